"""The treatment viewer: one self-contained HTML page of a case and the plans proposed for it.

What a clinician reviewing a proposed treatment, and an ML engineer reviewing a run, look at:

* both arches in 3-D with one slider over stages 0-24 for every plan on the page (side by side):
  the achieved crowns, coloured by the stage's PDL stress (kPa) or its limit ratio (the aligner's
  increment over the per-stage limit), the aligner's (planned) shape as a ghost where the teeth
  do not follow it (force decay, non-compliance), the target as open markers, and the contacts that
  collide at that stage as red segments;
* a staging chart per plan: teeth x aligners, the planned movement per aligner (mm-equivalent),
  with limit breaches, PDL stress over critical and collisions marked;
* the per-stage reward components of the stepwise environment (its step reward, the running
  accuracy, the limit and collision penalties) and the stage's peak PDL stress, teeth over the
  limit and colliding contacts;
* the plan's score as GRPO and the evaluation see it (terminal and scaled reward, broken hard
  rules, every component), and the case's diagnosis (the casts' measures; the case's profile and
  optimal strategy, which the planner does not see; the oracle's reading of the setup);
* with the staging engine (:mod:`orthojob.eval.engine_view`), a plan the engine changed as written
  and as executed, side by side, what the engine changed per tooth, and on the executed plan's
  staging chart the aligners at which a tooth's planned movement changed.

Every number comes from the environment (``server``): the trajectories from
:func:`server.treatment.rollout_plans` and from stepping :class:`server.dental_environment.
StepwiseDentalEnvironment` with the plan's aligners (the achieved poses, step rewards and the
session's own :class:`server.scoring.StageMeasures`), the per-tooth measures from
:func:`server.scoring.pdl_stress_kpa` and :func:`server.scoring.limit_ratio`, the collisions from
:func:`server.collisions.collision_severity`, the score from :func:`server.treatment.score_plan_specs`.
Nothing here scores anything a second way.

The page inlines plotly's JavaScript (no network when it is opened); MLflow renders it as an
artifact. Crowns are drawn as elliptic prisms of the crown's mesiodistal width and buccolingual
depth, :data:`DRAWN_HEIGHT_SHARE` of its crown height tall, centred on the crown centroid and
turned by its orientation (a drawing, not the scoring geometry, which is the occlusal ellipse).

Entry points: :func:`plan_view` (one plan's arrays), :func:`render_html` / :func:`write_viewer`
(the page), :func:`resolve_plan` (``orthojob view``'s plan sources), :func:`log_checkpoint_viewers`,
:func:`log_baseline_viewers` and :func:`grpo_viewer_callback` (MLflow artifacts of evaluations and
GRPO runs).
"""

from __future__ import annotations

import html
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from orthojob.core.parsing import find_plan
from orthojob.eval import engine_view
from orthojob.eval.plan_geometry import PlanView, _rounded, plan_view, prism_triangles, stage_data
from server.cases import Case
from server.collisions import COLLISION_TOLERANCE_MM
from server.dental_constants import (
    ADJACENT_PAIRS,
    LIMIT_TOLERANCE,
    MAX_TRANSLATION_MM,
    N_STAGES,
    PDL_CRITICAL_KPA,
    TOOTH_IDS,
)
from server.dental_environment import initial_observation
from server.oracle import infer_profiles, oracle_plan
from server.plans import UNIFORM_FRACTION

log = logging.getLogger(__name__)

