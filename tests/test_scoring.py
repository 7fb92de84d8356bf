"""Scoring and plan semantics (docs/environment.md, "Plans" and "Scoring"): every component responds to the plan,
plans mean what the prompt says, garbage never beats a structured plan, calibrations hold."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.cases import TASK_IDS, generate_case
from server.clinical_profiles import STRATEGIES, STRATEGY_LEVELS
from server.dental_constants import (
    IS_INCISOR,
    N_STAGES,
    N_TEETH,
    PDL_CRITICAL_KPA,
    PRIORITY_START_STAGE,
    TOOTH_IDS,
    TOOTH_INDEX,
)
from server.dental_environment import StepwiseDentalEnvironment
from server.oracle import oracle_plan
from server.plans import MAX_GROUPS, UNIFORM_FRACTION, normalize_plan, planned_progress
from server.reward_scaler import (
    BREACH_KEYS,
    FAIL_TOP,
    REWARD_MIN,
    SAFE_SCALE,
    breach_total,
    broken_rules,
    scale_reward,
    scale_rewards,
)
from server.scoring import (
    MAX_MULTIPLIER,
    MOVEMENT_EPS_MM,
    STRATEGY_MULTIPLIERS,
    TERMINAL_WEIGHTS,
    movement_mm,
    pdl_stress_kpa,
    pdl_tooth_score,
)
from server.treatment import rollout_plans, score_plans

ALL_TEETH = list(TOOTH_IDS)
COMPONENTS = (
    "accuracy",
    "occlusion_composite",
    "collision_free",
    "pdl_feasibility",
    "limits_compliance",
    "smoothness",
    "staging",
    "strategy_multiplier",
    "realism",
    "anchorage",
    "movement_prior",
)


def teeth(*numbers: int) -> list[int]:
    """FDI ids of every tooth whose last digit is in ``numbers``."""
    return [t for t in TOOTH_IDS if t % 10 in numbers]


def group(ids, fraction, priority="high") -> dict:
    return {"teeth": list(ids), "fraction": fraction, "priority": priority}


DO_NOTHING = {"tooth_groups": [group(ALL_TEETH, 0.0)]}
FAST = {"tooth_groups": [group(ALL_TEETH, 0.5)]}
JUMP = {"tooth_groups": [group(ALL_TEETH, 1.0)]}
ANTERIOR_FIRST = {
    "strategy": "anterior_first",
    "tooth_groups": [
        group(teeth(1, 2), 1 / 24, "high"),
        group(teeth(3), 1 / 18, "medium"),
        group(teeth(4, 5, 6, 7), 1 / 12, "low"),
    ],
}
LOW_LATE = {"strategy": "distal_first", "tooth_groups": [group(ALL_TEETH, 1 / 12, "low")]}
INCISORS_FAST_FIRST = {
    "tooth_groups": [group(teeth(1, 2), 0.125, "high"), group(teeth(3, 4, 5), 1 / 12, "low")]
}


@pytest.fixture(scope="module")
def env() -> StepwiseDentalEnvironment:
    return StepwiseDentalEnvironment()


def oracle_for(env: StepwiseDentalEnvironment, task: str, seed: int, force_decay: bool = False) -> dict:
    return oracle_plan(env.reset(task, seed, force_decay))


def terminals(results: list[dict]) -> np.ndarray:
    return np.array([r["terminal_reward"] for r in results])


def component(results: list[dict], name: str) -> np.ndarray:
    return np.array([r["reward_breakdown"][name] for r in results])


# --- PDL calibration ----------------------------------------------------------------------------


def test_pdl_stress_at_the_limits_is_safe_for_every_tooth():
    at_limits = pdl_stress_kpa(np.full(N_TEETH, 0.25), np.full(N_TEETH, 2.0))
    assert at_limits.shape == (N_TEETH,)
    assert np.all(at_limits < PDL_CRITICAL_KPA), dict(zip(TOOTH_IDS, at_limits.round(2)))
    assert np.all(pdl_tooth_score(at_limits) > 0.5)


def test_pdl_stress_at_twice_the_limits_is_critical_for_every_incisor():
    doubled = pdl_stress_kpa(np.full(N_TEETH, 0.5), np.full(N_TEETH, 4.0))
    assert np.all(doubled[IS_INCISOR] > PDL_CRITICAL_KPA), dict(zip(TOOTH_IDS, doubled.round(2)))
    assert np.all(pdl_tooth_score(doubled[IS_INCISOR]) < 0.5)


def test_pdl_stress_and_score_are_monotonic():
    mis = np.linspace(0.0, 2.0, 50)
    stress = pdl_stress_kpa(mis[:, None] * np.ones(N_TEETH), 8.0 * mis[:, None] * np.ones(N_TEETH))
    assert np.all(np.diff(stress, axis=0) > 0)
    score = pdl_tooth_score(stress)
    assert np.all(np.diff(score, axis=0) <= 1e-12)
    assert score[0].min() == 1.0 and score[-1].max() == 0.0


# --- reward scaler: the ordering principle -----------------------------------------------------------


@pytest.mark.parametrize("raw", [0.0, 0.1, 0.25, 0.5, 0.8, 1.0])
def test_safe_band_is_eight_times_the_terminal(raw):
    value, band = scale_reward(raw, 0.0)
    assert value == pytest.approx(SAFE_SCALE * raw) and band == "safe"


def test_failing_band_lies_below_the_safe_band_and_is_graded():
    breach = np.array([1e-9, 0.01, 0.1, 1.0, 10.0, 100.0, 1e6, np.inf, np.nan])
    failing = scale_rewards(np.ones_like(breach), breach)
    assert np.all(failing <= FAIL_TOP) and np.all(failing > REWARD_MIN)
    assert np.all(np.diff(failing[:-1]) < 0) or np.all(np.diff(failing[:-2]) < 0)  # more breach, lower
    assert failing[-1] == failing[-2]  # NaN breach counts as infinite
    # the best failing plan is below the worst safe one (doing nothing, raw 0)
    assert failing.max() < scale_rewards(np.array([0.0]), np.array([0.0]))[0] == 0.0
    # non-finite raw is not a plan
    assert scale_reward(float("nan"), 0.0) == (REWARD_MIN, "non_finite")
    assert scale_rewards(np.array([np.inf, -np.inf]), np.zeros(2)).tolist() == [REWARD_MIN, REWARD_MIN]


@settings(max_examples=200, deadline=None)
@given(
    raw=st.floats(-1, 2, allow_nan=False),
    other=st.floats(-1, 2, allow_nan=False),
    breach=st.floats(1e-12, 1e9, allow_nan=False),
)
def test_any_breaking_plan_scores_below_any_safe_plan(raw, other, breach):
    assert scale_reward(raw, breach)[0] < scale_reward(other, 0.0)[0]


def test_scale_reward_matches_scale_rewards():
    rng = np.random.default_rng(0)
    raw = rng.uniform(-0.2, 1.2, 200)
    breach = np.where(rng.random(raw.size) < 0.5, 0.0, rng.exponential(5.0, raw.size))
    vec = scale_rewards(raw, breach)
    assert np.allclose(vec, [scale_reward(r, b)[0] for r, b in zip(raw, breach)])


def test_broken_rules_names_each_rule():
    diag = dict.fromkeys(BREACH_KEYS.values(), 0.0)
    assert broken_rules(diag) == [] and breach_total(diag) == 0.0
    for rule, key in BREACH_KEYS.items():
        assert broken_rules({**diag, key: 0.5}) == [rule]
    assert broken_rules({**diag, "pdl_breach": float("nan")}) == ["pdl_stress"]


# --- every component responds to the plan ----------------------------------------------------------------

VARIATION_CASES = [(t, s) for t in TASK_IDS for s in (0, 1, 2)]


@pytest.fixture(scope="module")
def plan_variation(env) -> dict[tuple[str, int], list[dict]]:
    """Per case: the scores of a varied set of plans (and the oracle under force decay)."""
    out = {}
    for task, seed in VARIATION_CASES:
        plans = [
            oracle_for(env, task, seed),
            None,  # uniform SLERP
            DO_NOTHING,
            FAST,
            JUMP,
            ANTERIOR_FIRST,
            LOW_LATE,
            INCISORS_FAST_FIRST,
        ]
        results = score_plans(plans, [(task, seed, False)] * len(plans))
        results += score_plans([oracle_for(env, task, seed, True), None], [(task, seed, True)] * 2)
        out[(task, seed)] = results
    return out


@pytest.mark.parametrize("name", [c for c in COMPONENTS if c != "collision_free"])
def test_every_component_responds_to_the_plan(plan_variation, name):
    """A component constant across plans for a fixed case is a defect.

    collision_free is tested below: in the plan format every tooth moves on its own
    straight path between a penetration-free initial and target, so plans can only
    collide where paths cross (crowding); any action that brings crowns into contact
    lowers it on every case.
    """
    constant = {}
    for case, results in plan_variation.items():
        values = {round(v, 12) for v in component(results, name)}
        if len(values) < 2:
            constant[case] = values.pop()
    print(f"{name}: constant on {len(constant)}/{len(plan_variation)} cases {constant}")
    assert not constant, (
        f"component {name!r} takes a single value across {len(plan_variation[VARIATION_CASES[0]])} plans "
        f"on {len(constant)}/{len(plan_variation)} cases: {constant}"
    )


@pytest.mark.parametrize(("task", "seed"), VARIATION_CASES)
def test_collision_free_responds_to_actions_on_every_case(task, seed):
    from server.cases import generate_case
    from server.dental_constants import TOOTH_INDEX
    from server.plans import interpolate_poses, planned_progress
    from server.scoring import score_episodes

    case = generate_case(task, seed)
    traj = interpolate_poses(
        case.initial, case.target, planned_progress(np.ones(28, int), np.full(28, 1 / 24))
    )
    pushed = traj.copy()
    a, b = TOOTH_INDEX[11], TOOTH_INDEX[21]
    pushed[10:, a, 4:6] += 0.6 * (traj[10:, b, 4:6] - traj[10:, a, 4:6])  # 11 into 21 from stage 10 on

    def collision_free(t):
        scores = score_episodes(
            case.initial[None],
            case.target[None],
            case.crown_width_mm[None],
            case.crown_depth_mm[None],
            t[None],
            t[None],
            [case.profile],
            [None],
        )
        return scores.components["collision_free"][0]

    assert collision_free(traj) == pytest.approx(1.0, abs=0.01)
    assert collision_free(pushed) < 0.6


def test_collision_free_responds_to_plans_on_crowding(env):
    seeds = [s for s in range(200) if generate_case("task_medium", s).profile == "crowding"][:5]
    for seed in seeds:
        results = score_plans(
            [oracle_for(env, "task_medium", seed), INCISORS_FAST_FIRST], [("task_medium", seed, False)] * 2
        )
        values = component(results, "collision_free")
        assert len({round(v, 9) for v in values}) == 2, (seed, values)


def test_components_are_in_range(plan_variation):
    """Every score in [0, 1] (the multiplier in {0.6, 1.0, 1.2})."""
    out_of_range = []
    for case, results in plan_variation.items():
        for k, r in enumerate(results):
            b = r["reward_breakdown"]
            assert set(COMPONENTS) <= set(b)
            assert 0.0 <= r["terminal_reward"] <= 1.0
            for name, v in b.items():
                assert math.isfinite(v)
                if name == "strategy_multiplier":
                    assert v in STRATEGY_MULTIPLIERS.values()
                elif not 0.0 <= v <= 1.0:
                    out_of_range.append((case, k, name, v))
    assert not out_of_range, f"(case, plan index, component, value) outside [0, 1]: {out_of_range[:10]}"


def test_terminal_is_the_documented_composite(plan_variation):
    for results in plan_variation.values():
        for r in results:
            b = r["reward_breakdown"]
            process = sum(TERMINAL_WEIGHTS[k] * b[k] for k in TERMINAL_WEIGHTS if k != "accuracy")
            raw = b["strategy_multiplier"] / MAX_MULTIPLIER * (0.30 * b["accuracy"] + b["accuracy"] * process)
            expected = min(max(raw * r["format"]["validity"], 0.0), 1.0)
            assert r["terminal_reward"] == pytest.approx(expected, abs=1e-12)


# --- strategy judged against the plan's own staging ------------------------------------------------

_FRACTION_BY_PRIORITY = {"high": 1 / 24, "medium": 1 / 18, "low": 1 / 12}


def staged_plan(case, reverse: bool) -> dict | None:
    """A plan that declares the case's optimal strategy and stages with it (or against it).

    Each of the strategy's levels present among the treated teeth starts at its own aligner
    (evenly from 1 to 13, ``start_stage``; reverse: the last level first) and finishes at 24.
    None when the treated teeth all share one level (nothing to stage).
    """
    levels = STRATEGY_LEVELS[case.optimal_strategy]
    treated = movement_mm(case.initial, case.target) > MOVEMENT_EPS_MM
    present = np.unique(levels[treated])
    if present.size < 2:
        return None
    groups: dict[int, list[int]] = {}
    for i, fdi in enumerate(TOOTH_IDS):
        rank = int(np.clip(np.searchsorted(present, levels[i]), 0, present.size - 1))
        if reverse:
            rank = present.size - 1 - rank
        groups.setdefault(1 + round(12 * rank / (present.size - 1)), []).append(fdi)
    return {
        "strategy": case.optimal_strategy,
        "tooth_groups": [
            {"teeth": ids, "fraction": 1 / (N_STAGES - start + 1), "start_stage": start}
            for start, ids in groups.items()
        ],
    }


@pytest.mark.parametrize("task", TASK_IDS)
def test_declaring_the_optimal_strategy_while_staging_against_it_is_not_paid(task):
    cs = [generate_case(task, s) for s in range(200)]
    pairs = [(c, staged_plan(c, reverse=True), staged_plan(c, reverse=False)) for c in cs]
    pairs = [p for p in pairs if p[1] is not None]
    assert len(pairs) >= 50
    against = score_plans([p[1] for p in pairs], [(task, p[0].seed, False) for p in pairs])
    follows = score_plans([p[2] for p in pairs], [(task, p[0].seed, False) for p in pairs])
    bad = [
        (c.seed, c.profile, b["staging"], b["strategy_multiplier"])
        for (c, _, _), b in zip(pairs, (r["reward_breakdown"] for r in against))
        if b["strategy_multiplier"] == 1.2 or not b["staging"] < 0.5
    ]
    assert not bad, f"{task}: reversed staging still paid (seed, profile, staging, multiplier): {bad[:10]}"
    # the control: the same groups in the strategy's order are paid the optimal multiplier
    assert np.all(component(follows, "strategy_multiplier") == 1.2)
    assert np.all(component(follows, "staging") > 0.5)
    assert np.all(terminals(follows) > terminals(against))


def test_the_declared_strategy_changes_the_multiplier():
    case = generate_case("task_medium", 4)
    plans = [{"strategy": s} for s in STRATEGIES] + [{}]
    res = score_plans(plans, [("task_medium", 4, False)] * len(plans))
    mult = dict(zip([*STRATEGIES, None], component(res, "strategy_multiplier")))
    assert mult[None] == 1.0
    assert set(mult.values()) >= {1.0, 0.6}
    # uniform staging neither follows nor contradicts: the optimal strategy is not paid 1.2 for it
    assert mult[case.optimal_strategy] == 1.0


# --- structured plans vs garbage ------------------------------------------------------------------------

ALL_NAN = {"strategy": "anterior_first", "tooth_groups": [group([t], float("nan")) for t in TOOTH_IDS]}
GARBAGE = [
    '{"tooth_groups": [{"teeth": ["x"], "fraction": "NaN"}]}',
    '{"tooth_groups": [{"teeth": [11, 21], "fraction": NaN}]}',
    '{"tooth_groups": [{"teeth": [11], "fraction": Infinity}, {"teeth": [12], "fraction": -1}]}',
    json.dumps({"tooth_groups": [group(ALL_TEETH, 2.0)]}),
]


@pytest.mark.parametrize("task", TASK_IDS)
def test_structured_plan_beats_garbage_and_degenerate_plans_score_low(env, task):
    seeds = range(12)
    oracle = [oracle_for(env, task, s) for s in seeds]
    cases = [(task, s, False) for s in seeds]
    ours = terminals(env.score_plans(oracle, cases))
    report = {}
    for name, plan in [("do_nothing", DO_NOTHING), ("all_nan", ALL_NAN), *[(g, g) for g in GARBAGE]]:
        theirs = terminals(env.score_plans([plan] * len(cases), cases))
        report[name[:40]] = round(float(theirs.max()), 4)
        assert np.all(ours > theirs), (name, ours, theirs)
        assert theirs.max() < 0.2, (name, theirs)
    # garbage without any group is not a plan: the environment scores it the minimum, never SLERP
    for garbage in ("not json at all", "{}", "[]", '{"tooth_groups": "all"}'):
        results = env.score_plans([garbage] * len(cases), cases)
        assert all(r["not_a_plan"] and r["scaled_reward"] == REWARD_MIN for r in results), garbage
        assert ours.mean() > terminals(results).mean() + 0.05, (garbage, ours.mean())
    print(task, "oracle mean", round(float(ours.mean()), 4), "degenerate max", report)


def test_all_invalid_groups_count_in_the_format_and_zero_validity():
    res = score_plans([ALL_NAN], [("task_easy", 0, False)])[0]
    assert res["format"]["invalid_fractions"] == N_TEETH
    assert res["format"]["validity"] == 0.0
    assert res["terminal_reward"] == 0.0


# --- crowding: aligning crowded anteriors before creating space collides --------------------------------


@pytest.mark.parametrize("task", ["task_medium", "task_hard"])
def test_aligning_crowded_anteriors_before_creating_space_collides(env, task):
    seeds = [s for s in range(120) if generate_case(task, s).profile == "crowding"]
    assert len(seeds) >= 15
    cases = [(task, s, False) for s in seeds]
    oracle = score_plans([oracle_for(env, task, s) for s in seeds], cases)
    rushed = score_plans([INCISORS_FAST_FIRST] * len(seeds), cases)
    cf_oracle, cf_rushed = component(oracle, "collision_free"), component(rushed, "collision_free")
    print(
        f"{task}: {len(seeds)} crowding cases, collision_free oracle {cf_oracle.mean():.3f}, "
        f"incisors-first {cf_rushed.mean():.3f}"
    )
    worse = cf_rushed < cf_oracle
    assert worse.all(), (
        f"seeds {np.array(seeds)[~worse].tolist()} oracle {cf_oracle[~worse]} rushed {cf_rushed[~worse]}"
    )
    assert np.all(cf_rushed < 0.9), cf_rushed  # a real collision (the reward scaler's hard fail)
    assert np.all([r["diagnostics"]["colliding_contacts"] > 0 for r in rushed])


# --- plan semantics -------------------------------------------------------------------------------------


def rollout(plans: list, task: str = "task_medium", seed: int = 3, force_decay: bool = False) -> np.ndarray:
    """Planned trajectories (B, 25, 28, 7) of plans on one case."""
    case = generate_case(task, seed, force_decay)
    planned, _ = rollout_plans([normalize_plan(p) for p in plans], [case] * len(plans))
    return planned


def test_priority_sets_the_start_stage():
    plans = [{"tooth_groups": [group(ALL_TEETH, 1 / 12, p)]} for p in ("high", "medium", "low")]
    specs = [normalize_plan(p) for p in plans]
    for spec, p in zip(specs, ("high", "medium", "low")):
        assert np.all(spec.start == PRIORITY_START_STAGE[p])
    res = score_plans(plans, [("task_medium", 3, False)] * 3)
    case = generate_case("task_medium", 3)
    treated = movement_mm(case.initial, case.target) > MOVEMENT_EPS_MM
    for r, p in zip(res, ("high", "medium", "low")):
        assert np.all(np.array(r["start_stage"])[treated] == PRIORITY_START_STAGE[p])
    traj = rollout(plans)
    assert not np.allclose(traj[0], traj[1]) and not np.allclose(traj[1], traj[2])
    # under a declared strategy the start order changes the staging score
    staged = [
        {"strategy": "anterior_first", "tooth_groups": [group(teeth(1, 2), 1 / 12, p)]}
        for p in ("high", "low")
    ]
    early, late = score_plans(staged, [("task_medium", 3, False)] * 2)
    assert early["reward_breakdown"]["staging"] != late["reward_breakdown"]["staging"]
    # nothing moves before the start stage
    assert np.allclose(traj[2, : PRIORITY_START_STAGE["low"]], case.initial)


def test_missing_priority_means_high_and_unknown_priority_is_counted():
    a = normalize_plan({"tooth_groups": [{"teeth": [11], "fraction": 0.1}]})
    b = normalize_plan({"tooth_groups": [{"teeth": [11], "fraction": 0.1, "priority": "urgent"}]})
    assert a.start[TOOTH_INDEX[11]] == 1 and b.start[TOOTH_INDEX[11]] == 1
    assert b.format.invalid_priorities == 1 and a.format.invalid_priorities == 0


def test_fraction_changes_the_trajectory_and_score():
    plans = [{"tooth_groups": [group(ALL_TEETH, f)]} for f in (1 / 24, 1 / 16, 1 / 10)]
    traj = rollout(plans)
    assert not np.allclose(traj[0], traj[1]) and not np.allclose(traj[1], traj[2])
    assert len(set(terminals(score_plans(plans, [("task_medium", 3, False)] * 3)).round(9))) == 3


def test_teeth_change_the_trajectory():
    plans = [
        {"tooth_groups": [group(teeth(1, 2), 0.1)]},
        {"tooth_groups": [group(teeth(3, 4), 0.1)]},
    ]
    traj = rollout(plans)
    i11, i14 = TOOTH_INDEX[11], TOOTH_INDEX[14]
    case = generate_case("task_medium", 3)
    need = movement_mm(case.initial, case.target)
    assert need[i11] > 0.1 or need[i14] > 0.1
    assert not np.allclose(traj[0], traj[1])
    res = score_plans(plans, [("task_medium", 3, False)] * 2)
    assert (
        res[0]["start_stage"] != res[1]["start_stage"]
        or res[0]["terminal_reward"] != res[1]["terminal_reward"]
    )


def test_strategy_changes_the_score_not_the_trajectory():
    plans = [ANTERIOR_FIRST | {"strategy": s} for s in STRATEGIES]
    traj = rollout(plans)
    assert np.allclose(traj, traj[:1])
    res = score_plans(plans, [("task_medium", 3, False)] * len(plans))
    assert len(set(terminals(res).round(9))) >= 2
    assert len(set(component(res, "staging").round(9))) >= 2


def test_uniform_fraction_from_stage_one_is_uniform_slerp():
    explicit = {"tooth_groups": [group(ALL_TEETH, 1 / 24, "high")]}
    for task in TASK_IDS:
        for fd in (False, True):
            traj = rollout([explicit, None, {}], task=task, seed=11, force_decay=fd)
            assert np.array_equal(traj[0], traj[1]) and np.array_equal(traj[1], traj[2])
            res = score_plans([explicit, None], [(task, 11, fd)] * 2)
            assert res[0]["terminal_reward"] == res[1]["terminal_reward"]
            assert res[0]["reward_breakdown"] == res[1]["reward_breakdown"]
    case = generate_case("task_hard", 11)
    assert np.allclose(traj[1, -1], case.target, atol=1e-12)
    assert np.allclose(traj[1, 12, :, 4:], (case.initial[:, 4:] + case.target[:, 4:]) / 2, atol=1e-12)


def progress_of(plan) -> np.ndarray:
    """(25, 28) planned share of each tooth's movement at stages 0..24."""
    spec = normalize_plan(plan)
    return planned_progress(spec.start, spec.fraction)


