"""The SFT stages, one training routine (:func:`run_sft`) for three demonstration sources.

The chain's stages that TRL's SFTTrainer trains, each its own command, MLflow stage run and gate:

* **stage 0, format SFT** (``orthojob format-sft``, :class:`~orthojob.stages.sft_config.FormatSFTConfig`,
  gate stage ``format_sft``): demonstrations that carry no clinical choice
  (:func:`orthojob.data.format_demos.format_demonstrations`: a uniformly random strategy, random feasible
  groups). Its gate checks the format only (parse rate, format score).
* **stage 2, BC SFT** (``orthojob bc-sft``, :class:`~orthojob.stages.sft_config.SFTJobConfig`, gate stage
  ``bc_sft``): the environment's rule-based oracle
  (:func:`server.oracle.oracle_plan`) on training seeds, only plans the environment judges safe
  (:func:`orthojob.data.oracle_demos.demonstrations`; the number filtered out is logged and recorded). Its gate is a quality gate:
  the format, and a held-out hard-rule share no higher than the oracle's (:mod:`orthojob.stages.gate`).
  ``orthojob bc-sft --no-gate`` is the same training without the gate (``orthojob gate`` then writes it).
* **stage 4, RSFT** (``orthojob rsft``, :mod:`orthojob.stages.rsft`): a checkpoint's own samples that the
  environment scored best; :mod:`orthojob.stages.rsft` samples and keeps them, then calls :func:`run_sft`
  with the kept rows.

With ``cases`` (a case set, :mod:`orthojob.data.case_sets`) every stage takes its cases from the set's
training patients instead of generated seeds (:func:`demonstration_rows`; RSFT's prompts,
:func:`orthojob.stages.rsft.prompt_keys`) and its gate judges the held-out ones; the stage command
checks the set before any model loads (a bad set: exit 2, every problem named).

Each example is the policy's own prompt (:func:`orthojob.core.prompts.build_messages`, conversational)
and, as the completion, a plan as canonical JSON (:func:`orthojob.core.prompts.plan_to_completion`), on
*training* seeds (from :data:`orthojob.core.prompts.TRAIN_SEED_START`). TRL's SFTTrainer trains on the
completion only (prompt tokens are masked).

Models (:func:`orthojob.modeling.models.load_policy`): LoRA on real models (Unsloth 4-bit on a GPU when it
imports, QLoRA with bitsandbytes on a GPU, plain LoRA on CPU), full fine-tuning with ``lora_r 0``;
``from_checkpoint`` continues an earlier stage's model or adapter. The tiny preset fine-tunes fully:
LoRA on a randomly initialised base never learns the format. bf16 only where the GPU supports it.

``--out`` receives the model (or adapter) and tokenizer, ``sft_log.json`` (TRL's log history and the
summary, with the demonstrations' counts) and ``sft_config.json``; the stage commands add the gate
file (:func:`orthojob.stages.gate.run_gate`). ``--out`` and ``--from-checkpoint`` take ``s3://`` URIs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from orthojob.agentic.chat_template import prepare_tokenizer
from orthojob.core.prompts import (
    build_messages,
    plan_to_completion,
    prompt_format_of,
)
from orthojob.data import case_sets
from orthojob.data.format_demos import case_set_format_demonstrations, demo_stats, format_demonstrations
from orthojob.data.oracle_demos import demonstrations, oracle_demonstrations
from orthojob.data.robust_plans import robust_plan
from orthojob.lifecycle import gate_file, model_logging
from orthojob.lifecycle.gate_file import BC_SFT, DEFAULT_THRESHOLDS, FORMAT_SFT
from orthojob.modeling import models
from orthojob.modeling.models import TINY_MODEL, ensure_tiny
from orthojob.ops import progress, storage, tracking, work_dirs
from orthojob.ops.exit_codes import ExitCode
from orthojob.stages import gate
from orthojob.stages.flags import add_config_arguments, given_values
from orthojob.stages.gate import GateSettings, add_gate_arguments, gate_settings_from_args
from orthojob.stages.presets import PRESETS
from orthojob.stages.sft_config import (
    SFT_CONFIG_FILE,
    SFT_LOG_FILE,
    ConfigError,
    FormatSFTConfig,
    SFTJobConfig,
)
from orthojob.stages.stage_table import SFT_SECTIONS, STAGE_TABLE
from orthojob.stages.tool_sft import (
    build_tiny_tool_model,
    case_set_tool_demonstrations,
    conversation_dataset,
    tool_demonstrations,
)
from server.cases import generate_case
from server.dental_environment import initial_observation
from server.oracle import oracle_plan
from server.treatment import score_plans

log = logging.getLogger(__name__)

TRAINING_CASES = "training_cases"
"""The summary's key for the cases a stage trained on (:func:`orthojob.lifecycle.model_logging.training_cases`)."""


