"""The training side's client of the environment server (``server.app`` over WebSocket).

:class:`DentalEnvClient` is OpenEnv's ``EnvClient`` for this environment (the OpenEnv
pattern: typed payloads, its protocol, its ``.sync()``), with the errors a trainer can act on:

* a server error reply raises :class:`EnvServerError` with OpenEnv's ``code``
  (``VALIDATION_ERROR``, ``EXECUTION_ERROR``, ``CAPACITY_REACHED``...) instead of a bare
  ``RuntimeError``.

:class:`EnvSession` is the synchronous session a rollout holds (one per generation, as in
TRL's ``environment_factory``). It never hangs and never repeats a dead connection's error:

* every call is bounded (``connect_timeout_s``, ``message_timeout_s``);
* when the connection is lost mid-episode (server restart: close code 1012; idle reaping:
  ``IDLE_TIMEOUT``; no reply in time), ``step``/``state`` raise :class:`EpisodeLostError`
  naming the episode, its stage and the cause, and drop the connection;
* ``reset`` (re)connects, retrying with backoff for up to ``reconnect_deadline_s`` (a server
  restarting, or at capacity), then raises :class:`ServerUnavailableError`.

Steps carry ``expected_stage`` so a step can never be applied to another stage than the
one it was computed from.

    with EnvSession("http://127.0.0.1:8000") as env:
        result = env.reset(task_id="task_medium", seed=3)
        while not result.done:
            try:
                result = env.step(poses)        # 28 x 7
            except EpisodeLostError:            # the server restarted: score the rollout as failed
                break
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

logger = logging.getLogger(__name__)

CLOSE_REASONS = {
    1000: "closed normally",
    1001: "server going away (idle session reaped, or shutting down)",
    1006: "connection dropped without a close frame",
    1011: "server error",
    1012: "server restarting",
    1013: "server at capacity, try again later",
}
"""WebSocket close codes as a trainer should read them."""

RETRYABLE_CODES = frozenset({"CAPACITY_REACHED", "IDLE_TIMEOUT"})
"""Server error codes after which a new connection and a reset may succeed."""

LOST_EPISODE_CODES = frozenset({"IDLE_TIMEOUT", "UNKNOWN_EPISODE"})
"""Server error codes that mean this session's episode is gone."""


class EnvServerError(RuntimeError):
    """The server answered with an error reply; ``code`` is OpenEnv's error code."""

    def __init__(self, code: str, message: str, data: dict[str, Any] | None = None):
        super().__init__(f"{message} (code: {code})")
        self.code = code
        self.data = data or {}


class EpisodeLostError(RuntimeError):
    """The episode this session was playing is gone (server restart, reaped session, lost
    connection): it cannot be continued. Call ``reset()`` for a new one."""

    def __init__(self, message: str, episode_id: str | None, stage: int | None):
        super().__init__(message)
        self.episode_id = episode_id
        self.stage = stage


class ServerUnavailableError(ConnectionError):
    """The server could not be reached (or kept refusing) for ``reconnect_deadline_s``."""


class DentalEnvClient(EnvClient[dict[str, Any], dict[str, Any], dict[str, Any]]):
    """OpenEnv's async client for the aligner-staging environment (actions and observations
    as dicts: ``{"poses": 28x7, "strategy": ..., "expected_stage": ...}``)."""

    async def connect(self) -> DentalEnvClient:
        """Open the WebSocket as OpenEnv's client does, without per-message deflate: the
        server's observations are 14 kB of numbers, and compressing them costs the server
        more CPU than the network saves (no proxy for a loopback address)."""
        if self._ws is not None:
            return self
        loopback = any(h in self._ws_url.lower() for h in ("://localhost", "://127.0.0.1", "://[::1]"))
        try:
            self._ws = await ws_connect(
                self._ws_url,
                open_timeout=self._connect_timeout,
                max_size=self._max_message_size,
                compression=None,
                proxy=None if loopback else True,
            )
        except Exception as exc:
            raise ConnectionError(f"Failed to connect to {self._ws_url}: {exc}") from exc
        return self

    def _step_payload(self, action: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in action.items() if v is not None}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[dict[str, Any]]:
        return StepResult(
            observation=payload.get("observation", {}),
            reward=payload.get("reward"),
            done=bool(payload.get("done", False)),
        )

    def _parse_state(self, payload: dict[str, Any]) -> dict[str, Any]:
        return payload

    async def _send_and_receive(self, message: dict[str, Any]) -> dict[str, Any]:
        await self._send(message)
        response = await self._receive()
        if response.get("type") == "error":
            data = response.get("data") or {}
            raise EnvServerError(str(data.get("code", "UNKNOWN")), str(data.get("message", "")), data)
        return response

    async def drop(self) -> None:
        """Forget the connection (closing it if it is still open) so the next call reconnects."""
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                await asyncio.wait_for(ws.close(), timeout=1.0)
            except Exception:  # already dead: nothing to close
                logger.debug("closing a dead connection", exc_info=True)


_CONNECTION_ERRORS = (ConnectionClosed, ConnectionError, InvalidHandshake, OSError, TimeoutError)


