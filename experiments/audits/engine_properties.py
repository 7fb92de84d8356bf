"""The staging engine's guarantees on a corpus of plans (an audit, not a test; the fast version is
``tests/test_staging_engine.py``; the engine's cost is ``bench/staging_engine.py``).

Per cell (three levels x both dynamics, and task_hard with non-compliance), on seeds from 3,000,000, on
the whole corpus (:func:`corpus`): the executed plan breaks no rule, a safe plan comes back bit for bit,
the executed plan scores the same written as a plan dict, and the anti-gaming invariant
(:func:`check_properties`); with ``--checkpoint``, the corpus also holds ``--samples`` completions per
case sampled at temperature 1 from a trained checkpoint (:func:`checkpoint_samples`: those that read as
a plan; the others are counted, not scored). Per cell: the corpus plans, of which checkpoint samples,
how many the engine changed (repaired + fallback), and each property's failures; each failing plan is
printed (cell, seed, corpus name, JSON). Exit status 1 if any fails.

    OMP_NUM_THREADS=1 python -m experiments.audits.engine_properties [--seeds 100]
    OMP_NUM_THREADS=1 python -m experiments.audits.engine_properties --seeds 1000 --checkpoint DIR [--samples 2]
"""

from __future__ import annotations

import argparse
import json
import os
from unittest import mock

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from server.cases import Case, generate_case
from server.dental_constants import N_STAGES
from server.oracle import plan_for_case
from server.plans import normalize_plan
from server.staging_engine import FALLBACK, REPAIRED, UNCHANGED, engine_reward, execute_plans, spec_to_plan

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
SAMPLE_CHUNK: int = 64
"""Cases whose checkpoint samples are generated together (bounded memory on 1,000 seeds)."""
SAMPLE_BATCH: int = 16
"""Prompts per generation call (each with ``--samples`` sequences)."""


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
    :func:`experiments.audits.plan_search.exploit_plans`; the oracle's plan at 2 decimals; everything in one
    aligner; the oracle's largest group at three times its speed; every tooth frozen but one."""
    from experiments.audits import plan_search

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


PROPERTIES: tuple[str, ...] = ("unsafe", "not_identical", "dict_mismatch", "gaming")
"""The properties :func:`check_properties` counts failures of."""


