"""Environment throughput benchmark (not a test): single process, OMP_NUM_THREADS=1.

Prints
* stepwise episodes/s (reset + 24 steps) per task level and dynamics, cold (every case
  generated at reset) and warm (cases from the case cache, as in GRPO where G completions
  share a seed);
* milliseconds to generate a case, per task level;
* batch plan scoring episodes/s for 64 and for 1,024 plans (cases cached);
* milliseconds to score one plan;
* RSS growth over N stepwise episodes (default 100,000) with the default session cap.

    OMP_NUM_THREADS=1 python bench/env_throughput.py [--episodes 100000]
"""

from __future__ import annotations

import argparse
import os
import resource
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from server.cases import TASK_IDS, clear_case_cache, generate_case
from server.dental_constants import TOOTH_IDS
from server.dental_environment import StepwiseDentalEnvironment
from server.oracle import oracle_plan
from server.plans import interpolate_poses, planned_progress
from server.treatment import score_plans

TASK = "task_medium"
UNIFORM = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 1 / 24, "priority": "high"}]}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def slerp_trajectory(seed: int, task: str = TASK, force_decay: bool = False) -> np.ndarray:
    case = generate_case(task, seed, force_decay)
    return interpolate_poses(
        case.initial, case.target, planned_progress(np.ones(28, int), np.full(28, 1 / 24))
    )


def stepwise(
    env: StepwiseDentalEnvironment,
    seeds: list[int],
    trajectories: dict[int, np.ndarray],
    task: str = TASK,
    force_decay: bool = False,
) -> float:
    t0 = time.perf_counter()
    for seed in seeds:
        eid = env.reset(task, seed, force_decay)["episode_id"]
        traj = trajectories[seed]
        for s in range(1, 25):
            obs = env.step(eid, traj[s])
    assert obs["done"]
    return len(seeds) / (time.perf_counter() - t0)


def cold_and_cached(
    env: StepwiseDentalEnvironment, n: int, task: str, force_decay: bool
) -> tuple[float, float]:
    """Stepwise episodes/s with every case generated at reset, then with the cases cached."""
    seeds = list(range(n))
    trajectories = {s: slerp_trajectory(s, task, force_decay) for s in seeds}
    stepwise(env, seeds[:20], trajectories, task, force_decay)  # warm-up
    clear_case_cache()
    cold = stepwise(env, seeds, trajectories, task, force_decay)
    return cold, stepwise(env, seeds, trajectories, task, force_decay)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=100_000, help="episodes for the RSS measurement")
    parser.add_argument("--stepwise", type=int, default=400, help="episodes per stepwise timing")
    args = parser.parse_args()
    env = StepwiseDentalEnvironment()

    print("stepwise episodes/s (reset + 24 uniform-SLERP steps; cold: every case generated at reset):")
    for task in TASK_IDS:
        for decay in (False, True):
            cold, warm = cold_and_cached(env, args.stepwise, task, decay)
            dynamics = "force decay" if decay else "ideal"
            print(f"  {task:<12} {dynamics:<12} cold cases {cold:4.0f}, cached cases {warm:4.0f}")

    for task in TASK_IDS:
        clear_case_cache()
        t0 = time.perf_counter()
        for s in range(200):
            generate_case(task, 10_000 + s)
        print(f"case generation, {task}: {(time.perf_counter() - t0) / 200 * 1e3:.2f} ms per case (cold)")

    pool = [(TASK, 20_000 + s, s % 2 == 1) for s in range(1024)]
    for c in pool:
        generate_case(*c)
    obs0 = env.reset(TASK, 20_000)
    plans = [oracle_plan(obs0) if i % 2 == 0 else UNIFORM for i in range(1024)]
    for n in (64, 1024):
        score_plans(plans[:n], pool[:n])
        reps = max(1, 4096 // n)
        t0 = time.perf_counter()
        for _ in range(reps):
            score_plans(plans[:n], pool[:n])
        rate = n * reps / (time.perf_counter() - t0)
        print(f"batch plan scoring, {n} plans (half force decay): {rate:.0f} episodes/s")
    t0 = time.perf_counter()
    for i in range(200):
        score_plans([plans[i]], [pool[i]])
    print(f"one plan: {(time.perf_counter() - t0) / 200 * 1e3:.2f} ms")

    before = rss_mb()
    t0 = time.perf_counter()
    rng_seeds = np.arange(args.episodes) % 2048  # cases stay within the case cache
    traj_cache: dict[int, np.ndarray] = {}
    for k, seed in enumerate(rng_seeds):
        seed = int(seed)
        if seed not in traj_cache:
            traj_cache[seed] = slerp_trajectory(seed)
        eid = env.reset(TASK, seed)["episode_id"]
        for s in range(1, 25):
            env.step(eid, traj_cache[seed][s])
        if k == 2047:
            before = rss_mb()  # after the caches (cases, trajectories, sessions) are full
    elapsed = time.perf_counter() - t0
    after = rss_mb()
    print(
        f"RSS growth over {args.episodes} stepwise episodes (after caches fill): {after - before:+.1f} MB "
        f"({before:.0f} -> {after:.0f} MB, {len(env.sessions)} live sessions, {args.episodes / elapsed:.0f} eps/s)"
    )


if __name__ == "__main__":
    main()
