"""The stepwise environment and its session store (docs/environment.md, "Python API" and "The server")."""

from __future__ import annotations

import copy
import json
import threading
import uuid

import numpy as np
import pytest

from server import cases as cases_module
from server.cases import TASK_IDS, generate_case
from server.collisions import contact_penetration_mm, penetration_mm
from server.dental_constants import N_STAGES, TOOTH_IDS, TOOTH_INDEX
from server.dental_environment import MAX_ROLLBACKS, StepwiseDentalEnvironment
from server.errors import InvalidActionError, StageConflictError, UnknownEpisodeError
from server.plans import normalize_plan
from server.treatment import rollout_plans

OBSERVATION_KEYS = {
    "episode_id",
    "task_id",
    "seed",
    "current_stage",
    "stages_remaining",
    "initial_config",
    "current_config",
    "target_config",
    "per_tooth_progress",
    "case_summary",
    "step_reward",
    "reward_breakdown",
    "terminal_reward",
    "done",
    "violations",
}


UNIFORM_SLERP = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 1 / N_STAGES}]}
"""Every tooth at an even pace through the 24 aligners: the plan ``planned_trajectory(None, ...)`` wears."""


def planned_trajectory(plan, task: str, seed: int, force_decay: bool = False) -> np.ndarray:
    """The aligner shapes (25, 28, 7) a plan means for a case."""
    planned, _ = rollout_plans([normalize_plan(plan)], [generate_case(task, seed, force_decay)])
    return planned[0]


def run_episode(env, episode_id: str, trajectory: np.ndarray, strategy=None) -> dict:
    obs = None
    for s in range(1, N_STAGES + 1):
        obs = env.step(episode_id, trajectory[s].tolist(), strategy=strategy)
    return obs


@pytest.fixture
def env() -> StepwiseDentalEnvironment:
    return StepwiseDentalEnvironment()


@pytest.fixture
def midway(env):
    """An episode at stage 2 of task_medium seed 4 (uniform SLERP poses) and its trajectory."""
    traj = planned_trajectory(None, "task_medium", 4)
    obs = env.reset("task_medium", 4)
    eid = obs["episode_id"]
    env.step(eid, traj[1].tolist())
    env.step(eid, traj[2].tolist())
    return env, eid, traj


# --- the contract -----------------------------------------------------------------------------------


def test_reset_observation_is_complete_and_json_safe(env):
    obs = env.reset("task_hard", 17, force_decay=True)
    assert set(obs) >= OBSERVATION_KEYS
    assert obs["current_stage"] == 0 and obs["stages_remaining"] == N_STAGES and obs["done"] is False
    assert obs["terminal_reward"] is None
    case = generate_case("task_hard", 17, True)
    assert np.array_equal(np.array(obs["initial_config"]), case.initial)
    assert np.array_equal(np.array(obs["current_config"]), case.initial)
    assert np.array_equal(np.array(obs["target_config"]), case.target)
    assert obs["case_summary"] == case.summary
    assert obs["violations"] == {"limits": 0, "collisions": 0, "pdl": 0}
    json.dumps(obs, allow_nan=False)


@pytest.mark.parametrize("task", TASK_IDS)
@pytest.mark.parametrize("force_decay", [False, True])
def test_stepping_uniform_slerp_gives_the_plan_score(env, task, force_decay):
    seed = 21
    traj = planned_trajectory(None, task, seed, force_decay)
    eid = env.reset(task, seed, force_decay)["episode_id"]
    rewards = []
    for s in range(1, N_STAGES + 1):
        obs = env.step(eid, traj[s].tolist())
        rewards.append(obs["step_reward"])
        assert obs["current_stage"] == s and obs["stages_remaining"] == N_STAGES - s
        assert obs["done"] is (s == N_STAGES)
        json.dumps(obs, allow_nan=False)
    plan = env.score_plan(UNIFORM_SLERP, task, seed, force_decay)
    assert obs["terminal_reward"] == pytest.approx(plan["terminal_reward"], abs=1e-9)
    assert obs["reward_breakdown"] == pytest.approx(plan["reward_breakdown"], abs=1e-9)
    assert obs["violations"]["limits"] == 0
    if not force_decay:
        assert np.allclose(np.array(obs["current_config"]), generate_case(task, seed).target, atol=1e-12)
        # the step rewards add up to the accuracy gained less 0.05 x the collision severity per stage
        b = obs["reward_breakdown"]
        penalty = 0.05 * N_STAGES * (1.0 - b["collision_free"])
        assert sum(rewards) == pytest.approx(b["accuracy"] - penalty, abs=1e-9)
        assert min(obs["per_tooth_progress"]["translation"]) == 1.0


