"""The gate file (``<checkpoint>/gate_passed.json``): the stage names, the thresholds and checks it
records, writing it, reading it back strictly, and the pre-flight that refuses an ungated checkpoint.

The evaluation that fills it is :mod:`orthojob.stages.gate`. The file::

    {"passed": true | false, "stage": "bc_sft" | "grpo" | ..., "metrics": {...}, "thresholds": {...},
     "checks": {"parse_rate": true, ...}, "checkpoint_digest": "<sha256>", "digest_files": [...],
     "evaluation": {"window": {"identity", "start", "n_per_cell", "n_cases", "cells"},
                    "guarantee": {"n_cases", "breaks", "hard_rule_rate_ruled_out", ...}, ...},
     "created_at": "...", "format_version": 1}

``evaluation.window`` is the run's window of cases (:func:`orthojob.stages.gate.gate_window`: the seeds
from ``start`` in each cell); ``evaluation.guarantee`` the hard-rule rate the verdict rules out at 95 %
confidence (:func:`orthojob.stages.gate.hard_rule_rate_bound`).

``passed`` is computed from the metrics and the thresholds (every check true), never set by hand.
:func:`check_gate` is the pre-flight of ``orthojob grpo --from-checkpoint DIR``: it raises
:class:`GateError` with a distinct exit code (10 missing, 11 unreadable or edited, 12 failed, 13 the
weights changed since the gate) and a message that says how to fix it.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from orthojob.core.metrics import HARD_RULE_SHARE, SCALED_REWARD, SCALED_REWARD_MEAN, TERMINAL_RAW, mean_of
from orthojob.modeling.models import ModelError, checkpoint_digest, checkpoint_files
from orthojob.ops.exit_codes import ExitCode
from orthojob.ops.records import json_value

log = logging.getLogger(__name__)

GATE_FILE = "gate_passed.json"


FORMAT_VERSION = 1


FORMAT_SFT = "format_sft"


TOOL_SFT = "tool_sft"


BC_SFT = "bc_sft"


GRPO = "grpo"


RSFT = "rsft"


STAGES: tuple[str, ...] = (FORMAT_SFT, TOOL_SFT, BC_SFT, GRPO, RSFT)
"""Every stage that writes a gate file, in training order: stage 0 format SFT, stage 1 tool-use
SFT, stage 2 BC SFT, stage 3 GRPO, stage 4 RSFT. Each is also the stage's pipeline folder
(``<out>/<name>``) and MLflow stage run (:data:`orthojob.stages.presets.PIPELINE_STAGES`)."""


SFT_STAGES: tuple[str, ...] = (FORMAT_SFT, BC_SFT, RSFT)
"""The stages trained with TRL's SFTTrainer (:func:`orthojob.stages.sft.run_sft`) whose gates check the plan
format (stage 1, ``tool_sft``, is trained the same way; its gate checks tool calls)."""


PREFLIGHT_REFUSALS: tuple[ExitCode, ...] = (
    ExitCode.GATE_MISSING,
    ExitCode.GATE_UNREADABLE,
    ExitCode.GATE_FAILED,
    ExitCode.GATE_DIGEST_MISMATCH,
)
"""The exit codes of :func:`check_gate`'s refusals."""


