"""The GRPO stage as a job (pipeline stage 3): ``orthojob grpo``.

Three modules hold the stage, as in TRL:

* :mod:`orthojob.stages.grpo_config`: :class:`~orthojob.stages.grpo_config.GRPOJobConfig` (every flag, checked in
  ``__post_init__``) and :func:`~orthojob.stages.grpo_config.validate` (the launch: processes, GPU, vLLM);
* :mod:`orthojob.stages.grpo_trainer`: the GRPOTrainer subclass and the training loop;
* this module: the job around them, which the CLI and the pipeline call.

:func:`run_train` is ``orthojob grpo``'s body: flags -> config (the preset's values from
:data:`orthojob.stages.presets.PRESETS`, then the flags given), ``--analyze`` (emergent-behaviour table,
:mod:`orthojob.eval.analysis`), then :func:`run_grpo`. :func:`run_grpo` takes a config object (the
pipeline calls it directly): validation before any model loads (exit 2), ``--test`` (a
smoke check: prompts and every reward on real plans, no model), the SFT gate pre-flight
(:func:`orthojob.lifecycle.gate_file.check_gate`, its exit code on refusal), then training inside the stage's
MLflow run with S3 in and out and resume. After training, :func:`run_grpo_gate` evaluates the
saved checkpoint on held-out seeds and writes its gate file once, with the thresholds the caller
passed (default :data:`orthojob.lifecycle.gate_file.DEFAULT_THRESHOLDS` ``["grpo"]``).

Data parallel: ``torchrun --nproc_per_node N -m orthojob.cli train ...``. A resumed run resumes on
every rank from the same checkpoint (with ``--out s3://...`` the first rank of each node downloads
it, the others reuse the verified copy).

Files in ``--out``: the adapter (or model) and tokenizer, ``completions.jsonl`` (every completion
with its step, case and rewards: the input of ``--analyze``), ``train_log.json`` (TRL's
log_history) and the gate file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from orthojob.core.prompts import TRAIN_SEED_START, plan_to_completion, prompt_cases
from orthojob.data import case_sets
from orthojob.eval.analysis import analyze
from orthojob.eval.evaluation import DO_NOTHING_PLAN, UNIFORM_SLERP_PLAN
from orthojob.eval.reward_signal import format_report, signal_groups, signal_report
from orthojob.lifecycle import model_logging
from orthojob.lifecycle.gate_file import GateError, GateThresholds, check_gate, format_gate, write_gate
from orthojob.modeling.models import adapter_base, device_info, is_adapter
from orthojob.ops import checkpoints, job_errors, storage, tracking, work_dirs
from orthojob.ops.exit_codes import ExitCode
from orthojob.ops.preemption import PreemptionGuard
from orthojob.ops.run_identity import RunIdentityError
from orthojob.rewards.reward_functions import REWARD_FUNCS, RewardFunc
from orthojob.stages.flags import add_config_arguments, engine_on, given_values
from orthojob.stages.gate import gate_report
from orthojob.stages.grpo_config import COMPLETIONS_FILE, ConfigError, GRPOJobConfig, validate, world_size
from orthojob.stages.presets import PRESETS
from server.cases import CaseKey
from server.oracle import oracle_plan


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every ``orthojob grpo`` flag, generated from :class:`GRPOJobConfig`. Unset flags stay absent
    from the namespace, so that :func:`config_from_args` can tell a preset's value from a flag's."""
    return add_config_arguments(parser, GRPOJobConfig, choices={"preset": sorted(PRESETS)})


def config_from_args(args: argparse.Namespace | dict) -> GRPOJobConfig:
    """The config of parsed flags: dataclass defaults < the preset's GRPO config < the flags given."""
    given = given_values(args, GRPOJobConfig)
    preset = given.get("preset")
    if preset is None:
        return GRPOJobConfig(**given)
    if preset not in PRESETS:
        raise ConfigError(f"unknown --preset {preset!r}: use one of {', '.join(sorted(PRESETS))}")
    return dataclasses.replace(PRESETS[preset].grpo, **given)


# ---------------------------------------------------------------------------------------------
# --test: a smoke check, without a model
# ---------------------------------------------------------------------------------------------


