"""The oracle's safety audit: over many seeds, does its plan break a hard rule, and does it score
at least uniform SLERP? Its plans are the SFT demonstrations and the upper baseline, so an unsafe
one would teach harm (the reward-fidelity issue).

Used by ``tests/test_oracle_safety.py`` (a share of the seeds, within CI's time) and by
``experiments/audits/oracle_safety.py`` (all 1,000 seeds per level and dynamics).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from server.cases import generate_case
from server.oracle import plan_for_case
from server.treatment import score_plans

SLERP_TIE: float = 1e-4
"""The oracle writes fractions to 4 decimals: where it stages uniformly it can trail exact uniform
SLERP by ~5e-6 on the scaled reward."""

COMBOS: tuple[tuple[str, bool, bool], ...] = (
    *((t, d, False) for t in ("task_easy", "task_medium", "task_hard") for d in (False, True)),
    ("task_hard", False, True),
    ("task_hard", True, True),
)
"""(task_id, force_decay, non_compliance) combinations audited: every level under both dynamics,
and task_hard with non-compliance under both."""


class AuditRow(NamedTuple):
    """One seed's outcome: the rules the oracle's plan breaks, both scaled rewards, and the rules
    uniform SLERP's plan breaks."""

    seed: int
    broken_rules: list[str]
    oracle: float
    slerp: float
    slerp_broken_rules: list[str]


def audit_seeds(job: tuple[str, bool, bool, Sequence[int]]) -> list[AuditRow]:
    """Rows for the seeds of one (task_id, force_decay, non_compliance, seeds) job."""

    task, decay, non_compliance, seeds = job
    out = []
    for seed in seeds:
        case = generate_case(task, seed, decay, non_compliance)
        oracle, slerp = score_plans([plan_for_case(case), None], [case, case])
        out.append(
            AuditRow(
                seed,
                oracle["broken_rules"],
                oracle["scaled_reward"],
                slerp["scaled_reward"],
                slerp["broken_rules"],
            )
        )
    return out


def audit(
    seeds_per_combo: dict[tuple[str, bool, bool], Iterable[int]], workers: int = 2, chunks: int = 4
) -> dict[tuple[str, bool, bool], list[AuditRow]]:
    """Rows per combination, the seeds split into ``chunks`` jobs per combination over ``workers``
    spawned processes (1: in this process)."""
    jobs = []
    for combo, seeds in seeds_per_combo.items():
        seeds = list(seeds)
        size = max(1, -(-len(seeds) // chunks))
        jobs += [(*combo, seeds[k : k + size]) for k in range(0, len(seeds), size)]
    if workers > 1:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            done = pool.map(audit_seeds, jobs, chunksize=1)
    else:
        done = [audit_seeds(j) for j in jobs]
    out: dict[tuple[str, bool, bool], list[AuditRow]] = {c: [] for c in seeds_per_combo}
    for job, rows in zip(jobs, done):
        out[job[:3]] += rows
    return out


def summary(rows: list[AuditRow]) -> dict[str, object]:
    """Counts over one combination's rows: the oracle's plans breaking a rule, its plans below SLERP,
    the mean margin, and uniform SLERP's plans breaking a rule."""
    broken = [(r.seed, r.broken_rules) for r in rows if r.broken_rules]
    slerp_broken = [(r.seed, r.slerp_broken_rules) for r in rows if r.slerp_broken_rules]
    below = [(r.seed, round(r.oracle, 4), round(r.slerp, 4)) for r in rows if r.oracle < r.slerp - SLERP_TIE]
    margin = sum(r.oracle - r.slerp for r in rows) / max(len(rows), 1)
    return {
        "n": len(rows),
        "broken": broken,
        "below_slerp": below,
        "mean_margin": margin,
        "slerp_broken": slerp_broken,
    }
