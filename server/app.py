"""HTTP + WebSocket app of the aligner-staging environment.

Built on openenv-core's server (``create_fastapi_app``), so OpenEnv's own clients
(``EnvClient``, ``GenericEnvClient``, ``.sync()``) drive it over the WebSocket ``/ws``:
one OpenEnv session per connection, each holding one episode of the shared
:class:`~server.dental_environment.StepwiseDentalEnvironment` store at a time.

Routes
------
From openenv-core (kept as they are; the first matching route wins, so none is redefined):

* ``WS /ws`` -- reset / step / state / close messages; the stateful path of OpenEnv clients.
* ``POST /reset``, ``POST /step``, ``GET /state`` -- OpenEnv's *stateless* HTTP calls (a fresh
  session per request: ``/reset`` returns an observation whose episode is released at once,
  ``/step`` has no episode and answers 409). Use the episode routes below for stateful HTTP.
* ``GET /health``, ``GET /schema`` (action/observation/state JSON schemas), ``GET /metadata``,
  ``/mcp`` (unused here).

The project's own routes, keyed by ``episode_id``:

* ``GET /tasks``
* ``POST /episodes`` (body ``task_id``, ``seed``, ``force_decay``, ``non_compliance``) -> observation
* ``GET /episodes/{episode_id}`` -> current observation, no change
* ``POST /episodes/{episode_id}/step`` (body ``poses`` 28x7, optional ``strategy``)
* ``POST /episodes/{episode_id}/simulate`` (body ``poses``) -> observation, no change
* ``POST /episodes/{episode_id}/rollback`` -> observation (at most 2 per episode)
* ``POST /episodes/{episode_id}/collisions`` (optional body ``poses``; default the current stage)
* ``GET /episodes/{episode_id}/teeth/{tooth_id}`` (FDI id)
* ``POST /plans/score`` (body ``plan``, ``task_id``, ``seed``, ``force_decay``, ``non_compliance``)

Errors are JSON ``{"detail": ...}`` naming the problem: validation and refused actions 422,
unknown or expired episodes 404, a step without an episode 409, oversized bodies 413.
Bad input never yields a 500, and a non-finite number in an output is reported as a
server error instead of being serialised as ``null``.

Configuration (environment variables, overridable by :func:`build_app` and ``main`` args):
``ORTHORL_HOST`` (127.0.0.1), ``ORTHORL_PORT`` (8000), ``ORTHORL_MAX_SESSIONS`` (concurrent
WebSocket sessions, 64), ``ORTHORL_MAX_EPISODES`` (episode store LRU cap, 1024),
``ORTHORL_EPISODE_TTL_S`` (3600), ``ORTHORL_MAX_BODY_BYTES`` (1000000),
``ORTHORL_WS_IDLE_TIMEOUT_S`` (unset: no idle reaping of WebSocket sessions).

Run: ``python -m server.app [--host H] [--port P]`` or ``uvicorn server.app:app``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
from typing import Annotated, Any

import numpy as np
from fastapi import Body, FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError, ResponseValidationError
from fastapi.responses import JSONResponse
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import ConcurrencyConfig, EnvironmentMetadata
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.cases import TASK_DESCRIPTIONS
from server.dental_constants import N_STAGES, N_TEETH, TOOTH_IDS
from server.dental_environment import POSE_FIELDS, TASK_IDS, StepwiseDentalEnvironment
from server.errors import InvalidActionError, UnknownEpisodeError
from server.models import (
    MAX_EPISODE_ID_CHARS,
    CollisionReport,
    CollisionsRequest,
    DentalAction,
    DentalObservation,
    DentalState,
    EpisodeObservation,
    EpisodeResetRequest,
    ErrorResponse,
    PlanScore,
    PlanScoreRequest,
    PosesRequest,
    ResetParams,
    TasksResponse,
)

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_SESSIONS = 64
DEFAULT_MAX_EPISODES = 1024
DEFAULT_EPISODE_TTL_S = 3600.0
DEFAULT_MAX_BODY_BYTES = 1_000_000

_MAX_REPORTED_ERRORS = 10
_MAX_INPUT_REPR = 200


# --- Errors ---------------------------------------------------------------------------


class RequestRejectedError(ValueError):
    """Malformed request parameters (e.g. OpenEnv reset data); answered with 422."""


class NoEpisodeError(RuntimeError):
    """A step or state call in an OpenEnv session that has no episode yet; answered with 409."""


class NonFiniteOutputError(RuntimeError):
    """The environment produced NaN/inf: a server bug, never serialised as ``null``."""


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return default if raw in (None, "") else int(raw)


def _env_float(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name)
    return default if raw in (None, "") else float(raw)


def json_safe(obj: Any, depth: int = 0) -> Any:
    """A JSON-serialisable copy of an error detail: non-finite floats become the strings
    ``"NaN"``/``"Infinity"``/``"-Infinity"``, other objects their ``str``, long inputs a
    truncated repr."""
    if depth > 8:
        return _short_repr(obj)
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj if not isinstance(obj, str) or len(obj) <= 4 * _MAX_INPUT_REPR else _short_repr(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {str(k): json_safe(v, depth + 1) for k, v in list(obj.items())[:64]}
    if isinstance(obj, (list, tuple)):
        if len(obj) > 16:
            return _short_repr(obj)
        return [json_safe(v, depth + 1) for v in obj]
    if isinstance(obj, bytes):
        return _short_repr(obj.decode("utf-8", errors="replace"))
    return _short_repr(obj)


def _short_repr(obj: Any) -> str:
    text = obj if isinstance(obj, str) else repr(obj)
    return text if len(text) <= _MAX_INPUT_REPR else text[:_MAX_INPUT_REPR] + "...(truncated)"


def _format_loc(loc: tuple[Any, ...] | list[Any]) -> str:
    """``('body', 'poses', 3, 4)`` -> ``poses[3][4] (tooth 14, tz)``."""
    parts: list[str] = []
    tooth_note = ""
    items = [p for p in loc if p not in ("body",)]
    for i, part in enumerate(items):
        if isinstance(part, int):
            parts.append(f"[{part}]")
        else:
            parts.append(("." if parts else "") + str(part))
        if part == "poses" and i + 1 < len(items) and isinstance(items[i + 1], int):
            k = items[i + 1]
            if 0 <= k < N_TEETH:
                tooth_note = f"tooth {TOOTH_IDS[k]}"
                if i + 2 < len(items) and isinstance(items[i + 2], int) and 0 <= items[i + 2] < 7:
                    tooth_note += f", {POSE_FIELDS[items[i + 2]]}"
    text = "".join(parts) or "body"
    return f"{text} ({tooth_note})" if tooth_note else text


def describe_validation_errors(errors: list[dict[str, Any]]) -> str:
    """One readable line per error (the first few), e.g.
    ``poses[3][4] (tooth 14, tz): Input should be a finite number (got NaN)``."""
    lines = []
    for err in errors[:_MAX_REPORTED_ERRORS]:
        where = _format_loc(err.get("loc", ()))
        msg = err.get("msg", "invalid")
        kind = err.get("type")
        if kind == "json_invalid":
            loc = err.get("loc", ())
            pos = f" at position {loc[-1]}" if loc and isinstance(loc[-1], int) else ""
            reason = (err.get("ctx") or {}).get("error", "")
            lines.append(f"body is not valid JSON{pos}" + (f": {reason}" if reason else ""))
            continue
        if tuple(err.get("loc", ())) == ("body",) and kind == "missing":
            msg = "a JSON object body is required"
        got = ""
        if "input" in err and kind != "missing":
            raw = err["input"]
            if isinstance(raw, float) and not math.isfinite(raw):
                shown = json_safe(raw)  # NaN / Infinity / -Infinity, as written in the JSON text
            else:
                shown = _short_repr(json.dumps(json_safe(raw, depth=7)))
            got = f" (got {shown})"
            if len(got) > 80:
                got = ""
        lines.append(f"{where}: {msg}{got}")
    more = len(errors) - _MAX_REPORTED_ERRORS
    if more > 0:
        lines.append(f"... and {more} more error(s)")
    return "; ".join(lines)


def _safe_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for err in errors[:_MAX_REPORTED_ERRORS]:
        item = {k: json_safe(v) for k, v in err.items() if k in ("type", "loc", "msg", "ctx")}
        if "input" in err:
            item["input"] = json_safe(err["input"], depth=7)
        out.append(item)
    return out


def to_jsonable(obj: Any, path: str = "") -> Any:
    """Plain JSON types from an environment output (numpy scalars/arrays included).

    Raises :class:`NonFiniteOutputError` naming the path of the first NaN/inf.
    """
    try:
        return _plain(obj)
    except _RefusedValueError:  # another type or a non-finite value: the full walk, naming any bad path
        return _to_jsonable_at(obj, path)


class _RefusedValueError(Exception):
    """_plain met a value it does not take as it is."""


def _plain(obj: Any) -> Any:
    """to_jsonable's fast walk over the plain types observations are made of (no paths)."""
    t = type(obj)
    if t is float:
        if obj - obj == 0.0:  # false for NaN and +-inf
            return obj
        raise _RefusedValueError
    if t is str or t is int or t is bool or obj is None:
        return obj
    if t is dict:
        return {str(k): _plain(v) for k, v in obj.items()}
    if t is list or t is tuple:
        return [_plain(v) for v in obj]
    if t is np.ndarray and (obj.dtype.kind in "biu" or (obj.dtype.kind == "f" and np.isfinite(obj).all())):
        return obj.tolist()
    raise _RefusedValueError  # anything else (numpy scalars, subclasses, NaN): the path-naming walk


