"""Steps per second through the Gymnasium API (not a test): single process, OMP_NUM_THREADS=1.

Prints, for uniform SLERP episodes (reset + 24 steps, actions precomputed) on task_medium with
force decay:
* the environment's own store stepped directly (the floor of any adapter),
* one ``gymnasium.make("OrthoRL/AlignerStaging-v0")`` env (its wrappers included),
* ``gymnasium.make_vec(..., vectorization_mode="sync")`` with N envs (env-steps/s: N per call).

    OMP_NUM_THREADS=1 python bench/gym_throughput.py [--episodes 40] [--num-envs 8]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import gymnasium as gym
import numpy as np

from server.cases import TRAIN_SEED_START, generate_case
from server.dental_constants import N_STAGES, N_TEETH
from server.dental_environment import StepwiseDentalEnvironment
from server.gym_env import ENV_ID
from server.plans import interpolate_poses

TASK, DECAY = "task_medium", True
STAGES = np.repeat((np.arange(N_STAGES + 1) / N_STAGES)[:, None], N_TEETH, 1)


def trajectories(seeds: list[int]) -> dict[int, np.ndarray]:
    """(25, 28, 7) uniform SLERP aligners of each case."""
    out = {}
    for seed in seeds:
        case = generate_case(TASK, seed, DECAY)
        out[seed] = interpolate_poses(case.initial, case.target, STAGES)
    return out


def store_steps(seeds: list[int], traj: dict[int, np.ndarray]) -> float:
    store = StepwiseDentalEnvironment()
    t0 = time.perf_counter()
    for seed in seeds:
        eid = store.reset(TASK, seed, DECAY)["episode_id"]
        for s in range(1, N_STAGES + 1):
            store.step(eid, traj[seed][s])
        store.close_episode(eid)
    return len(seeds) * N_STAGES / (time.perf_counter() - t0)


def gym_steps(seeds: list[int], traj: dict[int, np.ndarray]) -> float:
    env = gym.make(ENV_ID, task_id=TASK, force_decay=DECAY)
    t0 = time.perf_counter()
    for seed in seeds:
        env.reset(options={"case_seed": seed})
        for s in range(1, N_STAGES + 1):
            env.step(traj[seed][s])
    rate = len(seeds) * N_STAGES / (time.perf_counter() - t0)
    env.close()
    return rate


def vector_steps(seeds: list[int], traj: dict[int, np.ndarray], num_envs: int) -> float:
    envs = gym.make_vec(ENV_ID, num_envs=num_envs, vectorization_mode="sync", task_id=TASK, force_decay=DECAY)
    rounds = max(len(seeds) // num_envs, 1)
    steps = 0
    t0 = time.perf_counter()
    for r in range(rounds):
        seed = seeds[r % len(seeds)]
        envs.reset(options={"case_seed": seed})  # the option goes to every sub-env
        for s in range(1, N_STAGES + 1):
            envs.step(np.stack([traj[seed][s]] * num_envs))
            steps += num_envs
    rate = steps / (time.perf_counter() - t0)
    envs.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--num-envs", type=int, default=8)
    args = parser.parse_args()
    seeds = list(range(TRAIN_SEED_START, TRAIN_SEED_START + args.episodes))
    traj = trajectories(seeds)
    store_steps(seeds[:4], traj)  # warm the case cache and the code paths
    print(
        f"{TASK}, force decay, uniform SLERP, {args.episodes} episodes x {N_STAGES} steps, OMP_NUM_THREADS=1"
    )
    print(f"  store.step directly          {store_steps(seeds, traj):9.0f} steps/s")
    print(f"  gymnasium.make env           {gym_steps(seeds, traj):9.0f} steps/s")
    rate = vector_steps(seeds, traj, args.num_envs)
    print(f"  make_vec sync, {args.num_envs:2d} envs       {rate:9.0f} env-steps/s")


if __name__ == "__main__":
    main()
