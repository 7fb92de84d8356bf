"""Environment metrics of one batch of completions, logged per GRPO step next to TRL's reward metrics:
``env/parse_rate``, ``env/terminal_raw_mean``, ``env/collision_failure_rate``, ``env/pdl_failure_rate``,
``env/limit_failure_rate``, ``env/strategy_accuracy``.
"""

from __future__ import annotations

from collections.abc import Sequence

from orthojob.rewards.rollouts import DEFAULT_CACHE, NO_PLAN
from server.cases import CaseKey, generate_case


def env_diagnostics(texts: Sequence[str], cases: Sequence[CaseKey]) -> dict[str, float]:
    """Environment metrics of one batch of completions on their cases (:class:`server.cases.CaseKey`)."""
    if not texts:
        return {}
    keys = [CaseKey(*c) for c in cases]
    rollouts = DEFAULT_CACHE.get_many(
        list(texts), [k.seed for k in keys], [k.task_id for k in keys], [k.force_decay for k in keys]
    )  # cache hits: the rewards scored them
    n = len(rollouts)
    parsed = [r for r in rollouts if r.error != NO_PLAN and r.plan is not None]
    correct = sum(
        1
        for r, key in zip(rollouts, keys)
        if r.strategy is not None and r.strategy == generate_case(*key).optimal_strategy
    )

    def breaking(rule: str) -> float:
        """Share of the batch breaking a hard rule (a completion that is not a plan counts as failing)."""
        return sum(1 for r in rollouts if r.error is not None or rule in r.broken_rules) / n

    return {
        "env/parse_rate": len(parsed) / n,
        "env/terminal_raw_mean": sum(r.terminal_reward for r in rollouts) / n,
        "env/collision_failure_rate": breaking("collision"),
        "env/pdl_failure_rate": breaking("pdl_stress"),
        "env/limit_failure_rate": breaking("limits"),
        "env/strategy_accuracy": correct / n,
    }
