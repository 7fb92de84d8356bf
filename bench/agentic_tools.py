"""Agentic tool-call benchmark (not a test): single process, OMP_NUM_THREADS=1.

Environment time per tool call of :class:`orthojob.agentic.DentalToolEnv` (the whole method: argument
checks, the environment, the JSON result), per tool, median and p90 in milliseconds:

* in process (target: under 1 ms per call);
* over the WebSocket to a local server (``server.app`` served by uvicorn in a thread of this process,
  so client and server share one core), through OpenEnv's client (:class:`orthojob.agentic.RemoteStepwise`).

Each episode (seeds from the training range, task levels in turn): inspect_tooth, check_collisions,
simulate_stage, commit_stage x 3, rollback_stage, then submit_plan (the oracle's plan, scored in
process in both settings; every plan a new case, so no score cache hits).

    OMP_NUM_THREADS=1 python bench/agentic_tools.py [--episodes 200] [--no-server]
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time
from collections import defaultdict

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from orthojob.agentic import TOOL_NAMES, DentalToolEnv
from orthojob.prompts import TRAIN_SEED_START, plan_to_completion, reset_observation
from server.cases import TASK_IDS
from server.oracle import oracle_plan

STAGE = [{"teeth": [11, 21, 31, 41], "fraction": 0.04}, {"teeth": [13, 23, 33, 43], "fraction": 0.03}]


def run(env: DentalToolEnv, episodes: int, seed_start: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = defaultdict(list)
    clock = time.perf_counter

    def timed(name: str, *args, **kwargs) -> str:
        t0 = clock()
        out = getattr(env, name)(*args, **kwargs)
        times[name].append(clock() - t0)
        if out.startswith("error: "):
            raise RuntimeError(f"{name}: {out}")
        return out

    for k in range(episodes):
        task_id, seed = TASK_IDS[k % len(TASK_IDS)], seed_start + k
        plan = plan_to_completion(oracle_plan(reset_observation(seed, task_id, False)))
        t0 = clock()
        env.reset(seed=seed, task_id=task_id, force_decay=False)
        times["reset"].append(clock() - t0)
        timed("inspect_tooth", 13)
        timed("check_collisions")
        timed("simulate_stage", STAGE)
        for _ in range(3):
            timed("commit_stage", STAGE)
        timed("rollback_stage")
        timed("submit_plan", plan)
    return times


def report(title: str, times: dict[str, list[float]]) -> None:
    print(f"\n{title}: ms per call (median, p90, calls)")
    for name in ("reset", *TOOL_NAMES):
        ms = np.asarray(times[name]) * 1e3
        print(f"  {name:<17} {np.median(ms):8.3f} {np.percentile(ms, 90):8.3f} {ms.size:6d}")
    tools = np.concatenate([np.asarray(times[n]) for n in TOOL_NAMES]) * 1e3
    print(f"  {'all tools':<17} {np.median(tools):8.3f} {np.percentile(tools, 90):8.3f} {tools.size:6d}")


def serve() -> tuple[str, object, threading.Thread]:
    import uvicorn

    from server.app import create_app
    from server.settings import ServerSettings

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(ServerSettings(max_sessions=8)), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--no-server", action="store_true", help="in process only")
    args = parser.parse_args()
    run(DentalToolEnv(), 3, TRAIN_SEED_START)  # warm-up (imports, first cases)
    report("in process", run(DentalToolEnv(), args.episodes, TRAIN_SEED_START + 10))
    if args.no_server:
        return
    url, server, thread = serve()
    env = DentalToolEnv(env_url=url)
    try:
        run(env, 3, TRAIN_SEED_START)
        report(
            f"over the WebSocket ({url}, server in this process)",
            run(env, args.episodes, TRAIN_SEED_START + 10 + args.episodes),
        )
    finally:
        env._env.close()
        server.should_exit = True
        thread.join(timeout=10)


if __name__ == "__main__":
    main()
