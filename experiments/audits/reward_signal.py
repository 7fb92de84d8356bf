"""Audit: does each GRPO reward carry a within-group signal, in the clinical direction?

Run from the repository root (single process, one BLAS thread)::

    OMP_NUM_THREADS=1 PYTHONPATH=. python experiments/audits/reward_signal.py [--seeds 10] [--group-size 32]

For every task level, both dynamics and ``--seeds`` held-out seeds, a group of ``--group-size``
plausible plans (:func:`orthojob.eval.reward_signal.plausible_plans`: the oracle's plan and its
perturbations, uniform SLERP variants, compressed and slowed versions) is scored through the five
TRL reward functions. Printed per reward: the mean within-group std, the share of groups above
the reward's threshold, the mean Spearman correlation with reward_terminal; then the clinical
directions: anchorage ranks the oracle above everything-at-once and above doing nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from orthojob.core.prompts import plan_to_completion
from orthojob.eval.reward_signal import format_report, signal_groups, signal_report
from orthojob.rewards.reward_functions import reward_anchorage
from server.cases import HELDOUT_SEED_START, TASK_IDS, generate_case
from server.dental_constants import TOOTH_IDS
from server.oracle import plan_for_case


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10, help="held-out seeds per task level and dynamics")
    parser.add_argument("--group-size", type=int, default=32, help="plans per group (a GRPO group)")
    args = parser.parse_args(argv)
    cases = [
        (t, HELDOUT_SEED_START + s, d) for t in TASK_IDS for d in (False, True) for s in range(args.seeds)
    ]
    t0 = time.perf_counter()
    groups = signal_groups(cases, group_size=args.group_size, seed=0)
    print(format_report(signal_report(groups), len(groups), args.group_size))
    print()
    print("anchorage direction (share of cases where the oracle's plan scores higher):")
    everything = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 1.0}]}
    nothing = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 0.0}]}
    for task in TASK_IDS:
        for decay in (False, True):
            vs_all, vs_nothing = [], []
            for s in range(args.seeds):
                case = generate_case(task, HELDOUT_SEED_START + s, decay)
                comps = [plan_to_completion(p) for p in (plan_for_case(case), everything, nothing)]
                cols = {"seed": [case.seed] * 3, "task_id": [task] * 3, "force_decay": [decay] * 3}
                o, a, n = reward_anchorage(comps, **cols)
                vs_all.append(o > a)
                vs_nothing.append(o > n)
            print(
                f"  {task:<12} force_decay={decay!s:<5}  > all at once {np.mean(vs_all):5.0%}"
                f"   > nothing {np.mean(vs_nothing):5.0%}"
            )
    print(f"\n{len(groups)} groups in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