def test_a_declared_strategy_reaches_the_terminal_score(env):
    traj = planned_trajectory(None, "task_easy", 3)
    eid = env.reset("task_easy", 3)["episode_id"]
    env.step(eid, traj[1].tolist(), strategy="distal_first")
    obs = run_episode_from(env, eid, traj, 2)
    plan = env.score_plan({**UNIFORM_SLERP, "strategy": "distal_first"}, "task_easy", 3)
    assert obs["terminal_reward"] == pytest.approx(plan["terminal_reward"], abs=1e-9)


def run_episode_from(env, eid, traj, first_stage):
    obs = None
    for s in range(first_stage, N_STAGES + 1):
        obs = env.step(eid, traj[s].tolist())
    return obs


def test_numpy_arrays_and_lists_are_the_same_action(env):
    traj = planned_trajectory(None, "task_easy", 9)
    a = env.reset("task_easy", 9)["episode_id"]
    b = env.reset("task_easy", 9)["episode_id"]
    obs_a = env.step(a, traj[1])
    obs_b = env.step(b, traj[1].tolist())
    assert obs_a["current_config"] == obs_b["current_config"]
    assert obs_a["step_reward"] == obs_b["step_reward"]


# --- bad input: refused, named, and the session is unchanged ----------------------------------------


def _with(traj_row: np.ndarray, tooth: int, field: int, value) -> list:
    rows = traj_row.tolist()
    rows[TOOTH_INDEX[tooth]][field] = value
    return rows


def _bad_poses(row: np.ndarray) -> list[tuple[str, object, tuple[str, ...]]]:
    zero_q = row.tolist()
    zero_q[TOOTH_INDEX[35]][:4] = [0.0, 0.0, 0.0, 0.0]
    short_row = row.tolist()
    short_row[TOOTH_INDEX[22]] = short_row[TOOTH_INDEX[22]][:6]
    return [
        ("nan", _with(row, 13, 5, float("nan")), ("13", "ty")),
        ("inf", _with(row, 46, 1, float("inf")), ("46", "qx")),
        ("-inf", _with(row, 27, 6, -float("inf")), ("27", "tz")),
        ("nan array", np.where(np.arange(7) == 4, np.nan, row)[:, :], ("11", "tx")),
        ("string value", _with(row, 31, 6, "1.0"), ("31", "tz")),
        ("None value", _with(row, 17, 0, None), ("17", "qw")),
        ("bool value", _with(row, 24, 4, True), ("24", "tx")),
        ("numpy bool value", _with(row, 24, 4, np.True_), ("24", "tx")),
        ("nested list value", _with(row, 12, 2, [0.0]), ("12", "qy")),
        ("zero quaternion", zero_q, ("35", "quaternion")),
        ("huge value", _with(row, 44, 4, 1e9), ("44", "tx")),
        ("short row", short_row, ("22",)),
        ("27 rows", row.tolist()[:27], ("28",)),
        ("29 rows", [*row.tolist(), row.tolist()[0]], ("28",)),
        ("transposed array", row.T.copy(), ("(28, 7)",)),
        ("28x6 array", row[:, :6].copy(), ("(28, 7)",)),
        ("28x7x1 array", row[..., None].copy(), ("(28, 7)",)),
        ("flat list", row.ravel().tolist(), ()),
        ("empty list", [], ("28",)),
        ("string", "poses", ()),
        ("None", None, ()),
        ("dict", {"11": row[0].tolist()}, ()),
        ("bool array", np.ones((28, 7), dtype=bool), ("bool",)),
        ("string array", row.astype(str), ()),
        ("object array", row.astype(object), ()),
    ]


def test_bad_poses_are_refused_naming_the_tooth_and_field_and_change_nothing(midway):
    env, eid, traj = midway
    before = env.state(eid)
    for name, poses, needles in _bad_poses(traj[3]):
        for method in (env.step, env.simulate_step, env.commit_stage):
            with pytest.raises(InvalidActionError) as info:
                method(eid, poses)
            message = str(info.value)
            for needle in needles:
                assert needle in message, f"{name}: {needle!r} not in {message!r}"
        assert env.state(eid) == before, name
    with pytest.raises(InvalidActionError):
        env.check_collisions(eid, _with(traj[3], 13, 5, float("nan")))
    # the session still works
    assert env.step(eid, traj[3].tolist())["current_stage"] == 3


