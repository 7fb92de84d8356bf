"""A safe oracle (the reward-fidelity issue): on 1,000 seeds per task level, under ideal dynamics
and force decay, and with non-compliance on task_hard, the oracle's plan breaks no hard rule and
scores at least uniform SLERP on every seed. Its plans are the SFT demonstrations and the upper
baseline, so an unsafe one would teach harm.

The 8,000 cases run in two worker processes (one per core); each worker returns, per seed, the
rules broken and the two scaled rewards."""

from __future__ import annotations

import multiprocessing

import pytest

SEEDS_PER_LEVEL = 1000
SLERP_TIE = 1e-4
"""The oracle writes fractions to 4 decimals: where it stages uniformly it can trail exact uniform
SLERP by ~5e-6 on the scaled reward."""
COMBOS: tuple[tuple[str, bool, bool], ...] = (
    *((t, d, False) for t in ("task_easy", "task_medium", "task_hard") for d in (False, True)),
    ("task_hard", False, True),
    ("task_hard", True, True),
)


def check_seeds(job: tuple[str, bool, bool, int, int]) -> list[tuple[int, list[str], float, float]]:
    """(seed, broken rules, oracle scaled, SLERP scaled) for seeds [lo, hi) of one combination."""
    from server.cases import generate_case
    from server.oracle import plan_for_case
    from server.treatment import score_plans

    task, decay, non_compliance, lo, hi = job
    out = []
    for seed in range(lo, hi):
        case = generate_case(task, seed, decay, non_compliance)
        oracle, slerp = score_plans([plan_for_case(case), None], [case, case])
        out.append((seed, oracle["broken_rules"], oracle["scaled_reward"], slerp["scaled_reward"]))
    return out


@pytest.fixture(scope="module")
def outcomes() -> dict[tuple[str, bool, bool], list]:
    chunk = SEEDS_PER_LEVEL // 4
    jobs = [(*c, lo, lo + chunk) for c in COMBOS for lo in range(0, SEEDS_PER_LEVEL, chunk)]
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        done = pool.map(check_seeds, jobs, chunksize=1)
    out: dict[tuple[str, bool, bool], list] = {c: [] for c in COMBOS}
    for job, rows in zip(jobs, done):
        out[job[:3]] += rows
    return out


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"{c[0]}-decay{int(c[1])}-noncompliance{int(c[2])}")
def test_the_oracle_breaks_no_hard_rule_and_beats_slerp(outcomes, combo):
    rows = outcomes[combo]
    assert len(rows) == SEEDS_PER_LEVEL
    broken = [(seed, rules) for seed, rules, _, _ in rows if rules]
    below = [(seed, round(o, 4), round(u, 4)) for seed, _, o, u in rows if o < u - SLERP_TIE]
    margin = sum(o - u for _, _, o, u in rows) / len(rows)
    print(
        f"{combo}: {len(broken)} plans breaking a rule, {len(below)} below SLERP, mean margin {margin:+.3f}"
    )
    assert not broken, broken[:10]
    assert not below, below[:10]
