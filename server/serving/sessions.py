"""OpenEnv's WebSocket ``/ws`` for the environment: one session (one environment adapter, one
episode at a time) per connection, speaking OpenEnv's protocol, so its clients
(``EnvClient``, ``GenericEnvClient``, ``.sync()``) and :mod:`orthojob.agentic.env_client` drive it.

Protocol (JSON text frames): the client sends ``{"type": "reset" | "step" | "state" |
"close", "data": {...}}``; the server answers each with ``{"type": "observation", "data":
{"observation", "reward", "done"}}``, ``{"type": "state", "data": {...}}`` or ``{"type":
"error", "data": {"message", "code"}}``. ``close`` ends the session. Beyond OpenEnv's four, a
``{"type": "tool", "data": {"name": ..., ...}}`` message runs one of the agentic tools on the
session's own episode (inspect_tooth, simulate, collisions, rollback, terminal; answered
``{"type": "tool", "data": {...}}``), so an agentic rollout needs one connection only; and OpenEnv's
``{"type": "mcp", "data": <JSON-RPC request>}`` calls the agentic MCP tools on that episode
(answered ``{"type": "mcp", "data": <JSON-RPC response>}``, :mod:`server.serving.mcp_tools`), as do
OpenEnv's MCP step actions (``{"type": "step", "data": {"type": "call_tool", ...}}``, what its
``MCPToolClient`` sends), answered as an observation.

What this adds to openenv-core 0.3.0's own ``/ws`` (which it replaces):

* **Capacity with a readable refusal.** At most ``max_sessions`` live sessions; the count
  is taken before ``accept`` and given back when the handler ends, so it never exceeds
  the cap. A connection over the cap is accepted, sent ``CAPACITY_REACHED`` (naming the
  cap and the variable that raises it), and closed with 1013 (try again later) only after
  its first message or :data:`~server.serving.settings.CAPACITY_REFUSAL_WAIT_S`: OpenEnv's client
  sends its reset, then reads the refusal instead of a bare "connection closed".
* **Idle and frozen sessions are reaped.** A session with no message from its client for
  ``ws_idle_timeout_s`` (idle, frozen, or gone without a close) is sent ``IDLE_TIMEOUT``,
  closed (1001) and uncounted; its episode is released.
* **A bad frame never ends a session.** Binary frames, frames over ``max_message_bytes``,
  non-JSON, JSON that is not a message object (``[1,2]``, ``null``), deep nesting and
  invalid data all get an error reply; the session and its episode stay as they were.
* **Quiet closes.** A clean or abrupt close is not an error: nothing is logged above debug.
* **Speed.** Messages are handled in the event loop (no thread hop: a step is a fraction
  of a millisecond); observations are encoded by the app's
  :class:`server.serving.serialization.ObservationEncoder` (each case's constant fields once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from server.errors import (
    InvalidActionError,
    NoEpisodeError,
    RequestRejectedError,
    StageConflictError,
    UnknownEpisodeError,
)
from server.json_values import NonFiniteOutputError
from server.serving.serialization import (
    MessageError,
    ObservationEncoder,
    decode_message,
    describe_validation_errors,
    encode_json,
    error_frame,
)
from server.serving.settings import (
    CAPACITY_REFUSAL_WAIT_S,
    ENV_VARIABLES,
    MAX_PENDING_REFUSALS,
    ServerSettings,
)

logger = logging.getLogger(__name__)

TOOL_ACTIONS = ("list_tools", "call_tool")
"""The ``type`` of OpenEnv's MCP step actions (``ListToolsAction``, ``CallToolAction``)."""

CLOSE_GOING_AWAY = 1001
"""Close code of a reaped (idle) session."""
CLOSE_TRY_AGAIN_LATER = 1013
"""Close code of a refusal at capacity."""


@dataclass
class SessionCounters:
    """What the WebSocket endpoint has done since start (``GET /status``)."""

    accepted: int = 0
    refused_at_capacity: int = 0
    reaped_idle: int = 0
    bad_messages: int = 0
    closed: int = 0


@dataclass
class _Connection:
    opened_at: float
    last_message_at: float = field(default=0.0)


