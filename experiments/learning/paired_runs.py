"""Two ``make learn`` runs compared case by case: each planner of run A against the same planner of run B.

Both runs evaluate the same held-out cases (the seeds from ``HELDOUT_SEED_START``, the same count per
cell), and ``learning.json`` keeps every planner's per-case scaled reward. For each planner both runs
have (stage 0, GRPO from stage 0 at its last step, BC, GRPO from BC at its last step), this prints
the mean per-case difference A - B and its 95 % interval (stratified by cell,
:func:`experiments.learning.report.paired_per_case`), per level and pooled. Two runs that differ in one setting
are compared on the same cases, so what the cases share drops out: a trial's effect with a narrower
interval than the difference of two unpaired means.

    python experiments/learning/paired_runs.py runs/learn-terse runs/learn
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.learning.report import PLANNER_LABELS, paired_per_case, planners, table_of

PLANNERS: tuple[str, ...] = ("stage0", "grpo_stage0", "bc", "grpo_bc")


def paired_runs(report_a: dict, report_b: dict) -> list[dict]:
    """Per planner both reports evaluated case by case: ``{"planner", "levels": {level: ci}, "pooled": ci}``
    of the per-case differences A - B. A ValueError when the runs evaluated different numbers of cases."""
    table = table_of(report_a, report_b)
    a, b = planners(report_a, table), planners(report_b, table)
    try:
        return [
            {
                "planner": name,
                **paired_per_case(a[name]["per_case"], b[name]["per_case"], f"the runs' {name}"),
            }
            for name in PLANNERS
            if "per_case" in a.get(name, {}) and "per_case" in b.get(name, {})
        ]
    except ValueError as err:
        raise ValueError(f"{err}: compare runs made with the same --eval-seeds") from None


def _ci(ci: dict) -> str:
    return f"{ci['mean']:+.2f} [{ci['lo']:+.2f}, {ci['hi']:+.2f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a", help="a make learn output folder (with learning.json)")
    parser.add_argument("run_b", help="the run it is compared against")
    args = parser.parse_args(argv)
    reports = [json.loads((Path(p) / "learning.json").read_text()) for p in (args.run_a, args.run_b)]
    rows = paired_runs(*reports)
    if not rows:
        print("no planner has per-case scores in both runs", file=sys.stderr)
        return 1
    levels = list(rows[0]["levels"])
    print(f"Per-case difference in scaled reward, {args.run_a} minus {args.run_b}, mean [95 % CI]:\n")
    print("| planner | " + " | ".join([*levels, "pooled"]) + " |")
    print("|---" * (len(levels) + 2) + "|")
    for r in rows:
        cells = [_ci(r["levels"][lv]) for lv in levels] + [_ci(r["pooled"])]
        print(f"| {PLANNER_LABELS[r['planner']]} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