@pytest.mark.parametrize("strategy", ["fastest", "", "EXPANSION_FIRST", 3, True, ["anterior_first"]])
def test_unknown_strategy_is_refused_and_changes_nothing(midway, strategy):
    env, eid, traj = midway
    before = env.state(eid)
    with pytest.raises(InvalidActionError, match="strategy"):
        env.step(eid, traj[3].tolist(), strategy=strategy)
    assert env.state(eid) == before


@pytest.mark.parametrize("episode_id", ["nope", "", "0" * 32, None, 123, b"bytes"])
def test_unknown_episode_ids_are_refused_by_every_call(env, episode_id):
    live = env.reset("task_easy", 1)["episode_id"]
    before = env.state(live)
    row = planned_trajectory(None, "task_easy", 1)[1].tolist()
    calls = [
        lambda: env.step(episode_id, row),
        lambda: env.simulate_step(episode_id, row),
        lambda: env.commit_stage(episode_id, row),
        lambda: env.rollback_stage(episode_id),
        lambda: env.state(episode_id),
        lambda: env.inspect_tooth(episode_id, 11),
        lambda: env.check_collisions(episode_id),
    ]
    for call in calls:
        with pytest.raises(UnknownEpisodeError):
            call()
    assert env.state(live) == before


def test_stepping_after_done_is_refused_and_changes_nothing(env):
    traj = planned_trajectory(None, "task_easy", 2)
    eid = env.reset("task_easy", 2)["episode_id"]
    done = run_episode(env, eid, traj)
    assert done["done"] and done["terminal_reward"] is not None
    before = env.state(eid)
    assert before == done
    for method in (env.step, env.simulate_step):
        with pytest.raises(InvalidActionError, match="done"):
            method(eid, traj[-1].tolist())
    assert env.state(eid) == before


@pytest.mark.parametrize(
    "kwargs",
    [
        {"task_id": "task_impossible", "seed": 0},
        {"task_id": None, "seed": 0},
        {"task_id": "task_easy", "seed": -1},
        {"task_id": "task_easy", "seed": "7"},
        {"task_id": "task_easy", "seed": True},
        {"task_id": "task_easy", "seed": 0, "force_decay": "yes"},
        {"task_id": "task_easy", "seed": 0, "episode_id": ""},
        {"task_id": "task_easy", "seed": 0, "episode_id": "x" * 129},
        {"task_id": "task_easy", "seed": 0, "episode_id": 5},
    ],
)
def test_bad_reset_is_refused_and_creates_nothing(env, kwargs):
    env.reset("task_easy", 0, episode_id="keep")
    before = env.state("keep")
    with pytest.raises(InvalidActionError):
        env.reset(**kwargs)
    assert len(env.sessions) == 1
    assert env.state("keep") == before


def test_unknown_task_message_lists_the_tasks(env):
    with pytest.raises(InvalidActionError, match="task_easy"):
        env.reset("task_extreme", 0)


@pytest.mark.parametrize("tooth", [99, 18, True, "11", None, 11.5])
def test_inspect_tooth_refuses_unknown_teeth(midway, tooth):
    env, eid, _ = midway
    with pytest.raises(InvalidActionError):
        env.inspect_tooth(eid, tooth)


def test_inspect_tooth_and_check_collisions_change_nothing(midway):
    env, eid, _ = midway
    before = env.state(eid)
    info = env.inspect_tooth(eid, 21)
    assert info["tooth_id"] == 21 and info["current_stage"] == 2
    assert info["current_pose"] == before["current_config"][TOOTH_INDEX[21]]
    case = generate_case("task_medium", 4)
    assert env.check_collisions(eid, case.target.tolist())["collision_free"] is True
    assert env.check_collisions(eid)["severity"] >= 0.0
    assert env.state(eid) == before


# --- simulate_step and rollback -----------------------------------------------------------------------


def test_simulate_step_changes_nothing_and_predicts_step(midway):
    env, eid, _ = midway
    before = env.state(eid)
    jump = generate_case("task_medium", 4).target.tolist()  # over the limits
    predicted = env.simulate_step(eid, jump, strategy="expansion_first")
    assert predicted["current_stage"] == 3
    assert env.state(eid) == before
    again = env.simulate_step(eid, jump, strategy="expansion_first")
    assert again == predicted
    committed = env.step(eid, jump, strategy="expansion_first")
    assert committed == predicted
    assert committed["violations"]["limits"] > 0


