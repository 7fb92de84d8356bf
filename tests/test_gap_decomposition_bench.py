"""experiments/learning/gap_decomposition.py: the overcorrecting share and the room counterfactual on hand-made plans."""

from __future__ import annotations

from experiments.learning import gap_decomposition as gap_decomposition_script
from orthojob.data.robust_plans import within_room
from server.cases import HELDOUT_SEED_START, CaseKey, generate_case
from server.staging import overcorrection_room
from server.treatment import score_plans


def test_room_counterfactual_scores_the_plans_that_hold_back_with_and_without_the_room():
    bench = gap_decomposition_script
    keys = [CaseKey("task_easy", HELDOUT_SEED_START + i, fd) for fd in (False, True) for i in range(3)]
    plain = [
        {"tooth_groups": [{"teeth": list(generate_case(*k).present_ids), "fraction": 0.0417}]} for k in keys
    ]
    plans = list(plain)
    plans[4] = None  # not a plan
    plans[5] = {"tooth_groups": [{**plain[5]["tooth_groups"][0], "overcorrection": 0.2}]}  # overcorrects
    assert [bench.overcorrects(p) for p in plans] == [False] * 5 + [True]

    (row,) = bench.room_counterfactual(plans, keys, share=0.5)
    assert row["cell"] == "task_easy/force_decay" and row["plans"] == 1  # only the decay plan that holds back
    k = keys[3]
    case = generate_case(*k)
    room = overcorrection_room(
        case.initial, case.target, case.crown_width_mm, case.crown_depth_mm, case.absent
    )
    expected = score_plans([plans[3], within_room(plans[3], room, 0.5)], [k, k])
    assert row["as_written"]["mean"] == expected[0]["scaled_reward"]
    assert row["within_room"]["mean"] == expected[1]["scaled_reward"]
    assert row["within_room"]["broken"] == float(bool(expected[1]["broken_rules"]))
    assert row["uniform"]["mean"] is not None
    assert bench.room_counterfactual(plans[:3], keys[:3], share=0.5) == []  # no force-decay case
