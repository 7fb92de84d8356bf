"""A finished ``make learn`` run's planners compared case by case on the same held-out cases.

Loads the run's four checkpoints (``<out>/stage0``, ``bc``, ``grpo_stage0``, ``grpo_bc``: the last step
of each GRPO run), evaluates each greedily on ``--seeds`` held-out seeds of every cell with the
experiment's own evaluation (:func:`experiments.learning.evaluation.evaluate_model`, deterministic, so the
scores are the run's own), and prints the paired differences of
:func:`experiments.learning.report.paired_differences`: the mean per-case difference in scaled reward
and its 95 % interval (stratified by cell), per level and pooled; then each planner's table per cell,
per level and pooled, with the intervals as ``make learn`` now computes them. ``make learn`` prints the same table for runs made
since it records per-case scores; this rebuilds it for a run made before.

    OMP_NUM_THREADS=1 python experiments/learning/paired_heldout.py --out runs/learn [--seeds 32]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.learning.evaluation import evaluate_model, heldout_cases, reference_rows
from experiments.learning.experiment import MAX_SEQ_LENGTH
from experiments.learning.report import markdown_tables, paired_differences, paired_table
from orthojob.modeling import models

CHECKPOINTS: dict[str, tuple[str, int]] = {
    "stage0": ("grpo_stage0", 0),
    "grpo_stage0": ("grpo_stage0", 1),
    "bc": ("grpo_bc", 0),
    "grpo_bc": ("grpo_bc", 1),
}
"""Each checkpoint folder: the run whose evaluations it fills, and where (0 its start, 1 its last step)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="a make learn output folder")
    parser.add_argument("--seeds", type=int, default=32, help="held-out seeds per cell")
    parser.add_argument("--max-new-tokens", type=int, default=384)
    args = parser.parse_args(argv)

    out = Path(args.out)
    missing = [name for name in CHECKPOINTS if not (out / name).is_dir()]
    if missing:
        parser.error(f"{out} lacks {', '.join(missing)}: point --out at a finished make learn run")
    cases = heldout_cases(args.seeds)
    report: dict = {"references": reference_rows(cases), "runs": {}}
    for name, (run, index) in CHECKPOINTS.items():
        model, tokenizer = models.load_policy(str(out / name), lora_r=0, max_seq_length=MAX_SEQ_LENGTH)
        evaluation = evaluate_model(model, tokenizer, cases, args.max_new_tokens)
        evals = report["runs"].setdefault(run, {"evaluations": [None, None]})["evaluations"]
        evals[index] = {"step": index, **evaluation}
        print(f"{name}: pooled scaled_reward {evaluation['pooled']['scaled_reward']['mean']:.3f}", flush=True)
    rows = paired_differences(report, "tuning")
    print(f"\n{out}: {args.seeds} held-out seeds per cell\n")
    print(paired_table(rows))
    print()
    print(markdown_tables(report, "tuning"))
    (out / "paired.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
