"""The verifiers face of the environment: the ``orthorl-aligner`` taskset (verifiers 0.4, ``verifiers.v1``).

verifiers resolves a taskset id to the installed module of that name (``orthorl-aligner`` ->
``orthorl_aligner``) and takes the ``Taskset`` subclass it exports in ``__all__``. Each task is one
case (``task_id``, ``seed``, ``force_decay``) with the one-shot prompt the GRPO job trains on
(:func:`orthojob.core.prompts.build_messages`); its rewards are the job's five TRL reward functions
(:data:`orthojob.rewards.reward_functions.REWARD_FUNCS`) applied to the trace's reply, weighted as GRPO weights
them (:func:`orthojob.rewards.reward_functions.reward_weights`), so a trace's ``reward`` is the weighted sum TRL
computes for the same completion. No scoring here: the functions are the job's.

    import orthorl_aligner
    env = orthorl_aligner.load_environment(task_id="task_hard", force_decay=True, num_tasks=8)
    # or: vf-eval orthorl-aligner --env.taskset.task_id task_hard ...

``load_environment(**kwargs)`` is the Environments Hub's entry point; it builds the
``verifiers.v1`` env config and returns ``verifiers.v1.load_environment(config)``.

``mode="tools"``: multi-turn with the agentic tools. The prompt is the agentic GRPO prompt
(:func:`orthojob.agentic.prompts.full_prompt`), the tools :class:`orthorl_aligner.tools.StagingToolset` (an
MCP server verifiers launches per rollout, over :class:`orthojob.agentic.tools.DentalToolEnv`), and the
reward ``reward_agentic``: the environment-owned reward of the episode the tools played (the
submitted plan's or the 24 committed stages' scaled reward; -2 unfinished), as TRL's
:func:`orthojob.agentic.reward.reward_agentic`. In that mode the five one-shot rewards weigh 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf
from pydantic import Field, model_validator
from verifiers.v1.configs.task import RewardFunctionConfig

from orthojob.agentic.prompts import agentic_rows, full_prompt
from orthojob.core.prompts import TRAIN_SEED_START, build_messages, reset_observation
from orthojob.rewards.reward_functions import DEFAULT_REWARD_WEIGHTS, REWARD_FUNCS, reward_weights
from orthorl_aligner.tools import EpisodeState, StagingToolset
from server.cases import TASK_IDS
from server.reward_scaler import REWARD_MIN

TASKSET_ID = "orthorl-aligner"


class CaseData(vf.TaskData):
    """One case: the reward functions' dataset columns."""

    task_id: str
    seed: int
    force_decay: bool


def mode_weights(tools: bool) -> dict[str, float]:
    """The rewards' default weights: one-shot, GRPO's (:data:`DEFAULT_REWARD_WEIGHTS`) and the
    tools' reward 0; with the tools, ``reward_agentic`` alone (as ``--mode agentic`` trains)."""
    weights = {name: 0.0 if tools else w for name, w in DEFAULT_REWARD_WEIGHTS.items()}
    return {**weights, "reward_agentic": 1.0 if tools else 0.0}


def check_task_weights(weights: dict[str, float], tools: bool) -> None:
    """Raise ValueError unless the task's reward weights (every reward of :func:`mode_weights`) keep
    the ordering principle for the sum a trace's ``reward`` is: one-shot, the five rewards' weights
    pass :func:`orthojob.rewards.reward_functions.reward_weights` (its ordering check) and
    ``reward_agentic`` (no tools: -2 for every trace) weighs 0; with the tools, ``reward_agentic`` (the
    environment's scaled reward, which keeps the ordering itself) weighs > 0 and the five weigh 0."""
    agentic = weights["reward_agentic"]
    one_shot = {name: weights[name] for name in REWARD_FUNCS}
    if tools:
        weighing = [name for name, w in one_shot.items() if w != 0.0]
        if weighing or not agentic > 0.0:
            raise ValueError(
                "with tools=true the task is scored by reward_agentic alone (the episode the tools played): "
                f"give it a weight > 0 (got {agentic}) and the one-shot rewards 0"
                + (f" (got {', '.join(f'{n}={one_shot[n]}' for n in weighing)})" if weighing else "")
            )
        return
    if agentic != 0.0:
        raise ValueError(
            f"reward_agentic weighs {agentic} without the tools (tools=false), where it is -2 for every "
            "trace: give it weight 0, or set tools=true"
        )
    reward_weights(list(REWARD_FUNCS.values()), one_shot)


