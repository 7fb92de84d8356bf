"""HTTP + WebSocket app of the aligner-staging environment.

Built on openenv-core's server (``create_fastapi_app``), so OpenEnv's own clients
(``EnvClient``, ``GenericEnvClient``, ``.sync()``) and :mod:`server.env_client` drive it
over the WebSocket ``/ws``: one session per connection, each holding one episode of the
shared :class:`~server.dental_environment.StepwiseDentalEnvironment` store at a time.

Routes
------
* ``WS /ws`` -- OpenEnv's reset / step / state / close messages, served by
  :mod:`server.serving.sessions` (it replaces openenv-core's handler: capacity with a
  readable refusal, idle reaping, an error reply for every bad frame, quiet closes).
* From openenv-core, kept as they are: ``POST /reset``, ``POST /step``, ``GET /state``
  (OpenEnv's *stateless* HTTP calls: ``/reset``'s episode is released at once, ``/step``
  has no episode and answers 409; use the episode routes for stateful HTTP), ``GET
  /health``, ``GET /schema``, ``GET /metadata``.
* ``POST /mcp`` -- the agentic tools as MCP tools (JSON-RPC 2.0: ``tools/list``, ``tools/call``,
  OpenEnv's ``openenv/session/create``/``close``), :mod:`server.serving.mcp_tools`; over the WebSocket,
  the ``mcp`` message on ``/ws``.

The project's own routes, keyed by ``episode_id``:

* ``GET /tasks``; ``GET /status`` (live WebSocket sessions and episodes, caps, counters)
* ``POST /episodes`` (body ``task_id``, ``seed``, ``force_decay``, ``non_compliance``) -> observation
* ``GET /episodes/{episode_id}`` -> current observation, no change
* ``DELETE /episodes/{episode_id}`` -> ``{"episode_id", "closed": true}``: releases the episode
* ``POST /episodes/{episode_id}/step`` (body ``poses`` 28x7, optional ``strategy`` and
  ``expected_stage``: the stage the step builds on; another stage -> 409, not applied)
* ``POST /episodes/{episode_id}/simulate`` (body ``poses``) -> observation, no change
* ``POST /episodes/{episode_id}/rollback[?expected_stage=k]`` -> observation (at most 2 per episode)
* ``POST /episodes/{episode_id}/collisions`` (optional body ``poses``; default the current stage)
* ``GET /episodes/{episode_id}/teeth/{tooth_id}`` (FDI id)
* ``POST /plans/score`` (body ``plan``, ``task_id``, ``seed``, ``force_decay``, ``non_compliance``)

Errors are JSON ``{"detail": ...}`` naming the problem: validation and refused actions 422;
unknown, closed, evicted or expired episodes 404 (``reason`` says which); a step for
another stage than ``expected_stage``, or without an episode, 409; bodies over the
message limit 413. Bad input never yields a 500, and a non-finite number in an output is
reported as a server error instead of being serialised as ``null``.

Speed: a trainer's calls (``POST /episodes``, ``POST /episodes/{episode_id}/step``, ``DELETE
/episodes/{episode_id}``) are answered by :class:`EpisodeFastPath` without FastAPI's request
machinery when they succeed (the same bytes; everything else is the routes' own answer), and
observations carry each case's constant fields encoded once
(:class:`server.serving.serialization.ObservationEncoder`).

Configuration: :class:`server.serving.settings.ServerSettings` (the ``ORTHORL_*`` variables:
WebSocket capacity 256, idle timeout 300 s, message limit 1 MB, episode cap 1024 and TTL
3600 s). The limits are enforced by the app itself, so they hold however it is launched.

Run: ``python -m server.app [--host H] [--port P] [--max-sessions N] ...`` or
``uvicorn server.app:app``. One worker process only: the episodes live in its memory, so
``--workers N`` (or ``WEB_CONCURRENCY``) above 1 is refused at start.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Annotated, Any

import orjson
from fastapi import Body, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError, ResponseValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import ConcurrencyConfig, EnvironmentMetadata
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import WebSocketRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.cases import TASK_DESCRIPTIONS
from server.dental_constants import N_STAGES, N_TEETH, TOOTH_IDS
from server.dental_environment import TASK_IDS, StepwiseDentalEnvironment
from server.errors import (
    InvalidActionError,
    NoEpisodeError,
    RequestRejectedError,
    StageConflictError,
    UnknownEpisodeError,
)
from server.json_values import NonFiniteOutputError
from server.serving.mcp_tools import INVALID_PARAMS, McpEndpoint, ServerToolEpisode, oversized_answer
from server.serving.models import (
    MAX_EPISODE_ID_CHARS,
    CollisionReport,
    CollisionsRequest,
    DentalAction,
    DentalObservation,
    DentalState,
    EpisodeClosed,
    EpisodeObservation,
    EpisodeResetRequest,
    ErrorResponse,
    PlanScore,
    PlanScoreRequest,
    PosesRequest,
    ResetParams,
    TasksResponse,
)
from server.serving.rubric import StagingRubric
from server.serving.serialization import (
    ObservationEncoder,
    decode_json_body,
    describe_validation_errors,
    encode_json,
    json_safe,
    safe_errors,
    short_repr,
    to_jsonable,
)
from server.serving.sessions import WebSocketSessions
from server.serving.settings import ENV_VARIABLES, WORKERS_VARIABLE, ServerSettings, SettingsError

logger = logging.getLogger(__name__)


# --- OpenEnv adapter ------------------------------------------------------------------

TOOL_ARGUMENTS: dict[str, frozenset[str]] = {
    "inspect_tooth": frozenset({"tooth_id"}),
    "simulate": frozenset({"poses", "strategy"}),
    "collisions": frozenset({"poses"}),
    "rollback": frozenset({"expected_stage"}),
    "terminal": frozenset(),
}
"""The WebSocket ``tool`` message's tools and their arguments (:meth:`DentalOpenEnvAdapter.tool_dict`)."""


