"""Agentic tool-call benchmark (not a test): single process, OMP_NUM_THREADS=1.

Environment time per tool call of :class:`orthojob.agentic.tools.DentalToolEnv` (the whole method: argument
checks, the environment, the JSON result), per tool, median and p90 in milliseconds:

* in process (target: under 1 ms per call);
* over the WebSocket to a local server (``server.app`` served by uvicorn in a thread of this process,
  so client and server share one core), through OpenEnv's client (:class:`orthojob.agentic.remote.RemoteStepwise`).

Each episode (seeds from the training range, task levels in turn): inspect_tooth, check_collisions,
simulate_stage, commit_stage x 3, rollback_stage, then submit_plan (the oracle's plan, scored in
process in both settings; every plan a new case, so no score cache hits). Tools are called with
keyword arguments, as TRL calls them.

Then the environment's mean ms per tool call over two oracle-like episodes (reset not counted; each
call's fastest of 3 runs of the episode, as a shared machine's preemptions would otherwise count):

* ``trace``: the tool-use SFT demonstration (:func:`orthojob.stages.tool_sft.oracle_tool_trace`):
  inspect_tooth x 2, check_collisions, submit_plan (the oracle's plan);
* ``stepwise``: inspect_tooth x 2, check_collisions, then the oracle's plan stage by stage
  (:func:`orthojob.agentic.tools.plan_stages`): simulate_stage and commit_stage x 24 (the 24th commit
  finishes the episode and scores it).

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

from orthojob.agentic.tools import DentalToolEnv, plan_stages
from orthojob.core.prompts import TRAIN_SEED_START, plan_to_completion, reset_observation
from server.agent_tools import TOOL_NAMES
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
        timed("inspect_tooth", tooth_id=13)
        timed("check_collisions")
        timed("simulate_stage", groups=STAGE)
        for _ in range(3):
            timed("commit_stage", groups=STAGE)
        timed("rollback_stage")
        timed("submit_plan", plan=plan)
    return times


def oracle_episodes(
    env: DentalToolEnv, episodes: int, seed_start: int, repeats: int = 3
) -> dict[str, list[float]]:
    """Each oracle-like episode's seconds in the tools (reset not counted) and its calls, by kind.

    Every episode runs ``repeats`` times and each call counts its fastest run: a shared machine
    preempts a process for milliseconds every few milliseconds, which a mean over single runs
    would count as the environment's time (``{kind}/single``: the first run's seconds, as measured)."""
    out: dict[str, list[float]] = defaultdict(list)
    clock = time.perf_counter
    for k in range(episodes):
        task_id, seed = TASK_IDS[k % len(TASK_IDS)], seed_start + k
        plan = oracle_plan(reset_observation(seed, task_id, False))
        text = plan_to_completion(plan)
        for kind in ("trace", "stepwise"):
            calls = [
                ("inspect_tooth", {"tooth_id": 13}),
                ("inspect_tooth", {"tooth_id": 23}),
                ("check_collisions", {}),
            ]
            if kind == "trace":
                calls.append(("submit_plan", {"plan": text}))
            else:
                for s, groups in enumerate(plan_stages(plan)):
                    strategy = {"strategy": plan["strategy"]} if s == 0 else {}
                    calls += [
                        ("simulate_stage", {"groups": groups}),
                        ("commit_stage", {"groups": groups, **strategy}),
                    ]
            runs = []
            for _ in range(repeats):
                env.reset(seed=seed, task_id=task_id, force_decay=False)
                seconds = []
                for name, arguments in calls:
                    t0 = clock()
                    result = getattr(env, name)(**arguments)
                    seconds.append(clock() - t0)
                    if result.startswith("error: "):
                        raise RuntimeError(f"{name}: {result}")
                if not env.finished:
                    raise RuntimeError(f"the {kind} episode did not finish")
                runs.append(seconds)
            out[kind].append(float(np.min(runs, axis=0).sum()))
            out[f"{kind}/single"].append(sum(runs[0]))
            out[f"{kind}/calls"].append(len(calls))
    return out


def report_episodes(title: str, out: dict[str, list[float]]) -> None:
    print(
        f"\n{title}: environment ms per tool call over an oracle-like episode (mean over the episode's "
        "calls, each its fastest of 3 runs: median and mean of episodes; single runs' mean; calls)"
    )
    for kind in ("trace", "stepwise"):
        calls = np.asarray(out[f"{kind}/calls"])
        per_call = np.asarray(out[kind]) * 1e3 / calls
        single = np.asarray(out[f"{kind}/single"]) * 1e3 / calls
        print(
            f"  {kind:<17} {np.median(per_call):8.3f} {per_call.mean():8.3f} {single.mean():8.3f} {int(calls[0]):6d}"
        )


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
    from server.serving.settings import ServerSettings

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
    n_oracle = max(args.episodes // 4, 3)
    report_episodes("in process", oracle_episodes(DentalToolEnv(), n_oracle, TRAIN_SEED_START + 10))
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
        report_episodes("over the WebSocket", oracle_episodes(env, n_oracle, TRAIN_SEED_START + 10))
    finally:
        env._env.close()
        server.should_exit = True
        thread.join(timeout=10)


if __name__ == "__main__":
    main()