def test_fraction_is_per_stage():
    """A group with fraction 0.1 reaches its target after 10 stages, not at stage 1."""
    case = generate_case("task_hard", 2)
    i = TOOTH_INDEX[11]
    progress = progress_of({"tooth_groups": [group([11], 0.1)]})
    assert progress[0, i] == 0.0
    assert progress[1, i] == pytest.approx(0.1)
    assert progress[5, i] == pytest.approx(0.5)
    assert progress[9, i] == pytest.approx(0.9)
    assert np.all(progress[10:, i] == 1.0)
    traj = rollout([{"tooth_groups": [group([11], 0.1)]}], task="task_hard", seed=2)[0]
    start_gap = np.linalg.norm(case.target[i, 4:] - case.initial[i, 4:])
    assert np.linalg.norm(traj[1, i, 4:] - case.initial[i, 4:]) == pytest.approx(0.1 * start_gap, abs=1e-9)
    assert not np.allclose(traj[9, i], case.target[i])
    assert np.allclose(traj[10:, i], case.target[i], atol=1e-12)
    # a medium group with fraction 0.1 starts at 7 and arrives at stage 16
    progress = progress_of({"tooth_groups": [group([11], 0.1, "medium")]})
    assert progress[6, i] == 0.0 and progress[7, i] == pytest.approx(0.1)
    assert progress[15, i] == pytest.approx(0.9) and progress[16, i] == 1.0