class DentalOpenEnvAdapter(Environment[DentalAction, DentalObservation, DentalState]):
    """OpenEnv ``Environment`` over the shared episode store.

    One instance per WebSocket session (:mod:`server.serving.sessions`) and per stateless
    HTTP ``/reset``/``/step``/``/state`` call of openenv-core. ``reset`` creates an episode
    in the shared :class:`StepwiseDentalEnvironment` (releasing this session's previous
    one), ``step`` forwards the poses (and optional strategy and expected stage) to that
    episode, ``close`` releases it. Isolation: a session only ever touches the episode id
    its own reset returned. ``rubric`` is :class:`server.serving.rubric.StagingRubric` (the reward's
    parts, read from the observation). The ``*_observation`` methods return the environment's dict
    (the WebSocket path, no pydantic round trip); ``reset``/``step`` wrap it for OpenEnv.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, store: StepwiseDentalEnvironment, mcp: McpEndpoint | None = None):
        super().__init__(rubric=StagingRubric())
        self._store = store
        self._mcp = mcp
        self._episode_id: str | None = None
        self._tools: ServerToolEpisode | None = None  # the MCP tools on this episode, from their first call

    # reset kwargs come verbatim from the client (WebSocket data / HTTP body extras)
    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        **kwargs: Any,
    ) -> DentalObservation:
        if seed is not None:
            kwargs["seed"] = seed
        if episode_id is not None:
            kwargs["episode_id"] = episode_id
        return make_observation(self.reset_observation(**kwargs))

    def reset_observation(self, **data: Any) -> dict[str, Any]:
        """Start an episode from OpenEnv reset data; the stage-0 observation dict."""
        try:
            params = ResetParams.model_validate(data)
        except ValidationError as exc:
            raise RequestRejectedError(
                "invalid reset parameters: "
                + describe_validation_errors(exc.errors())
                + " (accepted: task_id, seed, force_decay, non_compliance, episode_id)"
            ) from None
        if params.episode_id is not None and params.episode_id != self._episode_id:
            self._refuse_live_episode_id(params.episode_id)
        obs = self._store.reset(
            task_id=params.task_id,
            seed=params.seed,
            force_decay=params.force_decay,
            episode_id=params.episode_id,
            non_compliance=params.non_compliance,
        )
        self._release()
        self._episode_id = obs["episode_id"]
        self._tools = None
        return obs

    def step(
        self,
        action: DentalAction,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> DentalObservation:
        observation = make_observation(self._step(action))
        observation.reward = self._apply_rubric(action, observation)  # the same sum, with its parts
        return observation

    def step_observation(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """Validate OpenEnv step data (a :class:`DentalAction`) and step; the observation dict."""
        if self._episode_id is None:  # before validation: the missing reset is the first thing to fix
            self._step(None)
        return self._step(DentalAction.model_validate(data))

    def _step(self, action: DentalAction | None) -> dict[str, Any]:
        if self._episode_id is None or action is None:
            raise NoEpisodeError(
                "this session has no episode: send a reset first (OpenEnv's HTTP /step is "
                "stateless; use the WebSocket /ws or POST /episodes/{episode_id}/step)"
            )
        return self._store.step(
            self._episode_id,
            action.poses_array(),
            strategy=action.strategy,
            expected_stage=action.expected_stage,
        )

    @property
    def state(self) -> DentalState:
        return DentalState.model_validate(self.state_dict())

    def tool_dict(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """One agentic tool on this session's episode (the WebSocket ``tool`` message):
        ``{"name": "inspect_tooth", "tooth_id"}``, ``{"name": "simulate", "poses", "strategy"?}``,
        ``{"name": "collisions", "poses"?}``, ``{"name": "rollback", "expected_stage"?}`` or
        ``{"name": "terminal"}`` (the finished episode's score, or null)."""
        if self._episode_id is None:
            raise NoEpisodeError("this session has no episode: send a reset first")
        if not isinstance(data, Mapping):
            raise RequestRejectedError('tool data must be an object {"name": ..., ...}')
        name, args = data.get("name"), {k: v for k, v in data.items() if k != "name"}
        allowed = TOOL_ARGUMENTS.get(name) if isinstance(name, str) else None
        if allowed is None:
            raise RequestRejectedError(f"unknown tool {name!r:.40}: use one of {', '.join(TOOL_ARGUMENTS)}")
        if set(args) - allowed:
            raise RequestRejectedError(
                f"tool {name} takes {sorted(allowed) or 'no arguments'}, got {sorted(args)}"
            )
        eid, store = self._episode_id, self._store
        if name == "inspect_tooth":
            return store.inspect_tooth(eid, args.get("tooth_id"))
        if name == "simulate":
            return store.simulate_step(eid, args.get("poses"), args.get("strategy"))
        if name == "collisions":
            return store.check_collisions(eid, args.get("poses"))
        if name == "rollback":
            return store.rollback_stage(eid, expected_stage=args.get("expected_stage"))
        session = store.sessions.get(eid)
        with session.lock:
            return {"terminal": session.terminal}

    def mcp_dict(self, data: Any) -> dict[str, Any] | None:
        """One JSON-RPC request to the agentic MCP tools on this session's episode (the WebSocket
        ``mcp`` message, :mod:`server.serving.mcp_tools`); the JSON-RPC answer. The tools take the episode
        over at their first call, which must come at stage 0 (before any ``step``): their stages
        are groups of teeth, a step's are poses."""
        if self._mcp is None:
            raise RequestRejectedError("this server has no MCP endpoint")
        if self._episode_id is not None and self._tools is None:
            obs = self._store.state(self._episode_id)
            if obs["current_stage"] == 0:
                self._tools = ServerToolEpisode(self._store)
                self._tools.attach(obs)
        if self._tools is None:
            self._tools = ServerToolEpisode(self._store)  # no episode: tools/list answers, a call is refused
        elif self._tools._episode_id != self._episode_id:
            raise RequestRejectedError(
                "the MCP tools hold stage 0 of the episode and this session stepped it with poses: "
                "reset, then use either the tools or step"
            )
        return self._mcp.handle(data, episode=self._tools)

    def tool_action_dict(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """OpenEnv's MCP step actions on this session's episode (what ``MCPToolClient`` sends over
        ``/ws`` by default): ``{"type": "list_tools"}`` or ``{"type": "call_tool", "tool_name",
        "arguments"}``, answered as OpenEnv's observation payload ``{"observation": {"tools"} |
        {"tool_name", "result", "error"}, "reward", "done"}``; ``reward`` is the episode's
        ``terminal_reward`` on the call that finishes it, else 0."""
        if data.get("type") == "list_tools":
            answer = self.mcp_dict({"jsonrpc": "2.0", "id": 0, "method": "tools/list"})
            return {
                "observation": {"tools": answer["result"]["tools"], "metadata": {}},
                "reward": 0.0,
                "done": False,
            }
        name = data.get("tool_name")
        request = {"name": name, "arguments": data.get("arguments", {})}
        answer = self.mcp_dict({"jsonrpc": "2.0", "id": 0, "method": "tools/call", "params": request})
        tools = self._tools
        done = tools is not None and tools.finished
        observation: dict[str, Any] = {
            "tool_name": name,
            "result": answer.get("result"),
            "error": None,
            "metadata": {},
        }
        if "error" in answer:
            code, message = answer["error"]["code"], answer["error"]["message"]
            unknown = message.startswith("unknown tool")
            kind = (
                "tool_not_found"
                if unknown
                else "invalid_args"
                if code == INVALID_PARAMS
                else "execution_error"
            )
            observation["error"] = {"error_type": kind, "message": message}
        finished_now = done and "error" not in answer and tools.result is not None
        reward = float(tools.result["terminal_reward"]) if finished_now else 0.0
        return {"observation": observation, "reward": reward, "done": done}

    def state_dict(self) -> dict[str, Any]:
        """OpenEnv state of this session (its current episode) as a dict."""
        if self._episode_id is None:
            return DentalState().model_dump()
        obs = self._store.state(self._episode_id)
        return {
            "episode_id": obs["episode_id"],
            "step_count": int(obs["current_stage"]),
            "task_id": obs["task_id"],
            "seed": int(obs["seed"]),
            "force_decay": bool(obs["force_decay"]),
            "non_compliance": bool(obs["non_compliance"]),
            "current_stage": int(obs["current_stage"]),
            "done": bool(obs["done"]),
        }

    @property
    def episode_id(self) -> str | None:
        return self._episode_id

    def _refuse_live_episode_id(self, episode_id: str) -> None:
        """A client-chosen id may not replace another session's live episode."""
        try:
            self._store.state(episode_id)
        except UnknownEpisodeError:
            return
        raise RequestRejectedError(
            f"episode_id {episode_id!r:.80} belongs to a live episode: omit episode_id or choose another"
        )

    def _release(self) -> None:
        episode_id, self._episode_id = self._episode_id, None
        self._tools = None
        if episode_id is None:
            return
        self._store.close_episode(episode_id)

    def close(self) -> None:
        self._release()

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name="OrthoRL aligner staging",
            description=(
                "Stepwise clear-aligner staging: 28 teeth, 24 stages; each step sends the "
                "next stage's 28x7 poses [qw,qx,qy,qz,tx,ty,tz]."
            ),
            version="1.0.0",
        )


def make_observation(obs: dict[str, Any]) -> DentalObservation:
    """OpenEnv observation from the environment's dict; ``reward`` is ``step_reward`` plus,
    on the last stage, ``terminal_reward``."""
    clean = to_jsonable(obs, "observation")
    reward = float(clean.get("step_reward", 0.0))
    if clean.get("done") and clean.get("terminal_reward") is not None:
        reward += float(clean["terminal_reward"])
    return DentalObservation.model_validate({**clean, "reward": reward})


# --- Message size limit ---------------------------------------------------------------


class BodyLimitMiddleware:
    """Refuses HTTP request bodies above ``max_body_bytes`` with 413: from ``Content-Length``
    before reading, and while reading (chunked bodies). (WebSocket frames: the same limit,
    in :mod:`server.serving.sessions`.)"""

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = int(max_body_bytes)

    def _too_large(self, size: str) -> str:
        return (
            f"request body too large: {size} exceeds the limit of {self.max_body_bytes} bytes "
            f"(the server sets it with {ENV_VARIABLES['max_message_bytes']})"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > limit:
                    message = self._too_large(f"Content-Length {declared}")
                    response = (
                        Response(oversized_answer(message), status_code=413, media_type="application/json")
                        if scope.get("path") == "/mcp"  # a JSON-RPC error, as the endpoint's others
                        else JSONResponse({"detail": message}, status_code=413)
                    )
                    await response(scope, receive, send)
                    return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise StarletteHTTPException(
                        status_code=413, detail=self._too_large(f"at least {received} bytes")
                    )
            return message

        await self.app(scope, limited_receive, send)


EpisodeIdPath = Annotated[
    str, Path(min_length=1, max_length=MAX_EPISODE_ID_CHARS, description="id from POST /episodes")
]
ToothIdPath = Annotated[int, Path(ge=11, le=48, description="FDI id, e.g. 11")]
ExpectedStageQuery = Annotated[
    int | None,
    Query(ge=0, le=N_STAGES, description="the stage the episode must be at (else 409, not applied)"),
]


# --- App ------------------------------------------------------------------------------

ENCODED_CASES = 256
"""Cases whose constant observation fields the app keeps encoded (least recently used dropped
first; about 8 kB each)."""


def _error(status_code: int, detail: Any, **extra: Any) -> JSONResponse:
    return JSONResponse({"detail": json_safe(detail), **json_safe(extra)}, status_code=status_code)


def _server_error(path: str, exc: Exception) -> JSONResponse:
    """The 500 of a server bug (bad input never gets here), logged; JSON so clients can show
    the reason. A non-finite number in an output is named as such."""
    if isinstance(exc, NonFiniteOutputError):
        logger.error("non-finite output on %s: %s", path, exc)
        return _error(500, f"internal error: {exc}")
    logger.error("internal error on %s", path, exc_info=exc)
    return _error(500, f"internal error: {type(exc).__name__}: {short_repr(str(exc))}")


class FastJSONRequest(Request):
    """A request whose JSON body is parsed by :func:`server.serving.serialization.decode_json_body`."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = decode_json_body(await self.body())
        return self._json


class FastJSONRoute(APIRoute):
    """FastAPI route whose handler sees :class:`FastJSONRequest` (FastAPI's custom-request
    pattern): the body of a step is parsed about ten times faster than by ``json.loads``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def fast_json_handler(request: Request) -> Response:
            return await handler(FastJSONRequest(request.scope, request.receive))

        return fast_json_handler


class JSONBytesResponse(Response):
    """A JSON response encoded by :func:`server.serving.serialization.encode_json` (orjson, NaN refused)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return encode_json(content)


_REFUSED_BEFORE_APPLYING = (
    InvalidActionError,
    NoEpisodeError,
    RequestRejectedError,
    StageConflictError,
    UnknownEpisodeError,
)
"""What ``StepwiseDentalEnvironment.step`` and ``.reset`` raise before they change anything."""


class EpisodeFastPath:
    """The episode routes a trainer calls every step, without FastAPI's request machinery:
    ``POST /episodes`` (reset), ``POST /episodes/{episode_id}/step`` and ``DELETE
    /episodes/{episode_id}``.

    Routing through FastAPI's middleware stack and dependency solving cost more server time
    than the environment's step itself. This answers such a request here when its body is
    declared (``Content-Length``, none for DELETE) within the message limit and is JSON
    (``application/json`` or no content type) that the route's model validates (pydantic, as
    the route does), and the store does what is asked: 200 with the bytes the route would send
    (observations by :class:`server.serving.serialization.ObservationEncoder`), or for a server bug the
    app's own 500. Any other request goes on to the app with its body, and so does one the
    store refuses (it has changed nothing; the app then refuses it again, with its status and
    words): every answer but a success is the app's. The routes stay the app's, in its OpenAPI.
    """

    def __init__(
        self, app: ASGIApp, store: StepwiseDentalEnvironment, encoder: ObservationEncoder, max_body_bytes: int
    ):
        self.app = app
        self.store = store
        self.encoder = encoder
        self.max_body_bytes = int(max_body_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._route(scope)
        if route is None:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if size > self.max_body_bytes or not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        response = None
        if size <= self.max_body_bytes:
            response = self._answer(route[0], route[1], body, scope["path"])
        await (self.app if response is None else response)(scope, replay, send)

    def _route(self, scope: Scope) -> tuple[str, str] | None:
        """``(what, episode_id)`` of a request this path may answer ("reset", "step" or
        "close"; the id empty for a reset); None for anything else."""
        if scope["type"] != "http" or scope.get("root_path"):
            return None
        method, path = scope["method"], scope["path"]
        if method == "POST" and path.endswith("/step") and path.startswith("/episodes/"):
            what, episode_id = "step", path[10:-5]
        elif method == "POST" and path == "/episodes":
            what, episode_id = "reset", ""
        elif method == "DELETE" and path.startswith("/episodes/"):
            what, episode_id = "close", path[10:]
        else:
            return None
        if what != "reset" and (not 0 < len(episode_id) <= MAX_EPISODE_ID_CHARS or "/" in episode_id):
            return None
        length = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"content-type":
                if value.lower() != b"application/json":
                    return None
            elif name == b"transfer-encoding":
                return None
        if what == "close":  # no body
            return (what, episode_id) if length in (None, b"0") else None
        if length is None or not length.isdigit() or int(length) > self.max_body_bytes:
            return None
        return what, episode_id

    def _answer(self, what: str, episode_id: str, body: bytes, path: str) -> Response | None:
        """The response to a request done here, or None (the app answers)."""
        if what == "close":
            if not self.store.close_episode(episode_id):
                return None  # the app's 404 says why it is gone
            return Response(
                encode_json({"episode_id": episode_id, "closed": True}), media_type="application/json"
            )
        try:
            data = orjson.loads(body) if body or what == "step" else {}
            if what == "reset":
                params = EpisodeResetRequest.model_validate(data)
            else:
                action = DentalAction.model_validate(data)
        except (orjson.JSONDecodeError, ValidationError):
            return None
        try:
            if what == "reset":
                obs = self.store.reset(
                    task_id=params.task_id,
                    seed=params.seed,
                    force_decay=params.force_decay,
                    non_compliance=params.non_compliance,
                )
            else:
                obs = self.store.step(
                    episode_id,
                    action.poses_array(),
                    strategy=action.strategy,
                    expected_stage=action.expected_stage,
                )
        except _REFUSED_BEFORE_APPLYING:
            return None
        except Exception as exc:  # a server bug, after the store may have changed: answered here
            return _server_error(path, exc)
        try:
            return Response(self.encoder.encode(obs), media_type="application/json")
        except Exception as exc:
            return _server_error(path, exc)


def install_exception_handlers(app: FastAPI) -> None:
    """JSON-safe handlers: a bad request gets a 4xx naming the problem, never a 500."""

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        return _error(422, describe_validation_errors(errors), errors=safe_errors(errors))

    @app.exception_handler(ValidationError)
    async def _pydantic_validation(request: Request, exc: ValidationError) -> JSONResponse:
        errors = exc.errors()
        return _error(422, describe_validation_errors(errors), errors=safe_errors(errors))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail
        cause = exc.__cause__
        if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError):
            # FastAPI answers undecodable bodies with a bare 400 "error parsing the body"
            return _error(
                422, f"body is not valid JSON: not UTF-8 text ({cause.reason} at byte {cause.start})"
            )
        if isinstance(detail, list) and detail and all(isinstance(e, dict) and "loc" in e for e in detail):
            # openenv's /step raises HTTPException(422, detail=ValidationError.errors())
            return _error(exc.status_code, describe_validation_errors(detail), errors=safe_errors(detail))
        return JSONResponse(
            {"detail": json_safe(detail)}, status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(InvalidActionError)
    async def _invalid_action(request: Request, exc: InvalidActionError) -> JSONResponse:
        return _error(422, str(exc))

    @app.exception_handler(RequestRejectedError)
    async def _rejected(request: Request, exc: RequestRejectedError) -> JSONResponse:
        return _error(422, str(exc))

    @app.exception_handler(UnknownEpisodeError)
    async def _unknown_episode(request: Request, exc: UnknownEpisodeError) -> JSONResponse:
        return _error(404, str(exc), reason=exc.reason)

    @app.exception_handler(StageConflictError)
    async def _stage_conflict(request: Request, exc: StageConflictError) -> JSONResponse:
        return _error(409, str(exc), current_stage=exc.current_stage)

    @app.exception_handler(NoEpisodeError)
    async def _no_episode(request: Request, exc: NoEpisodeError) -> JSONResponse:
        return _error(409, str(exc))

    @app.exception_handler(NonFiniteOutputError)
    async def _non_finite(request: Request, exc: NonFiniteOutputError) -> JSONResponse:
        return _server_error(request.url.path, exc)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return _server_error(request.url.path, exc)

    @app.exception_handler(ResponseValidationError)
    async def _bad_response(request: Request, exc: ResponseValidationError) -> JSONResponse:
        logger.error("invalid response on %s: %s", request.url.path, exc)
        return _error(500, "internal error: the server produced an invalid response: " + str(exc)[:500])


def _patch_openapi(app: FastAPI) -> None:
    """Point OpenEnv's ``/step`` action (a bare object in openenv-core) and ``/reset`` body at
    the real schemas, so fuzzers and clients see the action's shape."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        schema = original()
        if schema.get("x-orthorl-patched"):
            return schema
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        action_schema = DentalAction.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in action_schema.pop("$defs", {}).items():
            components.setdefault(name, sub)
        action_name = next((n for n in ("DentalAction", "DentalAction-Input") if n in components), None)
        if action_name is None:
            action_name = "DentalAction"
            components[action_name] = action_schema
        step_request = components.get("StepRequest")
        if step_request is not None:
            step_request["properties"]["action"] = {
                "$ref": f"#/components/schemas/{action_name}",
                "description": "the next stage's 28x7 poses and optional strategy",
            }
        reset_request = components.get("ResetRequest")
        if reset_request is not None:
            params = ResetParams.model_json_schema(ref_template="#/components/schemas/{model}")
            props = params["properties"]
            reset_request["properties"] = {**reset_request.get("properties", {}), **props}
            reset_request["additionalProperties"] = False
        schema["x-orthorl-patched"] = True
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(
    settings: ServerSettings | None = None, store: StepwiseDentalEnvironment | None = None
) -> FastAPI:
    """The FastAPI app: openenv-core's server, this project's ``/ws`` and the episode routes.

    ``settings`` default to :meth:`ServerSettings.from_env`; ``store`` to a new store with
    the settings' episode cap and TTL.
    """
    settings = ServerSettings.from_env() if settings is None else settings
    if store is None:
        store = StepwiseDentalEnvironment(
            max_sessions=settings.max_episodes, ttl_seconds=settings.episode_ttl_s
        )
    mcp = McpEndpoint(store, max_sessions=settings.max_sessions)
    env_factory = functools.partial(DentalOpenEnvAdapter, store, mcp)
    app = create_fastapi_app(
        env_factory,
        DentalAction,
        DentalObservation,
        concurrency_config=ConcurrencyConfig(max_concurrent_envs=settings.max_sessions, session_timeout=None),
    )
    app.title = "OrthoRL aligner-staging environment"
    app.description = (__doc__ or "").split("Configuration:")[0]
    app.state.store = store
    app.state.settings = settings
    # the JSON of observations (WebSocket and HTTP), each case's constant fields encoded once
    encoder = ObservationEncoder(max_cases=ENCODED_CASES)
    app.state.observation_encoder = encoder
    sessions = WebSocketSessions(env_factory, settings, encoder)
    app.state.websocket_sessions = sessions
    _replace_websocket_route(app, "/ws", sessions.endpoint)
    app.state.mcp = mcp
    _replace_mcp_routes(app, mcp)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_message_bytes)
    # outside the body limit: it reads only bodies declared within the limit, passes others on
    app.add_middleware(
        EpisodeFastPath, store=store, encoder=encoder, max_body_bytes=settings.max_message_bytes
    )
    install_exception_handlers(app)

    existing = {getattr(r, "path", None) for r in app.routes}
    n_openenv_routes = len(app.router.routes)
    app.router.route_class = FastJSONRoute
    errors = {
        404: {"model": ErrorResponse, "description": "unknown, closed, evicted or expired episode"},
        409: {"model": ErrorResponse, "description": "the episode is not at expected_stage: not applied"},
        422: {"model": ErrorResponse, "description": "invalid request or refused action"},
    }

    # The episode routes are ``async``: they run in the event loop (a step is well under a
    # millisecond; a thread hop per request costs more than it saves on one core).
    def respond(obj: Any) -> JSONBytesResponse:
        return JSONBytesResponse(obj)

    def observe(obs: dict[str, Any]) -> Response:
        return Response(encoder.encode(obs), media_type="application/json")

    if "/tasks" not in existing:

        @app.get("/tasks", response_model=TasksResponse, tags=["Episodes"], summary="Task levels")
        async def list_tasks() -> JSONBytesResponse:
            return respond(
                {
                    "tasks": [{"task_id": t, "description": TASK_DESCRIPTIONS[t]} for t in TASK_IDS],
                    "n_stages": N_STAGES,
                    "n_teeth": N_TEETH,
                    "tooth_ids": list(TOOTH_IDS),
                }
            )

    @app.get("/status", tags=["Server"], summary="Live sessions and episodes, limits and counters")
    async def server_status() -> JSONBytesResponse:
        return respond(
            {
                "websocket_sessions": sessions.status(),
                "episodes": {
                    "live": len(store.sessions),
                    "max_episodes": store.sessions.max_sessions,
                    "ttl_s": store.sessions.ttl_seconds,
                },
                "max_message_bytes": settings.max_message_bytes,
            }
        )

    @app.post(
        "/episodes",
        response_model=EpisodeObservation,
        responses={422: errors[422]},
        tags=["Episodes"],
        summary="Start an episode (reset)",
    )
    async def create_episode(
        request: Annotated[EpisodeResetRequest, Body(default_factory=EpisodeResetRequest)],
    ) -> Response:
        return observe(
            store.reset(
                task_id=request.task_id,
                seed=request.seed,
                force_decay=request.force_decay,
                non_compliance=request.non_compliance,
            )
        )

    @app.get(
        "/episodes/{episode_id}",
        response_model=EpisodeObservation,
        responses={404: errors[404], 422: errors[422]},
        tags=["Episodes"],
        summary="Current observation",
    )
    async def get_episode(episode_id: EpisodeIdPath) -> Response:
        return observe(store.state(episode_id))

    @app.delete(
        "/episodes/{episode_id}",
        response_model=EpisodeClosed,
        responses={404: errors[404], 422: errors[422]},
        tags=["Episodes"],
        summary="Close an episode (release it now)",
    )
    async def close_episode(episode_id: EpisodeIdPath) -> JSONBytesResponse:
        if not store.close_episode(episode_id):
            store.state(episode_id)  # raises the 404 that says why it is gone
        return respond({"episode_id": episode_id, "closed": True})

    @app.post(
        "/episodes/{episode_id}/step",
        response_model=EpisodeObservation,
        responses=errors,
        tags=["Episodes"],
        summary="Commit the next stage",
    )
    async def step_episode(episode_id: EpisodeIdPath, action: DentalAction) -> Response:
        # a well-formed step that the environment applies is answered by EpisodeFastPath
        return observe(
            store.step(
                episode_id,
                action.poses_array(),
                strategy=action.strategy,
                expected_stage=action.expected_stage,
            )
        )

    @app.post(
        "/episodes/{episode_id}/simulate",
        response_model=EpisodeObservation,
        responses={404: errors[404], 422: errors[422]},
        tags=["Episodes"],
        summary="Simulate the next stage without committing it",
    )
    async def simulate_episode(episode_id: EpisodeIdPath, request: PosesRequest) -> Response:
        return observe(store.simulate_step(episode_id, request.poses))

    @app.post(
        "/episodes/{episode_id}/rollback",
        response_model=EpisodeObservation,
        responses=errors,
        tags=["Episodes"],
        summary="Undo the last stage (at most 2 per episode)",
    )
    async def rollback_episode(
        episode_id: EpisodeIdPath, expected_stage: ExpectedStageQuery = None
    ) -> Response:
        return observe(store.rollback_stage(episode_id, expected_stage=expected_stage))

    @app.post(
        "/episodes/{episode_id}/collisions",
        response_model=CollisionReport,
        responses={404: errors[404], 422: errors[422]},
        tags=["Episodes"],
        summary="Adjacent-tooth collisions of the given poses (default: the current stage)",
    )
    async def episode_collisions(
        episode_id: EpisodeIdPath,
        request: Annotated[CollisionsRequest | None, Body()] = None,
    ) -> JSONBytesResponse:
        poses = request.poses if request is not None else None
        return respond(store.check_collisions(episode_id, poses))

    @app.get(
        "/episodes/{episode_id}/teeth/{tooth_id}",
        responses={404: errors[404], 422: errors[422]},
        tags=["Episodes"],
        summary="Inspect one tooth (FDI id)",
    )
    async def inspect_tooth(episode_id: EpisodeIdPath, tooth_id: ToothIdPath) -> JSONBytesResponse:
        return respond(store.inspect_tooth(episode_id, tooth_id))

    @app.post(
        "/plans/score",
        response_model=PlanScore,
        responses={422: errors[422]},
        tags=["Plans"],
        summary="Score a whole treatment plan as one episode",
    )
    async def score_plan(request: PlanScoreRequest) -> JSONBytesResponse:
        return respond(
            store.score_plan(
                request.plan,
                task_id=request.task_id,
                seed=request.seed,
                force_decay=request.force_decay,
                non_compliance=request.non_compliance,
            )
        )

    # this project's routes first: a request matches its route without scanning openenv-core's
    # (their paths differ, so no route shadows another)
    routes = app.router.routes
    routes[:] = routes[n_openenv_routes:] + routes[:n_openenv_routes]
    _patch_openapi(app)
    return app