class GateError(Exception):
    """A refused pre-flight: ``exit_code`` (10-13, see the module docstring) and a fix-it ``message``."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class GateThresholds:
    """What a checkpoint must reach on held-out cases; None = not checked.

    Attributes:
        min_parse_rate: share of completions holding a JSON plan.
        min_format_reward: mean of the five format checks (:func:`orthojob.core.parsing.format_checks`).
        min_margin_over_slerp: scaled reward mean minus uniform SLERP's on the same cases.
        max_p_no_better_than_slerp: the one-sided paired t-test's p-value for "scaled reward no higher
            than uniform SLERP's on the same cases" (:func:`orthojob.stages.gate.paired_margin`; 1 for a
            planner that ties SLERP on every case): the margin must be more than the cases' noise.
        min_margin_over_oracle: scaled reward mean minus the oracle's (usually negative or None).
        max_hard_rule_share_over_oracle: share of the cases whose plan breaks a hard rule minus the
            oracle's share on the same cases (0: no worse than the oracle).
        min_strategy_accuracy: share of plans declaring the case's optimal strategy.
        max_repair_share: share of the cases whose plan the staging engine changed (repaired, or replaced
            by its fallback; :mod:`server.staging_engine`): a planner the engine must rewrite for most
            cases does not pass on the engine's quality. 0 with the engine off.
        min_tool_call_rate: (tool_sft) share of agentic episodes whose first turn is a parseable call
            of a known tool.
        min_finished_rate: (tool_sft) share of agentic episodes that finish (a plan submitted, or 24
            stages committed) within the gate's turns.
    """

    min_parse_rate: float | None = field(
        default=0.9,
        metadata={"help": "gate: share of completions holding a JSON plan", "show_default": False},
    )
    min_format_reward: float | None = field(
        default=0.8, metadata={"help": "gate: mean format score", "show_default": False}
    )
    min_margin_over_slerp: float | None = field(
        default=None, metadata={"help": "gate: scaled reward mean minus uniform SLERP's on the same cases"}
    )
    max_p_no_better_than_slerp: float | None = field(
        default=None,
        metadata={"help": "gate: p-value of the paired test that the plans score no higher than uniform "
                          "SLERP's on the same cases", "show_default": False},
    )  # fmt: skip
    min_margin_over_oracle: float | None = field(
        default=None, metadata={"help": "gate: scaled reward mean minus the oracle's on the same cases"}
    )
    max_hard_rule_share_over_oracle: float | None = field(
        default=None,
        metadata={"help": "gate: at most this share of plans breaking a hard rule beyond the oracle's on the same "
                          "cases (0: no worse than the oracle)", "show_default": False},
    )  # fmt: skip
    min_strategy_accuracy: float | None = field(
        default=None, metadata={"help": "gate: share declaring the case's optimal strategy"}
    )
    max_repair_share: float | None = field(
        default=None,
        metadata={"help": "gate: at most this share of plans changed by the staging engine",
                  "show_default": False},
    )  # fmt: skip
    min_tool_call_rate: float | None = field(
        default=None,
        metadata={"help": "gate (tool_sft): share of episodes whose first turn is a parseable tool call"},
    )
    min_finished_rate: float | None = field(
        default=None,
        metadata={"help": "gate (tool_sft): share of episodes that submit a plan (or commit 24 stages)"},
    )

    def __post_init__(self) -> None:
        # every way a threshold arrives (a preset, --set, a gate file, replace()) is checked here, so a
        # mistyped value is refused before a stage trains rather than by the gate after it
        for key, value in self.to_dict().items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"threshold {key} must be a number or null, got {value!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> GateThresholds:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - names
        if unknown:
            raise ValueError(f"unknown gate thresholds {sorted(unknown)}; known: {sorted(names)}")
        return cls(**values)

    def replace(self, **changes) -> GateThresholds:
        return dataclasses.replace(self, **changes)


HARD_RULE_BOUND: float = 0.0
"""The quality gates' default ``max_hard_rule_share_over_oracle``: no more rule-breaking plans than
the oracle's on the same held-out cases (none where the oracle breaks none)."""

REPAIR_BOUND: float = 0.5
"""The quality gates' default ``max_repair_share``: the staging engine may change at most half of the
plans. With the engine, every executed plan is safe by construction, so the hard-rule bound alone no
longer tells a planner from the engine; this bound says that most of what ships is the planner's own
plan as written, and a planner the engine must rewrite for most cases (or replace by its fallback)
fails, however good the engine's rewrites score."""

SLERP_P_BOUND: float = 0.05
"""The GRPO gate's default ``max_p_no_better_than_slerp``: its plans must beat uniform SLERP's on the
same cases at 95 % one-sided confidence (a paired t-test), not merely match them: writing uniform SLERP
as a plan ties it on every case (margin 0) and fails."""


DEFAULT_THRESHOLDS: dict[str, GateThresholds] = {
    FORMAT_SFT: GateThresholds(min_parse_rate=0.9, min_format_reward=0.8),
    TOOL_SFT: GateThresholds(
        min_parse_rate=None, min_format_reward=None, min_tool_call_rate=0.9, min_finished_rate=0.8
    ),
    BC_SFT: GateThresholds(
        min_parse_rate=0.9,
        min_format_reward=0.8,
        max_hard_rule_share_over_oracle=HARD_RULE_BOUND,
        max_repair_share=REPAIR_BOUND,
    ),
    GRPO: GateThresholds(
        min_parse_rate=0.9,
        min_format_reward=0.8,
        min_margin_over_slerp=0.0,
        max_p_no_better_than_slerp=SLERP_P_BOUND,
        max_hard_rule_share_over_oracle=HARD_RULE_BOUND,
        max_repair_share=REPAIR_BOUND,
    ),
    RSFT: GateThresholds(
        min_parse_rate=0.9,
        min_format_reward=0.8,
        max_hard_rule_share_over_oracle=HARD_RULE_BOUND,
        max_repair_share=REPAIR_BOUND,
    ),
}
"""Per stage: the format gate after format SFT, the tool-call gate after tool-use SFT, and the quality
gates (format, the hard-rule bound on the plans that ship and the repair bound) after BC and RSFT, plus the
margin over uniform SLERP after GRPO, beyond the cases' noise."""


