"""Gates: a checkpoint's held-out evaluation, the verdict the gate file records.

Every pipeline stage ends in a gate (docs/stages.md): :func:`gate_report` greedy-decodes a
plan for each case of the run's window (:func:`gate_window`), parses and scores it as the GRPO rewards
do, and compares it with uniform SLERP and the oracle on the same cases;
:func:`run_gate` writes the verdict with :func:`orthojob.lifecycle.gate_file.write_gate` (the file, its
stage names, thresholds and the pre-flight check live there), and a gate file exists only where
such an evaluation ran.

The metrics a gate judges by are :mod:`orthojob.core.metrics`': the headline ``scaled_reward_mean`` (the
scaled terminal reward GRPO is paid, bands in :mod:`server.reward_scaler`) and ``hard_rule_share``;
the raw terminal score (``terminal_raw_mean``) is recorded for reference and compared by nothing.

Thresholds (:class:`GateThresholds`, defaults per stage in :data:`DEFAULT_THRESHOLDS`): every gate of
a stage that writes clinical plans (BC, GRPO, RSFT: the quality gates) checks parse rate >= 0.9, mean
format score >= 0.8 and a **held-out hard-rule share no higher than the oracle's on the same cases**
(``max_hard_rule_share_over_oracle`` = 0: none when the oracle breaks none); the GRPO gate also asks
for a mean scaled reward above uniform SLERP's on the same cases beyond the cases' noise
(``min_margin_over_slerp`` = 0 and ``max_p_no_better_than_slerp`` = 0.05, :func:`paired_margin`: a
planner that writes uniform SLERP ties it on every case and fails). Format SFT's gate (random clinical choices by design) checks the format only, tool-use SFT's
its tool calls. A ``min_*`` threshold is met by a metric at least as high, a ``max_*`` one by a metric
at most as high; one set to None is not checked (and is recorded as null). :class:`GateSettings` is
one gate evaluation's settings (seeds, budget, thresholds), as the presets and the stage commands'
``--gate-*`` / ``--min-*`` / ``--max-*`` flags give them.

**The window.** A gate judges cases nobody tuned on, drawn for the run: ``n_seeds`` consecutive seeds
from :func:`server.seed_ranges.gate_window_start` of the run's identity, inside
:data:`server.seed_ranges.GATES` (disjoint from the training, tuning, tests, audits and final ranges),
in each of the gate's cells. The identity is the checkpoint's digest
(:func:`weights_digest`: sha256 of the tensors a loader reads, not of files beside them or of how a
config is written), so a checkpoint is always judged on the same cases, other weights on others, and no
window is known before the weights it judges exist; a scripted policy or a folder without weights is
named by its resolved path. New weights draw a new window: each attempt's window is in its gate file.
A quality gate's cells are every task level under both dynamics (:data:`QUALITY_CELLS`; no stage trains
on non-compliance, so no gate judges it); the format and tool-use gates' the stage's levels under its
dynamics. The gate file records the window (identity, first seed, seeds per cell, cells).

**What a verdict guarantees.** Zero rule-breaking plans in ``n`` cases rules out, at 95 % confidence, a
hard-rule rate above ``1 - 0.05 ** (1 / n)`` (about ``-ln(0.05) / n``, i.e. ``3 / n``): 96 cases rule out
3.1 %, 300 cases 1.0 %. With ``k`` breaks the bound is the one-sided Clopper-Pearson upper limit
(:func:`hard_rule_rate_bound`). The report's ``guarantee`` holds both figures for its own ``n`` and ``k``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import t as student_t

from orthojob.agentic.episodes import tool_gate_metrics
from orthojob.core.metrics import HARD_RULE_SHARE, SCALED_REWARD_MEAN, TERMINAL_RAW, mean_of
from orthojob.core.prompts import CELLS
from orthojob.data import case_sets
from orthojob.eval.evaluation import BASELINES, episode_metrics, run_checkpoint
from orthojob.lifecycle.gate_file import (
    BC_SFT,
    DEFAULT_THRESHOLDS,
    QUALITY_STAGES,
    TOOL_SFT,
    GateThresholds,
    gate_checks,
    thresholds_for,
    write_gate,
)
from orthojob.modeling.models import ModelError, checkpoint_files, load_for_inference
from orthojob.stages.flags import add_config_arguments, engine_field, engine_on, given_values, positive_int
from server.cases import TASK_IDS, CaseKey
from server.seed_ranges import gate_window_start
from server.treatment import score_plans

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateSettings:
    """One gate evaluation: seeds per cell of the run's window, completion budget, batch, thresholds.

    The stage commands (``orthojob format-sft``, ``bc-sft``, ``rsft``) take these as ``--gate-seeds``,
    ``--gate-max-new-tokens``, ``--gate-batch-size`` and the thresholds' ``--min-*`` flags
    (:func:`add_gate_arguments`)."""

    n_seeds: int = field(
        default=50,
        metadata={"help": "gate: seeds per cell (a quality gate's cells: every level under both dynamics)",
                  "flag": "--gate-seeds", "dest": "gate_n_seeds",
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
    engine: str = engine_field(flag="--engine", dest="gate_engine")
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
# The window a gate judges, and what its verdict guarantees
# ---------------------------------------------------------------------------------------------

QUALITY_CELLS: tuple[tuple[str, bool], ...] = CELLS
"""A quality gate's cells: every ``(task level, force decay)`` (:data:`orthojob.core.prompts.CELLS`)."""