def _smoke_plans(observation: dict) -> dict[str, str]:
    """Real plans for a case: the oracle's, uniform SLERP, do-nothing, and a garbage completion."""
    return {
        "oracle": plan_to_completion(oracle_plan(observation)),
        "uniform_slerp": plan_to_completion({"strategy": "anterior_first", **UNIFORM_SLERP_PLAN}),
        "do_nothing": plan_to_completion(DO_NOTHING_PLAN),
        "garbage": "I would move the incisors first {not json",
    }


def smoke_test(config: GRPOJobConfig, n_prompts: int = 4) -> int:
    """Prompts, every reward on real plans (the oracle's, uniform SLERP, do-nothing, garbage), the
    active set. Returns 0 when every value is finite and the oracle's plan beats garbage on
    reward_terminal, else :attr:`ExitCode.FAILURE`. Loads no model.
    """
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
    group_size = 16
    groups = signal_groups([CaseKey.of_row(row) for row in rows], group_size=group_size, seed=0)
    print(
        "[grpo] " + format_report(signal_report(groups), len(groups), group_size).replace("\n", "\n[grpo] ")
    )
    print(f"[grpo] active reward funcs: {[f.__name__ for f in config.reward_funcs]} weights {config.weights}")
    print("[grpo] TEST OK" if ok else "[grpo] TEST FAILED")
    return 0 if ok else ExitCode.FAILURE


# ---------------------------------------------------------------------------------------------
# The job
# ---------------------------------------------------------------------------------------------


def run_grpo_gate(
    config: GRPOJobConfig, checkpoint: Path, thresholds: GateThresholds | None = None
) -> tuple[dict, bool]:
    """The GRPO gate: evaluate the saved checkpoint on held-out seeds (:func:`orthojob.stages.gate.gate_report`,
    stage ``grpo``: by default format thresholds, a hard-rule share no higher than the oracle's and a
    mean scaled reward no lower than uniform SLERP's),
    then write the gate file, once, with ``thresholds``; ``passed`` follows from the metrics."""
    keys = case_set = None
    if config.cases is not None:  # the set's held-out patients (the gate may run alone)
        keys, case_set = case_sets.heldout_cases(config.cases, config.heldout_share, config.force_decay)
    report = gate_report(
        str(checkpoint),
        n_seeds=config.gate_seeds,
        task_id=config.task_id,
        force_decay=config.force_decay,
        max_new_tokens=config.max_completion_length,
        stage="grpo",
        thresholds=thresholds,
        keys=keys,
        case_set=case_set,
        engine=engine_on(config.engine),
    )
    content = write_gate(str(checkpoint), report)
    print(format_gate(content))
    return content, bool(content["passed"])


def train_and_gate(
    config: GRPOJobConfig,
    sync_to: str | None = None,
    resume_from: str | None = None,
    gate_thresholds: GateThresholds | None = None,
    reward_funcs: Sequence[RewardFunc] | None = None,
    identity: dict | None = None,
    guard: PreemptionGuard | None = None,
):
    """:func:`orthojob.stages.grpo_trainer.train`, then (rank 0) :func:`run_grpo_gate` on the saved checkpoint.

    ``identity``: recorded in every checkpoint (:mod:`orthojob.ops.run_identity`). ``guard``: a SIGTERM
    saves a checkpoint and stops training; the gate is then skipped (the grace period is short)."""
    device_info()  # imports Unsloth where it can be used: it must come before TRL
    from orthojob.stages import grpo_trainer  # imports TRL and torch: only once training starts

    def gate(out: Path) -> tuple[dict, bool]:
        if guard is not None and guard.requested:
            return {}, False
        return run_grpo_gate(config, out, gate_thresholds)

    return grpo_trainer.train(
        config,
        sync_to=sync_to,
        resume_from=resume_from,
        reward_funcs=reward_funcs,
        on_saved=gate,
        identity=identity,
        callbacks=[guard.callback()] if guard is not None else (),
    )


