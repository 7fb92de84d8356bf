"""Agentic GRPO: the stepwise environment as tools, through TRL's ``environment_factory``.

TRL 1.16's GRPOTrainer (``environment_factory=DentalToolEnv``) makes one :class:`DentalToolEnv`
per rollout (pooled and reused), calls ``reset(**row)`` with the dataset row (columns ``seed``,
``task_id``, ``force_decay``; ``prompt`` is ignored) and appends the text it returns, the case
(:func:`orthojob.core.prompts.case_description`), to the last user message. Every public method is a
tool: TRL derives its JSON schema from the signature and the Google-style docstring
(``transformers.utils.get_json_schema``), parses the model's ``<tool_call>`` JSON, calls the method
and feeds the returned text back as a ``tool`` message, up to ``max_tool_calling_iterations``
assistant turns.

Tools: :class:`server.agent_tools.StagingTools`' (``inspect_tooth``, ``simulate_stage``,
``check_collisions``, ``commit_stage``, ``rollback_stage``, ``submit_plan``; the stage format and each
tool's contract are documented there), which the environment server also serves as MCP tools
(:mod:`server.serving.mcp_tools`). :class:`DentalToolEnv` adds the episode start (``reset``: the case as
text), the release, and ``submit_plan``'s scoring as the one-shot rewards score a completion
(:func:`orthojob.rewards.rollouts.score_texts`: a plan found in the text). The model never types 28 x 7 poses.

**Reward.** The environment owns it (:attr:`DentalToolEnv.reward`), read by
:func:`orthojob.agentic.reward.reward_agentic`. The environment deliberately has no ``get_reward``
method: TRL would add that as a second reward column with weight 1, counting the same score twice.
A few episodes per step are recorded as MLflow traces (:mod:`orthojob.agentic.traces`).

Non-tool members are private or properties: TRL exposes every public function as a tool.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from orthojob.agentic.prompts import _case_text
from orthojob.agentic.remote import RemoteStepwise
from orthojob.agentic.traces import _BUDGET, _traced
from orthojob.rewards.rollouts import NO_PLAN, score_texts
from server.agent_tools import (
    TOOL_NAMES,
    StagingTools,
    ToolError,
)
from server.cases import IMPORTED_TASK, TASK_IDS, generate_case
from server.dental_constants import (
    N_STAGES,
    TOOTH_IDS,
)
from server.dental_environment import StepwiseDentalEnvironment
from server.plans import normalize_plan

log = logging.getLogger(__name__)


class DentalToolEnv(StagingTools):
    """One agentic episode on the in-process :class:`StepwiseDentalEnvironment` (module docstring);
    the tools are :class:`server.agent_tools.StagingTools`'.

    Usable as TRL's ``environment_factory`` (the class itself is the factory). After an episode:
    :attr:`reward`, :attr:`result`, :attr:`metrics`, :attr:`finished`.
    """

    def __init__(self, env_url: str | None = None) -> None:
        # in process: one episode at a time, a small store and a TTL no generation outlasts;
        # with env_url: the server's episode, over one WebSocket (RemoteStepwise)
        super().__init__(
            StepwiseDentalEnvironment(max_sessions=2, ttl_seconds=1e9)
            if env_url is None
            else RemoteStepwise(env_url)
        )
        self._trace_calls: list[tuple] | None = None  # this episode's tool calls, when recorded
        self._trace_start = 0

    # --- episode (not tools) ---------------------------------------------------------------

    def reset(
        self, seed: int | None = None, task_id: str = "task_easy", force_decay: bool = False, **kwargs
    ) -> str:
        """Start the episode of a dataset row (``seed``, ``task_id``, ``force_decay``; other
        columns ignored) and return the case as text (:func:`orthojob.core.prompts.case_description`).
        ``task_id`` ``"imported"`` names a case of a case set loaded in this process
        (:func:`orthojob.data.case_sets.load_case_set`).

        A bad row raises ValueError (a dataset error, not the model's)."""
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"column 'seed' must hold integers, got {seed!r:.40}")
        if task_id not in (*TASK_IDS, IMPORTED_TASK):
            raise ValueError(
                f"column 'task_id' must be one of {TASK_IDS} or {IMPORTED_TASK!r}, got {task_id!r:.40}"
            )
        t0 = time.perf_counter()
        if self._episode_id is not None:
            self._env.close_episode(self._episode_id)
        obs = self._env.reset(task_id=task_id, seed=int(seed), force_decay=bool(force_decay))
        case = (
            self._env.sessions.get(obs["episode_id"]).case
            if isinstance(self._env, StepwiseDentalEnvironment)
            else generate_case(
                task_id, int(seed), bool(force_decay)
            )  # the server's case: a pure function of its key
        )
        self._begin(obs, case)
        text = _case_text(obs)
        self._metrics.env_seconds = time.perf_counter() - t0
        self._trace_calls = [] if _BUDGET.claim() else None  # a trace of this episode (module docstring)
        self._trace_start = time.time_ns()
        return text

    def _close(self) -> None:
        """Release the episode: over the server, close the WebSocket session (the server drops its
        episode); in process, forget it. Private, so not a tool; for the end of a run (TRL calls no
        tool after training)."""
        if isinstance(self._env, RemoteStepwise):
            self._env.close()
        elif self._episode_id is not None:
            self._env.close_episode(self._episode_id)
        self._episode_id = None

    def _score_plan_text(self, plan: str) -> dict:
        """The one-shot rewards' scoring of the plan text (:func:`orthojob.rewards.rollouts.score_texts`: a
        plan found in the text as a completion's is), so a submitted plan scores what
        ``reward_terminal`` gives the same text."""
        (rollout,) = score_texts([plan], [self._key])
        if rollout.error == NO_PLAN:
            raise ToolError(rollout.not_a_plan)
        if rollout.error:
            raise ToolError(f"the plan could not be scored: {rollout.error}")
        return {
            "terminal_reward": rollout.terminal_reward,
            "scaled_reward": rollout.scaled_reward,
            "reward_breakdown": dict(rollout.reward_breakdown),
            "broken_rules": list(rollout.broken_rules),
        }