CONFIDENCE: float = 0.95
"""The confidence of the hard-rule rate a verdict rules out (:func:`hard_rule_rate_bound`)."""


@dataclass(frozen=True)
class GateWindow:
    """The cases one gate judges: ``n_per_cell`` consecutive seeds from ``start`` in each of ``cells``
    (``(task_id, force_decay)``), drawn for the run named ``identity`` (:func:`gate_window`)."""

    identity: str
    start: int
    n_per_cell: int
    cells: tuple[tuple[str, bool], ...]

    @property
    def n_cases(self) -> int:
        return self.n_per_cell * len(self.cells)

    def keys(self) -> list[CaseKey]:
        """The window's cases, cell by cell."""
        return [CaseKey(t, self.start + i, bool(fd)) for t, fd in self.cells for i in range(self.n_per_cell)]

    def to_dict(self) -> dict:
        return {
            "identity": self.identity,
            "start": self.start,
            "n_per_cell": self.n_per_cell,
            "n_cases": self.n_cases,
            "cells": [{"task_id": t, "force_decay": bool(fd)} for t, fd in self.cells],
        }


LOADED_WEIGHTS = re.compile(r"^(adapter_model|model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)$")
"""The weight files a loader reads (transformers' and PEFT's names, sharded or not): only they name
a gate's window, so a file no loader reads, or a config written another way, draws no new one."""


def weights_digest(path: str | Path) -> str:
    """sha256 over the weights a loader reads from the checkpoint folder ``path`` (:data:`LOADED_WEIGHTS`,
    by name): each safetensors file's tensors (name, dtype, shape, bytes, by name; not its header's
    free-form metadata), any other weight file's bytes. ModelError where there are none."""
    files = [f for f in checkpoint_files(path) if LOADED_WEIGHTS.match(f.name)]
    if not files:
        raise ModelError(f"checkpoint folder {path} holds no weight file a loader reads")
    h = hashlib.sha256()
    for file in files:
        h.update(file.name.encode() + b"\0")
        if file.suffix == ".safetensors" and _hash_tensors(h, file):
            continue
        with file.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _hash_tensors(h, file: Path) -> bool:
    """Add ``file``'s tensors to ``h``; False (nothing added) where it is not a readable safetensors file."""
    try:
        import torch  # heavy: only where a gate judges real weights
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            for name in sorted(f.keys()):
                t = f.get_tensor(name).contiguous()
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    except Exception:  # not safetensors (or an unreadable one): judged by its bytes
        return False
    return True


def window_identity(path: str | Path) -> str:
    """What names a gated run: ``weights:<sha256 of the weights a loader reads>`` (:func:`weights_digest`),
    or, where ``path`` holds none (a scripted policy), ``path:<the resolved path>``. A window changes only
    with the weights: retrained or altered weights are another candidate and draw another window, and
    every gate file and MLflow gate run records the window it judged."""
    try:
        return f"weights:{weights_digest(path)}"
    except (ModelError, OSError):
        return f"path:{Path(path).resolve()}"


def gate_cells(stage: str | None, tasks: Sequence[str], force_decay: bool) -> tuple[tuple[str, bool], ...]:
    """The cells a gate of ``stage`` judges: :data:`QUALITY_CELLS` for a quality gate, else ``tasks``
    under the stage's dynamics."""
    if stage in QUALITY_STAGES:
        return QUALITY_CELLS
    return tuple((t, bool(force_decay)) for t in tasks)


