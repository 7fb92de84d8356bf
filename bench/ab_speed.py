"""Speed of two checkouts side by side, interleaved (benchmark, not a test).

On a shared machine a benchmark run minutes after another measures the load as much as the code.
This runs one worker process per checkout and alternates every measurement between them (ABAB…, the
order flipped every round), so both see the same load; it reports per measure the median CPU time of
each (``time.process_time``) and their ratio.

Measures (each on the checkout's own code, single process, ``OMP_NUM_THREADS=1``):

* ``stepwise <task> <ideal|decay>``: one stepwise episode (reset + 24 uniform-SLERP steps), case cached;
* ``case <task>``: generating one case (cache cleared), mean over 10 seeds;
* ``batch64``: scoring 64 uniform-SLERP plans (half force decay) in one batch;
* ``rewards64``: all five reward functions on 64 completions, as TRL calls them (rollout cache cleared).

    OMP_NUM_THREADS=1 python bench/ab_speed.py --base /path/to/old/checkout [--head .] [--rounds 9]

(``git worktree add /tmp/base <commit>`` gives an old checkout.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, os, random, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import numpy as np
import reward_throughput as R
from orthojob.rewards import reward_functions, rollouts
from server.cases import clear_case_cache, generate_case
from server.dental_environment import StepwiseDentalEnvironment
from server.plans import interpolate_poses, planned_progress

from server.treatment import score_plans

clock = time.process_time
env = StepwiseDentalEnvironment()
seeds = range(100, 110)
trajectories = {}

def trajectory(task, seed, decay):
    key = (task, seed, decay)
    if key not in trajectories:
        c = generate_case(task, seed, decay)
        trajectories[key] = interpolate_poses(
            c.initial, c.target, planned_progress(np.ones(28, int), np.full(28, 1 / 24))
        )
    return trajectories[key]

funcs = reward_functions.active_reward_funcs()
rng = random.Random(0)
batches = [R.make_batch(list(range(60000 + 16 * b, 60016 + 16 * b)), 4, "task_medium", rng) for b in range(3)]
cases64 = [generate_case("task_medium", s, s % 2 == 1) for s in range(64)]

def measure(kind, task, decay):
    if kind == "stepwise":
        t = clock()
        for s in seeds:
            tr = trajectory(task, s, decay)
            eid = env.reset(task, s, decay)["episode_id"]
            for k in range(1, 25):
                env.step(eid, tr[k])
        return (clock() - t) / len(seeds)
    if kind == "case":
        total = 0.0
        for s in seeds:
            clear_case_cache()
            t = clock()
            generate_case(task, s, decay)
            total += clock() - t
        return total / len(seeds)
    if kind == "batch64":
        t = clock()
        score_plans([None] * 64, cases64)
        return clock() - t
    total = 0.0
    for comps, cols in batches:
        rollouts.DEFAULT_CACHE.clear()
        t = clock()
        R._all_rewards(funcs, comps, cols)
        total += clock() - t
    return total / len(batches)

for line in sys.stdin:
    kind, task, decay = line.split()
    print(json.dumps(measure(kind, task, decay == "1")), flush=True)
"""

MEASURES = [
    *(f"stepwise {t} {d}" for t in ("task_easy", "task_medium", "task_hard") for d in ("0", "1")),
    *(f"case {t} 0" for t in ("task_easy", "task_medium", "task_hard")),
    "batch64 - 0",
    "rewards64 - 0",
]


def _label(measure: str) -> str:
    kind, task, decay = measure.split()
    if kind == "stepwise":
        return f"stepwise {task} {'decay' if decay == '1' else 'ideal'}"
    return f"{kind} {task}" if kind == "case" else kind


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the older checkout (a folder)")
    parser.add_argument(
        "--head", default=str(Path(__file__).resolve().parents[1]), help="(default: this one)"
    )
    parser.add_argument("--rounds", type=int, default=9, help="measurements per measure and checkout")
    args = parser.parse_args(argv)
    trees = [str(Path(args.base).resolve()), str(Path(args.head).resolve())]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER],
            cwd=tree,
            env={**env, "PYTHONPATH": tree},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for tree in trees
    ]
    times: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in MEASURES}
    for r in range(args.rounds):
        for m in MEASURES:
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                workers[i].stdin.write(m + "\n")
                workers[i].stdin.flush()
                line = workers[i].stdout.readline()
                if not line:
                    raise SystemExit(f"the worker in {trees[i]} stopped (run it by hand to see why)")
                times[m][i].append(json.loads(line))
    for w in workers:
        w.stdin.close()
        w.wait()
    print(f"base {trees[0]}\nhead {trees[1]}\n(median CPU ms over {args.rounds} interleaved rounds)")
    print(f"{'measure':28s} {'base ms':>9s} {'head ms':>9s} {'head/base':>9s}")
    for m, (a, b) in times.items():
        ma, mb = 1000 * statistics.median(a), 1000 * statistics.median(b)
        print(f"{_label(m):28s} {ma:9.3f} {mb:9.3f} {mb / ma:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
