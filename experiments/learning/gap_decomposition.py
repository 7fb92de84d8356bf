"""Where a planner's gap to uniform SLERP and to the oracle is: its hard-rule breaks, or its staging?

For a checkpoint (``make learn``'s ``runs/learn/grpo_bc``, ``bc``, ...), its greedy plans for ``--seeds``
held-out seeds of every (task level x dynamics) cell, and ``--samples`` sampled plans per case at
``--temperature`` (the training temperature), scored four ways (``experiments.learning.evaluation.safety_counterfactuals``):

* **as written**;
* **checked**: a plan that breaks a hard rule replaced by uniform SLERP (one check on the simulator
  and a fixed fallback, what the environment's check tool would allow);
* **no overcorrection**: every group's overcorrection removed;
* **first safe sample**: the first of the policy's own sampled plans that breaks no rule, else SLERP.

``--room-share X`` adds, per force-decay cell, the greedy plans that do not overcorrect as written and
with each group overcorrected by ``X`` of its teeth's smallest overcorrection room
(:func:`orthojob.data.robust_plans.within_room`; 1.0: the whole room), and a uniform overcorrection of
0.1 on every group: whether the cases where the planner holds back could take an overcorrection, and
whether the room tells how much.

Beside them: the share of plans breaking a hard rule, the rules they break, the mean of the safe plans
alone, the share of plans that overcorrect a tooth (as the simulator reads them; under force decay
overcorrection is what the oracle's lead rests on), and uniform SLERP's and the oracle's means on the
same cases. Where "checked" beats SLERP, the
planner's safe plans are better than SLERP and its breaks are what keeps it below; where "safe plans"
are at SLERP's level, its staging has nothing to add.

    OMP_NUM_THREADS=1 python experiments/learning/gap_decomposition.py --checkpoint runs/learn/grpo_bc [--seeds 32] [--samples 4] \
        [--room-share 0.5]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from experiments.learning.evaluation import (
    CHECKS,
    greedy_plans,
    heldout_cases,
    mean_ci,
    safety_counterfactuals,
    sampled_plans,
)
from experiments.learning.experiment import MAX_SEQ_LENGTH
from experiments.learning.report import CELL_NAMES, cell_name
from orthojob.eval.evaluation import UNIFORM_SLERP_PLAN
from orthojob.modeling import models
from server.cases import CaseKey, generate_case
from server.oracle import plan_for_case
from server.plans import overcorrects
from server.treatment import score_plans


def room_counterfactual(
    plans: Sequence[dict | None], keys: Sequence[CaseKey], share: float, uniform: float = 0.1
) -> list[dict]:
    """Per force-decay cell present in ``keys`` (in :data:`CELL_NAMES` order), over its plans that are a
    plan and do not overcorrect: ``cell``, ``plans``, and for ``as_written``, ``within_room`` (each group
    overcorrected by ``share`` of its teeth's smallest room) and ``uniform`` (every group by
    ``uniform``) the ``mean`` scaled reward and the ``broken`` share (None for both where there is no
    such plan)."""
    from orthojob.data.robust_plans import within_room

    rows = []
    for cell in CELL_NAMES:
        idx = [i for i, k in enumerate(keys) if k.force_decay and cell_name(k) == cell]
        if not idx:
            continue
        idx = [i for i in idx if plans[i] is not None and not overcorrects(plans[i])]
        ks = [keys[i] for i in idx]
        held = [plans[i] for i in idx]
        ways = {
            "as_written": held,
            "within_room": [
                within_room(p, generate_case(*k).overcorrection_room, share) for p, k in zip(held, ks)
            ],
            "uniform": [
                {**p, "tooth_groups": [{**g, "overcorrection": uniform} for g in p["tooth_groups"]]}
                for p in held
            ],
        }
        row: dict = {"cell": cell, "plans": len(idx)}
        for name, ps in ways.items():
            scored = score_plans(ps, ks) if ps else []
            row[name] = {
                "mean": float(np.mean([r["scaled_reward"] for r in scored])) if scored else None,
                "broken": float(np.mean([bool(r["broken_rules"]) for r in scored])) if scored else None,
            }
        rows.append(row)
    return rows


def table(
    rows: Sequence[dict],
    keys: Sequence[CaseKey],
    slerp: Sequence[float],
    oracle: Sequence[float],
    overcorrecting: Sequence[bool] | None = None,
) -> str:
    """A markdown table per cell, per level and pooled: each way's mean [95 % CI] (stratified by cell), the hard-rule share,
    the rules broken (counts), the safe plans' mean, the share of plans that overcorrect (``overcorrecting``,
    one flag per case; "-" without), uniform SLERP's and the oracle's means."""
    ways = [w for w in CHECKS if rows and rows[0][w] is not None]
    lines = [
        "| cases | "
        + " | ".join(w.replace("_", " ") for w in ways)
        + " | hard rule | rules broken | safe plans | overcorrecting "
        "| uniform SLERP | oracle |",
        "|---" * (len(ways) + 7) + "|",
    ]
    cells = np.array([cell_name(k) for k in keys])
    levels = np.array([k.task_id for k in keys])
    groups = [(c, cells == c) for c in CELL_NAMES] + [(lv, levels == lv) for lv in dict.fromkeys(levels)]
    for name, m in (*groups, ("pooled", np.ones(len(keys), bool))):
        if not m.any():
            continue
        sel = [r for r, keep in zip(rows, m) if keep]
        broken = np.array([bool(r["broken"]) for r in sel])
        rules = Counter(b for r in sel for b in r["broken"])
        means = []
        for w in ways:
            ci = mean_ci([r[w] for r in sel], cells[m])  # stratified by cell on levels and pooled
            means.append(f"{ci['mean']:.2f} [{ci['lo']:.2f}, {ci['hi']:.2f}]")
        safe = (
            np.mean([r["as_written"] for r, b in zip(sel, broken) if not b])
            if (~broken).any()
            else float("nan")
        )
        kinds = ", ".join(f"{k} {v}" for k, v in rules.most_common()) or "-"
        oc = f"{np.mean(np.asarray(overcorrecting)[m]):.2f}" if overcorrecting is not None else "-"
        lines.append(
            f"| {name} | {' | '.join(means)} | {broken.mean():.2f} | {kinds} | {safe:.2f} | {oc} "
            f"| {np.mean(np.asarray(slerp)[m]):.2f} | {np.mean(np.asarray(oracle)[m]):.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--seeds", type=int, default=32, help="held-out seeds per cell")
    parser.add_argument("--samples", type=int, default=4, help="sampled plans per case (0: none)")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (GRPO's)")
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument(
        "--room-share",
        type=float,
        default=None,
        help="also score the force-decay plans that do not overcorrect with each group overcorrected by "
        "this share of its teeth's smallest room (and by 0.1 alike)",
    )
    args = parser.parse_args(argv)

    import torch

    torch.manual_seed(0)
    model, tokenizer = models.load_policy(args.checkpoint, lora_r=0, max_seq_length=MAX_SEQ_LENGTH)
    model.eval()
    keys = heldout_cases(args.seeds)
    plans = greedy_plans(model, tokenizer, keys, args.max_new_tokens)
    samples = (
        sampled_plans(model, tokenizer, keys, args.max_new_tokens, args.samples, args.temperature)
        if args.samples
        else None
    )
    rows = safety_counterfactuals(plans, keys, samples)
    slerp = [r["scaled_reward"] for r in score_plans([UNIFORM_SLERP_PLAN] * len(keys), keys)]
    oracle = [r["scaled_reward"] for r in score_plans([plan_for_case(generate_case(*k)) for k in keys], keys)]
    print(
        f"{args.checkpoint}: greedy plans on {args.seeds} held-out seeds per cell"
        + (f", {args.samples} samples per case at temperature {args.temperature}" if args.samples else "")
        + "; scaled reward mean [95 % CI]"
    )
    print(table(rows, keys, slerp, oracle, [overcorrects(p) for p in plans]))
    if args.room_share is not None:
        print(
            f"\nforce-decay plans that do not overcorrect: as written, within {args.room_share} of the room, 0.1 alike"
        )
        print("| cell | plans | as written | within the room | 0.1 alike |\n|---|---|---|---|---|")
        for r in room_counterfactual(plans, keys, args.room_share):
            ways = [r[w] for w in ("as_written", "within_room", "uniform")]
            cells = " | ".join(
                "-" if w["mean"] is None else f"{w['mean']:.2f} ({w['broken']:.2f} broken)" for w in ways
            )
            print(f"| {r['cell']} | {r['plans']} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
