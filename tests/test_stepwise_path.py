"""The stepwise faces judge the path the aligners take, not only where it ends.

Aligner series an optimiser can write through the stepwise faces (the OpenEnv-style
:class:`server.dental_environment.StepwiseDentalEnvironment` and Gymnasium) but no interpolated plan
can: the lower molars driven 2.4 mm up into their antagonists by aligner 12 and back by 24; every
tooth jiggled 0.1 mm sideways and back each aligner; every tooth taken 0.9 mm sideways by aligner 12
and back (a 1.8 mm round trip). Each ends where the clean path ends; each breaks a hard rule or earns
less than the clean path, and smoothness never pays a jiggle. Whole plans (interpolated from initial
to target, overcorrected or not) move every tooth on its straight path, which these judgements leave
as they were.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from server.cases import TASK_IDS, generate_case
from server.contact_rules import OCCLUSAL_TOLERANCE_MM
from server.dental_constants import LOWER_PAIRS, MM_PER_DEG, N_STAGES, N_TEETH, TOOTH_IDS
from server.dental_environment import StepwiseDentalEnvironment
from server.dynamics import designed_steps, engaging_steps, reach_advances, simulate
from server.gym_env import ENV_ID
from server.occlusion import posterior_clearance_floor_mm, posterior_clearance_mm
from server.oracle import oracle_plan
from server.plans import interpolate_poses, normalize_plan
from server.scoring import (
    PATH_DETOUR_SCALE_MM,
    increments,
    movement_mm,
    path_efficiency,
)
from server.treatment import rollout_plans

SEEDS = (3_000_031, 3_000_032, 3_000_033)
_STAGES = np.arange(N_STAGES + 1)
_OUT_AND_BACK = np.minimum(_STAGES, N_STAGES - _STAGES) / (N_STAGES / 2)  # 0 -> 1 at aligner 12 -> 0
_JIGGLE = (_STAGES % 2).astype(float)  # out on odd aligners, back on even ones (the 24th is back)
_UNIFORM = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 1 / N_STAGES}]}
_LOWER_MOLARS = LOWER_PAIRS[5:].ravel()


def detours(clean: np.ndarray) -> dict[str, np.ndarray]:
    """The off-path aligner series built on a clean trajectory (25, 28, 7): each ends where it ends."""
    molars = clean.copy()
    molars[:, _LOWER_MOLARS, 6] += 2.4 * _OUT_AND_BACK[:, None]
    jiggle = clean.copy()
    jiggle[:, :, 4] += 0.1 * _JIGGLE[:, None]
    trip = clean.copy()
    trip[:, :, 4] += 0.9 * _OUT_AND_BACK[:, None]
    return {"molars_up_and_back": molars, "jiggle_0.1mm": jiggle, "round_trip_1.8mm": trip}


def stepwise(store: StepwiseDentalEnvironment, case, trajectory: np.ndarray, strategy: str | None) -> dict:
    """The terminal of an OpenEnv-style episode wearing ``trajectory[1..24]``."""
    obs = store.reset(case.task_id, case.seed, case.force_decay)
    for stage in range(1, N_STAGES + 1):
        obs = store.step(obs["episode_id"], trajectory[stage], strategy=strategy, expected_stage=stage - 1)
    terminal = store.sessions.get(obs["episode_id"]).terminal
    store.close_episode(obs["episode_id"])
    return terminal


def gymnasium(env: gym.Env, case, trajectory: np.ndarray, strategy: str | None) -> dict:
    """The last info of a Gymnasium episode wearing ``trajectory[1..24]``."""
    env.reset(options={"case_seed": case.seed, "strategy": strategy})
    for stage in range(1, N_STAGES + 1):
        _, _, terminated, _, info = env.step(trajectory[stage])
    assert terminated
    return info


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_off_path_aligners_break_a_rule_or_earn_less_than_the_clean_path(task_id):
    store = StepwiseDentalEnvironment(max_sessions=4)
    env = gym.make(ENV_ID, task_id=task_id, reward_mode="shaped", gamma=0.95)
    for seed in SEEDS:
        case = generate_case(task_id, seed)
        oracle = oracle_plan(store.reset(task_id, seed))
        strategy = oracle.get("strategy")
        clean = rollout_plans([normalize_plan(oracle)], [case])[0][0]
        base = stepwise(store, case, clean, strategy)
        assert base["broken_rules"] == [], (task_id, seed, base["broken_rules"])
        for name, trajectory in detours(clean).items():
            result = stepwise(store, case, trajectory, strategy)
            info = gymnasium(env, case, trajectory, strategy)
            assert info["scaled_reward"] == result["scaled_reward"]
            assert info["broken_rules"] == result["broken_rules"]
            where = (task_id, seed, name, result["broken_rules"])
            assert result["broken_rules"] or result["scaled_reward"] < base["scaled_reward"], where
            # smoothness pays no detour: a tooth that reverses travels more than it moves
            smooth = result["reward_breakdown"]["smoothness"]
            assert smooth < base["reward_breakdown"]["smoothness"], (where, smooth)
            if name == "molars_up_and_back":  # the cusps met along the way, not at the end
                assert "occlusal_collision" in result["broken_rules"], where


def test_a_reversal_counts_against_the_limits_as_the_movement_it_is():
    """Every tooth jiggled 0.3 mm sideways and back each aligner, going nowhere: each aligner moves
    each tooth 0.3 mm, over the 0.25 mm per-stage limit, and every stage says so."""
    store = StepwiseDentalEnvironment(max_sessions=2)
    for task_id in TASK_IDS:
        case = generate_case(task_id, SEEDS[0])
        still = np.repeat(case.initial[None], N_STAGES + 1, axis=0)
        still[:, :, 4] += 0.3 * _JIGGLE[:, None]
        obs = store.reset(task_id, case.seed)
        for stage in range(1, N_STAGES + 1):
            obs = store.step(obs["episode_id"], still[stage])
            assert obs["violations"]["limits"] == N_TEETH * stage, (task_id, stage, obs["violations"])
        terminal = store.sessions.get(obs["episode_id"]).terminal
        assert "limits" in terminal["broken_rules"] and terminal["reward_breakdown"]["smoothness"] < 1e-9
        store.close_episode(obs["episode_id"])


def test_whole_plans_keep_their_straight_paths():
    """Interpolated plans (uniform, the oracle's, rushed, overcorrected), under both dynamics: each
    tooth's planned path is its net movement (path efficiency exactly 1) and no posterior cusp comes
    nearer its antagonist than the tolerance below the tightest bite of the teeth's own paths."""
    overcorrected = {
        "tooth_groups": [
            {"teeth": list(TOOTH_IDS), "fraction": 1 / 12, "start_stage": 5, "overcorrection": 0.3}
        ]
    }
    rushed = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 1 / 6}]}
    store = StepwiseDentalEnvironment(max_sessions=2)
    for task_id in TASK_IDS:
        for force_decay in (False, True):
            for seed in SEEDS:
                case = generate_case(task_id, seed, force_decay)
                oracle = oracle_plan(store.reset(task_id, seed, force_decay))
                for plan in (_UNIFORM, oracle, rushed, overcorrected):
                    planned, achieved = rollout_plans([normalize_plan(plan)], [case])
                    inc_t, inc_r = increments(planned)
                    net = movement_mm(planned[:, 0], planned[:, -1])
                    efficiency = path_efficiency(net, np.hypot(inc_t, MM_PER_DEG * inc_r))
                    assert (efficiency == 1.0).all(), (task_id, force_decay, seed, plan)
                    # every step advances the reach by itself: the dynamics engage it in full
                    steps = np.array(designed_steps(planned))
                    engage = engaging_steps(*steps, *reach_advances(planned))
                    assert np.array_equal(engage, steps), (task_id, force_decay, seed, plan)
                    floor = posterior_clearance_floor_mm(case.initial, case.target)
                    clearance = posterior_clearance_mm(achieved[0, 1:])
                    assert (clearance >= floor - OCCLUSAL_TOLERANCE_MM).all(), (task_id, force_decay, seed)


