"""The agentic reward: the environment's own score of each episode, and the tool metrics logged per step.

The environment owns the reward (:attr:`orthojob.agentic.tools.DentalToolEnv.reward`): the scaled
terminal reward (:mod:`server.reward_scaler`, [-2, 8]) of the submitted plan, or of the 24 committed
stages; REWARD_MIN for an episode that did not finish. :func:`reward_agentic` is the TRL reward
function that reads it from the ``environments`` TRL passes, and logs per step (``log_metric``) the
tool metrics of :func:`episode_metrics` (``agentic/*``) and the finished episodes' scoring
components.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from orthojob.agentic.tools import DentalToolEnv
from orthojob.agentic.traces import flush_traces
from server.agent_tools import (
    TOOL_NAMES,
)


def _turns(completion: object) -> int:
    """Assistant turns of a conversational completion (1 for a plain string)."""
    if isinstance(completion, (list, tuple)):
        return sum(1 for m in completion if isinstance(m, dict) and m.get("role") == "assistant")
    return 1


def episode_metrics(
    environments: Sequence[DentalToolEnv], completions: Sequence | None = None
) -> dict[str, float]:
    """Batch means of the tool metrics (``agentic/*``): calls per episode by tool, invalid calls,
    rollbacks, stages committed, assistant turns (from ``completions``), the finished share (and by
    how), and the finished episodes' scoring components and scaled reward. Every key is present for
    any non-empty batch except the components (only when an episode finished)."""
    envs = list(environments)
    n = len(envs)
    if not n:
        return {}
    out: dict[str, float] = {}
    for name in TOOL_NAMES:
        out[f"agentic/calls/{name}"] = sum(e.metrics.calls.get(name, 0) for e in envs) / n
    out["agentic/calls/total"] = sum(sum(e.metrics.calls.values()) for e in envs) / n
    out["agentic/invalid_calls"] = sum(e.metrics.invalid for e in envs) / n
    out["agentic/rollbacks"] = sum(e.metrics.rollbacks for e in envs) / n
    out["agentic/stages_committed"] = sum(e.metrics.stages_committed for e in envs) / n
    out["agentic/finished_share"] = sum(e.finished for e in envs) / n
    out["agentic/submitted_share"] = sum(e.metrics.finished_by == "submit_plan" for e in envs) / n
    out["agentic/reward"] = sum(e.reward for e in envs) / n
    # the environment's wall time in this batch (this rank): reset and every tool call; over the
    # step's wall time (``step_time``) it is the environment's share of an agentic GRPO step
    out["agentic/env_seconds"] = sum(e.metrics.env_seconds for e in envs)
    calls = sum(sum(e.metrics.calls.values()) for e in envs)
    if calls:
        out["agentic/env_ms_per_call"] = 1e3 * sum(e.metrics.env_seconds for e in envs) / calls
    if completions is not None:
        out["agentic/turns"] = sum(_turns(c) for c in completions) / max(len(completions), 1)
    done = [e.result for e in envs if e.result is not None]
    if done:
        out["agentic/finished/scaled_reward"] = sum(r["scaled_reward"] for r in done) / len(done)
        out["agentic/finished/terminal_raw"] = sum(r["terminal_reward"] for r in done) / len(done)
        names = sorted({k for r in done for k in r["reward_breakdown"]})
        for name in names:
            values = [float(r["reward_breakdown"][name]) for r in done if name in r["reward_breakdown"]]
            values = [v for v in values if math.isfinite(v)]
            if values:
                out[f"agentic/component/{name}"] = sum(values) / len(values)
    return out


def reward_agentic(
    completions: Sequence, environments: Sequence[DentalToolEnv] | None = None, **kwargs
) -> list[float]:
    """The environment-owned reward of each rollout, read from the environments TRL passes.

    Args:
        completions: the rollouts (conversational message lists, tool messages included).
        environments: one :class:`DentalToolEnv` per completion (TRL's ``environments`` keyword).
        **kwargs: TRL's other keywords; ``log_metric(name, value)`` receives :func:`episode_metrics`.

    Returns:
        One float per completion in [-2, 8]: :attr:`DentalToolEnv.reward` (the scaled terminal reward of
        the submitted plan or the 24 committed stages; -2 for an unfinished episode).
    """
    if environments is None or len(environments) != len(completions):
        got = None if environments is None else len(environments)
        raise ValueError(
            f"reward_agentic needs one environment per completion (TRL's environments keyword, with "
            f"environment_factory=DentalToolEnv); got {got} for {len(completions)} completions"
        )
    log_metric = kwargs.get("log_metric")
    if callable(log_metric):
        for name, value in episode_metrics(environments, completions).items():
            log_metric(name, value)
    flush_traces(environments)  # the sampled episodes, as MLflow traces
    return [e.reward for e in environments]
