"""The report of ``--chain-only`` runs on their own (BC, GRPO from BC), side by side: one per run folder.

Each chain run (``python -m experiments.learning --chain-only``) writes ``chain.json`` and no report. This
script completes each with the references (:func:`experiments.learning.experiment.report_head`, the run's own
settings) into the report ``make learn`` writes (:func:`experiments.learning.experiment.finish_report`), in
``<run>/chain_report/``; GRPO from stage 0's targets read missing. It prints each run's targets and, for
all runs, BC and GRPO from BC on the final range pooled: the executed plans' scaled reward, the raw
plans', the repair share, and the share of the SLERP -> oracle gap GRPO from BC closes. For two GRPO
objectives run side by side (one core each):

    OMP_NUM_THREADS=1 python -m experiments.learning --chain-only --objective raw --out runs/obj-raw &
    OMP_NUM_THREADS=1 python -m experiments.learning --chain-only --objective engine --out runs/obj-engine &
    wait; python experiments/learning/chain_report.py runs/obj-raw runs/obj-engine
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.learning.config import CHAIN_FILE
from experiments.learning.evaluation import heldout_cases
from experiments.learning.experiment import LearnConfig, finish_report, report_head
from experiments.learning.report import planners, targets_table
from orthojob.core.metrics import SCALED_REWARD

COLUMNS: tuple[tuple[str, str], ...] = (
    (SCALED_REWARD, "executed"),
    ("raw_scaled_reward_mean", "raw"),
    ("repair_share", "repair share"),
)


def chain_report(folder: Path) -> dict:
    """``folder``'s chain record completed into a report, written to ``folder/chain_report/``."""
    record = json.loads((folder / CHAIN_FILE).read_text())
    cfg = LearnConfig(**{**record["config"], "chain_only": False})
    report = report_head(cfg, heldout_cases(cfg.eval_seeds))
    out = folder / "chain_report"
    out.mkdir(exist_ok=True)
    finish_report(report, record, out, float(record.get("wall_seconds") or 0.0))
    return report


def summary_row(name: str, report: dict) -> str:
    """One run's BC and GRPO from BC on the final range, pooled, and GRPO from BC's share of the gap."""
    p = planners(report)
    cells = []
    for planner in ("bc", "grpo_bc"):
        pooled = p.get(planner, {}).get("pooled", {})
        cells += [
            f"{pooled[m]['mean']:.3f}" if pooled.get(m, {}).get("mean") is not None else "-"
            for m, _ in COLUMNS
        ]
    gap = next((t["value"] for t in report["targets"] if t["name"] == "final_closes_the_gap"), "-")
    objective = report["config"]["objective"]
    return f"| {name} | {objective} | " + " | ".join(cells) + f" | {gap} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "runs", nargs="+", help="`python -m experiments.learning --chain-only` output folders"
    )
    args = parser.parse_args(argv)
    rows = []
    for run in args.runs:
        report = chain_report(Path(run))
        print(f"\n{run} (objective {report['config']['objective']}):\n{targets_table(report['targets'])}")
        rows.append(summary_row(run, report))
    heads = [f"{who} {h}" for who in ("BC", "GRPO from BC") for _, h in COLUMNS]
    print("\nFinal range, pooled (executed: the plans the staging engine carries out; raw: as written):\n")
    print("| run | objective | " + " | ".join(heads) + " | gap closed |")
    print("|---" * (len(heads) + 3) + "|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
