"""GRPO training (pipeline stage 3): ``orthojob train``.

The seed's ``train_grpo.py`` flags and behaviour, on TRL's GRPOTrainer, with the five project
rewards (:mod:`orthojob.rewards`) called by TRL itself:

* :class:`GRPOJobConfig` holds every flag; :data:`PRESETS` (``tiny-cpu``, ``qwen2.5-3b``) set
  defaults that explicit flags override (:func:`add_train_arguments`, :func:`config_from_args`).
* :func:`validate` checks the batch arithmetic (and lengths, vLLM, devices) **before any model
  loads**: TRL generates ``batch_size x grad_accum x world_size`` completions per optimizer step,
  and each prompt's group of ``num_generations`` must fit in it. The CLI exits 2 on a bad config.
* :func:`run_train` is the CLI body: ``--analyze`` (emergent-behaviour table,
  :mod:`orthojob.analysis`), the SFT gate pre-flight (:func:`orthojob.gate.check_gate`, its exit
  code on refusal), ``--test`` (the seed's smoke: prompts and every reward on real plans, no model),
  then :func:`train`.
* :func:`train` loads the policy through :mod:`orthojob.models` (Unsloth 4-bit on a GPU when it
  imports, else PEFT LoRA, QLoRA on a GPU; full fine-tuning with ``--lora-r 0``), trains with bf16
  only where the hardware has it, vLLM colocate or server on request, saves, and then runs the
  GRPO gate: the held-out evaluation (:func:`orthojob.gate.evaluate_checkpoint`) whose outcome
  :func:`orthojob.gate.write_gate` records. No gate file is written any other way.
* Data parallel: launch with ``torchrun --nproc_per_node N -m orthojob.cli train ...`` (on CPU
  ``accelerate launch --cpu --num_processes 2`` silently runs one process). Only rank 0 writes
  files; every rank ends with ``destroy_process_group``. A resumed run resumes on every rank
  from the same checkpoint (with ``--out s3://...`` the first rank of each node downloads it,
  the others reuse the verified copy).

Files in ``--out``: the adapter (or model) and tokenizer, ``completions.jsonl`` (every completion
with its step, case and rewards: the input of ``--analyze``), ``train_log.json`` (TRL's
log_history) and the gate file.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orthojob.cli import non_negative_int, positive_int
from orthojob.exit_codes import ExitCode
from orthojob.mlops import EXIT_USAGE
from orthojob.models import TINY_MODEL, device_info  # --model tiny: built into <out>/tiny-model
from server.cases import TASK_IDS

log = logging.getLogger(__name__)

EXIT_SMOKE_FAILED = ExitCode.FAILURE
EXIT_GRPO_GATE_FAILED = ExitCode.GRPO_GATE_FAILED
COMPLETIONS_FILE = "completions.jsonl"
TRAIN_LOG_FILE = "train_log.json"
VLLM_MODES: tuple[str, ...] = ("colocate", "server")


class ConfigError(ValueError):
    """A configuration that cannot train; the message names the flags to change."""


@dataclass
class GRPOJobConfig:
    """Every ``orthojob train`` flag (field ``x_y`` is flag ``--x-y``); defaults are the seed's.

    The seed's ``--batch-size 2`` with ``--num-generations 4`` cannot train (TRL needs the
    generation batch divisible by the group size), so the default batch is 4.
    """

    model: str = "Qwen/Qwen2.5-3B-Instruct"
    steps: int = 300
    num_generations: int = 4
    batch_size: int = 4
    grad_accum: int = 1
    lr: float = 5e-6
    lora_r: int = 16
    max_prompt_length: int = 1536
    max_completion_length: int = 512
    max_seq_length: int = 2048
    out: str = "./checkpoints/grpo"
    task_id: str = "task_easy"
    force_decay: bool = False
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    vllm_server_url: str | None = None
    vllm_gpu_memory_utilization: float = 0.3
    from_checkpoint: str | None = None
    skip_sft_gate: bool = False
    test: bool = False
    analyze: bool = False
    preset: str | None = None
    seed: int = 0
    num_prompts: int = 0
    beta: float = 0.0
    temperature: float = 1.0
    gradient_checkpointing: bool = True
    save_steps: int = 0
    rewards: list[str] | None = None
    reward_weights: dict[str, float] = field(default_factory=dict)
    gate_seeds: int = 50

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


PRESETS: dict[str, dict[str, Any]] = {
    "tiny-cpu": {
        # The offline tiny model, fully fine-tuned on CPU in seconds: proves the loop, learns little.
        "model": TINY_MODEL,
        "steps": 8,
        "num_generations": 4,
        "batch_size": 4,
        "grad_accum": 1,
        "lr": 1e-4,
        "lora_r": 0,
        "max_prompt_length": 3072,
        "max_completion_length": 128,
        "max_seq_length": 4096,
        "gradient_checkpointing": False,
        "gate_seeds": 8,
    },
    "qwen2.5-3b": {
        # The Unsloth Qwen2.5-3B GRPO recipe on one GPU: LoRA r 16, 8 completions per prompt.
        "model": "Qwen/Qwen2.5-3B-Instruct",
        "steps": 300,
        "num_generations": 8,
        "batch_size": 8,
        "grad_accum": 1,
        "lr": 5e-6,
        "lora_r": 16,
        "max_prompt_length": 1536,
        "max_completion_length": 512,
        "max_seq_length": 2048,
        "gradient_checkpointing": True,
        "save_steps": 60,
        "gate_seeds": 50,
    },
}
"""Named defaults for ``--preset``; flags given explicitly override them."""

_FIELDS = {f.name: f for f in dataclasses.fields(GRPOJobConfig)}
_DEFAULTS = GRPOJobConfig()


def _finite_float(value: str) -> float:
    x = float(value)
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be finite, got {value}")
    return x


def _weight(value: str) -> tuple[str, float]:
    name, sep, number = value.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=WEIGHT (e.g. format=2), got {value!r}")
    return name.strip(), _finite_float(number)


def _names(value: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected a comma list of reward names")
    return names


class _WeightAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        weights = dict(getattr(namespace, self.dest, None) or {})
        name, value = values
        weights[name] = value
        setattr(namespace, self.dest, weights)


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ``orthojob train`` flag. Unset flags stay absent from the namespace, so that
    :func:`config_from_args` can tell a preset's default from an explicit value."""
    d = _DEFAULTS
    s = argparse.SUPPRESS
    p = parser.add_argument
    p("--preset", choices=sorted(PRESETS), default=s, help="named defaults; explicit flags override them")
    p("--model", default=s, help=f"model id or path, or '{TINY_MODEL}' (default {d.model})")
    p("--steps", type=positive_int, default=s, help=f"GRPO optimizer steps (default {d.steps})")
    p(
        "--num-generations",
        type=positive_int,
        default=s,
        help=f"completions per prompt (default {d.num_generations})",
    )
    p(
        "--batch-size",
        type=positive_int,
        default=s,
        help=f"completions per device per step (default {d.batch_size})",
    )
    p(
        "--grad-accum",
        type=positive_int,
        default=s,
        help=f"gradient accumulation steps (default {d.grad_accum})",
    )
    p("--lr", type=_finite_float, default=s, help=f"learning rate (default {d.lr})")
    p(
        "--lora-r",
        type=non_negative_int,
        default=s,
        help=f"LoRA rank; 0 = full fine-tuning (default {d.lora_r})",
    )
    p(
        "--max-prompt-length",
        type=positive_int,
        default=s,
        help=f"longest prompt in tokens (default {d.max_prompt_length})",
    )
    p("--max-completion-length", type=positive_int, default=s, help=f"(default {d.max_completion_length})")
    p(
        "--max-seq-length",
        type=positive_int,
        default=s,
        help=f"prompt + completion budget (default {d.max_seq_length})",
    )
    p("--out", default=s, help=f"output folder (default {d.out})")
    p("--task-id", choices=TASK_IDS, default=s, help=f"(default {d.task_id})")
    p("--force-decay", action="store_true", default=s, help="pharmacokinetic force decay during training")
    p("--use-vllm", action="store_true", default=s, help="generate with vLLM (GPU only)")
    p(
        "--vllm-mode",
        choices=VLLM_MODES,
        default=s,
        help=f"vLLM in this process or a trl vllm-serve server (default {d.vllm_mode})",
    )
    p("--vllm-server-url", default=s, help="base URL of the trl vllm-serve server (server mode)")
    p(
        "--vllm-gpu-memory-utilization",
        type=_finite_float,
        default=s,
        help=f"colocate mode (default {d.vllm_gpu_memory_utilization})",
    )
    p("--from-checkpoint", default=s, help="start from this SFT checkpoint (needs its passed gate file)")
    p("--skip-sft-gate", action="store_true", default=s, help="do not require the SFT gate (NOT recommended)")
    p(
        "--test",
        action="store_true",
        default=s,
        help="smoke: prompts and every reward on real plans; no model",
    )
    p(
        "--analyze",
        action="store_true",
        default=s,
        help="emergent-behaviour metrics of <out>/completions.jsonl",
    )
    p("--seed", type=int, default=s, help=f"training seed (default {d.seed})")
    p(
        "--num-prompts",
        type=non_negative_int,
        default=s,
        help="training prompts; 0 = one per prompt group of every step",
    )
    p(
        "--beta",
        type=_finite_float,
        default=s,
        help=f"KL coefficient; > 0 loads a reference model (default {d.beta})",
    )
    p("--temperature", type=_finite_float, default=s, help=f"sampling temperature (default {d.temperature})")
    p("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=s, help="(default: on)")
    p("--save-steps", type=non_negative_int, default=s, help="checkpoint every N steps; 0 = only at the end")
    p("--rewards", type=_names, default=s, help="comma list of reward functions (default: all five)")
    p(
        "--reward-weight",
        dest="reward_weights",
        type=_weight,
        action=_WeightAction,
        default=s,
        metavar="NAME=W",
        help="weight of one reward (repeatable; default 1 each)",
    )
    p(
        "--gate-seeds",
        type=positive_int,
        default=s,
        help=f"held-out seeds of the GRPO gate (default {d.gate_seeds})",
    )
    return parser


def config_from_args(args: argparse.Namespace | dict) -> GRPOJobConfig:
    """The config of parsed flags: dataclass defaults < the preset's < the flags given."""
    given = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
    values: dict[str, Any] = {}
    preset = given.get("preset")
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown --preset {preset!r}: use one of {', '.join(sorted(PRESETS))}")
        values.update(PRESETS[preset])
    values.update({k: v for k, v in given.items() if k in _FIELDS})
    return GRPOJobConfig(**values)


def world_size() -> int:
    """Processes of this launch (torchrun/accelerate set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def generation_batch(config: GRPOJobConfig, n_processes: int | None = None) -> int:
    """Completions generated per optimizer step over all processes."""
    return config.batch_size * config.grad_accum * (n_processes or world_size())


def validate(config: GRPOJobConfig, n_processes: int | None = None, cuda: bool | None = None) -> None:
    """Raise ConfigError (naming the flags) for a config that cannot train. Loads no model.

    ``cuda``: whether a GPU is usable (None: ask torch only when the config needs to know).
    """
    n_processes = n_processes or world_size()
    for name in (
        "steps",
        "num_generations",
        "batch_size",
        "grad_accum",
        "max_completion_length",
        "max_prompt_length",
        "max_seq_length",
        "gate_seeds",
    ):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
    if config.num_generations < 2:
        raise ConfigError(
            f"--num-generations must be >= 2, got {config.num_generations}: GRPO's advantage compares "
            "completions of the same prompt"
        )
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
    if config.max_prompt_length + config.max_completion_length > config.max_seq_length:
        raise ConfigError(
            f"--max-prompt-length ({config.max_prompt_length}) + --max-completion-length "
            f"({config.max_completion_length}) exceeds --max-seq-length ({config.max_seq_length})"
        )
    if config.lora_r < 0:
        raise ConfigError(f"--lora-r must be >= 0 (0 = full fine-tuning), got {config.lora_r}")
    if not (math.isfinite(config.lr) and config.lr > 0):
        raise ConfigError(f"--lr must be a finite number > 0, got {config.lr}")
    if config.beta < 0 or config.temperature <= 0:
        raise ConfigError(
            f"--beta must be >= 0 and --temperature > 0, got {config.beta}, {config.temperature}"
        )
    if config.task_id not in TASK_IDS:
        raise ConfigError(f"--task-id must be one of {', '.join(TASK_IDS)}, got {config.task_id!r}")
    if config.vllm_mode not in VLLM_MODES:
        raise ConfigError(f"--vllm-mode must be one of {', '.join(VLLM_MODES)}, got {config.vllm_mode!r}")
    if not 0.0 < config.vllm_gpu_memory_utilization <= 1.0:
        raise ConfigError(
            f"--vllm-gpu-memory-utilization must be in (0, 1], got {config.vllm_gpu_memory_utilization}"
        )
    from orthojob.rewards import active_reward_funcs, reward_weights

    try:
        reward_weights(active_reward_funcs(config.rewards), config.reward_weights)
    except ValueError as exc:
        raise ConfigError(f"--rewards / --reward-weight: {exc}") from None
    if config.use_vllm and not (config.test or config.analyze):
        if cuda is None:
            import torch

            cuda = torch.cuda.is_available()
        if not cuda:
            raise ConfigError("--use-vllm needs a CUDA GPU (vLLM does not generate on CPU); drop --use-vllm")
        if config.vllm_mode == "colocate":
            try:
                import vllm  # noqa: F401
            except ImportError:
                raise ConfigError(
                    "--use-vllm --vllm-mode colocate needs the vllm package (pip install vllm), or use "
                    "--vllm-mode server with a running `trl vllm-serve`"
                ) from None


# ---------------------------------------------------------------------------------------------
# --test: the seed's smoke, without a model
# ---------------------------------------------------------------------------------------------


def _smoke_plans(observation: dict) -> dict[str, str]:
    """Real plans for a case: the oracle's, uniform SLERP, do-nothing, and a garbage completion."""
    from orthojob.evaluation import DO_NOTHING_PLAN, UNIFORM_SLERP_PLAN
    from orthojob.prompts import plan_to_completion
    from server.oracle import oracle_plan

    return {
        "oracle": plan_to_completion(oracle_plan(observation)),
        "uniform_slerp": plan_to_completion({"strategy": "anterior_first", **UNIFORM_SLERP_PLAN}),
        "do_nothing": plan_to_completion(DO_NOTHING_PLAN),
        "garbage": "I would move the incisors first {not json",
    }


def smoke_test(config: GRPOJobConfig, n_prompts: int = 4) -> int:
    """Prompts, every reward on real plans (the oracle's, uniform SLERP, do-nothing, garbage), the
    active set. Returns 0 when every value is finite and the oracle's plan beats garbage on
    reward_terminal, else EXIT_SMOKE_FAILED. Loads no model.
    """
    from orthojob.prompts import TRAIN_SEED_START, prompt_cases
    from orthojob.rewards import REWARD_FUNCS, active_reward_funcs, reward_weights

    print("=== TEST MODE: no model load, no training step ===")
    cases = list(prompt_cases(n_prompts, TRAIN_SEED_START, config.task_id, config.force_decay))
    rows = [row for row, _obs in cases]
    user = rows[0]["prompt"][-1]["content"]
    print(
        f"[grpo] {len(rows)} prompts ({config.task_id}, force_decay={config.force_decay}); "
        f"first prompt: {len(user)} chars, seed {rows[0]['seed']}"
    )
    seeds = [row["seed"] for row, _obs in cases[:2]]
    completions, labels, columns = [], [], {"seed": [], "task_id": [], "force_decay": []}
    for row, obs in cases[:2]:
        for name, text in _smoke_plans(obs).items():
            completions.append([{"role": "assistant", "content": text}])
            labels.append(f"{name}@{row['seed']}")
            columns["seed"].append(row["seed"])
            columns["task_id"].append(config.task_id)
            columns["force_decay"].append(config.force_decay)
    print(f"[grpo] completions: {', '.join(labels)}")
    ok = True
    values_of = {}
    for name, func in REWARD_FUNCS.items():
        values = values_of[name] = func(completions, **columns)
        finite = len(values) == len(completions) and all(
            isinstance(v, (int, float)) and math.isfinite(v) for v in values
        )
        ok &= finite
        flag = "" if finite else "  NOT FINITE"
        print(f"[grpo] {name:<17} {' '.join(f'{v:+.3f}' for v in values)}{flag}")
    n_plans = len(labels) // len(seeds)
    terminal = values_of["reward_terminal"]
    if ok and not all(terminal[k * n_plans] > terminal[k * n_plans + n_plans - 1] for k in range(len(seeds))):
        print("[grpo] the oracle's plan does not score above garbage on reward_terminal")
        ok = False
    from orthojob.reward_signal import format_report, signal_groups, signal_report

    group_size = 16
    groups = signal_groups(
        [(config.task_id, row["seed"], config.force_decay) for row in rows], group_size=group_size, seed=0
    )
    print(
        "[grpo] " + format_report(signal_report(groups), len(groups), group_size).replace("\n", "\n[grpo] ")
    )
    funcs = active_reward_funcs(config.rewards)
    weights = reward_weights(funcs, config.reward_weights)
    print(f"[grpo] active reward funcs: {[f.__name__ for f in funcs]} weights {weights}")
    print("[grpo] TEST OK" if ok else "[grpo] TEST FAILED")
    return 0 if ok else EXIT_SMOKE_FAILED


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def _json_value(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if hasattr(x, "item"):
        return _json_value(x.item())
    return x


def _make_trainer_class():
    """GRPOTrainer that appends every generated completion (with its case and rewards) to a JSONL file.

    It hooks ``_generate_and_score_completions`` (one call per generation batch): afterwards TRL's
    ``_logs`` hold exactly that batch, gathered from all processes, in the order of the inputs.
    The case columns are gathered the same way. Rank 0 writes; all ranks join the gather.
    """
    from accelerate.utils import gather_object
    from trl import GRPOTrainer

    from orthojob.parsing import completion_text

    class RecordingGRPOTrainer(GRPOTrainer):
        record_completions: bool = False  # set on every rank: the gather below is collective
        completions_path: Path | None = None  # set on rank 0 only
        _record_warned = False

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            if self.record_completions and self.model.training:
                cases = gather_object(
                    [(x.get("seed"), x.get("task_id"), bool(x.get("force_decay", False))) for x in inputs]
                )
                if self.accelerator.is_main_process and self.completions_path is not None:
                    self._record(cases)
            return output

        def _record(self, cases: list) -> None:
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
            texts = [completion_text(t) for t in texts]
            with open(self.completions_path, "a", encoding="utf-8") as fh:
                for i, (seed, task_id, decay) in enumerate(cases):
                    rec = {
                        "step": step,
                        "seed": _json_value(seed),
                        "task_id": task_id,
                        "force_decay": decay,
                        "completion": texts[i],
                        "rewards": {k: _json_value(float(v[i])) for k, v in rewards.items()},
                        "advantage": _json_value(float(advantages[i])),
                    }
                    fh.write(json.dumps(rec) + "\n")
            self._log_env_diagnostics(texts, cases)

        def _log_env_diagnostics(self, texts: list[str], cases: list) -> None:
            """env/* metrics of this batch (``texts``: completion texts, already normalised), averaged
            by TRL with its own metrics at the next log (rank 0)."""
            from orthojob.mlops import env_diagnostics

            try:
                metrics = env_diagnostics(texts, cases)
            except Exception as exc:  # diagnostics never stop training
                log.warning("env diagnostics skipped: %s", exc)
                return
            for key, value in metrics.items():
                self._metrics["train"][key].append(value)

    return RecordingGRPOTrainer


@dataclass
class TrainResult:
    """What :func:`train` leaves: the trainer (weights on every rank), the output folder, the gate."""

    trainer: Any
    out: Path
    gate: Any = None
    gate_passed: bool | None = None
    step_times: list[float] = field(default_factory=list)


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
    if config.model != TINY_MODEL or config.from_checkpoint:  # a checkpoint brings its own model
        return config.model
    from orthojob.models import ensure_tiny

    path = Path(config.out) / "tiny-model"
    if is_main:
        ensure_tiny(path, [config.task_id], config.force_decay, max_position_embeddings=config.max_seq_length)
    wait()
    return str(path)


def _prompt_lengths(tokenizer, rows: Sequence[dict]) -> list[int]:
    lengths = []
    for row in rows:
        text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        lengths.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return lengths


def build_grpo_args(config: GRPOJobConfig, devices: dict, n_processes: int):
    """TRL's GRPOConfig for a job config (bf16 only where the GPU has it; CPU otherwise)."""
    from trl import GRPOConfig

    from orthojob.rewards import active_reward_funcs, reward_weights

    funcs = active_reward_funcs(config.rewards)
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
        "seed": config.seed,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "steps" if config.save_steps else "no",
        "save_steps": config.save_steps or 500,
        "bf16": devices["bf16"],
        "fp16": False,
        "use_cpu": not devices["cuda"],
        "gradient_checkpointing": config.gradient_checkpointing,
        "reward_weights": reward_weights(funcs, config.reward_weights),
        "ddp_find_unused_parameters": False,
        "dataloader_num_workers": 0,
        "log_completions": False,
        "use_vllm": config.use_vllm,
    }
    if n_processes > 1 and not devices["cuda"]:
        kwargs["ddp_backend"] = "gloo"
    if config.use_vllm:
        kwargs["vllm_mode"] = config.vllm_mode
        if config.vllm_mode == "server" and config.vllm_server_url:
            kwargs["vllm_server_base_url"] = config.vllm_server_url
        if config.vllm_mode == "colocate":
            kwargs["vllm_gpu_memory_utilization"] = config.vllm_gpu_memory_utilization
    return GRPOConfig(**kwargs), funcs


def _load_policy(config: GRPOJobConfig, model_path: str, devices: dict):
    """(model, tokenizer) through :mod:`orthojob.models`."""
    from orthojob import models

    return models.load_policy(
        model_path,
        checkpoint=config.from_checkpoint,
        lora_r=config.lora_r,
        max_seq_length=config.max_seq_length,
        use_vllm=config.use_vllm and config.vllm_mode == "colocate",
    )


class _StepTimer:
    """TrainerCallback measuring wall time per optimizer step (generation + scoring + update)."""

    def __init__(self):
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                timer.times.append(time.perf_counter() - timer.t0)

        self.t0 = 0.0
        self.times: list[float] = []
        self.callback = Callback()


def _callbacks(timer: _StepTimer, is_main: bool, sync_to: str | None) -> list:
    callbacks = [timer.callback]
    if is_main and sys.modules.get("mlflow") is not None:
        import mlflow

        if mlflow.active_run() is not None:
            from orthojob.tracking import trainer_callback

            callbacks.append(trainer_callback())
    if is_main and sync_to:
        from orthojob.mlops import checkpoint_sync_callback

        callbacks.append(checkpoint_sync_callback(sync_to))
    return callbacks


def train(config: GRPOJobConfig, sync_to: str | None = None, resume_from: str | None = None) -> TrainResult:
    """Train with GRPO, save, run the GRPO gate. Call :func:`validate` first (run_train does).

    ``sync_to``: an ``s3://`` URI; every saved ``checkpoint-N`` is uploaded below it (rank 0).
    ``resume_from``: a local ``checkpoint-N`` folder to resume from (optimizer, scheduler, step).
    Metrics go to the active MLflow run (rank 0) when there is one.
    """
    import torch
    from datasets import Dataset

    from orthojob.prompts import TRAIN_SEED_START, prompt_rows

    devices = device_info()  # imports Unsloth (before TRL) where it can be used
    n_processes = world_size()
    out = Path(config.out)
    grpo_args, funcs = build_grpo_args(config, devices, n_processes)  # initialises torch.distributed
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
    model, tokenizer = _load_policy(config, model_path, devices)  # the tokenizer has a pad token

    prompts_per_step = generation_batch(config, n_processes) // config.num_generations
    n_prompts = config.num_prompts or max(8, config.steps * prompts_per_step)
    rows = prompt_rows(n_prompts, TRAIN_SEED_START, config.task_id, config.force_decay)
    longest = max(_prompt_lengths(tokenizer, rows))
    if longest > config.max_prompt_length:
        raise ConfigError(
            f"the longest training prompt is {longest} tokens, over --max-prompt-length "
            f"({config.max_prompt_length}); raise it (and --max-seq-length) rather than cut the plan format"
        )
    dataset = Dataset.from_list(rows)

    trainer_cls = _make_trainer_class()
    timer = _StepTimer()
    trainer = trainer_cls(
        model=model,
        reward_funcs=funcs,
        args=grpo_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=_callbacks(timer, is_main, sync_to),
    )
    trainer.record_completions = True
    trainer.completions_path = out / COMPLETIONS_FILE if is_main else None
    trainer.train(resume_from_checkpoint=resume_from)
    trainer.save_model(str(out))
    result = TrainResult(trainer=trainer, out=out, step_times=list(timer.times))
    if is_main:
        (out / TRAIN_LOG_FILE).write_text(
            json.dumps(
                [{k: _json_value(v) for k, v in row.items()} for row in trainer.state.log_history], indent=1
            )
        )
        result.gate, result.gate_passed = run_grpo_gate(config, out)
    state.wait_for_everyone()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return result


def run_grpo_gate(config: GRPOJobConfig, checkpoint: Path) -> tuple[dict, bool]:
    """The GRPO gate: evaluate the saved checkpoint on held-out seeds (:func:`orthojob.gate.evaluate_checkpoint`,
    stage ``grpo``: format thresholds plus a terminal reward no lower than uniform SLERP's), then write
    the gate file, whose ``passed`` :func:`orthojob.gate.write_gate` computes from the metrics."""
    from orthojob.gate import evaluate_checkpoint, format_gate, write_gate

    report = evaluate_checkpoint(
        str(checkpoint),
        n_seeds=config.gate_seeds,
        task_id=config.task_id,
        force_decay=config.force_decay,
        max_new_tokens=config.max_completion_length,
        stage="grpo",
    )
    content = write_gate(str(checkpoint), report)
    print(format_gate(content))
    return content, bool(content["passed"])


def run_train(args: argparse.Namespace | dict) -> int:
    """``orthojob train``: returns the process exit code (see the module docstring)."""
    try:
        config = config_from_args(args)
    except (ConfigError, TypeError) as exc:
        print(f"orthojob train: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if config.analyze:
        from orthojob.analysis import analyze

        path = Path(config.out) / COMPLETIONS_FILE
        if not path.exists():
            print(
                f"orthojob train --analyze: {path} not found (train with --out {config.out} first)",
                file=sys.stderr,
            )
            return EXIT_USAGE
        analyze(path)
        return 0
    try:
        validate(config)
    except ConfigError as exc:
        print(f"orthojob train: {exc}", file=sys.stderr)
        return EXIT_USAGE

    main_rank = int(os.environ.get("RANK", "0")) == 0
    say = print if main_rank else (lambda *a, **k: None)
    say("=== OrthoRL GRPO training ===")
    for key in (
        "preset",
        "model",
        "steps",
        "num_generations",
        "batch_size",
        "grad_accum",
        "task_id",
        "force_decay",
        "use_vllm",
        "from_checkpoint",
        "out",
    ):
        say(f"  {key:<16} {getattr(config, key)}")
    if config.test:
        code = _check_sft_gate(config, say)
        return code if code is not None else smoke_test(config)

    from orthojob.mlops import report_job_error
    from orthojob.storage import StorageError
    from orthojob.tracking import TrackingError

    try:
        return _tracked_train(args, config, main_rank, say)
    except (TrackingError, StorageError) as exc:
        return report_job_error("train", exc)


def _check_sft_gate(config: GRPOJobConfig, say) -> int | None:
    """The SFT gate pre-flight: None when training may start, else the exit code (message printed)."""
    if config.from_checkpoint and not config.skip_sft_gate:
        from orthojob.gate import GateError, check_gate

        try:
            check_gate(config.from_checkpoint)
        except GateError as exc:
            print(f"orthojob train: {exc.message}", file=sys.stderr)
            return exc.exit_code
        say(f"[grpo] SFT gate of {config.from_checkpoint}: passed")
    elif config.skip_sft_gate:
        say("[grpo] WARNING: --skip-sft-gate: not checking the SFT gate (expect format errors early on)")
    return None


def tracking_params(args: argparse.Namespace | dict, config: GRPOJobConfig) -> dict:
    """What the stage's MLflow run records as params (flattened and redacted by :mod:`orthojob.tracking`)."""
    from orthojob.rewards import active_reward_funcs, reward_weights
    from orthojob.tracking import git_commit

    given = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
    if config.lora_r > 0:
        lora = {
            "r": config.lora_r,
            "alpha": 2 * config.lora_r,
            "dropout": 0.0,
            "target_modules": "attention+mlp projections",
        }
    else:
        lora = {"r": 0, "mode": "full fine-tuning"}
    funcs = active_reward_funcs(config.rewards)
    return {
        "cli": {k: v for k, v in given.items() if not callable(v)},
        "grpo": config.to_dict(),
        "lora": lora,
        "env": {
            "task_id": config.task_id,
            "force_decay": config.force_decay,
            "rewards": ",".join(f.__name__ for f in funcs),
            "reward_weights": reward_weights(funcs, config.reward_weights),
        },
        "world_size": world_size(),
        "git_commit": git_commit(),
        "image_digest": os.environ.get("IMAGE_DIGEST", "unknown"),
    }


def _tracked_train(args, config: GRPOJobConfig, main_rank: bool, say) -> int:
    """Training inside the stage's MLflow run (rank 0), with S3 in and out and resume (module docstring)."""
    import contextlib

    from orthojob import mlops, storage, tracking

    out_uri = config.out
    params = tracking_params(args, config)
    run_ctx: Any = contextlib.nullcontext()
    if main_rank:
        with contextlib.suppress(ImportError):
            import mlflow
            import psutil  # noqa: F401

            mlflow.enable_system_metrics_logging()
        run_ctx = tracking.stage_run("grpo", params=params)
    with run_ctx, mlops.sigterm_as_exit():
        if config.from_checkpoint and storage.is_s3_uri(config.from_checkpoint):
            config.from_checkpoint = str(
                mlops.local_input(config.from_checkpoint, lambda m: say(f"[grpo] {m}"))
            )
        code = _check_sft_gate(config, say)
        if code is not None:
            _tag("orthorl.refused", f"SFT gate exit {code}")
            return code
        sync_to = None
        if storage.is_s3_uri(out_uri):
            sync_to = out_uri
            config.out = str(mlops.local_work_dir(out_uri))
            say(f"[grpo] training in {config.out}; checkpoints and the result go to {out_uri}")
        # every rank resumes from the same checkpoint: the first rank of each node downloads
        # it, the others find the verified copy (storage.download_dir takes turns on a lock)
        resume = mlops.resume_checkpoint(out_uri, Path(config.out))
        resume_from = None
        if resume is not None:
            step, folder = resume
            resume_from = str(folder)
            print(f"[grpo] rank {os.environ.get('RANK', '0')}: resuming from checkpoint-{step} of {out_uri}")
            _tag("orthorl.resumed_from", f"checkpoint-{step}")
        try:
            result = train(config, sync_to=sync_to, resume_from=resume_from)
        except ConfigError as exc:
            print(f"orthojob train: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if result.gate_passed is None:  # not rank 0; from here on this is the main rank
            return 0
        times = result.step_times
        if times:
            print(f"[grpo] {len(times)} steps, {sum(times) / len(times):.2f} s/step; saved to {result.out}")
        if sync_to:
            from orthojob.mlops import publish_output

            publish_output(result.out, out_uri)
            say(f"[grpo] published to {out_uri}")
        trainer = result.trainer
        model = trainer.accelerator.unwrap_model(trainer.model)
        base = _base_model_name(config)
        resolved = config.to_dict() | {"out": out_uri, "work_dir": str(result.out)}
        mlops.log_training_artifacts(
            result.out,
            resolved,
            model,
            trainer.processing_class,
            base,
            trainer.state.log_history,
            config.task_id,
            config.force_decay,
            COMPLETIONS_FILE,
        )
        print(f"[grpo] GRPO gate: {'passed' if result.gate_passed else 'FAILED'}")
        return 0 if result.gate_passed else EXIT_GRPO_GATE_FAILED


def _tag(key: str, value: str) -> None:
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and mlflow.active_run() is not None:
        mlflow.set_tag(key, value)


def _base_model_name(config: GRPOJobConfig) -> str:
    """The base model a checkpoint was trained from (an adapter's base, else --model)."""
    if config.from_checkpoint:
        from orthojob.models import adapter_base, is_adapter

        if is_adapter(config.from_checkpoint):
            return adapter_base(config.from_checkpoint)
    return config.model


__all__ = [
    "COMPLETIONS_FILE",
    "EXIT_GRPO_GATE_FAILED",
    "EXIT_USAGE",
    "PRESETS",
    "TINY_MODEL",
    "ConfigError",
    "GRPOJobConfig",
    "TrainResult",
    "add_train_arguments",
    "build_grpo_args",
    "config_from_args",
    "device_info",
    "generation_batch",
    "run_grpo_gate",
    "run_train",
    "smoke_test",
    "train",
    "trainable_digest",
    "validate",
    "world_size",
]
