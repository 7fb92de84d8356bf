"""The project's routes, keyed by ``episode_id``, and the swaps of openenv-core's ``/ws`` and ``/mcp``."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Body, FastAPI, Path, Query, Request
from fastapi.responses import Response
from starlette.routing import WebSocketRoute

from server.cases import TASK_DESCRIPTIONS
from server.dental_constants import N_STAGES, N_TEETH, TOOTH_IDS
from server.dental_environment import TASK_IDS, StepwiseDentalEnvironment
from server.plan_text import decode_marking_repeats
from server.serving.fast_path import FastJSONRoute, JSONBytesResponse
from server.serving.mcp_tools import McpEndpoint
from server.serving.models import (
    MAX_EPISODE_ID_CHARS,
    CollisionReport,
    CollisionsRequest,
    DentalAction,
    EpisodeClosed,
    EpisodeObservation,
    EpisodeResetRequest,
    ErrorResponse,
    PlanScore,
    PlanScoreRequest,
    PosesRequest,
    TasksResponse,
)
from server.serving.serialization import (
    ObservationEncoder,
)
from server.serving.sessions import WebSocketSessions
from server.serving.settings import ServerSettings

EpisodeIdPath = Annotated[
    str, Path(min_length=1, max_length=MAX_EPISODE_ID_CHARS, description="id from POST /episodes")
]


ToothIdPath = Annotated[int, Path(ge=11, le=48, description="FDI id, e.g. 11")]


ExpectedStageQuery = Annotated[
    int | None,
    Query(ge=0, le=N_STAGES, description="the stage the episode must be at (else 409, not applied)"),
]


def _plan_as_sent(body: bytes, plan: dict[str, Any]) -> Any:
    """The ``plan`` object of a ``POST /plans/score`` body decoded again with its repeated keys
    marked (:func:`server.plan_text.decode_marking_repeats`: the body parser keeps a repeated
    key's last value silently); ``plan`` itself when the body does not decode so."""
    try:
        sent = decode_marking_repeats(body)
    except (ValueError, RecursionError):
        return plan
    return sent["plan"] if isinstance(sent, dict) and isinstance(sent.get("plan"), dict) else plan


def replace_mcp_routes(app: FastAPI, mcp: McpEndpoint) -> None:
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


def replace_websocket_route(app: FastAPI, path: str, endpoint: Any) -> None:
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


def add_episode_routes(
    app: FastAPI,
    store: StepwiseDentalEnvironment,
    settings: ServerSettings,
    sessions: WebSocketSessions,
    encoder: ObservationEncoder,
) -> None:
    """Add the episode, plan and status routes on ``store`` to ``app`` (and ``GET /tasks`` unless
    openenv-core serves it). Their bodies are parsed by :class:`FastJSONRoute`; a trainer's successful
    calls never reach them (:class:`server.serving.fast_path.EpisodeFastPath`)."""
    with_tasks = not any(getattr(r, "path", None) == "/tasks" for r in app.routes)
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

    if with_tasks:

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
        return observe(store.reset(**request.reset_kwargs()))

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
    async def score_plan(request: PlanScoreRequest, raw: Request) -> JSONBytesResponse:
        plan = request.plan
        if isinstance(plan, dict):  # the object as sent: one that repeats a key is not a plan
            plan = _plan_as_sent(await raw.body(), plan)
        return respond(
            store.score_plan(
                plan,
                task_id=request.task_id,
                seed=request.seed,
                force_decay=request.force_decay,
                non_compliance=request.non_compliance,
            )
        )
