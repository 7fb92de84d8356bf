"""A safe oracle and a safe baseline: the oracle's plan (and, with full wear, uniform SLERP's) breaks
no hard rule, and the oracle's scores at least uniform SLERP's, on every seed, at every level, under ideal dynamics and force decay, and with
non-compliance on task_hard (:mod:`orthojob.eval.oracle_audit`).

Within CI's time: all 1,000 seeds per level where the teeth follow the plan (ideal dynamics, full
wear), the first 250 where the dynamics are simulated (4x the cost a case). The full 1,000 seeds
of every combination: ``python bench/oracle_safety.py`` (figures in the README)."""

from __future__ import annotations

import pytest

from orthojob.eval.oracle_audit import COMBOS, audit, summary

SEEDS_FOLLOWING_THE_PLAN = 1000
SEEDS_SIMULATED = 250


def seeds_for(combo: tuple[str, bool, bool]) -> range:
    _, decay, non_compliance = combo
    return range(SEEDS_SIMULATED if (decay or non_compliance) else SEEDS_FOLLOWING_THE_PLAN)


@pytest.fixture(scope="module")
def outcomes():
    return audit({c: seeds_for(c) for c in COMBOS}, workers=2)


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"{c[0]}-decay{int(c[1])}-noncompliance{int(c[2])}")
def test_the_oracle_and_slerp_break_no_hard_rule_and_the_oracle_beats_slerp(outcomes, combo):
    s = summary(outcomes[combo])
    assert s["n"] == len(seeds_for(combo))
    print(f"{combo}: {len(s['broken'])} plans breaking a rule, {len(s['below_slerp'])} below SLERP, "
          f"mean margin {s['mean_margin']:+.3f}")  # fmt: skip
    assert not s["broken"], s["broken"][:10]
    assert not s["below_slerp"], s["below_slerp"][:10]
    # uniform SLERP ignores the wear it is given: only with full wear is it a safe baseline (with
    # non-compliance about 1 plan in 5 breaks a rule, bench/oracle_safety.py)
    if not combo[2]:
        assert not s["slerp_broken"], s["slerp_broken"][:10]