class WebSocketSessions:
    """The ``/ws`` endpoint and the registry of its live sessions.

    ``env_factory()`` makes one session's environment: an object with ``reset_observation
    (**data) -> dict``, ``step_observation(data: dict) -> dict``, ``state_dict() -> dict`` and
    ``close()`` (:class:`server.serving.adapter.DentalOpenEnvAdapter`). Refused requests raise
    ``ValueError``/``ValidationError`` subclasses, answered as error replies.
    """

    def __init__(
        self,
        env_factory: Callable[[], Any],
        settings: ServerSettings,
        encoder: ObservationEncoder | None = None,
    ):
        self._env_factory = env_factory
        self.encoder = ObservationEncoder() if encoder is None else encoder
        self.max_sessions = settings.max_sessions
        self.idle_timeout_s = settings.ws_idle_timeout_s
        self.max_message_bytes = settings.max_message_bytes
        self._live: dict[int, _Connection] = {}
        self._pending_refusals = 0
        self.counters = SessionCounters()

    @property
    def live(self) -> int:
        """Sessions holding a slot now (never more than ``max_sessions``)."""
        return len(self._live)

    def status(self) -> dict[str, Any]:
        """Live count, cap, timeouts and counters, for ``GET /status``."""
        return {
            "live": self.live,
            "max_sessions": self.max_sessions,
            "idle_timeout_s": self.idle_timeout_s,
            "max_message_bytes": self.max_message_bytes,
            **vars(self.counters),
        }

    async def endpoint(self, websocket: WebSocket) -> None:
        """The ASGI WebSocket handler of ``/ws``."""
        if len(self._live) >= self.max_sessions:  # count and take the slot with no await between
            await self._refuse(websocket)
            return
        key = id(websocket)
        now = time.monotonic()
        self._live[key] = _Connection(opened_at=now, last_message_at=now)
        env = None
        try:
            env = self._env_factory()
            await websocket.accept()
            self.counters.accepted += 1
            await self._serve(websocket, env)
        except (WebSocketDisconnect, OSError):  # the client went away (abruptly or not): not an error
            pass
        finally:
            del self._live[key]
            self.counters.closed += 1
            if env is not None:
                env.close()
            await _close_quietly(websocket, 1000, "")

    async def _serve(self, websocket: WebSocket, env: Any) -> None:
        while True:
            try:
                async with asyncio.timeout(self.idle_timeout_s):
                    message = await websocket.receive()
            except TimeoutError:
                self.counters.reaped_idle += 1
                logger.info("closing a WebSocket session idle for %g s", self.idle_timeout_s)
                reason = (
                    f"no message for {self.idle_timeout_s:g} s: session closed "
                    f"(the server sets this with {ENV_VARIABLES['ws_idle_timeout_s']})"
                )
                await _send_quietly(websocket, error_frame("IDLE_TIMEOUT", reason))
                await _close_quietly(websocket, CLOSE_GOING_AWAY, "idle timeout")
                return
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            reply = self._answer(env, text, binary=text is None)
            if reply is None:  # "close"
                return
            await websocket.send({"type": "websocket.send", "text": reply})

    def _answer(self, env: Any, frame: str | None, binary: bool) -> str | None:
        """The reply to one frame (None for a close message). Never raises for bad input."""
        kind = "?"
        encoder = self.encoder
        try:
            message = decode_message(frame, self.max_message_bytes, binary=binary)
            kind, data = message["type"], message["data"]
            if kind == "step":
                if data.get("type") in TOOL_ACTIONS:  # OpenEnv's MCP actions (MCPToolClient)
                    return encode_json({"type": "observation", "data": env.tool_action_dict(data)}).decode()
                return encoder.frame(env.step_observation(data))
            if kind == "reset":
                return encoder.frame(env.reset_observation(**data))
            if kind == "state":
                return encode_json({"type": "state", "data": env.state_dict()}).decode()
            if kind == "tool":
                return encode_json({"type": "tool", "data": env.tool_dict(data)}).decode()
            if kind == "mcp":
                return encode_json({"type": "mcp", "data": env.mcp_dict(data)}).decode()
            return None
        except MessageError as exc:
            self.counters.bad_messages += 1
            return error_frame(exc.code, str(exc))
        except ValidationError as exc:
            self.counters.bad_messages += 1
            return error_frame("VALIDATION_ERROR", describe_validation_errors(exc.errors()))
        except StageConflictError as exc:
            return error_frame("STAGE_CONFLICT", str(exc), current_stage=exc.current_stage)
        except UnknownEpisodeError as exc:
            return error_frame("UNKNOWN_EPISODE", str(exc), reason=exc.reason)
        except (InvalidActionError, RequestRejectedError, NoEpisodeError) as exc:
            return error_frame("EXECUTION_ERROR", str(exc))
        except NonFiniteOutputError as exc:
            logger.error("non-finite output over /ws: %s", exc)
            return error_frame("INTERNAL_ERROR", f"internal error: {exc}")
        except Exception as exc:  # a server bug: logged with its traceback; the session goes on
            logger.exception("internal error on a /ws %s message", kind)
            return error_frame("INTERNAL_ERROR", f"internal error: {type(exc).__name__}")

    async def _refuse(self, websocket: WebSocket) -> None:
        """Answer a connection over the cap with a CAPACITY_REACHED it can read, then close."""
        self.counters.refused_at_capacity += 1
        variable = ENV_VARIABLES["max_sessions"]
        message = (
            f"server at capacity: all {self.max_sessions} WebSocket sessions are in use; retry later, "
            f"close unused clients, or raise the capacity with {variable} (python -m server.app "
            "--max-sessions N)"
        )
        if self._pending_refusals >= MAX_PENDING_REFUSALS:  # a flood: no wait for these
            await _close_quietly(websocket, CLOSE_TRY_AGAIN_LATER, "server at capacity")
            return
        self._pending_refusals += 1
        try:
            await websocket.accept()
            frame = error_frame(
                "CAPACITY_REACHED", message, max_sessions=self.max_sessions, active_sessions=self.live
            )
            await websocket.send_text(frame)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CAPACITY_REFUSAL_WAIT_S):
                    reply = await websocket.receive()  # the client's first message: it reads the refusal next
                    if reply["type"] == "websocket.disconnect":
                        return
            await _close_quietly(websocket, CLOSE_TRY_AGAIN_LATER, f"server at capacity; raise {variable}")
        except (WebSocketDisconnect, OSError):
            pass
        finally:
            self._pending_refusals -= 1


async def _send_quietly(websocket: WebSocket, text: str) -> None:
    with contextlib.suppress(WebSocketDisconnect, OSError, RuntimeError):
        await websocket.send_text(text)


async def _close_quietly(websocket: WebSocket, code: int, reason: str) -> None:
    """Close unless already closed (either side); a gone client is not an error."""
    if websocket.application_state == WebSocketState.DISCONNECTED:
        return
    if websocket.client_state == WebSocketState.DISCONNECTED:
        return
    with contextlib.suppress(WebSocketDisconnect, OSError, RuntimeError):
        await websocket.close(code=code, reason=reason)
