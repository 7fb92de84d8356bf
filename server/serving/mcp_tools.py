"""The agentic tools as MCP tools: JSON-RPC 2.0 over ``POST /mcp`` and the ``/ws`` ``mcp`` message.

The tools are :class:`server.agent_tools.StagingTools`' (the very methods the TRL tools run), so a
call answers the same text as in process. Their input schemas come from the methods' signatures and
Google-style docstrings (:func:`tool_schemas`).

Methods (``params`` is always an object):

=========================  ======================================================================
``initialize``             MCP's handshake: protocol version, ``capabilities.tools``, server info
``ping``                   ``{}``; a request without ``id`` (a notification) gets no answer
``tools/list``             ``{"tools": [{"name", "description", "inputSchema"}, ...]}``
``tools/call``             ``{"name", "arguments", "session_id"}`` (the session: over ``POST /mcp``;
                           over ``/ws`` the connection's episode) -> ``{"content": [{"type":
                           "text", "text"}], "isError": false, "data": text}``
``openenv/session/create`` OpenEnv's session call, here with the episode's optional ``task_id``,
                           ``seed``, ``force_decay``, ``non_compliance`` (as a reset) ->
                           ``{"session_id", "episode_id", "task_id", "seed", ...}``
``openenv/session/close``  ``{"session_id"}`` -> ``{"session_id", "closed": true}``
=========================  ======================================================================

Errors are JSON-RPC errors (HTTP 200; an oversized body 413 with a JSON-RPC error body), never a
500, and leave the session as it was: parse error -32700; not a request object, or a batch,
-32600; unknown method -32601; bad params or tool arguments, unknown tool or session -32602; a
tool the episode refuses in its state (finished, lost, at another stage) :data:`EPISODE_REFUSED`;
a server bug -32603 (logged). A tool's own refusal keeps its message, without the in-process
``"error: "`` prefix.
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
import types
import typing
import uuid
from collections import OrderedDict
from typing import Any

import orjson
from pydantic import ValidationError

from server.agent_tools import GROUP_KEYS, TOOL_NAMES, StagingTools
from server.clinical_profiles import STRATEGIES
from server.dental_constants import TOOTH_IDS
from server.dental_environment import StepwiseDentalEnvironment
from server.errors import UnknownEpisodeError
from server.serving.models import EpisodeResetRequest
from server.serving.serialization import decode_request, describe_validation_errors

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = "2025-06-18"
"""The MCP revision this endpoint speaks (a client's own is echoed back when it names one)."""
SERVER_INFO = {"name": "orthorl-aligner-staging", "version": "1.0.0"}

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS, INTERNAL_ERROR = (
    -32700,
    -32600,
    -32601,
    -32602,
    -32603,
)
EPISODE_REFUSED = -32000
"""JSON-RPC server-error code of a tool call the episode refuses in its state (finished, lost)."""

GROUP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "teeth": {"type": "array", "items": {"type": "integer", "enum": list(TOOTH_IDS)}, "minItems": 1},
        "fraction": {"type": "number", "minimum": 0.0, "maximum": 1.0},
    },
    "required": sorted(GROUP_KEYS),
    "additionalProperties": False,
}
"""One tooth group of a stage (:data:`server.agent_tools.GROUP_KEYS`)."""


class JsonRpcError(Exception):
    """A JSON-RPC error answer: ``code``, ``message`` and optional ``data``."""

    def __init__(self, code: int, message: str, data: Any = None):
        super().__init__(message)
        self.code, self.message, self.data = code, message, data


# --- Tool schemas ------------------------------------------------------------------------


def _docstring_parts(doc: str) -> tuple[str, dict[str, str], str]:
    """(summary, {argument: description}, returns) of a Google-style docstring."""
    lines = inspect.cleandoc(doc).splitlines()
    summary, args, returns, section, current = [], {}, [], "summary", None
    for line in lines:
        stripped = line.strip()
        if stripped in ("Args:", "Returns:"):
            section = stripped[:-1].lower()
            continue
        if section == "summary":
            summary.append(stripped)
        elif section == "args":
            match = re.match(r"^(\w+):\s*(.*)$", stripped) if not line.startswith("        ") else None
            if match:
                current = match.group(1)
                args[current] = match.group(2)
            elif current and stripped:
                args[current] += " " + stripped
        elif stripped:
            returns.append(stripped)
    return " ".join(s for s in summary if s), args, " ".join(returns)