def build_app(store: StepwiseDentalEnvironment | None = None, **overrides: Any) -> FastAPI:
    """:func:`create_app` with settings from the environment, overridden by keyword
    (``max_sessions=4``, ``ws_idle_timeout_s=0.5``...; ``max_body_bytes`` is
    ``max_message_bytes``)."""
    if "max_body_bytes" in overrides:
        overrides["max_message_bytes"] = overrides.pop("max_body_bytes")
    return create_app(ServerSettings.from_env(**overrides), store)


def _replace_mcp_routes(app: FastAPI, mcp: McpEndpoint) -> None:
    """``POST /mcp`` answered by :class:`server.serving.mcp_tools.McpEndpoint` instead of openenv-core's
    (whose environments need a FastMCP server); openenv-core's ``WS /mcp`` goes (MCP over the
    WebSocket is the ``mcp`` message on ``/ws``, on the session's own episode)."""
    routes = app.router.routes
    routes[:] = [
        r
        for r in routes
        if getattr(r, "path", None) != "/mcp"
        or not (isinstance(r, WebSocketRoute) or "POST" in (getattr(r, "methods", None) or ()))
    ]

    async def mcp_endpoint(request: Request) -> Response:
        answer = mcp.handle_bytes(await request.body())
        if answer is None:  # a notification
            return Response(status_code=202)
        return Response(answer, media_type="application/json")

    app.add_api_route(
        "/mcp",
        mcp_endpoint,
        methods=["POST"],
        tags=["MCP"],
        summary="MCP JSON-RPC: the agentic tools (tools/list, tools/call) and OpenEnv's sessions",
        response_class=Response,
    )


