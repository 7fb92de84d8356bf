"""Robust demonstrations (orthojob/data/robust_plans.py): per case a safe candidate, never one that
breaks a rule as written, chosen by how its imprecise copies score; BC's rows carry the choices."""

from __future__ import annotations

import json

from orthojob.data import robust_plans
from orthojob.data.robust_plans import CANDIDATES, candidates, robust_plan
from orthojob.stages.sft import oracle_demonstrations
from server.cases import HELDOUT_SEED_START, CaseKey, generate_case
from server.oracle import plan_for_case
from server.treatment import score_plans


def test_the_choice_is_a_safe_candidate_and_the_best_of_their_noisy_copies(monkeypatch):
    picked = set()
    for task_id in ("task_easy", "task_hard"):
        for seed in range(HELDOUT_SEED_START, HELDOUT_SEED_START + 6):
            key = CaseKey(task_id, seed, True)
            case = generate_case(*key)
            oracle = plan_for_case(case)
            plan, name = robust_plan(oracle, key, case.present_ids)
            assert name in CANDIDATES and plan == candidates(oracle, case.present_ids)[name]
            assert not score_plans([plan], [key])[0]["broken_rules"]
            picked.add(name)
    assert picked - {"oracle"}, "on force decay some case's oracle plan is not its most robust one"
    # a candidate that breaks a rule as written is never chosen, however its copies score
    key = CaseKey("task_easy", HELDOUT_SEED_START, False)
    case = generate_case(*key)
    oracle = plan_for_case(case)
    broken = {"tooth_groups": [{"teeth": case.present_ids, "fraction": 1.0}]}
    monkeypatch.setattr(robust_plans, "candidates", lambda plan, teeth: {"uniform": broken, "oracle": plan})
    assert robust_plan(oracle, key, case.present_ids)[1] == "oracle"


def test_bc_demonstrations_can_be_the_robust_choices():
    rows, info = oracle_demonstrations(6, ["task_medium"], True, "compact", robust=True)
    assert len(rows) == 6 and sum(info["robust_choices"].values()) == 6
    for row in rows:
        plan = json.loads(row["completion"][0]["content"])
        key = CaseKey(row["task_id"], row["seed"], True)
        assert not score_plans([plan], [key])[0]["broken_rules"]
