"""Per-episode metrics of one plan, shared by the learning experiment and GRPO's completion table.

:func:`episode_record` turns one scored plan into what an RL researcher checks beside the reward:
the scaled terminal reward (``scaled_reward``, the headline metric of :mod:`orthojob.core.metrics`), whether
the strategy is the case's optimal one, whether it parsed,
and the clinical **canaries that are not reward functions** (:data:`CANARIES`): per-stage limit
violations, colliding contacts, peak PDL stress (kPa), whether a hard rule broke, and whether the
plan is degenerate (:func:`degenerate_form`: does nothing, moves everything at
once, or puts every treated tooth in one group). The values come from the server's scoring
(``diagnostics``, ``broken_rules``), which the rollout cache already holds for every completion.

:func:`episode_values` is the numeric part (:data:`METRICS`), which the learning experiment
averages with confidence intervals; :func:`rollout_record` does the same for a cached
:class:`orthojob.rewards.rollouts.Rollout`.
"""

from __future__ import annotations

import numpy as np

from orthojob.core.metrics import SCALED_REWARD
from server.cases import Case
from server.dental_constants import MM_PER_DEG, N_STAGES
from server.plans import normalize_plan
from server.reward_scaler import REWARD_MIN
from server.scoring import MOVEMENT_EPS_MM

CANARIES: tuple[str, ...] = (
    "limit_violations",
    "colliding_contacts",
    "peak_pdl_kpa",
    "hard_rule",
    "degenerate",
)
"""Clinical canaries reported beside the reward; none of them is a reward function."""
METRICS: tuple[str, ...] = (SCALED_REWARD, "strategy_accuracy", "parse", *CANARIES)
"""The numeric per-episode metrics (:func:`episode_values`)."""


ALL_AT_ONCE_STAGES: int = 2
"""A plan that moves every treated tooth fully within this many aligners moves it all at once."""


def degenerate_form(case: Case, plan: dict) -> str | None:
    """``"nothing"``, ``"all_at_once"``, ``"one_group"`` or None for a plan on a case."""
    spec = normalize_plan(plan)
    treated = np.hypot(case.need[0], MM_PER_DEG * case.need[1]) > MOVEMENT_EPS_MM
    if not treated.any():
        return None
    f, s = spec.fraction[treated], spec.start[treated]
    if np.all(f <= 0.0):
        return "nothing"
    if np.all(f >= 1.0 / ALL_AT_ONCE_STAGES):
        return "all_at_once"
    if np.unique(np.stack((f, s)), axis=1).shape[1] == 1 and not np.isclose(f[0], 1.0 / N_STAGES, atol=1e-3):
        return "one_group"
    return None


def episode_record(result: dict | None, case: Case, optimal: str) -> dict:
    """:data:`METRICS` of one scored plan plus ``strategy``, ``broken_rules`` (comma-joined) and
    ``degenerate_form`` (None when not degenerate). ``result``: a :func:`server.treatment.score_plans`
    dict with ``plan``; None for a completion that is not a plan (scaled reward -2, canaries NaN)."""

    if result is None:
        nan = float("nan")
        return {
            SCALED_REWARD: REWARD_MIN,
            "strategy_accuracy": 0.0,
            "parse": 0.0,
            **dict.fromkeys(CANARIES, nan),
            "strategy": None,
            "broken_rules": None,
            "degenerate_form": None,
        }
    diag = result["diagnostics"]
    form = degenerate_form(case, result["plan"])
    return {
        SCALED_REWARD: float(result["scaled_reward"]),
        "strategy_accuracy": float(result.get("strategy") == optimal),
        "parse": 1.0,
        "limit_violations": float(diag.get("limit_violations", 0.0)),
        "colliding_contacts": float(diag.get("colliding_contacts", 0.0)),
        "peak_pdl_kpa": float(diag.get("peak_pdl_kpa", 0.0)),
        "hard_rule": float(bool(result["broken_rules"])),
        "degenerate": float(form is not None),
        "strategy": result.get("strategy"),
        "broken_rules": ",".join(str(r) for r in result["broken_rules"]),
        "degenerate_form": form,
    }


def episode_values(result: dict | None, case: Case, optimal: str) -> dict[str, float]:
    """The numeric per-episode metrics (:data:`METRICS`) of one scored plan (see :func:`episode_record`)."""
    record = episode_record(result, case, optimal)
    return {m: record[m] for m in METRICS}


def rollout_record(rollout, case: Case) -> dict:
    """:func:`episode_record` of a cached rollout (:class:`orthojob.rewards.rollouts.Rollout`) on its case."""
    result = (
        None
        if rollout.error
        else {
            "scaled_reward": rollout.scaled_reward,
            "strategy": rollout.strategy,
            "diagnostics": rollout.diagnostics,
            "broken_rules": rollout.broken_rules,
            "plan": rollout.plan,
        }
    )
    return episode_record(result, case, case.optimal_strategy)


__all__ = ["CANARIES", "METRICS", "episode_record", "episode_values", "rollout_record"]