SECTIONS: dict[str, type[SFTJobConfig]] = SFT_SECTIONS
"""A preset's SFT-stage sections (:class:`orthojob.stages.presets.Preset`, the stages' keys) and their config
classes (:data:`orthojob.stages.stage_table.STAGE_TABLE`)."""


def case_set_demonstrations(
    loaded: case_sets.LoadedCaseSet, n: int, prompt_format: str = "full", robust: bool = False
) -> tuple[list[dict], dict]:
    """BC examples of a case set's training patients: the oracle's plan for each case (at most ``n``,
    in file order; ``robust``: its robust choice, :func:`orthojob.data.robust_plans.robust_plan`), only
    those the environment judges safe, each row with its ``case_id``."""
    rows, filtered, choices = [], 0, {}
    for key, index in zip(loaded.train, loaded.split.train):
        if len(rows) == n:
            break
        obs = initial_observation(generate_case(*key))
        plan = oracle_plan(obs)
        if score_plans([plan], [key])[0]["broken_rules"]:
            filtered += 1
            continue
        if robust:
            plan, chosen = robust_plan(plan, key, generate_case(*key).present_ids)
            choices[chosen] = choices.get(chosen, 0) + 1
        rows.append({"prompt": build_messages(obs, prompt_format),
                     "completion": [{"role": "assistant", "content": plan_to_completion(plan)}],
                     "seed": key.seed, "task_id": key.task_id, "case_id": loaded.validation.case_ids[index]})  # fmt: skip
    loaded.log_input("train")
    log.info("BC demonstrations of %s: %d safe oracle plans, %d filtered", loaded.source, len(rows), filtered)
    return rows, {"source": f"oracle on {loaded.source}", "examples": len(rows), "filtered_hard_rule": filtered,
                  "split_digest": loaded.split.digest, **({"robust_choices": choices} if robust else {})}  # fmt: skip