def _json_type(annotation: Any, name: str) -> dict[str, Any]:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return _json_type(args[0], name)
    if annotation is int:
        return {"type": "integer"}
    if annotation is str:
        return {"type": "string", "enum": list(STRATEGIES)} if name == "strategy" else {"type": "string"}
    if typing.get_origin(annotation) is list:
        return {"type": "array", "items": GROUP_SCHEMA if name == "groups" else {}}
    raise TypeError(f"no JSON schema for {annotation!r} ({name})")


def tool_schema(name: str) -> dict[str, Any]:
    """MCP's ``{"name", "description", "inputSchema"}`` of one tool, from its method."""
    method = getattr(StagingTools, name)
    summary, described, returns = _docstring_parts(method.__doc__ or "")
    hints = typing.get_type_hints(method.__wrapped__)
    properties, required = {}, []
    for param in list(inspect.signature(method).parameters.values())[1:]:
        properties[param.name] = {
            **_json_type(hints[param.name], param.name),
            "description": described.get(param.name, ""),
        }
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    description = f"{summary} Returns {returns}" if returns else summary
    return {"name": name, "description": description, "inputSchema": schema}


def tool_schemas() -> list[dict[str, Any]]:
    """Every tool's MCP description, in :data:`server.agent_tools.TOOL_NAMES` order."""
    return [tool_schema(name) for name in TOOL_NAMES]


# --- Episodes behind the tools -------------------------------------------------------------


class ServerToolEpisode(StagingTools):
    """The tools on one episode of the server's shared store (the episode an MCP session or a
    WebSocket session holds)."""

    def __init__(self, store: StepwiseDentalEnvironment):
        super().__init__(store)

    def start(self, **params: Any) -> dict[str, Any]:
        """A new episode (reset parameters as ``POST /episodes``); what session create answers."""
        try:
            request = EpisodeResetRequest.model_validate(params)
        except ValidationError as exc:
            raise JsonRpcError(
                INVALID_PARAMS,
                "invalid episode parameters: " + describe_validation_errors(exc.errors()),
            ) from None
        obs = self._env.reset(**request.reset_kwargs())
        self.attach(obs)
        return {
            "episode_id": obs["episode_id"],
            **{k: obs[k] for k in ("task_id", "seed", "force_decay", "non_compliance")},
        }

    def attach(self, observation: dict[str, Any]) -> None:
        """Take over the episode of a stage-0 observation (its case the episode's own: an inline imported
        case has no key to generate it from)."""
        self._begin(observation, self._env.sessions.get(observation["episode_id"]).case)

    def release(self) -> None:
        if self._episode_id is not None:
            self._env.close_episode(self._episode_id)
        self._episode_id = None