VIEWER_ARTIFACT_DIR: str = "viewers"
"""MLflow artifact folder of the viewers (``viewers/evaluate/...``, ``viewers/grpo/...``)."""
EVALUATION_VIEWER_CASES: int = 2
"""Held-out cases per task an evaluation logs a viewer for (each ~5 MB: plotly's JS is inlined)."""
GRPO_VIEWER_EVERY: int = 10
"""GRPO logs its best and worst completions' viewers every this many optimizer steps."""
PDL_COLOUR_MAX_KPA: float = 1.5 * PDL_CRITICAL_KPA
"""Top of the PDL colour scale: where :func:`server.scoring.pdl_tooth_score` reaches 0."""
LIMIT_COLOUR_MAX: float = 1.5
"""Top of the limit-ratio colour scale (1 = at the per-stage limit)."""
LAG_COLOUR_MIN_MM: float = 0.1
"""Smallest top of the lag colour scale (mm-equivalent); else the page's largest lag."""
BASELINE_PLANS: dict[str, dict] = {
    "uniform_slerp": {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": UNIFORM_FRACTION}]},
    "do_nothing": {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 0.0}]},
}
"""The fixed baselines (as :data:`orthojob.eval.evaluation.BASELINES`); ``oracle`` is computed per case."""


# ---------------------------------------------------------------------------------------------
# Plan sources (orthojob view)
# ---------------------------------------------------------------------------------------------


class PlanSourceError(ValueError):
    """A plan source that cannot be read; the message says what to pass instead."""


PLAN_SOURCES_HELP: str = (
    "oracle | uniform_slerp | do_nothing | plan:FILE.json (a plan object) | completion:FILE "
    "(a completion's text; its plan is parsed as the rewards parse it) | checkpoint:DIR "
    "(the checkpoint's greedy plan for the case) | FILE.json"
)


