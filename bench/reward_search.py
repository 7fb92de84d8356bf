"""Benchmark: an optimiser's attack on the reward (hill climbing over plans, as GRPO would climb).

Run from the repository root (single process, one BLAS thread)::

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/reward_search.py [--seeds 20] [--rounds 30]

For every task level and ``--seeds`` held-out seeds (dynamics alternate between ideal and force
decay), :func:`orthojob.plan_search.search_case` hill-climbs the summed five TRL rewards from
uniform SLERP, from the oracle's plan and from a random plan, ``--rounds`` rounds of 48 proposals
each. Printed per level and start: how often the best plan found beats the oracle's summed reward
(and by how much), how often it breaks a hard rule or is a degenerate form (nothing, everything
at once, one group), and the best plan's terminal against the oracle's. A reward an optimiser
can game shows here as a found plan above the oracle that breaks a rule or is degenerate.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from orthojob.plan_search import search_case
from server.cases import HELDOUT_SEED_START, TASK_IDS, generate_case

STARTS: tuple[str, ...] = ("slerp", "oracle", "random")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="held-out seeds per task level")
    parser.add_argument("--rounds", type=int, default=30, help="hill-climbing rounds per search")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    print(
        f"{'level':<12}{'start':<8}{'searches':>9}{'beat oracle':>12}{'by (mean)':>10}"
        f"{'break a rule':>13}{'degenerate':>11}{'found terminal':>15}{'oracle terminal':>16}"
    )
    dishonest = 0
    for task in TASK_IDS:
        results = {s: [] for s in STARTS}
        for k in range(args.seeds):
            case = generate_case(task, HELDOUT_SEED_START + k, k % 2 == 1)
            for start in STARTS:
                results[start].append(search_case(case, start, args.rounds, rng))
        for start, rs in results.items():
            beat = [r for r in rs if r.beats_oracle]
            bad = [r for r in beat if r.broken_rules or r.degenerate]
            dishonest += len(bad)
            margin = np.mean([r.best_total - r.oracle_total for r in beat]) if beat else 0.0
            print(
                f"{task:<12}{start:<8}{len(rs):>9}{len(beat):>12}{margin:>+10.3f}"
                f"{sum(bool(r.broken_rules) for r in rs):>13}{sum(r.degenerate is not None for r in rs):>11}"
                f"{np.mean([r.best_terminal for r in rs]):>15.3f}{np.mean([r.oracle_terminal for r in rs]):>16.3f}"
            )
            for r in bad:
                print(f"    above the oracle and dishonest: {r.case} {r.broken_rules} {r.degenerate}")
    evaluations = 3 * len(TASK_IDS) * args.seeds * (1 + args.rounds * 48)
    print(f"\nplans found above the oracle that break a rule or are degenerate: {dishonest}")
    print(f"{evaluations} plans scored in {time.perf_counter() - t0:.0f} s")
    return 1 if dishonest else 0


if __name__ == "__main__":
    raise SystemExit(main())