def demonstration_rows(config: SFTJobConfig, prompt_format: str = "full") -> tuple[list[dict], dict]:
    """The demonstrations of ``config.demos`` (``oracle``, ``format`` or ``tool``) and their counts,
    prompts in the policy's ``prompt_format``; with ``config.cases``, on the case set's training
    patients (each row with its ``case_id``, the counts with the split's digest, the set logged as the
    run's training input). RSFT's rows come from :func:`orthojob.stages.rsft.sample_and_keep` instead."""
    loaded = None
    if config.cases is not None:
        loaded = case_sets.load_case_set(config.cases, config.heldout_share, config.force_decay)
    if config.demos == "oracle" and loaded is not None:
        return case_set_demonstrations(loaded, config.examples, prompt_format, config.robust_demos)
    if config.demos == "oracle":
        return oracle_demonstrations(
            config.examples,
            config.task_ids,
            config.force_decay,
            prompt_format,
            robust=config.robust_demos,
            both_dynamics=config.both_dynamics,
        )
    demo_seed = getattr(config, "demo_seed", 0)
    if config.demos == "format":
        strategy_last = getattr(config, "strategy_last", False)
        safe = getattr(config, "safe_demos", False)
        staging = getattr(config, "demo_staging", "random")
        if loaded is None:
            rows = format_demonstrations(config.examples, config.task_ids, config.force_decay, seed=demo_seed,
                                         prompt_format=prompt_format, strategy_last=strategy_last, safe=safe,
                                         staging=staging)  # fmt: skip
        else:
            rows = case_set_format_demonstrations(loaded.train, loaded.case_ids("train"), config.examples,
                                                  demo_seed, prompt_format, strategy_last, safe, staging)  # fmt: skip
        stats = demo_stats(rows)
        log.info("format demonstrations: %s", stats)
        return rows, {"source": "format", "examples": len(rows), **stats, **_case_set_info(loaded)}
    if config.demos == "tool":
        if loaded is None:
            return tool_demonstrations(config.examples, config.task_ids, config.force_decay, seed=demo_seed)
        rows, info = case_set_tool_demonstrations(
            loaded.train, loaded.case_ids("train"), config.examples, demo_seed
        )
        return rows, {**info, **_case_set_info(loaded)}
    raise ConfigError(f"demos={config.demos!r} has no built-in source: pass the rows to run_sft")


def _case_set_info(loaded: case_sets.LoadedCaseSet | None) -> dict:
    """What a stage's demonstration counts record of the case set it trained on (its source and split
    digest), the set's training side logged as the run's dataset input; nothing without a set."""
    if loaded is None:
        return {}
    loaded.log_input("train")
    return {"cases": loaded.source, "split_digest": loaded.split.digest}


def resolve_model(config: SFTJobConfig) -> str:
    """The base model reference: ``config.model`` (hub id, folder or ``s3://`` URI, resolved by
    :func:`orthojob.modeling.models.load_policy`), or the tiny model built into ``<out>/base-model`` (with
    ``from_checkpoint``, the checkpoint is the model and nothing is built)."""
    if config.from_checkpoint:
        return config.from_checkpoint
    if config.model != TINY_MODEL:
        return config.model
    if config.demos == "tool":  # stage 1: a tokenizer that knows the tool conversations, longer context
        return str(
            build_tiny_tool_model(
                Path(config.out) / "base-model", config.task_ids, config.force_decay, **config.tiny_arch
            )
        )
    return str(
        ensure_tiny(Path(config.out) / "base-model", config.task_ids, config.force_decay, **config.tiny_arch)
    )