def resolve_plan(
    source: str, case: Case, complete: Callable[[str, dict], str] | None = None
) -> tuple[str, dict, str | None]:
    """``(name, plan, completion text or None)`` of a plan source (:data:`PLAN_SOURCES_HELP`) for a
    case; :class:`PlanSourceError` when it cannot be read. ``complete(folder, observation)``: a
    checkpoint's completion for the case's stage-0 observation (``orthojob view`` passes the
    evaluation's greedy decoding); without it a ``checkpoint:`` source is refused."""

    kind, _, rest = source.partition(":")
    if source == "oracle":
        return "oracle", oracle_plan(initial_observation(case)), None
    if source in BASELINE_PLANS:
        return source, BASELINE_PLANS[source], None
    if kind == "checkpoint" and rest:
        if complete is None:
            raise PlanSourceError("checkpoint sources need a model to decode with (use orthojob view)")
        if not Path(rest).is_dir():
            raise PlanSourceError(f"checkpoint folder {rest} does not exist")
        return plan_of_text(Path(rest).name, complete(rest, initial_observation(case)), f"checkpoint {rest}")
    if kind in ("plan", "completion") and rest:
        path = Path(rest)
    elif source.endswith(".json"):
        kind, path = "plan", Path(source)
    else:
        raise PlanSourceError(f"unknown plan source {source!r}: use one of {PLAN_SOURCES_HELP}")
    if not path.is_file():
        raise PlanSourceError(f"{kind} file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if kind == "completion":
        return plan_of_text(path.stem, text, str(path))
    try:
        plan = json.loads(text)
    except ValueError as exc:
        raise PlanSourceError(f"{path} is not JSON ({exc}); pass a completion as completion:{path}") from None
    if not isinstance(plan, dict) or "tooth_groups" not in plan:
        raise PlanSourceError(f"{path} holds no plan object (a JSON object with 'tooth_groups')")
    return path.stem, plan, None


def plan_of_text(name: str, text: str, where: str) -> tuple[str, dict, str]:
    """``(name, plan, text)`` of a completion, its plan parsed as the rewards parse it
    (:func:`orthojob.core.parsing.find_plan`); :class:`PlanSourceError` naming ``where`` when it holds none."""
    plan = find_plan(text)[0]
    if plan is None or "tooth_groups" not in plan:
        raise PlanSourceError(
            f"{where}: the completion holds no plan (no JSON object with 'tooth_groups'); it begins {text[:200]!r}"
        )
    return name, plan, text


# ---------------------------------------------------------------------------------------------
# Drawing: pure functions of the arrays
# ---------------------------------------------------------------------------------------------


def _go():
    import plotly.graph_objects as go

    return go


TOOTH_LABELS: list[str] = [str(t) for t in TOOTH_IDS]


def arch_figure(view: PlanView, case: Case, data: dict) -> dict:
    """The 3-D figure (plotly JSON) of a plan at stage 0; the page's slider restyles its traces:
    0 achieved crowns (coloured), 1 aligner ghost, 2 centroids, 3 collisions, 4 target."""
    go = _go()
    ii, jj, kk = prism_triangles()
    v = data["vertices_per_tooth"]
    ghost = not case.follows_plan
    hover = [
        f"tooth {t}<br>stage 0<br>PDL 0 kPa<br>limit ratio 0" for t in TOOTH_IDS
    ]  # the page rewrites it per stage
    fig = go.Figure(
        [
            go.Mesh3d(
                x=data["mesh"]["x"][0], y=data["mesh"]["y"][0], z=data["mesh"]["z"][0],
                i=ii, j=jj, k=kk,
                intensity=np.repeat(data["pdl_kpa"][0], v).tolist(),
                cmin=0.0, cmax=PDL_COLOUR_MAX_KPA,
                colorscale=[[0.0, "#2c7bb6"], [PDL_CRITICAL_KPA / PDL_COLOUR_MAX_KPA * 0.55, "#ffffbf"],
                            [PDL_CRITICAL_KPA / PDL_COLOUR_MAX_KPA, "#fdae61"], [1.0, "#d7191c"]],
                colorbar={"title": {"text": "PDL kPa"}, "len": 0.6},
                flatshading=True, name="achieved crowns", hoverinfo="skip", showscale=True,
            ),
            go.Mesh3d(
                x=data["aligner"]["x"][0], y=data["aligner"]["y"][0], z=data["aligner"]["z"][0],
                i=ii, j=jj, k=kk, color="#888888", opacity=0.22, name="aligner (planned)",
                hoverinfo="skip", visible=ghost, showlegend=ghost,
            ),
            go.Scatter3d(
                x=data["centroid"]["x"][0], y=data["centroid"]["y"][0], z=data["centroid"]["z"][0],
                mode="markers+text", text=TOOTH_LABELS, textfont={"size": 8}, hovertext=hover,
                hoverinfo="text", marker={"size": 2, "color": "#222"}, name="crown centroids",
            ),
            go.Scatter3d(
                x=data["collisions"][0]["x"], y=data["collisions"][0]["y"], z=data["collisions"][0]["z"],
                mode="lines+markers", line={"color": "#e31a1c", "width": 9}, marker={"size": 4, "color": "#e31a1c"},
                hovertext=data["collisions"][0]["label"], hoverinfo="text", name="collisions",
            ),
            go.Scatter3d(
                x=_rounded(case.target[:, 4]), y=_rounded(case.target[:, 5]), z=_rounded(case.target[:, 6]),
                mode="markers", marker={"size": 3, "symbol": "diamond-open", "color": "#1a9641"},
                name="target", hovertext=[f"target {t}" for t in TOOTH_IDS], hoverinfo="text",
            ),
        ]
    )  # fmt: skip
    fig.update_layout(
        margin={"l": 0, "r": 0, "t": 10, "b": 0},
        height=460,
        uirevision="keep",
        legend={"orientation": "h", "y": 0.02},
        scene={
            "aspectmode": "data",
            "xaxis": {"title": {"text": "x left (mm)"}},
            "yaxis": {"title": {"text": "y anterior (mm)"}},
            "zaxis": {"title": {"text": "z up (mm)"}},
            "camera": {"eye": {"x": 0.0, "y": -1.7, "z": 2.0}},
        },
    )
    return json.loads(fig.to_json())


def staging_figure(view: PlanView, zmax: float | None = None) -> dict:
    """Teeth x aligners: planned movement per aligner (mm-equivalent) with limit breaches (x),
    PDL over critical (circles) and the teeth of colliding contacts (triangles) marked, and on an
    executed plan the aligners whose planned movement the staging engine changed (squares,
    :func:`orthojob.eval.engine_view.changed_trace`); a line at the slider's stage (shape 0).
    ``zmax``: the colour scale's top (one for every plan of a page)."""
    go = _go()
    stages = list(range(1, N_STAGES + 1))
    inc = view.increment_mm[1:].T  # (28, 24)
    over = view.limit[1:] > 1.0 + LIMIT_TOLERANCE
    pdl = view.pdl_kpa[1:] > PDL_CRITICAL_KPA
    touched = np.zeros_like(over)
    for s, k in np.argwhere(view.penetration[1:] > COLLISION_TOLERANCE_MM):
        touched[s, ADJACENT_PAIRS[k]] = True

    def marks(mask: np.ndarray, name: str, symbol: str, color: str, what: np.ndarray, unit: str):
        s_idx, t_idx = np.nonzero(mask)
        return go.Scatter(
            x=(s_idx + 1).tolist(), y=[TOOTH_LABELS[t] for t in t_idx], mode="markers", name=name,
            marker={"symbol": symbol, "size": 8, "color": color, "line": {"width": 1, "color": "#000"}},
            hovertext=[f"tooth {TOOTH_LABELS[t]}, aligner {s + 1}: {what[s + 1, t]:.2f} {unit}"
                       for s, t in zip(s_idx, t_idx)],
            hoverinfo="text",
        )  # fmt: skip

    fig = go.Figure(
        [
            go.Heatmap(
                z=_rounded(inc), x=stages, y=TOOTH_LABELS, colorscale="Blues", zmin=0.0, zmax=zmax,
                colorbar={"title": {"text": "mm-eq / aligner"}, "len": 0.8},
                hovertemplate="tooth %{y}, aligner %{x}: %{z:.3f} mm-eq<extra></extra>", name="movement",
            ),
            marks(over, "over the per-stage limit", "x", "#d7191c", view.limit, "x limit"),
            marks(pdl, "PDL over critical", "circle-open", "#fdae61", view.pdl_kpa, "kPa"),
            marks(touched, "in a colliding contact", "triangle-up-open", "#6a3d9a", view.pdl_kpa, "kPa PDL"),
        ]
    )  # fmt: skip
    changed = engine_view.changed_trace(view, TOOTH_LABELS)
    if changed is not None:
        fig.add_trace(changed)
    fig.update_layout(
        height=520,
        margin={"l": 40, "r": 10, "t": 30, "b": 40},
        title={"text": "staging: movement per aligner", "font": {"size": 13}},
        xaxis={"title": {"text": "aligner"}, "dtick": 2},
        yaxis={"title": {"text": "tooth (FDI)"}, "type": "category", "autorange": "reversed"},
        legend={"orientation": "h", "y": -0.12},
        showlegend=True,  # plotly hides a legend of one entry: the engine's layer may be the only one
        shapes=[_stage_line(0)],
    )
    return json.loads(fig.to_json())


def _stage_line(stage: int) -> dict:
    return {"type": "line", "xref": "x", "yref": "paper", "x0": stage, "x1": stage, "y0": 0, "y1": 1,
            "line": {"color": "#000", "width": 2, "dash": "dot"}}  # fmt: skip


def reward_figure(view: PlanView) -> dict:
    """Per-stage reward components (top) and per-stage safety measures (bottom); a line at the
    slider's stage (shape 0)."""
    go = _go()
    from plotly.subplots import make_subplots

    stages = list(range(N_STAGES + 1))
    summary_over = (view.limit > 1.0 + LIMIT_TOLERANCE).sum(axis=1)
    colliding = (view.penetration > COLLISION_TOLERANCE_MM).sum(axis=1)
    colliding[0] = 0
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        specs=[[{}], [{"secondary_y": True}]])  # fmt: skip
    for y, name, color in (
        (view.step_reward, "step reward", "#000"),
        (view.accuracy, "accuracy (running)", "#1a9641"),
        (-view.limit_penalty, "limit penalty", "#d7191c"),
        (-view.collision_penalty, "collision penalty", "#6a3d9a"),
    ):
        fig.add_trace(go.Scatter(x=stages, y=_rounded(y), name=name, line={"color": color}), row=1, col=1)
    fig.add_trace(
        go.Scatter(x=stages, y=_rounded(view.pdl_kpa.max(axis=1)), name="peak PDL kPa", line={"color": "#fdae61"}),
        row=2, col=1,
    )  # fmt: skip
    fig.add_trace(
        go.Bar(x=stages, y=summary_over.tolist(), name="teeth over limit", marker={"color": "#d7191c"}, opacity=0.6),
        row=2, col=1, secondary_y=True,
    )  # fmt: skip
    fig.add_trace(
        go.Bar(x=stages, y=colliding.tolist(), name="colliding contacts", marker={"color": "#6a3d9a"}, opacity=0.6),
        row=2, col=1, secondary_y=True,
    )  # fmt: skip
    fig.add_hline(y=PDL_CRITICAL_KPA, line_dash="dash", line_color="#fdae61", row=2, col=1)
    fig.update_layout(
        height=420,
        margin={"l": 40, "r": 10, "t": 30, "b": 30},
        title={"text": "per-stage reward components and safety", "font": {"size": 13}},
        legend={"orientation": "h", "y": -0.1},
        barmode="group",
    )
    fig.update_xaxes(title_text="stage", row=2, col=1)
    fig.update_yaxes(title_text="reward", row=1, col=1)
    fig.update_yaxes(title_text="kPa", rangemode="tozero", row=2, col=1)
    fig.update_yaxes(title_text="count", rangemode="tozero", row=2, col=1, secondary_y=True)
    layout = json.loads(fig.to_json())
    layout["layout"]["shapes"] = [_stage_line(0), *layout["layout"].get("shapes", [])]
    return layout


