"""The oracle's safety audit on 1,000 seeds per level and dynamics (not a test).

Prints, per (task, force_decay, non_compliance): the oracle's plans breaking a hard rule, its plans
below uniform SLERP, the mean scaled-reward margin over SLERP, uniform SLERP's plans breaking a
hard rule, and seconds. Exit status 1 if the oracle's plan breaks a rule or falls below SLERP, or
uniform SLERP's breaks one with full wear (it ignores non-compliance, so there it is only counted).

    OMP_NUM_THREADS=1 python experiments/audits/oracle_safety.py [--seeds 1000] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.audits.oracle_audit import COMBOS, audit, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1000, help="seeds per combination (from 0)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    args = parser.parse_args(argv)
    bad = 0
    print(f"{'task':12s} {'decay':>5s} {'nc':>3s} {'seeds':>6s} {'breaking':>9s} {'below SLERP':>12s} "
          f"{'margin':>8s} {'SLERP breaking':>15s} {'s':>7s}")  # fmt: skip
    for combo in COMBOS:
        t = time.perf_counter()
        s = summary(audit({combo: range(args.seeds)}, workers=args.workers)[combo])
        # uniform SLERP is a safe baseline only with full wear (it ignores non-compliance)
        bad += len(s["broken"]) + len(s["below_slerp"]) + (0 if combo[2] else len(s["slerp_broken"]))
        print(f"{combo[0]:12s} {int(combo[1]):5d} {int(combo[2]):3d} {s['n']:6d} {len(s['broken']):9d} "
              f"{len(s['below_slerp']):12d} {s['mean_margin']:+8.3f} {len(s['slerp_broken']):15d} {time.perf_counter() - t:7.1f}", flush=True)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
