"""Audit: degenerate planners at the GRPO gate, with the staging engine and without it.

Each planner writes the same kind of plan for every case (not a plan, nothing, stalling, one uniform
group, everything at once, overshoot, every tooth frozen but one, the oracle at 3x its speed, and the
oracle itself for reference). Each is judged by :func:`orthojob.stages.gate.gate_report` (stage
``grpo``, its default thresholds) on one window of ``--seeds`` seeds in each of the six cells, with the
engine (what ships) and with ``engine=False`` (the raw plans). Printed per planner and judgement: the
verdict, the failed checks, the scaled reward of the judged plans against uniform SLERP's, the hard-rule
share of the judged plans and of the raw ones, the repair share, and GRPO's weighted reward sum on the
same cases as written (``--objective raw``) and with the engine in the loop (``--objective engine``).
A degenerate planner that passes a gate, or a rule-breaking raw plan that outscores the oracle on either
sum, is a hole. Run::

    OMP_NUM_THREADS=1 python experiments/audits/degenerate_gates.py [--seeds 4]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from orthojob.core.prompts import plan_to_completion
from orthojob.rewards.reward_functions import active_reward_funcs, reward_weights
from orthojob.stages import gate
from server.cases import generate_case
from server.dental_constants import N_STAGES, TOOTH_IDS
from server.dental_environment import initial_observation
from server.oracle import oracle_plan

IDENTITY = "bench:degenerate-gates"


def _groups(obs: dict, **group) -> str:
    return plan_to_completion({"tooth_groups": [{"teeth": [int(t) for t in TOOTH_IDS], **group}]})


def _oracle_times(k: float):
    def write(obs: dict) -> str:
        plan = oracle_plan(obs)
        groups = [{**g, "fraction": min(1.0, k * g["fraction"])} for g in plan["tooth_groups"]]
        return plan_to_completion({**plan, "tooth_groups": groups})

    return write


def _frozen_but_one(obs: dict) -> str:
    teeth = [int(t) for t in TOOTH_IDS]
    return plan_to_completion(
        {"tooth_groups": [{"teeth": teeth[:1], "fraction": 0.2}, {"teeth": teeth[1:], "fraction": 0.0}]}
    )


PLANNERS = {
    "not a plan": lambda obs: "I would move the teeth.",
    "nothing": lambda obs: _groups(obs, fraction=0.0),
    "stalling (start 20)": lambda obs: _groups(obs, fraction=0.2, start_stage=20),
    "one uniform group": lambda obs: _groups(obs, fraction=1 / N_STAGES),
    "everything at once": lambda obs: _groups(obs, fraction=1.0),
    "overshoot (overcorrection 1)": lambda obs: _groups(obs, fraction=1 / N_STAGES, overcorrection=1.0),
    "frozen but one": _frozen_but_one,
    "oracle at 3x": _oracle_times(3.0),
    "oracle": _oracle_times(1.0),
}


def weighted_sums(texts: list[str], obs: list[dict], engine: bool) -> np.ndarray:
    """GRPO's weighted sum of the five rewards of each text on its case (the default weights)."""
    funcs = active_reward_funcs()
    cols = {
        "seed": [o["seed"] for o in obs],
        "task_id": [o["task_id"] for o in obs],
        "force_decay": [bool(o["force_decay"]) for o in obs],
    }
    if engine:
        cols["engine"] = [True] * len(texts)
    return sum(w * np.asarray(f(texts, **cols)) for w, f in zip(reward_weights(funcs), funcs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=4, help="seeds in each of the six cells")
    args = parser.parse_args(argv)
    window = gate.gate_window(IDENTITY, args.seeds, gate.QUALITY_CELLS)
    obs = [initial_observation(generate_case(*k)) for k in window.keys()]  # noqa: SIM118 (a method)
    oracle_sum = {
        e: weighted_sums([PLANNERS["oracle"](o) for o in obs], obs, e).mean() for e in (False, True)
    }
    print(f"window: {window.n_cases} cases from seed {window.start}; oracle's weighted sum raw "
          f"{oracle_sum[False]:.2f}, engine in the loop {oracle_sum[True]:.2f}")  # fmt: skip
    header = f"{'planner':<30}{'engine':>7}{'passed':>8}  {'failed checks':<44}{'scaled':>8}{'SLERP':>7}"
    print(header + f"{'hard':>6}{'raw hard':>9}{'repair':>8}{'sum raw':>9}{'sum eng':>9}")
    holes = 0
    for name, planner in PLANNERS.items():
        texts = [planner(o) for o in obs]
        sums = {e: float(weighted_sums(texts, obs, e).mean()) for e in (False, True)}
        for engine in (True, False):
            r = gate.gate_report("scripted", n_seeds=args.seeds, stage="grpo", policy=lambda o, p=planner: [p(x) for x in o],
                                 identity=IDENTITY, engine=engine)  # fmt: skip
            m = r["metrics"]
            failed = ",".join(k for k, ok in r["checks"].items() if not ok) or "-"
            print(f"{name:<30}{'on' if engine else 'off':>7}{r['passed']!s:>8}  {failed:<44}"
                  f"{m['scaled_reward_mean']:>8.2f}{m['uniform_slerp_scaled_reward_mean']:>7.2f}"
                  f"{m['hard_rule_share']:>6.2f}{m['raw_hard_rule_share']:>9.2f}{m['repair_share']:>8.2f}"
                  f"{sums[False]:>9.2f}{sums[True]:>9.2f}")  # fmt: skip
            if name != "oracle" and r["passed"]:
                holes += 1
        if name != "oracle" and max(sums.values()) > oracle_sum[False]:
            holes += 1
            print(f"  {name}: a weighted sum above the oracle's: {json.dumps(sums)}")
    print(f"{holes} holes (a degenerate planner passing a gate, or outscoring the oracle on a sum)")
    return 1 if holes else 0


if __name__ == "__main__":
    raise SystemExit(main())
