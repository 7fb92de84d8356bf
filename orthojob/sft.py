"""SFT stage 0 (format SFT): ``orthojob sft``.

Demonstrations are written by the environment's rule-based oracle (:func:`server.oracle.oracle_plan`)
for *training* seeds (from :data:`orthojob.prompts.TRAIN_SEED_START`): each example is the policy's
own prompt (:func:`orthojob.prompts.prompt_rows`, conversational) and, as the completion, the
oracle's plan as canonical JSON (:func:`orthojob.prompts.plan_to_completion`). TRL's SFTTrainer
trains on the completion only (prompt tokens are masked).

Models (:func:`orthojob.models.load_policy`): LoRA on real models (Unsloth 4-bit on a GPU when it
imports, QLoRA with bitsandbytes on a GPU, plain LoRA on CPU), full fine-tuning with ``lora_r 0``.
The tiny preset fine-tunes fully: LoRA on a randomly initialised base never learns the format.
bf16 only where the GPU supports it.

``--out`` receives the model (or adapter) and tokenizer, ``sft_log.json`` (TRL's log history) and
``sft_config.json``. The gate (:mod:`orthojob.gate`) is a separate step: ``orthojob gate``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from orthojob import mlops, models, storage
from orthojob.exit_codes import ExitCode
from orthojob.flags import add_config_arguments, given_values
from orthojob.models import TINY_MODEL, ensure_tiny
from orthojob.presets import PRESETS
from orthojob.prompts import TRAIN_SEED_START, build_messages, plan_to_completion, reset_observation
from orthojob.sft_config import SFT_CONFIG_FILE, SFT_LOG_FILE, ConfigError, SFTJobConfig
from server.cases import CaseKey
from server.oracle import oracle_plan
from server.treatment import score_plans

log = logging.getLogger(__name__)


def demonstrations(n: int, task_ids: Sequence[str], force_decay: bool = False) -> list[dict]:
    """``n`` SFT examples ``{"prompt": messages, "completion": [assistant message], "seed", "task_id"}``.

    Seeds run from TRAIN_SEED_START within each task; tasks take turns (``n`` split evenly). Only
    plans the environment judges safe are kept (no hard rule broken, :mod:`server.reward_scaler`):
    a case whose oracle plan breaks one is skipped and the next seed taken; the number skipped is
    logged.
    """
    tasks = list(task_ids)
    per_task = [n // len(tasks) + (1 if k < n % len(tasks) else 0) for k in range(len(tasks))]
    by_task = []
    filtered = 0
    for task_id, count in zip(tasks, per_task):
        rows = []
        seed = TRAIN_SEED_START
        while len(rows) < count:
            obs = reset_observation(seed, task_id, force_decay)
            plan = oracle_plan(obs)
            if score_plans([plan], [CaseKey(task_id, seed, force_decay)])[0]["broken_rules"]:
                filtered += 1
            else:
                rows.append(
                    {
                        "prompt": build_messages(obs),
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
    return out


def resolve_model(config: SFTJobConfig) -> str:
    """The base model reference: ``config.model`` (hub id, folder or ``s3://`` URI, resolved by
    :func:`orthojob.models.load_policy`), or the tiny model built into ``<out>/base-model``."""
    if config.model != TINY_MODEL:
        return config.model
    return str(
        ensure_tiny(Path(config.out) / "base-model", config.task_ids, config.force_decay, **config.tiny_arch)
    )


def run_sft(config: SFTJobConfig) -> dict:
    """Train SFT stage 0 and save model + tokenizer to ``config.out``; returns a summary dict
    (examples, steps, losses, token accuracy, wall times, parameters)."""
    devices = models.device_info()  # imports Unsloth (on a GPU) before TRL and transformers
    from datasets import Dataset  # heavy, and only after Unsloth: imported when training starts
    from trl import SFTConfig, SFTTrainer

    t0 = time.perf_counter()
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    base = resolve_model(config)
    model, tokenizer = models.load_policy(base, lora_r=config.lora_r, lora_alpha=config.lora_alpha,
                                          max_seq_length=config.max_length)  # fmt: skip
    t_data = time.perf_counter()
    rows = demonstrations(config.examples, config.task_ids, config.force_decay)
    dataset = Dataset.from_dict(
        {"prompt": [r["prompt"] for r in rows], "completion": [r["completion"] for r in rows]}
    )
    data_seconds = time.perf_counter() - t_data
    args = SFTConfig(
        output_dir=str(out),
        max_steps=config.steps,
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum,
        learning_rate=config.lr,
        lr_scheduler_type=config.lr_scheduler,
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        max_length=config.max_length,
        seed=config.seed,
        logging_steps=max(1, min(config.logging_steps, config.steps // 2)),
        save_strategy="no",
        report_to="none",
        bf16=devices["bf16"],
        fp16=False,
        use_cpu=not devices["cuda"],
        gradient_checkpointing=config.gradient_checkpointing,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    t_train = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - t_train
    trainer.save_model(str(out))
    tokenizer.save_pretrained(str(out))
    (out / "training_args.bin").unlink(missing_ok=True)  # Trainer state, not part of the checkpoint
    history = trainer.state.log_history
    losses = [row["loss"] for row in history if "loss" in row]
    accuracy = [row["mean_token_accuracy"] for row in history if "mean_token_accuracy" in row]
    summary = {
        "examples": len(rows),
        "steps": trainer.state.global_step,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "final_token_accuracy": accuracy[-1] if accuracy else None,
        "parameters": models.count_parameters(model),
        "base_model": base,
        "data_seconds": data_seconds,
        "train_seconds": train_seconds,
        "seconds_per_step": train_seconds / max(1, trainer.state.global_step),
        "wall_seconds": time.perf_counter() - t0,
        "device": "cuda" if devices["cuda"] else "cpu",
        "bf16": devices["bf16"],
    }
    (out / SFT_LOG_FILE).write_text(json.dumps({"summary": summary, "log_history": history}, indent=1))
    (out / SFT_CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2))
    log.info("SFT stage 0: %d steps in %.0f s, loss %s -> %s", summary["steps"], train_seconds,
             summary["first_loss"], summary["final_loss"])  # fmt: skip
    return summary


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def add_sft_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``orthojob sft`` flags, generated from :class:`SFTJobConfig`, and ``--preset``."""
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=argparse.SUPPRESS,
        help="take the SFT settings of a preset (orthojob/presets.py)",
    )
    return add_config_arguments(parser, SFTJobConfig)


