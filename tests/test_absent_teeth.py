"""Absent teeth (docs/cases.md): a case may lack any tooth. It is left out of the prompt, the plan's
tooth ids, the contacts, the bite, anchorage and the oracle; a plan that names it pays a format
penalty; the crowns across its space are still held to the collision rule; generated cases are
unchanged (their behaviour digests are tests/test_behaviour_digest.py's)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from orthojob.agentic.tools import DentalToolEnv
from orthojob.core.prompts import build_prompt
from orthojob.rewards.reward_functions import reward_format
from orthojob.rewards.rollouts import score_texts
from server.absent_teeth import NO_CONTACT_MM, placeholder_poses
from server.case_records import case_digest, case_of_record, record_of_case, register_case
from server.cases import TASK_IDS, generate_case
from server.collisions import all_pairs_penetration_mm
from server.dental_constants import ADJACENT_PAIRS, SECOND_NEIGHBOUR_PAIRS, TOOTH_IDS, TOOTH_INDEX
from server.dental_environment import StepwiseDentalEnvironment, initial_observation
from server.errors import InvalidActionError
from server.movement_priors import AnchoragePrior
from server.occlusion import occlusion_composite, present_keys, six_keys
from server.oracle import oracle_plan
from server.plans import UNIFORM_FRACTION
from server.treatment import score_plans

PAIRS = np.concatenate((ADJACENT_PAIRS, SECOND_NEIGHBOUR_PAIRS))


def without(record: dict, absent: list[int]) -> dict:
    """``record`` with the teeth ``absent`` taken out of its per-tooth lists and marked absent, its
    key and labels dropped (an imported, unlabelled case)."""
    out = {k: v for k, v in record.items() if k not in ("task_id", "seed", "labels")}
    keep = [i for i, t in enumerate(record["teeth"]) if t not in absent]
    for name in ("teeth", "initial", "target", "crown_width_mm", "crown_depth_mm"):
        out[name] = [record[name][i] for i in keep]
    out["absent"] = list(absent)
    return out


def drifted_case(task_id: str = "task_easy", seed: int = 0, absent: tuple[int, ...] = (15, 25), drift_mm=2.0):
    """A generated case with ``absent`` teeth extracted and each one's mesial neighbour drifted
    ``drift_mm`` into the space in the initial arrangement (the target puts it back)."""
    record = json.loads(json.dumps(record_of_case(generate_case(task_id, seed))))
    for t in absent:
        mesial, k = TOOTH_INDEX[t - 1], TOOTH_INDEX[t]
        pose = np.array(record["initial"][mesial])
        towards = np.array(record["target"][k][4:]) - np.array(record["target"][mesial][4:])
        pose[4:] += drift_mm * towards / np.linalg.norm(towards)
        record["initial"][mesial] = pose.tolist()
    return without(record, list(absent))


def uniform_plan(case) -> dict:
    return {
        "strategy": case.optimal_strategy,
        "tooth_groups": [{"teeth": case.present_ids, "fraction": UNIFORM_FRACTION}],
    }


def test_a_case_with_absent_teeth_validates_and_its_placeholders_sit_in_their_space():
    record = drifted_case()
    checked = case_of_record(record)
    assert checked.case is not None, [str(p) for p in checked.problems]
    case = checked.case
    assert [int(TOOTH_IDS[k]) for k in np.flatnonzero(case.absent)] == [15, 25]
    assert 15 not in case.present_ids and len(case.present_ids) == 26
    k = TOOTH_INDEX[15]
    # the placeholder never moves, and sits between its neighbours' targets
    assert np.array_equal(case.initial[k], case.target[k])
    mid = 0.5 * (case.target[TOOTH_INDEX[14], 4:] + case.target[TOOTH_INDEX[16], 4:])
    assert np.allclose(case.target[k, 4:], mid)
    # the drifted 14 overlaps the placeholder: only the mask keeps the case valid
    raw = all_pairs_penetration_mm(case.initial, case.crown_width_mm, case.crown_depth_mm)
    pair = next(n for n, (a, b) in enumerate(PAIRS) if {a, b} == {TOOTH_INDEX[14], k})
    assert raw[pair] > 1.0
    assert checked.diagnosis is not None and checked.diagnosis.treatment_needed


def test_an_arch_with_every_tooth_absent_and_a_tooth_listed_twice_are_refused():
    record = json.loads(json.dumps(record_of_case(generate_case("task_easy", 1))))
    upper = [t for t in TOOTH_IDS if t < 30]
    checked = case_of_record(without(record, upper))
    assert checked.case is None
    assert any("every upper tooth is absent" in str(p) for p in checked.problems)
    twice = without(record, [15])
    twice["absent"] = [15, 16]
    assert any(p.tooth == 16 and "listed twice" in p.message for p in case_of_record(twice).problems)


def test_a_target_whose_crowns_across_the_gap_collide_is_refused():
    """Across one absent tooth the neighbours are a second-neighbour pair: a target that puts them
    into each other breaks the collision rule at rest."""
    record = json.loads(json.dumps(record_of_case(generate_case("task_easy", 2))))
    a, b = TOOTH_INDEX[14], TOOTH_INDEX[16]
    target = np.array(record["target"])
    target[a, 4:6] = target[b, 4:6] + 0.3 * (target[a, 4:6] - target[b, 4:6])  # 14 nearly on 16
    record["target"] = target.tolist()
    record["initial"][a] = target[a].tolist()
    problems = case_of_record(without(record, [15])).problems
    assert any("target crowns of 16 and 14 interpenetrate" in p.message for p in problems), problems


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_the_prompt_and_the_oracle_leave_absent_teeth_out_and_the_oracle_stays_safe(task_id):
    case = case_of_record(drifted_case(task_id, 3)).case
    key = register_case(case)
    observation = initial_observation(generate_case(*key))
    prompt = build_prompt(observation)
    assert "absent_teeth: 15, 25 (the patient has no such tooth" in prompt
    assert "FDI 15:" not in prompt and "FDI 25:" not in prompt and "top 12 of 26" in prompt
    terse = build_prompt(observation, "terse")
    assert "absent_teeth: 15, 25 (the patient has no such tooth" in terse
    assert " of 26; the other " in terse and "\n  15 " not in terse and "\n  25 " not in terse
    plan = oracle_plan(observation)
    named = {t for g in plan["tooth_groups"] for t in g["teeth"]}
    assert named == set(case.present_ids)
    oracle, uniform = score_plans([plan, uniform_plan(case)], [key, key])
    assert not oracle["broken_rules"] and not uniform["broken_rules"]
    assert oracle["scaled_reward"] > uniform["scaled_reward"]
    assert oracle["format"]["absent_teeth_groups"] == 0 and oracle["format"]["validity"] == 1.0


def test_a_plan_that_moves_an_absent_tooth_pays_a_format_penalty_not_a_crash():
    case = case_of_record(drifted_case("task_medium", 4)).case
    key = register_case(case)
    good = uniform_plan(case)
    bad = {**good, "tooth_groups": [*good["tooth_groups"], {"teeth": [15], "fraction": 0.5}]}
    only_absent = {**good, "tooth_groups": [{"teeth": [15, 25], "fraction": 0.1}]}
    g, b, o = score_plans([good, bad, only_absent], [key] * 3)
    assert b["format"]["absent_teeth_groups"] == 1 and b["format"]["validity"] == 0.5
    assert b["terminal_reward"] == pytest.approx(0.5 * g["terminal_reward"])
    assert o["format"]["validity"] == 0.0 and o["terminal_reward"] == 0.0
    texts = [json.dumps(p) for p in (good, bad)]
    rollouts = score_texts(texts, [key, key])
    assert rollouts[0].format["teeth_ints"] == 1.0 and rollouts[1].format["teeth_ints"] == 0.0
    columns = {"task_id": [key.task_id] * 2, "seed": [key.seed] * 2, "force_decay": [False] * 2}
    fmt = reward_format(texts, **columns)
    assert fmt[1] < fmt[0]


def test_the_stepwise_environment_and_the_tools_refuse_an_absent_tooth():
    case = case_of_record(drifted_case("task_easy", 5)).case
    env = StepwiseDentalEnvironment()
    obs = env.reset(case=record_of_case(case, case_id="c5", patient_id="p5"))
    assert obs["case_summary"]["absent_teeth"] == [15, 25]
    with pytest.raises(InvalidActionError, match="tooth 15 is absent"):
        env.inspect_tooth(obs["episode_id"], 15)
    key = register_case(case)
    tools = DentalToolEnv()
    tools.reset(seed=key.seed, task_id=key.task_id)
    assert "absent in this patient" in tools.inspect_tooth(25)
    assert "tooth 15 is absent" in tools.commit_stage([{"teeth": [15], "fraction": 0.1}])
    present = [t for t in case.present_ids if t < 30]
    assert "error" not in tools.commit_stage([{"teeth": present, "fraction": 0.05}])


def test_an_absent_tooth_is_no_contact_and_a_neighbour_crossing_its_space_breaks_no_rule():
    """The drifted 14 moves back through 15's placeholder: no collision, while the same arrays scored
    as if 15 were present collide."""
    case = case_of_record(drifted_case("task_easy", 6)).case
    key = register_case(case)
    plan = {"tooth_groups": [{"teeth": case.present_ids, "fraction": UNIFORM_FRACTION}]}
    (with_mask,) = score_plans([plan], [key])
    assert with_mask["diagnostics"]["collision_breach"] == 0.0
    from dataclasses import replace

    present_all = replace(case, absent=None)
    (unmasked,) = score_plans([plan], [present_all])
    assert unmasked["diagnostics"]["collision_breach"] > 0.0


def test_occlusion_keys_degrade_where_their_teeth_are_absent():
    case = generate_case("task_medium", 7)
    poses = np.stack([case.initial, case.target])
    none = np.zeros(28, dtype=bool)
    keys, measured = present_keys(poses, case.target, case.crown_width_mm, none)
    full = six_keys(poses, case.target, case.crown_width_mm)
    for name in full:
        assert np.allclose(keys[name], full[name], atol=1e-12) and measured[name].all(), name
    molars = none.copy()
    molars[[TOOTH_INDEX[t] for t in (16, 26, 36, 46)]] = True
    keys, measured = present_keys(poses, case.target, case.crown_width_mm, molars)
    assert not measured["molar_relation"].any() and measured["overjet"].all()
    one_side = none.copy()
    one_side[TOOTH_INDEX[16]] = True
    moved = poses.copy()
    moved[:, TOOTH_INDEX[16], 5] += 3.0  # the right molar relation, which one_side cannot measure
    a = present_keys(poses, case.target, case.crown_width_mm, one_side)[0]["molar_relation"]
    b = present_keys(moved, case.target, case.crown_width_mm, one_side)[0]["molar_relation"]
    assert np.array_equal(a, b)
    centrals = none.copy()
    centrals[TOOTH_INDEX[11]] = True
    keys, measured = present_keys(poses, case.target, case.crown_width_mm, centrals)
    assert measured["symmetry"].all() and measured["overjet"].all()  # the left side measures them
    composite = occlusion_composite(poses, case.target, case.crown_width_mm, molars)
    assert np.all((composite >= 0.0) & (composite <= 1.0))
    assert composite[1] == pytest.approx(1.0)  # the target is ideal whatever is measured


def test_an_absent_root_anchors_nothing():
    stage_mm = np.zeros((1, 24, 28))
    stage_mm[0, :, TOOTH_INDEX[11]] = 0.2  # one incisor moves, the rest of the arch anchors it
    absent = np.zeros((1, 28), dtype=bool)
    absent[0, [TOOTH_INDEX[t] for t in (16, 17, 26, 27)]] = True
    prior = AnchoragePrior()
    assert prior.load_scores_from_movement(stage_mm, absent)[0] < prior.load_scores_from_movement(stage_mm)[0]


def test_an_export_of_a_case_with_absent_teeth_reads_back_the_same_case():
    case = case_of_record(drifted_case("task_hard", 8)).case
    record = json.loads(json.dumps(record_of_case(case, case_id="x", patient_id="p")))
    assert record["absent"] == [15, 25] and 15 not in record["teeth"]
    again = case_of_record(record).case
    assert case_digest(again) == case_digest(case)
    assert np.array_equal(again.absent, case.absent) and np.array_equal(again.initial, case.initial)
    assert case_digest(case) != case_digest(case_of_record({**record, "absent": [15, 25, 47], "teeth": record["teeth"][:-1],
        **{k: record[k][:-1] for k in ("initial", "target", "crown_width_mm", "crown_depth_mm")}}).case)  # fmt: skip


def test_placeholder_at_the_end_of_an_arch_takes_the_last_neighbours_pose():
    case = generate_case("task_easy", 9)
    absent = np.zeros(28, dtype=bool)
    absent[[TOOTH_INDEX[17], TOOTH_INDEX[16]]] = True
    out = placeholder_poses(case.target, absent)
    assert np.array_equal(out[TOOTH_INDEX[17]], case.target[TOOTH_INDEX[15]])
    assert np.array_equal(out[TOOTH_INDEX[16]], case.target[TOOTH_INDEX[15]])
    assert NO_CONTACT_MM < 0


def test_crowns_facing_each_other_across_two_absent_teeth_are_held_to_the_collision_rule():
    """With 14 and 15 absent, 13 and 16 face each other: a target that closes the space through
    them is refused, and a plan whose achieved arch does so breaks the collision rule."""
    record = json.loads(json.dumps(record_of_case(generate_case("task_easy", 3))))
    a, b = TOOTH_INDEX[13], TOOTH_INDEX[16]
    target = np.array(record["target"])
    target[b, 4:6] = target[a, 4:6] + 0.5 * (target[b, 4:6] - target[a, 4:6]) / np.linalg.norm(
        target[b, 4:6] - target[a, 4:6]
    )  # 16's centroid half a millimetre from 13's
    closed = {**record, "target": target.tolist()}
    problems = case_of_record(without(closed, [14, 15])).problems
    assert any("target crowns of 16 and 13 interpenetrate" in p.message for p in problems), problems
    assert case_of_record(without(record, [14, 15])).case is not None  # the space itself is fine
    case = case_of_record(without(record, [14, 15])).case
    moved = np.array(case.initial)
    moved[b] = target[b]  # score an arch where 16 sits on 13 as the achieved trajectory
    from server.scoring import arch_breaches

    traj = np.broadcast_to(moved, (1, 25, 28, 7))
    w, d = case.crown_width_mm[None], case.crown_depth_mm[None]
    with_gap = arch_breaches(
        case.initial[None], case.target[None], w, d, traj, traj, absent=case.absent[None]
    )
    assert with_gap["second_collision_breach"][0] > 0.0
