"""Where does a trained planner score above the oracle, and what do its plans do there?

For a checkpoint (``make learn``'s ``runs/learn/grpo_bc`` or ``runs/learn/grpo_stage0``), its greedy
plans for ``--seeds`` held-out seeds of every (task level x dynamics) cell, scored as the rewards score
them, beside the oracle's plan for the same case. Printed:

* per cell: how many of the planner's plans score above the oracle's (scaled reward), how many of
  those are safe (no hard rule broken) and not degenerate, and the mean margin;
* for the ``--show`` cases with the largest safe margins: both plans, their canaries (limit
  violations, colliding contacts, peak PDL kPa) and, per stage, the teeth that move and the largest
  planned step of any tooth (translation mm, rotation deg), so the difference can be checked by hand.

    OMP_NUM_THREADS=1 python experiments/learning/beyond_oracle.py --checkpoint runs/learn/grpo_bc [--seeds 32] [--show 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from experiments.learning.evaluation import greedy_plans, heldout_cases
from experiments.learning.experiment import MAX_SEQ_LENGTH
from experiments.learning.report import CELL_NAMES, cell_name
from orthojob.modeling import models
from orthojob.rewards.canaries import episode_record
from server.cases import generate_case
from server.dental_constants import TOOTH_IDS
from server.oracle import plan_for_case
from server.plans import normalize_plan
from server.quaternion_utils import quaternion_angle
from server.treatment import rollout_plans, score_plans


def stage_moves(plan: dict, case) -> list[dict]:
    """Per stage 1-24 of a plan on its case: the teeth whose planned pose changes, and the largest
    planned step of any tooth (translation mm, rotation deg)."""
    planned, _achieved = rollout_plans([normalize_plan(plan)], [case])
    traj = planned[0]  # (25, 28, 7)
    rows = []
    for s in range(1, traj.shape[0]):
        step_mm = np.linalg.norm(traj[s, :, 4:] - traj[s - 1, :, 4:], axis=-1)
        step_deg = np.degrees(quaternion_angle(traj[s - 1, :, :4], traj[s, :, :4]))
        moving = [int(t) for t, mm, deg in zip(TOOTH_IDS, step_mm, step_deg) if mm > 1e-4 or deg > 1e-3]
        rows.append(
            {"stage": s, "teeth": moving, "max_mm": float(step_mm.max()), "max_deg": float(step_deg.max())}
        )
    return rows


def _moves_text(rows: list[dict]) -> str:
    out = []
    for r in rows:
        teeth = ",".join(map(str, r["teeth"])) if len(r["teeth"]) < 28 else "all 28"
        out.append(
            f"    stage {r['stage']:2d}: {r['max_mm']:.3f} mm {r['max_deg']:.2f} deg  teeth {teeth or '-'}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--seeds", type=int, default=32, help="held-out seeds per cell")
    parser.add_argument("--show", type=int, default=3, help="cases to print in full")
    parser.add_argument("--max-new-tokens", type=int, default=384)
    args = parser.parse_args(argv)

    model, tokenizer = models.load_policy(args.checkpoint, lora_r=0, max_seq_length=MAX_SEQ_LENGTH)
    model.eval()
    keys = heldout_cases(args.seeds)
    cases = [generate_case(*k) for k in keys]
    plans = greedy_plans(model, tokenizer, keys, args.max_new_tokens)
    oracle = [plan_for_case(c) for c in cases]
    mine = score_plans([p if p is not None else {} for p in plans], keys)
    theirs = score_plans(oracle, keys)
    above = []
    per_cell = {c: {"cases": 0, "above": 0, "above_safe": 0, "margins": []} for c in CELL_NAMES}
    for k, case, plan, r, o in zip(keys, cases, plans, mine, theirs):
        cell = per_cell[cell_name(k)]
        cell["cases"] += 1
        if plan is None:
            continue
        record = episode_record({**r, "plan": plan}, case, case.optimal_strategy)
        margin = r["scaled_reward"] - o["scaled_reward"]
        if margin > 0:
            cell["above"] += 1
            if not r["broken_rules"] and record["degenerate_form"] is None:
                cell["above_safe"] += 1
                cell["margins"].append(margin)
                above.append((margin, k, case, plan, r, o))
    print(f"{args.checkpoint}: greedy plans on {args.seeds} held-out seeds per cell, against the oracle's")
    print("| cell | cases | above the oracle | of them safe, not degenerate | mean margin (safe) |")
    print("|---|---|---|---|---|")
    for c, v in per_cell.items():
        m = f"{np.mean(v['margins']):+.3f}" if v["margins"] else "-"
        print(f"| {c} | {v['cases']} | {v['above']} | {v['above_safe']} | {m} |")
    for margin, k, case, plan, r, o in sorted(above, key=lambda x: -x[0])[: args.show]:
        print(f"\n{cell_name(k)} seed {k.seed}: planner {r['scaled_reward']:.3f} vs oracle {o['scaled_reward']:.3f} "
              f"(+{margin:.3f}); optimal strategy {case.optimal_strategy}")  # fmt: skip
        for name, p, res in (("planner", plan, r), ("oracle", plan_for_case(case), o)):
            d = res["diagnostics"]
            print(f"  {name}: {json.dumps(p)}")
            print(f"  {name} canaries: limit violations {d.get('limit_violations', 0):.0f}, colliding contacts "
                  f"{d.get('colliding_contacts', 0):.0f}, peak PDL {d.get('peak_pdl_kpa', 0):.2f} kPa, "
                  f"broken rules {res['broken_rules'] or 'none'}; components "
                  f"{ {k2: round(v, 3) for k2, v in res['reward_breakdown'].items()} }")  # fmt: skip
            print(_moves_text(stage_moves(p, case)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
