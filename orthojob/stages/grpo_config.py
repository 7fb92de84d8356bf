"""The GRPO stage's configuration: :class:`GRPOJobConfig`, every ``orthojob grpo`` flag.

Modelled on TRL's ``trl/trainer/grpo_config.py``: one frozen dataclass, help text in each field's
metadata, flags generated from the fields (:func:`orthojob.stages.flags.add_config_arguments`), and the
checks that need nothing but the config in ``__post_init__`` (a bad value raises
:class:`ConfigError` naming the flag). Checks that depend on the launch -- the number of processes,
whether a GPU and vLLM are there -- are :func:`validate`'s, called before any model loads.

TRL generates ``batch_size x grad_accum x world_size`` completions per optimizer step, and each
prompt's group of ``num_generations`` must fit in it: :func:`generation_batch`.

Change a config with :func:`dataclasses.replace` (which checks again); it is never mutated.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from orthojob.agentic.reward import reward_agentic
from orthojob.core.prompts import cell_turns
from orthojob.ops import progress
from orthojob.ops.run_identity import POLICIES
from orthojob.rewards.reward_functions import RewardFunc, active_reward_funcs, reward_weights
from orthojob.rewards.strategy_advantage import STRATEGY_ADVANTAGES
from orthojob.stages.flags import (
    CollectPairs,
    engine_field,
    name_list,
    name_weight,
    non_negative_int,
    positive_int,
)
from orthojob.stages.training_config import ConfigError, TrainingConfig, cases_field, output_field
from server.cases import HELDOUT_SEED_START, TASK_IDS, TRAIN_SEED_START

VLLM_MODES: tuple[str, ...] = ("colocate", "server")
OBJECTIVES: tuple[str, ...] = ("raw", "engine")
SAMPLERS: tuple[str, ...] = ("shared-prefix", "generate")
"""What GRPO's rewards judge: the plan as written, or the plan the staging engine executes."""
LOSS_TYPES: tuple[str, ...] = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo")
"""TRL's GRPO loss formulations that need no other setting (``GRPOConfig.loss_type``; TRL 1.15 and 1.16 default
to ``dapo``; clip ratios are logged for all but ``cispo``, which logs ``cispo_clip_ratio``)."""
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
"""How TRL divides the centred rewards into advantages (``GRPOConfig.scale_rewards``; default ``group``)."""
LR_SCHEDULERS: tuple[str, ...] = ("linear", "constant", "cosine", "constant_with_warmup")
MODES: tuple[str, ...] = ("oneshot", "agentic")
"""``oneshot``: the policy writes a whole plan, scored by the five rewards. ``agentic``: the policy
calls the environment's tools (:mod:`orthojob.agentic.tools`, TRL's ``environment_factory``) and is scored
by the environment's reward (:func:`orthojob.agentic.reward.reward_agentic`)."""
COMPLETIONS_FILE = "completions.jsonl"
"""In ``--out``: every training completion with its step, case and rewards (``--analyze`` reads it)."""
TRAIN_LOG_FILE = "train_log.json"
"""In ``--out``: TRL's log history."""
COMPLETIONS_TABLE = "completions.json"
"""The stage run's MLflow table (``mlflow.log_table``) of training completions, rows added every step."""


LEVEL_WEIGHT_FLAG: dict[str, Any] = {"type": name_weight, "action": CollectPairs, "metavar": "LEVEL=W"}
"""A repeatable ``LEVEL=W`` flag collected into a dict of task level -> turns per round of a mixed prompt
set (:func:`orthojob.core.prompts.cell_turns`): this config's ``level_weights`` and the learning
experiment's."""


