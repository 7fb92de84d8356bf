"""A safe oracle and a safe baseline: the oracle's plan (and, with full wear, uniform SLERP's) breaks
no hard rule, and the oracle's scores at least uniform SLERP's, on every seed, at every level, under ideal dynamics and force decay, and with
non-compliance on task_hard (:mod:`experiments.audits.oracle_audit`).

Within CI's time: all 1,000 seeds per level where the teeth follow the plan (ideal dynamics, full
wear), the first 250 where the dynamics are simulated (4x the cost a case). The full 1,000 seeds
of every combination: ``python experiments/audits/oracle_safety.py`` (figures in the README). With non-compliance
also the seeds on which the oracle once broke a rule and a window of the tests' seed range, and the
oracle's last resort (:func:`server.oracle_fallback.safe_fallback`) where uniform SLERP breaks a rule; the
1,000-seed shares on fresh seeds: ``python experiments/audits/oracle_noncompliance.py``."""

from __future__ import annotations

import pytest

from experiments.audits.oracle_audit import COMBOS, audit, summary
from server.cases import generate_case
from server.clinical_profiles import optimal_strategy
from server.oracle import infer_profiles, plan_for_case, uniform_staging
from server.oracle_fallback import lagging_windows, safe_fallback
from server.seed_ranges import TESTS
from server.staging import arrays_to_plan
from server.treatment import score_plans

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
    # non-compliance about 1 plan in 4 breaks a rule under ideal dynamics, 1 in 9 under force decay:
    # experiments/audits/oracle_noncompliance.py)
    if not combo[2]:
        assert not s["slerp_broken"], s["slerp_broken"][:10]


# task_hard with non-compliance: seeds on which the oracle once broke a rule (a lost attachment late in
# treatment under ideal dynamics, or over the middle aligners under force decay), then a window of the
# tests' range; the 1,000-seed shares: experiments/audits/oracle_noncompliance.py
REGRESSION_SEEDS: dict[bool, tuple[int, ...]] = {
    False: (1000022, 1000146, 3000296, 3000375, 3000485, 3000644, 3000840),
    True: (1000176, 3000215),
}
NON_COMPLIANCE_SEEDS = 30
SLERP_BREAKING_CASES = 3


@pytest.mark.parametrize("decay", (False, True), ids=("ideal", "decay"))
def test_the_oracle_breaks_no_rule_with_non_compliance(decay):
    seeds = [*REGRESSION_SEEDS[decay], *range(TESTS.start, TESTS.start + NON_COMPLIANCE_SEEDS)]
    cases = [generate_case("task_hard", s, decay, True) for s in seeds]
    results = score_plans([plan_for_case(c) for c in cases], cases)
    broken = [(s, r["broken_rules"]) for s, r in zip(seeds, results) if r["broken_rules"]]
    assert not broken


@pytest.mark.parametrize("decay", (False, True), ids=("ideal", "decay"))
def test_the_safe_fallback_makes_uniform_staging_safe_where_slerp_breaks_a_rule(decay):
    """Uniform SLERP ignores the wear: where it breaks a rule, the oracle's last resort built from it
    reschedules the lagging tooth (or slows the teeth) into a plan that breaks none."""
    checked = 0
    for seed in range(TESTS.start, TESTS.start + 200):
        case = generate_case("task_hard", seed, decay, True)
        if not score_plans([None], [case])[0]["broken_rules"]:
            continue
        strategy = optimal_strategy(*infer_profiles(case.initial, case.target))
        found = safe_fallback(case, strategy, [uniform_staging()])
        assert found is not None, seed
        staging, result = found
        assert not result["broken_rules"], seed
        plan = arrays_to_plan(strategy, *staging, absent=case.absent)
        assert not score_plans([plan], [case])[0]["broken_rules"], seed
        checked += 1
        if checked == SLERP_BREAKING_CASES:
            break
    assert checked == SLERP_BREAKING_CASES


def test_lagging_windows_name_the_lost_attachment_and_its_stages():
    case = generate_case("task_hard", TESTS.start, False, True)
    windows = lagging_windows(case.wear)
    assert len(windows) == 1
    tooth, first, last = windows[0]
    behind = case.wear[:, tooth] < case.wear.max(axis=1)
    assert (
        behind[first - 1] and behind[last - 1] and not behind[: first - 1].any() and not behind[last:].any()
    )
    assert lagging_windows(None) == []
