"""The baselines table (an audit, not a test): the oracle, uniform SLERP, uniform SLERP naming the
oracle's strategy, and doing nothing, on held-out seeds of every level under both dynamics.

Prints, per (task, dynamics) cell and plan: the mean scaled terminal reward (the headline metric,
[-2, 8]) with its 95 % confidence interval, the share of plans breaking a hard rule, and which rules.
Exit status 1 if the order oracle > uniform SLERP > do-nothing fails in any cell, or if the oracle or
uniform SLERP break a rule anywhere.

    OMP_NUM_THREADS=1 python experiments/audits/baselines.py [--seeds 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from server.cases import HELDOUT_SEED_START, TASK_IDS, generate_case
from server.dental_constants import TOOTH_IDS
from server.oracle import plan_for_case
from server.treatment import score_plans

UNIFORM = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 1 / 24}]}
NOTHING = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 0.0}]}


def _ci(values: np.ndarray) -> float:
    return 1.96 * float(values.std(ddof=1)) / np.sqrt(len(values)) if len(values) > 1 else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200, help="held-out seeds per cell")
    args = parser.parse_args(argv)
    print(f"{'task':<12}{'decay':>6}  {'plan':<16}{'scaled':>8}{'95% CI':>9}{'breaking':>10}  rules")
    failures = 0
    t0 = time.perf_counter()
    for force_decay in (False, True):
        for task in TASK_IDS:
            cases = [generate_case(task, HELDOUT_SEED_START + k, force_decay) for k in range(args.seeds)]
            oracle = [plan_for_case(c) for c in cases]
            plans = {
                "oracle": oracle,
                "slerp": [UNIFORM] * len(cases),
                "slerp+strategy": [{**UNIFORM, "strategy": p["strategy"]} for p in oracle],
                "do-nothing": [NOTHING] * len(cases),
            }
            means = {}
            for name, ps in plans.items():
                results = score_plans(ps, cases)
                scaled = np.array([r["scaled_reward"] for r in results])
                rules = Counter(rule for r in results for rule in r["broken_rules"])
                breaking = float(np.mean([bool(r["broken_rules"]) for r in results]))
                means[name] = scaled.mean()
                if name in ("oracle", "slerp") and breaking > 0:
                    failures += 1
                print(
                    f"{task:<12}{int(force_decay):>6}  {name:<16}{scaled.mean():>8.3f}{_ci(scaled):>9.3f}"
                    f"{breaking:>10.3f}  {dict(rules) or ''}"
                )
            if not means["oracle"] > means["slerp"] > means["do-nothing"]:
                failures += 1
                print("    the order oracle > uniform SLERP > do-nothing fails here")
    print(f"\n{failures} failures; {time.perf_counter() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
