"""Audit: an optimiser's attack on the reward (hill climbing over plans, as GRPO would climb).

Run from the repository root (single process, one BLAS thread)::

    OMP_NUM_THREADS=1 PYTHONPATH=. python experiments/audits/reward_search.py [--seeds 20] [--rounds 30] [--generations 20]
        [--seed-start 1000000]

For every task level and ``--seeds`` held-out seeds (dynamics alternate between ideal and force
decay) and every objective (the five TRL rewards summed at the default weights, at ``make learn``'s
weights, and with the staging engine in the loop (``sum_engine``: GRPO's ``--objective engine``; the hard
rules are still judged on the plan as written), and the scaled terminal alone): :func:`experiments.audits.plan_search.search_case` hill-climbs from
uniform SLERP, from the oracle's plan and from a random plan, ``--rounds`` rounds of 48 proposals
each, and :func:`experiments.audits.plan_search.population_search` evolves per-tooth plans (start, duration,
overcorrection) for ``--generations`` generations, once from the oracle, SLERP and random plans and
once seeded with :func:`experiments.audits.plan_search.exploit_plans` too (the plans an optimiser was seen to
exploit: one aligner, the oracle at 3x, the mirrored malocclusion, rushed incisors, the strategy's
first level unmoved). Printed per level, objective and search: how
often the best plan found beats the oracle on that objective (and by how much), how often it breaks
a hard rule or is a degenerate form (nothing, everything at once, one group), how often it beats
the oracle on the objective with a lower terminal, and the best plan's terminal against the
oracle's. A reward an optimiser can game shows here as a found plan above the oracle that breaks a
rule or is degenerate. Exit status 1 if any such plan is found.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from experiments.audits.plan_search import exploit_plans, population_search, search_case
from experiments.learning.experiment import LearnConfig
from server.cases import HELDOUT_SEED_START, TASK_IDS, generate_case

STARTS: tuple[str, ...] = ("slerp", "oracle", "random", "population", "exploits")
OBJECTIVES: dict[str, tuple[dict | None, str]] = {
    "sum": (None, "sum"),
    "sum_learn": ({"reward_strategy": LearnConfig().strategy_weight}, "sum"),
    "sum_engine": (None, "sum_engine"),
    "terminal": (None, "terminal"),
}
"""Objective name -> (reward weights, target) of :func:`experiments.audits.plan_search.objective`."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="held-out seeds per task level")
    parser.add_argument(
        "--seed-start",
        type=int,
        default=HELDOUT_SEED_START,
        help="first seed (default the tuning range's start; an audit names a range no default was chosen on, "
        "e.g. 4000000 in server.seed_ranges.AUDITS)",
    )
    parser.add_argument("--rounds", type=int, default=30, help="hill-climbing rounds per search")
    parser.add_argument("--generations", type=int, default=20, help="population-search generations")
    parser.add_argument("--objectives", default=",".join(OBJECTIVES), help="comma-separated objectives")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    print(
        f"{'level':<12}{'objective':<11}{'search':<11}{'runs':>5}{'beat oracle':>12}{'by (mean)':>10}"
        f"{'break a rule':>13}{'degenerate':>11}{'lower term.':>12}{'found terminal':>15}{'oracle terminal':>16}"
    )
    dishonest = 0
    evaluations = 0
    for task in TASK_IDS:
        for name in args.objectives.split(","):
            weights, target = OBJECTIVES[name]
            results = {s: [] for s in STARTS}
            for k in range(args.seeds):
                case = generate_case(task, args.seed_start + k, k % 2 == 1)
                for start in STARTS:
                    if start == "population":
                        r = population_search(case, args.generations, rng, weights, target)
                    elif start == "exploits":
                        seeds = list(exploit_plans(case).values())
                        r = population_search(case, args.generations, rng, weights, target, seeds)
                    else:
                        r = search_case(case, start, args.rounds, rng, weights, target)
                    results[start].append(r)
                    evaluations += r.evaluations
            for start, rs in results.items():
                beat = [r for r in rs if r.beats_oracle]
                # the best plan above the oracle, and a population search's whole last population there
                bad = [
                    r
                    for r in rs
                    if (r.beats_oracle and (r.broken_rules or r.degenerate))
                    or any(b or d for _, b, d in r.above_oracle)
                ]
                dishonest += len(bad)
                margin = np.mean([r.best_total - r.oracle_total for r in beat]) if beat else 0.0
                lower = sum(r.best_terminal < r.oracle_terminal for r in beat)
                print(
                    f"{task:<12}{name:<11}{start:<11}{len(rs):>5}{len(beat):>12}{margin:>+10.3f}"
                    f"{sum(bool(r.broken_rules) for r in rs):>13}{sum(r.degenerate is not None for r in rs):>11}"
                    f"{lower:>12}{np.mean([r.best_terminal for r in rs]):>15.3f}"
                    f"{np.mean([r.oracle_terminal for r in rs]):>16.3f}"
                )
                for r in bad:
                    print(f"    above the oracle and dishonest: {r.case} {r.broken_rules} {r.degenerate}")
    print(f"\nplans found above the oracle that break a rule or are degenerate: {dishonest}")
    print(f"{evaluations} plans scored in {time.perf_counter() - t0:.0f} s")
    return 1 if dishonest else 0


if __name__ == "__main__":
    raise SystemExit(main())
