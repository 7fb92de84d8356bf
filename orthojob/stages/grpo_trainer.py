"""The GRPO training loop on TRL's GRPOTrainer, with the five project rewards called by TRL itself.

* :func:`build_grpo_args`: TRL's ``GRPOConfig`` of a :class:`orthojob.stages.grpo_config.GRPOJobConfig`
  (bf16 only where the GPU has it; vLLM colocate or server on request).
* :class:`RecordingGRPOTrainer`: GRPOTrainer that appends every generated completion (with its case
  and rewards) to ``completions.jsonl``, adds up to ``completions_table_rows`` of them per step to the
  MLflow table ``completions.json`` (case, completion, each reward, TRL's advantage and the clinical
  canaries that are not rewards), and logs per step, beside TRL's own metrics: ``env/*`` diagnostics,
  ``rewards/<name>/group_std`` (each reward's std within a prompt's group, averaged over the groups;
  TRL's ``rewards/<name>/std`` is over the whole batch) and ``reward_time_share`` (the reward
  functions' wall time as a share of the optimizer step's).
* :func:`train`: loads the policy through :mod:`orthojob.modeling.models` (Unsloth 4-bit on a GPU when it
  imports, else PEFT LoRA, QLoRA on a GPU; full fine-tuning with ``lora_r 0``), trains, saves, and
  calls ``on_saved(out)`` on rank 0 before the ranks part (the job runs the GRPO gate there).
* ``--mode agentic``: the trainer gets ``environment_factory=DentalToolEnv`` and the environment's reward
  (:mod:`orthojob.agentic.tools`); the tokenizer a tool-calling chat template where it lacks one; the tool
  metrics (``agentic/*``) come from the reward function's ``log_metric``; the one-shot table and
  ``env/*`` diagnostics are skipped and ``completions.jsonl`` holds each rollout's messages. With
  ``--env-url`` the factory is :class:`orthojob.agentic.tools.RemoteToolEnvFactory` (the tools over the
  environment server), whose WebSocket sessions are closed when training ends, or fails.
* Data parallel: launch with ``torchrun --nproc_per_node N -m orthojob.cli train ...``. Only rank 0
  writes files; every rank ends the process group in :func:`orthojob.ops.process_group.end_process_group`, which first lets go
  of the DDP wrapper that keeps it alive.

Import this module after :func:`orthojob.modeling.models.device_info` has run: Unsloth must be imported
before TRL where it is used, which is why :mod:`orthojob.stages.grpo` imports this module lazily.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate.utils import gather_object
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context
from trl.models import unwrap_model_for_generation

from orthojob.agentic.chat_template import prepare_tokenizer
from orthojob.agentic.prompts import agentic_rows, full_prompt
from orthojob.agentic.remote import check_server_capacity
from orthojob.agentic.tools import DentalToolEnv, RemoteToolEnvFactory
from orthojob.core.parsing import completion_text
from orthojob.core.prompts import mixed_prompt_rows, prompt_format_of, prompt_rows
from orthojob.data import case_sets
from orthojob.eval.viewer_logging import grpo_viewer_callback
from orthojob.modeling import models, sampling
from orthojob.ops import progress, tracking
from orthojob.ops.checkpoints import checkpoint_sync_callback
from orthojob.ops.process_group import end_process_group
from orthojob.ops.records import json_value
from orthojob.rewards.canaries import rollout_record
from orthojob.rewards.diagnostics import env_diagnostics
from orthojob.rewards.reward_functions import RewardFunc
from orthojob.rewards.rollouts import DEFAULT_CACHE
from orthojob.rewards.strategy_advantage import strategy_token_advantages, strategy_token_ids
from orthojob.stages.grpo_config import (
    COMPLETIONS_FILE,
    COMPLETIONS_TABLE,
    TRAIN_LOG_FILE,
    ConfigError,
    GRPOJobConfig,
    build_grpo_args,
    generation_batch,
    world_size,
)
from server.agent_tools import TOOL_NAMES
from server.cases import HELDOUT_SEED_START, TASK_IDS, CaseKey, generate_case

log = logging.getLogger(__name__)

TABLE_TEXT_CHARS = 4000


def _timeable(func: Any) -> bool:
    """A plain synchronous reward function (not a model id, a reward model or a coroutine)."""
    return (
        callable(func)
        and hasattr(func, "__name__")
        and not isinstance(func, (str, torch.nn.Module))
        and not inspect.iscoroutinefunction(func)
    )


def group_std(values: Sequence[float], group_size: int) -> float:
    """The mean over consecutive groups of ``group_size`` of each group's std (NaN-aware, Bessel-corrected
    as TRL's ``nanstd``); NaN when no group has two finite values."""
    arr = np.asarray(values, dtype=float).reshape(-1, group_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # groups with < 2 finite values
        stds = np.nanstd(arr, axis=1, ddof=1)
        return float(np.nanmean(stds)) if np.isfinite(stds).any() else math.nan


class _RewardClock(TrainerCallback):
    """Reward functions' wall time as a share of each optimizer step (generation + scoring + update):
    the trainer's ``reward_time_share`` metric. First in the callback list, so that a later
    callback's work at ``on_step_end`` (an evaluation) is not counted in the step."""

    def __init__(self, trainer: RecordingGRPOTrainer):
        self.trainer = trainer
        self.t0 = 0.0
        self.r0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()
        self.r0 = self.trainer.reward_seconds

    def on_step_end(self, args, state, control, **kwargs):
        wall = time.perf_counter() - self.t0
        self.trainer.step_seconds += wall
        if wall > 0:
            share = (self.trainer.reward_seconds - self.r0) / wall
            self.trainer._metrics["train"]["reward_time_share"].append(share)


class RecordingGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that records every generated completion and logs the diagnostics of its rewards.

    It hooks ``_generate_and_score_completions`` (one call per generation batch): afterwards TRL's
    ``_logs`` hold exactly that batch, gathered from all processes, in the order of the inputs
    (prompt groups of ``num_generations`` consecutive completions, with TRL's advantages). The case
    keys are gathered the same way. Rank 0 writes ``completions.jsonl`` and buffers up to
    :attr:`table_rows` rows, which :meth:`log` appends to the active MLflow run's table
    :attr:`table_file`; all ranks join the gather. The reward functions are wrapped to time them
    (names kept): ``reward_time_share`` per step, :attr:`reward_seconds` and :attr:`step_seconds`
    over the run.
    """

    record_completions: bool = False  # set on every rank: the gather below is collective
    agentic: bool = False  # tool rollouts (orthojob.agentic.tools): no one-shot table rows or env/* metrics
    completions_path: Path | None = None  # set on rank 0 only
    table_rows: int = 0  # rows per logging step for the MLflow table (rank 0); 0 = no table
    table_file: str = COMPLETIONS_TABLE
    strategy_advantage: str = "sequence"  # orthojob.rewards.strategy_advantage.STRATEGY_ADVANTAGES
    strategy_advantage_scale: float = 1.0
    strategy_lr_scale: float = 1.0  # GRPOJobConfig.strategy_lr_scale; set before train() builds the optimizer
    sampler: str = "generate"  # GRPOJobConfig.sampler
    _record_warned = False

    def __init__(self, model, reward_funcs, *args, **kwargs):
        self.reward_seconds = 0.0  # this rank's reward functions, over the run
        self.step_seconds = 0.0  # this rank's optimizer steps, over the run
        self._table: list[dict] = []
        if isinstance(reward_funcs, (list, tuple)):
            reward_funcs = [self._timed(f) if _timeable(f) else f for f in reward_funcs]
        elif _timeable(reward_funcs):
            reward_funcs = self._timed(reward_funcs)
        super().__init__(model, reward_funcs, *args, **kwargs)
        self.callback_handler.callbacks.insert(0, _RewardClock(self))

    @classmethod
    def from_config(cls, config: GRPOJobConfig, is_main: bool = True, **kwargs: Any) -> RecordingGRPOTrainer:
        """The job's trainer, ``cls(**kwargs)`` set as ``config`` says; rank 0 (``is_main``) records."""
        trainer = cls(**kwargs)
        progress.attach(trainer, "grpo")
        trainer.agentic, trainer.record_completions = config.mode == "agentic", True
        trainer.completions_path = Path(config.out) / COMPLETIONS_FILE if is_main else None
        trainer.table_rows = config.completions_table_rows if is_main else 0
        for name in ("strategy_advantage", "strategy_advantage_scale", "strategy_lr_scale", "sampler"):
            setattr(trainer, name, getattr(config, name))  # the config's settings of the same names
        return trainer

    def create_optimizer(self):
        """TRL's optimizer; with :attr:`strategy_lr_scale` != 1 the rows of the output layer that
        spell the five strategies (:func:`orthojob.rewards.strategy_advantage.strategy_token_ids`) learn
        at ``learning_rate x strategy_lr_scale``, every other parameter at the learning rate.

        Adam has no per-row rate: the output layer gets its own group at the scaled rate, and a
        step hook brings every other row of it back to the unscaled step (old + step / scale)."""
        if self.strategy_lr_scale == 1.0 or self.optimizer is not None:
            return super().create_optimizer()
        head = self.model.get_output_embeddings().weight
        if not head.requires_grad:
            raise ValueError("strategy_lr_scale needs a trainable output layer (full fine-tuning)")
        decay = set(self.get_decay_parameter_names(self.model))
        groups: dict[tuple[bool, bool], list] = {}
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                groups.setdefault((p is head, name in decay), []).append(p)
        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        lr = optimizer_kwargs.pop("lr", self.args.learning_rate)
        scale = self.strategy_lr_scale
        self.optimizer = optimizer_cls(
            [
                {
                    "params": params,
                    "lr": lr * (scale if is_head else 1.0),
                    "weight_decay": self.args.weight_decay if decays else 0.0,
                }
                for (is_head, decays), params in groups.items()
            ],
            **optimizer_kwargs,
        )
        others = torch.ones(head.shape[0], dtype=torch.bool, device=head.device)
        others[strategy_token_ids(self.processing_class)] = False
        before: list[torch.Tensor] = []

        def keep(optimizer, args, kwargs):
            before[:] = [head.detach()[others].clone()]

        def unscale(optimizer, args, kwargs):
            with torch.no_grad():
                head[others] = before[0] + (head[others] - before[0]) / scale

        self.optimizer.register_step_pre_hook(keep)
        self.optimizer.register_step_post_hook(unscale)
        return self.optimizer

    def _timed(self, func: Callable) -> Callable:
        @functools.wraps(func)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                self.reward_seconds += time.perf_counter() - t0

        return timed

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        """TRL's generation, or (:attr:`sampler` ``shared-prefix``, no vLLM, no images, settings it covers)
        :func:`orthojob.modeling.sampling.sample_completions`: the same distribution, TRL's profiling name."""
        plain = self.sampler != "shared-prefix" or self.use_vllm or self.use_transformers_continuous_batching
        if plain or images or multimodal_fields or not sampling.covers(self.generation_kwargs):
            turn = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
            return super()._generate_single_turn(*turn)
        unwrapped = unwrap_model_for_generation(
            self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation,
            generation_kwargs=self.generation_kwargs,
            gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
        )  # fmt: skip
        gathered = self._dist.summon_full_params(self.model_wrapped, recurse=False)
        with profiling_context(self, "transformers.generate"), unwrapped as model, gathered:
            ids = sampling.sample_completions(
                model, prompt_ids, max_new_tokens=self.max_completion_length, eos_token_ids=self.eos_token_ids,
                pad_token_id=self._tokenizer.pad_token_id, temperature=self.temperature, top_k=self.top_k,
                top_p=self.top_p,
            )  # fmt: skip
        return ids, None

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training and not self.agentic and self.strategy_advantage != "sequence":
            self._strategy_token_advantages(output, [CaseKey.of_row(x) for x in inputs])
        if self.model.training:
            self._log_group_std(len(inputs) * self.accelerator.num_processes)
            if self.record_completions:
                cases = gather_object([CaseKey.of_row(x) for x in inputs])
                if self.accelerator.is_main_process and (
                    self.completions_path is not None or self.table_rows
                ):
                    self._record([CaseKey(*c) for c in cases])
        return output

    def _strategy_token_advantages(self, output: dict, cases: list[CaseKey]) -> None:
        """Token-level advantages (B, T) in place of TRL's (B,): the tokens naming the strategy get
        :attr:`strategy_advantage`'s value (:func:`orthojob.rewards.strategy_advantage.strategy_token_advantages`,
        over this process's batch; ``counterfactual`` scores each plan under the five strategies
        with this trainer's reward functions and weights), every other token TRL's. Logs
        ``strategy_advantage/<diagnostic>``."""
        advantages = output["advantages"]
        ids, mask = output["completion_ids"].tolist(), output["completion_mask"].tolist()
        width = len(ids[0]) if ids else 0
        flat = self.processing_class.batch_decode([[t] for row in ids for t in row], skip_special_tokens=True)
        pieces = [
            [p if keep else "" for p, keep in zip(flat[r * width : (r + 1) * width], mask[r])]
            for r in range(len(ids))
        ]
        token_advantages, diagnostics = strategy_token_advantages(
            advantages.detach().float().cpu().numpy(),
            pieces,
            self.strategy_advantage_scale,
            kind=self.strategy_advantage,
            score=lambda texts, rows: self._weighted_reward(texts, [cases[r] for r in rows]),
        )
        output["advantages"] = torch.as_tensor(
            token_advantages, dtype=advantages.dtype, device=advantages.device
        )
        for key, value in diagnostics.items():
            self._metrics["train"][f"strategy_advantage/{key}"].append(value)

    def _weighted_reward(self, texts: list[str], cases: list[CaseKey]):
        """(len(texts),) the reward functions' weighted sum (NaN-skipping, as TRL sums them) of
        each text as a completion for its case."""
        columns = {
            "seed": [c.seed for c in cases],
            "task_id": [c.task_id for c in cases],
            "force_decay": [c.force_decay for c in cases],
        }
        total = torch.zeros(len(texts))
        for func, weight in zip(self.reward_funcs, self.reward_weights.tolist()):
            values = torch.tensor([math.nan if v is None else float(v) for v in func(texts, **columns)])
            total += torch.nan_to_num(values * weight, nan=0.0)
        return total.numpy()

    def _log_group_std(self, n: int) -> None:
        """``rewards/<name>/group_std`` of the batch just scored (``n`` completions, every rank)."""
        size = self.num_generations
        logs = getattr(self, "_logs", None)
        if not logs or n % size:
            return
        for name in self.reward_func_names:
            values = list(logs["rewards"][name])[-n:] if name in logs["rewards"] else []
            if len(values) == n:
                self._metrics["train"][f"rewards/{name}/group_std"].append(group_std(values, size))

    def _record(self, cases: list[CaseKey]) -> None:
        logs = getattr(self, "_logs", None)
        n = len(cases)
        try:
            texts = list(logs["completion"])[-n:]
            rewards = {k: list(v)[-n:] for k, v in logs["rewards"].items()}
            advantages = list(logs["advantages"])[-n:]
        except (TypeError, KeyError):
            texts, rewards, advantages = [], {}, []
        if len(texts) != n or any(len(v) != n for v in rewards.values()) or len(advantages) != n:
            if not self._record_warned:
                log.warning("completion recording skipped: TRL's completion logs do not match the batch")
                self._record_warned = True
            return
        step = self.state.global_step + 1  # the first optimizer step that trains on this batch
        texts = [_conversation_text(t) if self.agentic else completion_text(t) for t in texts]
        if self.completions_path is not None:
            with open(self.completions_path, "a", encoding="utf-8") as fh:
                for i, case in enumerate(cases):
                    rec = {
                        "step": step,
                        "seed": json_value(case.seed),
                        "task_id": case.task_id,
                        "force_decay": case.force_decay,
                        "completion": texts[i],
                        "rewards": {k: json_value(float(v[i])) for k, v in rewards.items()},
                        "advantage": json_value(float(advantages[i])),
                    }
                    fh.write(json.dumps(rec) + "\n")
        if self.agentic:  # the one-shot table and env/* score completion texts as plans: not these
            return
        if self.table_rows:
            try:
                self._table_rows(step, texts, rewards, advantages, cases)
            except Exception as exc:  # the table never stops training
                log.warning("completion table rows skipped: %s", exc)
        self._log_env_diagnostics(texts, cases)

    def _table_rows(
        self,
        step: int,
        texts: list[str],
        rewards: dict[str, list],
        advantages: list,
        cases: list[CaseKey],
    ) -> None:
        """Buffer rows for the MLflow table: whole prompt groups first, up to :attr:`table_rows` per
        logging step; each row the case, the completion, every reward, TRL's weighted sum and
        advantage, and the canaries (:func:`orthojob.rewards.canaries.rollout_record`)."""
        size = self.num_generations
        room = self.table_rows - len(self._table)
        take = min(len(texts), (room // size) * size or room)
        if take <= 0:
            return
        keep = range(take)
        rollouts = DEFAULT_CACHE.get_many(
            [texts[i] for i in keep],
            [cases[i].seed for i in keep],
            [cases[i].task_id for i in keep],
            [cases[i].force_decay for i in keep],
        )  # cache hits: the rewards scored them
        weights = [float(w) for w in self.reward_weights.tolist()]
        names = list(self.reward_func_names)
        for i, rollout in zip(keep, rollouts):
            case = cases[i]
            values = [float(rewards[name][i]) for name in names]
            finite = [w * v for w, v in zip(weights, values) if not math.isnan(v)]
            self._table.append(
                {
                    "step": step,
                    "group": i // size,
                    "task_id": case.task_id,
                    "seed": int(case.seed),
                    "force_decay": bool(case.force_decay),
                    "completion": texts[i][:TABLE_TEXT_CHARS],
                    **dict(zip(names, values)),
                    "reward": sum(finite) if finite else math.nan,
                    "advantage": float(advantages[i]),
                    **rollout_record(rollout, generate_case(*case)),
                }
            )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        super().log(logs, start_time)
        if self._table:
            rows, self._table = self._table, []
            if self.accelerator.is_main_process:
                tracking.log_table_rows(rows, self.table_file)

    def _log_env_diagnostics(self, texts: list[str], cases: list[CaseKey]) -> None:
        """env/* metrics of this batch (``texts``: completion texts, already normalised), averaged
        by TRL with its own metrics at the next log (rank 0)."""
        try:
            metrics = env_diagnostics(texts, cases)
        except Exception as exc:  # diagnostics never stop training
            log.warning("env diagnostics skipped: %s", exc)
            return
        for key, value in metrics.items():
            self._metrics["train"][key].append(value)


def _conversation_text(completion: object) -> str:
    """A tool rollout as text for ``completions.jsonl``: its messages (tool calls and tool results
    included) as JSON; a plain string as it is."""
    if isinstance(completion, str):
        return completion
    try:
        return json.dumps(json_value(completion), ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return completion_text(completion)


class StepTimer(TrainerCallback):
    """Wall time per optimizer step (generation + scoring + update)."""

    def __init__(self):
        self.t0 = 0.0
        self.times: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.t0)


@dataclass
class TrainResult:
    """What :func:`train` leaves: the trainer (weights on every rank), the output folder, the gate."""

    trainer: Any
    out: Path
    gate: Any = None
    gate_passed: bool | None = None
    step_times: list[float] = field(default_factory=list)
    reward_seconds: float = 0.0  # the reward functions' wall time over the run (this rank)


def trainable_digest(model) -> str:
    """sha256 over the names and values of a model's trainable parameters (float32, CPU)."""
    h = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if param.requires_grad:
            h.update(name.encode())
            h.update(param.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _resolve_model(config: GRPOJobConfig, is_main: bool, wait) -> str:
    """The base model to load: ``--model tiny`` builds the offline tiny model once, on rank 0."""
    if config.model != models.TINY_MODEL or config.from_checkpoint:  # a checkpoint brings its own model
        return config.model
    path = Path(config.out) / "tiny-model"
    if is_main:
        models.ensure_tiny(
            path,
            list(TASK_IDS) if config.mixed_cells else [config.task_id],
            config.force_decay,
            max_position_embeddings=config.max_seq_length,
        )
    wait()
    return str(path)


def _prompt_lengths(tokenizer, rows: Sequence[dict], tools: Sequence | None = None) -> list[int]:
    """Tokens of each row's prompt as the policy sees it (with ``tools``: the agentic prompt, the case
    appended and the tool schemas rendered, :func:`orthojob.agentic.prompts.full_prompt`)."""
    lengths = []
    for row in rows:
        if tools:
            text = tokenizer.apply_chat_template(
                full_prompt(row), tools=list(tools), add_generation_prompt=True, tokenize=False
            )
            lengths.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
            continue
        text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        lengths.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return lengths


def _callbacks(
    timer: StepTimer,
    is_main: bool,
    sync_to: str | None,
    identity: dict | None,
    extra: Sequence,
    viewed: Path | None = None,
) -> list:
    """The run's TrainerCallbacks; ``viewed``: the completions file whose best and worst completions
    get treatment viewers every GRPO_VIEWER_EVERY steps (:mod:`orthojob.eval.viewer`), None for none."""
    callbacks: list = [timer, *extra]
    mlflow = sys.modules.get("mlflow")  # only when a stage run was opened (the job imported mlflow)
    if is_main and mlflow is not None and mlflow.active_run() is not None:
        callbacks.append(tracking.trainer_callback())
        if viewed is not None:
            callbacks.append(grpo_viewer_callback(viewed))
    if is_main and (sync_to or identity is not None):
        callbacks.append(checkpoint_sync_callback(sync_to, config=identity))
    return callbacks


def train(
    config: GRPOJobConfig,
    sync_to: str | None = None,
    resume_from: str | None = None,
    reward_funcs: Sequence[RewardFunc] | None = None,
    on_saved: Callable[[Path], tuple[dict, bool]] | None = None,
    identity: dict | None = None,
    callbacks: Sequence = (),
) -> TrainResult:
    """Train with GRPO and save. Call :func:`orthojob.stages.grpo_config.validate` first.

    ``sync_to``: an ``s3://`` URI; every saved ``checkpoint-N`` is uploaded below it (rank 0).
    ``resume_from``: a local ``checkpoint-N`` folder to resume from (optimizer, scheduler, step).
    ``reward_funcs``: instead of the config's. ``on_saved(out) -> (gate, passed)``: run on rank 0
    once the model is saved, while the other ranks wait (the GRPO gate).
    ``identity``: the config whose digest every checkpoint records (:mod:`orthojob.ops.run_identity`);
    ``callbacks``: more TrainerCallbacks (the job's preemption guard).
    Metrics go to the active MLflow run (rank 0) when there is one.
    """
    devices = models.device_info()
    n_processes = world_size()
    out = Path(config.out)
    # initialises torch.distributed
    grpo_args, funcs = build_grpo_args(config, devices, n_processes, reward_funcs)
    state = grpo_args.distributed_state
    is_main = state.is_main_process
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        if resume_from is None:
            (out / COMPLETIONS_FILE).unlink(missing_ok=True)
    log.info(
        "GRPO on %s x%d, bf16=%s, vLLM=%s",
        "cuda" if devices["cuda"] else "cpu",
        n_processes,
        devices["bf16"],
        config.use_vllm and config.vllm_mode,
    )

    model_path = _resolve_model(config, is_main, state.wait_for_everyone)
    model, tokenizer = models.load_policy(
        model_path,
        checkpoint=config.from_checkpoint,
        lora_r=config.lora_r,
        max_seq_length=config.max_seq_length,
        use_vllm=config.use_vllm and config.vllm_mode == "colocate",
    )  # the tokenizer has a pad token

    prompts_per_step = generation_batch(config, n_processes) // config.num_generations
    n_prompts = config.num_prompts or max(8, config.steps * prompts_per_step)
    if config.prompt_seed_start + n_prompts > HELDOUT_SEED_START:
        raise ConfigError(
            f"--prompt-seed-start {config.prompt_seed_start} + {n_prompts} prompts reaches the held-out "
            f"seeds ({HELDOUT_SEED_START})"
        )
    agentic = config.mode == "agentic"
    extra: dict[str, Any] = {}
    tools = None
    if agentic:
        tokenizer = prepare_tokenizer(tokenizer)  # a chat template TRL can parse tool calls with
        rows = agentic_rows(n_prompts, config.prompt_seed_start, config.task_id, config.force_decay)
        probe = DentalToolEnv()
        tools = [getattr(probe, name) for name in TOOL_NAMES]
        extra["environment_factory"] = DentalToolEnv
        if config.env_url:  # the tools over the server: one WebSocket session per rollout
            try:
                check_server_capacity(config.env_url, generation_batch(config, n_processes))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            extra["environment_factory"] = RemoteToolEnvFactory(config.env_url)
    elif config.cases is not None:  # the set's training patients, each case once an epoch
        loaded = case_sets.load_case_set(config.cases, config.heldout_share, config.force_decay)
        if not loaded.train:
            raise ConfigError(f"--cases {config.cases} leaves no training patient: lower --heldout-share")
        rows = loaded.rows("train", prompt_format_of(model))[: config.num_prompts or None]
        if is_main:
            loaded.log_input("train")
    elif config.mixed_cells:
        rows = mixed_prompt_rows(
            n_prompts, config.prompt_seed_start, prompt_format_of(model), config.level_weights
        )
    else:
        rows = prompt_rows(
            n_prompts, config.prompt_seed_start, config.task_id, config.force_decay, prompt_format_of(model)
        )
    if config.objective == "engine":  # the rewards read the column (orthojob.rewards.reward_functions)
        rows = [{**row, "engine": True, "repair_cost_scale": config.repair_cost_scale} for row in rows]
    longest = max(_prompt_lengths(tokenizer, rows, tools))
    if longest > config.max_prompt_length:
        raise ConfigError(
            f"the longest training prompt is {longest} tokens, over --max-prompt-length "
            f"({config.max_prompt_length}); raise it (and --max-seq-length) rather than cut the plan format"
        )

    timer = StepTimer()
    viewed = None if agentic else out / COMPLETIONS_FILE
    trainer = RecordingGRPOTrainer.from_config(
        config,
        is_main,
        model=model,
        reward_funcs=funcs,
        args=grpo_args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=_callbacks(timer, is_main, sync_to, identity, callbacks, viewed),
        **extra,
    )
    try:
        trainer.train(resume_from_checkpoint=resume_from)
    finally:  # the environments' server sessions (--env-url): TRL never closes its pooled environments
        close_environments = getattr(extra.get("environment_factory"), "close", None)
        if callable(close_environments):
            close_environments()
    trainer.save_model(str(out))
    result = TrainResult(
        trainer=trainer, out=out, step_times=list(timer.times), reward_seconds=trainer.reward_seconds
    )
    if is_main:
        (out / TRAIN_LOG_FILE).write_text(
            json.dumps([json_value(row) for row in trainer.state.log_history], indent=1)
        )
        if on_saved is not None:
            result.gate, result.gate_passed = on_saved(out)
    state.wait_for_everyone()
    end_process_group(trainer)
    return result
