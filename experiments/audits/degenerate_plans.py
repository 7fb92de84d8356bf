"""Audit: degenerate plans against the oracle, as TRL calls reward_terminal (ideal dynamics).

Prints mean [min, max] of the scaled terminal reward over 10 held-out seeds per level for plans an
optimiser might collapse to: not a plan, nothing, stalling, one uniform group, everything at once, a
compressed single group. Run: ``OMP_NUM_THREADS=1 python experiments/audits/degenerate_plans.py``.
"""

import json

import numpy as np

from orthojob.core.prompts import plan_to_completion
from orthojob.rewards import reward_functions
from server.cases import HELDOUT_SEED_START, generate_case
from server.dental_constants import TOOTH_IDS
from server.oracle import plan_for_case

ALL = [int(t) for t in TOOTH_IDS]
plans = {
    "not a plan ('{}')": "{}",
    "garbage text": "I would move the teeth.",
    "nothing (fraction 0)": json.dumps(
        {"strategy": "anterior_first", "tooth_groups": [{"teeth": ALL, "fraction": 0.0}]}
    ),
    "stalling (start 20, fraction 0.05)": json.dumps(
        {"strategy": "anterior_first", "tooth_groups": [{"teeth": ALL, "fraction": 0.05, "start_stage": 20}]}
    ),
    "one group, uniform SLERP": json.dumps(
        {"strategy": "anterior_first", "tooth_groups": [{"teeth": ALL, "fraction": 1 / 24}]}
    ),
    "everything at once (fraction 1)": json.dumps(
        {"strategy": "anterior_first", "tooth_groups": [{"teeth": ALL, "fraction": 1.0}]}
    ),
    "one group x3 speed (fraction 1/8)": json.dumps(
        {"strategy": "anterior_first", "tooth_groups": [{"teeth": ALL, "fraction": 1 / 8}]}
    ),
}
print("| plan | task_easy | task_medium | task_hard |\n|---|---|---|---|")
rows = {}
for task in ("task_easy", "task_medium", "task_hard"):
    seeds = list(range(HELDOUT_SEED_START, HELDOUT_SEED_START + 10))
    for name, c in [*plans.items(), ("oracle", None)]:
        comps = [
            c if c is not None else plan_to_completion(plan_for_case(generate_case(task, s, False, False)))
            for s in seeds
        ]
        r = reward_functions.reward_terminal(comps, seed=seeds, task_id=[task] * 10, force_decay=[False] * 10)
        rows.setdefault(name, []).append(f"{np.mean(r):+.2f} [{min(r):+.2f}, {max(r):+.2f}]")
for n, v in rows.items():
    print(f"| {n} | " + " | ".join(v) + " |")
