"""Importing a case set: seconds to read and validate N cases, and the cost of scoring an imported case
against a generated one (not a test; single process).

Writes N generated cases (the three levels in turn, half under force decay) as JSON Lines with
``orthojob cases export``'s code, then times :func:`orthojob.data.case_sets.validate` on the file (every
check of docs/cases.md, each case built), and scores the oracle's plans on 64 imported and the same
64 generated cases (batch scoring, median of ``--rounds``).

    OMP_NUM_THREADS=1 python bench/case_import.py [--cases 10000] [--rounds 7] [--unlabelled] [--absent 15,25]

``--absent``: every record lacks these teeth (taken out of its lists and marked absent; the space
kept), so the import builds their placeholders and masks, and the scoring comparison is an imported
case with absent teeth against the generated case it came from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from orthojob.data import case_sets
from server.case_records import record_of_case
from server.cases import TASK_IDS, generate_case
from server.oracle import plan_for_case
from server.treatment import score_plans


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--unlabelled",
        action="store_true",
        help="records without labels: every diagnosis computed from the poses",
    )
    parser.add_argument("--absent", default="", help="FDI ids every record lacks, comma-separated")
    args = parser.parse_args(argv)
    absent = [int(t) for t in args.absent.split(",") if t]
    keys = [(TASK_IDS[i % 3], i, bool(i % 2)) for i in range(args.cases)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cases.jsonl"
        t0 = time.perf_counter()
        with path.open("w") as f:
            for k in keys:
                record = record_of_case(generate_case(*k))
                if args.unlabelled:
                    del record["labels"]
                if absent:
                    keep = [i for i, t in enumerate(record["teeth"]) if t not in absent]
                    for name in ("teeth", "initial", "target", "crown_width_mm", "crown_depth_mm"):
                        record[name] = [record[name][i] for i in keep]
                    record["absent"] = absent
                f.write(json.dumps(record) + "\n")
        written = time.perf_counter() - t0
        size = path.stat().st_size
        t0 = time.perf_counter()
        report = case_sets.validate(str(path))
        seconds = time.perf_counter() - t0
    assert report.ok, report.summary()
    print(
        f"wrote {args.cases} generated cases ({size / 1e6:.1f} MB) in {written:.1f} s (generation included)"
    )
    print(
        f"read and validated {len(report.cases)} {'unlabelled ' if args.unlabelled else ''}cases"
        f"{f' lacking {args.absent}' if absent else ''} in {seconds:.2f} s: {1e3 * seconds / args.cases:.3f} ms a case"
    )
    generated = [generate_case(*k) for k in keys[:64]]
    imported = report.cases[:64]
    plans = [plan_for_case(c) for c in imported]
    times = {"generated": [], "imported": []}
    for _ in range(args.rounds):
        for name, cases in (("generated", generated), ("imported", imported)):
            t0 = time.perf_counter()
            score_plans(plans, cases)
            times[name].append(time.perf_counter() - t0)
    g, i = (statistics.median(times[n]) * 1e3 for n in ("generated", "imported"))
    print(
        f"scoring 64 oracle plans: generated cases {g:.1f} ms, imported {i:.1f} ms (imported / generated {i / g:.3f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