# ---------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------


def diagnosis(case: Case) -> dict:
    """The case's diagnosis for the page: the casts' measures (what the planner sees), the oracle's
    reading of the setup, and the case's truth (profile, secondary profile, optimal strategy),
    which no planner sees."""
    primary, secondary = infer_profiles(case.initial, case.target)
    return {
        "measures": dict(case.summary),
        "oracle_reading": {"profile": primary, "secondary_profile": secondary},
        "truth": {
            "profile": case.profile,
            "secondary_profile": case.secondary_profile,
            "optimal_strategy": case.optimal_strategy,
        },
    }


SUMMARY_ROWS: tuple[str, ...] = ("terminal_reward", "scaled_reward")


def _score_table(views: Sequence[PlanView]) -> str:
    keys = list(dict.fromkeys(k for v in views for k in v.result["reward_breakdown"]))
    head = "".join(f"<th>{html.escape(v.name)}</th>" for v in views)
    rows = [f"<tr><th>strategy</th>{''.join(f'<td>{html.escape(str(v.strategy))}</td>' for v in views)}</tr>"]
    for key in SUMMARY_ROWS:
        rows.append(
            f"<tr><th>{key}</th>{''.join(f'<td><b>{v.result[key]:.4f}</b></td>' for v in views)}</tr>"
        )
    rows.append(
        "<tr><th>broken hard rules</th>"
        + "".join(f"<td>{html.escape(', '.join(v.result['broken_rules']) or 'none')}</td>" for v in views)
        + "</tr>"
    )
    for key in keys:
        cells = "".join(f"<td>{v.result['reward_breakdown'].get(key, float('nan')):.4f}</td>" for v in views)
        rows.append(f"<tr><th>{html.escape(key)}</th>{cells}</tr>")
    return f"<table class='score'><tr><th></th>{head}</tr>{''.join(rows)}</table>"


