"""Does each reward carry a GRPO signal, and does it point the clinical way?

GRPO's advantage is a reward's deviation from its group mean: a reward that is flat within a
group teaches nothing. This module builds groups of *plausible* plans for a case (what a policy
that already writes valid plans samples: the oracle's plan perturbed, uniform SLERP variants,
compressed and slowed versions), scores them through the five TRL reward functions exactly as
TRL calls them (completions plus the ``seed``, ``task_id``, ``force_decay`` columns), and
reports per reward:

* ``std`` - the mean within-group standard deviation;
* ``share_informative`` - the share of groups whose std exceeds :data:`MIN_GROUP_STD`;
* ``rank_corr`` - the mean Spearman correlation with ``reward_terminal`` within groups (a reward
  that is a copy of the terminal adds nothing; one that opposes it everywhere is suspect).

``orthojob grpo --test`` prints the report for a few prompts, ``experiments/audits/reward_signal.py`` for
many; ``tests/test_reward_signal.py`` asserts the thresholds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import spearmanr

from orthojob.core.prompts import plan_to_completion
from orthojob.rewards.reward_functions import REWARD_FUNCS
from server.cases import Case, CaseKey, generate_case
from server.clinical_profiles import STRATEGIES
from server.dental_constants import N_STAGES, TOOTH_IDS
from server.oracle import plan_for_case

MIN_GROUP_STD: dict[str, float] = {
    "reward_terminal": 0.1,
    "reward_occlusion": 0.01,
    "reward_strategy": 0.02,
    "reward_format": 0.01,
    "reward_anchorage": 0.01,
}
"""Within-group std above which a group of a reward counts as informative (each reward's own units:
terminal on [-2, 8], the others on [0, 1])."""
MIN_INFORMATIVE_SHARE: float = 0.8
"""Share of groups every reward must be informative in (tests and the smoke's verdict)."""


def _scaled(plan: dict, k: float) -> dict:
    return {
        **plan,
        "tooth_groups": [
            dict(g, fraction=round(min(1.0, g["fraction"] * k), 4)) for g in plan["tooth_groups"]
        ],
    }


def plausible_plans(case: Case, n: int, rng: np.random.Generator) -> list[dict]:
    """``n`` plausible plans for a case: the oracle's plan and its perturbations (each group's
    fraction x U(0.6, 1.4), start moved by up to 3 aligners), uniform SLERP under the optimal, a
    random or no strategy, the oracle compressed (x2, x3) and slowed (x0.5, x0.7)."""
    oracle = plan_for_case(case)
    uniform = {"teeth": list(TOOTH_IDS), "fraction": round(1.0 / N_STAGES, 4)}
    fixed = [
        oracle,
        {"strategy": case.optimal_strategy, "tooth_groups": [uniform]},
        {"strategy": STRATEGIES[int(rng.integers(len(STRATEGIES)))], "tooth_groups": [uniform]},
        {"tooth_groups": [uniform]},
        _scaled(oracle, 2.0),
        _scaled(oracle, 3.0),
        _scaled(oracle, 0.5),
        _scaled(oracle, 0.7),
    ]
    plans = fixed[:n]
    while len(plans) < n:
        groups = []
        for g in oracle["tooth_groups"]:
            g = dict(g, fraction=round(min(1.0, g["fraction"] * float(rng.uniform(0.6, 1.4))), 4))
            if rng.random() < 0.3:
                start = (
                    g.pop("start_stage", None)
                    or {"high": 1, "medium": 7, "low": 13}[g.pop("priority", "high")]
                )
                g["start_stage"] = int(np.clip(start + rng.integers(-3, 4), 1, N_STAGES))
            groups.append(g)
        plans.append({**oracle, "tooth_groups": groups})
    return plans


@dataclass(frozen=True)
class GroupRewards:
    """One group: the case key and each reward's values, (n,) per reward."""

    case: tuple[int, str, bool]
    values: dict[str, np.ndarray]


def score_group(case: Case, plans: Sequence[dict]) -> GroupRewards:
    """Every reward of a group of plans, called as TRL calls them (conversational completions)."""
    completions = [[{"role": "assistant", "content": plan_to_completion(p)}] for p in plans]
    n = len(completions)
    cols = {"seed": [case.seed] * n, "task_id": [case.task_id] * n, "force_decay": [case.force_decay] * n}
    values = {name: np.asarray(f(completions, **cols), dtype=float) for name, f in REWARD_FUNCS.items()}
    return GroupRewards((case.seed, case.task_id, case.force_decay), values)


def signal_groups(cases: Sequence[CaseKey], group_size: int = 32, seed: int = 0) -> list[GroupRewards]:
    """A group of ``group_size`` plausible plans per case (:class:`server.cases.CaseKey`), scored."""
    rng = np.random.default_rng(seed)
    out = []
    for key in cases:
        case = generate_case(*key)
        out.append(score_group(case, plausible_plans(case, group_size, rng)))
    return out


def signal_report(groups: Sequence[GroupRewards]) -> dict[str, dict[str, float]]:
    """Per reward: mean within-group ``std``, ``share_informative`` and mean ``rank_corr`` with terminal."""
    report = {}
    for name in REWARD_FUNCS:
        stds = np.array([g.values[name].std() for g in groups])
        corrs = []
        for g in groups:
            a, b = g.values[name], g.values["reward_terminal"]
            if a.std() > 0 and b.std() > 0:
                corrs.append(float(spearmanr(a, b).statistic))
        report[name] = {
            "std": float(stds.mean()),
            "share_informative": float(np.mean(stds > MIN_GROUP_STD[name])),
            "rank_corr": float(np.mean(corrs)) if corrs else math.nan,
        }
    return report


def format_report(report: dict[str, dict[str, float]], n_groups: int, group_size: int) -> str:
    """The report as a table (what ``orthojob grpo --test`` and the benchmark print)."""
    lines = [
        f"reward signal over {n_groups} groups of {group_size} plausible plans "
        f"(informative: within-group std above the reward's threshold)",
        f"{'reward':<18}{'mean std':>10}{'threshold':>11}{'informative':>13}{'rank corr w/ terminal':>23}",
    ]
    for name, r in report.items():
        lines.append(
            f"{name:<18}{r['std']:>10.4f}{MIN_GROUP_STD[name]:>11.3f}{r['share_informative']:>12.0%}"
            f"{r['rank_corr']:>23.3f}"
        )
    return "\n".join(lines)


__all__ = [
    "MIN_GROUP_STD",
    "MIN_INFORMATIVE_SHARE",
    "GroupRewards",
    "format_report",
    "plausible_plans",
    "score_group",
    "signal_groups",
    "signal_report",
]
