"""Behaviour digest: cases, observations/prompts and the five rewards are bit-identical to a recorded value.

Refactors of ``orthojob/`` (issue 11) must not change what the environment generates or what the
rewards return. The digest hashes, for seeds 0-49 of every task (with and without force decay):
the case arrays and labels; the first prompt built from the case's observation; and the five
reward functions' values on the oracle's plan, uniform SLERP, do-nothing and a non-plan.
A legitimate change to the environment or the rewards updates :data:`EXPECTED` in the same commit.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from orthojob.evaluation import DO_NOTHING_PLAN, UNIFORM_SLERP_PLAN
from orthojob.prompts import build_prompt, plan_to_completion
from orthojob.rewards import REWARD_FUNCS
from server.cases import TASK_IDS, generate_case
from server.oracle import oracle_plan

SEEDS = range(50)
EXPECTED = {
    "cases": "37e501ac32777fa9dabad2b9a146a13bf4b8d6c9988f6e2720c1aa990a56d06f",
    "rewards": "080fe4bb6a74cc4e3fe0c79adbbd91ffa8cf218931ad40163ec5850e2f9e6274",
}


def observation_of(task_id: str, seed: int, force_decay: bool) -> dict:
    from orthojob.prompts import reset_observation

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


def test_cases_digest_unchanged():
    assert cases_digest() == EXPECTED["cases"]


def test_prompts_and_rewards_digest_unchanged():
    assert rewards_digest() == EXPECTED["rewards"]


if __name__ == "__main__":
    print(json.dumps({"cases": cases_digest(), "rewards": rewards_digest()}, indent=1))