def run_train(args: argparse.Namespace | dict) -> int:
    """``orthojob grpo``: returns the process exit code (see the module docstring)."""
    try:
        config = config_from_args(args)
    except (ConfigError, TypeError) as exc:
        print(f"orthojob grpo: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    if config.analyze:
        path = Path(config.out) / COMPLETIONS_FILE
        if not path.exists():
            print(
                f"orthojob grpo --analyze: {path} not found (train with --out {config.out} first)",
                file=sys.stderr,
            )
            return ExitCode.USAGE
        analyze(path)
        return 0
    return run_grpo(config, given=given_values(args, GRPOJobConfig))


def run_grpo(
    config: GRPOJobConfig, given: dict | None = None, gate_thresholds: GateThresholds | None = None
) -> int:
    """The GRPO stage of a config object (``orthojob grpo`` and the pipeline): the exit code.

    ``given``: the flags as given (recorded as the run's ``cli`` params); ``gate_thresholds``: the
    GRPO gate's (default: the stage's defaults), recorded in the one gate file the stage writes.
    """
    try:
        validate(config)
    except ConfigError as exc:
        print(f"orthojob grpo: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    if config.cases is not None:  # before any model loads: a bad case set fails at once, every problem named
        try:
            case_sets.load_case_set(config.cases, config.heldout_share, config.force_decay)
        except (case_sets.CaseSetError, FileNotFoundError, ValueError) as exc:
            print(f"orthojob grpo: --cases {config.cases}: {getattr(exc, 'message', exc)}", file=sys.stderr)
            return ExitCode.USAGE

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
    try:
        return _tracked_train(given or {}, config, main_rank, say, gate_thresholds)
    except (tracking.TrackingError, storage.StorageError) as exc:
        return job_errors.report_job_error("grpo", exc)


def _check_sft_gate(config: GRPOJobConfig, say: Callable[..., Any]) -> int | None:
    """The SFT gate pre-flight: None when training may start, else the exit code (message printed)."""
    if config.from_checkpoint and not config.skip_sft_gate:
        try:  # the gate of any earlier stage (format SFT, BC, RSFT, GRPO) is accepted
            content = check_gate(config.from_checkpoint)
        except GateError as exc:
            print(f"orthojob grpo: {exc.message}", file=sys.stderr)
            return exc.exit_code
        say(f"[grpo] SFT gate of {config.from_checkpoint}: passed (stage {content.get('stage')})")
    elif config.skip_sft_gate:
        say("[grpo] WARNING: --skip-sft-gate: not checking the SFT gate (expect format errors early on)")
    return None


def tracking_params(
    given: argparse.Namespace | dict, config: GRPOJobConfig, gate_thresholds: GateThresholds | None = None
) -> dict:
    """What the stage's MLflow run records as params (flattened and redacted by :mod:`orthojob.ops.tracking`)."""
    given = dict(vars(given) if isinstance(given, argparse.Namespace) else given)
    if config.lora_r > 0:
        lora = {
            "r": config.lora_r,
            "alpha": 2 * config.lora_r,
            "dropout": 0.0,
            "target_modules": "attention+mlp projections",
        }
    else:
        lora = {"r": 0, "mode": "full fine-tuning"}
    params = {
        "cli": {k: v for k, v in given.items() if not callable(v)},
        "grpo": config.to_dict(),
        "lora": lora,
        "env": {
            "task_id": config.task_id,
            "force_decay": config.force_decay,
            "rewards": ",".join(f.__name__ for f in config.reward_funcs),
            "reward_weights": config.weights,
        },
        "world_size": world_size(),
        "git_commit": tracking.git_commit(),
        "image_digest": os.environ.get("IMAGE_DIGEST", "unknown"),
    }
    if gate_thresholds is not None:
        params["grpo_gate"] = gate_thresholds.to_dict()
    return params


def _tracked_train(
    given: dict, config: GRPOJobConfig, main_rank: bool, say, gate_thresholds: GateThresholds | None
) -> int:
    """Training inside the stage's MLflow run (rank 0), with S3 in and out and resume (module docstring)."""
    out_uri = config.out
    params = tracking_params(given, config, gate_thresholds)
    run_ctx: Any = contextlib.nullcontext()
    if main_rank:
        with contextlib.suppress(ImportError):
            import mlflow  # heavy and optional: imported only when a run is tracked
            import psutil  # noqa: F401  (system metrics need it)

            mlflow.enable_system_metrics_logging()
        run_ctx = tracking.stage_run("grpo", params=params)
    identity = config.to_dict()  # as asked for: before inputs and outputs are made local
    with run_ctx, PreemptionGuard() as guard:
        if config.from_checkpoint and storage.is_s3_uri(config.from_checkpoint):
            local = work_dirs.local_input(config.from_checkpoint, lambda m: say(f"[grpo] {m}"))
            config = dataclasses.replace(config, from_checkpoint=str(local))
        code = _check_sft_gate(config, say)
        if code is not None:
            _tag("orthorl.refused", f"SFT gate exit {code}")
            return code
        sync_to = None
        if storage.is_s3_uri(out_uri):
            sync_to = out_uri
            config = dataclasses.replace(config, out=str(work_dirs.local_work_dir(out_uri)))
            say(f"[grpo] training in {config.out}; checkpoints and the result go to {out_uri}")
        # every rank resumes from the same checkpoint: the first rank of each node downloads
        # it, the others find the verified copy (storage.download_dir takes turns on a lock)
        try:
            resume = checkpoints.resume_checkpoint(
                out_uri, Path(config.out), config=identity, on_foreign=config.on_foreign_checkpoint
            )
        except RunIdentityError as exc:
            print(f"orthojob grpo: {exc}", file=sys.stderr)
            _tag("orthorl.refused", f"run identity exit {exc.exit_code}")
            return exc.exit_code
        resume_from = None
        if resume is not None:
            step, folder = resume
            resume_from = str(folder)
            print(f"[grpo] rank {os.environ.get('RANK', '0')}: resuming from checkpoint-{step} of {out_uri}")
            _tag("orthorl.resumed_from", f"checkpoint-{step}")
        try:
            result = train_and_gate(
                config,
                sync_to=sync_to,
                resume_from=resume_from,
                gate_thresholds=gate_thresholds,
                identity=identity,
                guard=guard,
            )
        except ConfigError as exc:
            print(f"orthojob grpo: {exc}", file=sys.stderr)
            return ExitCode.USAGE
        guard.exit_if_requested()  # SIGTERM: checkpoint saved and synced; run KILLED; exit 143
        if result.gate_passed is None:  # not rank 0; from here on this is the main rank
            return 0
        times = result.step_times
        if times:
            print(f"[grpo] {len(times)} steps, {sum(times) / len(times):.2f} s/step; saved to {result.out}")
        if sync_to:
            work_dirs.publish_output(result.out, out_uri)
            say(f"[grpo] published to {out_uri}")
        trainer = result.trainer
        model = trainer.accelerator.unwrap_model(trainer.model)
        resolved = config.to_dict() | {"out": out_uri, "work_dir": str(result.out)}
        data = trainer.train_dataset
        columns = [c for c in ("task_id", "seed") if c in (getattr(data, "column_names", None) or ())]
        training = model_logging.training_cases(
            list(data.select_columns(columns)) if columns else [], config.force_decay
        )
        model_logging.log_training_artifacts(
            result.out,
            resolved,
            model,
            trainer.processing_class,
            _base_model_name(config),
            trainer.state.log_history,
            config.task_id,
            config.force_decay,
            COMPLETIONS_FILE,
            training,
        )
        print(f"[grpo] GRPO gate: {'passed' if result.gate_passed else 'FAILED'}")
        return 0 if result.gate_passed else ExitCode.GRPO_GATE_FAILED


def _tag(key: str, value: str) -> None:
    mlflow = sys.modules.get("mlflow")  # only when a stage run imported it
    if mlflow is not None and mlflow.active_run() is not None:
        mlflow.set_tag(key, value)


def _base_model_name(config: GRPOJobConfig) -> str:
    """The base model a checkpoint was trained from (an adapter's base, else --model)."""
    if config.from_checkpoint and is_adapter(config.from_checkpoint):
        return adapter_base(config.from_checkpoint)
    return config.model


__all__ = [
    "add_train_arguments",
    "config_from_args",
    "run_grpo",
    "run_grpo_gate",
    "run_train",
    "smoke_test",
    "tracking_params",
    "train_and_gate",
]
