"""Non-compliance, the task_hard option (docs/environment.md, "Cases"): seeded with the case, never
re-rolled by a rollback, the same in the stepwise and the plan paths, and visible in the
achieved poses and the insertion forces."""

from __future__ import annotations

import numpy as np
import pytest

from server.cases import HELDOUT_SEED_START, generate_case
from server.compliance import MISSED_WEAR_FACTOR, PARTIAL_WEAR_FACTOR, compliance_schedule
from server.dental_constants import N_STAGES, N_TEETH
from server.dental_environment import StepwiseDentalEnvironment
from server.errors import InvalidActionError
from server.plans import interpolate_poses
from server.treatment import score_plans

UNIFORM = {"tooth_groups": [{"teeth": [], "fraction": 1 / 24, "priority": "high"}]}
SEEDS = range(HELDOUT_SEED_START, HELDOUT_SEED_START + 40)


def slerp_poses(case) -> np.ndarray:
    """Uniform SLERP aligners (25, 28, 7) from the initial to the target."""
    progress = np.broadcast_to((np.arange(N_STAGES + 1) / N_STAGES)[:, None], (N_STAGES + 1, N_TEETH))
    return interpolate_poses(case.initial, case.target, progress)


def test_schedule_is_seeded_bounded_and_has_each_event():
    for seed in SEEDS:
        wear = compliance_schedule(seed, 2)
        assert np.array_equal(wear, compliance_schedule(seed, 2))
        assert wear.shape == (N_STAGES, N_TEETH) and not wear.flags.writeable
        assert ((wear >= 0.0) & (wear <= 1.0)).all()
        arch = np.median(wear, axis=1)  # the whole arch's factor (the one lost attachment aside)
        missed = np.flatnonzero(arch <= MISSED_WEAR_FACTOR[1])
        assert 1 <= missed.size <= 2, seed  # missed wear: 1-2 stages with the aligner mostly out
        partial = np.flatnonzero((arch >= PARTIAL_WEAR_FACTOR[0]) & (arch <= PARTIAL_WEAR_FACTOR[1]))
        assert partial.size + missed.size >= 3, seed  # a run of >= 3 partly worn stages (a miss may cut in)
        assert np.isin(arch, 1.0).sum() + partial.size + missed.size == N_STAGES
        lone = {int(t) for s in range(N_STAGES) for t in np.flatnonzero(wear[s] < np.median(wear[s]))}
        assert len(lone) == 1, seed  # one tooth lost its attachment
    assert not np.array_equal(compliance_schedule(1, 2), compliance_schedule(2, 2))


def test_the_option_keeps_the_case_geometry_and_is_task_hard_only():
    plain = generate_case("task_hard", 7)
    worn = generate_case("task_hard", 7, False, True)
    assert worn.non_compliance and not plain.non_compliance and not worn.follows_plan
    for name in ("initial", "target", "crown_width_mm", "crown_depth_mm"):
        assert np.array_equal(getattr(plain, name), getattr(worn, name))
    assert worn.summary == plain.summary
    for task in ("task_easy", "task_medium"):
        with pytest.raises(InvalidActionError, match="task_hard"):
            generate_case(task, 7, False, True)
        with pytest.raises(InvalidActionError, match="task_hard"):
            StepwiseDentalEnvironment().reset(task, 7, non_compliance=True)
    with pytest.raises(InvalidActionError, match="non_compliance"):
        StepwiseDentalEnvironment().reset("task_hard", 7, non_compliance="yes")


@pytest.mark.parametrize("force_decay", [False, True])
def test_missed_stage_lags_and_stepwise_equals_plan_scoring(force_decay):
    env = StepwiseDentalEnvironment()
    for seed in list(SEEDS)[:5]:
        case = generate_case("task_hard", seed, force_decay, True)
        poses = slerp_poses(case)
        eid = env.reset("task_hard", seed, force_decay, non_compliance=True)["episode_id"]
        achieved = [np.asarray(env.state(eid)["current_config"])]
        for s in range(1, N_STAGES + 1):
            obs = env.step(eid, poses[s])
            achieved.append(np.asarray(obs["current_config"]))
        assert obs["non_compliance"] is True
        stage = int(np.argmax(case.wear.max(axis=1) <= MISSED_WEAR_FACTOR[1]))  # a missed stage
        moved = np.linalg.norm(achieved[stage + 1][:, 4:] - achieved[stage][:, 4:], axis=-1)
        planned = np.linalg.norm(poses[stage + 1][:, 4:] - achieved[stage][:, 4:], axis=-1)
        assert (moved <= MISSED_WEAR_FACTOR[1] * planned + 1e-9).all()
        (plan,) = score_plans([UNIFORM], [("task_hard", seed, force_decay, True)])
        assert obs["terminal_reward"] == pytest.approx(plan["terminal_reward"], abs=1e-9)
        assert obs["reward_breakdown"] == pytest.approx(plan["reward_breakdown"], abs=1e-9)
        (compliant,) = score_plans([UNIFORM], [("task_hard", seed, force_decay)])
        if not force_decay:
            # the aligner after a missed stage goes onto teeth that lag: a larger insertion force
            # (under force decay the lag already engages every aligner to its seat limit,
            # server.dynamics.SEAT_FACTOR, so a missed one costs movement, not force)
            assert plan["diagnostics"]["peak_pdl_kpa"] > compliant["diagnostics"]["peak_pdl_kpa"] + 0.1
        assert plan["reward_breakdown"]["accuracy"] <= compliant["reward_breakdown"]["accuracy"] + 1e-9


def test_rollback_does_not_reroll_the_schedule():
    env = StepwiseDentalEnvironment()
    case = generate_case("task_hard", 11, False, True)
    poses = slerp_poses(case)
    eid = env.reset("task_hard", 11, non_compliance=True)["episode_id"]
    for s in range(1, 6):
        first = env.step(eid, poses[s])
    env.rollback_stage(eid)
    again = env.step(eid, poses[5])
    assert again["current_config"] == first["current_config"]
    assert again["step_reward"] == first["step_reward"]