QUALITY_STAGES: tuple[str, ...] = (BC_SFT, GRPO, RSFT)
"""The stages whose gates judge clinical plans, and so bound the hard-rule share by default."""


_METRIC_OF: dict[str, str] = {
    "min_parse_rate": "parse_rate",
    "min_format_reward": "format_reward",
    "min_margin_over_slerp": "margin_over_slerp",
    "max_p_no_better_than_slerp": "p_no_better_than_slerp",
    "min_margin_over_oracle": "margin_over_oracle",
    "max_hard_rule_share_over_oracle": "hard_rule_share_over_oracle",
    "min_strategy_accuracy": "strategy_accuracy",
    "max_repair_share": "repair_share",
    "min_tool_call_rate": "tool_call_rate",
    "min_finished_rate": "finished_rate",
}


def thresholds_for(stage: str | None) -> GateThresholds:
    """The default thresholds of a stage (a name starting with ``grpo`` shares GRPO's; any other
    unknown name BC's)."""
    if stage in DEFAULT_THRESHOLDS:
        return DEFAULT_THRESHOLDS[stage]
    if stage and stage.startswith(GRPO):
        return DEFAULT_THRESHOLDS[GRPO]
    return DEFAULT_THRESHOLDS[BC_SFT]


def gate_checks(metrics: dict, thresholds: GateThresholds | dict) -> dict[str, bool]:
    """One boolean per threshold that is set: the metric is finite and at least the threshold
    (``min_*``) or at most it (``max_*``); a missing metric fails its check."""
    values = thresholds.to_dict() if isinstance(thresholds, GateThresholds) else dict(thresholds)
    checks: dict[str, bool] = {}
    for name, limit in values.items():
        if limit is None:
            continue
        metric = metrics.get(_METRIC_OF.get(name, ""))
        ok = (
            isinstance(metric, (int, float))
            and not isinstance(metric, bool)
            and math.isfinite(metric)
            and (metric <= limit if name.startswith("max_") else metric >= limit)
        )
        checks[_METRIC_OF.get(name, name)] = bool(ok)
    return checks


def gate_path(checkpoint: str | Path) -> Path:
    return Path(checkpoint) / GATE_FILE


def write_gate(
    path: str | Path,
    metrics: dict,
    thresholds: GateThresholds | dict | None = None,
    stage: str | None = None,
) -> dict:
    """Write ``<path>/gate_passed.json`` and return its content.

    ``metrics``: the metrics dict of an evaluation, or a whole report of :func:`gate_report`
    (its metrics, thresholds, stage and context are then used unless given here). ``passed`` is
    recomputed here from the metrics and the thresholds; a ``passed`` in the input is ignored.
    ``stage`` (default: the report's, else ``bc_sft``) must be one of :data:`STAGES`.
    """
    report: dict = {}
    if isinstance(metrics, dict) and isinstance(metrics.get("metrics"), dict):
        report, metrics = metrics, metrics["metrics"]
    if not isinstance(metrics, dict) or not metrics:
        raise ValueError("write_gate needs the metrics of an evaluation (orthojob.stages.gate.gate_report)")
    stage = stage or report.get("stage") or BC_SFT
    if stage not in STAGES:
        raise ValueError(f"unknown gate stage {stage!r}: one of {', '.join(STAGES)}")
    if thresholds is None:
        thresholds = report.get("thresholds") or thresholds_for(stage)
    if isinstance(thresholds, dict):
        thresholds = GateThresholds.from_dict(thresholds)

    checks = gate_checks(metrics, thresholds)
    content = {
        "passed": bool(checks) and all(checks.values()),
        "stage": stage,
        "metrics": json_value(metrics),
        "thresholds": thresholds.to_dict(),
        "checks": checks,
        "checkpoint_digest": checkpoint_digest(path),
        "digest_files": [p.name for p in checkpoint_files(path)],
        "evaluation": {
            k: report[k]
            for k in (
                "task_ids",
                "n_seeds",
                "seed_start",
                "force_decay",
                "window",
                "max_new_tokens",
                "case_set",
                "guarantee",
            )
            if report.get(k) is not None
        },
        "samples": report.get("samples", []),
        "created_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "format_version": FORMAT_VERSION,
    }
    target = gate_path(path)
    tmp = target.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(content, indent=2, allow_nan=False))
    tmp.replace(target)
    log.info("gate %s: %s -> %s", stage, "passed" if content["passed"] else "FAILED", target)
    return content