def _replace_websocket_route(app: FastAPI, path: str, endpoint: Any) -> None:
    """Swap openenv-core's WebSocket route at ``path`` for ``endpoint`` (first match wins, so
    it takes the old one's place)."""
    routes = app.router.routes
    for i, route in enumerate(routes):
        if isinstance(route, WebSocketRoute) and route.path == path:
            routes[i] = WebSocketRoute(path, endpoint, name=route.name)
            return
        if getattr(route, "path", None) == path and not hasattr(route, "methods"):
            routes[i] = WebSocketRoute(path, endpoint, name=getattr(route, "name", None))
            return
    app.router.routes.append(WebSocketRoute(path, endpoint))


# --- Start ----------------------------------------------------------------------------


def requested_workers(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """The worker processes a uvicorn/gunicorn command line (or ``WEB_CONCURRENCY``) asks for.

    A uvicorn worker is a spawned process whose ``sys.argv`` is its parent's, so each worker
    sees the ``--workers`` it was started with.
    """
    count = environ.get(WORKERS_VARIABLE, "")
    args = list(argv[1:])
    flags = ("--workers", "-w") if "gunicorn" in os.path.basename(argv[0] if argv else "") else ("--workers",)
    for i, arg in enumerate(args):
        if arg in flags and i + 1 < len(args):
            count = args[i + 1]
        elif arg.startswith("--workers="):
            count = arg.split("=", 1)[1]
    try:
        return max(int(count), 1) if count else 1
    except ValueError:
        return 1


def refuse_several_workers(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> None:
    """Exit (uvicorn's start-failure status 3, which stops its supervisor) when several worker
    processes are asked for: episodes live in one process's memory, so a request landing on
    another worker would find none."""
    argv = sys.argv if argv is None else argv
    environ = os.environ if environ is None else environ
    workers = requested_workers(argv, environ)
    if workers <= 1:
        return
    message = (
        f"refusing to start with {workers} worker processes: the environment keeps its episodes in "
        "one process's memory, so requests landing on another worker would get 404. Run one worker "
        f"(drop --workers / unset {WORKERS_VARIABLE}) and raise its capacity with "
        f"{ENV_VARIABLES['max_sessions']}, or run several servers on separate ports, each client "
        "keeping to one."
    )
    logger.critical(message)  # no handler configured yet: Python's last-resort handler writes it to stderr
    raise SystemExit(3)  # uvicorn.config.STARTUP_FAILURE: the supervisor stops instead of restarting


def main(argv: list[str] | None = None) -> None:
    """``python -m server.app``: serve the app with uvicorn (flags override ``ORTHORL_*``)."""
    import uvicorn

    parser = argparse.ArgumentParser(description="OrthoRL environment server (one process)")
    parser.add_argument("--host", default=None, help="default ORTHORL_HOST or 127.0.0.1")
    parser.add_argument("--port", type=int, default=None, help="default ORTHORL_PORT or 8000")
    parser.add_argument("--max-sessions", type=int, default=None, help="concurrent WebSocket sessions (256)")
    parser.add_argument(
        "--max-message-bytes", type=int, default=None, help="HTTP body / WebSocket frame limit"
    )
    parser.add_argument("--ws-idle-timeout-s", type=float, default=None, help="close silent sessions (300)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    try:
        settings = ServerSettings.from_env(
            host=args.host,
            port=args.port,
            max_sessions=args.max_sessions,
            max_message_bytes=args.max_message_bytes,
            ws_idle_timeout_s=args.ws_idle_timeout_s,
        )
    except SettingsError as exc:
        parser.error(str(exc))
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        # frames up to 4x the app's limit get its readable error reply; larger ones close with 1009
        ws_max_size=4 * settings.max_message_bytes,
        ws_ping_interval=settings.ws_ping_interval_s,
        ws_ping_timeout=settings.ws_ping_timeout_s,
        # per-message deflate costs the server about 0.5 ms of CPU per 14 kB observation, for
        # bandwidth a loopback or cluster network does not need
        ws_per_message_deflate=False,
    )


_default_app: FastAPI | None = None


def __getattr__(name: str) -> Any:
    """``server.app:app`` is built on first access (so importing this module is cheap); a
    command line asking for several workers is refused here, in each worker."""
    global _default_app
    if name == "app":
        if _default_app is None:
            refuse_several_workers()
            _default_app = create_app()
        return _default_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    main()