def property_failures(plans: list[dict], cases: list[Case]) -> tuple[dict[str, np.ndarray], list[str]]:
    """Which plans fail each property of :func:`check_properties` (name -> (n_plans,) bool), and the
    engine's record status of each plan (``unchanged``, ``repaired`` or ``fallback``)."""
    specs = [normalize_plan(p) for p in plans]
    run = execute_plans(specs, cases)
    fails = {name: np.zeros(len(plans), bool) for name in PROPERTIES}
    for k, (spec, executed, record, result, raw, case) in enumerate(
        zip(specs, run.specs, run.records, run.results, run.raw_results, cases)
    ):
        fails["unsafe"][k] = bool(result["broken_rules"]) or not record.safe
        if not raw["broken_rules"]:
            fails["not_identical"][k] = executed is not spec or record.status != UNCHANGED
        back = normalize_plan(spec_to_plan(executed, case.absent))
        fails["dict_mismatch"][k] = not (
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
        fails["gaming"][k] = bool(bad)
    return fails, [r.status for r in run.records]


def check_properties(plans: list[dict], cases: list[Case]) -> dict[str, int]:
    """Failures of each property over plans on their cases (0 everywhere when the engine holds):

    * ``unsafe``: an executed plan that breaks a rule (or a record claiming safety it has not);
    * ``not_identical``: a safe raw plan not returned as itself, or its record not ``unchanged``;
    * ``dict_mismatch``: the executed plan written as a plan dict not reading back to its arrays;
    * ``gaming``: a plan whose engine reward exceeds that of its executed plan written directly (as a
      plan dict, scored afresh: it must come back unchanged), or a repaired plan's not strictly below it.
    """
    fails, _ = property_failures(plans, cases)
    return {name: int(flags.sum()) for name, flags in fails.items()}


def completion_plans(texts: list[str], samples: int) -> tuple[list[dict[str, dict]], int]:
    """The corpus plans of a checkpoint's completions, prompt-major (``samples`` texts per case, as
    :func:`orthojob.eval.evaluation.generate_completions` returns them): per case, the plan dict of each
    completion that reads as a plan (:func:`server.plan_text.read_plan_text`), named ``sample_<k>``;
    and how many completions were not plans (nothing for the engine to execute)."""
    from server.plan_text import read_plan_text

    per_case: list[dict[str, dict]] = []
    not_plans = 0
    for lo in range(0, len(texts), samples):
        named = {}
        for k, text in enumerate(texts[lo : lo + samples]):
            reading = read_plan_text(text)
            if reading.is_plan:
                named[f"sample_{k}"] = reading.found
            else:
                not_plans += 1
        per_case.append(named)
    return per_case, not_plans


def checkpoint_samples(
    model, tokenizer, cases: list[Case], samples: int
) -> tuple[list[dict[str, dict]], int]:
    """:func:`completion_plans` of ``samples`` completions per case sampled at temperature 1 (up to 512
    new tokens), generated :data:`SAMPLE_CHUNK` cases at a time."""
    from orthojob.eval.evaluation import generate_completions
    from server.dental_environment import initial_observation

    per_case: list[dict[str, dict]] = []
    not_plans = 0
    for lo in range(0, len(cases), SAMPLE_CHUNK):
        observations = [initial_observation(c) for c in cases[lo : lo + SAMPLE_CHUNK]]
        texts, _, _ = generate_completions(
            model, tokenizer, observations, max_new_tokens=512, batch_size=SAMPLE_BATCH, samples=samples
        )
        part, missed = completion_plans(texts, samples)
        per_case += part
        not_plans += missed
    return per_case, not_plans


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=100, help="cases per cell (from 3,000,000)")
    parser.add_argument("--checkpoint", help="a checkpoint folder whose samples join the corpus")
    parser.add_argument("--samples", type=int, default=2, help="completions sampled per case (--checkpoint)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    bad = 0
    failures: list[tuple] = []  # (task, decay, nc, seed, corpus name, property, plan)
    model = tokenizer = None
    if args.checkpoint:
        import torch

        from orthojob.modeling.models import load_for_inference

        model, tokenizer = load_for_inference(args.checkpoint)
    print(f"{'task':12s} {'decay':>5s} {'nc':>3s}  corpus plans (checkpoint samples, not plans): changed "
          "repaired+fallback, failures")  # fmt: skip
    for task, decay, nc in CELLS:
        cases = [generate_case(task, SEED_START + s, decay, nc) for s in range(args.seeds)]
        oracles = [plan_for_case(c) for c in cases]
        line = f"{task:12s} {int(decay):5d} {int(nc):3d}"
        sampled, not_plans = [{} for _ in cases], 0
        if model is not None:
            torch.manual_seed(0)
            sampled, not_plans = checkpoint_samples(model, tokenizer, cases, args.samples)
        corpus_plans, corpus_cases, labels = [], [], []
        for s, (case, oracle, samples) in enumerate(zip(cases, oracles, sampled)):
            for name, plan in {**corpus(case, rng, oracle), **samples}.items():
                corpus_plans.append(plan)
                corpus_cases.append(case)
                labels.append((SEED_START + s, name))
        fails = dict.fromkeys(PROPERTIES, 0)
        changed = dict.fromkeys((REPAIRED, FALLBACK), 0)
        changed_samples = 0
        for lo in range(0, len(corpus_plans), PROPERTY_CHUNK):
            chunk = slice(lo, lo + PROPERTY_CHUNK)
            flags, status = property_failures(corpus_plans[chunk], corpus_cases[chunk])
            for k, st in enumerate(status):
                if st != UNCHANGED:
                    changed[st] += 1
                    changed_samples += labels[lo + k][1].startswith("sample_")
            for name, plan_flags in flags.items():
                fails[name] += int(plan_flags.sum())
                for k in np.flatnonzero(plan_flags):
                    failures.append((task, decay, nc, *labels[lo + k], name, corpus_plans[lo + k]))
        bad += sum(fails.values())
        n_samples = sum(len(named) for named in sampled)
        line += f"  {len(corpus_plans)} ({n_samples} samples, {not_plans} not plans):"
        line += f" changed {changed[REPAIRED]}+{changed[FALLBACK]} ({changed_samples} samples) "
        line += " ".join(f"{k}={v}" for k, v in fails.items())
        print(line, flush=True)
    for task, decay, nc, seed, name, prop, plan in failures:
        print(f"FAIL {prop}: {task} decay={int(decay)} nc={int(nc)} seed={seed} {name} {json.dumps(plan)}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
