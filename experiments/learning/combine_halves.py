"""One ``make learn`` report from its two halves, run apart: a ``--stage0-only`` run and a ``--chain-only`` run.

``make learn`` runs its two halves as two processes, one per core: stage 0 with GRPO from it, and the
chain (BC, GRPO from BC). Neither reads the other's results. A trial that changes one half can
therefore run that half alone, on one core, beside another trial; this script joins a stage-0 run's
``learning.json`` with a chain run's ``chain.json`` into the report ``make learn`` would have written
(:func:`experiments.learning.experiment.finish_report`: the targets, the paired differences, ``comparison.md``,
``learning.png``) and prints its targets. Both halves must have evaluated the same held-out cases
(the same ``--eval-seeds``) with the same ``--seed``; otherwise it exits 2 saying which differs.

    python experiments/learning/combine_halves.py runs/stage0-s0 runs/chain-s0 --out runs/learn-s0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.learning.config import CHAIN_FILE
from experiments.learning.experiment import finish_report
from experiments.learning.report import targets_table


def _chain_seed(record: dict) -> int | None:
    """The chain's seed: from its settings, or, in a record written before they were kept, from GRPO's."""
    if "config" in record:
        return record["config"]["seed"]
    grpo = (record.get("grpo_bc") or {}).get("training") or {}
    return (grpo.get("grpo_config") or {}).get("seed")


def _chain_wall_seconds(record: dict) -> float:
    """The chain's wall time: as recorded, or, in a record written before it was kept, BC's wall time, the
    evaluation of GRPO's start and GRPO's training time (which holds the later evaluations)."""
    if "wall_seconds" in record:
        return float(record["wall_seconds"])
    grpo = record["grpo_bc"]
    start_eval = grpo["evaluations"][0].get("eval_seconds") or 0.0
    return float(record["bc"]["wall_seconds"]) + start_eval + float(grpo["training"]["grpo_seconds"])


def _case_counts(evaluation: dict) -> dict[str, int]:
    return {cell: len(scores) for cell, scores in (evaluation.get("per_case") or {}).items()}


def combine(stage0_report: dict, chain_record: dict) -> dict:
    """The joined report (not yet judged). A ValueError naming what differs when the halves used
    different seeds or evaluated different cases, or when either half is missing."""
    if "grpo_stage0" not in stage0_report.get("runs", {}):
        raise ValueError("the first folder holds no GRPO-from-stage-0 run: give a --stage0-only run's folder")
    if "grpo_bc" not in chain_record:
        raise ValueError(
            "the chain record holds no GRPO-from-BC run: give a finished --chain-only run's folder"
        )
    seed, chain_seed = stage0_report["config"]["seed"], _chain_seed(chain_record)
    if chain_seed is not None and chain_seed != seed:
        raise ValueError(f"the halves ran with different seeds: stage 0 {seed}, chain {chain_seed}")
    ours = _case_counts(stage0_report["runs"]["grpo_stage0"]["evaluations"][0])
    theirs = _case_counts(chain_record["grpo_bc"]["evaluations"][0])
    if ours != theirs:
        raise ValueError(f"the halves evaluated different cases per cell: {ours} against {theirs}")
    return {
        **stage0_report,
        "runs": {"grpo_stage0": stage0_report["runs"]["grpo_stage0"]},
        "halves": "stage 0's process and the chain's process run apart (experiments/learning/combine_halves.py)",
        "chain_config": chain_record.get("config"),  # "config" is the stage-0 run's
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage0_run", help="a `python -m experiments.learning --stage0-only` output folder")
    parser.add_argument("chain_run", help="a `python -m experiments.learning --chain-only` output folder")
    parser.add_argument(
        "--out",
        required=True,
        help="the joined report's folder: new, or without a learning.json (not one of the two)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.resolve() in {Path(args.stage0_run).resolve(), Path(args.chain_run).resolve()}:
        print("--out must be a new folder, not one of the halves", file=sys.stderr)
        return 2
    if (out / "learning.json").exists():
        print(f"{out} already holds a report: give a new folder (or remove it)", file=sys.stderr)
        return 2
    try:
        stage0_report = json.loads((Path(args.stage0_run) / "learning.json").read_text())
        chain_record = json.loads((Path(args.chain_run) / CHAIN_FILE).read_text())
        report = combine(stage0_report, chain_record)
    except (OSError, ValueError) as err:
        print(f"cannot combine: {err}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    wall = max(float(stage0_report.get("wall_seconds") or 0.0), _chain_wall_seconds(chain_record))
    finish_report(report, chain_record, out, wall)
    print(targets_table(report["targets"]))
    print("ALL TARGETS PASSED" if report["passed"] else "SOME TARGETS FAILED")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