def test_simulating_the_last_stage_does_not_finish_the_episode(env):
    traj = planned_trajectory(None, "task_easy", 5)
    eid = env.reset("task_easy", 5)["episode_id"]
    for s in range(1, N_STAGES):
        env.step(eid, traj[s].tolist())
    before = env.state(eid)
    predicted = env.simulate_step(eid, traj[N_STAGES].tolist())
    assert predicted["done"] and predicted["terminal_reward"] is not None
    assert env.state(eid) == before and before["done"] is False
    assert env.step(eid, traj[N_STAGES].tolist()) == predicted


def test_rollback_restores_the_previous_stage_and_the_violation_counters(env):
    traj = planned_trajectory(None, "task_hard", 6)
    case = generate_case("task_hard", 6)
    eid = env.reset("task_hard", 6)["episode_id"]
    env.step(eid, traj[1].tolist())
    at_one = env.state(eid)
    bad = env.step(eid, case.target.tolist())  # jumps: limits (and PDL) violations
    assert bad["violations"]["limits"] > 0 and bad["violations"]["pdl"] > 0
    back = env.rollback_stage(eid)
    assert back["current_stage"] == 1
    assert back["violations"] == at_one["violations"] == {"limits": 0, "collisions": 0, "pdl": 0}
    assert back["current_config"] == at_one["current_config"]
    assert env.state(eid) == at_one
    # the rolled-back stage is gone: the rest of a uniform episode matches a clean one
    final = run_episode_from(env, eid, traj, 2)
    clean = env.reset("task_hard", 6)["episode_id"]
    assert final["terminal_reward"] == run_episode(env, clean, traj)["terminal_reward"]
    assert final["violations"] == {"limits": 0, "collisions": 0, "pdl": 0}


def test_rollback_is_limited_to_two(env):
    traj = planned_trajectory(None, "task_easy", 8)
    eid = env.reset("task_easy", 8)["episode_id"]
    with pytest.raises(InvalidActionError, match="stage 0"):
        env.rollback_stage(eid)
    for s in range(1, 5):
        env.step(eid, traj[s].tolist())
    for expected in range(3, 3 - MAX_ROLLBACKS, -1):
        assert env.rollback_stage(eid)["current_stage"] == expected
    before = env.state(eid)
    with pytest.raises(InvalidActionError, match="limit"):
        env.rollback_stage(eid)
    assert env.state(eid) == before
    # stepping again after rollbacks does not restore the allowance
    env.step(eid, traj[3].tolist())
    with pytest.raises(InvalidActionError):
        env.rollback_stage(eid)


def test_rollback_after_done_is_refused_so_the_terminal_is_paid_once(env):
    traj = planned_trajectory(None, "task_easy", 4)
    eid = env.reset("task_easy", 4)["episode_id"]
    done = run_episode(env, eid, traj)
    assert done["done"] and done["terminal_reward"] is not None
    # reopening aligner 24 would pay the terminal reward again (up to MAX_ROLLBACKS more times)
    with pytest.raises(InvalidActionError, match="done"):
        env.rollback_stage(eid)
    assert env.state(eid) == done
    with pytest.raises(InvalidActionError, match="done"):
        env.step(eid, traj[-1].tolist())


# --- episode ids and the store ----------------------------------------------------------------------------


def test_episode_ids_are_uuid4_hex_and_never_collide():
    env = StepwiseDentalEnvironment(max_sessions=5000)
    ids = [env.reset("task_easy", s % 7)["episode_id"] for s in range(2000)]
    assert len(set(ids)) == len(ids)
    for eid in ids[:50]:
        assert len(eid) == 32 and eid == eid.lower()
        assert uuid.UUID(hex=eid).version == 4
    # each id names its own episode
    assert env.state(ids[3])["seed"] == 3 and env.state(ids[4])["seed"] == 4


def test_a_given_episode_id_is_used_and_a_reset_replaces_it(env):
    obs = env.reset("task_easy", 1, episode_id="mine")
    assert obs["episode_id"] == "mine"
    env.reset("task_hard", 2, episode_id="mine")
    assert env.state("mine")["task_id"] == "task_hard"
    assert len(env.sessions) == 1


def test_environments_do_not_share_sessions():
    a, b = StepwiseDentalEnvironment(), StepwiseDentalEnvironment()
    eid = a.reset("task_easy", 1)["episode_id"]
    with pytest.raises(UnknownEpisodeError):
        b.state(eid)