@dataclass(frozen=True)
class GRPOJobConfig(TrainingConfig):
    """Every ``orthojob grpo`` flag (field ``x_y`` is flag ``--x-y``): the shared training fields
    (:class:`~orthojob.stages.training_config.TrainingConfig`) and GRPO's own.

    The defaults follow the project's original specification where it set one, except the batch: 4
    completions per device and step, not its 2, so that a prompt's group of ``num_generations`` (4)
    completions fits in one generation batch, which TRL requires (:func:`validate`).
    """

    preset: str | None = field(
        default=None,
        metadata={"help": "named defaults (orthojob/stages/presets.py); explicit flags override them"},
    )
    steps: int = field(default=300, metadata={"help": "GRPO optimizer steps", "type": positive_int})
    num_generations: int = field(default=4, metadata={"help": "completions per prompt", "type": positive_int})
    batch_size: int = field(
        default=4, metadata={"help": "completions per device per step", "type": positive_int}
    )
    lr: float = field(default=5e-6, metadata={"help": "learning rate"})
    max_prompt_length: int = field(
        default=1536, metadata={"help": "longest prompt in tokens", "type": positive_int}
    )
    max_completion_length: int = field(
        default=512, metadata={"help": "longest completion in tokens", "type": positive_int}
    )
    max_seq_length: int = field(
        default=2048, metadata={"help": "prompt + completion budget", "type": positive_int}
    )
    out: str = output_field("./checkpoints/grpo")
    task_id: str = field(default="task_easy", metadata={"help": "the training task", "choices": TASK_IDS})
    force_decay: bool = field(default=False, metadata={"help": "pharmacokinetic force decay during training"})
    mixed_cells: bool = field(
        default=False,
        metadata={
            "help": "train on every task level under both dynamics, the prompts taking turns "
            "(task_id and force_decay then unused)"
        },
    )
    level_weights: dict[str, float] = field(
        default_factory=dict,
        metadata={
            **LEVEL_WEIGHT_FLAG,
            "help": "with --mixed-cells: a task level's turns per round of the prompt mix (repeatable; default 1 "
            "each, e.g. task_hard=2 gives task_hard half the prompts)",
            "flag": "--level-weight",
        },
    )
    cases: str | None = cases_field(
        "train on its training patients and gate on its held-out ones (task_id, mixed_cells and "
        "prompt_seed_start then unused)"
    )
    use_vllm: bool = field(default=False, metadata={"help": "generate with vLLM (GPU only)"})
    vllm_mode: str = field(
        default="colocate",
        metadata={"help": "vLLM in this process or a trl vllm-serve server", "choices": VLLM_MODES},
    )
    vllm_server_url: str | None = field(
        default=None, metadata={"help": "base URL of the trl vllm-serve server (server mode)"}
    )
    vllm_server_timeout: float = field(
        default=240.0,
        metadata={"help": "server mode: seconds to wait for the vLLM server at start (TRL's default 240)"},
    )
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "colocate mode"})
    from_checkpoint: str | None = field(
        default=None, metadata={"help": "start from this SFT checkpoint (needs its passed gate file)"}
    )
    skip_sft_gate: bool = field(
        default=False, metadata={"help": "do not require the SFT gate (NOT recommended)"}
    )
    on_foreign_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "when --out holds checkpoints of another config: refuse (exit 14), fresh (train from "
            "the start) or continue; default $ORTHORL_ON_FOREIGN_CHECKPOINT, else refuse",
            "choices": POLICIES,
        },
    )
    test: bool = field(
        default=False, metadata={"help": "smoke: prompts and every reward on real plans; no model"}
    )
    analyze: bool = field(
        default=False, metadata={"help": "emergent-behaviour metrics of <out>/completions.jsonl"}
    )
    num_prompts: int = field(
        default=0,
        metadata={
            "help": "training prompts; 0 = one per prompt group of every step",
            "type": non_negative_int,
        },
    )
    beta: float = field(
        default=0.0,
        metadata={"help": "KL coefficient; > 0 loads a reference model (and TRL logs kl)"},
    )
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    loss_type: str = field(
        default="dapo",
        metadata={"help": "TRL's GRPO loss formulation (GRPOConfig.loss_type)", "choices": LOSS_TYPES},
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "advantage = (reward - group mean) / std of the group, of the batch, or not scaled",
            "choices": SCALE_REWARDS,
        },
    )
    objective: str = field(
        default="raw",
        metadata={
            "help": "raw: the rewards judge the plan as written; engine: the staging engine in the loop, the "
            "rewards judge the plan it executes, a repaired plan paying the repair's cost "
            "(orthojob.rewards.rollouts.Rollout.objective)",
            "choices": OBJECTIVES,
        },
    )
    repair_cost_scale: float = field(
        default=1.0,
        metadata={
            "help": "with --objective engine, the repair cost's multiplier (> 0): 1 is the engine's own "
            "cost (server.staging_engine.repair_cost); smaller leaves more of the ranking to the executed "
            "plan's quality"
        },
    )
    sampler: str = field(
        default="shared-prefix",
        metadata={
            "help": "how completions are sampled without vLLM: shared-prefix runs each prompt through the "
            "model once for its group and drops a completion from the batch at its end "
            "(orthojob.modeling.sampling); generate is transformers' generate, as TRL calls it. The same "
            "sampling distribution; shared-prefix covers temperature, top-k and top-p and hands any other "
            "setting to generate",
            "choices": SAMPLERS,
        },
    )
    strategy_advantage: str = field(
        default="sequence",
        metadata={
            "help": "sequence: TRL's advantage on every token; centred: the tokens naming the strategy get "
            "it less their strategy's batch mean; counterfactual: they get the plan's reward less its "
            "mean under the five strategies, then centred; so GRPO learns which strategy fits which "
            "case rather than one strategy for all (orthojob.rewards.strategy_advantage)",
            "choices": STRATEGY_ADVANTAGES,
        },
    )
    strategy_advantage_scale: float = field(
        default=1.0,
        metadata={"help": "centred, counterfactual: multiplies the strategy tokens' advantage"},
    )
    strategy_lr_scale: float = field(
        default=1.0,
        metadata={
            "help": "the output layer's rows of the tokens that spell the five strategies (the diagnosis "
            "read-out) learn at --lr x this; full fine-tuning only (an adapter leaves lm_head frozen)"
        },
    )
    lr_scheduler_type: str = field(
        default="linear", metadata={"help": "learning-rate schedule (no warm-up)", "choices": LR_SCHEDULERS}
    )
    prompt_seed_start: int = field(
        default=TRAIN_SEED_START,
        metadata={
            "help": f"training prompts are the cases from this seed up (below the held-out {HELDOUT_SEED_START:,})",
            "type": non_negative_int,
        },
    )
    completions_table_rows: int = field(
        default=64,
        metadata={
            "help": "completions per step added to the MLflow table completions.json (whole prompt groups "
            "first); 0 = no table",
            "type": non_negative_int,
        },
    )
    gradient_checkpointing: bool = field(
        default=True, metadata={"help": "gradient checkpointing", "negatable": True, "show_default": False}
    )
    save_steps: int = field(
        default=0,
        metadata={"help": "checkpoint every N steps; 0 = only at the end", "type": non_negative_int},
    )
    rewards: list[str] | None = field(
        default=None,
        metadata={"help": "comma list of reward functions (default: all five)", "type": name_list},
    )
    reward_weights: dict[str, float] = field(
        default_factory=dict,
        metadata={
            "help": "weight of one reward (repeatable; default 1 each)",
            "flag": "--reward-weight",
            "type": name_weight,
            "action": CollectPairs,
            "metavar": "NAME=W",
        },
    )
    gate_seeds: int = field(
        default=50, metadata={"help": "GRPO gate: seeds per level and dynamics", "type": positive_int}
    )
    engine: str = engine_field()
    mode: str = field(
        default="oneshot",
        metadata={
            "help": "oneshot: write the whole plan (five rewards); agentic: plan with the environment's "
            "tools (TRL environment_factory, the environment's reward)",
            "choices": MODES,
        },
    )
    max_tool_turns: int = field(
        default=8,
        metadata={
            "help": "agentic mode: most tool-calling turns per rollout (TRL max_tool_calling_iterations)",
            "type": positive_int,
        },
    )
    env_url: str | None = field(
        default=None,
        metadata={
            "help": "agentic mode: run the tools on the environment server at this URL (python -m server.app; "
            "one WebSocket session per rollout: its --max-sessions must hold a generation batch) instead of "
            "in process"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in (
            "num_generations",
            "max_completion_length",
            "max_prompt_length",
            "max_seq_length",
            "gate_seeds",
            "max_tool_turns",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.num_generations < 2:
            raise ConfigError(
                f"--num-generations must be >= 2, got {self.num_generations}: GRPO's advantage compares "
                "completions of the same prompt"
            )
        if self.max_prompt_length + self.max_completion_length > self.max_seq_length:
            raise ConfigError(
                f"--max-prompt-length ({self.max_prompt_length}) + --max-completion-length "
                f"({self.max_completion_length}) exceeds --max-seq-length ({self.max_seq_length})"
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"--lr must be a finite number > 0, got {self.lr}")
        if not (math.isfinite(self.strategy_advantage_scale) and self.strategy_advantage_scale > 0):
            raise ConfigError(
                f"--strategy-advantage-scale must be a finite number > 0, got {self.strategy_advantage_scale}"
            )
        if not (math.isfinite(self.strategy_lr_scale) and self.strategy_lr_scale > 0):
            raise ConfigError(
                f"--strategy-lr-scale must be a finite number > 0, got {self.strategy_lr_scale}"
            )
        if self.strategy_lr_scale != 1.0 and self.lora_r > 0:
            raise ConfigError(
                "--strategy-lr-scale needs full fine-tuning (--lora-r 0): a LoRA adapter leaves lm_head frozen"
            )
        if self.strategy_advantage != "sequence" and self.mode == "agentic":
            raise ConfigError(
                "--strategy-advantage centred or counterfactual is for --mode oneshot (a tool rollout names no strategy)"
            )
        if self.beta < 0 or self.temperature <= 0:
            raise ConfigError(
                f"--beta must be >= 0 and --temperature > 0, got {self.beta}, {self.temperature}"
            )
        for name, allowed in (
            ("loss_type", LOSS_TYPES),
            ("scale_rewards", SCALE_REWARDS),
            ("lr_scheduler_type", LR_SCHEDULERS),
            ("strategy_advantage", STRATEGY_ADVANTAGES),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )
        for name in ("prompt_seed_start", "completions_table_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 0, got {value!r}")
        if self.prompt_seed_start >= HELDOUT_SEED_START:
            raise ConfigError(
                f"--prompt-seed-start must be below the held-out seeds ({HELDOUT_SEED_START}), "
                f"got {self.prompt_seed_start}"
            )
        if self.mode not in MODES:
            raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.env_url is not None and (
            self.mode != "agentic" or not self.env_url.startswith(("http://", "https://"))
        ):
            raise ConfigError(
                f"--env-url needs --mode agentic and an http(s):// URL, got {self.env_url!r} ({self.mode})"
            )
        if (
            isinstance(self.repair_cost_scale, bool)
            or not isinstance(self.repair_cost_scale, (int, float))
            or not (0 < self.repair_cost_scale < float("inf"))
        ):
            raise ConfigError(
                f"--repair-cost-scale must be a number > 0 (at 0 leaning on the engine is free), got {self.repair_cost_scale!r}"
            )
        if self.mode == "agentic" and self.objective != "raw":
            raise ConfigError(
                "--objective engine is for --mode oneshot (the agentic reward is the environment's)"
            )
        if self.mode == "agentic" and (self.rewards is not None or self.reward_weights):
            raise ConfigError(
                "--mode agentic is scored by the environment's reward alone (orthojob.agentic.reward.reward_agentic): "
                "drop --rewards and --reward-weight"
            )
        if self.cases is not None and (self.mode == "agentic" or self.mixed_cells):
            raise ConfigError(
                "--cases trains --mode oneshot on the set's own cases: drop --mode agentic / --mixed-cells"
            )
        if self.level_weights:
            if not self.mixed_cells:
                raise ConfigError(
                    "--level-weight weighs the cells of --mixed-cells: add --mixed-cells or drop it"
                )
            try:
                cell_turns(self.level_weights)
            except ValueError as exc:
                raise ConfigError(f"--level-weight: {exc}") from None
        if self.mixed_cells and self.mode == "agentic":
            raise ConfigError("--mixed-cells is for --mode oneshot; agentic prompts take one --task-id")
        if self.task_id not in TASK_IDS:
            raise ConfigError(f"--task-id must be one of {', '.join(TASK_IDS)}, got {self.task_id!r}")
        if self.vllm_mode not in VLLM_MODES:
            raise ConfigError(f"--vllm-mode must be one of {', '.join(VLLM_MODES)}, got {self.vllm_mode!r}")
        if not 0.0 < self.vllm_gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"--vllm-gpu-memory-utilization must be in (0, 1], got {self.vllm_gpu_memory_utilization}"
            )
        try:
            _ = self.weights  # resolves (and caches) the reward functions once
        except ValueError as exc:
            raise ConfigError(f"--rewards / --reward-weight: {exc}") from None

    @functools.cached_property
    def reward_funcs(self) -> list:
        """The active reward functions (:func:`orthojob.rewards.reward_functions.active_reward_funcs`), in order,
        resolved once per config; in agentic mode the environment's (:func:`orthojob.agentic.reward.reward_agentic`)."""
        if self.mode == "agentic":
            return [reward_agentic]
        return active_reward_funcs(self.rewards)

    @functools.cached_property
    def weights(self) -> list[float]:
        """GRPOConfig.reward_weights of :attr:`reward_funcs` (:func:`orthojob.rewards.reward_functions.reward_weights`)."""
        if self.mode == "agentic":
            return [1.0]
        return reward_weights(self.reward_funcs, self.reward_weights)


def world_size() -> int:
    """Processes of this launch (torchrun/accelerate set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def generation_batch(config: GRPOJobConfig, n_processes: int | None = None) -> int:
    """Completions generated per optimizer step over all processes."""
    return config.batch_size * config.grad_accum * (n_processes or world_size())


def validate(config: GRPOJobConfig, n_processes: int | None = None, cuda: bool | None = None) -> None:
    """Raise ConfigError (naming the flags) for a config this launch cannot train. Loads no model.

    ``n_processes``: the launch's processes (default :func:`world_size`); ``cuda``: whether a GPU is
    usable (None: ask torch only when the config needs to know).
    """
    n_processes = n_processes or world_size()
    total = generation_batch(config, n_processes)
    if total % config.num_generations:
        fits = config.num_generations * max(1, math.ceil(config.batch_size / config.num_generations))
        raise ConfigError(
            f"--batch-size ({config.batch_size}) x --grad-accum ({config.grad_accum}) x processes "
            f"({n_processes}) = {total} completions per step, which is not divisible by --num-generations "
            f"({config.num_generations}): every prompt's group of {config.num_generations} completions must "
            f"fit in one generation batch. Use e.g. --batch-size {fits}, or a --grad-accum / "
            "--num-generations that makes the product a multiple."
        )
    if config.use_vllm and not (config.test or config.analyze):
        if cuda is None:
            import torch  # only here: asking for a GPU is the one reason to import torch at validation

            cuda = torch.cuda.is_available()
        if not cuda:
            raise ConfigError("--use-vllm needs a CUDA GPU (vLLM does not generate on CPU); drop --use-vllm")
        if config.vllm_mode == "colocate":
            try:
                import vllm  # noqa: F401  (an optional GPU dependency: only probed)
            except ImportError:
                raise ConfigError(
                    "--use-vllm --vllm-mode colocate needs the vllm package (pip install vllm), or use "
                    "--vllm-mode server with a running `trl vllm-serve`"
                ) from None


__all__ = [
    "COMPLETIONS_FILE",
    "COMPLETIONS_TABLE",
    "LOSS_TYPES",
    "LR_SCHEDULERS",
    "MODES",
    "SCALE_REWARDS",
    "TRAIN_LOG_FILE",
    "VLLM_MODES",
    "ConfigError",
    "GRPOJobConfig",
    "generation_batch",
    "validate",
    "world_size",
]


SERVER_WAIT_MARGIN_S = 600
"""vLLM server mode: the process group's timeout (ddp_timeout) exceeds rank 0's wait for the server
(vllm_server_timeout) by this much (connecting, the weight-transfer group, the first gather)."""


def build_grpo_args(
    config: GRPOJobConfig, devices: dict, n_processes: int, reward_funcs: Sequence[RewardFunc] | None = None
) -> tuple[Any, list[RewardFunc]]:
    """TRL's GRPOConfig for a job config, and the reward functions it weights (default: the
    config's, :attr:`GRPOJobConfig.reward_funcs`)."""
    from trl import GRPOConfig  # TRL loads only where a GRPO run starts

    funcs = list(reward_funcs if reward_funcs is not None else config.reward_funcs)
    kwargs: dict[str, Any] = {
        "output_dir": config.out,
        "max_steps": config.steps,
        "learning_rate": config.lr,
        "per_device_train_batch_size": config.batch_size,
        "gradient_accumulation_steps": config.grad_accum,
        "num_generations": config.num_generations,
        "max_completion_length": config.max_completion_length,
        "temperature": config.temperature,
        "beta": config.beta,
        "loss_type": config.loss_type,
        "scale_rewards": config.scale_rewards,
        "lr_scheduler_type": config.lr_scheduler_type,
        "seed": config.seed,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "steps" if config.save_steps else "no",
        "save_steps": config.save_steps or 500,
        "bf16": devices["bf16"],
        "fp16": False,
        "use_cpu": not devices["cuda"],
        "gradient_checkpointing": config.gradient_checkpointing,
        "reward_weights": config.weights
        if reward_funcs is None
        else reward_weights(funcs, config.reward_weights),
        "ddp_find_unused_parameters": False,
        "dataloader_num_workers": 0,
        "log_completions": False,
        "disable_tqdm": not progress.trainer_bars(),  # a bar on a terminal, log lines in a Job
        "use_vllm": config.use_vllm,
    }
    if config.mode == "agentic":
        kwargs["max_tool_calling_iterations"] = config.max_tool_turns
    if n_processes > 1 and not devices["cuda"]:
        kwargs["ddp_backend"] = "gloo"
    if config.use_vllm:
        kwargs["vllm_mode"] = config.vllm_mode
        if config.vllm_mode == "server" and config.vllm_server_url:
            kwargs["vllm_server_base_url"] = config.vllm_server_url
            kwargs["vllm_server_timeout"] = config.vllm_server_timeout
            # while rank 0 waits for the server, the other ranks wait at their first collective for
            # the process group's timeout (transformers' default 1800 s): longer than rank 0's wait
            kwargs["ddp_timeout"] = max(1800, math.ceil(config.vllm_server_timeout) + SERVER_WAIT_MARGIN_S)
        if config.vllm_mode == "colocate":
            kwargs["vllm_gpu_memory_utilization"] = config.vllm_gpu_memory_utilization
    return GRPOConfig(**kwargs), funcs
