"""The agentic tools as a verifiers ``Toolset`` (an MCP server verifiers launches per rollout).

Each tool is :class:`orthojob.agentic.tools.DentalToolEnv`'s (so :class:`server.agent_tools.StagingTools`'),
on the episode of the rollout's case (``setup_task``); after every call the episode's standing goes
to the rollout's state (:class:`EpisodeState`), which the task's ``reward_agentic`` reads: the
environment-owned reward TRL's ``reward_agentic`` gives the same episode.

Run by verifiers as ``python -m orthorl_aligner.tools``.
"""

from __future__ import annotations

from typing import Any

import verifiers.v1 as vf

from orthojob.agentic.tools import DentalToolEnv
from server.agent_tools import TOOL_NAMES, StagingTools


class EpisodeState(vf.State):
    """What the tools leave on the rollout: calls made, how the episode finished, its reward."""

    tool_calls: int = 0
    finished_by: str | None = None
    reward: float | None = None


def _doc(name: str) -> str:
    return getattr(StagingTools, name).__doc__ or ""


class StagingToolset(vf.Toolset[vf.ToolsetConfig, EpisodeState]):
    """The six agentic tools on one case's episode (their names bare, as TRL's)."""

    TOOL_PREFIX = None

    async def setup_task(self, task: Any) -> None:
        data = getattr(task, "data", task)  # verifiers hands the server the task's data
        self._env = DentalToolEnv()
        self._env.reset(seed=int(data.seed), task_id=data.task_id, force_decay=bool(data.force_decay))

    def _after(self, text: str) -> str:
        state = self.state
        state.tool_calls += 1
        if self._env.finished:
            state.finished_by, state.reward = self._env.metrics.finished_by, self._env.reward
        return text

    @vf.tool
    async def inspect_tooth(self, tooth_id: int) -> str:
        return self._after(self._env.inspect_tooth(tooth_id))

    @vf.tool
    async def simulate_stage(self, groups: list[dict], strategy: str | None = None) -> str:
        return self._after(self._env.simulate_stage(groups, strategy))

    @vf.tool
    async def check_collisions(self, groups: list[dict] | None = None) -> str:
        return self._after(self._env.check_collisions(groups))

    @vf.tool
    async def commit_stage(self, groups: list[dict], strategy: str | None = None) -> str:
        return self._after(self._env.commit_stage(groups, strategy))

    @vf.tool
    async def rollback_stage(self) -> str:
        return self._after(self._env.rollback_stage())

    @vf.tool
    async def submit_plan(self, plan: str) -> str:
        return self._after(self._env.submit_plan(plan))


for _name in TOOL_NAMES:
    getattr(StagingToolset, _name).__doc__ = _doc(_name)

if __name__ == "__main__":
    StagingToolset.run()
