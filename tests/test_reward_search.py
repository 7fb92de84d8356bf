"""An optimiser finds nothing dishonest (fast version of experiments/audits/reward_search.py): hill climbing the
summed five TRL rewards from uniform SLERP, the oracle's plan and a random plan, and a population
search seeded with the plans an optimiser was seen to exploit; any plan found above the oracle breaks
no hard rule and is not a degenerate form, and every exploit that breaks a rule sums below doing
nothing."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.audits.plan_search import (
    degenerate_form,
    exploit_plans,
    objective,
    population_search,
    search_case,
)
from server.cases import HELDOUT_SEED_START, TASK_IDS, generate_case
from server.dental_constants import TOOTH_IDS

ROUNDS = 8


@pytest.mark.parametrize("task", TASK_IDS)
def test_plans_found_above_the_oracle_are_honest(task):
    rng = np.random.default_rng(0)
    found = []
    for k in range(2):
        case = generate_case(task, HELDOUT_SEED_START + k, k == 1)
        for start in ("slerp", "oracle", "random"):
            r = search_case(case, start, ROUNDS, rng)
            found.append(r)
            if r.beats_oracle:
                assert not r.broken_rules, (r.case, start, r.broken_rules, r.best_plan)
                assert r.degenerate is None, (r.case, start, r.degenerate, r.best_plan)
    # the search does climb: from a random plan it ends above where it started; from SLERP and the
    # oracle it stays safe
    assert all(r.best_total > r.start_total for r in found if r.start_from == "random")
    assert all(r.best_total > 0.0 for r in found if r.start_from != "random")


def test_degenerate_forms_are_named():
    case = generate_case("task_medium", 3)
    every = list(TOOTH_IDS)
    assert degenerate_form(case, {"tooth_groups": [{"teeth": every, "fraction": 0.0}]}) == "nothing"
    assert degenerate_form(case, {"tooth_groups": [{"teeth": every, "fraction": 1.0}]}) == "all_at_once"
    assert degenerate_form(case, {"tooth_groups": [{"teeth": every, "fraction": 0.1}]}) == "one_group"
    assert degenerate_form(case, {"tooth_groups": [{"teeth": every, "fraction": 1 / 24}]}) is None  # SLERP


@pytest.mark.parametrize("task", TASK_IDS)
def test_population_search_on_the_weighted_sum_finds_nothing_dishonest(task):
    """The per-tooth population search (start, duration, overcorrection of each tooth) on the sum at
    the weights make learn trains with, under both dynamics: any plan found above the oracle breaks no
    hard rule and is not a degenerate form."""
    from experiments.audits.plan_search import population_search
    from experiments.learning.experiment import LearnConfig

    rng = np.random.default_rng(1)
    weights = {"reward_strategy": LearnConfig().strategy_weight}
    for force_decay in (False, True):
        case = generate_case(task, HELDOUT_SEED_START + 5, force_decay)
        r = population_search(case, 4, rng, weights)
        assert r.best_total >= r.oracle_total - 0.05  # the oracle, re-encoded per tooth, starts the search
        if r.beats_oracle:
            assert not r.broken_rules, (r.case, r.broken_rules, r.best_plan)
            assert r.degenerate is None, (r.case, r.degenerate, r.best_plan)


@pytest.mark.parametrize("task", TASK_IDS)
def test_a_search_from_the_exploits_finds_only_honest_plans_above_the_oracle(task):
    """The exploits (one aligner, the oracle at 3x, the mirrored malocclusion, rushed incisors, the
    strategy's first level unmoved) that break a rule here sum below doing nothing, at the default
    weights and make learn's; the population search seeded with them keeps, after 6 generations,
    only plans that break no rule and are not degenerate above the oracle. Under force decay it does
    find plans above the oracle (the oracle's hand rules are weakest there), so the check is not
    empty."""
    from experiments.learning.experiment import LearnConfig
    from server.plans import normalize_plan
    from server.treatment import score_plan_specs

    rng = np.random.default_rng(2)
    above = 0
    for force_decay in (False, True):
        case = generate_case(task, HELDOUT_SEED_START + 11, force_decay)
        exploits = exploit_plans(case)
        judged = score_plan_specs([normalize_plan(p) for p in exploits.values()], [case] * len(exploits))
        breaking = [name for name, j in zip(exploits, judged) if j["broken_rules"]]
        assert "all_at_once" in breaking and len(breaking) >= 2, breaking
        for weights in ({}, {"reward_strategy": LearnConfig().strategy_weight}):
            totals, _ = objective(case, list(exploits.values()), weights)
            by_name = dict(zip(exploits, totals))
            for name in breaking:
                assert by_name[name] < by_name["nothing"], (name, by_name)
            r = population_search(case, 6, rng, weights, seed_plans=list(exploits.values()))
            for plan, broken, degenerate in r.above_oracle:
                assert not broken and degenerate is None, (r.case, broken, degenerate, plan)
            above += len(r.above_oracle) * force_decay
    assert above > 0
