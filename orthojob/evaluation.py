"""Held-out evaluation: baselines (and, with a model, checkpoints) on unseen seeds.

Baselines (ENVIRONMENT.md §5):
* ``oracle`` - the rule-based clinical stager (:mod:`server.oracle`), the upper baseline;
* ``uniform_slerp`` - every tooth moves 1/24 of its way per stage from stage 1;
* ``do_nothing`` - every fraction 0.

Seeds come from :data:`server.cases.HELDOUT_SEED_START` upwards, never used for training.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from server.cases import HELDOUT_SEED_START, TASK_IDS
from server.dental_constants import TOOTH_IDS
from server.dental_environment import StepwiseDentalEnvironment
from server.oracle import oracle_plan
from server.plans import UNIFORM_FRACTION
from server.treatment import score_plans

log = logging.getLogger(__name__)

UNIFORM_SLERP_PLAN: dict = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": UNIFORM_FRACTION}]}
DO_NOTHING_PLAN: dict = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 0.0}]}
BASELINES: dict[str, Callable[[dict], dict]] = {
    "oracle": oracle_plan,
    "uniform_slerp": lambda obs: UNIFORM_SLERP_PLAN,
    "do_nothing": lambda obs: DO_NOTHING_PLAN,
}
SUMMARY_KEYS: tuple[str, ...] = (
    "terminal_reward",
    "accuracy",
    "occlusion_composite",
    "collision_free",
    "pdl_feasibility",
    "limits_compliance",
    "smoothness",
    "staging",
    "strategy_multiplier",
    "movement_prior",
)


def observations(
    task_id: str, n_seeds: int, seed_start: int = HELDOUT_SEED_START, force_decay: bool = False
) -> list[dict]:
    """Reset observations of ``n_seeds`` consecutive seeds (what a planner sees)."""
    env = StepwiseDentalEnvironment(max_sessions=max(1, n_seeds))
    return [env.reset(task_id, seed_start + i, force_decay) for i in range(n_seeds)]


def summarize(results: Sequence[dict]) -> dict[str, dict[str, float]]:
    """Mean and SD over episodes of the terminal reward and every summary component."""
    out = {}
    for key in SUMMARY_KEYS:
        values = np.array(
            [
                r["terminal_reward"] if key == "terminal_reward" else r["reward_breakdown"][key]
                for r in results
            ]
        )
        out[key] = {"mean": float(values.mean()), "sd": float(values.std(ddof=1)) if len(values) > 1 else 0.0}
    return out


def evaluate_planners(
    planners: dict[str, Callable[[dict], dict]],
    task_ids: Sequence[str] = TASK_IDS,
    n_seeds: int = 200,
    seed_start: int = HELDOUT_SEED_START,
    force_decay: bool = False,
) -> dict:
    """Score each planner on the same held-out cases: ``{task: {planner: summary}}``."""
    report: dict = {}
    for task_id in task_ids:
        obs = observations(task_id, n_seeds, seed_start, force_decay)
        cases = [(task_id, o["seed"], force_decay) for o in obs]
        report[task_id] = {}
        for name, planner in planners.items():
            results = score_plans([planner(o) for o in obs], cases)
            report[task_id][name] = summarize(results)
            log.info("%s %s: terminal %.3f", task_id, name, report[task_id][name]["terminal_reward"]["mean"])
    return report


def evaluate_baselines(
    task_ids: Sequence[str] = TASK_IDS,
    n_seeds: int = 200,
    seed_start: int = HELDOUT_SEED_START,
    force_decay: bool = False,
) -> dict:
    """The three baselines on held-out seeds (see module docstring)."""
    return evaluate_planners(BASELINES, task_ids, n_seeds, seed_start, force_decay)


def format_table(report: dict, n_seeds: int, force_decay: bool = False) -> str:
    """A plain-text table: one row per task and planner, mean ± sd of each summary key."""
    short = {
        "terminal_reward": "terminal",
        "accuracy": "accuracy",
        "occlusion_composite": "occlusion",
        "collision_free": "coll_free",
        "pdl_feasibility": "pdl",
        "limits_compliance": "limits",
        "smoothness": "smooth",
        "staging": "staging",
        "strategy_multiplier": "strat_mult",
        "movement_prior": "prior",
    }
    header = f"{'task':<12}{'planner':<15}" + "".join(f"{short[k]:>14}" for k in SUMMARY_KEYS)
    lines = [
        f"Held-out evaluation: {n_seeds} seeds per task from {HELDOUT_SEED_START}, force_decay={force_decay}; "
        "mean ± sd",
        header,
        "-" * len(header),
    ]
    for task_id, planners in report.items():
        for name, summary in planners.items():
            cells = "".join(f"{summary[k]['mean']:>8.3f}±{summary[k]['sd']:<5.3f}" for k in SUMMARY_KEYS)
            lines.append(f"{task_id:<12}{name:<15}{cells}")
        if {"oracle", "uniform_slerp"} <= planners.keys():
            margin = (
                planners["oracle"]["terminal_reward"]["mean"]
                - planners["uniform_slerp"]["terminal_reward"]["mean"]
            )
            lines.append(f"{'':<12}oracle margin over uniform SLERP: {margin:+.3f}")
    return "\n".join(lines)
