"""The environment's reward as an OpenEnv rubric (openenv-core's ``Rubric``, RFC 004) of named parts.

The rubric reads what the environment computed -- it scores nothing itself (:mod:`server.scoring`
does, once): ``step`` is the stage's ``step_reward``, ``terminal`` the episode's
``terminal_reward`` on the last stage (0 before), and their sum is the observation's ``reward``.
``components`` holds one child per scoring component of ``reward_breakdown`` (accuracy,
occlusion, collisions, ...), for introspection: after a call each child's ``last_score`` is that
component on this observation (0 where the observation does not carry it yet). So a trainer can
log ``for name, r in env.rubric.named_rubrics(): r.last_score``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from openenv.core.rubrics import Rubric, RubricDict

from server.cases import CaseKey
from server.treatment import score_plans


def _field(observation: Any, name: str) -> Any:
    if isinstance(observation, Mapping):
        return observation.get(name)
    return getattr(observation, name, None)


class ObservationValue(Rubric):
    """One number the environment put in the observation: a top-level field, or a
    ``reward_breakdown`` entry (``component=True``); 0 when absent (None)."""

    def __init__(self, name: str, component: bool = False):
        super().__init__()
        self.name, self.component = name, component

    def forward(self, action: Any, observation: Any) -> float:
        if self.component:
            value = (_field(observation, "reward_breakdown") or {}).get(self.name)
        else:
            value = _field(observation, self.name)
        return 0.0 if value is None else float(value)


class TerminalReward(ObservationValue):
    """The episode's ``terminal_reward``, counted on the observation that ends it."""

    def __init__(self):
        super().__init__("terminal_reward")

    def forward(self, action: Any, observation: Any) -> float:
        return super().forward(action, observation) if _field(observation, "done") else 0.0


@functools.cache
def component_names() -> tuple[str, ...]:
    """The names of the scoring components (``reward_breakdown``'s keys of a scored episode)."""
    (result,) = score_plans([{}], [CaseKey("task_easy", 0)])
    return tuple(result["reward_breakdown"])


class StagingRubric(Rubric):
    """``step + terminal`` of an observation, with every scoring component as a named child."""

    def __init__(self):
        super().__init__()
        self.step = ObservationValue("step_reward")
        self.terminal = TerminalReward()
        self.components = RubricDict(
            {name: ObservationValue(name, component=True) for name in component_names()}
        )

    def forward(self, action: Any, observation: Any) -> float:
        for child in self.components.values():
            child(action, observation)
        return self.step(action, observation) + self.terminal(action, observation)


__all__ = ["ObservationValue", "StagingRubric", "TerminalReward", "component_names"]
