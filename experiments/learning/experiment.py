"""The learning experiment: does RL improve on imitation, and on the simple baselines?

``make learn`` (``python -m experiments.learning``; experiments/learning/NOTEBOOK.md) runs the seed's chain
and, beside it, RL without any oracle data, on CPU and offline, in two processes (one per core):

* **chain** (a second process): the base model, then **BC** (stage 2: the oracle's safe plans on
  every task level and both dynamics), then **GRPO from BC**;
* **from scratch** (this process): **stage 0** (format SFT on plans that carry no clinical choice,
  :mod:`orthojob.data.format_demos`), then **GRPO from stage 0**.

The base model is the offline tiny Qwen2 (:func:`orthojob.modeling.models.build_tiny`) in the ``terse`` prompt
format (every tooth that moves, :data:`orthojob.core.prompts.PROMPT_FORMATS`). Both GRPO runs go through the
job's trainer (:func:`orthojob.stages.grpo_trainer.train`, TRL's GRPOTrainer, the project's five reward
functions) on prompts of every cell (:data:`orthojob.core.prompts.CELLS`: three task levels x ideal and
force-decay dynamics, taking turns).

Every planner (stage 0, BC, each GRPO run at its start, every ``eval_every`` steps and at its end) is
evaluated greedily, its plans executed by the staging engine (:mod:`server.staging_engine`: what ships),
beside the oracle, uniform SLERP and doing nothing on the same cases (scored as they are), by
:mod:`experiments.learning.evaluation`: the headline metric (``scaled_reward``, :mod:`orthojob.core.metrics`),
strategy accuracy, parse rate, the clinical canaries that are NOT rewards
(:data:`orthojob.rewards.canaries.CANARIES`) and the raw plans' figures, each as mean and 95 % interval per
cell, per level and pooled. The curves (every ``eval_every`` steps) use ``eval_seeds`` seeds of each cell from
the tuning range (:data:`server.seed_ranges.TUNING`, on which the defaults were chosen); the final table (each
GRPO run's start and trained planner, the references) uses as many from the final range
(:data:`server.seed_ranges.FINAL`, on which none was).

:func:`targets` judges the run against the claims it is meant to support, on the final table (GRPO after BC
beats BC; the final planner beats uniform SLERP on every level and closes 60 % of the gap to the oracle; GRPO
from stage 0 beats uniform SLERP on ``task_easy``; no hard rule, few degenerate plans) and on the curves
(stable; GRPO from BC's raw repair share falling). Each target has a pass/fail in ``<out>/learning.json``,
which ``make learn`` prints last. Also written: ``<out>/comparison.md`` (per cell and pooled),
``<out>/learning.png`` and an MLflow run ``learn`` with ``heldout/<run>/<metric>`` per evaluated step.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from experiments.learning.config import (
    CHAIN_FILE,
    GRPO_PROMPT_SEED_START,
    MAX_SEQ_LENGTH,
    RSFT_PROMPT_SEED_START,
    LearnConfig,
)
from experiments.learning.evaluation import (
    ENGINE_METRICS,
    evaluate_model,
    final_cases,
    heldout_cases,
    reference_rows,
)
from experiments.learning.report import (
    CELL_NAMES,
    RUNS,
    cell_name,
    curve_table,
    markdown_tables,
    paired_differences,
    paired_table,
    planners,
    plot,
    targets,
    targets_table,
)
from experiments.learning.weight_average import WeightAverage
from orthojob.core.metrics import SCALED_REWARD
from orthojob.core.prompts import CELLS, prompt_format_of
from orthojob.modeling import models
from orthojob.ops import tracking
from orthojob.rewards.canaries import METRICS
from orthojob.stages import grpo_trainer
from orthojob.stages import rsft as rsft_stage
from orthojob.stages.flags import add_config_arguments, config_argv
from orthojob.stages.grpo_config import ConfigError, GRPOJobConfig, validate
from orthojob.stages.rsft_config import RSFTConfig
from orthojob.stages.sft import oracle_demonstrations, run_sft
from orthojob.stages.sft_config import FormatSFTConfig, SFTJobConfig
from server.cases import TASK_IDS, CaseKey
from server.seed_ranges import FINAL

log = logging.getLogger("experiments.learning")


# ---------------------------------------------------------------------------------------------
# The base model and the SFT stages
# ---------------------------------------------------------------------------------------------


def _arch(cfg: LearnConfig) -> dict:
    return {"prompt_format": cfg.prompt_format, "hidden_size": cfg.hidden_size, "layers": cfg.layers,
            "heads": cfg.heads, "kv_heads": cfg.kv_heads, "intermediate": cfg.intermediate, "seed": cfg.seed}  # fmt: skip


def base_model(cfg: LearnConfig) -> Path:
    """The experiment's tiny base model in ``<out>/base-model`` (built unless one with the same
    settings is there; the build is deterministic), its tokenizer trained on every task's prompts."""

    path = Path(cfg.out) / "base-model"
    key = _arch(cfg)
    key_file = path / "learn_base.json"
    if key_file.is_file() and json.loads(key_file.read_text()) == key:
        return path
    arch = {k: v for k, v in key.items() if k != "prompt_format"}
    models.build_tiny(path, list(TASK_IDS), prompt_format=cfg.prompt_format, max_position_embeddings=MAX_SEQ_LENGTH,
                      **arch)  # fmt: skip
    key_file.write_text(json.dumps(key))
    return path