def test_fraction_zero_keeps_a_tooth_still_and_unlisted_teeth_follow_uniform_slerp():
    plan = {"tooth_groups": [group([11, 12], 0.0)]}
    traj, uniform = rollout([plan, None])
    listed = [TOOTH_INDEX[11], TOOTH_INDEX[12]]
    others = [i for i in range(N_TEETH) if i not in listed]
    assert np.allclose(traj[:, listed], traj[0, listed])
    assert np.array_equal(traj[:, others], uniform[:, others])


def test_a_tooth_listed_twice_takes_its_first_group():
    spec = normalize_plan(
        {
            "tooth_groups": [
                group([11, 12], 0.2, "low"),
                group([12, 13], 0.05, "high"),
                group([11], 0.3, "medium"),
            ]
        }
    )
    assert spec.start[TOOTH_INDEX[12]] == PRIORITY_START_STAGE["low"]
    assert spec.fraction[TOOTH_INDEX[12]] == 0.2
    assert spec.start[TOOTH_INDEX[11]] == PRIORITY_START_STAGE["low"]
    assert spec.fraction[TOOTH_INDEX[11]] == 0.2
    assert spec.start[TOOTH_INDEX[13]] == 1 and spec.fraction[TOOTH_INDEX[13]] == 0.05
    assert spec.format.duplicate_teeth == 2