def read_gate(checkpoint: str | Path) -> dict:
    """The parsed gate file; raises GateError 10 (missing) or 11 (unreadable, inconsistent, or of a
    stage that is not one of :data:`STAGES`)."""
    target = gate_path(checkpoint)
    redo = (
        f"Re-run the gate: orthojob gate --checkpoint {checkpoint} --stage {BC_SFT} (after orthojob bc-sft --no-gate --out "
        f"{checkpoint})."
    )
    if not target.is_file():
        where = "" if Path(checkpoint).is_dir() else f" (the folder {checkpoint} does not exist)"
        raise GateError(
            ExitCode.GATE_MISSING,
            f"gate file {target} missing{where}: this checkpoint was never evaluated. Train it with "
            f"orthojob bc-sft --no-gate --out {checkpoint}, then evaluate it with orthojob gate --checkpoint {checkpoint} "
            "(or run orthojob pipeline). --skip-sft-gate bypasses the check (NOT recommended).",
        )
    try:
        content = json.loads(target.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise GateError(
            ExitCode.GATE_UNREADABLE, f"gate file {target} is not readable JSON ({exc}). {redo}"
        ) from None
    problems = []
    if not isinstance(content, dict):
        problems.append("not a JSON object")
    else:
        if not isinstance(content.get("passed"), bool):
            problems.append("'passed' is not true/false")
        if not isinstance(content.get("checkpoint_digest"), str):
            problems.append("no 'checkpoint_digest'")
        if not isinstance(content.get("metrics"), dict):
            problems.append("no 'metrics'")
        if not isinstance(content.get("thresholds"), dict):
            problems.append("no 'thresholds'")
        if content.get("stage") is not None and content.get("stage") not in STAGES:
            problems.append(f"its stage {content.get('stage')!r} is not a stage: one of {', '.join(STAGES)}")
    if problems:
        raise GateError(
            ExitCode.GATE_UNREADABLE, f"gate file {target} is malformed: {'; '.join(problems)}. {redo}"
        )
    try:
        thresholds = GateThresholds.from_dict(content["thresholds"])
    except (TypeError, ValueError) as exc:
        raise GateError(
            ExitCode.GATE_UNREADABLE, f"gate file {target} has bad thresholds ({exc}). {redo}"
        ) from None
    checks = gate_checks(content["metrics"], thresholds)
    if content["passed"] != (bool(checks) and all(checks.values())):
        raise GateError(
            ExitCode.GATE_UNREADABLE,
            f"gate file {target} says passed={content['passed']}, but its own metrics and thresholds give "
            f"{checks}: the file was edited, not written by an evaluation. {redo}",
        )
    return content


def check_gate(
    checkpoint: str | Path, accept: Sequence[str] | None = STAGES, passed_only: bool = True
) -> dict:
    """The pre-flight of a stage that starts from a checkpoint (GRPO, RSFT): the gate file's content
    when ``checkpoint`` has a passed gate of a stage in ``accept`` (None: any) whose digest still
    matches; else raise :class:`GateError` (exit codes 10-13, see the module docstring; a gate of a
    stage not in ``accept`` is 11). ``passed_only`` False: a failed gate is returned too (the
    pipeline's resume: the gate is intact, whatever its verdict)."""

    content = read_gate(checkpoint)
    if accept is not None and content.get("stage") not in accept:
        raise GateError(
            ExitCode.GATE_UNREADABLE,
            f"gate file {gate_path(checkpoint)} is for stage {content.get('stage')!r}, not a stage this one "
            f"starts from ({', '.join(accept)}). Gate the checkpoint as one: orthojob gate --checkpoint "
            f"{checkpoint} --stage {accept[0]}.",
        )
    if passed_only and not content["passed"]:
        failed = [k for k, ok in (content.get("checks") or {}).items() if not ok]
        metrics = content["metrics"]
        shown = ", ".join(
            f"{k}={metrics.get(k):.3f}"
            if isinstance(metrics.get(k), (int, float))
            else f"{k}={metrics.get(k)}"
            for k in failed
        )
        raise GateError(
            ExitCode.GATE_FAILED,
            f"checkpoint {checkpoint} failed its {content.get('stage')} gate ({shown or 'no checks'}; thresholds "
            f"{content['thresholds']}). Train it further (orthojob bc-sft with more --steps / --examples, or a higher "
            f"--lr), then re-run orthojob gate --checkpoint {checkpoint}.",
        )
    try:
        digest = checkpoint_digest(checkpoint)
    except ModelError as exc:
        digest = f"unavailable ({exc})"
    if digest != content["checkpoint_digest"]:
        raise GateError(
            ExitCode.GATE_DIGEST_MISMATCH,
            f"checkpoint {checkpoint} changed since its gate: sha256 of its weight and config files is "
            f"{digest}, the gate recorded {content['checkpoint_digest']} (files {content.get('digest_files')}). "
            f"Re-run orthojob gate --checkpoint {checkpoint} to evaluate the checkpoint as it is now.",
        )
    return content


def _num(value, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "n/a"


def format_gate(content: dict) -> str:
    """A few lines: stage, verdict, every check with its metric and threshold, the window and the
    hard-rule rate the verdict rules out, the headline metric and
    the hard-rule share beside the baselines', the raw terminal score last (for reference)."""
    m = content["metrics"]
    lines = [f"gate {content.get('stage')}: {'PASSED' if content['passed'] else 'FAILED'}"]
    for name, limit in content["thresholds"].items():
        if limit is None:
            continue
        metric = _METRIC_OF.get(name, name)
        ok = content["checks"].get(metric)
        sign = "<=" if name.startswith("max_") else ">="
        lines.append(f"  {metric:<28} {_num(m.get(metric)):>8}  {sign} {limit:<6}  {'ok' if ok else 'FAIL'}")
    lines.extend(_guarantee_lines(content.get("evaluation") or content))
    if SCALED_REWARD_MEAN in m:
        lines.append(
            f"  {SCALED_REWARD} {_num(m.get(SCALED_REWARD_MEAN))}  uniform SLERP "
            f"{_num(m.get(f'uniform_slerp_{SCALED_REWARD_MEAN}'))}  oracle {_num(m.get(f'oracle_{SCALED_REWARD_MEAN}'))}"
            f"  |  {HARD_RULE_SHARE} {_num(m.get(HARD_RULE_SHARE))}  oracle {_num(m.get(f'oracle_{HARD_RULE_SHARE}'))}"
            f"  |  strategy accuracy {_num(m.get('strategy_accuracy'))} (oracle {_num(m.get('oracle_strategy_accuracy'))})"
        )  # fmt: skip
        if m.get("engine") not in (None, "off"):
            lines.append(
                f"  staging engine v{m['engine']}: the figures above judge the executed plans; the raw plans: "
                f"{SCALED_REWARD} {_num(m.get(f'raw_{SCALED_REWARD_MEAN}'))}, {HARD_RULE_SHARE} "
                f"{_num(m.get(f'raw_{HARD_RULE_SHARE}'))}; repaired {_num(m.get('repair_share'))} of the plans "
                f"(fallback {_num(m.get('fallback_share'))}), {_num(m.get('repaired_movement_share'))} of the "
                "planned movement"
            )
        elif m.get("engine") == "off":
            lines.append("  staging engine off: the figures above judge the raw plans")
        lines.append(
            f"  ({TERMINAL_RAW}, unscaled, for reference: {_num(m.get(mean_of(TERMINAL_RAW)))}, uniform SLERP "
            f"{_num(m.get(f'uniform_slerp_{mean_of(TERMINAL_RAW)}'))}, oracle {_num(m.get(f'oracle_{mean_of(TERMINAL_RAW)}'))})"
        )  # fmt: skip
    return "\n".join(lines)


def _guarantee_lines(evaluation: dict) -> list[str]:
    """The window a gate judged and the hard-rule rate its verdict rules out (none for a gate file
    without them)."""
    lines = []
    window, g = evaluation.get("window"), evaluation.get("guarantee")
    if window:
        cells = ", ".join(f"{c['task_id']}{'+decay' if c['force_decay'] else ''}" for c in window["cells"])
        lines.append(
            f"  window: seeds {window['start']}..{window['start'] + window['n_per_cell'] - 1} in each of "
            f"{len(window['cells'])} cells ({cells}): {window['n_cases']} cases, drawn for {window['identity'][:24]}"
        )
    if g:
        lines.append(
            f"  guarantee: {g['breaks']} rule-breaking plans in {g['n_cases']} cases rule out a hard-rule rate "
            f"above {100 * g['hard_rule_rate_ruled_out']:.2f} % at {100 * g['confidence']:.0f} % confidence "
            f"(no break in {g['n_cases']}: 1 - 0.05^(1/n) = {100 * g['rate_ruled_out_with_no_break']:.2f} %)"
        )
    return lines