def _sft_stage_config(cfg: LearnConfig, kind: type | None = None, **changes):
    """An SFT stage's config (``kind``, default :class:`~orthojob.stages.sft_config.SFTJobConfig`) with the
    experiment's one set of SFT optimiser settings (full fine-tuning), for stage 0 and BC."""

    kind = kind or SFTJobConfig
    settings = dict(task_ids=list(TASK_IDS), batch_size=cfg.sft_batch_size, lr=cfg.sft_lr, lr_scheduler="cosine",
                    warmup_steps=10, lora_r=0, max_length=MAX_SEQ_LENGTH, seed=cfg.seed, logging_steps=50)  # fmt: skip
    return kind(**{**settings, **changes})


def _stage0_key(cfg: LearnConfig) -> dict:
    keys = (
        "sft_examples",
        "sft_steps",
        "sft_batch_size",
        "sft_lr",
        "strategy_last",
        "safe_format_demos",
        "format_demo_staging",
    )
    return {**_arch(cfg), **{k: getattr(cfg, k) for k in keys}}


def stage0(cfg: LearnConfig) -> tuple[Path, dict]:
    """Format SFT from :func:`base_model` on demonstrations with random strategies and random feasible
    groups (no clinical choice), every task level, with the project's one SFT routine
    (:func:`orthojob.stages.sft.run_sft`, stage 0's :class:`~orthojob.stages.sft_config.FormatSFTConfig`); a
    checkpoint with the same settings in ``<out>/stage0`` is reused unless ``fresh_stage0``."""

    out = Path(cfg.out) / "stage0"
    meta_file = out / "stage0.json"
    if meta_file.is_file() and not cfg.fresh_stage0:
        meta = json.loads(meta_file.read_text())
        if meta.get("key") == _stage0_key(cfg):
            log.info("reusing stage 0 checkpoint %s", out)
            return out, meta
    meta_file.unlink(missing_ok=True)
    t0 = time.perf_counter()
    config = _sft_stage_config(cfg, FormatSFTConfig, model=str(base_model(cfg)), out=str(out),
                               examples=cfg.sft_examples, demo_seed=cfg.seed, strategy_last=cfg.strategy_last,
                               safe_demos=cfg.safe_format_demos, demo_staging=cfg.format_demo_staging,
                               steps=cfg.sft_steps)  # fmt: skip
    summary = run_sft(config)
    meta = {"key": _stage0_key(cfg), **_sft_meta(summary), "wall_seconds": time.perf_counter() - t0}
    meta_file.write_text(json.dumps(meta, indent=1))
    return out, meta


def _sft_meta(summary: dict) -> dict:
    return {
        "demos": {k: v for k, v in summary["demos"].items() if k not in ("source", "examples")},
        "examples": summary["demos"].get("examples"),
        "parameters": summary["parameters"]["total"],
        "train_seconds": summary["train_seconds"],
        "seconds_per_step": summary["seconds_per_step"],
        "loss_first": summary["first_loss"],
        "loss_last": summary["final_loss"],
    }


