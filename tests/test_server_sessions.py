"""The environment server under load and misuse, on 127.0.0.1 (bounded in count and time).

* 64 concurrent WebSocket episodes give exactly the sequential in-process observations;
* OpenEnv's own client at capacity + 1 reads a refusal naming the capacity and how to raise it;
* 200 abrupt disconnects are all reclaimed, with nothing logged at error level;
* idle and frozen (SIGSTOP) sessions are reaped: closed, uncounted, the cap never exceeded;
* every malformed frame gets a bounded error reply that does not echo it, and the session
  goes on; one message-size limit under any uvicorn frame limit;
* a real server restart (uvicorn CLI, then ``python -m server.app``): the training client
  reports the lost episode, then reconnects; no traceback in the server's log for normal,
  client-side or abrupt closes;
* ``--workers 2`` is refused at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import websockets
from openenv.core.generic_client import GenericEnvClient
from websockets.sync.client import connect as ws_connect

from orthojob.agentic.env_client import DentalEnvClient, EnvSession, EpisodeLostError, ServerUnavailableError
from server.app import build_app, requested_workers
from server.dental_constants import N_STAGES
from server.dental_environment import StepwiseDentalEnvironment
from server.serving.settings import ENV_VARIABLES, MAX_ERROR_CHARS, ServerSettings, SettingsError
from tests.services import free_port, running_uvicorn, start_server_process

N_EPISODES = 64
TASKS = ("task_easy", "task_medium", "task_hard")


# --- Helpers ------------------------------------------------------------------------


def ws_url(base_url: str) -> str:
    return base_url.replace("http://", "ws://") + "/ws"


def plan_poses(obs: dict[str, Any], stage: int, wobble: float) -> list[list[float]]:
    """Stage ``stage`` of the straight line initial -> target, translations off by ``wobble`` mm
    (so the episodes differ); quaternions normalised."""
    initial = np.asarray(obs["initial_config"], dtype=float)
    target = np.asarray(obs["target_config"], dtype=float).copy()
    target[np.sum(initial[:, :4] * target[:, :4], axis=1) < 0, :4] *= -1.0
    t = stage / N_STAGES
    poses = (1.0 - t) * initial + t * target
    poses[:, :4] /= np.linalg.norm(poses[:, :4], axis=1, keepdims=True)
    poses[:, 4] += wobble * np.sin(stage)
    return poses.tolist()


def episode_case(i: int) -> tuple[str, int, bool, float]:
    """(task_id, seed, force_decay, wobble) of load episode ``i``."""
    return TASKS[i % 3], 100 + i, i % 4 == 1, 0.05 * (i % 5)


def sequential_episode(i: int) -> list[dict[str, Any]]:
    """Episode ``i`` in-process: its 25 observations (reset + 24 steps), without episode_id."""
    task_id, seed, force_decay, wobble = episode_case(i)
    env = StepwiseDentalEnvironment()
    obs = env.reset(task_id, seed, force_decay)
    first, out = obs, [obs]
    for stage in range(1, N_STAGES + 1):
        out.append(env.step(obs["episode_id"], plan_poses(first, stage, wobble)))
    return [{k: v for k, v in o.items() if k not in ("episode_id", "done")} for o in out]


def status(base_url: str) -> dict[str, Any]:
    return httpx.get(f"{base_url}/status", timeout=10, trust_env=False).json()


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def _default_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests state their settings: none leak in from the environment."""
    for variable in [*ENV_VARIABLES.values(), "ORTHORL_MAX_BODY_BYTES", "WEB_CONCURRENCY"]:
        monkeypatch.delenv(variable, raising=False)


