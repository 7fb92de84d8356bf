"""The HTTP/WebSocket app over a real uvicorn on 127.0.0.1 (free port, background thread).

Covers: OpenEnv's own client over ``/ws`` (one episode to done, several clients at once,
session capacity), the episode routes over plain HTTP (reset, step to done, simulate,
rollback, inspect, collisions, plan scoring), bad input (NaN/Infinity as raw JSON text,
wrong shapes, strings and booleans as numbers, unknown and expired episode ids,
oversized bodies) answered with a 4xx naming the problem, bounded and never quoting the
input, and leaving the session unchanged; the episode life cycle (DELETE, ``expected_stage``
409s for duplicated and out-of-order steps, the 404 of an evicted episode); a bounded
schemathesis run over the app's OpenAPI (``not_a_server_error``); and the hot path's shortcuts
giving the same answers (the observation encoder's bytes, the action's pose array, the HTTP
fast step against the route). Load and misuse of the
WebSocket sessions: ``tests/test_server_sessions.py``.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
import websockets
from openenv.core.generic_client import GenericEnvClient
from websockets.sync.client import connect as ws_connect

from server.app import build_app
from server.dental_constants import N_STAGES, N_TEETH, TOOTH_IDS
from server.dental_environment import StepwiseDentalEnvironment
from server.json_values import NonFiniteOutputError
from server.reward_scaler import REWARD_MIN
from server.serving.fast_path import EpisodeFastPath
from server.serving.models import DentalAction
from server.serving.serialization import ObservationEncoder, encode_json, observation_payload
from tests.services import running_uvicorn

# --- Server fixtures ----------------------------------------------------------------


@pytest.fixture(scope="module")
def uvicorn_server() -> Iterator[str]:
    """Base URL of the app (default settings: 1 MB body limit) on a free loopback port."""
    with running_uvicorn(build_app(max_sessions=16, max_body_bytes=1_000_000)) as url:
        yield url


@pytest.fixture(scope="module")
def http(uvicorn_server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=uvicorn_server, timeout=60, trust_env=False) as client:
        yield client


# --- Helpers ------------------------------------------------------------------------


def interpolated_poses(obs: dict[str, Any], stage: int) -> list[list[float]]:
    """Poses of ``stage`` on the straight line initial -> target (quaternions normalised)."""
    initial = np.asarray(obs["initial_config"], dtype=float)
    target = np.asarray(obs["target_config"], dtype=float).copy()
    flip = np.sum(initial[:, :4] * target[:, :4], axis=1) < 0
    target[flip, :4] *= -1.0
    t = stage / N_STAGES
    poses = (1.0 - t) * initial + t * target
    poses[:, :4] /= np.linalg.norm(poses[:, :4], axis=1, keepdims=True)
    return poses.tolist()


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def new_episode(http: httpx.Client, **body: Any) -> dict[str, Any]:
    response = http.post("/episodes", json={"task_id": "task_easy", "seed": 3, **body})
    assert response.status_code == 200, response.text
    return response.json()


def post_raw(http: httpx.Client, path: str, text: str) -> httpx.Response:
    return http.post(path, content=text.encode(), headers={"content-type": "application/json"})


def stage_of(http: httpx.Client, episode_id: str) -> int:
    response = http.get(f"/episodes/{episode_id}")
    assert response.status_code == 200, response.text
    return response.json()["current_stage"]


def run_openenv_episode(base_url: str, task_id: str, seed: int) -> tuple[Any, list[Any]]:
    client = GenericEnvClient(base_url=base_url, message_timeout_s=120).sync()
    with client:
        result = client.reset(task_id=task_id, seed=seed)
        first = result.observation
        results = []
        for stage in range(1, N_STAGES + 1):
            result = client.step({"poses": interpolated_poses(first, stage)})
            results.append(result)
        state = client.state()
    return first, [*results, state]


# --- OpenEnv client over /ws ----------------------------------------------------------


def test_openenv_client_runs_an_episode_to_done(uvicorn_server: str) -> None:
    first, results = run_openenv_episode(uvicorn_server, "task_easy", seed=1)
    *steps, state = results
    assert first["current_stage"] == 0 and len(first["initial_config"]) == N_TEETH
    assert [r.done for r in steps] == [False] * (N_STAGES - 1) + [True]
    assert [r.observation["current_stage"] for r in steps] == list(range(1, N_STAGES + 1))
    last = steps[-1]
    assert finite(last.observation["terminal_reward"])
    assert finite(last.reward)
    assert all(finite(r.reward) for r in steps)
    assert all(r.observation["terminal_reward"] is None for r in steps[:-1])
    assert state["episode_id"] == first["episode_id"]
    assert state["current_stage"] == N_STAGES and state["done"] is True


def test_several_openenv_clients_at_once(uvicorn_server: str) -> None:
    jobs = [("task_easy", 11), ("task_medium", 12), ("task_hard", 13), ("task_easy", 14)]
    outcomes: dict[int, Any] = {}

    def worker(i: int, task_id: str, seed: int) -> None:
        try:
            outcomes[i] = run_openenv_episode(uvicorn_server, task_id, seed)
        except BaseException as exc:  # reported below
            outcomes[i] = exc

    threads = [threading.Thread(target=worker, args=(i, *job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(outcomes) == len(jobs)
    episode_ids = set()
    for i, (task_id, seed) in enumerate(jobs):
        outcome = outcomes[i]
        assert not isinstance(outcome, BaseException), repr(outcome)
        first, results = outcome
        steps = results[:-1]
        assert first["task_id"] == task_id and first["seed"] == seed
        assert steps[-1].done and finite(steps[-1].observation["terminal_reward"])
        assert {r.observation["episode_id"] for r in steps} == {first["episode_id"]}
        episode_ids.add(first["episode_id"])
    assert len(episode_ids) == len(jobs)


def _ws_url(base_url: str) -> str:
    return base_url.replace("http://", "ws://") + "/ws"


def _ws_call(ws: Any, message: dict[str, Any] | str) -> dict[str, Any]:
    ws.send(message if isinstance(message, str) else json.dumps(message))
    return json.loads(ws.recv(timeout=60))


def test_websocket_bad_steps_keep_the_session(uvicorn_server: str) -> None:
    with ws_connect(_ws_url(uvicorn_server), open_timeout=10) as ws:
        before = _ws_call(ws, {"type": "step", "data": {"poses": [[1.0, 0, 0, 0, 0, 0, 0]] * N_TEETH}})
        assert before["type"] == "error" and "reset" in before["data"]["message"]

        reply = _ws_call(ws, {"type": "reset", "data": {"task_id": "task_medium", "seed": 5}})
        assert reply["type"] == "observation", reply
        obs = reply["data"]["observation"]
        poses = interpolated_poses(obs, 1)
        nan_text = json.dumps({"type": "step", "data": {"poses": poses}}).replace(
            json.dumps(poses[2][5]), "NaN", 1
        )
        bad_messages: list[dict[str, Any] | str] = [
            nan_text,
            {"type": "step", "data": {"poses": poses[:-1]}},
            {"type": "step", "data": {"poses": [p[:6] for p in poses]}},
            {"type": "step", "data": {"poses": [[str(v) for v in p] for p in poses]}},
            {"type": "step", "data": {"poses": [[True] * 7] * N_TEETH}},
            {"type": "step", "data": {"poses": poses, "strategy": 3}},
            {"type": "step", "data": {"poses": poses, "bogus": 1}},
            {"type": "reset", "data": {"task_id": "no_such_task"}},
            {"type": "reset", "data": {"seed": "7"}},
            "{not json",
        ]
        for message in bad_messages:
            reply = _ws_call(ws, message)
            assert reply["type"] == "error", (message, reply)
            assert reply["data"].get("message"), reply
        state = _ws_call(ws, {"type": "state"})
        assert state["type"] == "state" and state["data"]["current_stage"] == 0
        assert state["data"]["episode_id"] == obs["episode_id"]
        reply = _ws_call(ws, {"type": "step", "data": {"poses": poses, "strategy": "expansion_first"}})
        assert reply["type"] == "observation", reply
        assert reply["data"]["observation"]["current_stage"] == 1


def test_websocket_session_capacity() -> None:
    with running_uvicorn(build_app(max_sessions=2)) as url:
        with contextlib.ExitStack() as stack:
            for _ in range(2):
                ws = stack.enter_context(ws_connect(_ws_url(url), open_timeout=10))
                assert _ws_call(ws, {"type": "reset", "data": {"seed": 1}})["type"] == "observation"
            with ws_connect(_ws_url(url), open_timeout=10) as third:
                reply = json.loads(third.recv(timeout=10))
                assert reply["type"] == "error" and reply["data"]["code"] == "CAPACITY_REACHED"
                assert (
                    reply["data"]["max_sessions"] == 2 and "ORTHORL_MAX_SESSIONS" in reply["data"]["message"]
                )
                third.send(json.dumps({"type": "reset"}))  # read, then closed: 1013 (try again later)
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    third.recv(timeout=10)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013
                assert "ORTHORL_MAX_SESSIONS" in closed.value.rcvd.reason
        deadline = time.monotonic() + 10
        while True:  # the slots come back once the connections are gone
            with ws_connect(_ws_url(url), open_timeout=10) as ws:
                reply = _ws_call(ws, {"type": "reset", "data": {"seed": 2}})
            if reply["type"] == "observation" or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert reply["type"] == "observation", reply


# --- Episode routes over plain HTTP ----------------------------------------------------


def test_http_episode_to_done_with_tools(http: httpx.Client) -> None:
    obs = new_episode(http, task_id="task_medium", seed=7)
    episode_id = obs["episode_id"]
    assert obs["current_stage"] == 0 and obs["stages_remaining"] == N_STAGES
    assert obs["done"] is False and obs["terminal_reward"] is None
    assert http.get(f"/episodes/{episode_id}").json()["current_stage"] == 0

    simulated = http.post(f"/episodes/{episode_id}/simulate", json={"poses": interpolated_poses(obs, 1)})
    assert simulated.status_code == 200, simulated.text
    assert stage_of(http, episode_id) == 0

    collisions = http.post(f"/episodes/{episode_id}/collisions")
    assert collisions.status_code == 200, collisions.text
    report = collisions.json()
    assert isinstance(report["collision_free"], bool) and isinstance(report["pairs"], list)
    collisions = http.post(f"/episodes/{episode_id}/collisions", json={"poses": obs["target_config"]})
    assert collisions.status_code == 200 and collisions.json()["collision_free"] is True

    tooth = http.get(f"/episodes/{episode_id}/teeth/{TOOTH_IDS[0]}")
    assert tooth.status_code == 200, tooth.text
    assert isinstance(tooth.json(), dict)
    for bad_tooth in (19, 30, 48):
        response = http.get(f"/episodes/{episode_id}/teeth/{bad_tooth}")
        assert response.status_code == 422, response.text
        assert response.json()["detail"]
    assert http.get(f"/episodes/{episode_id}/teeth/eleven").status_code == 422

    rollback = http.post(f"/episodes/{episode_id}/rollback")
    assert rollback.status_code == 422 and rollback.json()["detail"]  # nothing to undo at stage 0

    stage, rolled_back = 0, False
    while stage < N_STAGES:
        stage += 1
        response = http.post(f"/episodes/{episode_id}/step", json={"poses": interpolated_poses(obs, stage)})
        assert response.status_code == 200, response.text
        current = response.json()
        assert current["current_stage"] == stage
        if stage == 3 and not rolled_back:
            rolled = http.post(f"/episodes/{episode_id}/rollback")
            assert rolled.status_code == 200, rolled.text
            assert rolled.json()["current_stage"] == 2
            stage, rolled_back = 2, True
    assert current["done"] is True and finite(current["terminal_reward"])
    assert all(finite(v) for v in current["reward_breakdown"].values())
    again = http.post(f"/episodes/{episode_id}/step", json={"poses": interpolated_poses(obs, N_STAGES)})
    assert again.status_code == 422 and again.json()["detail"]
    assert stage_of(http, episode_id) == N_STAGES


def test_http_strategy_and_tasks(http: httpx.Client) -> None:
    tasks = http.get("/tasks")
    assert tasks.status_code == 200
    assert [t["task_id"] for t in tasks.json()["tasks"]] == ["task_easy", "task_medium", "task_hard"]
    obs = new_episode(http)
    response = http.post(
        f"/episodes/{obs['episode_id']}/step",
        json={"poses": interpolated_poses(obs, 1), "strategy": "expansion_first"},
    )
    assert response.status_code == 200, response.text
    assert http.get("/health").json()["status"] == "healthy"
    schema = http.get("/schema").json()
    assert "poses" in schema["action"]["properties"]


def test_plan_scoring(http: httpx.Client) -> None:
    plan = {
        "strategy": "expansion_first",
        "tooth_groups": [
            {"teeth": [14, 15, 24, 25], "fraction": 0.08, "priority": "high"},
            {"teeth": [11, 12, 21, 22], "fraction": 0.06, "priority": "medium"},
        ],
    }
    scores = []
    for body in (
        {"plan": plan, "task_id": "task_medium", "seed": 4},
        {"plan": json.dumps(plan), "task_id": "task_medium", "seed": 4},
        {
            "plan": {"tooth_groups": [{"teeth": [True, 99, "x"], "fraction": 7, "priority": 1}]},
            "task_id": "task_easy",
            "seed": 4,
        },
        {"plan": "not a plan at all", "task_id": "task_hard", "seed": 4, "force_decay": True},
    ):
        response = http.post("/plans/score", json=body)
        assert response.status_code == 200, (body, response.text)
        result = response.json()
        assert finite(result["terminal_reward"]), result
        assert all(finite(v) for v in result["reward_breakdown"].values())
        assert isinstance(result["format"], dict)
        scores.append(result["terminal_reward"])
        plan_sent = body["task_id"] == "task_medium"
        assert (result["not_a_plan"] is None) is plan_sent, result  # the last two are not plans
        assert (result["scaled_reward"] == REWARD_MIN) is not plan_sent, result
    assert scores[0] == scores[1]  # text and object forms of one plan score the same
    # a non-finite fraction inside a plan is ignored (counted by the format score), never a crash
    text = json.dumps({"plan": plan, "task_id": "task_medium", "seed": 4}).replace("0.08", "NaN")
    response = post_raw(http, "/plans/score", text)
    assert response.status_code < 500, response.text
    if response.status_code == 200:
        assert finite(response.json()["terminal_reward"])
    for bad in (
        {"task_id": "task_easy", "seed": 4},
        {"plan": plan, "task_id": "task_x", "seed": 4},
        {"plan": plan, "task_id": "task_easy", "seed": -1},
        {"plan": plan, "task_id": "task_easy", "seed": 2**63},
        {"plan": plan, "seed": 4},
        {"plan": 3, "task_id": "task_easy", "seed": 4},
    ):
        response = http.post("/plans/score", json=bad)
        assert response.status_code == 422, (bad, response.text)


# --- Bad input over HTTP --------------------------------------------------------------


def _bad_step_bodies(poses: list[list[float]]) -> list[tuple[str, str, str]]:
    """(name, raw JSON text, a word the reason must contain)."""
    good = json.dumps({"poses": poses})
    value = json.dumps(poses[3][4])
    cases = [
        ("nan", good.replace(value, "NaN", 1), "finite"),
        ("infinity", good.replace(value, "Infinity", 1), "finite"),
        ("minus_infinity", good.replace(value, "-Infinity", 1), "finite"),
        ("overflow", good.replace(value, "1e400", 1), "finite"),
        ("27_teeth", json.dumps({"poses": poses[:-1]}), "28"),
        ("29_teeth", json.dumps({"poses": [*poses, poses[0]]}), "28"),
        ("6_numbers", json.dumps({"poses": [p[:6] for p in poses]}), "7"),
        ("8_numbers", json.dumps({"poses": [[*p, 0.0] for p in poses]}), "7"),
        ("flat", json.dumps({"poses": [v for p in poses for v in p]}), "list"),
        ("strings", json.dumps({"poses": [[str(v) for v in p] for p in poses]}), "number"),
        ("booleans", json.dumps({"poses": [[True] * 7 for _ in poses]}), "number"),
        ("one_boolean", good.replace(value, "false", 1), "number"),
        ("null_number", good.replace(value, "null", 1), "number"),
        ("null_poses", json.dumps({"poses": None}), "list"),
        ("missing_poses", json.dumps({"strategy": "expansion_first"}), "poses"),
        ("extra_field", json.dumps({"poses": poses, "extra": 1}), "extra"),
        ("strategy_number", json.dumps({"poses": poses, "strategy": 5}), "strategy"),
        ("not_json", "{'poses': nope", "json"),
        ("empty", "", "body"),
        ("array_body", json.dumps([poses]), "object"),
    ]
    return cases


def test_bad_step_bodies_are_refused_with_a_reason(http: httpx.Client) -> None:
    obs = new_episode(http, seed=21)
    episode_id = obs["episode_id"]
    ok = http.post(f"/episodes/{episode_id}/step", json={"poses": interpolated_poses(obs, 1)})
    assert ok.status_code == 200
    poses = interpolated_poses(obs, 2)
    for name, text, word in _bad_step_bodies(poses):
        for route in ("step", "simulate"):
            response = post_raw(http, f"/episodes/{episode_id}/{route}", text)
            assert response.status_code == 422, (name, route, response.text)
            detail = response.json()["detail"]
            assert isinstance(detail, str) and word.lower() in detail.lower(), (name, detail)
        assert stage_of(http, episode_id) == 1, name
    response = http.post(
        f"/episodes/{episode_id}/step",
        content=b'{"poses": "\xff\xfe"}',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 422 and "UTF-8" in response.json()["detail"], response.text
    nan = post_raw(http, f"/episodes/{episode_id}/step", _bad_step_bodies(poses)[0][1]).json()["detail"]
    assert f"tooth {TOOTH_IDS[3]}" in nan and "tx" in nan  # names the tooth and field
    assert http.get("/health").status_code == 200
    assert http.post(f"/episodes/{episode_id}/step", json={"poses": poses}).json()["current_stage"] == 2


def test_non_physical_poses_are_refused_by_the_env(http: httpx.Client) -> None:
    obs = new_episode(http, seed=22)
    episode_id = obs["episode_id"]
    zero_quaternion = interpolated_poses(obs, 1)
    zero_quaternion[5][:4] = [0.0, 0.0, 0.0, 0.0]
    huge = interpolated_poses(obs, 1)
    huge[0][4] = 1e308
    for poses in (zero_quaternion, huge):
        response = http.post(f"/episodes/{episode_id}/step", json={"poses": poses})
        assert response.status_code in (200, 422), response.text
        if response.status_code == 200:  # accepted: the outputs must still be finite
            assert all(finite(v) for v in response.json()["reward_breakdown"].values())
            assert http.post(f"/episodes/{episode_id}/rollback").status_code == 200
        else:
            assert response.json()["detail"]
        assert stage_of(http, episode_id) == 0
    assert http.get("/health").status_code == 200


def test_collisions_of_coinciding_teeth_are_finite(http: httpx.Client) -> None:
    obs = new_episode(http, seed=24)
    poses = [list(p) for p in obs["target_config"]]
    poses[1][4:6] = poses[0][4:6]  # teeth 12 and 11 at the same place
    response = http.post(f"/episodes/{obs['episode_id']}/collisions", json={"poses": poses})
    assert response.status_code == 200, response.text
    assert response.json()["collision_free"] is False


def test_non_compliance_option(http: httpx.Client, uvicorn_server: str) -> None:
    """task_hard's non-compliance over the episode routes, the plan route and OpenEnv's client."""
    obs = new_episode(http, task_id="task_hard", seed=9, non_compliance=True)
    assert obs["non_compliance"] is True and obs["task_id"] == "task_hard"
    assert new_episode(http, task_id="task_hard", seed=9)["non_compliance"] is False
    refused = http.post("/episodes", json={"task_id": "task_easy", "seed": 9, "non_compliance": True})
    assert refused.status_code == 422 and "task_hard" in refused.json()["detail"], refused.text
    uniform = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 1 / 24, "priority": "high"}]}
    scored = [
        http.post(
            "/plans/score", json={"plan": uniform, "task_id": "task_hard", "seed": 9, "non_compliance": flag}
        )
        for flag in (False, True)
    ]
    assert all(r.status_code == 200 for r in scored), [r.text for r in scored]
    assert scored[0].json()["reward_breakdown"] != scored[1].json()["reward_breakdown"]
    client = GenericEnvClient(base_url=uvicorn_server, message_timeout_s=120).sync()
    with client:
        first = client.reset(task_id="task_hard", seed=9, non_compliance=True).observation
        assert first["non_compliance"] is True
        assert client.state()["non_compliance"] is True


def test_bad_reset_bodies(http: httpx.Client) -> None:
    for body in (
        {"task_id": "task_x"},
        {"task_id": 1},
        {"seed": -1},
        {"seed": "3"},
        {"seed": True},
        {"seed": 1.5},
        {"seed": 2**63},
        {"force_decay": "yes"},
        {"non_compliance": 1},
        {"task_id": "task_medium", "non_compliance": True},
        {"episode_id": "mine"},
    ):
        response = http.post("/episodes", json=body)
        assert response.status_code == 422, (body, response.text)
        assert response.json()["detail"]
    assert post_raw(http, "/episodes", '{"seed": NaN}').status_code == 422
    assert http.post("/episodes").status_code == 200  # every field has a default


def test_unknown_episode_ids_are_404(http: httpx.Client) -> None:
    poses = [[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * N_TEETH
    for episode_id in ("0" * 32, "no-such-episode", "%20"):
        for method, path, body in (
            ("GET", "", None),
            ("POST", "/step", {"poses": poses}),
            ("POST", "/simulate", {"poses": poses}),
            ("POST", "/rollback", None),
            ("POST", "/collisions", None),
            ("GET", "/teeth/11", None),
        ):
            response = http.request(method, f"/episodes/{episode_id}{path}", json=body)
            assert response.status_code == 404, (episode_id, path, response.text)
            assert isinstance(response.json()["detail"], str) and response.json()["detail"]


def test_expired_episode_is_404() -> None:
    app = build_app(episode_ttl_s=0.3)
    with running_uvicorn(app) as url, httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        obs = new_episode(client)
        assert stage_of(client, obs["episode_id"]) == 0
        time.sleep(0.5)
        response = client.get(f"/episodes/{obs['episode_id']}")
        assert response.status_code == 404 and response.json()["detail"], response.text
        response = client.post(
            f"/episodes/{obs['episode_id']}/step", json={"poses": interpolated_poses(obs, 1)}
        )
        assert response.status_code == 404, response.text


def test_oversized_bodies(http: httpx.Client) -> None:
    obs = new_episode(http, seed=23)
    episode_id = obs["episode_id"]
    big = json.dumps({"poses": interpolated_poses(obs, 1), "strategy": "x" * 1_100_000})
    response = post_raw(http, f"/episodes/{episode_id}/step", big)
    assert response.status_code == 413, response.text
    assert "too large" in response.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while reading
        yield b'{"poses": [' + b"[1.0, 0, 0, 0, 0, 0, 0]," * 20_000
        for _ in range(20):
            yield b"[1.0, 0, 0, 0, 0, 0, 0]," * 5_000
        yield b"[1.0, 0, 0, 0, 0, 0, 0]]}"

    response = http.post(
        f"/episodes/{episode_id}/step", content=chunks(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 413, response.text
    assert "too large" in response.json()["detail"]
    response = http.post("/plans/score", json={"plan": "y" * 1_200_000})
    assert response.status_code == 413
    assert stage_of(http, episode_id) == 0
    assert http.get("/health").status_code == 200


def test_openenv_http_routes_refuse_bad_input(http: httpx.Client) -> None:
    reset = http.post("/reset", json={"task_id": "task_hard", "seed": 2})
    assert reset.status_code == 200, reset.text
    assert reset.json()["observation"]["task_id"] == "task_hard"
    for body in ({"task_id": "task_x"}, {"seed": -3}, {"unknown_param": 1}, {"force_decay": 1}):
        response = http.post("/reset", json=body)
        assert response.status_code == 422, (body, response.text)
    poses = interpolated_poses(reset.json()["observation"], 1)
    text = json.dumps({"action": {"poses": poses}}).replace(json.dumps(poses[0][0]), "NaN", 1)
    response = post_raw(http, "/step", text)
    assert response.status_code == 422 and "finite" in response.json()["detail"], response.text
    response = http.post("/step", json={"action": {"poses": poses[:3]}})
    assert response.status_code == 422 and "28" in response.json()["detail"], response.text
    response = http.post("/step", json={"action": {"poses": poses}})
    assert response.status_code == 409 and "reset" in response.json()["detail"]  # stateless /step
    assert http.get("/state").status_code == 200
    assert http.get("/health").status_code == 200


def test_openapi_points_step_at_the_action_schema(http: httpx.Client) -> None:
    spec = http.get("/openapi.json").json()
    components = spec["components"]["schemas"]
    ref = components["StepRequest"]["properties"]["action"]["$ref"]
    action = components[ref.rsplit("/", 1)[1]]
    poses = action["properties"]["poses"]
    assert poses["minItems"] == N_TEETH and poses["maxItems"] == N_TEETH
    assert "task_id" in components["ResetRequest"]["properties"]
    paths = set(spec["paths"])
    for path in (
        "/episodes",
        "/episodes/{episode_id}",
        "/episodes/{episode_id}/step",
        "/episodes/{episode_id}/simulate",
        "/episodes/{episode_id}/rollback",
        "/episodes/{episode_id}/collisions",
        "/episodes/{episode_id}/teeth/{tooth_id}",
        "/plans/score",
        "/tasks",
        "/health",
        "/schema",
        "/reset",
        "/step",
    ):
        assert path in paths, path


# --- Fuzzing --------------------------------------------------------------------------


def test_schemathesis_finds_no_server_error(uvicorn_server: str, http: httpx.Client) -> None:
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.checks import not_a_server_error

    def no_server_error(ctx: Any, response: Any, case: Any) -> bool | None:
        return not_a_server_error(ctx, response, case)

    schema = schemathesis.openapi.from_url(f"{uvicorn_server}/openapi.json")
    live = new_episode(http, seed=31)["episode_id"]
    fuzz_settings = settings(
        max_examples=25,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12
    started = time.monotonic()
    n_runs = 0
    for operation in operations:
        path_params = {p.name for p in operation.path_parameters}
        variants: list[dict[str, Any]] = [{}]
        if "episode_id" in path_params:
            variants.append({"path_parameters": {"episode_id": live}})
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            for extra in variants:
                strategy = operation.as_strategy(generation_mode=mode, **extra)

                @fuzz_settings
                @given(case=strategy)
                def check(case: Any) -> None:
                    case.call_and_validate(base_url=uvicorn_server, checks=[no_server_error])

                try:
                    check()
                except Unsatisfiable:
                    # nothing to negate (e.g. GET /health has no parameters)
                    assert mode == schemathesis.GenerationMode.NEGATIVE, operation.label
                    continue
                n_runs += 1
    assert n_runs >= len(operations) + 8
    assert time.monotonic() - started < 120
    assert http.get("/health").status_code == 200


# --- Episode life cycle over HTTP: close, ordering, eviction ---------------------------------


def test_http_delete_closes_an_episode(http: httpx.Client) -> None:
    obs = new_episode(http, seed=41)
    episode_id = obs["episode_id"]
    closed = http.delete(f"/episodes/{episode_id}")
    assert closed.status_code == 200 and closed.json() == {"episode_id": episode_id, "closed": True}
    for method, path, body in (
        ("GET", "", None),
        ("POST", "/step", {"poses": interpolated_poses(obs, 1)}),
        ("DELETE", "", None),
    ):
        response = http.request(method, f"/episodes/{episode_id}{path}", json=body)
        assert response.status_code == 404, response.text
        assert response.json()["reason"] == "closed" and "was closed" in response.json()["detail"]
    unknown = http.delete("/episodes/" + "0" * 32)
    assert unknown.status_code == 404 and unknown.json()["reason"] == "unknown"


def test_http_duplicate_and_stale_steps_get_409_and_are_not_applied(http: httpx.Client) -> None:
    obs = new_episode(http, seed=42)
    episode_id = obs["episode_id"]
    step = {"poses": interpolated_poses(obs, 1), "expected_stage": 0}
    first = http.post(f"/episodes/{episode_id}/step", json=step)
    assert first.status_code == 200 and first.json()["current_stage"] == 1
    again = http.post(f"/episodes/{episode_id}/step", json=step)  # a retried (duplicated) request
    assert again.status_code == 409, again.text
    assert again.json()["current_stage"] == 1 and "expected_stage=1" in again.json()["detail"]
    ahead = http.post(
        f"/episodes/{episode_id}/step", json={"poses": interpolated_poses(obs, 3), "expected_stage": 2}
    )
    assert ahead.status_code == 409 and stage_of(http, episode_id) == 1
    assert http.post(f"/episodes/{episode_id}/rollback?expected_stage=0").status_code == 409
    assert http.post(f"/episodes/{episode_id}/rollback?expected_stage=1").json()["current_stage"] == 0
    for bad in (-1, 25, "1", 1.5, True):
        response = http.post(f"/episodes/{episode_id}/step", json={**step, "expected_stage": bad})
        assert response.status_code == 422 and "expected_stage" in response.json()["detail"], (
            bad,
            response.text,
        )
    assert stage_of(http, episode_id) == 0


def test_http_concurrent_steps_in_any_order_apply_each_stage_once(http: httpx.Client) -> None:
    """24 concurrent requests, one per stage; each is applied only at its stage (else 409 and
    sent again), so the episode ends exactly as the sequential one."""
    obs = new_episode(http, task_id="task_medium", seed=43)
    reference = StepwiseDentalEnvironment()
    ref_obs = reference.reset("task_medium", 43)
    for stage in range(1, N_STAGES + 1):
        ref_obs = reference.step(ref_obs["episode_id"], interpolated_poses(obs, stage))
    episode_id = obs["episode_id"]
    conflicts = [0]

    def send(stage: int) -> dict[str, Any]:
        body = {"poses": interpolated_poses(obs, stage), "expected_stage": stage - 1}
        deadline = time.monotonic() + 60
        with httpx.Client(base_url=str(http.base_url), timeout=30, trust_env=False) as client:
            while True:
                response = client.post(f"/episodes/{episode_id}/step", json=body)
                if response.status_code == 200:
                    return response.json()
                assert response.status_code == 409, response.text
                assert response.json()["current_stage"] != stage - 1
                conflicts[0] += 1
                assert time.monotonic() < deadline
                time.sleep(0.005)

    with ThreadPoolExecutor(max_workers=N_STAGES) as pool:
        results = list(pool.map(send, range(N_STAGES, 0, -1)))  # the last stage first
    assert sorted(r["current_stage"] for r in results) == list(range(1, N_STAGES + 1))
    final = http.get(f"/episodes/{episode_id}").json()
    assert final["terminal_reward"] == ref_obs["terminal_reward"]
    assert final["reward_breakdown"] == ref_obs["reward_breakdown"]
    assert conflicts[0] > 0  # some did arrive out of order and were refused


def test_an_evicted_episode_says_so() -> None:
    app = build_app(max_episodes=3)
    with running_uvicorn(app) as url, httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        first = new_episode(client)["episode_id"]
        for seed in range(3):
            new_episode(client, seed=seed)
        response = client.get(f"/episodes/{first}")
        assert response.status_code == 404 and response.json()["reason"] == "evicted", response.text
        assert "evicted" in response.json()["detail"] and "at most 3" in response.json()["detail"]
        assert client.get("/status").json()["episodes"] == {"live": 3, "max_episodes": 3, "ttl_s": 3600.0}


def test_http_error_replies_are_bounded_and_do_not_echo(http: httpx.Client) -> None:
    obs = new_episode(http, seed=44)
    marker = "ECHO-MARKER-91c2"
    poses = interpolated_poses(obs, 1)
    for body in (
        {"poses": marker * 60_000},  # 960 kB string
        {"poses": [[marker] * 7] * N_TEETH},
        {"poses": poses, marker * 1000: 1},
        {"poses": [[*p, marker] for p in poses]},
    ):
        response = http.post(f"/episodes/{obs['episode_id']}/step", json=body)
        assert response.status_code == 422, response.text[:300]
        assert len(response.content) < 4000 and marker not in response.text, response.text[:300]
    assert stage_of(http, obs["episode_id"]) == 0


# --- The hot path (the server's time per step): the same answers, cheaper ----------------------


def test_observation_encoder_writes_the_bytes_of_encode_json() -> None:
    """Whole episodes (every task, force decay, non-compliance, rollback, simulate, state, an
    episode id reused for another case, two episodes of one case): the encoder's bytes are
    encode_json's, frame and bare."""

    def check(obs: dict[str, Any]) -> None:
        assert encoder.encode(obs) == encode_json(obs)
        frame = encode_json({"type": "observation", "data": observation_payload(obs)}).decode()
        assert encoder.frame(obs) == frame

    env = StepwiseDentalEnvironment()
    encoder = ObservationEncoder(max_cases=2)
    for task_id, seed, decay, non_compliance in (
        ("task_easy", 1, False, False),
        ("task_medium", 2, True, False),
        ("task_hard", 3, False, True),
        ("task_hard", 3, False, False),
    ):
        obs = env.reset(task_id, seed, decay, non_compliance=non_compliance, episode_id="reused")
        other = env.reset(task_id, seed, decay, non_compliance=non_compliance)["episode_id"]
        first = obs
        check(obs)
        for stage in range(1, N_STAGES + 1):
            poses = interpolated_poses(first, stage)
            check(env.simulate_step("reused", poses))
            check(env.step("reused", poses, expected_stage=stage - 1))
            check(env.step(other, interpolated_poses(first, min(stage + 1, N_STAGES))))
            if stage == 5:
                check(env.rollback_stage("reused"))
                check(env.step("reused", poses))
            check(env.state("reused"))
    assert len(encoder) == 2  # at most max_cases kept
    fresh = ObservationEncoder()
    for field in ("initial_config", "current_config"):
        broken = env.reset("task_easy", 4)
        broken[field][3][4] = math.nan
        with pytest.raises(NonFiniteOutputError, match=rf"{field}\[3\]\[4\]"):
            fresh.encode(broken)
    assert len(fresh) == 1 and "initial_config" not in fresh._cache[("task_easy", 4, False, False)]
    check(env.reset("task_easy", 4))
    no_case = {k: v for k, v in obs.items() if k != "seed"}
    assert encoder.encode(no_case) == encode_json(no_case)