def config_from_args(args: argparse.Namespace | dict) -> SFTJobConfig:
    """Dataclass defaults < the preset's SFT config < the flags given."""
    given = given_values(args, SFTJobConfig)
    preset = (vars(args) if isinstance(args, argparse.Namespace) else args).get("preset")
    if preset is None:
        return SFTJobConfig(**given)
    if preset not in PRESETS:
        raise ConfigError(f"unknown --preset {preset!r}: use one of {', '.join(sorted(PRESETS))}")
    return dataclasses.replace(PRESETS[preset].sft, **given)


def run_sft_cli(args: argparse.Namespace) -> int:
    """``orthojob sft``: 0 on success, 2 on a bad configuration."""
    try:
        config = config_from_args(args)
    except (TypeError, ValueError) as exc:
        print(f"orthojob sft: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    destination = config.out
    if storage.is_s3_uri(config.out):  # train in a local work folder, publish when done
        config = dataclasses.replace(config, out=str(mlops.local_work_dir(config.out)))
    # an s3:// --model stays a URI: load_policy fetches it into the model cache, and the adapter
    # records the URI as its base (orthojob/base_models.py), which resolves in any other pod
    summary = run_sft(config)
    if destination != config.out:
        storage.publish(config.out, destination)
    print(
        f"[sft] {summary['steps']} steps on {summary['examples']} oracle demonstrations in "
        f"{summary['train_seconds']:.0f} s ({summary['seconds_per_step']:.2f} s/step); loss "
        f"{summary['first_loss']} -> {summary['final_loss']}; saved to {destination}\n"
        f"[sft] next: orthojob gate --checkpoint {destination} --stage sft0"
    )
    return 0


__all__ = [
    "SFT_CONFIG_FILE",
    "SFT_LOG_FILE",
    "SFTJobConfig",
    "add_sft_arguments",
    "config_from_args",
    "demonstrations",
    "resolve_model",
    "run_sft",
    "run_sft_cli",
]