class ErrorRecords(logging.Handler):
    """Log records at WARNING and above, or carrying a traceback, from every logger."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING or record.exc_info:
            self.records.append(record)


@pytest.fixture
def error_records() -> Iterator[ErrorRecords]:
    handler = ErrorRecords()
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "server"))]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield handler
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


# --- Load: 64 concurrent episodes -------------------------------------------------------


async def _ws_episode(base_url: str, i: int, peak: list[int], app: Any) -> list[dict[str, Any]]:
    task_id, seed, force_decay, wobble = episode_case(i)
    client = DentalEnvClient(base_url, message_timeout_s=60)
    async with client:
        result = await client.reset(task_id=task_id, seed=seed, force_decay=force_decay)
        first, out = result.observation, [result.observation]
        for stage in range(1, N_STAGES + 1):
            peak[0] = max(peak[0], app.state.websocket_sessions.live)
            result = await client.step(
                {"poses": plan_poses(first, stage, wobble), "expected_stage": stage - 1}
            )
            out.append(result.observation)
        assert result.done and result.reward == pytest.approx(
            result.observation["step_reward"] + result.observation["terminal_reward"]
        )
    return [{k: v for k, v in o.items() if k != "episode_id"} for o in out]


def test_64_concurrent_websocket_episodes_equal_the_sequential_results(error_records: ErrorRecords) -> None:
    app = build_app()  # default settings: capacity 256
    assert app.state.websocket_sessions.max_sessions == 256
    peak = [0]
    with running_uvicorn(app) as url:

        async def run_all() -> list[Any]:
            return await asyncio.gather(*(_ws_episode(url, i, peak, app) for i in range(N_EPISODES)))

        started = time.monotonic()
        served = asyncio.run(run_all())
        elapsed = time.monotonic() - started
        wait_until(lambda: status(url)["websocket_sessions"]["live"] == 0, 10, "sessions released")
        final = status(url)
    assert peak[0] > 32, f"the episodes did not overlap (peak {peak[0]} sessions)"
    for i, observations in enumerate(served):
        assert observations == sequential_episode(i), f"episode {i} differs from the in-process run"
    assert final["episodes"]["live"] == 0, final  # every episode released with its session
    assert final["websocket_sessions"]["accepted"] == N_EPISODES
    assert not error_records.records, [r.getMessage() for r in error_records.records]
    print(f"64 concurrent episodes in {elapsed:.1f} s ({N_EPISODES / elapsed:.0f} episodes/s, one process)")


# --- Capacity -------------------------------------------------------------------------


def test_openenv_client_at_capacity_plus_one_reads_why() -> None:
    cap = 3
    app = build_app(max_sessions=cap)
    with running_uvicorn(app) as url:
        holders = [GenericEnvClient(base_url=url, message_timeout_s=30).sync() for _ in range(cap)]
        try:
            for holder in holders:
                holder.connect()
                assert holder.reset(seed=1).observation["current_stage"] == 0
            for attempt in range(10):  # OpenEnv's sync client, as a trainer would use it
                extra = GenericEnvClient(base_url=url, message_timeout_s=30).sync()
                with pytest.raises(RuntimeError) as refused:
                    extra.connect()
                    extra.reset(seed=2)
                extra.close()
                message = str(refused.value)
                assert "CAPACITY_REACHED" in message, (attempt, message)
                assert f"all {cap} WebSocket sessions" in message and "ORTHORL_MAX_SESSIONS" in message

            async def async_tries() -> list[str]:  # and its async client
                messages = []
                for _ in range(10):
                    client = GenericEnvClient(base_url=url, message_timeout_s=30)
                    try:
                        async with client:
                            await client.reset(seed=3)
                    except RuntimeError as exc:
                        messages.append(str(exc))
                return messages

            messages = asyncio.run(async_tries())
            assert len(messages) == 10 and all(
                "CAPACITY_REACHED" in m and "ORTHORL_MAX_SESSIONS" in m for m in messages
            )
            current = status(url)["websocket_sessions"]
            assert current["live"] == cap and current["refused_at_capacity"] == 20
        finally:
            holders[0].close()
        wait_until(lambda: status(url)["websocket_sessions"]["live"] == cap - 1, 10, "a slot freed")
        client = GenericEnvClient(base_url=url, message_timeout_s=30).sync()
        with client:  # the freed slot is usable
            assert client.reset(seed=4).observation["seed"] == 4
        for holder in holders[1:]:
            holder.close()


# --- Abrupt disconnects ---------------------------------------------------------------


def test_200_abrupt_disconnects_are_reclaimed(error_records: ErrorRecords) -> None:
    app = build_app()
    with running_uvicorn(app) as url:

        async def abrupt(i: int) -> None:
            ws = await websockets.connect(ws_url(url), open_timeout=30)
            await ws.send(json.dumps({"type": "reset", "data": {"seed": i}}))
            reply = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert reply["type"] == "observation"
            if i % 2:
                await ws.send(
                    json.dumps(
                        {"type": "step", "data": {"poses": reply["data"]["observation"]["target_config"]}}
                    )
                )
            ws.transport.abort()  # no close frame: a TCP reset, as a killed trainer leaves it

        async def run() -> None:
            for batch in range(4):
                await asyncio.gather(*(abrupt(50 * batch + k) for k in range(50)))

        asyncio.run(run())
        wait_until(lambda: status(url)["websocket_sessions"]["live"] == 0, 15, "200 sessions reclaimed")
        final = status(url)
        assert final["websocket_sessions"]["accepted"] == 200
        assert final["episodes"]["live"] == 0, final  # every episode released
    assert not error_records.records, [r.getMessage() for r in error_records.records]


# --- Idle and frozen sessions ------------------------------------------------------------

FROZEN_CLIENT = """
import json, sys
from websockets.sync.client import connect
ws = connect(sys.argv[1], open_timeout=30)
ws.send(json.dumps({"type": "reset", "data": {"seed": 5}}))
assert json.loads(ws.recv(timeout=30))["type"] == "observation"
print("ready", flush=True)
sys.stdin.readline()  # frozen here (SIGSTOP), then resumed
try:
    print("got", json.loads(ws.recv(timeout=10))["data"]["code"], flush=True)
    ws.recv(timeout=10)