def _diagnosis_html(case: Case) -> str:
    d = diagnosis(case)
    measures = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in d["measures"].items()
    )
    reading = d["oracle_reading"]
    truth = d["truth"]
    return (
        "<div class='diag'><h3>Diagnosis</h3><table>" + measures + "</table>"
        f"<p>Oracle's reading of the setup: <b>{html.escape(str(reading['profile']))}</b>"
        + (f" + {html.escape(str(reading['secondary_profile']))}" if reading["secondary_profile"] else "")
        + "</p>"
        f"<p>Case truth (no planner sees it): profile <b>{html.escape(truth['profile'])}</b>"
        + (f" + {html.escape(str(truth['secondary_profile']))}" if truth["secondary_profile"] else "")
        + f", optimal strategy <b>{html.escape(truth['optimal_strategy'])}</b></p></div>"
    )


_CSS = """
body{font-family:system-ui,sans-serif;margin:12px;color:#222}
h1{font-size:18px;margin:4px 0}
.controls{position:sticky;top:0;background:#fff;padding:6px 0;z-index:10;border-bottom:1px solid #ddd}
.controls input[type=range]{width:480px;vertical-align:middle}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:12px}
.plan{border:1px solid #ddd;border-radius:6px;padding:6px}
.plan h2{font-size:15px;margin:2px 0}
.status{font-size:12px;font-family:monospace;background:#f6f6f6;padding:3px}
table{border-collapse:collapse;font-size:12px}
td,th{border:1px solid #ddd;padding:2px 6px;text-align:left}
.score td{text-align:right}
.top{display:flex;gap:24px;flex-wrap:wrap;align-items:flex-start}
pre{white-space:pre-wrap;font-size:11px;max-height:240px;overflow:auto;background:#f6f6f6}
.engine{border:1px solid #00a0a0;border-radius:6px;padding:4px 8px;margin:8px 0}
.engine h3{margin:2px 0}
.engine-note{font-size:13px;margin:2px 0;color:#006868}
"""