def test_the_store_is_bounded_by_an_lru_cap():
    env = StepwiseDentalEnvironment(max_sessions=3)
    a, b, c = (env.reset("task_easy", s)["episode_id"] for s in range(3))
    env.state(a)  # a is now the most recently used
    d = env.reset("task_easy", 3)["episode_id"]
    assert len(env.sessions) == 3
    with pytest.raises(UnknownEpisodeError, match=r"evicted.*at most 3") as evicted:
        env.state(b)
    assert evicted.value.reason == "evicted"
    assert [env.state(x)["seed"] for x in (a, c, d)] == [0, 2, 3]
    env.close_episode(a)
    with pytest.raises(UnknownEpisodeError, match="closed") as closed:
        env.state(a)
    assert closed.value.reason == "closed"
    for s in range(10):
        env.reset("task_easy", s)
    assert len(env.sessions) == 3


def test_sessions_expire_after_the_ttl():
    now = [1000.0]
    env = StepwiseDentalEnvironment(ttl_seconds=10.0, clock=lambda: now[0])
    row = planned_trajectory(None, "task_easy", 0)[1].tolist()
    a = env.reset("task_easy", 0)["episode_id"]
    now[0] += 5.0
    b = env.reset("task_easy", 1)["episode_id"]
    now[0] += 4.0
    env.step(a, row)  # a used at t+9
    now[0] += 7.0  # t+16: b idle 11 s > 10, a idle 7 s
    with pytest.raises(UnknownEpisodeError, match="expired") as expired:
        env.step(b, row)
    assert expired.value.reason == "expired"
    assert env.state(a)["current_stage"] == 1
    assert len(env.sessions) == 1
    now[0] += 10.5
    with pytest.raises(UnknownEpisodeError):
        env.state(a)
    assert len(env.sessions) == 0


@pytest.mark.parametrize("kwargs", [{"max_sessions": 0}, {"ttl_seconds": 0.0}, {"ttl_seconds": float("nan")}])
def test_store_bounds_must_be_positive(kwargs):
    with pytest.raises(ValueError):
        StepwiseDentalEnvironment(**kwargs)


# --- threads ------------------------------------------------------------------------------------------------

THREAD_EPISODES = [
    ("task_easy", 1, False, None),
    ("task_easy", 2, True, {"tooth_groups": [{"teeth": [11, 21], "fraction": 0.5}]}),
    ("task_medium", 3, False, {"strategy": "anterior_first"}),
    ("task_medium", 4, True, None),
    (
        "task_hard",
        5,
        False,
        {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 0.1, "priority": "medium"}]},
    ),
    ("task_hard", 6, True, None),
    ("task_hard", 7, False, {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 0.0}]}),
    (
        "task_medium",
        8,
        False,
        {"tooth_groups": [{"teeth": [13, 23, 33, 43], "fraction": 1.0, "priority": "low"}]},
    ),
]


def _play(env, eid, traj, strategy) -> dict:
    for s in range(1, N_STAGES + 1):
        env.simulate_step(eid, traj[s].tolist())
        env.state(eid)
        obs = env.step(eid, traj[s].tolist(), strategy=strategy if s == 1 else None)
    return obs


def test_eight_threads_get_exactly_the_sequential_results():
    trajectories = [planned_trajectory(p, t, s, fd) for t, s, fd, p in THREAD_EPISODES]
    strategies = [p.get("strategy") if isinstance(p, dict) else None for *_, p in THREAD_EPISODES]

    sequential_env = StepwiseDentalEnvironment()
    expected = []
    for (task, seed, fd, _), traj, strat in zip(THREAD_EPISODES, trajectories, strategies):
        eid = sequential_env.reset(task, seed, fd)["episode_id"]
        expected.append(_play(sequential_env, eid, traj, strat))

    env = StepwiseDentalEnvironment()
    ids = [env.reset(t, s, fd)["episode_id"] for t, s, fd, _ in THREAD_EPISODES]
    results: list[dict | None] = [None] * len(ids)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(ids))

    def worker(k: int) -> None:
        try:
            barrier.wait()
            results[k] = _play(env, ids[k], trajectories[k], strategies[k])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for k, (got, want) in enumerate(zip(results, expected)):
        assert got is not None, k
        assert got["terminal_reward"] == want["terminal_reward"], (k, THREAD_EPISODES[k])
        assert got["current_config"] == want["current_config"], (k, THREAD_EPISODES[k])
        assert got["reward_breakdown"] == want["reward_breakdown"], (k, THREAD_EPISODES[k])
        assert got["violations"] == want["violations"], (k, THREAD_EPISODES[k])
        assert got["task_id"] == THREAD_EPISODES[k][0] and got["seed"] == THREAD_EPISODES[k][1]


