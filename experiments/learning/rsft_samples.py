"""What a planner's own samples reach, per cell: the RSFT samples file that ``make learn`` writes.

``python -m experiments.learning --rsft-prompts N`` samples BC ``--rsft-samples`` times per training
prompt and writes every sample, scored, to ``<out>/rsft/rsft_samples.jsonl``. This reads that file
and prints, per (level x dynamics) cell: the prompts, the share with at least one safe sample (a
plan that breaks no hard rule), the share with a safe sample at or above uniform SLERP on the same
case, and the mean scaled reward of uniform SLERP, of the safe samples, and of the best safe sample
of each prompt (uniform SLERP where none is safe). Where the best of k safe samples is at SLERP's
level, filtering broken plans cannot lift the planner above SLERP: its staging must improve.

    python experiments/learning/rsft_samples.py [runs/learn/rsft/rsft_samples.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.learning.report import CELL_NAMES, cell_name
from server.cases import CaseKey

UNSAFE = ("not_a_plan", "hard_rule")
"""The ``dropped`` reasons of a sample that is not a safe plan."""


def per_cell(rows: list[dict]) -> dict[str, dict]:
    """Per cell (``"task_easy/ideal"``, ...), the figures the module docstring lists, from the
    samples file's rows (each with ``task_id``, ``seed``, ``force_decay``, ``prompt_index``,
    ``scaled_reward``, ``slerp_scaled_reward``, ``dropped`` and ``broken_rules``)."""
    prompts: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in rows:
        cell = cell_name(CaseKey(r["task_id"], r["seed"], r["force_decay"]))
        prompts[(cell, r["prompt_index"])].append(r)
    out: dict[str, dict] = {}
    for (cell, _), samples in sorted(prompts.items(), key=lambda kv: (CELL_NAMES.index(kv[0][0]), kv[0][1])):
        c = out.setdefault(
            cell, {"slerp": [], "safe": [], "best": [], "any_safe": [], "at_slerp": [], "rules": Counter()}
        )
        slerp = samples[0]["slerp_scaled_reward"]
        safe = [s["scaled_reward"] for s in samples if s["dropped"] not in UNSAFE]
        c["slerp"].append(slerp)
        c["safe"].extend(safe)
        c["best"].append(max(safe) if safe else slerp)
        c["any_safe"].append(bool(safe))
        c["at_slerp"].append(any(v >= slerp for v in safe))
        c["rules"].update(rule for s in samples for rule in s["broken_rules"] or ())
    return {
        cell: {
            "prompts": len(c["slerp"]),
            "any_safe": float(np.mean(c["any_safe"])),
            "safe_at_slerp": float(np.mean(c["at_slerp"])),
            "slerp": float(np.mean(c["slerp"])),
            "safe_mean": float(np.mean(c["safe"])) if c["safe"] else float("nan"),
            "best_safe": float(np.mean(c["best"])),
            "rules": dict(c["rules"].most_common()),
        }
        for cell, c in out.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "path", nargs="?", default="runs/learn/rsft/rsft_samples.jsonl", help="the samples file"
    )
    args = parser.parse_args(argv)
    path = Path(args.path)
    if not path.is_file():
        parser.error(
            f"{path} not found: run python -m experiments.learning --rsft-prompts N --out <out> first"
        )
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    print(f"{len(rows)} samples in {path}")
    print(
        "| cell | prompts | a safe sample | a safe sample >= SLERP | SLERP | safe samples | best safe | rules broken |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for cell, f in per_cell(rows).items():
        print(f"| {cell} | {f['prompts']} | {f['any_safe']:.2f} | {f['safe_at_slerp']:.2f} | {f['slerp']:.2f} | "
              f"{f['safe_mean']:.2f} | {f['best_safe']:.2f} | {f['rules']} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
