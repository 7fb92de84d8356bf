"""Benchmark: milliseconds for all five GRPO rewards on one batch of 64 completions (16 prompts x 4).

Run from the repository root (single process, one BLAS thread)::

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/reward_throughput.py [--prompts 16] [--generations 4] [--reps 7]

Completions are realistic: for each prompt the rule-based oracle's plan rendered with
``plan_to_completion`` plus noise variants (jittered fractions, shuffled priorities, another
strategy), wrapped as conversational completions, as TRL passes them. Reported (median and
min over ``--reps`` batches, each on new seeds):

* ``first call``: the five rewards on a fresh cache, i.e. parsing + one batched rollout + reads;
  ``cases warm`` has the cases already generated (prompt_rows built them, the usual case),
  ``cases cold`` generates them too;
* ``cached``: the five rewards again on the same batch (all hits);
* the split of the first call: parse only, ``server.treatment.score_plan_specs`` only.

Target: < 50 ms for all five rewards on 64 completions.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orthojob.core.parsing import extract_plan
from orthojob.core.prompts import plan_to_completion, reset_observation
from orthojob.rewards import reward_functions, rollouts
from server import treatment
from server.cases import generate_case
from server.clinical_profiles import STRATEGIES
from server.dental_constants import PRIORITY_START_STAGE
from server.oracle import oracle_plan
from server.plans import normalize_plan

TARGET_MS = 50.0


def _variants(plan: dict, rng: random.Random, k: int) -> list[dict]:
    """``k`` plans: the oracle's, then noisy variants of it."""
    out = [plan]
    while len(out) < k:
        kind = len(out) % 3
        groups = [dict(g) for g in plan["tooth_groups"]]
        v = {"strategy": plan["strategy"], "tooth_groups": groups}
        if kind == 1:
            for g in groups:
                g["fraction"] = round(min(1.0, g["fraction"] * rng.uniform(0.6, 1.5)), 4)
        elif kind == 2:
            for g in groups:
                g["priority"] = rng.choice(list(PRIORITY_START_STAGE))
        else:
            v["strategy"] = rng.choice([s for s in STRATEGIES if s != plan["strategy"]])
        out.append(v)
    return out


def make_batch(seeds: list[int], generations: int, task_id: str, rng: random.Random) -> tuple[list, dict]:
    completions, columns = [], {"seed": [], "task_id": [], "force_decay": []}
    for seed in seeds:
        obs = reset_observation(seed, task_id, False)
        for plan in _variants(oracle_plan(obs), rng, generations):
            completions.append([{"role": "assistant", "content": plan_to_completion(plan)}])
            columns["seed"].append(seed)
            columns["task_id"].append(task_id)
            columns["force_decay"].append(False)
    return completions, columns


def _ms(f, *args, **kwargs) -> float:
    t = time.perf_counter()
    f(*args, **kwargs)
    return 1000.0 * (time.perf_counter() - t)


def _all_rewards(funcs: list, completions: list, columns: dict) -> None:
    for f in funcs:
        f(completions, **columns)


def run(n_prompts: int, generations: int, reps: int, task_id: str) -> dict[str, list[float]]:
    rng = random.Random(0)
    funcs = reward_functions.active_reward_funcs()
    timings: dict[str, list[float]] = {k: [] for k in ("warm", "cold", "cached", "parse", "server")}
    seed_base = 50_000
    for rep in range(reps + 1):  # rep 0 warms imports and numpy paths, not reported
        seeds = list(range(seed_base + rep * n_prompts, seed_base + (rep + 1) * n_prompts))
        comps, cols = make_batch(seeds, generations, task_id, rng)  # generates (and caches) the cases
        cold_cols = dict(cols, seed=[s + 10_000 for s in cols["seed"]])  # cases not generated yet

        rollouts.DEFAULT_CACHE.clear()
        warm = _ms(_all_rewards, funcs, comps, cols)
        cached = _ms(_all_rewards, funcs, comps, cols)
        rollouts.DEFAULT_CACHE.clear()
        cold = _ms(_all_rewards, funcs, comps, cold_cols)

        texts = [c[0]["content"] for c in comps]
        parse = _ms(list, map(extract_plan, texts))
        specs = [normalize_plan(extract_plan(t)) for t in texts]
        cases = [generate_case(task_id, s) for s in cols["seed"]]
        server = _ms(treatment.score_plan_specs, specs, cases)
        if rep:
            for k, v in zip(timings, (warm, cold, cached, parse, server)):
                timings[k].append(v)
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--task-id", default="task_medium")
    parser.add_argument("--no-grpo-step", action="store_true", help="skip timing a tiny-model GRPO step")
    args = parser.parse_args(argv)
    n = args.prompts * args.generations
    print(
        f"reward throughput: {args.prompts} prompts x {args.generations} generations = {n} completions, "
        f"{args.task_id}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {args.reps} reps"
    )
    t = run(args.prompts, args.generations, args.reps, args.task_id)
    rows = [
        ("five rewards, first call, cases warm", "warm"),
        ("five rewards, first call, cases cold", "cold"),
        ("five rewards, cached (all hits)", "cached"),
        ("  of which: parse only", "parse"),
        ("  of which: server score_plan_specs only", "server"),
    ]
    for label, key in rows:
        med, lo = statistics.median(t[key]), min(t[key])
        print(f"  {label:<42} median {med:7.2f} ms   min {lo:7.2f} ms   ({med / n:.3f} ms/completion)")
    warm = statistics.median(t["warm"])
    share = statistics.median(t["server"]) / warm
    print(f"  server share of the first call: {share:.0%}")
    print(f"  target < {TARGET_MS:.0f} ms per {n} completions: {'met' if warm < TARGET_MS else 'NOT met'}")
    if not args.no_grpo_step:
        step = grpo_step_seconds(args.prompts, args.generations)
        print(
            f"  tiny-model GRPO step ({n} completions, TRL on CPU): median {step * 1e3:.0f} ms; "
            f"the five rewards are {warm / (step * 1e3):.1%} of it"
        )
    return 0


def grpo_step_seconds(prompts: int, generations: int) -> float:
    """Median wall time of a GRPO step (after the first) of the tiny model on ``prompts x generations``
    completions: generation, the five rewards, the loss and the update, as TRL runs them."""
    import tempfile

    from orthojob.modeling.models import build_tiny
    from orthojob.stages.grpo import train_and_gate as train
    from orthojob.stages.grpo_config import GRPOJobConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny(Path(tmp) / "tiny", ["task_medium"])
        config = GRPOJobConfig(
            model=str(model),
            steps=4,
            batch_size=prompts * generations,
            num_generations=generations,
            lr=1e-4,
            lora_r=0,
            max_prompt_length=1760,
            max_completion_length=128,
            out=str(Path(tmp) / "out"),
            task_id="task_medium",
            skip_sft_gate=True,
            gradient_checkpointing=False,
            gate_seeds=2,
            num_prompts=prompts * 4,
        )
        result = train(config)
    return statistics.median(result.step_times[1:])


if __name__ == "__main__":
    sys.exit(main())
