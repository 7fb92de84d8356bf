"""The staging engine's cost (benchmark, not a test; its guarantees are audited by
``python -m experiments.audits.engine_properties``).

Per cell (three levels x both dynamics, and task_hard with non-compliance), on seeds from 3,000,000: a
batch of plans mixing safe and breaking ones (:func:`mixed_batch`: the oracle's plan at 2 decimals, the
same with its fractions jittered, and, in the adversarial batch, uniform staging, an exploit and a
random plan), timed as the engine (:func:`server.staging_engine.execute_plans`, the raw plans' scoring
included) over plain scoring of the same plans (:func:`server.treatment.score_plan_specs`), best of
``--repeat``; the share of the batch's plans left unchanged, repaired, and replaced by the fallback; and
the mean scaled reward of the raw and of the executed plans.

    OMP_NUM_THREADS=1 python bench/staging_engine.py [--seeds 16] [--batch 256] [--repeat 3]
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

import numpy as np

from experiments.audits.engine_properties import CELLS, SEED_START, corpus, random_plan, rounded
from server.cases import Case, generate_case
from server.dental_constants import N_STAGES
from server.oracle import plan_for_case
from server.plans import normalize_plan
from server.staging_engine import FALLBACK, REPAIRED, UNCHANGED, execute_plans
from server.treatment import score_plan_specs


def mixed_batch(
    cases: list[Case], oracles: list[dict], rng: np.random.Generator, size: int, adversarial: bool = True
) -> tuple[list, list]:
    """``size`` (plan, case) pairs mixing safe and breaking plans, drawn in turn: the oracle at 2
    decimals and the oracle with each fraction jittered by up to 10 % (a planner's imprecision), and,
    ``adversarial``, uniform staging, one exploit and one random plan too."""
    plans, batch_cases = [], []
    for k in range(size):
        case, oracle = cases[k % len(cases)], oracles[k % len(cases)]
        kind = k % (5 if adversarial else 2)
        if kind == 0:
            plan = rounded(oracle)
        elif kind == 1:
            plan = {
                **oracle,
                "tooth_groups": [
                    {**g, "fraction": min(1.0, g["fraction"] * float(rng.uniform(0.9, 1.1)))}
                    for g in oracle["tooth_groups"]
                ],
            }
        elif kind == 2:
            plan = {
                "strategy": oracle.get("strategy"),
                "tooth_groups": [{"teeth": case.present_ids, "fraction": 1 / N_STAGES}],
            }
        elif kind == 3:
            plan = list(corpus(case, rng, oracle).values())[int(rng.integers(3, 8))]
        else:
            plan = random_plan(case, rng)
        plans.append(plan)
        batch_cases.append(case)
    return plans, batch_cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=16, help="cases per cell (from 3,000,000)")
    parser.add_argument("--batch", type=int, default=256, help="plans in the timed batch per cell")
    parser.add_argument("--repeat", type=int, default=3, help="timings per measure (the best is kept)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    head = f"{'ratio':>5s} {'unch':>5s} {'rep':>5s} {'fall':>5s} {'raw':>5s} {'exec':>5s}"
    print(f"{'':22s} | planner batch ({args.batch} plans){'':12s}| adversarial batch")
    print(f"{'task':12s} {'decay':>5s} {'nc':>3s} | {head} | {head}")
    for task, decay, nc in CELLS:
        cases = [generate_case(task, SEED_START + s, decay, nc) for s in range(args.seeds)]
        oracles = [plan_for_case(c) for c in cases]
        line = f"{task:12s} {int(decay):5d} {int(nc):3d}"
        for adversarial in (False, True):
            plans, batch_cases = mixed_batch(cases, oracles, rng, args.batch, adversarial)
            specs = [normalize_plan(p) for p in plans]
            plain = engine = np.inf
            for _ in range(args.repeat):
                t = time.perf_counter()
                score_plan_specs(specs, batch_cases)
                plain = min(plain, time.perf_counter() - t)
                t = time.perf_counter()
                run = execute_plans(specs, batch_cases)
                engine = min(engine, time.perf_counter() - t)
            status = [r.status for r in run.records]
            shares = [status.count(s) / len(status) for s in (UNCHANGED, REPAIRED, FALLBACK)]
            raw = np.mean([r["scaled_reward"] for r in run.raw_results])
            executed = np.mean([r["scaled_reward"] for r in run.results])
            line += f" | {engine / plain:5.2f} " + " ".join(f"{s:5.3f}" for s in shares)
            line += f" {raw:5.2f} {executed:5.2f}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