_SCRIPT = """
(function(){
const V = JSON.parse(document.getElementById('viewer-data').textContent);
const N = V.n_stages;
const slider = document.getElementById('stage');
const label = document.getElementById('stage-label');
const colour = document.getElementById('colour');
const ghost = document.getElementById('ghost');
const fmt = (x, d) => (x === null ? '-' : Number(x).toFixed(d));
function repeat(values, n){const out = new Array(values.length * n);
  for (let t = 0; t < values.length; t++) for (let k = 0; k < n; k++) out[t * n + k] = values[t]; return out;}
function update(s){
  const metric = colour.value;
  label.textContent = s === 0 ? 'stage 0 (initial)' : 'stage ' + s + ' / ' + N + ' (aligner ' + s + ')';
  const jobs = [];
  V.plans.forEach((p, i) => {
    const arch = document.getElementById('arch-' + i);
    const m = p[metric][s];
    const hover = V.teeth.map((t, k) => 'tooth ' + t + '<br>stage ' + s + '<br>PDL ' + fmt(p.pdl_kpa[s][k], 2)
      + ' kPa<br>limit ratio ' + fmt(p.limit[s][k], 2) + '<br>lag behind aligner ' + fmt(p.lag_mm[s][k], 3)
      + ' mm-eq<br>x ' + fmt(p.centroid.x[s][k], 2) + ' y '
      + fmt(p.centroid.y[s][k], 2) + ' z ' + fmt(p.centroid.z[s][k], 2));
    const c = p.collisions[s];
    const d = arch.data;
    const title = Object.assign({}, d[0].colorbar.title, {text: V.colour_title[metric]});
    jobs.push(Plotly.react(arch, [
      Object.assign({}, d[0], {x: p.mesh.x[s], y: p.mesh.y[s], z: p.mesh.z[s],
        intensity: repeat(m, p.vertices_per_tooth), cmax: V.colour_max[metric],
        colorbar: Object.assign({}, d[0].colorbar, {title: title})}),
      Object.assign({}, d[1], {x: p.aligner.x[s], y: p.aligner.y[s], z: p.aligner.z[s],
        visible: V.ghost && ghost.checked}),
      Object.assign({}, d[2], {x: p.centroid.x[s], y: p.centroid.y[s], z: p.centroid.z[s], hovertext: hover}),
      Object.assign({}, d[3], {x: c.x, y: c.y, z: c.z, hovertext: c.label}),
      d[4],
    ], arch.layout));
    const sm = p.summary[s];
    document.getElementById('status-' + i).textContent = 'stage ' + s + ': step reward ' + fmt(sm.step_reward, 4)
      + ', accuracy ' + fmt(sm.accuracy, 4) + ', teeth over limit ' + sm.over_limit + ', PDL over critical '
      + sm.pdl_over_critical + ', colliding contacts ' + sm.colliding + ', peak PDL ' + fmt(sm.peak_pdl_kpa, 2)
      + ' kPa, peak limit ratio ' + fmt(sm.peak_limit, 2) + (V.ghost ? ', peak lag ' + fmt(sm.peak_lag_mm, 3)
      + ' mm-eq' : '') + (sm.worn === null ? '' : ', aligner worn ' + fmt(100 * sm.worn, 0) + '%');
    ['staging-', 'reward-'].forEach(prefix => {
      jobs.push(Plotly.relayout(document.getElementById(prefix + i), {'shapes[0].x0': s, 'shapes[0].x1': s}));
    });
  });
  document.body.dataset.stage = String(s);
  return Promise.all(jobs).then(() => { document.body.dataset.rendered = String(s); });
}
let playing = null;
document.getElementById('play').addEventListener('click', () => {
  if (playing) { clearInterval(playing); playing = null; return; }
  playing = setInterval(() => { const s = (Number(slider.value) + 1) % (N + 1); slider.value = s; update(s); }, 700);
});
slider.addEventListener('input', () => update(Number(slider.value)));
colour.addEventListener('change', () => update(Number(slider.value)));
ghost.addEventListener('change', () => update(Number(slider.value)));
const figs = JSON.parse(document.getElementById('figure-data').textContent);
const config = {responsive: true, displaylogo: false};
Promise.all(Object.entries(figs).map(([id, f]) => Plotly.newPlot(id, f.data, f.layout, config)))
  .then(() => update(Number(slider.value)))
  .then(() => { document.body.dataset.ready = '1'; });
window.orthoViewer = {data: V, update: update};
})();
"""