def bc_demonstrations(cfg: LearnConfig, prompt_format: str) -> tuple[list[dict], dict]:
    """``bc_examples`` of the oracle's safe plans (:func:`orthojob.stages.sft.oracle_demonstrations`;
    ``bc_demos="robust"``: their robust choices), half under ideal dynamics and half under force decay,
    every task level, taking turns."""

    halves, filtered, choices = [], 0, {}
    for k, force_decay in enumerate((False, True)):
        rows, info = oracle_demonstrations(
            cfg.bc_examples // 2 + (cfg.bc_examples % 2 if k == 0 else 0),
            list(TASK_IDS),
            force_decay,
            prompt_format,
            robust=cfg.bc_demos == "robust",
            max_groups=cfg.bc_max_groups or None,
            unnamed_uniform=cfg.bc_unnamed_uniform,
            oc_noise=cfg.bc_oc_noise,
            uniform_room=cfg.bc_uniform_room,
            room_oc=cfg.bc_room_oc,
        )
        halves.append(rows)
        filtered += info["filtered_hard_rule"]
        for name, count in info.get("robust_choices", {}).items():
            choices[name] = choices.get(name, 0) + count
    demos = [r for pair in zip(*halves) for r in pair] + halves[0][len(halves[1]) :]
    info = {"source": cfg.bc_demos, "examples": len(demos), "filtered_hard_rule": filtered}
    if cfg.bc_max_groups:
        info["max_groups"] = cfg.bc_max_groups
    if cfg.bc_unnamed_uniform:
        info["unnamed_uniform"] = True
    if cfg.bc_oc_noise:
        info["oc_noise"] = cfg.bc_oc_noise
    if cfg.bc_uniform_room:
        info["uniform_room"] = True
    if cfg.bc_room_oc:
        info["room_oc"] = True
    return demos, ({**info, "robust_choices": choices} if choices else info)


def bc(cfg: LearnConfig) -> tuple[Path, dict]:
    """Stage 2: the base model fine-tuned on :func:`bc_demonstrations` for ``bc_steps`` steps."""

    t0 = time.perf_counter()
    base = base_model(cfg)
    demos, info = bc_demonstrations(cfg, prompt_format_of(base))
    out = Path(cfg.out) / "bc"
    config = _sft_stage_config(cfg, model=str(base), out=str(out), examples=len(demos), steps=cfg.bc_steps)
    summary = run_sft(config, demos, info)
    return out, {**_sft_meta(summary), "wall_seconds": time.perf_counter() - t0}


