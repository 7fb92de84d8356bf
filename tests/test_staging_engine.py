"""The staging engine (server.staging_engine): executed plans break no rule, safe plans come back bit for
bit, and a planner gains nothing by leaning on the engine. The 1,000-seeds-per-cell run is
``python -m experiments.audits.engine_properties --seeds 1000``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.audits import engine_properties as audit
from server import staging_engine, staging_repairs
from server.cases import generate_case
from server.dental_constants import N_STAGES, TOOTH_IDS
from server.plans import normalize_plan
from server.staging_engine import (
    ENGINE_VERSION,
    FALLBACK,
    REPAIRED,
    UNCHANGED,
    engine_reward,
    execute_plan_dicts,
    execute_plans,
    spec_to_plan,
)
from server.staging_repairs import safe_speeds
from server.treatment import score_plan_specs

SEEDS = 3_000_000
ORACLE_SEEDS = 3
"""Cases per cell with the whole corpus (the oracle's plan and every exploit: ~0.1 s of oracle a case)."""
CHEAP_SEEDS = 30
"""Cases per cell with the plans that need no oracle (random, one aligner, all frozen but one)."""


@pytest.mark.parametrize("cell", audit.CELLS, ids=lambda c: f"{c[0]}-decay{int(c[1])}-nc{int(c[2])}")
def test_executed_plans_break_no_rule_and_safe_plans_come_back(cell):
    rng = np.random.default_rng(audit.CELLS.index(cell))
    plans, cases = [], []
    for s in range(CHEAP_SEEDS):
        case = generate_case(cell[0], SEEDS + s, cell[1], cell[2])
        if s < ORACLE_SEEDS:
            named = audit.corpus(case, rng)
        else:
            present = case.present_ids
            one = present[int(rng.integers(len(present)))]
            named = {
                "random": audit.random_plan(case, rng),
                "one_aligner": {"tooth_groups": [{"teeth": present, "fraction": 1.0}]},
                "frozen_but_one": {
                    "tooth_groups": [
                        {"teeth": [one], "fraction": float(rng.uniform(1 / N_STAGES, 0.25))},
                        {"teeth": [t for t in present if t != one], "fraction": 0.0},
                    ]
                },
                "uniform": {"tooth_groups": [{"teeth": present, "fraction": 1 / N_STAGES}]},
            }
        plans += list(named.values())
        cases += [case] * len(named)
    fails = audit.check_properties(plans, cases)
    assert fails == {"unsafe": 0, "not_identical": 0, "dict_mismatch": 0, "gaming": 0}
    run = execute_plans([normalize_plan(p) for p in plans], cases)
    status = [r.status for r in run.records]
    # the corpus exercises both sides: plans the engine leaves alone and plans it must change
    assert status.count(UNCHANGED) > 0 and status.count(REPAIRED) + status.count(FALLBACK) > 0


def test_a_safe_plan_is_returned_itself_with_its_own_result():
    case = generate_case("task_medium", SEEDS, True)
    spec = normalize_plan({"tooth_groups": [{"teeth": case.present_ids, "fraction": 1 / N_STAGES}]})
    direct = score_plan_specs([spec], [case])[0]
    assert not direct["broken_rules"]
    run = execute_plans([spec], [case])
    assert run.specs[0] is spec
    assert run.results[0] == direct and run.raw_results[0] == direct
    record = run.records[0]
    assert record.status == UNCHANGED and record.safe and not record.changes and record.kept_share == 1.0
    assert record.as_dict()["engine_version"] == ENGINE_VERSION
    assert engine_reward(run.raw_results[0], run.results[0], record) == direct["scaled_reward"]


def test_everything_in_one_aligner_is_slowed_to_each_teeths_safe_speed():
    case = generate_case("task_easy", SEEDS + 1)
    spec = normalize_plan({"tooth_groups": [{"teeth": case.present_ids, "fraction": 1.0}]})
    run = execute_plans([spec], [case])
    record, executed = run.records[0], run.specs[0]
    assert "limits" in record.raw_broken_rules and record.status == REPAIRED and record.safe
    assert not run.results[0]["broken_rules"]
    limit, pdl = safe_speeds(case, np.zeros(len(TOOTH_IDS)))
    speed = [c for c in record.changes if c.field == "fraction"]
    assert speed and all(c.repair in ("speed", "retime", "slow", "uniform") for c in speed)
    slowed = np.array([TOOTH_IDS.index(c.tooth) for c in speed if c.repair == "speed"])
    assert slowed.size
    np.testing.assert_array_equal(executed.fraction[slowed], np.minimum(limit, pdl)[slowed])
    # slowed teeth start early enough to finish, so the movement is kept
    assert record.kept_share > 0.9 and 0.0 < record.changed_share <= 1.0


def test_a_repaired_plan_earns_less_than_its_executed_plan_written_directly():
    case = generate_case("task_hard", SEEDS + 2, True)
    plans = [{"tooth_groups": [{"teeth": case.present_ids, "fraction": 0.3}]}]
    executed_dicts, run = execute_plan_dicts(plans, [case])
    record = run.records[0]
    assert record.status in (REPAIRED, FALLBACK)
    mine = engine_reward(run.raw_results[0], run.results[0], record)
    again = execute_plans([normalize_plan(executed_dicts[0])], [case])
    assert again.records[0].status == UNCHANGED
    direct = engine_reward(again.raw_results[0], again.results[0], again.records[0])
    assert mine < direct
    assert direct == again.results[0]["scaled_reward"]
    if record.status == FALLBACK:
        assert mine == run.raw_results[0]["scaled_reward"]


def test_the_executed_plan_keeps_the_planners_groups_where_it_can():
    case = generate_case("task_easy", SEEDS + 3)
    present = case.present_ids
    plan = {
        "strategy": "distal_first",
        "tooth_groups": [
            {"teeth": present[:14], "fraction": 1 / N_STAGES},
            {"teeth": present[14:], "fraction": 1.0, "priority": "medium"},
        ],
    }
    dicts, run = execute_plan_dicts([plan], [case])
    executed = dicts[0]
    assert run.records[0].status == REPAIRED
    assert executed["strategy"] == "distal_first"
    assert executed["tooth_groups"][0] == {
        "teeth": present[:14],
        "fraction": 1 / N_STAGES,
        "priority": "high",
    }
    changed = {c.tooth for c in run.records[0].changes}
    assert changed and changed <= set(present[14:])
    back = normalize_plan(executed)
    np.testing.assert_array_equal(back.fraction, run.specs[0].fraction)
    np.testing.assert_array_equal(back.start, run.specs[0].start)


def test_the_engine_is_deterministic():
    case = generate_case("task_hard", SEEDS + 4, False, True)
    rng = np.random.default_rng(7)
    plans = [audit.random_plan(case, rng) for _ in range(6)]
    a = execute_plan_dicts(plans, [case] * 6)
    b = execute_plan_dicts(plans, [case] * 6)
    assert a[0] == b[0]
    assert [r.as_dict() for r in a[1].records] == [r.as_dict() for r in b[1].records]
    # the raw plans' results passed in give the same execution
    specs = [normalize_plan(p) for p in plans]
    c = execute_plans(specs, [case] * 6, score_plan_specs(specs, [case] * 6))
    assert [r.as_dict() for r in c.records] == [r.as_dict() for r in a[1].records]
    assert c.results == a[1].results and any(r.status != UNCHANGED for r in c.records)


def test_a_fallback_that_still_breaks_a_rule_is_reported(monkeypatch):
    case = generate_case("task_medium", SEEDS + 5)
    fast = staging_repairs.uniform_staging(normalize_plan(None), case, N_STAGES)  # every tooth in one aligner
    monkeypatch.setattr(staging_engine, "fallbacks", lambda spec, case: [("uniform", fast)])
    monkeypatch.setattr(staging_engine, "alternatives", lambda s, case, share: [])
    monkeypatch.setattr(
        staging_engine, "analytic_repair", lambda spec, case, broken: staging_engine.Staging.of(spec)
    )
    spec = normalize_plan({"tooth_groups": [{"teeth": case.present_ids, "fraction": 1.0}]})
    run = execute_plans([spec], [case])
    record = run.records[0]
    assert record.status == FALLBACK and record.fallback == "uniform"
    assert not record.safe and record.broken_rules == run.results[0]["broken_rules"]
    assert engine_reward(run.raw_results[0], run.results[0], record) == run.raw_results[0]["scaled_reward"]


def test_spec_to_plan_round_trips_a_plan_with_no_groups():
    spec = normalize_plan({"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 1 / N_STAGES}]})
    spec.group = None
    back = normalize_plan(spec_to_plan(spec))
    np.testing.assert_array_equal(back.fraction, spec.fraction)
    np.testing.assert_array_equal(back.start, spec.start)


def test_a_case_with_absent_teeth_gets_executed_plans_that_leave_them_out():
    from server.case_records import case_of_record
    from tests.test_absent_teeth import drifted_case

    case = case_of_record(drifted_case("task_medium", SEEDS)).case
    rng = np.random.default_rng(3)
    plans = [audit.random_plan(case, rng) for _ in range(6)]
    plans += [{"tooth_groups": [{"teeth": case.present_ids, "fraction": 1.0}]}]
    assert audit.check_properties(plans, [case] * len(plans)) == {
        "unsafe": 0,
        "not_identical": 0,
        "dict_mismatch": 0,
        "gaming": 0,
    }
    dicts, run = execute_plan_dicts(plans, [case] * len(plans))
    absent = {TOOTH_IDS[k] for k in np.flatnonzero(case.absent)}
    assert any(r.status != UNCHANGED for r in run.records)
    for plan in dicts:
        assert not absent & {t for g in plan["tooth_groups"] for t in g["teeth"]}


def test_a_premolar_driven_into_its_antagonist_is_attributed_to_both_cusps():
    from server.contact_rules import OCCLUSAL_TOLERANCE_MM
    from server.occlusion import POSTERIOR_ANTAGONISTS
    from server.occlusion import posterior_clearance_floor_mm as floor
    from server.occlusion import posterior_clearance_mm as clearance
    from server.treatment import rollout_plans

    case = generate_case("task_medium", SEEDS + 6)
    spec = normalize_plan({"tooth_groups": [{"teeth": case.present_ids, "fraction": 1 / N_STAGES}]})
    planned, achieved = rollout_plans([spec], [case])
    assert not staging_engine._share_breach(staging_engine.rollout_breaches(planned, achieved, [case]))[0]
    upper, lower = POSTERIOR_ANTAGONISTS[0]
    achieved = achieved.copy()
    achieved[0, 10:14, upper, 6] -= 1.0  # the upper cusp pushed down through the lower one's
    share = staging_engine.rollout_breaches(planned, achieved, [case])
    assert share["contact"][0, upper] > 0.0 and share["contact"][0, lower] > 0.0
    # the lower cusp, untouched, carries the bite's breach alone (the upper may meet a neighbour too)
    excess = floor(case.initial, case.target)[0] - OCCLUSAL_TOLERANCE_MM - clearance(achieved[0, 1:])[:, 0]
    bite = np.maximum(excess, 0.0).sum() / OCCLUSAL_TOLERANCE_MM
    assert bite > 0.0 and share["contact"][0, lower] == pytest.approx(bite)
    assert share["contact"][0, upper] >= share["contact"][0, lower] - 1e-9
    assert score_plan_specs([spec], [case])[0]["broken_rules"] == []


def test_a_staging_the_tooth_check_shows_breaking_is_not_scored_and_twins_are_scored_once(monkeypatch):
    case = generate_case("task_easy", SEEDS + 7)
    safe = normalize_plan({"tooth_groups": [{"teeth": case.present_ids, "fraction": 1 / N_STAGES}]})
    twin = normalize_plan({"tooth_groups": [{"teeth": case.present_ids, "fraction": 1 / N_STAGES}]})
    over = {"teeth": case.present_ids, "fraction": 1 / N_STAGES, "overcorrection": 0.6}
    crash = normalize_plan({"tooth_groups": [over]})  # overshoots every tooth: the tooth check sees it
    scored = []
    score = staging_engine.score_rollout
    monkeypatch.setattr(
        staging_engine, "score_rollout", lambda s, c, r: scored.append(len(s)) or score(s, c, r)
    )
    tried = staging_engine._try([safe, crash, twin], [case] * 3)
    assert scored == [1]
    direct = score_plan_specs([safe, crash], [case] * 2)
    assert tried[0].safe and tried[0].result == direct[0]
    assert tried[2].spec is twin and tried[2].result == direct[0] and tried[2].result is not tried[0].result
    assert direct[1]["broken_rules"] and tried[1].result is None and not tried[1].safe
    assert tried[1].breach > 0.0


def test_the_bench_adds_a_checkpoints_sampled_plans_to_the_corpus_and_counts_the_rest(monkeypatch):
    from orthojob.eval import evaluation

    cases = [generate_case("task_medium", SEEDS + s, s % 2 == 1) for s in range(3)]
    plans = [
        {"tooth_groups": [{"teeth": c.present_ids[:4], "fraction": 0.05 * (k + 1)}]}
        for k, c in enumerate(cases)
    ]
    # per case, two completions: a plan in prose, and a plan object cut off mid-way (not a plan)
    cut = '{"tooth_groups": [{"teeth": [11], "fraction"'
    texts = iter(t for p in plans for t in (f"Plan: {json.dumps(p)}", cut))
    calls = []

    def scripted(model, tokenizer, observations, max_new_tokens, batch_size, samples):
        calls.append((len(observations), max_new_tokens, samples))
        return [next(texts) for _ in range(len(observations) * samples)], [], []

    monkeypatch.setattr(evaluation, "generate_completions", scripted)
    monkeypatch.setattr(audit, "SAMPLE_CHUNK", 2)
    per_case, not_plans = audit.checkpoint_samples(None, None, cases, samples=2)
    assert calls == [(2, 512, 2), (1, 512, 2)]  # generated in chunks of cases
    assert per_case == [{"sample_0": p} for p in plans] and not_plans == 3
    corpus = [p for named in per_case for p in named.values()]
    assert audit.check_properties(corpus, cases) == dict.fromkeys(audit.PROPERTIES, 0)