def gate_window(identity: str, n_per_cell: int, cells: Sequence[tuple[str, bool]]) -> GateWindow:
    """The window of the run ``identity``: ``n_per_cell`` seeds from
    :func:`server.seed_ranges.gate_window_start` in each cell."""
    cells = tuple((t, bool(fd)) for t, fd in cells)
    return GateWindow(identity, gate_window_start(identity, n_per_cell), int(n_per_cell), cells)


def hard_rule_rate_bound(breaks: int, n: int, confidence: float = CONFIDENCE) -> float:
    """The hard-rule rate that ``breaks`` rule-breaking plans in ``n`` cases rule out at ``confidence``:
    the one-sided Clopper-Pearson upper limit, the rate ``p`` at which seeing at most ``breaks`` has
    probability ``1 - confidence``. With no break it is ``1 - (1 - confidence) ** (1 / n)`` (about
    ``-ln(1 - confidence) / n``: 3.1 % for 96 cases, 1.0 % for 300). Bisection on the binomial CDF."""
    if n < 1:
        raise ValueError(f"a bound needs at least one case, got n={n}")
    if breaks >= n:
        return 1.0
    alpha = 1.0 - confidence
    if breaks <= 0:
        return 1.0 - alpha ** (1.0 / n)
    j = np.arange(breaks + 1)
    log_comb = math.lgamma(n + 1) - np.array([math.lgamma(k + 1) + math.lgamma(n - k + 1) for k in j])
    lo, hi = breaks / n, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        cdf = float(np.exp(log_comb + j * math.log(p) + (n - j) * math.log1p(-p)).sum())
        lo, hi = (p, hi) if cdf > alpha else (lo, p)
    return hi


def guarantee(breaks: int, n: int, confidence: float = CONFIDENCE) -> dict:
    """What a verdict on ``n`` cases with ``breaks`` rule-breaking plans guarantees
    (:func:`hard_rule_rate_bound`): the rate it rules out, and the rate ``n`` cases rule out at best
    (no break)."""
    return {
        "confidence": confidence,
        "n_cases": int(n),
        "breaks": int(breaks),
        "hard_rule_rate_ruled_out": hard_rule_rate_bound(breaks, n, confidence),
        "rate_ruled_out_with_no_break": hard_rule_rate_bound(0, n, confidence),
        "formula": "one-sided Clopper-Pearson upper limit; no break: 1 - (1 - confidence) ** (1 / n)",
    }


TIE_TOLERANCE: float = 1e-9
"""Paired differences of a smaller magnitude (scaled reward) count as exact ties: a plan that scores
as uniform SLERP's must not win on floating-point noise."""


def paired_margin(mine: Sequence[float], base: Sequence[float], confidence: float = CONFIDENCE) -> dict:
    """How far ``mine`` lies above ``base`` on the same cases (both shape ``(n,)``, scaled reward).

    Returns ``{"lower": the one-sided ``confidence`` lower bound of the mean paired difference,
    "p": the one-sided paired t-test's p-value for "no higher than base"}`` (Student's t with n - 1
    degrees of freedom). Where every difference is the same (no spread), the difference is known
    exactly: p is 0 if it is positive and 1 otherwise, so a planner that ties ``base`` on every case
    never passes; with fewer than two cases nothing can be concluded (p = 1)."""
    d = np.asarray(mine, dtype=float) - np.asarray(base, dtype=float)
    d = np.where(np.abs(d) < TIE_TOLERANCE, 0.0, d)
    n = d.size
    if n < 2:
        return {"lower": float(d.mean()) if n else 0.0, "p": 1.0}
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if sd < TIE_TOLERANCE:
        return {"lower": mean, "p": 0.0 if mean > 0 else 1.0}
    se = sd / math.sqrt(n)
    return {
        "lower": mean - float(student_t.ppf(confidence, n - 1)) * se,
        "p": float(student_t.sf(mean / se, n - 1)),
    }


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


def _task_list(task_id: str | Sequence[str]) -> list[str]:
    if isinstance(task_id, str):
        return list(TASK_IDS) if task_id == "all" else [task_id]
    return list(task_id)


