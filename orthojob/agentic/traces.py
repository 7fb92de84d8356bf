"""Agentic episodes as MLflow traces.

While an MLflow run is active, a few episodes per step (:data:`TRACE_EPISODES_ENV`, default
:data:`DEFAULT_TRACE_EPISODES` per reward call, i.e. per generation batch; 0: none) are recorded and
written by :func:`orthojob.agentic.reward.reward_agentic` as MLflow traces (:func:`flush_traces`): a
root span ``episode`` (inputs: the case key; outputs: the result; attributes and trace tags: the
reward) with one span per tool call (inputs: the arguments, outputs: the result text, its start and
end times). An episode not sampled costs one attribute test per tool call.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

TRACE_EPISODES_ENV = "ORTHORL_TRACE_EPISODES"
"""How many agentic episodes per reward call (one generation batch) become MLflow traces."""


DEFAULT_TRACE_EPISODES = 2


TRACE_REWARD_TAG = "orthorl.reward"
"""The trace tag (and root span attribute ``reward``) holding the episode's reward."""


TRACE_WINDOW_S = 60.0
"""The budget also renews after this many seconds without a flush (episodes nobody scores through
:func:`reward_agentic`, e.g. a gate's, never exhaust it)."""


class _TraceBudget:
    """How many more episodes of this batch are recorded: claimed at ``reset`` (only while an MLflow
    run is active), renewed by :func:`flush_traces` or after :data:`TRACE_WINDOW_S` (thread-safe: TRL
    may reset from threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._used = 0
        self._since = time.monotonic()

    def claim(self) -> bool:
        mlflow = sys.modules.get("mlflow")  # only when a stage run imported it
        if mlflow is None or mlflow.active_run() is None:
            return False
        try:
            limit = int(os.environ.get(TRACE_EPISODES_ENV) or DEFAULT_TRACE_EPISODES)
        except ValueError:
            limit = DEFAULT_TRACE_EPISODES
        with self._lock:
            if time.monotonic() - self._since >= TRACE_WINDOW_S:
                self._used, self._since = 0, time.monotonic()
            if self._used >= limit:
                return False
            self._used += 1
            return True

    def renew(self) -> None:
        with self._lock:
            self._used, self._since = 0, time.monotonic()


_BUDGET = _TraceBudget()


def _traced(func: Callable) -> Callable:
    """A tool that, in an episode being recorded, appends ``(name, arguments, result, start, end)``
    (nanoseconds) to it; signature and docstring kept, so TRL derives the same schema."""
    names = list(inspect.signature(func).parameters)[1:]  # after self

    @functools.wraps(func)
    def tool(self, *args, **kwargs) -> str:
        calls = self._trace_calls
        if calls is None:
            return func(self, *args, **kwargs)
        start = time.time_ns()
        out = func(self, *args, **kwargs)
        calls.append((func.__name__, {**dict(zip(names, args)), **kwargs}, out, start, time.time_ns()))
        return out

    return tool


def flush_traces(environments: Sequence, stage: str = "grpo") -> int:
    """Write the recorded episodes of ``environments`` as MLflow traces (module docstring) into the
    active run's experiment and renew the sampling budget; returns the number written. Tracing is a
    diagnostic: a failure is logged, never raised."""
    recorded = [e for e in environments if getattr(e, "_trace_calls", None) is not None]
    _BUDGET.renew()
    if not recorded:
        return 0
    import mlflow
    from mlflow.tracing.constant import TraceMetadataKey

    run = mlflow.active_run()
    where = {"experiment_id": run.info.experiment_id} if run is not None else {}
    linked = {TraceMetadataKey.SOURCE_RUN: run.info.run_id} if run is not None else None
    written = 0
    for env in recorded:
        calls, env._trace_calls = env._trace_calls, None
        key, reward = env._key, env.reward
        root = None
        try:
            root = mlflow.start_span_no_context(
                "episode",
                span_type="AGENT",
                inputs={"task_id": key.task_id, "seed": key.seed, "force_decay": key.force_decay},
                attributes={"reward": reward, "finished": env.finished, "stage": stage},
                tags={
                    TRACE_REWARD_TAG: f"{reward:.6f}",
                    "orthorl.stage": stage,
                    "orthorl.case": f"{key.task_id}/{key.seed}",
                },
                metadata=linked,
                start_time_ns=env._trace_start,
                **where,
            )
            end = env._trace_start
            for name, arguments, result, start, end in calls:
                span = mlflow.start_span_no_context(
                    name, span_type="TOOL", parent_span=root, inputs=arguments, start_time_ns=start
                )
                span.end(outputs=result, end_time_ns=end)
            root.end(
                outputs=env.result or {"finished_by": None, "reward": reward},
                end_time_ns=max(end, time.time_ns()),
            )
            written += 1
        except Exception as exc:
            log.warning("episode trace not written: %s: %s", type(exc).__name__, str(exc)[:200])
            if root is not None:  # never leave a half-built trace open in MLflow's trace manager
                with contextlib.suppress(Exception):
                    root.end(status="ERROR")
    return written