def _to_jsonable_at(obj: Any, path: str) -> Any:
    """to_jsonable that tracks the path of each value, for the error message."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise NonFiniteOutputError(
                f"the environment produced a non-finite number ({obj}) at {path or 'the top level'}"
            )
        return float(obj)
    if isinstance(obj, dict):
        return {str(k): _to_jsonable_at(v, f"{path}.{k}" if path else str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_jsonable_at(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, np.ndarray):
        return _to_jsonable_at(obj.tolist(), path)
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return _to_jsonable_at(float(obj), path)
    if hasattr(obj, "model_dump"):
        return _to_jsonable_at(obj.model_dump(), path)
    raise NonFiniteOutputError(
        f"the environment produced a non-JSON value of type {type(obj).__name__} at {path}"
    )


# --- OpenEnv adapter ------------------------------------------------------------------


class DentalOpenEnvAdapter(Environment[DentalAction, DentalObservation, DentalState]):
    """OpenEnv ``Environment`` over the shared episode store.

    openenv-core creates one instance per WebSocket connection (and one per stateless
    HTTP ``/reset``/``/step``/``/state`` call). ``reset`` creates an episode in the shared
    :class:`StepwiseDentalEnvironment` (releasing this session's previous one), ``step``
    forwards the poses (and optional strategy) to that episode, ``close`` releases it.
    Isolation: a session only ever touches the episode id its own reset returned.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, store: StepwiseDentalEnvironment):
        super().__init__()
        self._store = store
        self._episode_id: str | None = None

    # reset kwargs come verbatim from the client (WebSocket data / HTTP body extras)
    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        **kwargs: Any,
    ) -> DentalObservation:
        data: dict[str, Any] = dict(kwargs)
        if seed is not None:
            data["seed"] = seed
        if episode_id is not None:
            data["episode_id"] = episode_id
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
        return make_observation(obs)

    def step(
        self,
        action: DentalAction,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> DentalObservation:
        if self._episode_id is None:
            raise NoEpisodeError(
                "this session has no episode: send a reset first (OpenEnv's HTTP /step is "
                "stateless; use the WebSocket /ws or POST /episodes/{episode_id}/step)"
            )
        obs = self._store.step(self._episode_id, action.poses, strategy=action.strategy)
        return make_observation(obs)

    @property
    def state(self) -> DentalState:
        if self._episode_id is None:
            return DentalState()
        obs = self._store.state(self._episode_id)
        return DentalState(
            episode_id=obs["episode_id"],
            step_count=int(obs["current_stage"]),
            task_id=obs["task_id"],
            seed=int(obs["seed"]),
            force_decay=bool(obs["force_decay"]),
            non_compliance=bool(obs["non_compliance"]),
            current_stage=int(obs["current_stage"]),
            done=bool(obs["done"]),
        )

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


# --- Body size limit ------------------------------------------------------------------


class BodyLimitMiddleware:
    """Refuses request bodies above ``max_body_bytes`` with 413: from ``Content-Length``
    before reading, and while reading (chunked bodies)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = int(max_body_bytes)

    def _too_large(self, size: str) -> str:
        return f"request body too large: {size} exceeds the limit of {self.max_body_bytes} bytes"

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
                    response = JSONResponse(
                        {"detail": self._too_large(f"Content-Length {declared}")}, status_code=413
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


# --- App ------------------------------------------------------------------------------


def _error(status_code: int, detail: Any, **extra: Any) -> JSONResponse:
    return JSONResponse({"detail": json_safe(detail), **json_safe(extra)}, status_code=status_code)


def install_exception_handlers(app: FastAPI) -> None:
    """JSON-safe handlers: a bad request gets a 4xx naming the problem, never a 500."""

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        return _error(422, describe_validation_errors(errors), errors=_safe_errors(errors))

    @app.exception_handler(ValidationError)
    async def _pydantic_validation(request: Request, exc: ValidationError) -> JSONResponse:
        errors = exc.errors()
        return _error(422, describe_validation_errors(errors), errors=_safe_errors(errors))

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
            return _error(exc.status_code, describe_validation_errors(detail), errors=_safe_errors(detail))
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
        return _error(404, str(exc))

    @app.exception_handler(NoEpisodeError)
    async def _no_episode(request: Request, exc: NoEpisodeError) -> JSONResponse:
        return _error(409, str(exc))

    @app.exception_handler(NonFiniteOutputError)
    async def _non_finite(request: Request, exc: NonFiniteOutputError) -> JSONResponse:
        logger.error("non-finite output on %s: %s", request.url.path, exc)
        return _error(500, f"internal error: {exc}")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # a server bug (bad input never gets here); JSON so clients can show the reason
        return _error(500, f"internal error: {type(exc).__name__}: {_short_repr(str(exc))}")

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


def build_app(
    store: StepwiseDentalEnvironment | None = None,
    *,
    max_sessions: int | None = None,
    max_episodes: int | None = None,
    episode_ttl_s: float | None = None,
    max_body_bytes: int | None = None,
    ws_idle_timeout_s: float | None = None,
) -> FastAPI:
    """The FastAPI app: openenv-core's server plus the episode routes.

    Unset arguments come from the ``ORTHORL_*`` environment variables (module docstring).
    """
    if max_sessions is None:
        max_sessions = _env_int("ORTHORL_MAX_SESSIONS", DEFAULT_MAX_SESSIONS)
    if max_body_bytes is None:
        max_body_bytes = _env_int("ORTHORL_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES)
    if ws_idle_timeout_s is None:
        ws_idle_timeout_s = _env_float("ORTHORL_WS_IDLE_TIMEOUT_S", None)
    if store is None:
        store = StepwiseDentalEnvironment(
            max_sessions=max_episodes or _env_int("ORTHORL_MAX_EPISODES", DEFAULT_MAX_EPISODES),
            ttl_seconds=episode_ttl_s or _env_float("ORTHORL_EPISODE_TTL_S", DEFAULT_EPISODE_TTL_S),
        )

    app = create_fastapi_app(
        functools.partial(DentalOpenEnvAdapter, store),
        DentalAction,
        DentalObservation,
        concurrency_config=ConcurrencyConfig(
            max_concurrent_envs=max_sessions, session_timeout=ws_idle_timeout_s
        ),
    )
    app.title = "OrthoRL aligner-staging environment"
    app.description = (__doc__ or "").split("Configuration")[0]
    app.state.store = store
    app.state.max_body_bytes = max_body_bytes
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    install_exception_handlers(app)

    existing = {getattr(r, "path", None) for r in app.routes}
    errors = {
        404: {"model": ErrorResponse, "description": "unknown or expired episode"},
        422: {"model": ErrorResponse, "description": "invalid request or refused action"},
    }

    def respond(obj: Any) -> JSONResponse:
        return JSONResponse(to_jsonable(obj))

    if "/tasks" not in existing:

        @app.get("/tasks", response_model=TasksResponse, tags=["Episodes"], summary="Task levels")
        def list_tasks() -> JSONResponse:
            return respond(
                {
                    "tasks": [{"task_id": t, "description": TASK_DESCRIPTIONS[t]} for t in TASK_IDS],
                    "n_stages": N_STAGES,
                    "n_teeth": N_TEETH,
                    "tooth_ids": list(TOOTH_IDS),
                }
            )

    @app.post(
        "/episodes",
        response_model=EpisodeObservation,
        responses={422: errors[422]},
        tags=["Episodes"],
        summary="Start an episode (reset)",
    )
    def create_episode(
        request: Annotated[EpisodeResetRequest, Body(default_factory=EpisodeResetRequest)],
    ) -> JSONResponse:
        return respond(
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
        responses=errors,
        tags=["Episodes"],
        summary="Current observation",
    )
    def get_episode(episode_id: EpisodeIdPath) -> JSONResponse:
        return respond(store.state(episode_id))

    @app.post(
        "/episodes/{episode_id}/step",
        response_model=EpisodeObservation,
        responses=errors,
        tags=["Episodes"],
        summary="Commit the next stage",
    )
    def step_episode(episode_id: EpisodeIdPath, action: DentalAction) -> JSONResponse:
        return respond(store.step(episode_id, action.poses, strategy=action.strategy))

    @app.post(
        "/episodes/{episode_id}/simulate",
        response_model=EpisodeObservation,
        responses=errors,
        tags=["Episodes"],
        summary="Simulate the next stage without committing it",
    )
    def simulate_episode(episode_id: EpisodeIdPath, request: PosesRequest) -> JSONResponse:
        return respond(store.simulate_step(episode_id, request.poses))

    @app.post(
        "/episodes/{episode_id}/rollback",
        response_model=EpisodeObservation,
        responses=errors,
        tags=["Episodes"],
        summary="Undo the last stage (at most 2 per episode)",
    )
    def rollback_episode(episode_id: EpisodeIdPath) -> JSONResponse:
        return respond(store.rollback_stage(episode_id))

    @app.post(
        "/episodes/{episode_id}/collisions",
        response_model=CollisionReport,
        responses=errors,
        tags=["Episodes"],
        summary="Adjacent-tooth collisions of the given poses (default: the current stage)",
    )
    def episode_collisions(
        episode_id: EpisodeIdPath,
        request: Annotated[CollisionsRequest | None, Body()] = None,
    ) -> JSONResponse:
        poses = request.poses if request is not None else None
        return respond(store.check_collisions(episode_id, poses))

    @app.get(
        "/episodes/{episode_id}/teeth/{tooth_id}",
        responses=errors,
        tags=["Episodes"],
        summary="Inspect one tooth (FDI id)",
    )
    def inspect_tooth(
        episode_id: EpisodeIdPath,
        tooth_id: ToothIdPath,
    ) -> JSONResponse:
        return respond(store.inspect_tooth(episode_id, tooth_id))

    @app.post(
        "/plans/score",
        response_model=PlanScore,
        responses={422: errors[422]},
        tags=["Plans"],
        summary="Score a whole treatment plan as one episode",
    )
    def score_plan(request: PlanScoreRequest) -> JSONResponse:
        return respond(
            store.score_plan(
                request.plan,
                task_id=request.task_id,
                seed=request.seed,
                force_decay=request.force_decay,
                non_compliance=request.non_compliance,
            )
        )

    _patch_openapi(app)
    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="OrthoRL environment server")
    parser.add_argument("--host", default=os.environ.get("ORTHORL_HOST", DEFAULT_HOST))
    parser.add_argument("--port", type=int, default=_env_int("ORTHORL_PORT", DEFAULT_PORT))
    parser.add_argument("--max-sessions", type=int, default=None, help="concurrent WebSocket sessions")
    parser.add_argument("--max-body-bytes", type=int, default=None)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    application = build_app(max_sessions=args.max_sessions, max_body_bytes=args.max_body_bytes)
    uvicorn.run(
        application,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        ws_max_size=max(int(application.state.max_body_bytes), 64 * 1024),
    )


_default_app: FastAPI | None = None


def __getattr__(name: str) -> Any:
    """``server.app:app`` is built on first access (so importing this module is cheap)."""
    global _default_app
    if name == "app":
        if _default_app is None:
            _default_app = build_app()
        return _default_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    main()