except Exception as exc:
    print("closed", getattr(getattr(exc, "rcvd", None), "code", type(exc).__name__), flush=True)
"""


def test_idle_and_frozen_sessions_are_reaped() -> None:
    idle_s = 2.0  # long enough that neither is reaped before both are counted, on a loaded machine
    app = build_app(max_sessions=2, ws_idle_timeout_s=idle_s)
    with running_uvicorn(app) as url, contextlib.ExitStack() as stack:
        frozen = subprocess.Popen(
            [sys.executable, "-c", FROZEN_CLIENT, ws_url(url)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert frozen.stdout.readline().strip() == "ready"
            os.kill(frozen.pid, signal.SIGSTOP)
            silent = stack.enter_context(ws_connect(ws_url(url), open_timeout=10))  # connects, never sends
            assert status(url)["websocket_sessions"]["live"] == 2
            with ws_connect(ws_url(url), open_timeout=10) as third:  # full
                assert json.loads(third.recv(timeout=10))["data"]["code"] == "CAPACITY_REACHED"
            started = time.monotonic()
            wait_until(
                lambda: status(url)["websocket_sessions"]["live"] == 0, idle_s + 5, "idle sessions reaped"
            )
            assert time.monotonic() - started < idle_s + 3
            counters = status(url)
            assert counters["websocket_sessions"]["reaped_idle"] == 2 and counters["episodes"]["live"] == 0
            # the silent client is told why, then closed (1001); it cannot go on
            notice = json.loads(silent.recv(timeout=5))
            assert (
                notice["data"]["code"] == "IDLE_TIMEOUT"
                and "ORTHORL_WS_IDLE_TIMEOUT_S" in notice["data"]["message"]
            )
            with pytest.raises(websockets.ConnectionClosed) as closed:
                silent.recv(timeout=5)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
            # the freed slots serve new clients, and never more than the cap at once
            with ws_connect(ws_url(url), open_timeout=10) as a, ws_connect(ws_url(url), open_timeout=10) as b:
                for ws in (a, b):
                    ws.send(json.dumps({"type": "reset", "data": {"seed": 6}}))
                    assert json.loads(ws.recv(timeout=10))["type"] == "observation"
                assert status(url)["websocket_sessions"]["live"] == 2
            os.kill(frozen.pid, signal.SIGCONT)  # the frozen client wakes to a closed session
            frozen.stdin.write("\n")
            frozen.stdin.flush()
            out, _ = frozen.communicate(timeout=30)
            assert "got IDLE_TIMEOUT" in out and "closed 1001" in out, out
        finally:
            if frozen.poll() is None:
                os.kill(frozen.pid, signal.SIGCONT)
                frozen.kill()
                frozen.wait(timeout=10)


# --- Malformed frames ---------------------------------------------------------------


def test_malformed_frames_get_an_error_and_keep_the_session() -> None:
    app = build_app()
    marker = "ECHO-MARKER-7f3a"
    # uvicorn's command-line frame limit (16 MiB), far above the app's 1 MB: the app's limit decides
    with running_uvicorn(app, ws_max_size=16 * 2**20) as url, ws_connect(ws_url(url), max_size=2**24) as ws:
        ws.send(json.dumps({"type": "reset", "data": {"task_id": "task_medium", "seed": 8}}))
        first = json.loads(ws.recv(timeout=10))["data"]["observation"]
        ws.send(json.dumps({"type": "step", "data": {"poses": plan_poses(first, 1, 0.0)}}))
        assert json.loads(ws.recv(timeout=10))["data"]["observation"]["current_stage"] == 1
        step_text = json.dumps({"type": "step", "data": {"poses": plan_poses(first, 2, 0.0)}})
        big_string = json.dumps({"type": "step", "data": {"poses": marker * 300_000}})  # 4.8 MB
        frames: list[tuple[str, str | bytes, str]] = [
            ("array", "[1,2]", "INVALID_JSON"),
            ("null", "null", "INVALID_JSON"),
            ("number", "3", "INVALID_JSON"),
            ("string", json.dumps(marker), "INVALID_JSON"),
            ("binary", step_text.encode(), "INVALID_JSON"),
            ("nested", "[" * 100_000, "INVALID_JSON"),
            (
                "nested_object",
                '{"type": "step", "data": ' + '{"a": ' * 50_000 + "1" + "}" * 50_001,
                "INVALID_JSON",
            ),
            ("not_json", "{" + marker, "INVALID_JSON"),
            ("unknown_type", json.dumps({"type": marker}), "UNKNOWN_TYPE"),
            ("type_number", json.dumps({"type": 5}), "UNKNOWN_TYPE"),
            ("data_array", json.dumps({"type": "step", "data": [1, 2]}), "VALIDATION_ERROR"),
            ("extra_field", json.dumps({"type": "step", "data": {}, marker: 1}), "VALIDATION_ERROR"),
            (
                "too_large",
                json.dumps({"type": "step", "data": {"poses": [[1.0] * 7] * 40_000}}),
                "MESSAGE_TOO_LARGE",
            ),
            ("too_large_string", big_string, "MESSAGE_TOO_LARGE"),
            (
                "bad_poses_string",
                json.dumps({"type": "step", "data": {"poses": marker * 1000}}),
                "VALIDATION_ERROR",
            ),
            (
                "nan",
                step_text.replace(json.dumps(plan_poses(first, 2, 0.0)[3][4]), "NaN", 1),
                "VALIDATION_ERROR",
            ),
            (
                "stale_stage",
                json.dumps(
                    {"type": "step", "data": {"poses": plan_poses(first, 2, 0.0), "expected_stage": 0}}
                ),
                "STAGE_CONFLICT",
            ),
        ]
        for name, frame, code in frames:
            started = time.monotonic()
            ws.send(frame)
            raw = ws.recv(timeout=30)
            reply = json.loads(raw)
            assert reply["type"] == "error" and reply["data"]["code"] == code, (name, reply)
            assert len(raw) < MAX_ERROR_CHARS + 300, (name, len(raw))
            assert marker not in raw, (name, raw[:300])  # never echoed
            assert time.monotonic() - started < 5, name
        assert "expected_stage=1" in json.loads(raw)["data"]["message"]  # the stale step's reply
        ws.send(json.dumps({"type": "state"}))
        assert json.loads(ws.recv(timeout=10))["data"]["current_stage"] == 1  # nothing applied
        ws.send(step_text)
        assert json.loads(ws.recv(timeout=10))["data"]["observation"]["current_stage"] == 2
        assert status(url)["websocket_sessions"]["bad_messages"] >= len(frames) - 1


def test_nan_over_websocket_names_the_tooth() -> None:
    with running_uvicorn(build_app()) as url, ws_connect(ws_url(url)) as ws:
        ws.send(json.dumps({"type": "reset", "data": {"seed": 8}}))
        first = json.loads(ws.recv(timeout=10))["data"]["observation"]
        poses = plan_poses(first, 1, 0.0)
        ws.send(
            json.dumps({"type": "step", "data": {"poses": poses}}).replace(json.dumps(poses[3][4]), "NaN", 1)
        )
        message = json.loads(ws.recv(timeout=10))["data"]["message"]
        assert "tooth 14" in message and "tx" in message and "finite" in message, message


# --- Restart, closes and the training client (subprocess servers) -------------------------


def _close_in_three_ways(url: str) -> None:
    """A close message, a client-side close without one, and an abrupt TCP reset."""
    for how in ("message", "close", "abort"):
        with ws_connect(ws_url(url), open_timeout=30) as ws:
            ws.send(json.dumps({"type": "reset", "data": {"seed": 1}}))
            assert json.loads(ws.recv(timeout=30))["type"] == "observation"
            if how == "message":
                ws.send(json.dumps({"type": "close"}))
                with pytest.raises(websockets.ConnectionClosedOK):
                    ws.recv(timeout=10)
            elif how == "abort":
                ws.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                ws.socket.close()  # no close frame: a TCP reset


def test_restart_closes_quietly_and_the_training_client_recovers(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    python = sys.executable
    first = start_server_process(
        [python, "-m", "uvicorn", "server.app:app", "--host", "127.0.0.1", "--port", str(port)], port, log
    )
    session = EnvSession(first.url, message_timeout_s=30, reconnect_deadline_s=60)
    try:
        # one frame limit under the uvicorn command line (its own limit is 16 MiB)
        with ws_connect(ws_url(first.url), max_size=2**24) as ws:
            ws.send(json.dumps({"type": "step", "data": {"poses": [[0.5] * 7] * 30_000}}))  # 1.2 MB
            assert json.loads(ws.recv(timeout=30))["data"]["code"] == "MESSAGE_TOO_LARGE"
            ws.send(json.dumps({"type": "reset", "data": {"seed": 2}}))
            assert json.loads(ws.recv(timeout=30))["type"] == "observation"
        _close_in_three_ways(first.url)
        wait_until(lambda: status(first.url)["websocket_sessions"]["live"] == 0, 10, "closes counted")

        start = session.reset(task_id="task_medium", seed=9).observation
        lost_id = session.episode_id
        for stage in range(1, 4):
            assert session.step(plan_poses(start, stage, 0.0)).observation["current_stage"] == stage
        assert first.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
        log_text = first.output()
        assert "Traceback" not in log_text and "ERROR" not in log_text, log_text[-3000:]

        started = time.monotonic()
        with pytest.raises(EpisodeLostError) as lost:
            session.step(plan_poses(start, 4, 0.0))
        assert time.monotonic() - started < 5  # reported, not a hang
        assert lost.value.episode_id == lost_id and lost.value.stage == 3
        assert lost_id in str(lost.value) and "reset()" in str(lost.value)

        short = EnvSession(first.url, reconnect_deadline_s=0.5)
        started = time.monotonic()
        with pytest.raises(ServerUnavailableError, match="unavailable"):
            short.reset(seed=1)  # nothing listens: bounded, then a clear error
        assert time.monotonic() - started < 5
        short.close()

        # the server comes back (now as python -m server.app): reset reconnects by itself
        second = start_server_process(
            [python, "-m", "server.app", "--host", "127.0.0.1", "--port", str(port), "--log-level", "info"],
            port,
            log,
            wait=False,
        )
        try:
            result = session.reset(task_id="task_medium", seed=9)
            assert session.episode_id != lost_id and result.observation["current_stage"] == 0
            for stage in range(1, N_STAGES + 1):
                result = session.step(plan_poses(start, stage, 0.0))
            assert result.done and np.isfinite(result.observation["terminal_reward"])
            session.close()
            with ws_connect(ws_url(second.url), max_size=2**24) as ws:  # the same limit under python -m
                ws.send(json.dumps({"type": "step", "data": {"poses": [[0.5] * 7] * 30_000}}))
                assert json.loads(ws.recv(timeout=30))["data"]["code"] == "MESSAGE_TOO_LARGE"
            _close_in_three_ways(second.url)
        finally:
            assert second.stop() in (0, -signal.SIGTERM)
        log_text = second.output()
        assert "Traceback" not in log_text and "ERROR" not in log_text, log_text[-3000:]
    finally:
        session.close()
        if first.proc.poll() is None:
            first.stop()


# --- Workers ------------------------------------------------------------------------------


def test_several_workers_are_refused_at_start(tmp_path: Path) -> None:
    assert requested_workers(["uvicorn", "server.app:app", "--workers", "2"], {}) == 2
    assert requested_workers(["uvicorn", "server.app:app", "--workers=3"], {}) == 3
    assert requested_workers(["uvicorn", "server.app:app"], {"WEB_CONCURRENCY": "4"}) == 4
    assert requested_workers(["uvicorn", "server.app:app", "--workers", "1"], {"WEB_CONCURRENCY": "4"}) == 1
    assert requested_workers(["gunicorn", "-w", "2", "server.app:app"], {}) == 2
    assert requested_workers(["pytest", "-w", "2"], {}) == 1
    port = free_port()
    log = tmp_path / "workers.log"
    server = start_server_process(
        [sys.executable, "-m", "uvicorn", "server.app:app", "--port", str(port), "--workers", "2"],
        port,
        log,
        wait=False,
    )
    try:
        server.proc.wait(timeout=90)
    finally:
        if server.proc.poll() is None:
            server.stop()
            pytest.fail("uvicorn --workers 2 kept running:\n" + server.output()[-3000:])
    text = server.output()
    assert "refusing to start with 2 worker processes" in text and "WEB_CONCURRENCY" in text, text[-3000:]


# --- Settings -------------------------------------------------------------------------------


def test_settings_have_headroom_by_default_and_come_from_the_environment() -> None:
    default = ServerSettings.from_env({})
    assert default.max_sessions == 256 and default.ws_idle_timeout_s == 300.0
    assert default.max_message_bytes == 1_000_000
    settings = ServerSettings.from_env(
        {"ORTHORL_MAX_SESSIONS": "512", "ORTHORL_WS_IDLE_TIMEOUT_S": "30", "ORTHORL_MAX_BODY_BYTES": "2000"},
        max_episodes=9,
    )
    assert (settings.max_sessions, settings.ws_idle_timeout_s, settings.max_message_bytes) == (
        512,
        30.0,
        2000,
    )
    assert settings.max_episodes == 9
    assert (
        ServerSettings.from_env(
            {"ORTHORL_MAX_MESSAGE_BYTES": "5", "ORTHORL_MAX_BODY_BYTES": "7"}
        ).max_message_bytes
        == 5
    )
    for variable, value, words in (
        ("ORTHORL_MAX_SESSIONS", "lots", "ORTHORL_MAX_SESSIONS must be an integer"),
        ("ORTHORL_MAX_SESSIONS", "0", "positive integer"),
        ("ORTHORL_WS_IDLE_TIMEOUT_S", "-1", "positive number of seconds"),
        ("ORTHORL_WS_IDLE_TIMEOUT_S", "inf", "positive number of seconds"),
    ):
        with pytest.raises(SettingsError, match=words):
            ServerSettings.from_env({variable: value})
    app = build_app()
    assert app.state.websocket_sessions.idle_timeout_s == 300.0  # reaping is on by default
