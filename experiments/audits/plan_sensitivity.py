"""How much imprecision the oracle's plans survive, and what the robust demonstrations gain.

For held-out cases over the three levels and both dynamics, scores the oracle's plan as written,
with every fraction rounded to two decimals, with relative noise on every fraction (what a small
model's imprecise numbers do), and with each group's duration (1 / fraction, in aligners) off by
one either way; then the same noise on :func:`orthojob.data.robust_plans.robust_plan`'s choice.
Prints the mean scaled reward and the share that breaks a hard rule, and which rules; then, per
cell, the oracle's and the robust choice's mean as written and how often each candidate was chosen.

    OMP_NUM_THREADS=1 python experiments/audits/plan_sensitivity.py [--seeds 12] [--noise 0.05] [--draws 6]
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.learning.report import cell_name
from orthojob.data.robust_plans import robust_plan
from server.cases import HELDOUT_SEED_START, TASK_IDS, CaseKey, generate_case
from server.oracle import plan_for_case
from server.treatment import score_plans


def _with_fractions(plan: dict, change) -> dict:
    out = copy.deepcopy(plan)
    for g in out["tooth_groups"]:
        g["fraction"] = float(np.clip(change(g["fraction"]), 0.0, 1.0))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=12, help="held-out seeds per (level x dynamics) cell")
    parser.add_argument("--noise", type=float, default=0.05, help="relative noise on each fraction")
    parser.add_argument("--draws", type=int, default=6, help="noisy copies per case")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    rows: dict[str, list[tuple[float, tuple]]] = {}
    chosen: Counter = Counter()
    by_cell: dict[str, dict[str, list]] = {}
    start = time.perf_counter()
    for force_decay in (False, True):
        for task_id in TASK_IDS:
            for seed in range(HELDOUT_SEED_START, HELDOUT_SEED_START + args.seeds):
                key = CaseKey(task_id, seed, force_decay)
                case = generate_case(*key)
                oracle = plan_for_case(case)
                robust, name = robust_plan(oracle, key, case.present_ids)
                chosen[name] += 1
                cell = by_cell.setdefault(
                    cell_name(key),
                    {"oracle as written": [], "robust choice as written": [], "choices": Counter()},
                )
                cell["choices"][name] += 1

                def noisy(plan: dict) -> list[dict]:
                    return [
                        _with_fractions(plan, lambda f: round(f * (1 + rng.normal(0, args.noise)), 4))
                        for _ in range(args.draws)
                    ]

                def off_by_one(f: float) -> float:
                    return 1.0 / max(1, math.ceil(1.0 / f - 1e-9) + int(rng.integers(-1, 2))) if f > 0 else f

                plans = {
                    "oracle as written": [oracle],
                    "oracle, fractions to 2 decimals": [_with_fractions(oracle, lambda f: round(f, 2))],
                    f"oracle, ±{args.noise:.0%} noise": noisy(oracle),
                    "oracle, durations ±1 aligner": [
                        _with_fractions(oracle, off_by_one) for _ in range(args.draws)
                    ],
                    "robust choice as written": [robust],
                    f"robust choice, ±{args.noise:.0%} noise": noisy(robust),
                }
                flat = [p for group in plans.values() for p in group]
                results = iter(score_plans(flat, [key] * len(flat)))
                for label, group in plans.items():
                    for _ in group:
                        r = next(results)
                        rows.setdefault(label, []).append((r["scaled_reward"], tuple(r["broken_rules"])))
                        if label in cell:
                            cell[label].append(r["scaled_reward"])
    cases = 2 * len(TASK_IDS) * args.seeds
    print(
        f"{cases} held-out cases (3 levels x 2 dynamics x {args.seeds} seeds), {time.perf_counter() - start:.1f} s"
    )
    print(f"{'plan':36s} {'scaled':>7s} {'breaks a rule':>14s}  rules broken")
    for label, values in rows.items():
        scaled = np.mean([v for v, _ in values])
        broken = np.mean([bool(b) for _, b in values])
        rules = Counter(rule for _, b in values for rule in b)
        print(f"{label:36s} {scaled:7.3f} {broken:14.3f}  {dict(rules.most_common())}")
    print(f"robust choices: {dict(chosen)}")
    print("per cell, mean scaled reward as written: oracle, robust choice; the robust choices")
    for name, cell in by_cell.items():
        means = [np.mean(cell[label]) for label in ("oracle as written", "robust choice as written")]
        print(f"{name:24s} {means[0]:7.3f} {means[1]:7.3f}  {dict(cell['choices'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
