"""Hard-rule shares of the oracle and of uniform SLERP, per level x dynamics x compliance (an audit).

For each cell (every level under ideal dynamics and force decay with full wear, and task_hard under
both with non-compliance) and each seed window, one process plans every case with
:func:`server.oracle.plan_for_case` (uncached), scores the oracle's plan and uniform SLERP's on it,
and prints: cases, the oracle's plans breaking a hard rule (count, share, which rules), uniform
SLERP's (the same), both mean scaled rewards and the oracle's planning time per case (CPU ms). The
seeds of the breaking plans follow each table. Exit status 1 if an oracle plan breaks a rule.

    OMP_NUM_THREADS=1 python experiments/audits/oracle_noncompliance.py [--seeds 1000] [--full-wear-seeds 200]
        [--starts 3000000 1000000] [--rows FILE]

``--starts``: the first seed of each window (default: 3,000,000, a range no default was chosen on,
and the project's held-out range, :data:`server.cases.HELDOUT_SEED_START`). ``--rows FILE`` writes
one JSON line per case (cell, seed, both results' rules and scaled rewards, and a digest of the
oracle's plan), to compare two versions of the oracle case by case.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from server.cases import HELDOUT_SEED_START, TASK_IDS, generate_case
from server.compliance import COMPLIANCE_TASKS
from server.oracle import plan_for_case
from server.treatment import score_plans

FRESH_SEED_START: int = 3_000_000
"""First seed of a window no default, test or tuning run of the project was chosen on."""


def cells() -> list[tuple[str, bool, bool]]:
    """(task_id, force_decay, non_compliance): every level under both dynamics with full wear, then
    the levels that offer non-compliance under both dynamics with it."""
    full = [(t, d, False) for t in TASK_IDS for d in (False, True)]
    return full + [(t, d, True) for t in TASK_IDS if t in COMPLIANCE_TASKS for d in (False, True)]


def plan_digest(plan: dict) -> str:
    """A short digest of a plan's JSON (keys sorted): equal digests, the same plan."""
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]


def run_cell(task: str, decay: bool, nc: bool, seeds: range) -> tuple[list[dict], float]:
    """One row per seed and the oracle's mean planning time (CPU ms per case: what the machine's other
    load does not change)."""
    rows, planning = [], 0.0
    for seed in seeds:
        case = generate_case(task, seed, decay, nc)
        t = time.process_time()
        plan = plan_for_case(case)
        planning += time.process_time() - t
        oracle, slerp = score_plans([plan, None], [case, case])
        rows.append(
            {
                "task": task,
                "force_decay": decay,
                "non_compliance": nc,
                "seed": seed,
                "oracle_rules": oracle["broken_rules"],
                "oracle_scaled": oracle["scaled_reward"],
                "slerp_rules": slerp["broken_rules"],
                "slerp_scaled": slerp["scaled_reward"],
                "plan_digest": plan_digest(plan),
            }
        )
    return rows, 1000.0 * planning / max(len(rows), 1)


def _rules(rows: list[dict], key: str) -> str:
    counts = Counter(rule for r in rows for rule in r[key])
    return ",".join(f"{k}:{v}" for k, v in sorted(counts.items())) or "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1000, help="seeds per non-compliance cell")
    parser.add_argument("--full-wear-seeds", type=int, default=200, help="seeds per full-wear cell")
    parser.add_argument(
        "--starts", type=int, nargs="+", default=[FRESH_SEED_START, HELDOUT_SEED_START], help="window starts"
    )
    parser.add_argument("--non-compliance-only", action="store_true", help="only the non-compliance cells")
    parser.add_argument("--rows", type=Path, help="write one JSON line per case here")
    args = parser.parse_args(argv)
    out = args.rows.open("w") if args.rows else None
    broken = 0
    for start in args.starts:
        print(f"seeds from {start}")
        print(f"{'task':12s} {'decay':>5s} {'nc':>3s} {'n':>5s} {'oracle':>7s} {'share':>7s} {'SLERP':>6s} "
              f"{'share':>7s} {'oracle':>7s} {'SLERP':>7s} {'ms':>6s}  rules (oracle | SLERP)")  # fmt: skip
        failing = []
        for task, decay, nc in cells():
            if args.non_compliance_only and not nc:
                continue
            n = args.seeds if nc else args.full_wear_seeds
            rows, ms = run_cell(task, decay, nc, range(start, start + n))
            bad = [r["seed"] for r in rows if r["oracle_rules"]]
            slerp_bad = sum(bool(r["slerp_rules"]) for r in rows)
            broken += len(bad)
            failing += [(task, decay, nc, s) for s in bad]
            mean_o = sum(r["oracle_scaled"] for r in rows) / n
            mean_s = sum(r["slerp_scaled"] for r in rows) / n
            print(f"{task:12s} {int(decay):5d} {int(nc):3d} {n:5d} {len(bad):7d} {len(bad) / n:7.2%} "
                  f"{slerp_bad:6d} {slerp_bad / n:7.2%} {mean_o:7.3f} {mean_s:7.3f} {ms:6.0f}  "
                  f"{_rules(rows, 'oracle_rules')} | {_rules(rows, 'slerp_rules')}", flush=True)  # fmt: skip
            for r in rows if out else ():
                out.write(json.dumps(r) + "\n")
            if out:
                out.flush()
        print(f"oracle plans breaking a rule: {failing or 'none'}\n", flush=True)
    if out:
        out.close()
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
