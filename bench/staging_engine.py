"""The staging engine's cost and guarantees on a corpus of plans (benchmark, not a test).

Per cell (three levels x both dynamics, and task_hard with non-compliance), on seeds from 3,000,000:

* **cost**: a batch of plans mixing safe and breaking ones (:func:`mixed_batch`: the oracle's plan at 2
  decimals, the same with its fractions jittered, uniform staging, every exploit, random plans), timed
  as the engine (:func:`server.staging_engine.execute_plans`, the raw plans' scoring included) over
  plain scoring of the same plans (:func:`server.treatment.score_plan_specs`), best of ``--repeat``;
  the share of the batch's plans left unchanged, repaired, and replaced by the fallback; and the mean
  scaled reward of the raw and of the executed plans;
* **properties** (``--properties``): on the whole corpus (:func:`corpus`), the executed plan breaks no
  rule, a safe plan comes back bit for bit, the executed plan scores the same written as a plan dict,
  and the anti-gaming invariant (:func:`check_properties`). Exit status 1 if any fails.

    OMP_NUM_THREADS=1 python bench/staging_engine.py [--seeds 16] [--batch 256] [--properties]
    OMP_NUM_THREADS=1 python bench/staging_engine.py --properties --seeds 1000   # the full run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from unittest import mock

os.environ.setdefault("OMP_NUM_THREADS", "1")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from server.cases import Case, generate_case
from server.dental_constants import N_STAGES
from server.oracle import plan_for_case
from server.plans import normalize_plan
from server.staging_engine import FALLBACK, REPAIRED, UNCHANGED, engine_reward, execute_plans, spec_to_plan
from server.treatment import score_plan_specs

CELLS: tuple[tuple[str, bool, bool], ...] = (
    *((task, decay, False) for task in ("task_easy", "task_medium", "task_hard") for decay in (False, True)),
    ("task_hard", False, True),
)
"""(task_id, force_decay, non_compliance) of each cell."""
SEED_START: int = 3_000_000
PROPERTY_CHUNK: int = 1024
"""Corpus plans checked per engine call (bounded memory on 1,000 seeds)."""
RANDOM_PLANS: int = 3
"""Random plans per case in the corpus."""


def random_plan(case: Case, rng: np.random.Generator) -> dict:
    """A random plan: 1-4 groups over a random partition of the present teeth, each with a speed (half
    the groups near clinical speeds, half anywhere in [0, 1]), a start, sometimes an overcorrection."""
    teeth = np.array(case.present_ids)
    labels = rng.integers(0, int(rng.integers(1, 5)), teeth.size)
    groups = []
    for g in np.unique(labels):
        fraction = float(rng.uniform(0.02, 0.12) if rng.random() < 0.5 else rng.random())
        group = {
            "teeth": teeth[labels == g].tolist(),
            "fraction": fraction,
            "start_stage": int(rng.integers(1, 13)),
        }
        if rng.random() < 0.3:
            group["overcorrection"] = float(rng.uniform(0.0, 0.6))
        groups.append(group)
    return {"strategy": None, "tooth_groups": groups}


def rounded(plan: dict, decimals: int = 2) -> dict:
    """The plan with its fractions written at ``decimals`` decimals."""
    return {
        **plan,
        "tooth_groups": [{**g, "fraction": round(g["fraction"], decimals)} for g in plan["tooth_groups"]],
    }


def corpus(case: Case, rng: np.random.Generator, oracle: dict | None = None) -> dict[str, dict]:
    """The plans the properties are checked on, by name: random plans; every exploit of
    :func:`orthojob.rewards.plan_search.exploit_plans`; the oracle's plan at 2 decimals; everything in one
    aligner; the oracle's largest group at three times its speed; every tooth frozen but one."""
    from orthojob.rewards import plan_search

    oracle = plan_for_case(case) if oracle is None else oracle
    with mock.patch.object(plan_search, "plan_for_case", lambda c: oracle):  # computed once above
        exploits = plan_search.exploit_plans(case)
    plans = {f"random_{k}": random_plan(case, rng) for k in range(RANDOM_PLANS)}
    plans.update({f"exploit_{name}": plan for name, plan in exploits.items()})
    plans["oracle_2dp"] = rounded(oracle)
    plans["one_aligner"] = {"tooth_groups": [{"teeth": case.present_ids, "fraction": 1.0}]}
    groups = oracle["tooth_groups"]
    big = max(range(len(groups)), key=lambda g: len(groups[g]["teeth"]))
    plans["group_x3"] = {
        **oracle,
        "tooth_groups": [
            {**g, "fraction": min(1.0, 3 * g["fraction"])} if k == big else g for k, g in enumerate(groups)
        ],
    }
    present = case.present_ids
    one = present[int(rng.integers(len(present)))]
    plans["frozen_but_one"] = {
        "tooth_groups": [
            {"teeth": [one], "fraction": float(rng.uniform(1.0 / N_STAGES, 0.25))},
            {"teeth": [t for t in present if t != one], "fraction": 0.0},
        ]
    }
    return plans


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