class RemoteToolEnvFactory:
    """TRL's ``environment_factory`` for ``--env-url``: ``factory()`` is a :class:`DentalToolEnv` on
    the server at ``env_url`` (its WebSocket session opened at its first ``reset``). It keeps what it
    made, so that :meth:`close` can close their sessions when training ends: TRL pools its
    environments for the whole run and never closes them; the server would otherwise hold them
    until its idle timeout reaps them."""

    def __init__(self, env_url: str) -> None:
        self.env_url = env_url
        self.made: list[DentalToolEnv] = []

    def __call__(self) -> DentalToolEnv:
        env = DentalToolEnv(env_url=self.env_url)
        self.made.append(env)
        return env

    def close(self) -> int:
        """Close every session made so far; how many environments that was."""
        made, self.made = self.made, []
        for env in made:
            env._close()
        return len(made)


for _name in TOOL_NAMES:  # each tool records its calls in an episode being traced
    setattr(DentalToolEnv, _name, _traced(getattr(StagingTools, _name)))


# --- the dataset and the reward ---------------------------------------------------------------


def plan_stages(plan: dict) -> list[list[dict]]:
    """A plan (the plan format) as the ``groups`` of its 24 stages, for ``commit_stage``: at stage s
    each tooth whose group has started (``priority`` / ``start_stage``) moves its ``fraction``; teeth
    of one fraction share a group. Overcorrection is dropped (a stage stops at the target). What an
    agent following the oracle's plan stage by stage commits (the benchmark's stepwise episode)."""
    spec = normalize_plan(plan)
    stages = []
    for s in range(1, N_STAGES + 1):
        by_fraction: dict[float, list[int]] = {}
        for i, tooth in enumerate(TOOTH_IDS):
            if spec.start[i] <= s and spec.fraction[i] > 0:
                by_fraction.setdefault(float(spec.fraction[i]), []).append(tooth)
        stages.append([{"teeth": teeth, "fraction": f} for f, teeth in sorted(by_fraction.items())])
    return stages