@pytest.mark.parametrize("bad_id", [99, 18, 0, -11, True, False, 11.0, "11", None, [11], {"id": 11}, 1e300])
def test_bad_tooth_ids_are_ignored_and_counted(bad_id):
    spec = normalize_plan({"tooth_groups": [{"teeth": [bad_id, 21], "fraction": 0.1}]})
    assert spec.format.invalid_teeth == 1
    assert spec.format.valid_groups == 1
    assert spec.fraction[TOOTH_INDEX[21]] == 0.1
    changed = np.flatnonzero(spec.fraction != UNIFORM_FRACTION)
    assert changed.tolist() == [TOOTH_INDEX[21]]
    if bad_id is True:  # True == 1 must not address tooth index 1 or FDI 1
        assert spec.fraction[1] == UNIFORM_FRACTION


@pytest.mark.parametrize(
    "bad_fraction",
    [-0.1, 1.5, float("nan"), float("inf"), -float("inf"), "0.1", "NaN", None, True, [0.1], {}],
)
def test_bad_fractions_are_ignored_and_counted(bad_fraction):
    plan = {"tooth_groups": [{"teeth": [11, 12], "fraction": bad_fraction}, group([21], 0.1)]}
    spec = normalize_plan(plan)
    assert spec.format.invalid_fractions == 1
    assert spec.format.valid_groups == 1 and spec.format.groups == 2
    assert spec.format.validity == 0.5
    assert spec.fraction[TOOTH_INDEX[11]] == UNIFORM_FRACTION
    assert spec.fraction[TOOTH_INDEX[21]] == 0.1
    res = score_plans([plan], [("task_easy", 1, False)])[0]
    assert math.isfinite(res["terminal_reward"])
    assert res["format"]["invalid_fractions"] == 1


