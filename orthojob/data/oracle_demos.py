"""BC's demonstrations: the oracle's safe plans for training cases (:func:`oracle_demonstrations`),
computed in worker processes (:func:`oracle_cases`).

The rule-based oracle (:func:`server.oracle.oracle_plan`) refines its plan on the simulator: about 35 ms
a case on ``task_easy`` under ideal dynamics, about 260 ms on ``task_hard`` under force decay (measured
one process, one thread, 50 cases each). Demonstrations over every level under both dynamics cost about
a second per ten cases, so :func:`oracle_cases` spreads them over ``workers`` processes (each case is
independent and deterministic: the result is the same for any number of workers). The safety check
(:func:`server.treatment.score_plans`) is batched per chunk.

``ORTHORL_DEMO_WORKERS`` sets the number of workers (default: the CPUs this process may use, at most
:data:`MAX_WORKERS`); 1 computes in process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

from orthojob.core.prompts import build_messages, plan_to_completion, reset_observation
from orthojob.data.robust_plans import robust_plan
from server.cases import TRAIN_SEED_START, CaseKey, generate_case
from server.oracle import oracle_plan
from server.treatment import score_plans

log = logging.getLogger(__name__)

WORKERS_ENV = "ORTHORL_DEMO_WORKERS"
MAX_WORKERS = 8
CHUNK = 40
"""Cases per task handed to a worker (a few seconds of oracle work each)."""


def demo_workers() -> int:
    """Worker processes for :func:`oracle_cases`: ``ORTHORL_DEMO_WORKERS``, else the CPUs this process may
    use (at most :data:`MAX_WORKERS`)."""
    value = os.environ.get(WORKERS_ENV, "").strip()
    if value:
        try:
            workers = int(value)
        except ValueError:
            raise ValueError(
                f"{WORKERS_ENV}={value!r}: give a whole number of worker processes (1: none)"
            ) from None
        if workers < 1:
            raise ValueError(f"{WORKERS_ENV}={value!r}: give at least 1 (1 computes in this process)")
        return workers
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_WORKERS))


def oracle_cases(keys: Sequence[CaseKey], workers: int | None = None) -> list[tuple[dict, dict, bool]]:
    """``(reset observation, the oracle's plan, whether the plan breaks no hard rule)`` of each case, in
    the order of ``keys``; in ``workers`` processes (default :func:`demo_workers`) when there are at
    least two chunks of work."""
    keys = [CaseKey(*k) for k in keys]
    workers = demo_workers() if workers is None else workers
    if workers <= 1 or len(keys) < 2 * CHUNK:
        return _cases(keys)
    chunks = [keys[i : i + CHUNK] for i in range(0, len(keys), CHUNK)]
    # spawn: the caller may hold torch's thread pools, which a forked child must not inherit
    with ProcessPoolExecutor(
        min(workers, len(chunks)), mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        return [row for part in pool.map(_cases, chunks) for row in part]


def _cases(keys: Sequence[CaseKey]) -> list[tuple[dict, dict, bool]]:
    observations = [reset_observation(k.seed, k.task_id, k.force_decay) for k in keys]
    plans = [oracle_plan(o) for o in observations]
    results = score_plans(plans, list(keys)) if plans else []
    return [(o, p, not r["broken_rules"]) for o, p, r in zip(observations, plans, results)]


def demonstrations(n: int, task_ids: Sequence[str], force_decay: bool = False) -> list[dict]:
    """``n`` BC examples ``{"prompt": messages, "completion": [assistant message], "seed", "task_id"}``
    (:func:`oracle_demonstrations` without its counts)."""
    return oracle_demonstrations(n, task_ids, force_decay)[0]


def oracle_demonstrations(
    n: int,
    task_ids: Sequence[str],
    force_decay: bool = False,
    prompt_format: str = "full",
    robust: bool = False,
    max_groups: int | None = None,
    unnamed_uniform: bool = False,
    oc_noise: float = 0.0,
    uniform_room: bool = False,
    room_oc: bool = False,
    both_dynamics: bool = False,
) -> tuple[list[dict], dict]:
    """``n`` BC examples, and their counts ``{"source", "examples", "filtered_hard_rule"}``.

    Seeds run from TRAIN_SEED_START within each task; tasks take turns (``n`` split evenly). Only
    plans the environment judges safe are kept (no hard rule broken, :mod:`server.reward_scaler`):
    a case whose oracle plan breaks one is skipped and the next seed taken; the number skipped is
    logged and returned. ``robust``: each plan is :func:`orthojob.data.robust_plans.robust_plan`'s
    choice (the counts then say how often each candidate was chosen, ``robust_choices``), of at most
    ``max_groups`` groups where that is given, its uniform plans without a strategy where naming one
    earns nothing with ``unnamed_uniform``, judged with the overcorrections also written off by
    ``oc_noise`` (absolute) where given, and with uniform staging overcorrected within the room among
    the candidates with ``uniform_room``, and the plain candidates overcorrected within half the room with
    ``room_oc``. ``both_dynamics``: each task under both dynamics (ideal, then force decay), its cells
    taking turns with the other tasks' (``force_decay`` then unused).
    """
    cells = [(t, fd) for t in task_ids for fd in ((False, True) if both_dynamics else (bool(force_decay),))]
    choices: dict[str, int] = {}
    per_task = [n // len(cells) + (1 if k < n % len(cells) else 0) for k in range(len(cells))]
    by_task = []
    filtered = 0
    # the first `count` seeds of every cell at once (in worker processes), more where some were unsafe
    wanted = [
        CaseKey(t, TRAIN_SEED_START + i, fd) for (t, fd), count in zip(cells, per_task) for i in range(count)
    ]
    computed = dict(zip(wanted, oracle_cases(wanted)))
    for (task_id, force_decay), count in zip(cells, per_task):
        rows = []
        seed = TRAIN_SEED_START
        while len(rows) < count:
            key = CaseKey(task_id, seed, force_decay)
            if key not in computed:
                more = [key._replace(seed=seed + i) for i in range(count - len(rows))]
                computed.update(zip(more, oracle_cases(more)))
            obs, plan, safe = computed[key]
            if not safe:
                filtered += 1
            else:
                if robust:
                    plan, chosen = robust_plan(
                        plan, key, generate_case(*key).present_ids, max_groups, unnamed_uniform,
                        oc_noise=oc_noise, uniform_room=uniform_room, room_oc=room_oc,
                    )  # fmt: skip
                    choices[chosen] = choices.get(chosen, 0) + 1
                rows.append(
                    {
                        "prompt": build_messages(obs, prompt_format),
                        "completion": [{"role": "assistant", "content": plan_to_completion(plan)}],
                        "seed": seed,
                        "task_id": task_id,
                    }
                )
            seed += 1
        by_task.append(rows)
    log.info(
        "SFT demonstrations: %d safe oracle plans kept, %d that break a hard rule filtered out", n, filtered
    )
    out = []
    for k in range(max(per_task, default=0)):
        out.extend(rows[k] for rows in by_task if k < len(rows))
    info = {"source": "oracle", "examples": len(out), "filtered_hard_rule": filtered}
    return out, ({**info, "robust_choices": choices} if robust else info)


__all__ = ["CHUNK", "WORKERS_ENV", "demo_workers", "demonstrations", "oracle_cases", "oracle_demonstrations"]
