"""The verifiers face of the environment: the ``orthorl-aligner`` taskset (verifiers 0.4, ``verifiers.v1``).

verifiers resolves a taskset id to the installed module of that name (``orthorl-aligner`` ->
``orthorl_aligner``) and takes the ``Taskset`` subclass it exports in ``__all__``. Each task is one
case (``task_id``, ``seed``, ``force_decay``) with the one-shot prompt the GRPO job trains on
(:func:`orthojob.prompts.build_messages`); its rewards are the job's five TRL reward functions
(:data:`orthojob.rewards.REWARD_FUNCS`) applied to the trace's reply, weighted as GRPO weights
them (:func:`orthojob.rewards.reward_weights`), so a trace's ``reward`` is the weighted sum TRL
computes for the same completion. No scoring here: the functions are the job's.

    import orthorl_aligner
    env = orthorl_aligner.load_environment(task_id="task_hard", force_decay=True, num_tasks=8)
    # or: vf-eval orthorl-aligner --env.taskset.task_id task_hard ...

``load_environment(**kwargs)`` is the Environments Hub's entry point; it builds the
``verifiers.v1`` env config and returns ``verifiers.v1.load_environment(config)``.

Multi-turn with the agentic tools: the same tools are served over MCP by the environment server
(``POST /mcp``, :mod:`server.mcp_tools`); a verifiers ``Toolset`` pointed at it needs an MCP
streamable-HTTP transport, which that endpoint does not speak (see docs/environment.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf
from pydantic import Field

from orthojob.prompts import TRAIN_SEED_START, build_messages, reset_observation
from orthojob.rewards import DEFAULT_REWARD_WEIGHTS, REWARD_FUNCS, reward_weights
from server.cases import TASK_IDS

TASKSET_ID = "orthorl-aligner"


class CaseData(vf.TaskData):
    """One case: the reward functions' dataset columns."""

    task_id: str
    seed: int
    force_decay: bool


class AlignerTasksetConfig(vf.TasksetConfig):
    """Which cases: ``num_tasks`` seeds from ``seed_start`` of ``task_id`` (force decay or not)."""

    task_id: str = "task_easy"
    force_decay: bool = False
    seed_start: int = TRAIN_SEED_START
    num_tasks: int = Field(16, ge=1)
    prompt_format: str = "full"


def _reward_method(name: str):
    func = REWARD_FUNCS[name]

    async def method(self, task: CaseData, trace: vf.Trace) -> float:
        (value,) = func(
            [trace.last_reply], seed=[task.seed], task_id=[task.task_id], force_decay=[task.force_decay]
        )
        return value

    method.__name__ = name
    method.__doc__ = (func.__doc__ or "").split("\n\n")[0]
    return vf.reward(method, weight=DEFAULT_REWARD_WEIGHTS[name])


class AlignerTask(vf.Task[CaseData]):
    """A case's staging plan, scored by the job's five reward functions on the reply."""


for _name in REWARD_FUNCS:
    setattr(AlignerTask, _name, _reward_method(_name))


class AlignerTaskset(vf.Taskset[AlignerTask, AlignerTasksetConfig]):
    """The cases of one task level (:class:`AlignerTasksetConfig`)."""

    def load(self) -> Iterator[AlignerTask]:
        config = self.config
        if config.task_id not in TASK_IDS:
            raise ValueError(f"task_id must be one of {', '.join(TASK_IDS)}, got {config.task_id!r}")
        for seed in range(config.seed_start, config.seed_start + config.num_tasks):
            messages = build_messages(
                reset_observation(seed, config.task_id, config.force_decay), config.prompt_format
            )
            system, user = (m["content"] for m in messages)
            yield AlignerTask(
                CaseData(
                    id=f"{config.task_id}/{seed}/{'decay' if config.force_decay else 'ideal'}",
                    name=f"{config.task_id} seed {seed}",
                    system_prompt=system,
                    prompt=user,
                    task_id=config.task_id,
                    seed=seed,
                    force_decay=config.force_decay,
                ),
                config.task,
            )


def env_config(reward_weight_overrides: dict[str, float] | None = None, **taskset: Any) -> vf.EnvConfig:
    """The ``verifiers.v1`` env config of this taskset: ``taskset`` fields
    (:class:`AlignerTasksetConfig`) and reward weights (by any name :func:`reward_weights`
    accepts; the rest weigh as in GRPO)."""
    funcs = list(REWARD_FUNCS.values())
    weights = reward_weights(funcs, reward_weight_overrides)
    rewards = {f.__name__: {"weight": w} for f, w in zip(funcs, weights)}
    return vf.resolve_env_config({"taskset": {"id": TASKSET_ID, **taskset, "task": {"rewards": rewards}}})


def load_environment(reward_weights: dict[str, float] | None = None, **taskset: Any) -> vf.Env:
    """The verifiers environment of ``taskset`` fields (``task_id``, ``force_decay``,
    ``seed_start``, ``num_tasks``, ``prompt_format``) with ``reward_weights`` overrides."""
    return vf.load_environment(env_config(reward_weights, **taskset))


__all__ = ["AlignerTask", "AlignerTaskset", "CaseData", "env_config", "load_environment"]