WOBBLE_SEEDS = (3_600_000, 3_600_001)


@pytest.mark.parametrize("task_id", ("task_medium", "task_hard"))
@pytest.mark.parametrize("force_decay", (False, True))
def test_wobbled_aligners_earn_less_than_the_clean_path(task_id, force_decay):
    """The oracle's aligners nudged 0.005-0.02 mm sideways on every odd aligner (and back on the even
    ones) end where the clean path ends and break no rule; under force decay a nudge must not
    engage the lag the steady series leaves behind. They earn less than the clean path, and their
    smoothness is lower: the detours are charged, their evenness is not paid."""
    store = StepwiseDentalEnvironment(max_sessions=2)
    env = gym.make(ENV_ID, task_id=task_id, force_decay=force_decay, reward_mode="scaled")
    for seed in WOBBLE_SEEDS:
        case = generate_case(task_id, seed, force_decay)
        oracle = oracle_plan(store.reset(task_id, seed, force_decay))
        strategy = oracle.get("strategy")
        clean = rollout_plans([normalize_plan(oracle)], [case])[0][0]
        base = stepwise(store, case, clean, strategy)
        for amplitude in (0.005, 0.02):
            wobbled = clean.copy()
            wobbled[:, :, 4] += amplitude * _JIGGLE[:, None]
            result = stepwise(store, case, wobbled, strategy)
            where = (task_id, force_decay, seed, amplitude, result["broken_rules"])
            assert result["broken_rules"] or result["scaled_reward"] < base["scaled_reward"], where
            assert result["reward_breakdown"]["smoothness"] < base["reward_breakdown"]["smoothness"], where
        info = gymnasium(env, case, wobbled, strategy)
        assert info["scaled_reward"] == result["scaled_reward"]