def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def render_html(case: Case, views: Sequence[PlanView], title: str | None = None) -> str:
    """The viewer page of plans on a case (one or more, side by side on one slider)."""
    if not views:
        raise ValueError("render_html needs at least one plan")
    ghost = not case.follows_plan
    plans = [stage_data(v, case) for v in views]
    figures: dict[str, dict] = {}
    panels = []
    zmax = max(MAX_TRANSLATION_MM, *(float(v.increment_mm.max()) for v in views))
    lag_max = max(LAG_COLOUR_MIN_MM, *(float(np.max(p["lag_mm"])) for p in plans))
    for i, (view, data) in enumerate(zip(views, plans)):
        figures[f"arch-{i}"] = arch_figure(view, case, data)
        figures[f"staging-{i}"] = staging_figure(view, zmax)
        figures[f"reward-{i}"] = reward_figure(view)
        r = view.result
        rules = ", ".join(r["broken_rules"]) or "none"
        text = (
            f"<details><summary>completion text</summary><pre>{html.escape(view.text)}</pre></details>"
            if view.text
            else ""
        )
        panels.append(
            f"<div class='plan'><h2>{html.escape(view.name)}: strategy {html.escape(str(view.strategy))}, "
            f"terminal {r['terminal_reward']:.4f}, scaled {r['scaled_reward']:.4f}, broken rules: "
            f"{html.escape(rules)}</h2>{engine_view.panel_note(view)}"
            f"<div class='status' id='status-{i}'></div><div id='arch-{i}'></div>"
            f"<div id='staging-{i}'></div><div id='reward-{i}'></div>"
            f"<details><summary>plan JSON</summary><pre>{html.escape(json.dumps(view.plan, indent=1))}</pre>"
            f"</details>{text}</div>"
        )
    dynamics = ("force decay" if case.force_decay else "ideal dynamics") + (
        ", non-compliance" if case.non_compliance else ""
    )
    heading = title or f"{case.task_id} seed {case.seed} ({dynamics}): " + " vs ".join(v.name for v in views)
    payload = {
        "n_stages": N_STAGES,
        "teeth": list(TOOTH_IDS),
        "ghost": ghost,
        "colour_max": {"pdl_kpa": PDL_COLOUR_MAX_KPA, "limit": LIMIT_COLOUR_MAX, "lag_mm": lag_max},
        "colour_title": {"pdl_kpa": "PDL kPa", "limit": "limit ratio", "lag_mm": "lag mm-eq"},
        "case": {
            "task_id": case.task_id,
            "seed": case.seed,
            "force_decay": case.force_decay,
            "non_compliance": case.non_compliance,
        },
        "plans": plans,
    }
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(heading)}</title><style>{_CSS}</style>"
        f"<script type='text/javascript'>{_plotly_js()}</script></head><body>"
        f"<h1>{html.escape(heading)}</h1>"
        "<div class='controls'><button id='play'>play / pause</button> "
        f"<input type='range' id='stage' min='0' max='{N_STAGES}' step='1' value='0'> "
        "<b id='stage-label'>stage 0</b> &nbsp; colour: <select id='colour'>"
        "<option value='pdl_kpa'>PDL stress (kPa)</option>"
        "<option value='limit'>limit ratio (increment / per-stage limit)</option>"
        "<option value='lag_mm'>lag behind the aligner (mm-equivalent)</option></select> &nbsp; "
        f"<label><input type='checkbox' id='ghost' {'checked' if ghost else 'disabled'}> aligner (planned) shape"
        f"{'' if ghost else ' (the teeth follow the aligners: ideal dynamics, full wear)'}</label></div>"
        f"<div class='top'>{_diagnosis_html(case)}<div><h3>Plan scores</h3>{_score_table(views)}</div></div>"
        + "".join(engine_view.changes_html(v, i) for i, v in enumerate(views))
        + f"<div class='grid'>{''.join(panels)}</div>"
        f"<script type='application/json' id='viewer-data'>{_script_json(payload)}</script>"
        f"<script type='application/json' id='figure-data'>{_script_json(figures)}</script>"
        f"<script type='text/javascript'>{_SCRIPT}</script></body></html>"
    )


def _script_json(value: object) -> str:
    """JSON safe inside a <script> element (no '</' sequence can close it)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")


def write_viewer(
    path: str | Path,
    case: Case,
    plans: Sequence[tuple[str, dict, str | None] | PlanView],
    title: str | None = None,
    engine: bool = False,
) -> Path:
    """Write the viewer of ``plans`` on ``case`` to ``path``: each ``(name, plan, completion text or
    None)`` or an already computed view. ``engine``: run the ``(name, plan, text)`` plans through the
    staging engine and show a plan it changes as written and as executed
    (:func:`orthojob.eval.engine_view.executed_views`)."""
    views = []
    for item in plans:
        if isinstance(item, PlanView):
            views.append(item)
        else:
            name, plan, text = item
            views += (
                engine_view.executed_views(case, [item]) if engine else [plan_view(case, plan, name, text)]
            )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(case, views, title), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# MLflow artifacts: evaluations and GRPO runs
# ---------------------------------------------------------------------------------------------