def _checked_report(
    path, stage, tasks, window, force_decay, max_new_tokens, metrics, thresholds, samples, guarantees=None
) -> dict:
    """A gate report: the evaluation's settings (its ``window``, None where it judged given cases), its
    metrics checked against the stage's thresholds (``thresholds`` or the stage's defaults), the verdict,
    what it guarantees (:func:`guarantee`) and a few sample completions."""
    limits = thresholds or thresholds_for(stage)
    checks = gate_checks(metrics, limits)
    return {
        "stage": stage,
        "checkpoint": str(path),
        "task_ids": tasks,
        "n_seeds": window.n_per_cell if window else None,
        "seed_start": window.start if window else None,
        "force_decay": bool(force_decay),
        "window": window.to_dict() if window else None,
        "max_new_tokens": max_new_tokens,
        "metrics": metrics,
        "thresholds": limits.to_dict(),
        "checks": checks,
        "passed": bool(checks) and all(checks.values()),
        "guarantee": guarantees,
        "samples": samples,
    }


def _tool_gate_report(
    path, force_decay, max_new_tokens, batch_size, max_turns, stage, thresholds, model, tokenizer,
    keys, window,
) -> dict:  # fmt: skip
    """:func:`gate_report` of stage 1 (tool-use SFT): :func:`orthojob.agentic.episodes.tool_gate_metrics` on the
    cases ``keys`` (the run's ``window``, or a case set's held-out patients), checked against the stage's
    thresholds."""

    t0 = time.perf_counter()
    if model is None or tokenizer is None:
        model, tokenizer = load_for_inference(path)
    rows = [{"seed": int(k.seed), "task_id": k.task_id, "force_decay": bool(k.force_decay)} for k in keys]
    tasks = list(dict.fromkeys(k.task_id for k in keys))
    metrics, samples = tool_gate_metrics(model, tokenizer, rows, max_turns, max_new_tokens, batch_size)
    metrics["n"] = len(rows)
    metrics["eval_seconds"] = time.perf_counter() - t0
    return _checked_report(
        path, stage, tasks, window, force_decay, max_new_tokens, metrics, thresholds, samples
    )


def cell_name(task_id: str, force_decay: bool) -> str:
    """``task_hard/force_decay`` or ``task_hard/ideal``: a cell's key in the per-cell metrics."""
    return f"{task_id}/{'force_decay' if force_decay else 'ideal'}"