def test_an_aligner_stepping_back_engages_no_lag():
    """Force decay: teeth moved over aligners 1-12 and held from there lag their last aligner. Stepping
    every odd aligner after that back to aligner 11 (and returning on the even ones) advances no
    tooth's reach, so it engages none of the lag: no tooth ends nearer its target than the held
    series leaves it. (Engaged as a designed step, each step back would recover lag.)"""
    case = generate_case("task_hard", SEEDS[0], force_decay=True)
    progress = np.broadcast_to(np.minimum(_STAGES / 12, 1.0)[:, None], (N_STAGES + 1, N_TEETH))
    held = interpolate_poses(case.initial[None], case.target[None], progress[None])[0]
    back = held.copy()
    back[13::2] = held[11]
    clean = simulate(held, True, case.long_axis)
    wobbled = simulate(back, True, case.long_axis)
    lag = movement_mm(clean[-1], held[-1])
    assert lag.max() > 0.05  # there is lag to recover
    # the first step back breaks nothing (the teeth sit behind aligner 11); the tolerance of the
    # reach (1e-6 per aligner) is all the returns engage
    ahead = movement_mm(clean[-1], case.target) - movement_mm(wobbled[-1], case.target)
    assert ahead.max() < 1e-4, ahead.max()
    advances = np.array(reach_advances(back))
    assert (advances[:, 12:] == 0.0).all()  # aligners 13-24 stay within the reach of aligner 12


def test_a_detour_costs_path_efficiency_in_millimetres():
    """A tooth moving 5 mm that takes a 0.05 mm round trip on the way: the ratio of net movement to
    path (0.98) would charge next to nothing; the detour (0.1 mm) costs its share of
    PATH_DETOUR_SCALE_MM too. A straight path keeps 1; a detour of the scale or more keeps nothing."""
    straight = np.full((N_STAGES, 1), 5.0 / N_STAGES)
    detour = straight.copy()
    detour[0] += 0.05
    detour[1] += 0.05
    net = np.array([5.0])
    assert path_efficiency(net, straight)[0] == 1.0
    efficiency = path_efficiency(net, detour)[0]
    assert efficiency <= 5.0 / 5.1 * (1.0 - 0.1 / PATH_DETOUR_SCALE_MM) + 1e-12
    far = straight.copy()
    far[0] += PATH_DETOUR_SCALE_MM
    assert path_efficiency(net, far)[0] == 0.0