def rsft_keys(cfg: LearnConfig) -> list[CaseKey]:
    """RSFT's ``rsft_prompts`` training cases, the cells taking turns."""
    return [CaseKey(task_id, RSFT_PROMPT_SEED_START + k // len(CELLS), force_decay)
            for k, (task_id, force_decay) in zip(range(cfg.rsft_prompts), itertools.cycle(CELLS))]  # fmt: skip


def rsft(cfg: LearnConfig, checkpoint: Path) -> tuple[Path, dict]:
    """Stage 4 on ``checkpoint`` (BC): ``rsft_samples`` completions per :func:`rsft_keys` case at GRPO-from-BC's
    temperature, each scored by the environment; per case the best one that breaks no hard rule and
    scores at least uniform SLERP's + ``rsft_margin`` is kept (:mod:`orthojob.stages.rsft`), and the
    checkpoint fine-tuned on the kept ones (``rsft_steps``, ``rsft_lr``); every sample, kept or why
    dropped, in ``<out>/rsft/rsft_samples.jsonl``. Returns the checkpoint and
    the counts: why samples were dropped, how many were kept per cell, timings. When none is kept the
    checkpoint is returned as it is (``skipped`` says so)."""

    t0 = time.perf_counter()
    out = Path(cfg.out) / "rsft"
    config = _sft_stage_config(cfg, RSFTConfig, model=str(checkpoint), from_checkpoint=str(checkpoint), out=str(out),
                               prompts=cfg.rsft_prompts, samples_per_prompt=cfg.rsft_samples,
                               temperature=cfg.bc_temperature, max_new_tokens=cfg.max_completion_length,
                               sample_batch_size=16, keep_min_margin_over_slerp=cfg.rsft_margin,
                               skip_gate_check=True, steps=cfg.rsft_steps, lr=cfg.rsft_lr)  # fmt: skip
    samples = rsft_stage.sample_and_keep(config, checkpoint, rsft_keys(cfg))
    sample_seconds = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    rsft_stage.write_samples(samples, out)
    tally = rsft_stage.counts(samples)
    kept_by_cell: dict[str, int] = dict.fromkeys(CELL_NAMES, 0)
    for s in samples:
        if s["kept"]:
            kept_by_cell[cell_name(CaseKey(s["task_id"], s["seed"], s["force_decay"]))] += 1
    log.info("RSFT samples: %s; kept per cell %s", tally, kept_by_cell)
    meta = {"counts": tally, "kept_by_cell": kept_by_cell, "sample_seconds": sample_seconds}
    rows = rsft_stage.training_rows(samples, False, prompt_format_of(checkpoint))
    if not rows:  # nothing to imitate: GRPO starts from the checkpoint as it is
        log.warning("RSFT kept no sample (%s): GRPO starts from %s", tally, checkpoint)
        return checkpoint, {**meta, "skipped": "no sample kept", "wall_seconds": time.perf_counter() - t0}
    meta |= _sft_meta(run_sft(config, rows, {"source": "rsft", **tally}))
    return out, {**meta, "wall_seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------------
# GRPO
# ---------------------------------------------------------------------------------------------


def grpo_job_config(cfg: LearnConfig, checkpoint: Path, run: str = "grpo_stage0"):
    """The :class:`orthojob.stages.grpo_config.GRPOJobConfig` of one of the experiment's GRPO runs
    (:data:`RUNS`): full fine-tuning of ``checkpoint`` on prompts of every cell, ``prompts_per_step``
    prompt groups of ``num_generations`` per step, the ``lr_scheduler`` schedule and a completion budget
    of their own for each start (``bc_lr``, ``bc_beta``, ``bc_temperature`` and ``max_completion_length``
    from BC, ``lr``, ``beta``, ``temperature`` and ``stage0_completion_length`` from stage 0), no
    checkpoints until the end."""

    completion = cfg.max_completion_length if run == "grpo_bc" else cfg.stage0_completion_length
    return GRPOJobConfig(
        model=str(checkpoint),
        steps=cfg.steps if run == "grpo_bc" else cfg.stage0_steps,
        num_generations=cfg.num_generations,
        batch_size=cfg.num_generations * cfg.prompts_per_step,
        grad_accum=1,
        lr=cfg.bc_lr if run == "grpo_bc" else cfg.lr,
        lr_scheduler_type=cfg.lr_scheduler,
        lora_r=0,
        max_prompt_length=MAX_SEQ_LENGTH - completion,
        max_completion_length=completion,
        max_seq_length=MAX_SEQ_LENGTH,
        out=str(Path(cfg.out) / run),
        mixed_cells=True,
        level_weights=dict(cfg.bc_level_weights if run == "grpo_bc" else cfg.stage0_level_weights),
        seed=cfg.seed,
        objective=cfg.objective,
        repair_cost_scale=cfg.repair_cost_scale,
        num_prompts=cfg.num_prompts,
        prompt_seed_start=GRPO_PROMPT_SEED_START,
        beta=cfg.bc_beta if run == "grpo_bc" else cfg.beta,
        temperature=cfg.bc_temperature if run == "grpo_bc" else cfg.temperature,
        loss_type=cfg.loss_type,
        scale_rewards=cfg.scale_rewards,
        reward_weights={"reward_strategy": cfg.strategy_weight} if cfg.strategy_weight != 1.0 else {},
        strategy_advantage=cfg.strategy_advantage,
        strategy_advantage_scale=cfg.strategy_advantage_scale,
        strategy_lr_scale=cfg.strategy_lr_scale,
        gradient_checkpointing=False,
        save_steps=0,
    )


def run_grpo(
    cfg: LearnConfig,
    checkpoint: Path,
    cases: Sequence[CaseKey],
    evals: list,
    save: Callable[[], None],
    run: str = "grpo_stage0",
    deadline: float | None = None,
    final_keys: Sequence[CaseKey] = (),
) -> dict:
    """GRPO from ``checkpoint`` through :func:`orthojob.stages.grpo_trainer.train` (the job's trainer), with
    an evaluation every ``eval_every`` steps, at the last step, and when ``deadline`` (a
    ``time.monotonic()`` value) stops training early; each evaluation is appended to ``evals`` and
    ``save`` called. Returns timing, the reward functions' share of a step, TRL's logs and, under
    ``final_evaluation``, the trained planner's evaluation on ``final_keys`` (the final table's cases;
    None without them)."""
    from transformers import TrainerCallback

    models.device_info()  # Unsloth (on a GPU) before TRL

    job = grpo_job_config(cfg, checkpoint, run)
    validate(job)
    clock = {"train_begin": 0.0, "train_seconds": 0.0}
    step_seconds: list[float] = []

    average = WeightAverage(cfg.bc_ema if run == "grpo_bc" else 0.0)

    class EvalAndTime(TrainerCallback):
        t0 = 0.0

        def on_train_begin(self, args, state, control, **kw):
            clock["train_begin"] = time.perf_counter()
            average.start(kw["model"])

        def on_train_end(self, args, state, control, **kw):
            clock["train_seconds"] = time.perf_counter() - clock["train_begin"]
            average.copy_into(kw["model"])  # the checkpoint the job saves next is the planner evaluated

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            step_seconds.append(time.perf_counter() - self.t0)
            average.update(kw["model"])
            step = state.global_step
            late = deadline is not None and time.monotonic() > deadline
            if step % cfg.eval_every == 0 or step == job.steps or late:
                with average.swapped_in(kw["model"]):
                    scores = evaluate_model(
                        kw["model"], kw["processing_class"], cases, cfg.eval_max_new_tokens
                    )
                evals.append({"step": step, **scores})
                log.info(
                    "%s step %d: pooled %s %s", run, step, SCALED_REWARD, scores["pooled"][SCALED_REWARD]
                )
                save()
            if late:
                log.warning("%s: time limit reached at step %d", run, step)
                control.should_training_stop = True

    result = grpo_trainer.train(job, callbacks=[EvalAndTime()])
    trainer = result.trainer
    final = (
        evaluate_model(trainer.model, trainer.processing_class, final_keys, cfg.eval_max_new_tokens)
        if final_keys
        else None
    )
    return {
        "grpo_seconds": clock["train_seconds"],
        "steps_done": trainer.state.global_step,
        "seconds_per_step": float(np.mean(step_seconds)) if step_seconds else None,
        "reward_seconds": result.reward_seconds,
        # the optimizer steps' wall time, evaluations excluded (as the trainer's reward_time_share)
        "reward_share_of_step": result.reward_seconds / max(1e-9, trainer.step_seconds),
        "grpo_config": job.to_dict(),
        "log_history": trainer.state.log_history,
        "final_evaluation": final,
    }


def _evaluate_checkpoint(checkpoint: Path, cases: Sequence[CaseKey], cfg: LearnConfig) -> dict:
    model, tokenizer = models.load_policy(str(checkpoint), lora_r=0, max_seq_length=MAX_SEQ_LENGTH)
    return evaluate_model(model, tokenizer, cases, cfg.eval_max_new_tokens)


def _grpo_from(cfg, name, checkpoint, cases, record: dict, save, deadline) -> None:
    """One GRPO run recorded in ``record[name]``: its start's evaluation on the curve's ``cases`` (step
    0) and on the final range (``final.start``), then training, whose evaluations on ``cases`` make the
    curve and whose trained planner is evaluated on the final range last (``final.end``)."""
    evals: list = []
    keys = final_cases(cfg.eval_seeds)
    record[name] = {"evaluations": evals, "final": {}}
    evals.append({"step": 0, **_evaluate_checkpoint(checkpoint, cases, cfg)})
    record[name]["final"]["start"] = _evaluate_checkpoint(checkpoint, keys, cfg)
    save()
    training = run_grpo(cfg, checkpoint, cases, evals, save, name, deadline, keys)
    record[name]["final"]["end"] = training.pop("final_evaluation")
    record[name]["training"] = training
    save()


def run_chain(cfg: LearnConfig, cases: Sequence[CaseKey], deadline: float | None = None) -> dict:
    """The seed's chain: BC from the base model, its evaluation, then GRPO from BC (with
    ``rsft_prompts``, RSFT between them: BC evaluated on its own, GRPO from RSFT's checkpoint);
    written to ``<out>/chain.json`` as it goes, with its settings and wall time (the main process reads it)."""
    t0 = time.perf_counter()
    out = Path(cfg.out)
    record: dict = {"config": dataclasses.asdict(cfg)}

    def save() -> None:
        (out / CHAIN_FILE).write_text(json.dumps(record, indent=1, default=float))

    checkpoint, record["bc"] = bc(cfg)
    save()
    if cfg.rsft_prompts:
        record["bc"]["evaluation"] = _evaluate_checkpoint(checkpoint, cases, cfg)
        record["bc"]["final_evaluation"] = _evaluate_checkpoint(checkpoint, final_cases(cfg.eval_seeds), cfg)
        save()
        checkpoint, record["rsft"] = rsft(cfg, checkpoint)
        save()
    _grpo_from(cfg, "grpo_bc", checkpoint, cases, record, save, deadline)
    record["wall_seconds"] = time.perf_counter() - t0
    save()
    return record


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def chain_command(cfg: LearnConfig) -> list[str]:
    """The chain's process: ``python -m experiments.learning`` with the flags that rebuild ``cfg`` with
    ``chain_only`` set (:func:`orthojob.stages.flags.config_argv`, from the metadata :func:`build_parser`
    reads)."""
    flags = config_argv(dataclasses.replace(cfg, chain_only=True))
    return [sys.executable, "-m", "experiments.learning", *flags]


def run(cfg: LearnConfig) -> dict:
    """The experiment inside an MLflow stage run ``learn`` (the embedded sqlite store unless
    MLFLOW_TRACKING_URI)."""

    with tracking.stage_run("learn", params=dataclasses.asdict(cfg)):
        report = _run(cfg)
        _log_report(report, Path(cfg.out))
    return report


def _log_report(report: dict, out: Path) -> None:
    """Evaluations as step metrics (``heldout/<run>/<metric>``), the final table's planners pooled
    (``final/<planner>/<metric>``), the targets as 0/1 metrics and the files as artifacts."""
    import mlflow

    for run_name in RUNS:
        for e in report.get("runs", {}).get(run_name, {}).get("evaluations", []):
            tracking.log_metrics({f"heldout/{run_name}/{m}": e["pooled"][m]["mean"] for m in (*METRICS, *ENGINE_METRICS)
                                  if e["pooled"].get(m, {}).get("mean") is not None}, step=e["step"])  # fmt: skip
    for name, row in planners(report).items():  # the final table, executed and raw figures pooled
        tracking.log_metrics({f"final/{name}/{m}": row["pooled"][m]["mean"] for m in (*METRICS, *ENGINE_METRICS)
                              if row["pooled"].get(m, {}).get("mean") is not None})  # fmt: skip
    tracking.log_metrics({f"target/{t['name']}": float(t["passed"]) for t in report["targets"]})
    for name in ("learning.json", "learning.png", "comparison.md"):
        if (out / name).is_file():
            mlflow.log_artifact(str(out / name))


def report_head(cfg: LearnConfig, cases: Sequence[CaseKey]) -> dict:
    """A report's settings and references before any run: the oracle, uniform SLERP and doing nothing on
    the curves' ``cases`` (``references``) and on the final range (``final_references``)."""
    return {
        "config": dataclasses.asdict(cfg),
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "cells": list(CELL_NAMES),
        "references": reference_rows(cases),
        "final_cases": {"first_seed": FINAL.start, "seeds_per_cell": cfg.eval_seeds},
        "final_references": reference_rows(final_cases(cfg.eval_seeds)),
        "runs": {},
    }


def _run(cfg: LearnConfig) -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    deadline = time.monotonic() + cfg.time_limit_min * 60
    cases = heldout_cases(cfg.eval_seeds)
    base_model(cfg)  # once, before the chain's process reads it
    (out / CHAIN_FILE).unlink(missing_ok=True)
    chain = None
    # the chain's process starts before the references are scored, so that its time limit is not spent waiting
    if cfg.parallel and not cfg.stage0_only:
        with (out / "chain.log").open("w") as log_file:
            chain = subprocess.Popen(chain_command(cfg), stdout=log_file, stderr=subprocess.STDOUT)
    report = report_head(cfg, cases)

    def save() -> None:
        (out / "learning.json").write_text(json.dumps(report, indent=1, default=float))

    checkpoint, report["stage0"] = stage0(cfg)
    _grpo_from(cfg, "grpo_stage0", checkpoint, cases, report["runs"], save, deadline)
    if cfg.stage0_only:
        record = {}
    elif chain is None:
        record = run_chain(cfg, cases, deadline + cfg.time_limit_min * 60)  # one after the other
    else:
        code = chain.wait()
        record = json.loads((out / CHAIN_FILE).read_text()) if (out / CHAIN_FILE).is_file() else {}
        if code != 0:
            log.warning("the chain's process exited %s: see %s", code, out / "chain.log")
            report["chain_error"] = f"exit {code}, see chain.log"
    finish_report(report, record, out, time.perf_counter() - t0)
    return report


def finish_report(report: dict, record: dict, out: Path, wall_seconds: float) -> None:
    """``report`` (stage 0's process: settings, references, stage 0, GRPO from stage 0) completed with
    the chain's ``record`` (:func:`run_chain`: BC, RSFT, GRPO from BC), judged (:func:`targets`, the
    paired differences) and written to ``out``: ``learning.json``, ``comparison.md``, ``learning.png``."""
    report["bc"] = record.get("bc")
    if "rsft" in record:
        report["rsft"] = record["rsft"]
    if "grpo_bc" in record:
        report["runs"]["grpo_bc"] = record["grpo_bc"]
    report["targets"] = targets(report)
    report["passed"] = all(t["passed"] for t in report["targets"])
    report["paired"] = paired_differences(report)
    report["wall_seconds"] = wall_seconds
    (out / "learning.json").write_text(json.dumps(report, indent=1, default=float))
    text = (
        markdown_tables(report)
        + "\n\n"
        + markdown_tables(report, "tuning")
        + "\n\n"
        + curve_table(report)
        + "\n\n"
        + paired_table(report["paired"])
        + "\n\n"
        + targets_table(report["targets"])
        + "\n"
    )
    (out / "comparison.md").write_text(text)
    try:
        plot(report, out / "learning.png")
    except Exception as exc:  # the plot never fails the run
        log.warning("no plot: %s", exc)


def build_parser() -> argparse.ArgumentParser:
    """``python -m experiments.learning``'s flags, one per :class:`LearnConfig` field (the project's one
    flag generator, :func:`orthojob.stages.flags.add_config_arguments`)."""
    parser = argparse.ArgumentParser(prog="experiments.learning", description=__doc__.splitlines()[0])
    return add_config_arguments(parser, LearnConfig)


def main(argv: Sequence[str] | None = None) -> int:
    """0 when every target passed, 1 when one failed (the run itself finished), 2 on bad flags."""
    parser = build_parser()
    cfg = LearnConfig(**vars(parser.parse_args(argv)))
    for run_name in RUNS:  # a GRPO setting that cannot work fails here, not after an SFT stage
        try:
            validate(grpo_job_config(cfg, Path(cfg.out), run_name))
        except ConfigError as exc:
            parser.error(f"{run_name}: {exc}")
    try:
        WeightAverage(cfg.bc_ema)
    except ValueError as exc:
        parser.error(f"--bc-ema: {exc}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    if cfg.chain_only:
        run_chain(cfg, heldout_cases(cfg.eval_seeds), time.monotonic() + cfg.time_limit_min * 60)
        return 0
    report = run(cfg)
    print(markdown_tables(report) + "\n\n" + curve_table(report) + "\n\n" + paired_table(report["paired"]))
    print(f"\nwall time {report['wall_seconds']:.0f} s; targets ({Path(cfg.out) / 'learning.json'}):")
    print(targets_table(report["targets"]))
    print("ALL TARGETS PASSED" if report["passed"] else "SOME TARGETS FAILED")
    return 0 if report["passed"] else 1