class McpEndpoint:
    """The JSON-RPC handler: the HTTP sessions (``openenv/session/create``; at most
    ``max_sessions``, least recently used closed first) and the method table."""

    def __init__(self, store: StepwiseDentalEnvironment, max_sessions: int):
        self.store = store
        self.max_sessions = int(max_sessions)
        self._sessions: OrderedDict[str, ServerToolEpisode] = OrderedDict()
        self._lock = threading.Lock()
        self._tools = tool_schemas()

    def handle_bytes(self, body: bytes) -> bytes | None:
        """The JSON answer to a request body (None for a notification)."""
        try:
            request = decode_request(body)
        except ValueError as exc:
            return _encode(error_response(None, PARSE_ERROR, f"parse error: the body is not JSON ({exc})"))
        return _encode(self.handle(request))

    def handle(self, request: Any, episode: ServerToolEpisode | None = None) -> dict[str, Any] | None:
        """The answer to one decoded request; ``episode``: the WebSocket session's own (then no
        HTTP session is needed)."""
        request_id = request.get("id") if isinstance(request, dict) else None
        if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
            request_id = None
        try:
            method, params = _check_request(request)
        except JsonRpcError as exc:
            return error_response(request_id, exc.code, exc.message, exc.data)
        if "id" not in request:  # a notification (notifications/initialized, ...): no answer, no effect
            return None
        try:
            result = self._dispatch(method, params, episode)
        except JsonRpcError as exc:
            return error_response(request_id, exc.code, exc.message, exc.data)
        except Exception as exc:  # a server bug: logged, answered, the session goes on
            logger.exception("internal error in MCP %r", method)
            return error_response(request_id, INTERNAL_ERROR, f"internal error: {type(exc).__name__}")
        return {"jsonrpc": "2.0", "id": request_id, "result": result}

    def _dispatch(self, method: str, params: dict, episode: ServerToolEpisode | None) -> Any:
        if method == "initialize":
            version = params.get("protocolVersion")
            return {
                "protocolVersion": version if isinstance(version, str) else PROTOCOL_VERSION,
                "capabilities": {"tools": {"listChanged": False}},
                "serverInfo": SERVER_INFO,
            }
        if method == "ping":
            return {}
        if method == "tools/list":
            return {"tools": self._tools}
        if method == "tools/call":
            return self._call(params, episode)
        if method == "openenv/session/create":
            return self._create(params)
        if method == "openenv/session/close":
            return self._close(_session_id(params))
        raise JsonRpcError(
            METHOD_NOT_FOUND,
            f"method not found: {method[:60]!r}; use initialize, tools/list, tools/call, "
            "openenv/session/create or openenv/session/close",
        )

    def _create(self, params: dict) -> dict[str, Any]:
        episode = ServerToolEpisode(self.store)
        opened = episode.start(**{k: v for k, v in params.items() if k != "session_id"})
        session_id = uuid.uuid4().hex
        with self._lock:
            self._sessions[session_id] = episode
            while len(self._sessions) > self.max_sessions:
                _, oldest = self._sessions.popitem(last=False)
                oldest.release()
        return {"session_id": session_id, **opened}

    def _close(self, session_id: str) -> dict[str, Any]:
        with self._lock:
            episode = self._sessions.pop(session_id, None)
        if episode is None:
            raise JsonRpcError(INVALID_PARAMS, f"unknown session_id {session_id[:80]!r}")
        episode.release()
        return {"session_id": session_id, "closed": True}

    def _call(self, params: dict, episode: ServerToolEpisode | None) -> dict[str, Any]:
        name, arguments = params.get("name"), params.get("arguments", {})
        if not isinstance(name, str) or name not in TOOL_NAMES:
            raise JsonRpcError(
                INVALID_PARAMS, f"unknown tool {name!r:.60}: use one of {', '.join(TOOL_NAMES)} (tools/list)"
            )
        if not isinstance(arguments, dict):
            raise JsonRpcError(INVALID_PARAMS, f"arguments must be an object, got {type(arguments).__name__}")
        if episode is None:
            session_id = _session_id(params)
            with self._lock:
                episode = self._sessions.get(session_id)
                if episode is not None:
                    self._sessions.move_to_end(session_id)
            if episode is None:
                raise JsonRpcError(INVALID_PARAMS, f"unknown session_id {session_id[:80]!r}")
        if episode._episode_id is None:
            raise JsonRpcError(EPISODE_REFUSED, "this session has no episode: send a reset first")
        finished = episode.finished
        text = getattr(episode, name)(**arguments)
        if text.startswith("error: "):
            message = text[len("error: ") :]
            refused = finished or _episode_gone(episode)  # its state refuses it, not its arguments
            raise JsonRpcError(EPISODE_REFUSED if refused else INVALID_PARAMS, message, {"tool": name})
        return {"content": [{"type": "text", "text": text}], "isError": False, "data": text}


def _episode_gone(episode: ServerToolEpisode) -> bool:
    try:
        episode._env.state(episode._episode_id)
    except UnknownEpisodeError:
        return True
    return False


def _session_id(params: dict) -> str:
    session_id = params.get("session_id")
    if not isinstance(session_id, str) or not session_id:
        raise JsonRpcError(
            INVALID_PARAMS,
            "params.session_id is required: open a session with openenv/session/create (optional params "
            "task_id, seed, force_decay, non_compliance) and pass its session_id",
        )
    return session_id


def _check_request(request: Any) -> tuple[str, dict]:
    if isinstance(request, list):
        raise JsonRpcError(INVALID_REQUEST, "batch requests are not supported: send one request object")
    if not isinstance(request, dict):
        raise JsonRpcError(INVALID_REQUEST, f"a request is a JSON object, got {type(request).__name__}")
    if request.get("jsonrpc") != "2.0":
        raise JsonRpcError(INVALID_REQUEST, 'invalid request: "jsonrpc" must be "2.0"')
    method = request.get("method")
    if not isinstance(method, str):
        raise JsonRpcError(INVALID_REQUEST, 'invalid request: "method" must be a string')
    params = request.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise JsonRpcError(INVALID_PARAMS, f"params must be an object, got {type(params).__name__}")
    return method, params


def error_response(request_id: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message[:2000]}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": request_id, "error": error}


def _encode(answer: dict[str, Any] | None) -> bytes | None:
    return None if answer is None else orjson.dumps(answer)


def oversized_answer(message: str) -> bytes:
    """The JSON-RPC error body of a request over the message limit."""
    return orjson.dumps(error_response(None, INVALID_REQUEST, message))


__all__ = [
    "EPISODE_REFUSED",
    "PROTOCOL_VERSION",
    "JsonRpcError",
    "McpEndpoint",
    "ServerToolEpisode",
    "oversized_answer",
    "tool_schema",
    "tool_schemas",
]
