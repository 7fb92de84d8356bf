"""Gates: a checkpoint's held-out evaluation, the verdict the gate file records.

Every pipeline stage ends in a gate (ARCHITECTURE.md): :func:`gate_report` greedy-decodes a
plan for each held-out case (seeds from :data:`server.cases.HELDOUT_SEED_START`), parses and scores it
as the GRPO rewards do, and compares it with uniform SLERP and the oracle on the same cases;
:func:`run_gate` writes the verdict with :func:`orthojob.ops.gate_file.write_gate` (the file, its
stage names, thresholds and the pre-flight check live there), and a gate file exists only where
such an evaluation ran.

The metrics a gate judges by are :mod:`orthojob.eval.metrics`': the headline ``scaled_reward_mean`` (the
scaled terminal reward GRPO is paid, bands in :mod:`server.reward_scaler`) and ``hard_rule_share``;
the raw terminal score (``terminal_raw_mean``) is recorded for reference and compared by nothing.

Thresholds (:class:`GateThresholds`, defaults per stage in :data:`DEFAULT_THRESHOLDS`): every gate of
a stage that writes clinical plans (BC, GRPO, RSFT: the quality gates) checks parse rate >= 0.9, mean
format score >= 0.8 and a **held-out hard-rule share no higher than the oracle's on the same cases**
(``max_hard_rule_share_over_oracle`` = 0: none when the oracle breaks none); the GRPO gate also asks
for a mean scaled reward no lower than uniform SLERP's on the same cases (``min_margin_over_slerp``
= 0). Format SFT's gate (random clinical choices by design) checks the format only, tool-use SFT's
its tool calls. A ``min_*`` threshold is met by a metric at least as high, a ``max_*`` one by a metric
at most as high; one set to None is not checked (and is recorded as null). :class:`GateSettings` is
one gate evaluation's settings (seeds, budget, thresholds), as the presets and the stage commands'
``--gate-*`` / ``--min-*`` / ``--max-*`` flags give them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orthojob.data import case_sets
from orthojob.eval.evaluation import BASELINES, episode_metrics, run_checkpoint
from orthojob.eval.metrics import HARD_RULE_SHARE, SCALED_REWARD_MEAN, TERMINAL_RAW, mean_of
from orthojob.modeling.models import load_for_inference
from orthojob.ops.gate_file import (
    BC_SFT,
    DEFAULT_THRESHOLDS,
    TOOL_SFT,
    GateThresholds,
    gate_checks,
    thresholds_for,
    write_gate,
)
from orthojob.stages.flags import add_config_arguments, given_values, positive_int
from orthojob.stages.tool_sft import tool_gate_metrics
from server.cases import HELDOUT_SEED_START, TASK_IDS, CaseKey
from server.treatment import score_plans

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateSettings:
    """One gate evaluation: held-out seeds per task, completion budget, batch, thresholds.

    The stage commands (``orthojob format-sft``, ``bc-sft``, ``rsft``) take these as ``--gate-seeds``,
    ``--gate-max-new-tokens``, ``--gate-batch-size`` and the thresholds' ``--min-*`` flags
    (:func:`add_gate_arguments`)."""

    n_seeds: int = field(
        default=50,
        metadata={"help": "gate: held-out seeds per task", "flag": "--gate-seeds", "dest": "gate_n_seeds",
                  "type": positive_int, "show_default": False},
    )  # fmt: skip
    max_new_tokens: int = field(
        default=512,
        metadata={"help": "gate: completion budget", "flag": "--gate-max-new-tokens",
                  "dest": "gate_max_new_tokens", "type": positive_int, "show_default": False},
    )  # fmt: skip
    batch_size: int = field(
        default=16,
        metadata={"help": "gate: prompts per generate call", "flag": "--gate-batch-size",
                  "dest": "gate_batch_size", "type": positive_int, "show_default": False},
    )  # fmt: skip
    tool_turns: int = field(
        default=4,
        metadata={"help": "gate (tool_sft): assistant turns per agentic episode", "flag": "--gate-tool-turns",
                  "dest": "gate_tool_turns", "type": positive_int, "show_default": False},
    )  # fmt: skip
    thresholds: GateThresholds = field(
        default_factory=lambda: DEFAULT_THRESHOLDS[BC_SFT], metadata={"cli": False}
    )


def add_gate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A stage command's gate flags, generated from :class:`GateSettings` and :class:`GateThresholds`
    (defaults: the preset's gate settings, else the stage's :data:`DEFAULT_THRESHOLDS`)."""
    group = parser.add_argument_group("gate (held-out evaluation after training)")
    add_config_arguments(group, GateSettings)
    add_config_arguments(group, GateThresholds)
    return parser