def test_concurrent_steps_on_one_episode_never_skip_or_double_a_stage():
    env = StepwiseDentalEnvironment()
    traj = planned_trajectory(None, "task_medium", 11)
    eid = env.reset("task_medium", 11)["episode_id"]
    stages: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        for _ in range(3):
            obs = env.step(eid, traj[1].tolist())
            with lock:
                stages.append(obs["current_stage"])

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(stages) == list(range(1, N_STAGES + 1))
    assert env.state(eid)["done"] is True


@pytest.fixture
def isolated_episode():
    """An episode of a case no other test uses; the case cache is cleared afterwards, so a
    corrupted cached case cannot leak into other tests."""
    env = StepwiseDentalEnvironment()
    traj = planned_trajectory(None, "task_medium", 777_777)
    eid = env.reset("task_medium", 777_777)["episode_id"]
    env.step(eid, traj[1].tolist())
    yield env, eid
    cases_module.clear_case_cache()


@pytest.mark.parametrize(
    "path",
    [
        ("current_config", 0, 0),
        ("initial_config", 0, 0),
        ("target_config", 0, 0),
        ("per_tooth_progress", "translation", 0),
        ("case_summary", "overjet_mm"),
        ("violations", "limits"),
        ("reward_breakdown", "accuracy"),
    ],
)
def test_mutating_an_observation_does_not_change_the_session(isolated_episode, path):
    """An in-process caller that edits an observation must not corrupt the episode (or the case cache)."""
    env, eid = isolated_episode
    obs = env.state(eid)
    snapshot = copy.deepcopy(obs)
    node = obs
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = 123.0
    after = env.state(eid)
    fresh = env.reset("task_medium", 777_777)
    assert after == snapshot, f"observation{list(path)} aliases the session's state"
    assert fresh["case_summary"] == snapshot["case_summary"], (
        f"observation{list(path)} aliases the cached case"
    )
    assert fresh["initial_config"] == snapshot["initial_config"]


def test_forgotten_episode_ids_are_bounded():
    env = StepwiseDentalEnvironment(max_sessions=2)
    env.sessions.max_forgotten = 5
    ids = [env.reset("task_easy", s)["episode_id"] for s in range(12)]
    assert len(env.sessions) == 2 and len(env.sessions._forgotten) == 5
    with pytest.raises(UnknownEpisodeError) as old:
        env.state(ids[0])  # forgotten too long ago: plain unknown
    assert old.value.reason == "unknown"
    with pytest.raises(UnknownEpisodeError) as recent:
        env.state(ids[9])
    assert recent.value.reason == "evicted"


def test_expected_stage_refuses_a_duplicated_step():
    env = StepwiseDentalEnvironment()
    obs = env.reset("task_easy", 0)
    row = planned_trajectory(None, "task_easy", 0)[1].tolist()
    env.step(obs["episode_id"], row, expected_stage=0)
    with pytest.raises(StageConflictError) as conflict:
        env.step(obs["episode_id"], row, expected_stage=0)
    assert conflict.value.current_stage == 1 and env.state(obs["episode_id"])["current_stage"] == 1


def test_one_arch_penetration_is_bit_identical_to_the_general_path() -> None:
    """The stepwise hot path's one-arch penetration gives the batch function's bits (the
    episode's rewards and the plan scorer's stay equal), coinciding centroids included."""
    rng = np.random.default_rng(14)
    for task_id in TASK_IDS:
        for seed in range(8):
            case = generate_case(task_id, seed, seed % 2 == 1)
            width, depth = case.crown_width_mm, case.crown_depth_mm
            for k in range(12):
                s = k / 11
                poses = (1 - s) * case.initial + s * case.target + rng.normal(0.0, 0.2 * (k % 3), (28, 7))
                poses[:, :4] /= np.linalg.norm(poses[:, :4], axis=1, keepdims=True)
                if k == 5:
                    poses[6, 4:6] = poses[5, 4:6]  # two centroids at one place
                fast = contact_penetration_mm(poses, case.contacts)
                assert fast.tobytes() == penetration_mm(poses, width, depth).tobytes()
