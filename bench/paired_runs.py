"""Two ``make learn`` runs compared case by case: each planner of run A against the same planner of run B.

Both runs evaluate the same held-out cases (the seeds from ``HELDOUT_SEED_START``, the same count per
cell), and ``learning.json`` keeps every planner's per-case scaled reward. For each planner both runs
have (stage 0, GRPO from stage 0 at its last step, BC, GRPO from BC at its last step), this prints
the mean per-case difference A - B and its 95 % interval (stratified by cell,
:func:`examples.learning_report.mean_ci`), per level and pooled. Two runs that differ in one setting
are compared on the same cases, so what the cases share drops out: a trial's effect with a narrower
interval than the difference of two unpaired means.

    python bench/paired_runs.py runs/learn-terse runs/learn
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.learning_report import PLANNER_LABELS, mean_ci, planners

PLANNERS: tuple[str, ...] = ("stage0", "grpo_stage0", "bc", "grpo_bc")


def paired_runs(report_a: dict, report_b: dict) -> list[dict]:
    """Per planner both reports evaluated case by case: ``{"planner", "levels": {level: ci}, "pooled": ci}``
    of the per-case differences A - B. A ValueError when the runs evaluated different numbers of cases."""
    a, b = planners(report_a), planners(report_b)
    rows = []
    for name in PLANNERS:
        if "per_case" not in a.get(name, {}) or "per_case" not in b.get(name, {}):
            continue
        by_level: dict[str, tuple[list[float], list[str]]] = {}
        for cell, xs in a[name]["per_case"].items():
            ys = b[name]["per_case"].get(cell)
            if ys is None or len(ys) != len(xs):
                raise ValueError(
                    f"{name}: the runs evaluated different cases in {cell} ({len(xs)} vs {len(ys or [])}): "
                    "compare runs made with the same --eval-seeds"
                )
            values, strata = by_level.setdefault(cell.split("/")[0], ([], []))
            values.extend(x - y for x, y in zip(xs, ys))
            strata.extend([cell] * len(xs))
        pooled = (
            [v for vs, _ in by_level.values() for v in vs],
            [s for _, ss in by_level.values() for s in ss],
        )
        rows.append({"planner": name, "levels": {lv: mean_ci(*vs) for lv, vs in by_level.items()},
                     "pooled": mean_ci(*pooled)})  # fmt: skip
    return rows


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
