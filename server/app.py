"""HTTP + WebSocket app of the aligner-staging environment.

Built on openenv-core's server (``create_fastapi_app``), so OpenEnv's own clients
(``EnvClient``, ``GenericEnvClient``, ``.sync()``) and :mod:`orthojob.agentic.env_client` drive it
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
* ``POST /episodes`` (body ``task_id``, ``seed``, ``force_decay``, ``non_compliance``; or ``case_id``, a
  case of the server's case set, or ``case``, a whole case record checked first) -> observation
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

Run: ``python -m server.app [--host H] [--port P] [--max-sessions N] [--cases FILE] ...`` or
``uvicorn server.app:app``. One worker process only: the episodes live in its memory, so
``--workers N`` (or ``WEB_CONCURRENCY``) above 1 is refused at start. ``--cases FILE`` loads a local
case file (docs/cases.md) at start, every record checked (a file with a problem stops the server,
exit 2, every problem named): a reset (OpenEnv's, or ``POST /episodes``) may then name a case by
``case_id``; any reset may carry a ``case`` record instead, which is checked and never kept beyond its
episode.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.types import ConcurrencyConfig

from server.case_files import load_case_set
from server.cases import CaseKey
from server.dental_environment import StepwiseDentalEnvironment
from server.serving.adapter import DentalOpenEnvAdapter
from server.serving.fast_path import EpisodeFastPath
from server.serving.handlers import install_exception_handlers, patch_openapi
from server.serving.mcp_tools import McpEndpoint
from server.serving.middleware import BodyLimitMiddleware
from server.serving.models import (
    DentalAction,
    DentalObservation,
)
from server.serving.routes import (
    add_episode_routes,
    replace_mcp_routes,
    replace_websocket_route,
)
from server.serving.serialization import (
    ObservationEncoder,
)
from server.serving.sessions import WebSocketSessions
from server.serving.settings import ENV_VARIABLES, WORKERS_VARIABLE, ServerSettings, SettingsError

logger = logging.getLogger(__name__)


# --- OpenEnv adapter ------------------------------------------------------------------


# --- Message size limit ---------------------------------------------------------------


# --- App ------------------------------------------------------------------------------

ENCODED_CASES = 256
"""Cases whose constant observation fields the app keeps encoded (least recently used dropped
first; about 8 kB each)."""


def create_app(
    settings: ServerSettings | None = None,
    store: StepwiseDentalEnvironment | None = None,
    case_set: Mapping[str, CaseKey] | None = None,
) -> FastAPI:
    """The FastAPI app: openenv-core's server, this project's ``/ws`` and the episode routes.

    ``settings`` default to :meth:`ServerSettings.from_env`; ``store`` to a new store with
    the settings' episode cap and TTL, and ``case_set`` (case id -> key, :func:`server.case_files.load_case_set`) the
    cases a reset may name by ``case_id``.
    """
    settings = ServerSettings.from_env() if settings is None else settings
    if store is None:
        store = StepwiseDentalEnvironment(
            max_sessions=settings.max_episodes, ttl_seconds=settings.episode_ttl_s, case_set=case_set
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
    replace_websocket_route(app, "/ws", sessions.endpoint)
    app.state.mcp = mcp
    replace_mcp_routes(app, mcp)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_message_bytes)
    # outside the body limit: it reads only bodies declared within the limit, passes others on
    app.add_middleware(
        EpisodeFastPath, store=store, encoder=encoder, max_body_bytes=settings.max_message_bytes
    )
    install_exception_handlers(app)

    n_openenv_routes = len(app.router.routes)
    add_episode_routes(app, store, settings, sessions, encoder)
    # this project's routes first: a request matches its route without scanning openenv-core's
    # (their paths differ, so no route shadows another)
    routes = app.router.routes
    routes[:] = routes[n_openenv_routes:] + routes[:n_openenv_routes]
    patch_openapi(app)
    return app


def build_app(store: StepwiseDentalEnvironment | None = None, **overrides: Any) -> FastAPI:
    """:func:`create_app` with settings from the environment, overridden by keyword
    (``max_sessions=4``, ``ws_idle_timeout_s=0.5``...; ``max_body_bytes`` is
    ``max_message_bytes``)."""
    if "max_body_bytes" in overrides:
        overrides["max_message_bytes"] = overrides.pop("max_body_bytes")
    return create_app(ServerSettings.from_env(**overrides), store)


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
    parser.add_argument(
        "--cases",
        default=None,
        help="a case file (.jsonl or .parquet, docs/cases.md): reset may name its cases by case_id",
    )
    args = parser.parse_args(argv)
    case_set = None
    if args.cases:
        try:
            case_set = load_case_set(args.cases)
        except (FileNotFoundError, ValueError) as exc:
            parser.exit(2, f"{parser.prog}: --cases {args.cases}: {exc}\n")
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
        create_app(settings, case_set=case_set),
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
