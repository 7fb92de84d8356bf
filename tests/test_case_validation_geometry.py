"""The case validator judges the geometry between crowns, not only the schema: it refuses a target whose
lower incisors or canines pass through the upper ones, crowns pressed into their antagonists, arches in
the wrong vertical order or out of occlusion, crowns below anatomical minimum sizes, quadrants on the
wrong side of the midline, a crown far from its neighbours and crowns upside down, each problem naming
the case id, the tooth (or the quadrant, or the pairs) and what to fix; it accepts a case with nothing to move, on which no face pays a declared strategy;
and every generated case passes it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from orthojob.rewards.reward_functions import REWARD_FUNCS
from server.arch import occlusal_points
from server.case_anatomy import (
    ANTAGONISTS,
    MAX_CROWN_TILT_DEG,
    MAX_NEIGHBOUR_GAP_MM,
    MAX_TARGET_POSTERIOR_GAP_MM,
    MIN_CROWN_DEPTH_MM,
    MIN_CROWN_WIDTH_MM,
    MIN_TARGET_CANINE_CLEARANCE_MM,
    MIN_TARGET_INCISOR_CLEARANCE_MM,
    POSTERIOR_INTERDIGITATION_MM,
)
from server.case_records import case_of_record, cases_of_records, record_of_case, register_case
from server.cases import TASK_IDS, generate_case
from server.dental_constants import IS_UPPER, TOOTH_IDS, TOOTH_INDEX
from server.dental_environment import StepwiseDentalEnvironment
from server.occlusion import ANTERIOR_ANTAGONISTS, occlusal_clearance_mm, posterior_clearance_mm
from server.oracle import plan_for_case
from server.quaternion_utils import quaternion_axis, quaternion_multiply
from server.treatment import score_plans
from tests.test_real_jaw import real_jaw

SEEDS = range(3_003_000, 3_003_004)
"""Generated cases the nonsense is made from (every level)."""
LOWER_INCISORS = [TOOTH_INDEX[t] for t in (31, 32, 41, 42)]
DO_NOTHING = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 0.0}]}
RED_TEAM = ("task_medium", 3_400_001)
"""The generated case the layout nonsense below is made from."""


def record(task_id: str, seed: int) -> dict:
    """A generated case as an imported record (no key: it is checked as a patient's case)."""
    out = json.loads(json.dumps(record_of_case(generate_case(task_id, seed))))
    del out["task_id"], out["seed"]
    out["case_id"] = f"nonsense-{task_id}-{seed}"
    return out


def edit(rec: dict, change, names=("initial", "target")) -> dict:
    """The record with ``change`` applied to the (28, 7) poses of ``names`` (TOOTH_IDS order)."""
    out = dict(rec)
    for name in names:
        poses = np.array(rec[name])
        change(poses)
        out[name] = poses.tolist()
    return out


def without(rec: dict, absent: list[int]) -> dict:
    """The record with the teeth ``absent`` taken out of its per-tooth lists and marked absent."""
    keep = [i for i, t in enumerate(rec["teeth"]) if t not in absent]
    per_tooth = ("teeth", "initial", "target", "crown_width_mm", "crown_depth_mm")
    return {**rec, **{k: [rec[k][i] for i in keep] for k in per_tooth}, "absent": list(absent)}


def problems(rec: dict) -> list:
    checked = case_of_record(rec)
    assert checked.case is None and checked.problems, "the validator accepted it"
    return checked.problems


def cases() -> list[tuple[str, int]]:
    return [(task, seed) for task in TASK_IDS for seed in SEEDS]


@pytest.mark.parametrize(("task_id", "seed"), cases())
def test_the_untouched_record_is_accepted(task_id, seed):
    """The control: each record below, before it is made nonsense, is a valid case."""
    checked = case_of_record(record(task_id, seed))
    assert checked.case is not None and not checked.problems, checked.problems


@pytest.mark.parametrize(("task_id", "seed"), cases())
def test_a_target_with_the_lower_incisors_through_the_upper_ones_is_refused(task_id, seed):
    """The lower incisors 3 mm labial and 2.8 mm up, in the initial and the target (so no movement
    changes): the target's bite clearance falls to about -5.8 mm. The initial is not judged (a deep
    bite reads the same there); the target is, by each upper incisor over a lower one."""
    rec = record(task_id, seed)

    def through(poses):
        poses[LOWER_INCISORS, 5] += 3.0
        poses[LOWER_INCISORS, 6] += 2.8

    bad = edit(rec, through)
    target = np.array(bad["target"])
    assert occlusal_clearance_mm(target, target)[:4].min() < -5.0
    found = problems(bad)
    assert all(p.case_id == rec["case_id"] for p in found)
    bite = [p for p in found if "incisal edge" in p.message]
    assert {p.tooth for p in bite} <= {11, 12, 21, 22} and bite, [str(p) for p in found]
    assert all("fix the target's incisor positions" in p.message for p in bite)
    assert f"{MIN_TARGET_INCISOR_CLEARANCE_MM:.1f} mm" in bite[0].message
    assert f"case {rec['case_id']!r}, tooth {bite[0].tooth}:" in str(bite[0])


@pytest.mark.parametrize(("task_id", "seed"), cases())
def test_a_lower_molar_pressed_into_its_antagonist_is_refused(task_id, seed):
    """Both lower first molars 1 mm beyond the cusps' interdigitation, in the initial only, then in the
    target only: refused by the upper molar over it, in the arrangement that holds it."""
    rec = record(task_id, seed)
    for name in ("initial", "target"):
        poses = np.array(rec[name])
        tips = occlusal_points(poses)
        lift = {}
        for u, lo in ANTAGONISTS:
            if TOOTH_IDS[lo] in (36, 46):
                lift[lo] = tips[u, 2] - tips[lo, 2] + POSTERIOR_INTERDIGITATION_MM + 1.0

        def press(p, lift=lift):
            for lo, dz in lift.items():
                p[lo, 6] += dz

        found = problems(edit(rec, press, (name,)))
        pressed = [p for p in found if "rises" in p.message]
        assert {p.tooth for p in pressed} == {16, 26}, [str(p) for p in found]
        assert all(p.message.startswith(f"the {name} cusp tip") for p in pressed)
        assert all("check the crowns' vertical positions" in p.message for p in pressed)


@pytest.mark.parametrize(("task_id", "seed"), cases())
def test_arches_swapped_vertically_are_refused(task_id, seed):
    """z mirrored (the upper arch below the lower one), initial and target: one problem for each, naming
    every antagonist pair (upper/lower), and no other geometry judged on a reversed bite."""
    rec = record(task_id, seed)

    def mirrored(poses):
        poses[:, 6] *= -1.0

    found = problems(edit(rec, mirrored))
    assert [p.message.split()[1] for p in found] == ["initial", "target"], [str(p) for p in found]
    for p in found:
        assert p.case_id == rec["case_id"] and p.tooth is None
        assert all(f"{TOOTH_IDS[u]}/{TOOTH_IDS[lo]}" in p.message for u, lo in ANTAGONISTS)
        assert "are the arches swapped or z reversed?" in p.message


def test_one_pair_in_the_wrong_vertical_order_is_named_by_its_upper_tooth():
    rec = record("task_easy", SEEDS[0])
    poses = np.array(rec["target"])
    upper, lower = TOOTH_INDEX[16], TOOTH_INDEX[46]
    rise = poses[upper, 6] - poses[lower, 6] + 0.5

    def drop(p):
        p[upper, 6] -= rise

    found = problems(edit(rec, drop))
    assert [p.message.split()[1] for p in found] == ["initial", "target"], [str(p) for p in found]
    assert all(p.tooth == 16 and "(16/46, upper/lower" in p.message for p in found)


@pytest.mark.parametrize(("task_id", "seed"), cases())
def test_crowns_below_the_anatomical_minimum_are_refused_by_tooth(task_id, seed):
    """Every crown 1 x 1 mm: each tooth's width and depth refused by name, saying what to measure; one
    crown just under its floor is refused, one at its floor accepted."""
    rec = record(task_id, seed)
    found = problems({**rec, "crown_width_mm": [1.0] * 28, "crown_depth_mm": [1.0] * 28})
    assert all(p.case_id == rec["case_id"] for p in found)
    for name, what in (("crown_width_mm", "mesiodistal width"), ("crown_depth_mm", "buccolingual depth")):
        mine = [p for p in found if p.message.startswith(name)]
        assert sorted(p.tooth for p in mine) == sorted(rec["teeth"]), name
        assert all("below the smallest" in p.message and what in p.message for p in mine)
    k = rec["teeth"].index(41)
    floor = float(MIN_CROWN_WIDTH_MM[TOOTH_INDEX[41]])
    width = list(rec["crown_width_mm"])
    width[k] = floor - 0.01
    (small,) = problems({**rec, "crown_width_mm": width})
    assert small.tooth == 41 and "smallest incisor crown (3.0 mm)" in small.message
    width[k] = floor
    depth = list(rec["crown_depth_mm"])
    depth[k] = float(MIN_CROWN_DEPTH_MM[TOOTH_INDEX[41]])
    assert not case_of_record({**rec, "crown_width_mm": width, "crown_depth_mm": depth}).problems


def test_interpenetrating_target_neighbours_are_refused_by_tooth():
    """Neighbours in an arch (the collision model): 11 pushed into 21 in the target only."""
    rec = record("task_easy", SEEDS[0])
    a, b = TOOTH_INDEX[11], TOOTH_INDEX[21]

    def push(p):
        p[a, 4:6] += 0.6 * (p[b, 4:6] - p[a, 4:6])

    found = problems(edit(rec, push, ("target",)))
    mine = [p for p in found if "target crowns of 11 and 21 interpenetrate" in p.message]
    assert mine and mine[0].tooth == 11 and mine[0].case_id == rec["case_id"], [str(p) for p in found]


def nothing_to_move() -> tuple[dict, object]:
    """A generated case's target as its own initial, labelled with its profile: accepted."""
    rec = record("task_medium", SEEDS[0])
    rec["initial"] = rec["target"]
    checked = case_of_record(rec)
    assert checked.case is not None and not checked.problems, checked.problems
    return rec, checked.case


def test_a_case_with_nothing_to_move_is_accepted_and_no_face_pays_its_strategy():
    """Doing nothing on it, declaring the optimal strategy, a wrong one or none: the same terminal
    (a neutral multiplier, below the optimal one's 7.7), reward_strategy 0 and the same format reward,
    through the plan API, the five rewards and a stepwise episode."""
    rec, case = nothing_to_move()
    plans = [{**DO_NOTHING, "strategy": case.optimal_strategy}, {**DO_NOTHING, "strategy": "distal_first"}]
    plans.append(DO_NOTHING)
    if case.optimal_strategy == "distal_first":
        plans[1]["strategy"] = "anterior_first"
    results = score_plans(plans, [case] * 3)
    for r in results:
        assert r["broken_rules"] == [] and r["diagnostics"]["treated_teeth"] == 0
        assert r["reward_breakdown"]["strategy_multiplier"] == 1.0
        assert r["reward_breakdown"]["staging"] == 0.5
        assert r["terminal_reward"] == results[-1]["terminal_reward"]
    assert results[0]["scaled_reward"] < 6.7  # 8 / 1.2: the strategy's share of the scale is not earned

    key = register_case(case)
    n = len(plans)
    columns = {"seed": [key.seed] * n, "task_id": [key.task_id] * n, "force_decay": [False] * n}
    values = {name: f([json.dumps(p) for p in plans], **columns) for name, f in REWARD_FUNCS.items()}
    assert values["reward_strategy"] == [0.0] * n
    assert values["reward_terminal"] == [r["scaled_reward"] for r in results]
    assert len(set(values["reward_format"])) == 1

    env = StepwiseDentalEnvironment()
    terminals = []
    for strategy in (case.optimal_strategy, None):
        obs = env.reset(case=rec)
        for _ in range(24):
            obs = env.step(obs["episode_id"], obs["initial_config"], strategy=strategy)
        assert obs["reward_breakdown"]["strategy_multiplier"] == 1.0
        terminals.append(obs["terminal_reward"])
    assert terminals[0] == terminals[1] == pytest.approx(results[0]["terminal_reward"], abs=1e-4)


def test_with_movement_the_followed_optimal_strategy_is_still_paid():
    """The same case with its generated initial: the oracle's plan declares the optimal strategy and
    follows it, and earns the optimal multiplier (the rule above touches only cases with nothing to move)."""
    case = generate_case("task_medium", SEEDS[0])
    (result,) = score_plans([plan_for_case(case)], [case])
    assert result["diagnostics"]["treated_teeth"] > 0 and result["broken_rules"] == []
    assert result["reward_breakdown"]["strategy_multiplier"] == 1.2


def test_generated_cases_pass_every_check_with_margin():
    """Seeds of every level exported and read back: no problem, and each geometric check's measure
    well inside its bound (the arches' order, the incisor and the canine bite, the posterior
    interdigitation and gap, the crowns' tilt, the crown sizes), so the bounds are not tuned to the generator's edge."""
    for task_id in TASK_IDS:
        generated = [generate_case(task_id, s) for s in range(3_004_000, 3_004_100)]
        checked = cases_of_records([record_of_case(c) for c in generated])
        assert all(c.case is not None and not c.problems for c in checked), [
            str(p) for c in checked for p in c.problems
        ][:5]
        poses = np.stack([np.stack((c.initial, c.target)) for c in generated])  # (N, 2, 28, 7)
        assert (poses[..., ANTAGONISTS[:, 0], 6] - poses[..., ANTAGONISTS[:, 1], 6]).min() > 1.0
        target = poses[:, 1]
        incisors = occlusal_clearance_mm(target, target)[:, : len(ANTERIOR_ANTAGONISTS) - 2]
        assert incisors.min() > MIN_TARGET_INCISOR_CLEARANCE_MM + 1.5
        tips = occlusal_points(poses)[..., 2]
        rise = tips[..., ANTAGONISTS[:, 1]] - tips[..., ANTAGONISTS[:, 0]]
        assert rise[..., 6:].max() < POSTERIOR_INTERDIGITATION_MM - 1.0  # premolars and molars
        assert posterior_clearance_mm(target).max() < MAX_TARGET_POSTERIOR_GAP_MM - 3.0
        canines = occlusal_clearance_mm(target, target)[:, len(ANTERIOR_ANTAGONISTS) - 2 :]
        assert canines.min() > MIN_TARGET_CANINE_CLEARANCE_MM + 3.0
        tilt = np.degrees(np.arccos(quaternion_axis(poses[..., :4], 2)[..., 2]))
        assert tilt.max() < MAX_CROWN_TILT_DEG - 30.0
        width = np.stack([c.crown_width_mm for c in generated])
        depth = np.stack([c.crown_depth_mm for c in generated])
        assert (width / MIN_CROWN_WIDTH_MM).min() > 1.3 and (depth / MIN_CROWN_DEPTH_MM).min() > 1.3
    assert IS_UPPER[ANTAGONISTS[:, 0]].all() and not IS_UPPER[ANTAGONISTS[:, 1]].any()


def test_quadrants_on_the_wrong_side_of_the_midline_are_refused_by_quadrant():
    """x negated (every quadrant mirrored) and quadrants 1 and 2 swapped, in the initial and the
    target: refused by quadrant, naming its teeth; the whole case shifted 3 mm sideways (a midline off
    the frame's origin) and a central incisor absent (the midline from the laterals) are accepted."""
    rec = record(*RED_TEAM)

    def negated(p):
        p[:, 4] *= -1.0

    found = problems(edit(rec, negated))
    assert len(found) == 8 and all(p.case_id == rec["case_id"] and p.tooth is None for p in found)
    for p, (name, quadrant) in zip(found, [(n, q) for n in ("initial", "target") for q in (1, 2, 3, 4)]):
        teeth = ", ".join(str(t) for t in TOOTH_IDS if t // 10 == quadrant)
        assert p.message.startswith(f"the {name} crowns {teeth} of quadrant {quadrant} "), str(p)
        assert "are x mirrored or the quadrants' teeth swapped?" in p.message
    right, left = [TOOTH_INDEX[t] for t in range(11, 18)], [TOOTH_INDEX[t] for t in range(21, 28)]

    def swapped(p):
        p[right + left] = p[left + right]

    found = problems(edit(rec, swapped))
    assert [(p.message.split()[1], p.message.split(" of quadrant ")[1][0]) for p in found] == [
        ("initial", "1"), ("initial", "2"), ("target", "1"), ("target", "2")
    ], [str(p) for p in found]  # fmt: skip

    def shifted(p):
        p[:, 4] += 3.0

    assert case_of_record(edit(rec, shifted)).case is not None
    assert case_of_record(without(rec, [11])).case is not None


def test_a_crown_far_from_its_neighbours_is_refused_and_absent_teeth_spaces_are_allowed():
    """17 30 mm behind the arch, initial and target: refused by 17 alone; 15 and 16 absent, 17 in place
    (its nearest present neighbour 14, two crown widths away) is accepted."""
    rec = record(*RED_TEAM)

    def behind(p):
        p[TOOTH_INDEX[17], 5] -= 30.0

    found = problems(edit(rec, behind))
    assert [(p.tooth, p.message.split()[1]) for p in found] == [(17, "initial"), (17, "target")], [
        str(p) for p in found
    ]
    assert all(
        f"at most {MAX_NEIGHBOUR_GAP_MM:.0f} mm" in p.message and "list the teeth" in p.message for p in found
    )
    assert case_of_record(without(rec, [15, 16])).case is not None


def test_crowns_upside_down_are_refused_by_tooth():
    """Every crown rotated 180 deg about its local x, initial and target: each tooth refused in each;
    one crown (36) tilted just past the bound in the target only is refused, alone."""
    rec = record(*RED_TEAM)
    half_turn = np.array([0.0, 1.0, 0.0, 0.0])

    def upside_down(p):
        p[:, :4] = quaternion_multiply(p[:, :4], half_turn)

    found = problems(edit(rec, upside_down))
    assert [(p.tooth, p.message.split()[1]) for p in found] == [
        (t, name) for name in ("initial", "target") for t in TOOTH_IDS
    ]
    assert all("is the crown upside down" in p.message and p.case_id == rec["case_id"] for p in found)
    angle = np.radians(MAX_CROWN_TILT_DEG + 1.0)
    tilt = np.array([np.cos(angle / 2), np.sin(angle / 2), 0.0, 0.0])
    k = TOOTH_INDEX[36]

    def tilted(p):
        p[k, :4] = quaternion_multiply(p[k, :4], tilt)

    bad = edit(rec, tilted, ("target",))
    assert quaternion_axis(np.array(bad["target"])[k, :4], 2)[2] < 0.0
    (one,) = problems(bad)
    assert one.tooth == 36 and one.message.startswith("the target crown's long axis")


def test_arches_out_of_occlusion_in_the_target_are_refused():
    """The upper arch 30 mm above the lower one, initial and target: one problem, the target's, naming
    every posterior pair; lifted just under the bound it is accepted, just over it refused."""
    rec = record(*RED_TEAM)
    bite = posterior_clearance_mm(np.array(rec["target"])).max()

    def lift(dz):
        def up(p):
            p[IS_UPPER, 6] += dz

        return up

    (found,) = problems(edit(rec, lift(30.0)))
    assert found.tooth is None and found.message.startswith("the target's posterior cusps do not meet")
    assert all(f"{TOOTH_IDS[u]}/{TOOTH_IDS[lo]} " in found.message for u, lo in ANTAGONISTS[6:])
    assert "bring the arches into occlusion" in found.message
    assert case_of_record(edit(rec, lift(MAX_TARGET_POSTERIOR_GAP_MM - bite - 0.2))).case is not None
    assert problems(edit(rec, lift(MAX_TARGET_POSTERIOR_GAP_MM - bite + 0.2)))


def test_lower_canines_through_the_upper_ones_are_refused_under_a_bound_a_real_jaw_passes():
    """The lower canines 8 mm up, initial and target: the target refused by each upper canine; the
    bound lies more than 1.5 mm below a real jaw's canines at rest."""
    rec = record(*RED_TEAM)

    def up(p):
        p[[TOOTH_INDEX[33], TOOTH_INDEX[43]], 6] += 8.0

    found = problems(edit(rec, up))
    assert sorted(p.tooth for p in found) == [13, 23], [str(p) for p in found]
    assert all("fix the target's canine positions" in p.message for p in found)
    assert f"{MIN_TARGET_CANINE_CLEARANCE_MM:.1f} mm for canines" in found[0].message
    jaw = real_jaw()["poses"]
    real = occlusal_clearance_mm(jaw, jaw)[len(ANTERIOR_ANTAGONISTS) - 2 :]
    assert real.min() < MIN_TARGET_INCISOR_CLEARANCE_MM  # why canines need their own bound
    assert real.min() > MIN_TARGET_CANINE_CLEARANCE_MM + 1.5
