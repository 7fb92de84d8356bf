"""The Gymnasium face (:mod:`server.gym_env`): ``gymnasium.make("OrthoRL/AlignerStaging-v1", ...)``
passes Gymnasium's env checker; uniform SLERP and the oracle's plan played through the Gymnasium
API score what the environment scores them (its stepwise episode, bit for bit, and its whole-plan
scoring); the episode's return is the scaled reward the planners are judged on (a rule-breaker returns
less than doing nothing), dense or sparse; the vector env steps and resets as the single ones."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from server.cases import TASK_IDS, generate_case
from server.dental_constants import N_STAGES, TOOTH_IDS
from server.dental_environment import StepwiseDentalEnvironment
from server.gym_env import ENV_ID, AlignerStagingEnv
from server.oracle import oracle_plan
from server.plans import interpolate_poses, normalize_plan
from server.treatment import rollout_plans

UNIFORM_PLAN = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 1 / N_STAGES, "priority": "high"}]}


@pytest.mark.parametrize("task_id", TASK_IDS)
@pytest.mark.parametrize("force_decay", [False, True])
def test_make_passes_the_env_checker(task_id, force_decay):
    env = gym.make(ENV_ID, task_id=task_id, force_decay=force_decay)
    assert isinstance(env.unwrapped, AlignerStagingEnv) and env.spec.id == ENV_ID
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped, skip_render_check=True)
    assert [str(w.message) for w in caught] == []
    obs, _ = env.reset(seed=11)
    again, _ = env.reset(seed=11)
    assert all(np.array_equal(obs[k], again[k]) for k in obs) and obs in env.observation_space
    env.close()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="task_id must be one of"):
        gym.make(ENV_ID, task_id="task_impossible")
    env = gym.make(ENV_ID)
    with pytest.raises(ValueError, match="unknown reset options"):
        env.reset(options={"seed": 3})
    with pytest.raises(ValueError, match="strategy must be one of"):
        env.reset(options={"strategy": "all_at_once"})


def play(env: gym.Env, case_seed: int, trajectory: np.ndarray, strategy: str | None) -> tuple[list, dict]:
    """Rewards and the last info of an episode wearing ``trajectory[1..24]``."""
    obs, _ = env.reset(seed=0, options={"case_seed": case_seed, "strategy": strategy})
    assert np.allclose(obs["current_config"], trajectory[0], rtol=0, atol=1e-12)
    rewards = []
    for stage in range(1, N_STAGES + 1):
        obs, reward, terminated, truncated, info = env.step(trajectory[stage])
        rewards.append(reward)
        assert terminated == (stage == N_STAGES) and not truncated
    return rewards, info


@pytest.mark.parametrize(
    ("task_id", "force_decay"), [("task_easy", False), ("task_medium", True), ("task_hard", True)]
)
def test_uniform_slerp_and_the_oracle_score_as_the_environment_scores_them(task_id, force_decay):
    env = gym.make(ENV_ID, task_id=task_id, force_decay=force_decay, reward_mode="environment")
    scaled = {
        mode: gym.make(ENV_ID, task_id=task_id, force_decay=force_decay, reward_mode=mode)
        for mode in ("scaled", "shaped")
    }
    for case_seed in (2, 5):
        case = generate_case(task_id, case_seed, force_decay)
        oracle = oracle_plan(StepwiseDentalEnvironment().reset(task_id, case_seed, force_decay))
        for plan in (UNIFORM_PLAN, oracle):
            # the plan's aligners, as the whole-plan scoring rolls them out (its batch path)
            trajectory = rollout_plans([normalize_plan(plan)], [case])[0][0]
            rewards, info = play(env, case_seed, trajectory, plan.get("strategy"))
            # the environment's own stepwise episode of the same aligners
            store = StepwiseDentalEnvironment()
            eid = store.reset(task_id, case_seed, force_decay)["episode_id"]
            for stage in range(1, N_STAGES + 1):
                obs = store.step(eid, trajectory[stage], strategy=plan.get("strategy"))
                expected = obs["step_reward"] + (obs["terminal_reward"] if obs["done"] else 0.0)
                assert rewards[stage - 1] == expected  # bit for bit
            assert info["terminal_reward"] == obs["terminal_reward"]
            assert (
                info["reward_breakdown"] == obs["reward_breakdown"]
                and info["violations"] == obs["violations"]
            )
            # and the environment's scoring of the whole plan
            whole = store.score_plan(plan, task_id, case_seed, force_decay, case.non_compliance)
            assert info["terminal_reward"] == pytest.approx(whole["terminal_reward"], abs=1e-9)
            for name, value in whole["reward_breakdown"].items():
                assert info["reward_breakdown"][name] == pytest.approx(value, abs=1e-9), name
            assert info["scaled_reward"] == pytest.approx(whole["scaled_reward"], abs=1e-9)
            assert info["broken_rules"] == whole["broken_rules"] == []
            # the sparse and the shaped rewards return the scaled reward
            for mode, other in scaled.items():
                returns, last = play(other, case_seed, trajectory, plan.get("strategy"))
                assert sum(returns) == pytest.approx(whole["scaled_reward"], abs=1e-9), mode
                assert last["scaled_reward"] == info["scaled_reward"]
                if mode == "scaled":
                    assert returns[:-1] == [0.0] * (N_STAGES - 1)
                else:  # dense: the running accuracy's gains, then the rest on the last step
                    assert sum(r != 0 for r in returns[:-1]) > N_STAGES // 2
        assert oracle["strategy"] and info["terminal_reward"] > 0.5  # the oracle's plan scores well
    env.close()


def test_the_vector_env_steps_and_resets_as_the_single_ones():
    n = 3
    envs = gym.make_vec(
        ENV_ID, num_envs=n, vectorization_mode="sync", task_id="task_medium", force_decay=True
    )
    assert envs.single_action_space.shape == (28, 7) and envs.action_space.shape == (n, 28, 7)
    obs, infos = envs.reset(seed=[1, 2, 3])
    seeds = [int(s) for s in infos["case_seed"]]
    assert len(set(seeds)) == n
    totals = np.zeros(n)
    for stage in range(1, N_STAGES + 1):
        progress = np.full((1, 28), stage / N_STAGES)
        action = np.stack(
            [
                interpolate_poses(obs["initial_config"][i], obs["target_config"][i], progress)[0]
                for i in range(n)
            ]
        )
        obs, reward, terminated, truncated, infos = envs.step(action)
        totals += reward
        assert terminated.all() == (stage == N_STAGES) and not truncated.any()
    # the same cases through single envs: the same returns
    single = gym.make(ENV_ID, task_id="task_medium", force_decay=True)
    for i, seed in enumerate(seeds):
        case = generate_case("task_medium", seed, True)
        trajectory = interpolate_poses(
            case.initial, case.target, np.repeat((np.arange(N_STAGES + 1) / N_STAGES)[:, None], 28, 1)
        )
        rewards, _ = play(single, seed, trajectory, None)
        assert totals[i] == pytest.approx(sum(rewards), abs=1e-12)
    # next step: the finished sub-envs reset themselves (Gymnasium's next-step autoreset)
    obs, reward, terminated, _, _ = envs.step(action)
    assert (obs["stage"][:, 0] == 0).all() and (reward == 0).all() and not terminated.any()
    envs.close()


def test_a_rule_breaker_returns_less_than_doing_nothing():
    """Everything in the first aligner (limits and PDL broken) through the Gymnasium API: on the
    environment's raw score it returns more than doing nothing (the step rewards pay its accuracy);
    as the scaled reward it returns less than doing nothing, sparse or shaped, on every level."""
    for task_id in TASK_IDS:
        for mode in ("scaled", "shaped"):
            env = gym.make(ENV_ID, task_id=task_id, reward_mode=mode)
            for case_seed in (1_000_000, 1_000_001):
                case = generate_case(task_id, case_seed)
                at_once = np.concatenate([case.initial[None], np.repeat(case.target[None], N_STAGES, 0)])
                still = np.repeat(case.initial[None], N_STAGES + 1, 0)
                broke, info = play(env, case_seed, at_once, None)
                assert info["broken_rules"] and sum(broke) == pytest.approx(info["scaled_reward"], abs=1e-9)
                nothing, info = play(env, case_seed, still, None)
                assert info["broken_rules"] == [] and sum(nothing) == pytest.approx(0.0, abs=1e-9)
                assert sum(broke) < sum(nothing), (task_id, mode, case_seed)
    with pytest.raises(ValueError, match="reward_mode must be one of"):
        gym.make(ENV_ID, reward_mode="raw")
