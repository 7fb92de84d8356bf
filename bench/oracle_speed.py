"""The oracle's planning time per case, by dynamics (benchmark, not a test).

Plans ``--seeds`` held-out cases of each level, once with full expression and once under force decay
(where the oracle compensates and relieves colliding overcorrection), in one process, and prints the
milliseconds per case. (:func:`server.oracle.plan_for_case` is not cached: every plan is computed.)

    OMP_NUM_THREADS=1 python bench/oracle_speed.py [--seeds 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.cases import HELDOUT_SEED_START, TASK_IDS, generate_case
from server.oracle import plan_for_case


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20, help="held-out seeds per level")
    args = parser.parse_args(argv)
    for force_decay in (False, True):
        cases = [
            generate_case(task, HELDOUT_SEED_START + s, force_decay)
            for task in TASK_IDS
            for s in range(args.seeds)
        ]
        start = time.perf_counter()
        for case in cases:
            plan_for_case(case)
        ms = (time.perf_counter() - start) / len(cases) * 1000
        print(f"force_decay={force_decay!s:5}  {len(cases)} cases  {ms:6.1f} ms per case")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
