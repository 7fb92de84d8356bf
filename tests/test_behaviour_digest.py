"""Behaviour digest: cases, observations/prompts and the five rewards are bit-identical to a recorded value.

Refactors must not change what the environment generates or what the rewards return. The digest
hashes, for seeds 0-49 of every task (with and without force decay): the case arrays and labels; the first prompt built from the case's observation; and the five
reward functions' values on the oracle's plan, uniform SLERP, do-nothing and a non-plan; and every
observation of stepwise episodes (the environment server's per-step rewards).
A legitimate change to the environment or the rewards updates :data:`EXPECTED` in the same commit.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from orthojob.core.prompts import build_prompt, plan_to_completion
from orthojob.eval.evaluation import DO_NOTHING_PLAN, UNIFORM_SLERP_PLAN
from orthojob.rewards.reward_functions import REWARD_FUNCS
from orthojob.rewards.rollouts import DEFAULT_CACHE
from server.cases import TASK_IDS, generate_case
from server.dental_environment import StepwiseDentalEnvironment
from server.oracle import oracle_plan

SEEDS = range(50)
EXPECTED = {  # one digest per machine type: the float bits differ between them (below)
    "cases": (
        "f7a50a5cd0329e4e85c6d44eb1d23983d710cb443935c8a4ff23b8c6987ae0b3",
        "47afccaf42d0db7007dc94138d90475379dde01fdccf0f81a7aff5498440ff0f",
    ),
    "rewards": (
        "65d6d541f90473f75fcc1b1a21c0fd59e4b000c475ed64f4f45f7e0e298a7745",
        "4374c264464272ff34cc7abae4e14cea1b293ff300415d53ea39f48c3110786c",
    ),
    "stepwise": (
        "e5244c8a2166b4becd791fe6e327eb4e83034711c7fee455de29fc1533370b9a",
        "5187cc2707eb1007eec72a740757e6f2ad3884e1b61633faee8d9a1c25d98fef",
    ),
}
"""Accepted digests, one per machine kind: the first where the project started (numpy dispatching no
AVX-512, OpenBLAS's Haswell kernels), the second on an AMD EPYC machine (numpy 2.4.6 dispatching
AVX512_ICL, OpenBLAS's SkylakeX kernels), where the same code computes other float bits (every
tolerance test passes on both). An AVX-512 machine computes the first kind's digests too with
``OPENBLAS_CORETYPE=Haswell NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL"`` (checked: it gives the
first kind's recorded digests of the code before the change below). A change of behaviour changes
every kind's digest; record them together. The stepwise digests were last re-recorded, both kinds,
when the stepwise path came to be judged (premolar and molar contacts at every stage, path
efficiency, an aligner stepping back engaging no lag: the noisy episodes' observations changed, the
clean ones' did not; CHANGELOG.md); the cases and rewards digests are unchanged since then."""


def observation_of(task_id: str, seed: int, force_decay: bool) -> dict:
    from orthojob.core.prompts import reset_observation

    return reset_observation(seed, task_id, force_decay)


def cases_digest() -> str:
    h = hashlib.sha256()
    for task_id in TASK_IDS:
        for decay in (False, True):
            for seed in SEEDS:
                c = generate_case(task_id, seed, decay)
                for arr in (c.initial, c.target, c.crown_width_mm, c.crown_depth_mm):
                    h.update(np.ascontiguousarray(arr, dtype=np.float64).tobytes())
                h.update(f"{c.profile}|{c.secondary_profile}|{c.optimal_strategy}".encode())
    return h.hexdigest()


def rewards_digest() -> str:
    # Rollouts cached by earlier tests in this process were scored in other batches; the matrix
    # and component-wise quaternion products agree only to rounding, so score these afresh.
    DEFAULT_CACHE.clear()
    h = hashlib.sha256()
    for task_id in TASK_IDS:
        for decay in (False, True):
            completions, seeds = [], []
            for seed in SEEDS if decay is False else range(10):
                obs = observation_of(task_id, seed, decay)
                h.update(build_prompt(obs).encode())
                plans = [
                    plan_to_completion(oracle_plan(obs)),
                    plan_to_completion({"strategy": "anterior_first", **UNIFORM_SLERP_PLAN}),
                    plan_to_completion(DO_NOTHING_PLAN),
                    "no plan {here",
                ]
                completions += plans
                seeds += [seed] * len(plans)
            columns = {"seed": seeds, "task_id": [task_id] * len(seeds), "force_decay": [decay] * len(seeds)}
            for name, func in REWARD_FUNCS.items():
                values = func(completions, **columns)
                h.update(name.encode())
                h.update(json.dumps([float(v).hex() for v in values]).encode())
    return h.hexdigest()


def stepwise_digest() -> str:
    """Every observation of stepwise episodes (each task, force decay, non-compliance; noisy
    straight-line plans, as lists and as arrays) and a collision check at the end."""
    env = StepwiseDentalEnvironment()
    h = hashlib.sha256()
    rng = np.random.default_rng(1)
    for task_id in TASK_IDS:
        for seed in range(6):
            for decay, non_compliance in ((False, False), (True, False), (False, task_id == "task_hard")):
                obs = env.reset(task_id, seed, decay, non_compliance=non_compliance)
                episode_id = obs["episode_id"]
                initial = np.asarray(obs["initial_config"])
                target = np.asarray(obs["target_config"]).copy()
                target[np.sum(initial[:, :4] * target[:, :4], 1) < 0, :4] *= -1
                for s in range(1, 25):
                    poses = (
                        (1 - s / 24) * initial
                        + s / 24 * target
                        + rng.normal(0, 0.15, initial.shape) * (seed % 3)
                    )
                    poses[:, :4] /= np.linalg.norm(poses[:, :4], axis=1, keepdims=True)
                    step = env.step(episode_id, poses.tolist() if s % 2 else poses)
                    step.pop("episode_id")
                    h.update(json.dumps(step, sort_keys=True).encode())
                h.update(json.dumps(env.check_collisions(episode_id), sort_keys=True).encode())
    return h.hexdigest()


def test_cases_digest_unchanged():
    assert cases_digest() in EXPECTED["cases"]


def test_prompts_and_rewards_digest_unchanged():
    assert rewards_digest() in EXPECTED["rewards"]


def test_stepwise_episodes_digest_unchanged():
    assert stepwise_digest() in EXPECTED["stepwise"]


if __name__ == "__main__":
    print(
        json.dumps(
            {"cases": cases_digest(), "rewards": rewards_digest(), "stepwise": stepwise_digest()}, indent=1
        )
    )