def test_an_invalid_group_halves_the_terminal_of_a_two_group_plan():
    good = {"tooth_groups": [group([21], 0.1)]}
    with_bad = {"tooth_groups": [group([21], 0.1), {"teeth": [11], "fraction": float("nan")}]}
    a, b = score_plans([good, with_bad], [("task_medium", 8, False)] * 2)
    assert b["terminal_reward"] == pytest.approx(0.5 * a["terminal_reward"], abs=1e-12)
    assert a["terminal_reward"] > 0.1


def test_group_count_is_bounded():
    plan = {"tooth_groups": [group([11], 0.1)] * (MAX_GROUPS + 10)}
    spec = normalize_plan(plan)
    assert spec.format.ignored_groups == 10
    assert spec.format.duplicate_teeth == MAX_GROUPS - 1


def test_fraction_boundaries_are_valid():
    spec = normalize_plan(
        {"tooth_groups": [group([11], 0), group([12], 1), group([13], 0.0), group([14], 1.0)]}
    )
    assert spec.format.invalid_fractions == 0 and spec.format.valid_groups == 4
    assert spec.fraction[[TOOTH_INDEX[t] for t in (11, 12, 13, 14)]].tolist() == [0.0, 1.0, 0.0, 1.0]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-100, 100) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=30,
)
plan_like = st.fixed_dictionaries(
    {},
    optional={
        "strategy": st.sampled_from([*STRATEGIES, "nonsense", None]) | json_values,
        "tooth_groups": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "teeth": st.lists(st.sampled_from(TOOTH_IDS) | json_values, max_size=8) | json_values,
                    "fraction": st.floats(-0.5, 1.5) | json_values,
                    "priority": st.sampled_from(["high", "medium", "low", "x"]) | json_values,
                },
            )
            | json_values,
            max_size=6,
        )
        | json_values,
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(plan_like | json_values, min_size=1, max_size=4))
def test_no_plan_raises_and_every_score_is_finite_and_in_range(plans):
    for p in plans:
        spec = normalize_plan(p)
        assert spec.start.shape == (N_TEETH,) and spec.fraction.shape == (N_TEETH,)
        assert np.all((spec.fraction >= 0) & (spec.fraction <= 1))
        assert set(spec.start.tolist()) <= set(PRIORITY_START_STAGE.values())
    res = score_plans(plans, [("task_medium", 5, False)] * len(plans))
    for r in res:
        assert 0.0 <= r["terminal_reward"] <= 1.0
        assert all(math.isfinite(v) for v in r["reward_breakdown"].values())
        json.dumps(r, allow_nan=False)