def gate_settings_from_args(args: argparse.Namespace | dict, base: GateSettings) -> GateSettings:
    """``base`` with the gate flags given (:func:`add_gate_arguments`) replaced."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    changes = {
        f.name: given[f.metadata.get("dest", f.name)]
        for f in dataclasses.fields(GateSettings)
        if f.metadata.get("cli", True) and f.metadata.get("dest", f.name) in given
    }
    limits = given_values(given, GateThresholds)
    if limits:
        changes["thresholds"] = base.thresholds.replace(**limits)
    return dataclasses.replace(base, **changes)


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


def _task_list(task_id: str | Sequence[str]) -> list[str]:
    if isinstance(task_id, str):
        return list(TASK_IDS) if task_id == "all" else [task_id]
    return list(task_id)


def _checked_report(
    path, stage, tasks, n_seeds, seed_start, force_decay, max_new_tokens, metrics, thresholds, samples
) -> dict:
    """A gate report: the evaluation's settings, its metrics checked against the stage's thresholds
    (``thresholds`` or the stage's defaults), the verdict and a few sample completions."""
    limits = thresholds or thresholds_for(stage)
    checks = gate_checks(metrics, limits)
    return {
        "stage": stage,
        "checkpoint": str(path),
        "task_ids": tasks,
        "n_seeds": n_seeds,
        "seed_start": seed_start,
        "force_decay": bool(force_decay),
        "max_new_tokens": max_new_tokens,
        "metrics": metrics,
        "thresholds": limits.to_dict(),
        "checks": checks,
        "passed": bool(checks) and all(checks.values()),
        "samples": samples,
    }


def _tool_gate_report(
    path, n_seeds, task_id, force_decay, max_new_tokens, batch_size, max_turns, seed_start, stage, thresholds,
    model, tokenizer, keys=None,
) -> dict:  # fmt: skip
    """:func:`gate_report` of stage 1 (tool-use SFT): :func:`orthojob.stages.tool_sft.tool_gate_metrics` on the
    held-out seeds (or on the cases ``keys``), checked against the stage's thresholds."""

    t0 = time.perf_counter()
    tasks = _task_list(task_id)
    unknown = [t for t in tasks if t not in TASK_IDS]
    if unknown and keys is None:
        raise ValueError(f"unknown task ids {unknown}: use {TASK_IDS}")
    if model is None or tokenizer is None:
        model, tokenizer = load_for_inference(path)
    if keys is not None:
        rows = [{"seed": int(k.seed), "task_id": k.task_id, "force_decay": bool(k.force_decay)} for k in keys]
        tasks = list(dict.fromkeys(k.task_id for k in keys))
    else:
        rows = [
            {"seed": s, "task_id": t, "force_decay": bool(force_decay)}
            for t in tasks
            for s in range(seed_start, seed_start + n_seeds)
        ]
    metrics, samples = tool_gate_metrics(model, tokenizer, rows, max_turns, max_new_tokens, batch_size)
    metrics["n"] = len(rows)
    metrics["eval_seconds"] = time.perf_counter() - t0
    return _checked_report(
        path, stage, tasks, n_seeds, seed_start, force_decay, max_new_tokens, metrics, thresholds, samples
    )


def gate_report(
    path: str,
    n_seeds: int = 50,
    task_id: str | Sequence[str] = "task_easy",
    force_decay: bool = False,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    seed_start: int = HELDOUT_SEED_START,
    stage: str | None = None,
    thresholds: GateThresholds | None = None,
    model=None,
    tokenizer=None,
    max_tool_turns: int = 4,
    policy=None,
    keys: Sequence[CaseKey] | None = None,
    case_set: dict | None = None,
) -> dict:
    """Held-out gate evaluation of the checkpoint at ``path`` (or of an already loaded model, or of a
    scripted ``policy``: observations -> completion texts, :data:`orthojob.eval.evaluation.Policy`).

    Returns the gate report ``{"stage", "checkpoint", "metrics", "thresholds", "checks", "passed",
    "samples"}``; nothing is written (see :func:`write_gate`). ``metrics``: parse_rate,
    format_reward (mean and ``format_checks``), the headline scaled_reward_mean/sd and, on the same
    cases, uniform_slerp_scaled_reward_mean, oracle_scaled_reward_mean, margin_over_slerp,
    margin_over_oracle (scaled); hard_rule_share, uniform_slerp_hard_rule_share,
    oracle_hard_rule_share, hard_rule_share_over_oracle; strategy_accuracy (and the oracle's),
    mean_completion_tokens, truncated_rate, per-task scaled reward means and hard-rule shares,
    timings; terminal_raw_mean (secondary, the unscaled [0, 1] score, compared by nothing).
    ``keys``: judge these cases (an imported case set's held-out patients) instead of seeds;
    ``case_set`` (its source, split digest and counts) is then recorded in the report.
    """
    if stage == TOOL_SFT:  # stage 1's gate: greedy agentic episodes through the tools
        report = _tool_gate_report(path, n_seeds, task_id, force_decay, max_new_tokens, batch_size, max_tool_turns,
                                   seed_start, stage, thresholds, model, tokenizer, keys)  # fmt: skip
        return report if case_set is None else {**report, "case_set": case_set}

    t0 = time.perf_counter()
    tasks = _task_list(task_id)
    if policy is None and (model is None or tokenizer is None):
        model, tokenizer = load_for_inference(path)
    ep = run_checkpoint(
        model, tokenizer, tasks, n_seeds, seed_start, force_decay, max_new_tokens, batch_size, policy, keys
    )
    if keys is not None:
        tasks = list(dict.fromkeys(ep.task_ids))
    metrics = episode_metrics(ep)
    metrics["generate_seconds"] = ep.generate_seconds

    # the baselines on the very same cases
    obs = ep.observations
    cases = [CaseKey(o["task_id"], int(o["seed"]), bool(force_decay)) for o in obs]
    baseline = {
        name: score_plans([BASELINES[name](o) for o in obs], cases) for name in ("uniform_slerp", "oracle")
    }
    mine = metrics[SCALED_REWARD_MEAN]
    for name, results in baseline.items():
        metrics[f"{name}_{SCALED_REWARD_MEAN}"] = float(sum(r["scaled_reward"] for r in results) / len(obs))
        metrics[f"{name}_{HARD_RULE_SHARE}"] = float(sum(bool(r["broken_rules"]) for r in results) / len(obs))
    metrics.update(
        {
            "margin_over_slerp": mine - metrics[f"uniform_slerp_{SCALED_REWARD_MEAN}"],
            "margin_over_oracle": mine - metrics[f"oracle_{SCALED_REWARD_MEAN}"],
            f"{HARD_RULE_SHARE}_over_oracle": metrics[HARD_RULE_SHARE] - metrics[f"oracle_{HARD_RULE_SHARE}"],
            "oracle_strategy_accuracy": float(
                sum(r["strategy"] == opt for r, opt in zip(baseline["oracle"], ep.optimal_strategies))
                / len(obs)
            ),
            f"uniform_slerp_{mean_of(TERMINAL_RAW)}": float(
                sum(r["terminal_reward"] for r in baseline["uniform_slerp"]) / len(obs)
            ),
            f"oracle_{mean_of(TERMINAL_RAW)}": float(
                sum(r["terminal_reward"] for r in baseline["oracle"]) / len(obs)
            ),
            f"per_task_{SCALED_REWARD_MEAN}": {t: _mean(ep, ep.select(t), "scaled_reward") for t in tasks},
            f"per_task_{HARD_RULE_SHARE}": {t: _mean(ep, ep.select(t), "broken_rules") for t in tasks},
            "eval_seconds": time.perf_counter() - t0,
        }
    )
    samples = [
        {"task_id": ep.task_ids[i], "seed": ep.seeds[i], "completion": ep.texts[i][:2000]}
        for i in range(min(3, len(ep.texts)))
    ]
    report = _checked_report(
        path, stage, tasks, n_seeds, seed_start, force_decay, max_new_tokens, metrics, thresholds, samples
    )
    return report if case_set is None else {**report, "case_set": case_set}


def run_gate(
    path: str | Path,
    stage: str,
    settings: GateSettings,
    task_id: str | Sequence[str],
    force_decay: bool = False,
    config: Any = None,
) -> dict:
    """Evaluate the checkpoint at ``path`` with ``settings`` (:func:`gate_report`) and write its gate
    file (:func:`write_gate`); returns the file's content. A stage ``config`` with a case set
    (``cases``) is gated on the set's held-out patients."""
    keys = case_set = None
    if getattr(config, "cases", None) is not None:
        keys, case_set = case_sets.heldout_cases(config.cases, config.heldout_share, force_decay)
    report = gate_report(
        str(path),
        n_seeds=settings.n_seeds,
        task_id=task_id,
        force_decay=force_decay,
        max_new_tokens=settings.max_new_tokens,
        batch_size=settings.batch_size,
        stage=stage,
        thresholds=settings.thresholds,
        max_tool_turns=settings.tool_turns,
        keys=keys,
        case_set=case_set,
    )
    return write_gate(path, report)


def _mean(ep, index: list[int], field_name: str) -> float:
    """Mean over the episodes ``index`` of a rollout field (a list of broken rules counts as 0 / 1)."""
    return float(sum(float(bool(v) if isinstance(v, tuple) else v) for v in
                     (getattr(ep.rollouts[i], field_name) for i in index)) / len(index))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The gate file
# ---------------------------------------------------------------------------------------------
