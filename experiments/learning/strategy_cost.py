"""How much of a planner's gap to uniform SLERP and to the oracle is the strategy it names?

For a checkpoint (``make learn``'s ``runs/learn/grpo_stage0``, ``grpo_bc``, ``bc``, ``stage0``), its
greedy plans for ``--seeds`` held-out seeds of every (task level x dynamics) cell, scored three ways
with the same staging:

* **as written**;
* **no strategy**: the ``strategy`` key removed, so the terminal's strategy multiplier is the neutral
  1.0 that uniform SLERP (which names none) gets;
* **optimal named**: the case's optimal strategy written in its place (1.2 only where the plan's
  movement follows that strategy's sequence, 1.0 otherwise: ``server/scoring.py``).

Beside them, the share of plans whose strategy, as written, earned the optimal (1.2), neutral (1.0)
or wrong (0.6) multiplier. A planner whose "no strategy" score is uniform SLERP's loses to SLERP by
its strategy alone; the gap from "optimal named" up to the oracle is what its staging leaves.

A second table shows what naming each strategy earns on uniform staging (the staging GRPO from the
format stage converges to), per cell: the share of cases where it earns the optimal, neutral or wrong
multiplier, its mean, and each case's best of the five (a perfect read-out of the strategy). Where no
strategy ever earns the optimal multiplier, the only signal the strategy's name carries on that staging
is to avoid the wrong one, and naming none scores as well as the best read-out.

    OMP_NUM_THREADS=1 python experiments/learning/strategy_cost.py --checkpoint runs/learn/grpo_stage0 [--seeds 32]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from experiments.learning.evaluation import (
    WAYS,
    greedy_plans,
    heldout_cases,
    mean_ci,
    strategy_counterfactuals,
    uniform_strategy_signal,
)
from experiments.learning.experiment import MAX_SEQ_LENGTH
from experiments.learning.report import CELL_NAMES, cell_name
from orthojob.eval.evaluation import UNIFORM_SLERP_PLAN
from orthojob.modeling import models
from server.cases import CaseKey, generate_case
from server.clinical_profiles import STRATEGIES
from server.oracle import plan_for_case
from server.treatment import score_plans


def table(
    rows: Sequence[dict], keys: Sequence[CaseKey], slerp: Sequence[float], oracle: Sequence[float]
) -> str:
    """A markdown table: per cell and pooled, each way's mean, the multiplier class shares, and
    uniform SLERP's and the oracle's means on the same cases."""
    lines = [
        "| cell | as written | no strategy | optimal named | optimal / neutral / wrong | uniform SLERP | oracle |",
        "|---|---|---|---|---|---|---|",
    ]
    cells = np.array([cell_name(k) for k in keys])
    for name in (*CELL_NAMES, "pooled"):
        m = np.ones(len(keys), bool) if name == "pooled" else cells == name
        if not m.any():
            continue
        sel = [r for r, keep in zip(rows, m) if keep]
        ways = []
        for w in WAYS:
            ci = mean_ci([r[w] for r in sel], cells[m])  # stratified by cell when pooled
            ways.append(f"{ci['mean']:.2f} [{ci['lo']:.2f}, {ci['hi']:.2f}]")
        shares = " / ".join(
            f"{np.mean([r['class'] == c for r in sel]):.2f}" for c in ("optimal", "neutral", "wrong")
        )
        ref = f"{np.mean(np.asarray(slerp)[m]):.2f} | {np.mean(np.asarray(oracle)[m]):.2f}"
        lines.append(f"| {name} | {' | '.join(ways)} | {shares} | {ref} |")
    return "\n".join(lines)


def uniform_table(keys: Sequence[CaseKey], slerp: Sequence[float]) -> str:
    """A markdown table per cell: for each strategy named on uniform staging, the shares of cases
    earning the optimal / neutral / wrong multiplier and the mean; then each case's best of the five."""
    signal = uniform_strategy_signal(keys)
    lines = [
        "| cell | " + " | ".join(STRATEGIES) + " | case-aware best | uniform SLERP (none named) |",
        "|---" * (len(STRATEGIES) + 3) + "|",
    ]
    cells = np.array([cell_name(k) for k in keys])
    for name in CELL_NAMES:
        m = cells == name
        if not m.any():
            continue
        row = []
        for s in STRATEGIES:
            cls = np.asarray(signal[s]["class"])[m]
            shares = "/".join(f"{np.mean(cls == c):.2f}" for c in ("optimal", "neutral", "wrong"))
            row.append(f"{np.mean(np.asarray(signal[s]['scaled'])[m]):.2f} ({shares})")
        best = np.mean(np.asarray(signal["case_aware_best"]["scaled"])[m])
        lines.append(f"| {name} | {' | '.join(row)} | {best:.2f} | {np.mean(np.asarray(slerp)[m]):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--seeds", type=int, default=32, help="held-out seeds per cell")
    parser.add_argument("--max-new-tokens", type=int, default=384)
    args = parser.parse_args(argv)

    model, tokenizer = models.load_policy(args.checkpoint, lora_r=0, max_seq_length=MAX_SEQ_LENGTH)
    model.eval()
    keys = heldout_cases(args.seeds)
    rows = strategy_counterfactuals(greedy_plans(model, tokenizer, keys, args.max_new_tokens), keys)
    slerp = [r["scaled_reward"] for r in score_plans([UNIFORM_SLERP_PLAN] * len(keys), keys)]
    oracle = [r["scaled_reward"] for r in score_plans([plan_for_case(generate_case(*k)) for k in keys], keys)]
    print(
        f"{args.checkpoint}: greedy plans on {args.seeds} held-out seeds per cell, scaled reward mean [95 % CI]"
    )
    print(table(rows, keys, slerp, oracle))
    print()
    print("Each strategy named on uniform staging: mean (optimal/neutral/wrong multiplier shares)")
    print(uniform_table(keys, slerp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
