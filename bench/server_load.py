"""Environment server load benchmark (not a test): episodes/s and step latency over WebSocket
and HTTP at 1, 8, 32, 64 and 128 concurrent clients, with the server's RSS and CPU per step.

The server is ``uvicorn server.app:app`` with default settings, in a subprocess pinned to
CPU 0 (``taskset``, when there are two CPUs or more); the clients run in this process, pinned
to CPU 1, as asyncio tasks (one connection each; a light JSON client so that the clients are
not what is measured). An episode is a reset and 24 steps of a straight-line plan (task
levels and seeds cycle); over HTTP it is ``POST /episodes``, 24 ``POST .../step`` with
``expected_stage`` on one keep-alive connection, then ``DELETE`` (a well-behaved trainer).

Per level: warm-up, then ``--seconds`` of measurement; episodes/s is the steps answered in
the window over 24 (counting whole episodes would quantise: clients that start together
finish together), latencies are per step (send to reply), ``server CPU ms/step`` is the server's
CPU time (``utime + stime`` of its process) in the window over the steps answered in it (each
episode's reset and close included: the figure to hold against the budget below), ``server
ms/msg`` the same over every message, RSS the server's resident set after the window.

CPU per step is the figure to compare between runs on a shared machine: episodes/s and
latencies include the time the server waited for its core ("waited"), CPU time does not (it
still varies by 10-30 % with the load on the other core: caches, frequency). The target, 60
episodes/s of 24 steps from one core, is a budget of ``1 / (60 * 24)`` s = 0.694 ms of server
CPU per step; printed with the table.

Before the load it prints where one step's server time goes, measured in-process on the
code paths the server runs (decode, validation, environment step, encoding), next to
openenv-core 0.3.0's own path (``json``, pydantic observation, ``model_dump_json``).

    OMP_NUM_THREADS=1 python bench/server_load.py [--clients 1 8 32 64 128] [--seconds 4]
    OMP_NUM_THREADS=1 python bench/server_load.py --no-breakdown --clients 64 --episodes 4  # fixed work
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
import timeit
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import orjson
import websockets

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from server.dental_constants import N_STAGES  # noqa: E402
from server.dental_environment import StepwiseDentalEnvironment  # noqa: E402

TASKS = ("task_easy", "task_medium", "task_hard")
N_CASES = 12
TARGET_EPISODES_PER_S = 60
BUDGET_MS_PER_STEP = 1e3 / (TARGET_EPISODES_PER_S * N_STAGES)
"""Server CPU per step (its episode's reset and close included) that 60 episodes/s on one core allow."""


# --- Workload -----------------------------------------------------------------------


def straight_line(obs: dict) -> list[list[list[float]]]:
    """The 24 stages of the straight line initial -> target (quaternions normalised)."""
    initial = np.asarray(obs["initial_config"], dtype=float)
    target = np.asarray(obs["target_config"], dtype=float).copy()
    target[np.sum(initial[:, :4] * target[:, :4], axis=1) < 0, :4] *= -1.0
    stages = []
    for s in range(1, N_STAGES + 1):
        poses = (1 - s / N_STAGES) * initial + (s / N_STAGES) * target
        poses[:, :4] /= np.linalg.norm(poses[:, :4], axis=1, keepdims=True)
        stages.append(poses.tolist())
    return stages


def workload() -> list[tuple[dict, list[list[list[float]]]]]:
    """(reset parameters, 24 stages of poses) per case."""
    env = StepwiseDentalEnvironment()
    cases = []
    for i in range(N_CASES):
        params = {"task_id": TASKS[i % 3], "seed": 1000 + i}
        cases.append((params, straight_line(env.reset(params["task_id"], params["seed"]))))
    return cases


# --- Clients ------------------------------------------------------------------------


@dataclass
class Tally:
    """What the clients did inside the measurement window."""

    start: float = 0.0
    stop: float = float("inf")
    episodes: int = 0
    latencies: list[float] = field(default_factory=list)
    errors: int = 0

    def inside(self, t: float) -> bool:
        return self.start <= t <= self.stop


async def ws_client(
    url: str, cases: list, k: int, tally: Tally, until: float, deflate: bool, episodes: int | None = None
) -> None:
    """Episodes over one connection (until ``until``, or ``episodes`` of them); a refused or
    dropped connection counts an error and is opened again (after 50 ms)."""
    compression = "deflate" if deflate else None  # OpenEnv's stock client offers deflate; EnvSession does not
    i = k
    last = k + episodes if episodes is not None else None
    while time.perf_counter() < until and (last is None or i < last):
        try:
            async with websockets.connect(
                url, max_size=2**24, open_timeout=60, compression=compression
            ) as ws:
                while time.perf_counter() < until and (last is None or i < last):
                    params, stages = cases[i % len(cases)]
                    i += 1
                    await ws.send(orjson.dumps({"type": "reset", "data": params}).decode())
                    if orjson.loads(await ws.recv())["type"] != "observation":
                        raise ConnectionError("reset refused")
                    for s, poses in enumerate(stages):
                        message = orjson.dumps({"type": "step", "data": {"poses": poses}}).decode()
                        t0 = time.perf_counter()
                        await ws.send(message)
                        reply = orjson.loads(await ws.recv())
                        t1 = time.perf_counter()
                        if reply["type"] != "observation":
                            tally.errors += 1
                        if tally.inside(t1):
                            tally.latencies.append(t1 - t0)
                        if s == N_STAGES - 1 and tally.inside(t1):
                            tally.episodes += 1
                await ws.send('{"type": "close"}')
        except (websockets.ConnectionClosed, ConnectionError, OSError):
            tally.errors += 1
            await asyncio.sleep(0.05)


class KeepAliveHTTP:
    """A minimal HTTP/1.1 keep-alive JSON client (one connection), lighter than httpx."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status_line = await self.reader.readline()
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return int(status_line.split()[1]), await self.reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def http_client(
    host: str,
    port: int,
    cases: list,
    k: int,
    tally: Tally,
    until: float,
    legacy: bool = False,
    episodes: int | None = None,
) -> None:
    http = KeepAliveHTTP(host, port)
    i = k
    last = k + episodes if episodes is not None else None
    try:
        while time.perf_counter() < until and (last is None or i < last):
            params, stages = cases[i % len(cases)]
            i += 1
            code, body = await http.request("POST", "/episodes", orjson.dumps(params))
            episode_id = orjson.loads(body)["episode_id"]
            for s, poses in enumerate(stages):
                payload = orjson.dumps({"poses": poses} if legacy else {"poses": poses, "expected_stage": s})
                t0 = time.perf_counter()
                code, body = await http.request("POST", f"/episodes/{episode_id}/step", payload)
                orjson.loads(body)
                t1 = time.perf_counter()
                if code != 200:
                    tally.errors += 1
                if tally.inside(t1):
                    tally.latencies.append(t1 - t0)
                if s == N_STAGES - 1 and tally.inside(t1):
                    tally.episodes += 1
            if not legacy:
                await http.request("DELETE", f"/episodes/{episode_id}")
    finally:
        await http.close()


# --- Server -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, pin: bool, launch: str) -> subprocess.Popen:
    if launch == "uvicorn":  # uvicorn's command line, its defaults (per-message deflate on)
        cmd = [sys.executable, "-m", "uvicorn", "server.app:app", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--log-level", "warning", "--no-access-log"]
    else:  # the server's own launcher (deflate off, pings and frame limit from the settings)
        cmd = [sys.executable, "-m", "server.app", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--log-level", "warning"]
    if pin:
        cmd = ["taskset", "-c", "0", *cmd]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


def server_pid(proc: subprocess.Popen) -> int:
    """The uvicorn process (under taskset it is the same pid: taskset execs)."""
    return proc.pid


def server_stack() -> str:
    """The event loop and HTTP parser uvicorn picks here ("auto": uvloop and httptools if installed)."""
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return f"event loop {loop}, HTTP parser {http}"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def runqueue_wait_s(pid: int) -> float:
    """Seconds the server's threads have waited for a CPU (ready to run): other processes'
    load on its core, which the episodes/s and latencies then include."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- One level ------------------------------------------------------------------------


async def run_level(
    transport: str,
    n_clients: int,
    port: int,
    pid: int,
    cases: list,
    warmup: float,
    seconds: float,
    deflate: bool = False,
    legacy: bool = False,
    episodes: int | None = None,
) -> dict:
    """One level: a time window after a warm-up, or (``episodes``) a fixed number of episodes
    per client after one warm-up episode each, the server's CPU taken over exactly that work."""

    def clients(tally: Tally, until: float, episodes: int | None) -> asyncio.Future:
        if transport == "ws":
            url = f"ws://127.0.0.1:{port}/ws"
            tasks = [ws_client(url, cases, k, tally, until, deflate, episodes) for k in range(n_clients)]
        else:
            tasks = [
                http_client("127.0.0.1", port, cases, k, tally, until, legacy, episodes)
                for k in range(n_clients)
            ]
        return asyncio.gather(*tasks)

    tally = Tally()
    if episodes is not None:
        await clients(Tally(), math.inf, 1)
        cpu0, client0, wait0, t0 = cpu_s(pid), time.process_time(), runqueue_wait_s(pid), time.perf_counter()
        await clients(tally, math.inf, episodes)
        cpu1, client1, wait1 = cpu_s(pid), time.process_time(), runqueue_wait_s(pid)
        seconds = time.perf_counter() - t0
    else:
        now = time.perf_counter()
        tally.start, tally.stop = now + warmup, now + warmup + seconds
        runner = clients(tally, tally.stop, None)
        await asyncio.sleep(max(tally.start - time.perf_counter(), 0))
        cpu0, client0, wait0 = cpu_s(pid), time.process_time(), runqueue_wait_s(pid)
        await asyncio.sleep(max(tally.stop - time.perf_counter(), 0))
        cpu1, client1, wait1 = cpu_s(pid), time.process_time(), runqueue_wait_s(pid)
        await runner
    lat = np.asarray(tally.latencies) * 1e3
    per_episode = N_STAGES + (1 if transport == "ws" or legacy else 2)  # steps, reset (, delete)
    messages = len(lat) * per_episode / N_STAGES
    return {
        "transport": transport,
        "clients": n_clients,
        # steps in the window / 24: whole episodes finish in waves when all clients start together
        "episodes_per_s": len(lat) / N_STAGES / seconds,
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else float("nan"),
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else float("nan"),
        "server_cpu_ms_per_step": 1e3 * (cpu1 - cpu0) / max(len(lat), 1),
        "server_ms_per_msg": 1e3 * (cpu1 - cpu0) / max(messages, 1),
        "server_cpu_pct": 100 * (cpu1 - cpu0) / seconds,
        "server_cpu_wait_pct": 100 * (wait1 - wait0) / seconds,
        # what one whole core would serve at this CPU cost per message
        "core_episodes_per_s": 1e3 / max(1e3 * (cpu1 - cpu0) / max(messages, 1) * per_episode, 1e-9),
        "client_cpu_pct": 100 * (client1 - client0) / seconds,
        "server_rss_mb": rss_mb(pid),
        "errors": tally.errors,
    }


# --- Where a step's server time goes (in-process) ---------------------------------------


def breakdown() -> list[tuple[str, float, float]]:
    """(stage, µs now, µs with openenv-core's own path) of one step message."""
    from openenv.core.env_server.serialization import serialize_observation
    from openenv.core.env_server.types import WSObservationResponse

    from server.serving.adapter import DentalOpenEnvAdapter, make_observation
    from server.serving.models import DentalAction
    from server.serving.serialization import (
        ObservationEncoder,
        decode_message,
        encode_json,
        observation_payload,
    )

    env = StepwiseDentalEnvironment()
    adapter = DentalOpenEnvAdapter(env)
    first = adapter.reset_observation(task_id="task_medium", seed=3)
    stages = straight_line(first)
    frame = json.dumps({"type": "step", "data": {"poses": stages[0]}})
    episode_id = first["episode_id"]
    session = env.sessions.get(episode_id)

    def step_env() -> dict:
        session.stage = 0
        return env.step(episode_id, stages[0])

    obs = step_env()
    data = json.loads(frame)["data"]
    pydantic_obs = make_observation(obs)
    encoder = ObservationEncoder()
    encoder.frame(first)  # the case's constant fields, encoded at its reset
    n = 300

    def us(fn) -> float:
        return min(timeit.repeat(fn, number=n, repeat=3)) / n * 1e6

    return [
        ("decode the frame", us(lambda: decode_message(frame, 10**6)), us(lambda: json.loads(frame))),
        (
            "validate the action (pydantic; + poses_array here)",
            us(lambda: DentalAction.model_validate(data).poses_array()),
            us(lambda: DentalAction.model_validate(data)),
        ),
        ("environment step", us(step_env), us(step_env)),
        (
            "observation to a JSON frame",
            us(lambda: encoder.frame(obs)),
            us(
                lambda: WSObservationResponse(
                    data=serialize_observation(make_observation(obs))
                ).model_dump_json()
            ),
        ),
        ("  of which pydantic observation", 0.0, us(lambda: make_observation(obs))),
        (
            "  (encode_json of it, every field every step, for scale)",
            us(lambda: encode_json({"type": "observation", "data": observation_payload(obs)})),
            0.0,
        ),
        (
            "  (stdlib json.dumps of it, for scale)",
            0.0,
            us(lambda: json.dumps(serialize_observation(pydantic_obs))),
        ),
        (
            "step through the adapter (all above)",
            us(lambda: (setattr(session, "stage", 0), adapter.step_observation(data))),
            0.0,
        ),
    ]


# --- Main -----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--transports", nargs="+", default=["ws", "http"], choices=["ws", "http"])
    parser.add_argument("--seconds", type=float, default=4.0, help="measurement window per level")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument(
        "--episodes",
        type=int,
        default=None,
        help="instead of a time window: this many episodes per client, the server's CPU over exactly them "
        "(fixed work: the figure to compare between checkouts, run alternately)",
    )
    parser.add_argument(
        "--launch",
        choices=["module", "uvicorn"],
        default="module",
        help="python -m server.app (default) or uvicorn's command line with its defaults",
    )
    parser.add_argument("--deflate", action="store_true", help="WebSocket clients offer per-message deflate")
    parser.add_argument(
        "--legacy-http", action="store_true", help="no expected_stage, no DELETE (a server without them)"
    )
    args = parser.parse_args()

    pin = shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2
    if not args.no_breakdown:
        print("Where one step message's server time goes (in-process, µs):")
        print("| stage | this server | openenv-core 0.3.0 path |\n| --- | --- | --- |")
        for name, now, before in breakdown():
            print(f"| {name} | {now:.0f} | {before:.0f} |" if now or before else f"| {name} | | |")
        print()
    cases = workload()
    if pin:
        os.sched_setaffinity(0, {1})
    port = free_port()
    proc = start_server(port, pin, args.launch)
    rows = []
    try:
        pid = server_pid(proc)
        print(
            f"server pid {pid} {'on CPU 0, clients on CPU 1' if pin else '(not pinned: taskset or a 2nd CPU missing)'}"
        )
        print(f"launch: {args.launch}; clients offer deflate: {args.deflate}; {server_stack()}")
        print(f"server RSS at start: {rss_mb(pid):.0f} MB\n")
        print(
            f"budget for {TARGET_EPISODES_PER_S} episodes/s of {N_STAGES} steps on one core: "
            f"{BUDGET_MS_PER_STEP:.3f} ms of server CPU per step\n"
        )
        print(
            "| transport | clients | episodes/s | step p50 ms | step p99 ms | server CPU ms/step "
            "| server ms/msg | server CPU % | server waited for CPU % | episodes/s per server core "
            "| client CPU % | server RSS MB | errors |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for transport in args.transports:
            for n in args.clients:
                row = asyncio.run(
                    run_level(
                        transport,
                        n,
                        port,
                        pid,
                        cases,
                        args.warmup,
                        args.seconds,
                        args.deflate,
                        args.legacy_http,
                        args.episodes,
                    )
                )
                rows.append(row)
                print(
                    f"| {transport} | {n} | {row['episodes_per_s']:.1f} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} "
                    f"| {row['server_cpu_ms_per_step']:.3f} "
                    f"| {row['server_ms_per_msg']:.2f} | {row['server_cpu_pct']:.0f} | {row['server_cpu_wait_pct']:.0f} "
                    f"| {row['core_episodes_per_s']:.0f} | {row['client_cpu_pct']:.0f} "
                    f"| {row['server_rss_mb']:.0f} | {row['errors']} |",
                    flush=True,
                )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