class EnvSession:
    """A synchronous environment session for one rollout; see the module docstring."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float = 10.0,
        message_timeout_s: float = 60.0,
        reconnect_deadline_s: float = 60.0,
    ):
        self.base_url = base_url
        self.reconnect_deadline_s = reconnect_deadline_s
        self._client = DentalEnvClient(
            base_url, connect_timeout_s=connect_timeout_s, message_timeout_s=message_timeout_s
        )
        self._sync = self._client.sync()
        self.episode_id: str | None = None
        self.stage: int | None = None

    def reset(self, **params: Any) -> StepResult[dict[str, Any]]:
        """Start an episode (``task_id``, ``seed``, ``force_decay``, ``non_compliance``),
        connecting or reconnecting as needed."""
        self.episode_id = self.stage = None
        deadline = time.monotonic() + self.reconnect_deadline_s
        delay = 0.05
        while True:
            try:
                result = self._sync.reset(**params)
            except EnvServerError as exc:
                if exc.code not in RETRYABLE_CODES:
                    raise
                failure: BaseException = exc
            except _CONNECTION_ERRORS as exc:
                failure = exc
            else:
                self.episode_id = result.observation.get("episode_id")
                self.stage = int(result.observation.get("current_stage", 0))
                return result
            self._drop()
            if time.monotonic() + delay > deadline:
                raise ServerUnavailableError(
                    f"environment server at {self.base_url} unavailable for {self.reconnect_deadline_s:g} s: "
                    f"{_describe(failure)}"
                ) from failure
            logger.info("environment server unavailable (%s); retrying in %.2f s", _describe(failure), delay)
            time.sleep(delay)
            delay = min(2 * delay, 1.0)

    def step(
        self, poses: Any, strategy: str | None = None, expected_stage: int | None = None
    ) -> StepResult[dict[str, Any]]:
        """Wear the next aligner (28 x 7 poses). ``expected_stage`` defaults to the stage this
        session last saw."""
        if self.episode_id is None:
            raise EpisodeLostError("this session has no episode: call reset() first", None, None)
        stage = self.stage if expected_stage is None else expected_stage
        action = {"poses": poses, "strategy": strategy, "expected_stage": stage}
        result = self._call(self._sync.step, action)
        self.stage = int(result.observation.get("current_stage", (stage or 0) + 1))
        return result

    def state(self) -> dict[str, Any]:
        """The server's state of this session's episode."""
        return self._call(self._sync.state)

    def tool(self, name: str, **data: Any) -> dict[str, Any]:
        """One agentic tool on this session's episode (the server's ``tool`` message, sent through
        OpenEnv's client connection): ``inspect_tooth``, ``simulate``, ``collisions``, ``rollback``,
        ``terminal``. A refused argument raises :class:`EnvServerError` (``EXECUTION_ERROR``)."""
        if self.episode_id is None:
            raise EpisodeLostError("this session has no episode: call reset() first", None, None)
        message = {"type": "tool", "data": {"name": name, **{k: v for k, v in data.items() if v is not None}}}
        response = self._call(lambda: self._sync._run(self._client._send_and_receive(message)))
        result = response.get("data") or {}
        if name == "rollback":
            self.stage = int(result.get("current_stage", self.stage or 0))
        return result

    def _call(self, method: Any, *args: Any) -> Any:
        try:
            return method(*args)
        except EnvServerError as exc:
            if exc.code not in LOST_EPISODE_CODES:
                raise
            self._lose(exc)
        except _CONNECTION_ERRORS as exc:
            self._lose(exc)

    def _lose(self, cause: BaseException) -> None:
        episode_id, stage = self.episode_id, self.stage
        self.episode_id = self.stage = None
        self._drop()
        raise EpisodeLostError(
            f"episode {episode_id} at stage {stage} is lost: {_describe(cause)}. Call reset() to start a "
            f"new episode (this session reconnects to {self.base_url})",
            episode_id,
            stage,
        ) from cause

    def _drop(self) -> None:
        try:
            self._sync._run(self._client.drop())
        except Exception:  # the loop itself is gone: nothing to drop
            logger.debug("dropping the connection", exc_info=True)

    def close(self) -> None:
        """Close the connection (the server releases the episode)."""
        try:
            self._sync.close()
        except Exception:
            logger.debug("closing the session", exc_info=True)

    def __enter__(self) -> EnvSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _describe(exc: BaseException) -> str:
    """A trainer-readable cause: the close code's meaning, the server's error, or the failure."""
    if isinstance(exc, ConnectionClosed):
        frame = exc.rcvd or exc.sent
        if frame is None:
            return "the connection dropped without a close frame"
        meaning = CLOSE_REASONS.get(frame.code, "closed")
        return f"the server closed the connection ({frame.code}: {meaning}{'; ' + frame.reason if frame.reason else ''})"
    if isinstance(exc, InvalidStatus):
        return f"the server refused the WebSocket handshake (HTTP {exc.response.status_code})"
    if isinstance(exc, TimeoutError):
        return "no reply within the message timeout"
    if isinstance(exc, EnvServerError):
        return f"the server answered {exc.code}: {exc}"
    return f"{type(exc).__name__}: {exc}"