# --- batch scoring -----------------------------------------------------------------------------------


def test_batch_scoring_matches_one_by_one_across_chunks():
    rng = np.random.default_rng(7)
    pool = [None, DO_NOTHING, FAST, ANTERIOR_FIRST, LOW_LATE, INCISORS_FAST_FIRST]
    plans = [pool[i] for i in rng.integers(len(pool), size=140)]
    cases = [(TASK_IDS[i % 3], int(rng.integers(50)), bool(i % 2)) for i in range(140)]
    batch = score_plans(plans, cases)
    for k in (0, 1, 63, 127, 128, 129, 139):
        single = score_plans([plans[k]], [cases[k]])[0]
        assert single["terminal_reward"] == pytest.approx(batch[k]["terminal_reward"], abs=1e-12)
        assert single["reward_breakdown"] == pytest.approx(batch[k]["reward_breakdown"], abs=1e-12)


def test_force_decay_lags_the_teeth_behind_the_aligners():
    res = score_plans([None, None], [("task_medium", 9, False), ("task_medium", 9, True)])
    ideal, decay = (r["reward_breakdown"] for r in res)
    assert ideal["accuracy"] == pytest.approx(1.0, abs=1e-6)
    assert 0.25 < decay["accuracy"] < 0.75  # calibrated to the clinic (tests/test_calibration.py)
    assert res[1]["terminal_reward"] < res[0]["terminal_reward"]
    assert N_STAGES == 24
