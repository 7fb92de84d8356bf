"""What each GRPO objective asks of a group: from a run's sampled completions (``completions.jsonl``),
re-scored with the staging engine, the within-group correlation of each objective's advantage with how
fast the plan moves the teeth (its groups' mean fraction), and the repairs the samples needed.

Objectives: ``raw`` (the plan as written), ``executed`` (the plan the engine executes, no cost) and
``engine x s`` (the executed plan less ``s`` times the engine's repair cost,
:meth:`orthojob.rewards.rollouts.Rollout.objective_at`). A negative correlation means the objective pays a
group's slower plans above its faster ones: GRPO then learns to move less.

    OMP_NUM_THREADS=1 python -m experiments.learning.objective_signal runs/learn/grpo_bc/completions.jsonl [--steps 1 10] [--scales 1 0.25]
"""

from __future__ import annotations

import argparse
import collections
import json
from collections.abc import Sequence

import numpy as np

from orthojob.rewards.rollouts import score_texts
from server.cases import CaseKey


def mean_fraction(plan: dict | None) -> float:
    """A plan's groups' mean fraction (its speed, share of the movement a stage); NaN for no plan."""
    try:
        return float(np.mean([float(g.get("fraction", 0.0)) for g in plan["tooth_groups"]]))
    except (TypeError, KeyError, ValueError):
        return float("nan")


def within_group_correlation(values: np.ndarray, speed: np.ndarray, groups: Sequence[np.ndarray]) -> float:
    """Mean over groups (with spread in both) of corr(value - group mean, speed - group mean)."""
    out = []
    for idx in groups:
        v, m = values[idx] - values[idx].mean(), speed[idx] - np.nanmean(speed[idx])
        if np.all(np.isfinite(m)) and v.std() > 0 and m.std() > 0:
            out.append(np.corrcoef(v, m)[0, 1])
    return float(np.mean(out)) if out else float("nan")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="experiments.learning.objective_signal", description=__doc__.splitlines()[0]
    )
    parser.add_argument("completions", help="a GRPO run's completions.jsonl")
    parser.add_argument("--steps", type=int, nargs=2, default=(1, 10), help="first and last step read")
    parser.add_argument("--scales", type=float, nargs="+", default=(1.0, 0.25), help="repair-cost scales")
    args = parser.parse_args(argv)
    lo, hi = args.steps
    with open(args.completions, encoding="utf-8") as fh:
        rows = [r for r in map(json.loads, fh) if lo <= r["step"] <= hi]
    keys = [CaseKey(r["task_id"], r["seed"], r["force_decay"]) for r in rows]
    rolls = score_texts([r["completion"] for r in rows], keys, engine=True)
    status = collections.Counter(r.repair["status"] if r.repair else "not a plan" for r in rolls)
    speed = np.array([mean_fraction(r.plan) for r in rolls])
    by_group = collections.defaultdict(list)
    for k, r in enumerate(rows):
        by_group[(r["step"], r["seed"], r["task_id"], r["force_decay"])].append(k)
    groups = [np.array(v) for v in by_group.values() if len(v) > 1]
    objectives = {"raw": np.array([r.scaled_reward for r in rolls]),
                  "executed": np.array([r.shipped.scaled_reward for r in rolls])}  # fmt: skip
    for s in args.scales:
        objectives[f"engine x {s:g}"] = np.array([r.objective_at(s).scaled_reward for r in rolls])
    repaired = [r for r in rolls if r.repair and r.repair["status"] == "repaired"]
    print(f"steps {lo}-{hi}: {len(rows)} samples in {len(groups)} groups; engine: {dict(status)}")
    if repaired:
        changed = np.mean([r.repair["changed_share"] for r in repaired])
        print(f"repaired samples: raw {np.mean([r.scaled_reward for r in repaired]):.2f} -> executed "
              f"{np.mean([r.shipped.scaled_reward for r in repaired]):.2f}, changed share {changed:.3f}")  # fmt: skip
    print("| objective | mean | within-group corr(advantage, speed) |\n| --- | --- | --- |")
    for name, values in objectives.items():
        print(f"| {name} | {values.mean():.2f} | {within_group_correlation(values, speed, groups):+.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
