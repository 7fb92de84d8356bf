"""The Gymnasium face under discounting (:mod:`server.gym_env`): the ordering principle holds for
every discount gamma in (0, 1].

Plans that break a hard rule (every tooth to its target in aligner 1; rushed in 6 aligners; every
tooth held still until a jump in the last aligner; the lower molars driven up into their antagonists
and back) and safe ones (doing nothing, uniform SLERP, the oracle's plan) are worn aligner by aligner
through ``gymnasium.make``, on every level and both dynamics, on cases no default was tuned on. Under
each discount, each breaker's discounted return lies below doing nothing's (0) and below every safe
plan's, and the safe plans keep the order of their terminal scaled rewards; in ``"shaped"`` and in
``"scaled"`` mode.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from server.cases import TASK_IDS, generate_case
from server.dental_constants import LOWER_PAIRS, N_STAGES, TOOTH_IDS
from server.dental_environment import StepwiseDentalEnvironment
from server.gym_env import ENV_ID, PREVIOUS_ENV_IDS
from server.oracle import oracle_plan
from server.plans import interpolate_poses, normalize_plan
from server.treatment import rollout_plans

GAMMAS = (1.0, 0.99, 0.95, 0.9, 0.5)
SEEDS = (3_000_011, 3_000_012)
_STAGES = np.arange(N_STAGES + 1)
_OUT_AND_BACK = np.minimum(_STAGES, N_STAGES - _STAGES) / (N_STAGES / 2)  # 0 -> 1 at aligner 12 -> 0
_UNIFORM = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 1 / N_STAGES}]}


def _along(case, progress: np.ndarray) -> np.ndarray:
    """(25, 28, 7) poses a share ``progress`` (25,) of the way from initial to target at each stage."""
    return interpolate_poses(case.initial, case.target, np.repeat(progress[:, None], 28, axis=1))


def plans(case, oracle: dict) -> dict[str, tuple[np.ndarray, str | None]]:
    """Name -> (aligner trajectory (25, 28, 7), declared strategy) of the plans judged here."""
    uniform = rollout_plans([normalize_plan(_UNIFORM)], [case])[0][0]
    molars = uniform.copy()
    molars[:, LOWER_PAIRS[5:].ravel(), 6] += 2.4 * _OUT_AND_BACK[:, None]
    return {
        "nothing": (_along(case, np.zeros(N_STAGES + 1)), None),
        "uniform": (uniform, None),
        "oracle": (rollout_plans([normalize_plan(oracle)], [case])[0][0], oracle.get("strategy")),
        "at_once": (_along(case, np.minimum(_STAGES, 1.0)), None),
        "rushed_6": (_along(case, np.minimum(_STAGES / 6, 1.0)), None),
        "last_jump": (_along(case, (_STAGES == N_STAGES).astype(float)), None),
        "molars_up": (molars, None),
    }


def play(
    env: gym.Env, case_seed: int, trajectory: np.ndarray, strategy: str | None
) -> tuple[np.ndarray, dict]:
    """(24,) rewards and the last info of an episode wearing ``trajectory[1..24]``."""
    env.reset(seed=0, options={"case_seed": case_seed, "strategy": strategy})
    rewards = []
    for stage in range(1, N_STAGES + 1):
        _, reward, terminated, _, info = env.step(trajectory[stage])
        rewards.append(reward)
    assert terminated
    return np.array(rewards), info


def discounted(rewards: np.ndarray, gamma: float) -> float:
    return float(np.sum(rewards * gamma ** np.arange(len(rewards))))


@pytest.mark.parametrize("force_decay", [False, True])
@pytest.mark.parametrize("task_id", TASK_IDS)
def test_every_breaker_returns_less_than_every_safe_plan_under_any_discount(task_id, force_decay):
    scaled_env = gym.make(ENV_ID, task_id=task_id, force_decay=force_decay)
    shaped = {
        g: gym.make(ENV_ID, task_id=task_id, force_decay=force_decay, reward_mode="shaped", gamma=g)
        for g in GAMMAS
    }
    store = StepwiseDentalEnvironment(max_sessions=4)
    for seed in SEEDS:
        case = generate_case(task_id, seed, force_decay)
        oracle = oracle_plan(store.reset(task_id, seed, force_decay))
        returns: dict[str, dict] = {}  # plan -> {(mode, gamma): discounted return}
        final: dict[str, dict] = {}
        for name, (trajectory, strategy) in plans(case, oracle).items():
            sparse, info = play(scaled_env, seed, trajectory, strategy)
            final[name] = info
            returns[name] = {("scaled", g): discounted(sparse, g) for g in GAMMAS}
            for g, env in shaped.items():
                dense, dense_info = play(env, seed, trajectory, strategy)
                assert dense_info["scaled_reward"] == info["scaled_reward"]
                returns[name]["shaped", g] = discounted(dense, g)
            # undiscounted, both modes return the episode's scaled reward
            assert returns[name]["shaped", 1.0] == pytest.approx(info["scaled_reward"], abs=1e-9)
            assert returns[name]["scaled", 1.0] == pytest.approx(info["scaled_reward"], abs=1e-12)
        broken = {name for name, info in final.items() if info["broken_rules"]}
        where = (task_id, force_decay, seed)
        assert {"at_once", "molars_up"} <= broken, (where, {n: final[n]["broken_rules"] for n in final})
        assert "nothing" not in broken and "uniform" not in broken, where
        safe = [name for name in final if name not in broken]
        for key in returns["nothing"]:
            assert returns["nothing"][key] == pytest.approx(0.0, abs=1e-12), (where, key)
            for breaker in broken:
                for other in safe:
                    assert returns[breaker][key] < returns[other][key], (where, key, breaker, other)
            # safe plans keep the terminal reward's order (gamma^23 x their scaled reward)
            for a in safe:
                gamma = key[1]
                assert returns[a][key] == pytest.approx(
                    gamma ** (N_STAGES - 1) * final[a]["scaled_reward"], abs=1e-9
                )
                for b in safe:
                    if final[a]["scaled_reward"] > final[b]["scaled_reward"] + 1e-9:
                        assert returns[a][key] > returns[b][key], (where, key, a, b)


def test_shaping_pays_the_discounted_potential_and_the_breach_when_it_happens():
    """Every tooth in aligner 1: the first step is charged the breach it makes (at most -0.25), not
    the 24th; a safe plan's shaped steps are ``gamma * Phi(s') - Phi(s)`` with the accuracy as Phi."""
    seed, gamma = 3_000_021, 0.9
    case = generate_case("task_easy", seed)
    env = gym.make(ENV_ID, task_id="task_easy", reward_mode="shaped", gamma=gamma)
    rewards, info = play(env, seed, _along(case, np.minimum(_STAGES, 1.0)), None)
    assert rewards[0] <= -0.25 and info["broken_rules"]
    env.reset(seed=0, options={"case_seed": seed})
    uniform = rollout_plans([normalize_plan(_UNIFORM)], [case])[0][0]
    potential = 0.0
    for stage in range(1, N_STAGES):
        _, reward, _, _, info = env.step(uniform[stage])
        accuracy = info["reward_breakdown"]["accuracy"]
        assert reward == pytest.approx(gamma * accuracy - potential, abs=1e-12)
        potential = accuracy
    assert potential > 0.9


def test_gamma_is_checked_and_the_previous_id_still_makes_the_env():
    for bad in (0.0, -0.5, 1.5, float("nan"), True, "0.9"):
        with pytest.raises(ValueError, match="gamma must be a discount"):
            gym.make(ENV_ID, gamma=bad)
    for env_id in PREVIOUS_ENV_IDS:
        env = gym.make(env_id, reward_mode="shaped", gamma=0.95)
        assert env.unwrapped.gamma == 0.95
        env.close()
