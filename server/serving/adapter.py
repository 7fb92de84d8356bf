"""The OpenEnv adapter: the stepwise environment as an OpenEnv ``Environment`` (reset, step, state, the
``tool`` and ``mcp`` messages), one per WebSocket session, all on one shared episode store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import EnvironmentMetadata
from pydantic import ValidationError

from server.dental_environment import StepwiseDentalEnvironment
from server.errors import (
    NoEpisodeError,
    RequestRejectedError,
    UnknownEpisodeError,
)
from server.serving.mcp_tools import INVALID_PARAMS, McpEndpoint, ServerToolEpisode
from server.serving.models import (
    DentalAction,
    DentalObservation,
    DentalState,
    ResetParams,
)
from server.serving.rubric import StagingRubric
from server.serving.serialization import (
    describe_validation_errors,
    to_jsonable,
)

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
                + " (accepted: task_id, seed, force_decay, non_compliance, episode_id, case_id, case)"
            ) from None
        if params.episode_id is not None and params.episode_id != self._episode_id:
            self._refuse_live_episode_id(params.episode_id)
        obs = self._store.reset(**params.reset_kwargs(), episode_id=params.episode_id)
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