def sft_trainer(config: SFTJobConfig, model, tokenizer, rows: Sequence[dict], devices: dict):
    """TRL's SFTTrainer for ``rows`` (``{"prompt": messages, "completion": messages, ...}``), its
    dataset prepared (tokenized, ``labels`` built), not trained yet.

    The loss: the completion's tokens (TRL's completion-only loss). Stage 1 (``demos="tool"``) trains
    on the assistant's turns only (TRL's ``assistant_only_loss``): its completions hold the tools'
    results as ``tool`` messages, the environment's text, not the policy's; the tokenizer gets the
    tool-calling template (:func:`orthojob.agentic.chat_template.prepare_tokenizer`), and SFTTrainer renders with
    its training variant, which marks the assistant's turns (:func:`orthojob.stages.tool_sft.conversation_dataset`)."""
    from datasets import Dataset  # heavy, and only after Unsloth: imported when training starts
    from trl import SFTConfig, SFTTrainer

    tool = config.demos == "tool"
    if tool:
        tokenizer = prepare_tokenizer(tokenizer)
        dataset = conversation_dataset(rows)
    else:
        dataset = Dataset.from_dict(
            {"prompt": [r["prompt"] for r in rows], "completion": [r["completion"] for r in rows]}
        )
    args = SFTConfig(
        output_dir=str(config.out),
        max_steps=config.steps,
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum,
        learning_rate=config.lr,
        lr_scheduler_type=config.lr_scheduler,
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        max_length=config.max_length,
        assistant_only_loss=tool,
        seed=config.seed,
        logging_steps=max(1, min(config.logging_steps, config.steps // 2)),
        save_strategy="no",
        report_to="none",
        bf16=devices["bf16"],
        fp16=False,
        use_cpu=not devices["cuda"],
        gradient_checkpointing=config.gradient_checkpointing,
        dataloader_num_workers=0,
        disable_tqdm=not progress.trainer_bars(),  # a bar on a terminal, log lines in a Job (orthojob.ops.progress)
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    progress.attach(trainer, "sft")
    return trainer


def token_counts(trainer, max_length: int) -> dict:
    """The prepared training set's size in tokens: ``tokens``, ``loss_tokens`` (the tokens the loss
    is computed on) and ``examples_at_max_length`` (examples that reach ``max_length``: TRL cut
    their end, a warning is logged)."""
    columns = trainer.train_dataset.column_names
    ids = trainer.train_dataset["input_ids"]
    labels = trainer.train_dataset["labels"] if "labels" in columns else ids
    counts = {
        "tokens": sum(len(x) for x in ids),
        "loss_tokens": sum(sum(1 for t in x if t != -100) for x in labels),
        "examples_at_max_length": sum(len(x) >= max_length for x in ids),
    }
    if counts["examples_at_max_length"]:
        log.warning("%d of %d examples reach max_length %d: their end is cut from training (raise --max-length)",
                    counts["examples_at_max_length"], len(ids), max_length)  # fmt: skip
    return counts


def run_sft(config: SFTJobConfig, rows: Sequence[dict] | None = None, demo_info: dict | None = None) -> dict:
    """Train an SFT stage and save model + tokenizer to ``config.out``; returns a summary dict
    (examples, steps, losses, token accuracy, tokens and loss tokens, wall times, parameters,
    ``demos``: the counts of the demonstrations).

    ``rows``: the demonstrations (``{"prompt": messages, "completion": [assistant message], ...}``);
    by default those of ``config.demos`` (:func:`demonstration_rows`). ``demo_info``: their counts,
    recorded with the summary."""
    devices = models.device_info()  # imports Unsloth (on a GPU) before TRL and transformers

    t0 = time.perf_counter()
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    base = resolve_model(config)
    model, tokenizer = models.load_policy(base, checkpoint=config.from_checkpoint, lora_r=config.lora_r,
                                          lora_alpha=config.lora_alpha, max_seq_length=config.max_length)  # fmt: skip
    t_data = time.perf_counter()
    if rows is None:
        rows, demo_info = demonstration_rows(config, prompt_format_of(model))
    if not rows:
        raise ConfigError("no demonstrations to train on")
    trainer = sft_trainer(config, model, tokenizer, rows, devices)
    tokenizer = trainer.processing_class
    counts = token_counts(trainer, config.max_length)
    data_seconds = time.perf_counter() - t_data
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
        "demos": {"source": config.demos, **(demo_info or {})},
        "steps": trainer.state.global_step,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "final_token_accuracy": accuracy[-1] if accuracy else None,
        **counts,
        "assistant_only_loss": bool(trainer.args.assistant_only_loss),
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
    summary[TRAINING_CASES] = model_logging.training_cases(
        rows, config.force_decay
    )  # logged with the gated model
    log.info("SFT (%s demos): %d steps in %.0f s, loss %s -> %s", config.demos, summary["steps"], train_seconds,
             summary["first_loss"], summary["final_loss"])  # fmt: skip
    return summary


# ---------------------------------------------------------------------------------------------
# CLI: format-sft, tool-sft, bc-sft (and rsft, orthojob/stages/rsft.py)
# ---------------------------------------------------------------------------------------------


def add_sft_arguments(
    parser: argparse.ArgumentParser, section: str = BC_SFT, with_gate: bool = False
) -> argparse.ArgumentParser:
    """A SFT stage command's flags, generated from its config class (:data:`SECTIONS`), ``--preset``,
    and with ``with_gate`` the gate's (:func:`orthojob.stages.gate.add_gate_arguments`)."""
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=argparse.SUPPRESS,
        help=f"take the {section} settings of a preset (orthojob/stages/presets.py)",
    )
    add_config_arguments(parser, SECTIONS[section])
    if with_gate:
        add_gate_arguments(parser)
    return parser


def _preset_name(args: argparse.Namespace | dict) -> str | None:
    preset = (vars(args) if isinstance(args, argparse.Namespace) else args).get("preset")
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"unknown --preset {preset!r}: use one of {', '.join(sorted(PRESETS))}")
    return preset


def config_from_args(args: argparse.Namespace | dict, section: str = BC_SFT) -> SFTJobConfig:
    """Dataclass defaults < the preset's config of ``section`` < the flags given."""
    cls = SECTIONS[section]
    given = given_values(args, cls)
    preset = _preset_name(args)
    if preset is None:
        return cls(**given)
    return dataclasses.replace(getattr(PRESETS[preset], section), **given)


def gate_settings_for(args: argparse.Namespace | dict, section: str) -> tuple[str, GateSettings]:
    """The gate's stage name (the section: a stage's key) and settings: the stage's defaults < the
    preset's < the flags given."""
    preset = _preset_name(args)
    gate_section = STAGE_TABLE[section].gate_section
    default = GateSettings(thresholds=DEFAULT_THRESHOLDS[section])
    base = getattr(PRESETS[preset], gate_section) if preset else default
    return section, gate_settings_from_args(args, base)


def localize(config: SFTJobConfig, say: Callable[[str], Any]) -> SFTJobConfig:
    """``config`` with an ``s3://`` ``from_checkpoint`` downloaded (verified) and an ``s3://`` ``out``
    replaced by a local work folder (:func:`orthojob.ops.work_dirs.local_work_dir`; publish to the original
    when done). An ``s3://`` ``model`` stays a URI: :func:`orthojob.modeling.models.load_policy` fetches it
    into the model cache, and adapters record the URI as their base."""
    if storage.is_s3_uri(config.out):
        config = dataclasses.replace(config, out=str(work_dirs.local_work_dir(config.out)))
    if config.from_checkpoint and storage.is_s3_uri(config.from_checkpoint):
        config = dataclasses.replace(
            config, from_checkpoint=str(work_dirs.local_input(config.from_checkpoint, say))
        )
    return config


def log_stage(summary: dict, content: dict | None, out: str | Path, prefix: str = "") -> None:
    """Into the active MLflow stage run (if any): the training summary's numbers, the demonstrations'
    counts (``demos/*``); with the gate's ``content``, the checkpoint at ``out`` as a gated LoggedModel
    (:func:`orthojob.lifecycle.model_logging.log_gated_checkpoint`: the gate's metrics ``gate/*``, file and verdict tag
    on the run and the model, the training and held-out cases as its datasets)."""
    mlflow = sys.modules.get("mlflow")  # imported by the stage run, when there is one
    if mlflow is None or mlflow.active_run() is None:
        return

    numbers = {k: v for k, v in summary.items() if isinstance(v, (int, float))}
    numbers |= {
        f"demos/{k}": v for k, v in (summary.get("demos") or {}).items() if isinstance(v, (int, float))
    }
    tracking.log_metrics({f"{prefix}{k}": v for k, v in numbers.items()})
    if content is not None:
        base = str(summary.get("base_model") or "")
        model_logging.log_gated_checkpoint(out, content, base, training=summary.get(TRAINING_CASES))


def _demo_line(summary: dict) -> str:
    demos = summary.get("demos") or {}
    if demos.get("source") == "oracle":
        return f"{summary['examples']} safe oracle demonstrations ({demos.get('filtered_hard_rule', 0)} filtered)"
    return f"{summary['examples']} {demos.get('source', '')} demonstrations"


def _other_stage_at_default_out(args: argparse.Namespace, section: str, config: SFTJobConfig) -> str | None:
    """What another stage left in ``config.out`` when that is the command's default (no ``--out``
    given): its gate file's stage, else its ``sft_config.json``'s demonstrations; None when the folder
    holds nothing of another stage. A default must never overwrite another stage's checkpoint."""
    if "out" in given_values(args, SECTIONS[section]) or storage.is_s3_uri(config.out):
        return None
    folder = Path(config.out)
    try:
        stage = gate_file.read_gate(folder).get("stage")
        return f"stage {stage}" if stage != section else None
    except gate_file.GateError:
        pass  # no readable gate file: what trained it, if anything did
    try:
        demos = json.loads((folder / SFT_CONFIG_FILE).read_text()).get("demos")
    except (OSError, ValueError, AttributeError):
        return None
    return f"{demos} demonstrations" if demos != config.demos else None


def run_sft_stage_cli(args: argparse.Namespace, section: str, command: str, gated: bool = True) -> int:
    """``orthojob format-sft`` / ``bc-sft``: train, gate, publish; 0 when the gate passed, 12 when it
    failed, 2 on a bad configuration. ``gated=False`` or ``--no-gate`` trains without the gate
    (``orthojob gate`` writes it later): 0 on success.

    An ``s3://`` ``--model`` stays a URI (:func:`localize`): the adapter records it as its base."""
    try:
        config = config_from_args(args, section)
        gated = gated and not getattr(args, "no_gate", False)
        stage, settings = gate_settings_for(args, section) if gated else (None, None)
    except (TypeError, ValueError) as exc:
        print(f"orthojob {command}: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    if config.cases is not None:  # before any model loads: a bad case set fails at once, every problem named
        refused = case_sets.check_case_set(
            config.cases, config.heldout_share, config.force_decay, command, gated
        )
        if refused is not None:
            return refused
    other = _other_stage_at_default_out(args, section, config)
    if other:
        print(
            f"orthojob {command}: the default --out {config.out} holds another stage's checkpoint ({other}; format "
            f"SFT's default folder is {STAGE_TABLE[FORMAT_SFT].out}, BC's {STAGE_TABLE[BC_SFT].out}). Pass --out: another folder, "
            f"or --out {config.out} to overwrite it.",
            file=sys.stderr,
        )
        return ExitCode.USAGE
    destination = config.out
    config = localize(config, lambda m: print(f"[{command}] {m}"))
    summary = run_sft(config)
    content = None
    if gated:
        content = gate.run_gate(config.out, stage, settings, config.task_ids, config.force_decay, config)
        print(gate_file.format_gate(content))
    log_stage(summary, content, config.out)
    if destination != config.out:
        storage.publish(config.out, destination)
    verdict = f"gate {stage} {'passed' if content['passed'] else 'FAILED'}; " if gated else ""
    print(
        f"[{command}] {summary['steps']} steps on {_demo_line(summary)} in {summary['train_seconds']:.0f} s "
        f"({summary['seconds_per_step']:.2f} s/step); loss {summary['first_loss']} -> {summary['final_loss']}; "
        f"{verdict}saved to {destination}"
    )
    if not gated:
        print(
            f"[{command}] next: orthojob gate --checkpoint {destination} --stage {section} "
            f"(or run orthojob {STAGE_TABLE[section].command} without --no-gate)"
        )
        return 0
    return 0 if content["passed"] else ExitCode.GATE_FAILED


__all__ = [
    "SECTIONS",
    "SFT_CONFIG_FILE",
    "SFT_LOG_FILE",
    "FormatSFTConfig",
    "SFTJobConfig",
    "add_sft_arguments",
    "config_from_args",
    "demonstration_rows",
    "demonstrations",
    "gate_settings_for",
    "localize",
    "log_stage",
    "oracle_demonstrations",
    "resolve_model",
    "run_sft",
    "run_sft_stage_cli",
    "sft_trainer",
    "token_counts",
]