def test_poses_array_holds_the_values_of_np_array() -> None:
    env = StepwiseDentalEnvironment()
    poses = interpolated_poses(env.reset("task_medium", 5), 3)
    ints = [[round(v) if j >= 4 else v for j, v in enumerate(row)] for row in poses]
    extremes = [[*row[:4], 1e6, -1e6, 5e-324] for row in poses]
    for rows in (poses, ints, extremes):
        action = DentalAction.model_validate({"poses": rows})
        array = action.poses_array()
        assert array.dtype == np.float64 and array.shape == (N_TEETH, 7)
        assert array.tobytes() == np.array(action.poses, dtype=np.float64).tobytes()
        assert array.tobytes() == np.array(rows, dtype=np.float64).tobytes()


def test_http_fast_path_answers_as_the_routes_and_refusals_are_the_apps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Resets, well-formed steps and closes are answered by EpisodeFastPath with the routes'
    bytes; what it does not take (another content type, a chunked body, a refused request)
    gets the app's own answer."""
    answered: list[str] = []
    original = EpisodeFastPath._answer

    def counting(self: EpisodeFastPath, what: str, *args: Any) -> Any:
        response = original(self, what, *args)
        if response is not None:
            answered.append(what)
        return response

    def post(client: httpx.Client, path: str, body: Any, routed: bool = False) -> httpx.Response:
        # "; charset=utf-8" is not taken by the fast path: the route answers
        content_type = "application/json; charset=utf-8" if routed else "application/json"
        return client.post(path, content=json.dumps(body).encode(), headers={"content-type": content_type})

    monkeypatch.setattr(EpisodeFastPath, "_answer", counting)
    app = build_app()
    with running_uvicorn(app) as url, httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
        case = {"task_id": "task_hard", "seed": 8}
        fast_start = post(client, "/episodes", case)
        assert answered == ["reset"] and fast_start.status_code == 200, fast_start.text
        start = post(client, "/episodes", case, routed=True)
        assert answered == ["reset"] and start.status_code == 200, start.text
        fast_id, route_id = fast_start.json()["episode_id"], start.json()["episode_id"]
        assert fast_start.content == start.content.replace(route_id.encode(), fast_id.encode())
        default = client.post("/episodes", content=b"", headers={"content-type": "application/json"})
        assert answered[-1] == "reset" and default.json()["task_id"] == "task_easy"
        start = start.json()
        for stage in range(1, N_STAGES + 1):
            body = {"poses": interpolated_poses(start, stage), "expected_stage": stage - 1}
            fast = post(client, f"/episodes/{fast_id}/step", body)
            assert answered[-1] == "step" and fast.status_code == 200, fast.text
            n = len(answered)
            routed = post(client, f"/episodes/{route_id}/step", body, routed=True)
            assert len(answered) == n and routed.status_code == 200, routed.text
            assert fast.content == routed.content.replace(route_id.encode(), fast_id.encode())
            assert fast.headers["content-type"] == routed.headers["content-type"] == "application/json"
        assert answered.count("step") == N_STAGES
        n = len(answered)
        again = post(client, f"/episodes/{fast_id}/step", body)
        assert again.status_code == 409 and again.json()["current_stage"] == N_STAGES  # the app's 409
        done = post(client, f"/episodes/{fast_id}/step", {"poses": interpolated_poses(start, 1)})
        assert done.status_code == 422 and "done" in done.json()["detail"]
        gone = post(client, "/episodes/nope/step", {"poses": interpolated_poses(start, 1)})
        assert gone.status_code == 404 and gone.json()["reason"] == "unknown"
        bad_reset = post(client, "/episodes", {"task_id": "task_none"})
        assert bad_reset.status_code == 422 and "task_id" in bad_reset.json()["detail"]
        assert len(answered) == n  # all of those answered by the app
        chunked_id = new_episode(client, task_id="task_hard", seed=8)["episode_id"]
        body = json.dumps({"poses": interpolated_poses(start, 1)}).encode()
        chunked = client.post(
            f"/episodes/{chunked_id}/step",
            content=iter([body[:100], body[100:]]),
            headers={"content-type": "application/json"},
        )
        assert chunked.status_code == 200 and chunked.json()["current_stage"] == 1
        assert answered[-1] == "reset"  # the chunked step was the app's
        closed = client.delete(f"/episodes/{fast_id}")
        assert answered[-1] == "close" and closed.status_code == 200
        assert closed.content == encode_json({"episode_id": fast_id, "closed": True})
        n = len(answered)
        again = client.delete(f"/episodes/{fast_id}")
        assert again.status_code == 404 and again.json()["reason"] == "closed" and len(answered) == n


def test_encode_json_refuses_every_non_finite_number_after_its_null_scan() -> None:
    """encode_json trusts orjson's text when it has no more ``null`` than the object's shallow
    ``None``s; a NaN/inf anywhere (whatever else is null) is still refused, naming its path."""
    assert (
        encode_json({"a": None, "b": [None, 1.0], "c": {"d": None}})
        == b'{"a":null,"b":[null,1.0],"c":{"d":null}}'
    )
    assert encode_json({"s": "null", "x": [1.0]}) == b'{"s":"null","x":[1.0]}'
    for bad in (math.nan, math.inf, -math.inf):
        for obj, path in (
            ({"a": None, "x": [[1.0, bad]]}, r"x\[0\]\[1\]"),
            ({"s": "null", "x": {"y": bad}}, r"x\.y"),
            ({"a": None, "b": [None], "x": bad}, "at x"),
            ([None, bad], r"\[1\]"),
            ({"x": np.array([1.0, bad])}, r"x\[1\]"),
        ):
            with pytest.raises(NonFiniteOutputError, match=path):
                encode_json(obj)