def gate_report(
    path: str,
    n_seeds: int = 50,
    task_id: str | Sequence[str] = "task_easy",
    force_decay: bool = False,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    stage: str | None = None,
    thresholds: GateThresholds | None = None,
    model=None,
    tokenizer=None,
    max_tool_turns: int = 4,
    policy=None,
    keys: Sequence[CaseKey] | None = None,
    case_set: dict | None = None,
    identity: str | None = None,
    cells: Sequence[tuple[str, bool]] | None = None,
    engine: bool = True,
) -> dict:
    """Gate evaluation of the checkpoint at ``path`` (or of an already loaded model, or of a scripted
    ``policy``: observations -> completion texts, :data:`orthojob.eval.evaluation.Policy`) on the run's
    window (module docstring): ``n_seeds`` seeds per cell, the cells :func:`gate_cells` gives for
    ``stage`` (``cells``: these instead), the window drawn for ``identity`` (default
    :func:`window_identity` of ``path``).

    Returns the gate report ``{"stage", "checkpoint", "window", "metrics", "thresholds", "checks",
    "passed", "guarantee", "samples"}``; nothing is written (see :func:`write_gate`). ``metrics``:
    parse_rate, format_reward (mean and ``format_checks``), the headline scaled_reward_mean/sd and, on
    the same cases, uniform_slerp_scaled_reward_mean, oracle_scaled_reward_mean, margin_over_slerp,
    margin_over_oracle (scaled); hard_rule_share, uniform_slerp_hard_rule_share,
    oracle_hard_rule_share, hard_rule_share_over_oracle; strategy_accuracy (and the oracle's),
    mean_completion_tokens, truncated_rate, per-task scaled reward means and hard-rule shares, per-cell
    parse rates and hard-rule shares (the oracle's too), timings; terminal_raw_mean (secondary, the unscaled [0, 1] score, compared by nothing).
    ``keys``: judge these cases (an imported case set's held-out patients) instead of a window;
    ``case_set`` (its source, split digest and counts) is then recorded in the report.

    ``engine`` (default): the plans are executed through the staging engine and the headline, the
    hard-rule share and the guarantee judge the executed plans, what ships; the raw plans' figures
    (``raw_*``, ``repair_share``, ``fallback_share``, ``repaired_movement_share``,
    :func:`orthojob.eval.evaluation.engine_metrics`) stand beside them, and ``max_repair_share`` bounds
    how many plans the engine may change. False judges the raw plans (``engine`` ``off``).
    """
    window = None
    if keys is None:
        judged = tuple(cells) if cells is not None else gate_cells(stage, _task_list(task_id), force_decay)
        unknown = sorted({t for t, _ in judged} - set(TASK_IDS))
        if unknown:
            raise ValueError(f"unknown task ids {unknown}: use {TASK_IDS}")
        window = gate_window(identity or window_identity(path), n_seeds, judged)
        keys = window.keys()
    if stage == TOOL_SFT:  # stage 1's gate: greedy agentic episodes through the tools
        report = _tool_gate_report(path, force_decay, max_new_tokens, batch_size, max_tool_turns,
                                   stage, thresholds, model, tokenizer, keys, window)  # fmt: skip
        return report if case_set is None else {**report, "case_set": case_set}

    t0 = time.perf_counter()
    if policy is None and (model is None or tokenizer is None):
        model, tokenizer = load_for_inference(path)
    ep = run_checkpoint(
        model, tokenizer, [], 0, 0, force_decay, max_new_tokens, batch_size, policy, keys, engine=engine
    )
    tasks = list(dict.fromkeys(ep.task_ids))
    metrics = episode_metrics(ep)
    metrics["generate_seconds"] = ep.generate_seconds

    # the baselines on the very same cases
    obs = ep.observations
    cases = [CaseKey(o["task_id"], int(o["seed"]), bool(o["force_decay"])) for o in obs]
    baseline = {
        name: score_plans([BASELINES[name](o) for o in obs], cases) for name in ("uniform_slerp", "oracle")
    }
    mine = metrics[SCALED_REWARD_MEAN]
    for name, results in baseline.items():
        metrics[f"{name}_{SCALED_REWARD_MEAN}"] = float(sum(r["scaled_reward"] for r in results) / len(obs))
        metrics[f"{name}_{HARD_RULE_SHARE}"] = float(sum(bool(r["broken_rules"]) for r in results) / len(obs))
    by_cell: dict[str, list[int]] = {}
    for i, c in enumerate(cases):
        by_cell.setdefault(cell_name(c.task_id, c.force_decay), []).append(i)
    above_slerp = paired_margin(
        [ep.shipped(i).scaled_reward for i in range(len(obs))],
        [r["scaled_reward"] for r in baseline["uniform_slerp"]],
    )
    metrics.update(
        {
            "margin_over_slerp": mine - metrics[f"uniform_slerp_{SCALED_REWARD_MEAN}"],
            "margin_over_slerp_lower": above_slerp["lower"],
            "p_no_better_than_slerp": above_slerp["p"],
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
            "per_cell_parse_rate": {
                k: float(np.mean([ep.rollouts[i].plan is not None for i in idx]))
                for k, idx in by_cell.items()
            },
            f"per_cell_{HARD_RULE_SHARE}": {k: _mean(ep, idx, "broken_rules") for k, idx in by_cell.items()},
            f"per_cell_raw_{HARD_RULE_SHARE}": {
                k: float(np.mean([bool(ep.rollouts[i].broken_rules) for i in idx]))
                for k, idx in by_cell.items()
            },
            "per_cell_repair_share": {
                k: float(np.mean([ep.rollouts[i].changed for i in idx])) for k, idx in by_cell.items()
            },
            f"oracle_per_cell_{HARD_RULE_SHARE}": {
                k: float(np.mean([bool(baseline["oracle"][i]["broken_rules"]) for i in idx]))
                for k, idx in by_cell.items()
            },
            "eval_seconds": time.perf_counter() - t0,
        }
    )
    samples = [
        {"task_id": ep.task_ids[i], "seed": ep.seeds[i], "completion": ep.texts[i][:2000]}
        for i in range(min(3, len(ep.texts)))
    ]
    breaks = sum(bool(ep.shipped(i).broken_rules) for i in range(len(ep.rollouts)))
    report = _checked_report(path, stage, tasks, window, force_decay, max_new_tokens, metrics, thresholds,
                             samples, guarantee(breaks, len(ep.rollouts)))  # fmt: skip
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
        engine=engine_on(settings.engine),
    )
    return write_gate(path, report)


def _mean(ep, index: list[int], field_name: str) -> float:
    """Mean over the episodes ``index`` of a rollout field (a list of broken rules counts as 0 / 1)."""
    return float(sum(float(bool(v) if isinstance(v, tuple) else v) for v in
                     (getattr(ep.shipped(i), field_name) for i in index)) / len(index))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The gate file
# ---------------------------------------------------------------------------------------------