class AlignerTaskConfig(vf.TaskConfig):
    """``tools``: the multi-turn task with the agentic tools (their MCP server's config ``toolset``).
    Rewards without a weight in ``rewards`` weigh :func:`mode_weights`.

    Every weight the config is given, however (``rewards.<name>.weight`` from a config file or
    ``--env.taskset.task.rewards...``, or :func:`env_config`'s ``reward_weight_overrides``), passes
    :func:`check_task_weights`, the ordering principle; and the trace's ``reward`` is the job's rewards
    alone, so a reward of another name, a plugged function (``rewards.<name>.fn``) and a judge with a
    weight other than 0 are refused: none of them sees the hard rules."""

    tools: bool = False
    toolset: vf.ToolsetConfig = vf.ToolsetConfig()

    @model_validator(mode="after")
    def _mode_weights(self) -> AlignerTaskConfig:
        defaults = mode_weights(self.tools)
        unknown = sorted(set(self.rewards) - set(defaults))
        if unknown:
            raise ValueError(
                f"rewards {', '.join(unknown)} are not this task's: its rewards are {', '.join(defaults)}"
            )
        plugged = sorted(name for name, config in self.rewards.items() if config.fn is not None)
        if plugged:
            raise ValueError(
                f"rewards.{plugged[0]}.fn replaces the job's reward function: this task's rewards are "
                "the job's, which keep the ordering principle; set a weight only"
            )
        weighted_judges = [getattr(judge, "name", "") or type(judge).__name__ for judge in self.judges
                           if judge.weight != 0.0]  # fmt: skip
        if weighted_judges:
            raise ValueError(
                f"judges {', '.join(weighted_judges)} would add to the reward: a judge does not see the hard "
                "rules, so a plan breaking one could outscore a safe plan; give a judge weight 0 (a metric)"
            )
        for name, weight in defaults.items():
            config = self.rewards.get(name)
            if config is None:
                self.rewards[name] = RewardFunctionConfig(weight=weight)
            elif config.weight is None:
                self.rewards[name] = config.model_copy(update={"weight": weight})
        check_task_weights({name: float(self.rewards[name].weight) for name in defaults}, self.tools)
        return self


class AlignerTasksetConfig(vf.TasksetConfig):
    """Which cases: ``num_tasks`` seeds from ``seed_start`` of ``task_id`` (force decay or not)."""

    task: AlignerTaskConfig = AlignerTaskConfig()

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


class AlignerTask(vf.Task[CaseData, EpisodeState, AlignerTaskConfig]):
    """A case's staging plan, scored by the job's five reward functions on the reply; with the
    tools, by the episode the tools played (``reward_agentic``)."""

    @classmethod
    def toolsets(cls, config: AlignerTaskConfig) -> list[vf.Toolset]:
        return [StagingToolset(config.toolset)] if config.tools else []

    @vf.reward(weight=0.0)
    async def reward_agentic(self, trace: vf.Trace) -> float:
        """The tools' episode reward (:attr:`orthojob.agentic.tools.DentalToolEnv.reward`); -2 unfinished."""
        reward = trace.state.reward
        return REWARD_MIN if reward is None else float(reward)


for _name in REWARD_FUNCS:
    setattr(AlignerTask, _name, _reward_method(_name))


class AlignerTaskset(vf.Taskset[AlignerTask, AlignerTasksetConfig]):
    """The cases of one task level (:class:`AlignerTasksetConfig`)."""

    def load(self) -> Iterator[AlignerTask]:
        config = self.config
        if config.task_id not in TASK_IDS:
            raise ValueError(f"task_id must be one of {', '.join(TASK_IDS)}, got {config.task_id!r}")
        for seed in range(config.seed_start, config.seed_start + config.num_tasks):
            if config.task.tools:
                (row,) = agentic_rows(1, seed, config.task_id, config.force_decay)
                messages = full_prompt(row)
            else:
                obs = reset_observation(seed, config.task_id, config.force_decay)
                messages = build_messages(obs, config.prompt_format)
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


def env_config(
    reward_weight_overrides: dict[str, float] | None = None, mode: str = "oneshot", **taskset: Any
) -> vf.EnvConfig:
    """The ``verifiers.v1`` env config of this taskset: ``taskset`` fields
    (:class:`AlignerTasksetConfig`), ``mode`` (``oneshot`` or ``tools``) and, one-shot, the rewards'
    weights (by any name :func:`reward_weights` accepts; the rest weigh as in GRPO). A ``task`` dict
    (:class:`AlignerTaskConfig` fields) is kept; its weights are checked like any
    (:meth:`AlignerTaskConfig._mode_weights`)."""
    if mode not in ("oneshot", "tools"):
        raise ValueError(f"mode must be 'oneshot' or 'tools', got {mode!r}")
    given = taskset.pop("task", None) or {}
    if not isinstance(given, dict):
        raise ValueError(f"task must be a dict of AlignerTaskConfig fields, got {type(given).__name__}")
    if "tools" in given and bool(given["tools"]) != (mode == "tools"):
        raise ValueError(f"task.tools={given['tools']!r} contradicts mode={mode!r}: set mode only")
    if reward_weight_overrides and given.get("rewards"):
        raise ValueError("give reward_weights or task.rewards, not both")
    task: dict[str, Any] = {**given, "tools": mode == "tools"}
    if mode == "tools" and reward_weight_overrides:
        raise ValueError(
            "reward_weights weigh the one-shot rewards; mode='tools' is scored by reward_agentic alone"
        )
    if reward_weight_overrides:
        funcs = list(REWARD_FUNCS.values())
        weights = reward_weights(funcs, reward_weight_overrides)
        task["rewards"] = {f.__name__: {"weight": w} for f, w in zip(funcs, weights)}
    return vf.resolve_env_config({"taskset": {"id": TASKSET_ID, **taskset, "task": task}})


def load_environment(
    reward_weights: dict[str, float] | None = None, mode: str = "oneshot", **taskset: Any
) -> vf.Env:
    """The verifiers environment of ``taskset`` fields (``task_id``, ``force_decay``,
    ``seed_start``, ``num_tasks``, ``prompt_format``), ``mode`` (``oneshot``: one reply scored by
    the five rewards; ``tools``: multi-turn with the agentic tools) and ``reward_weights`` overrides."""
    return vf.load_environment(env_config(reward_weights, mode, **taskset))


__all__ = ["AlignerTask", "AlignerTaskset", "CaseData", "env_config", "load_environment"]
