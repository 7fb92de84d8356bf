"""Emergent-behaviour analysis of GRPO completions (``orthojob grpo --analyze``): early vs late.

Training writes one JSON line per completion to ``<out>/completions.jsonl``
(``RecordingGRPOTrainer``, built by :func:`orthojob.stages.grpo._make_trainer_class`): ``step``, ``seed``,
``task_id``, ``force_decay``, ``completion`` (text), ``rewards`` (by function) and ``advantage``. :func:`analyze` re-reads the
plans in them, replays each on its case (:func:`server.treatment.rollout_plans`, the simulator the
rewards used) and compares four metrics between the **first 20 %** and the **last 20 %** of the
logged steps (by distinct step number; with a single step both windows are that step).

Only completions that hold a JSON object (:func:`orthojob.core.parsing.extract_plan`) count: a
completion without one says nothing about what the policy plans (the simulator would run it as
uniform SLERP). Each metric is computed per plan and averaged over the window's plans where it is
defined; ``n`` columns say over how many.

Definitions (the four emergent-behaviour metrics the project's original specification names, made
precise for this environment):

``staging_correlation``
    Spearman's rho, per plan, between each tooth's **declared priority rank** (``high`` 0,
    ``medium`` 1, ``low`` 2, from the first group that lists the tooth, as written: also groups
    the simulator ignores) and its **movement start stage** (:func:`server.plans.normalize_plan`'s
    start stage, or 25 = never when its fraction is 0). Teeth listed with no or an unknown
    priority are left out. 1.0: the priorities the model writes are what stages the teeth; lower:
    they are undone by fraction 0, ignored groups or duplicate listings. Undefined (left out) for
    a plan that declares a single priority level.
``max_stage_delta_mm``
    The largest planned per-stage increment of any tooth over the 24 aligners, in mm-equivalent
    (``hypot(translation mm, MM_PER_DEG x rotation deg)``, as :mod:`server.scoring` measures
    increments); the per-stage limits are 0.25 mm / 2 deg. Velocity clamping shows as a decrease.
``molar_start_stage``
    Mean movement start stage (1-24, 25 = never) of the eight molars (x6, x7) under the plan's
    semantics (teeth in no group start at stage 1). Anchorage-first staging shows as an increase.
``anterior_recovery_speed``
    Ratio of the mean **closing speed** of anterior teeth (incisors and canines, x1-x3) to that of
    posterior teeth (x4-x7), over teeth that need movement (> ``MOVEMENT_EPS_MM``). A tooth's
    closing speed is the share of its movement the *achieved* trajectory has completed at stage
    24 divided by the stages it spent closing (from its start stage to the first stage within
    5 % of its target, else to stage 24). Under force decay the achieved pose lags the aligner and
    the lag carries over (what the tooth has to recover); without it, achieved = planned.
    > 1: anteriors close their gap faster than posteriors.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from orthojob.core.parsing import completion_text, extract_plan
from server.cases import CaseKey, generate_case
from server.dental_constants import (
    IS_MOLAR,
    MM_PER_DEG,
    N_STAGES,
    PRIORITY_START_STAGE,
    TOOTH_INDEX,
    TOOTH_NUMBER,
)
from server.plans import normalize_plan
from server.scoring import MOVEMENT_EPS_MM, increments, movement_mm
from server.treatment import rollout_plans

METRICS: tuple[str, ...] = (
    "staging_correlation",
    "max_stage_delta_mm",
    "molar_start_stage",
    "anterior_recovery_speed",
)
WINDOW_SHARE: float = 0.2
"""Share of the logged steps in each of the early and late windows."""
NEVER: int = N_STAGES + 1
CLOSED_SHARE: float = 0.95
"""A tooth has closed its gap once its achieved progress reaches this share."""
IS_ANTERIOR: np.ndarray = TOOTH_NUMBER <= 3
_PRIORITY_RANK: dict[str, int] = {
    p: r for r, p in enumerate(sorted(PRIORITY_START_STAGE, key=PRIORITY_START_STAGE.get))
}


def read_records(path: str | Path) -> list[dict]:
    """The records of a completions JSONL file (blank lines skipped; a bad line raises ValueError)."""
    records = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc})") from None
            if not isinstance(rec, dict) or "step" not in rec or "completion" not in rec:
                raise ValueError(f"{path}:{lineno}: a record needs 'step' and 'completion'")
            records.append(rec)
    return records


def windows(steps: Iterable[int], share: float = WINDOW_SHARE) -> tuple[set[int], set[int]]:
    """The early and late step sets: the first and last ceil(share x distinct steps) steps."""
    distinct = sorted(set(steps))
    if not distinct:
        return set(), set()
    k = max(1, math.ceil(share * len(distinct)))
    return set(distinct[:k]), set(distinct[-k:])


def _declared_ranks(plan: dict) -> dict[int, int]:
    """Tooth index -> declared priority rank (first group listing the tooth, as written)."""
    out: dict[int, int] = {}
    groups = plan.get("tooth_groups")
    if not isinstance(groups, list):
        return out
    for group in groups:
        if not isinstance(group, dict) or not isinstance(group.get("teeth"), list):
            continue
        priority = group.get("priority")
        for tooth in group["teeth"]:
            index = TOOTH_INDEX.get(tooth) if isinstance(tooth, int) and not isinstance(tooth, bool) else None
            if index is None or index in out:
                continue
            if isinstance(priority, str) and priority in _PRIORITY_RANK:
                out[index] = _PRIORITY_RANK[priority]
            else:
                out[index] = -1  # listed, but with no usable priority: taken, then left out
    return {k: v for k, v in out.items() if v >= 0}


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 2 or np.all(x == x[0]) or np.all(y == y[0]):
        return math.nan
    from scipy.stats import spearmanr

    return float(spearmanr(x, y).statistic)


def plan_metrics(plans: list[dict], cases: list[CaseKey]) -> list[dict[str, float]]:
    """The four metrics (NaN where undefined) of each parsed plan on its case (:class:`server.cases.CaseKey`)."""
    if not plans:
        return []
    specs = [normalize_plan(p) for p in plans]
    resolved = [generate_case(*c) for c in cases]
    planned, achieved = rollout_plans(specs, resolved)
    inc_t, inc_r = increments(planned)  # (B, 24, 28)
    max_delta = np.hypot(inc_t, MM_PER_DEG * inc_r).max(axis=(-2, -1))
    target = np.stack([c.target for c in resolved])  # (B, 28, 7)
    need = movement_mm(achieved[:, 0], target)  # (B, 28)
    remaining = movement_mm(achieved, target[:, None])  # (B, 25, 28)
    progress = 1.0 - remaining / np.maximum(need[:, None], 1e-12)
    out = []
    for b, (plan, spec) in enumerate(zip(plans, specs)):
        start = np.where(spec.fraction > 0, spec.start, NEVER)
        declared = _declared_ranks(plan)
        teeth = sorted(declared)
        rho = _spearman(np.array([declared[t] for t in teeth], float), start[teeth].astype(float))
        moving = need[b] > MOVEMENT_EPS_MM
        closed = progress[b] >= CLOSED_SHARE  # (25, 28)
        first_closed = np.where(closed.any(axis=0), np.argmax(closed, axis=0), N_STAGES)
        stages = np.maximum(first_closed - np.minimum(start, N_STAGES) + 1, 1)
        speed = np.clip(progress[b, -1], 0.0, 1.0) / stages
        ant, post = speed[moving & IS_ANTERIOR], speed[moving & ~IS_ANTERIOR]
        ratio = math.nan
        if len(ant) and len(post) and post.mean() > 0:
            ratio = float(ant.mean() / post.mean())
        out.append(
            {
                "staging_correlation": rho,
                "max_stage_delta_mm": float(max_delta[b]),
                "molar_start_stage": float(start[IS_MOLAR].mean()),
                "anterior_recovery_speed": ratio,
            }
        )
    return out


def _window_summary(records: list[dict], steps: set[int]) -> dict:
    chosen = [r for r in records if r["step"] in steps]
    plans, cases = [], []
    for r in chosen:
        plan = extract_plan(completion_text(r["completion"]))
        if plan is not None:
            plans.append(plan)
            cases.append(CaseKey.of_row(r))
    per_plan = plan_metrics(plans, cases)
    summary: dict = {
        "steps": [min(steps), max(steps)] if steps else [],
        "completions": len(chosen),
        "parsed": len(plans),
    }
    for name in METRICS:
        values = [m[name] for m in per_plan if not math.isnan(m[name])]
        summary[name] = float(np.mean(values)) if values else None
        summary[f"{name}_n"] = len(values)
    rewards: dict[str, list[float]] = {}
    for r in chosen:
        for key, value in (r.get("rewards") or {}).items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                rewards.setdefault(key, []).append(float(value))
    summary["rewards"] = {k: float(np.mean(v)) for k, v in rewards.items()}
    return summary


def format_table(result: dict) -> str:
    """The early vs late table of :func:`analyze`'s result."""
    early, late = result["early"], result["late"]

    def cell(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.3f}"

    def steps(s: dict) -> str:
        return f"steps {s['steps'][0]}-{s['steps'][1]}" if s["steps"] else "no steps"

    rows = [
        f"{'metric':<26} {'early':>12} {'late':>12} {'change':>10}   n early/late",
        f"{'(window)':<26} {steps(early):>12} {steps(late):>12}",
    ]
    for name in METRICS:
        a, b = early[name], late[name]
        change = "n/a" if a is None or b is None else f"{b - a:+.3f}"
        rows.append(
            f"{name:<26} {cell(a):>12} {cell(b):>12} {change:>10}   {early[name + '_n']}/{late[name + '_n']}"
        )
    for key in sorted(set(early["rewards"]) | set(late["rewards"])):
        a, b = early["rewards"].get(key), late["rewards"].get(key)
        change = "n/a" if a is None or b is None else f"{b - a:+.3f}"
        rows.append(f"{'mean ' + key:<26} {cell(a):>12} {cell(b):>12} {change:>10}")
    rows.append(
        f"{'plans parsed / completions':<26} {early['parsed']:>5}/{early['completions']:<6} "
        f"{late['parsed']:>5}/{late['completions']:<6}"
    )
    return "\n".join(rows)


def analyze(completions_path: str | Path, share: float = WINDOW_SHARE, print_table: bool = True) -> dict:
    """The four emergent-behaviour metrics, early vs late (see the module docstring).

    Returns ``{"path", "records", "early": {...}, "late": {...}}``; each window holds ``steps``
    ([first, last]), ``completions``, ``parsed``, the four metrics (None when undefined in every
    plan), ``<metric>_n`` (plans it is defined for) and ``rewards`` (mean of each logged reward).
    Raises FileNotFoundError when the file is missing and ValueError on a malformed record.
    """
    records = read_records(completions_path)
    early_steps, late_steps = windows((r["step"] for r in records), share)
    result = {
        "path": str(completions_path),
        "records": len(records),
        "early": _window_summary(records, early_steps),
        "late": _window_summary(records, late_steps),
    }
    if print_table:
        print(f"=== Emergent behaviour: {completions_path} ({len(records)} completions) ===")
        print(format_table(result))
    return result


__all__ = ["METRICS", "WINDOW_SHARE", "analyze", "format_table", "plan_metrics", "read_records", "windows"]