def check_properties(plans: list[dict], cases: list[Case]) -> dict[str, int]:
    """Failures of each property over plans on their cases (0 everywhere when the engine holds):

    * ``unsafe``: an executed plan that breaks a rule (or a record claiming safety it has not);
    * ``not_identical``: a safe raw plan not returned as itself, or its record not ``unchanged``;
    * ``dict_mismatch``: the executed plan written as a plan dict not reading back to its arrays;
    * ``gaming``: a plan whose engine reward exceeds that of its executed plan written directly (as a
      plan dict, scored afresh: it must come back unchanged), or a repaired plan's not strictly below it.
    """
    specs = [normalize_plan(p) for p in plans]
    run = execute_plans(specs, cases)
    fails = {"unsafe": 0, "not_identical": 0, "dict_mismatch": 0, "gaming": 0}
    for spec, executed, record, result, raw, case in zip(
        specs, run.specs, run.records, run.results, run.raw_results, cases
    ):
        fails["unsafe"] += bool(result["broken_rules"]) or not record.safe
        if not raw["broken_rules"]:
            fails["not_identical"] += executed is not spec or record.status != UNCHANGED
        back = normalize_plan(spec_to_plan(executed, case.absent))
        fails["dict_mismatch"] += not (
            np.array_equal(back.start, executed.start)
            and np.array_equal(back.fraction, executed.fraction)
            and np.array_equal(back.overcorrections(), executed.overcorrections())
        )
    # the executed plans written directly, as plan dicts, scored afresh
    again = execute_plans(
        [normalize_plan(spec_to_plan(e, c.absent)) for e, c in zip(run.specs, cases)], cases
    )
    for k, (record, again_record) in enumerate(zip(run.records, again.records)):
        direct = engine_reward(again.raw_results[k], again.results[k], again_record)
        mine = engine_reward(run.raw_results[k], run.results[k], record)
        bad = again_record.status != UNCHANGED and record.safe
        bad |= mine > direct or (record.status == REPAIRED and not mine < direct)
        fails["gaming"] += bool(bad)
    return fails


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=16, help="cases per cell (from 3,000,000)")
    parser.add_argument("--batch", type=int, default=256, help="plans in the timed batch per cell")
    parser.add_argument("--repeat", type=int, default=3, help="timings per measure (the best is kept)")
    parser.add_argument("--properties", action="store_true", help="check the properties on the corpus")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    bad = 0
    head = f"{'ratio':>5s} {'unch':>5s} {'rep':>5s} {'fall':>5s} {'raw':>5s} {'exec':>5s}"
    print(f"{'':22s} | planner batch ({args.batch} plans){'':12s}| adversarial batch")
    print(f"{'task':12s} {'decay':>5s} {'nc':>3s} | {head} | {head}  properties (corpus plans: failures)")
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
        if args.properties:
            corpus_plans, corpus_cases = [], []
            for case, oracle in zip(cases, oracles):
                for plan in corpus(case, rng, oracle).values():
                    corpus_plans.append(plan)
                    corpus_cases.append(case)
            fails = dict.fromkeys(("unsafe", "not_identical", "dict_mismatch", "gaming"), 0)
            for lo in range(0, len(corpus_plans), PROPERTY_CHUNK):
                part = check_properties(
                    corpus_plans[lo : lo + PROPERTY_CHUNK], corpus_cases[lo : lo + PROPERTY_CHUNK]
                )
                fails = {k: fails[k] + part[k] for k in fails}
            bad += sum(fails.values())
            line += f"  {len(corpus_plans)}: " + " ".join(f"{k}={v}" for k, v in fails.items())
        print(line, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
