"""What the staging engine did to a viewed plan: the plan as written beside the plan it executes.

The planner proposes, the staging engine (:mod:`server.staging_engine`) executes a plan that breaks no
hard rule, changing as little as it can. The treatment viewer shows a plan the engine changed twice, side
by side on one slider, each scored by the environment as any plan (:func:`orthojob.eval.plan_geometry.
plan_view`): ``<name> (as written)`` and ``<name> (executed, staging engine v<version>)``, with what the
engine changed (:func:`changes_html`: the rules the written plan broke, repaired or replaced by which
fallback, the share of the planned movement kept and changed, and per tooth the field, its value as
written and executed, and the repair that made it) and, on the executed plan's staging chart, the
aligners at which a tooth's planned movement differs from the written plan's (:func:`changed_cells`). A
plan the engine leaves unchanged is shown once, with a line saying so.

Sources: the engine's record is :meth:`server.staging_engine.Repair.as_dict` (from
:func:`server.staging_engine.execute_plan_dicts` for ``orthojob view``, from the evaluation's rollouts,
:attr:`orthojob.rewards.rollouts.Rollout.repair`, for its MLflow viewers); the per-aligner movements are
the two views' :attr:`~orthojob.eval.plan_geometry.PlanView.increment_mm`. Nothing is scored a second way:
the executed plan is scored as its plan dict (:func:`server.staging_engine.spec_to_plan`), which is the
evaluation's executed score but for a written plan with unusable groups, whose format share the evaluation
keeps off the executed plan's terminal score (:attr:`server.staging_engine.Execution.results`).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from orthojob.eval.plan_geometry import PlanView, plan_view
from server.cases import Case
from server.staging_engine import FALLBACK, UNCHANGED, execute_plan_dicts

MOVEMENT_CHANGE_MM: float = 1e-6
"""Smallest difference (mm-equivalent per aligner) between the written and the executed plan's planned
movement that marks an aligner cell as changed; below it the two are one staging up to float rounding."""

FALLBACK_TEXT: dict[str, str] = {"uniform": "uniform staging (its strategy kept)", "nothing": "no movement"}
"""How the page names the engine's fallbacks (:func:`server.staging_repairs.fallbacks`); a slowed uniform
staging ``uniform_x<factor>`` reads "uniform staging at <factor> of its speed"."""

FIELD_TEXT: dict[str, str] = {
    "start_stage": "start aligner",
    "fraction": "fraction per aligner",
    "overcorrection": "overcorrection",
}
"""The plan fields a change names (:attr:`server.staging_engine.Change.field`), as the page writes them."""


def written_name(name: str) -> str:
    return f"{name} (as written)"


def executed_name(name: str, repair: dict) -> str:
    return f"{name} (executed, staging engine v{repair['engine_version']})"


def pair_views(
    case: Case, name: str, plan: dict, text: str | None, repair: dict | None, executed: dict | None
) -> list[PlanView]:
    """The views of one plan on a case as the engine left it: ``repair`` its record
    (:meth:`server.staging_engine.Repair.as_dict`; None: the engine was not run, the plan is shown alone,
    with no note), ``executed`` the executed plan dict where the engine changed the plan. A changed plan gives
    two views, as written and executed (the latter's :attr:`PlanView.written` is the former); an unchanged
    one gives one view carrying the record."""
    raw = plan_view(case, plan, name, text)
    if repair is None:
        return [raw]
    if repair["status"] == UNCHANGED or executed is None:
        return [replace(raw, engine=repair)]
    raw = replace(raw, name=written_name(name), engine=repair)
    done = plan_view(case, executed, executed_name(name, repair), text)
    return [raw, replace(done, engine=repair, written=raw)]


def executed_views(case: Case, plans: Sequence[tuple[str, dict, str | None]]) -> list[PlanView]:
    """The views of ``plans`` ``(name, plan, completion text or None)`` on a case with the staging
    engine: each plan executed (:func:`server.staging_engine.execute_plan_dicts`) and shown by
    :func:`pair_views`."""
    if not plans:
        return []
    executed, run = execute_plan_dicts([plan for _, plan, _ in plans], [case] * len(plans))
    views = []
    for (name, plan, text), done, record in zip(plans, executed, run.records):
        views += pair_views(case, name, plan, text, record.as_dict(), done)
    return views


def rollout_views(case: Case, name: str, rollout, text: str | None) -> list[PlanView]:
    """The views of an evaluated plan (:class:`orthojob.rewards.rollouts.Rollout`): its record and its
    executed plan as the evaluation's engine left them (nothing executed again)."""
    executed = rollout.executed.plan if rollout.executed is not None else None
    return pair_views(case, name, rollout.plan, text, rollout.repair, executed)


def changed_cells(view: PlanView) -> np.ndarray | None:
    """(24, 28) bool, aligners x teeth: where an executed plan's planned movement per aligner differs
    from the written plan's by more than :data:`MOVEMENT_CHANGE_MM`; None for a view that is not an
    executed plan the engine changed."""
    if view.written is None:
        return None
    return np.abs(view.increment_mm[1:] - view.written.increment_mm[1:]) > MOVEMENT_CHANGE_MM


CHANGED_TRACE: str = "changed by the staging engine"
"""The name (legend entry) of the staging chart's layer of the aligners whose planned movement changed."""


def changed_trace(view: PlanView, tooth_labels: Sequence[str]) -> dict | None:
    """The executed plan's staging-chart layer (a plotly scatter trace) outlining the cells of
    :func:`changed_cells`, x the aligner (1..24), y the tooth's label, each cell's hover giving the
    planned movement as written and as executed (mm-equivalent); None for a view that is not an executed
    plan the engine changed."""
    cells = changed_cells(view)
    if cells is None:
        return None
    s_idx, t_idx = np.nonzero(cells)
    before, after = view.written.increment_mm[1:], view.increment_mm[1:]
    return {
        "type": "scatter",
        "x": (s_idx + 1).tolist(),
        "y": [tooth_labels[t] for t in t_idx],
        "mode": "markers",
        "name": CHANGED_TRACE,
        "marker": {"symbol": "square-open", "size": 13, "color": "#00a0a0", "line": {"width": 2}},
        "hovertext": [
            f"tooth {tooth_labels[t]}, aligner {s + 1}: as written {before[s, t]:.3f} -> executed "
            f"{after[s, t]:.3f} mm-eq"
            for s, t in zip(s_idx, t_idx)
        ],
        "hoverinfo": "text",
    }


def fallback_text(fallback: str) -> str:
    """The page's words for a fallback name (:data:`FALLBACK_TEXT`)."""
    if fallback.startswith("uniform_x"):
        return f"uniform staging at {fallback.removeprefix('uniform_x')} of its speed"
    return FALLBACK_TEXT.get(fallback, fallback)


def panel_note(view: PlanView) -> str:
    """The line a plan's panel carries about the engine (HTML): executed as written, changed (on the
    written plan's view), or what was executed (on the executed plan's view); empty without a record."""
    r = view.engine
    if r is None:
        return ""
    version = html.escape(str(r["engine_version"]))
    if r["status"] == UNCHANGED:
        text = f"The staging engine (v{version}) executed this plan as written: it breaks no hard rule."
    elif view.written is None:
        text = "The plan as written; the staging engine changed it (see what the staging engine changed)."
    else:
        text = f"The plan the staging engine (v{version}) executes: {_status_text(r)}."
    return f"<p class='engine-note'>{text}</p>"


def _status_text(r: dict) -> str:
    if r["status"] == FALLBACK:
        return f"replaced by its fallback, {html.escape(fallback_text(str(r['fallback'])))}"
    return "repaired"


def _value(field: str, x: float | int) -> str:
    return str(int(x)) if field == "start_stage" else f"{x:.4f}"


def changes_html(view: PlanView, index: int) -> str:
    """The page's section on what the engine changed in the plan an executed view came from (HTML;
    ``index``: the executed view's place on the page, for the element ids). Empty for any other view."""
    cells = changed_cells(view)
    if cells is None:
        return ""
    r = view.engine
    broke = html.escape(", ".join(r["raw_broken_rules"]) or "none")
    still = html.escape(", ".join(r["broken_rules"]) or "none")
    rows = "".join(
        f"<tr><td>{c['tooth']}</td><td>{html.escape(FIELD_TEXT.get(c['field'], c['field']))}</td>"
        f"<td>{_value(c['field'], c['old'])}</td><td>{_value(c['field'], c['new'])}</td>"
        f"<td>{html.escape(c['repair'])}</td></tr>"
        for c in r["changes"]
    )
    teeth = ", ".join(str(t) for t in r["teeth"]) or "none"
    return (
        f"<div class='engine' id='engine-{index}'><h3>What the staging engine changed: "
        f"{html.escape(view.written.name)}</h3>"
        f"<p>The plan as written broke: <b>{broke}</b>. Status: <b>{_status_text(r)}</b>; the executed plan "
        f"breaks: {still}.</p>"
        f"<p>Planned movement kept: <b>{100 * r['kept_share']:.1f}%</b>; on the teeth the engine changed: "
        f"<b>{100 * r['changed_share']:.1f}%</b>. Teeth changed: {teeth}. Aligners at which a tooth's planned "
        f"movement changed: {int(cells.sum())} (outlined on the executed plan's staging chart).</p>"
        f"<table class='changes' id='changes-{index}'><tr><th>tooth (FDI)</th><th>field</th><th>as written</th>"
        f"<th>executed</th><th>repair</th></tr>{rows}</table></div>"
    )
