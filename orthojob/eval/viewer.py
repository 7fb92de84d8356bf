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
  optimal strategy, which the planner does not see; the oracle's reading of the setup).

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
import math
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from orthojob.rewards.parsing import find_plan
from orthojob.rewards.rollouts import score_texts
from server.cases import Case, CaseKey, generate_case
from server.collisions import COLLISION_TOLERANCE_MM, collision_severity
from server.dental_constants import (
    ADJACENT_PAIRS,
    CROWN_HEIGHT_MM,
    LIMIT_TOLERANCE,
    MAX_TRANSLATION_MM,
    MM_PER_DEG,
    N_STAGES,
    N_TEETH,
    PDL_CRITICAL_KPA,
    TOOTH_IDS,
)
from server.dental_environment import STEP_PENALTY, StepwiseDentalEnvironment, initial_observation
from server.oracle import infer_profiles, oracle_plan
from server.plans import UNIFORM_FRACTION, normalize_plan
from server.quaternion_utils import quaternion_rotate
from server.scoring import limit_ratio, movement_mm, pdl_stress_kpa
from server.treatment import rollout_plans, score_plan_specs

log = logging.getLogger(__name__)

VIEWER_ARTIFACT_DIR: str = "viewers"
"""MLflow artifact folder of the viewers (``viewers/evaluate/...``, ``viewers/grpo/...``)."""
EVALUATION_VIEWER_CASES: int = 2
"""Held-out cases per task an evaluation logs a viewer for (each ~5 MB: plotly's JS is inlined)."""
GRPO_VIEWER_EVERY: int = 10
"""GRPO logs its best and worst completions' viewers every this many optimizer steps."""
DRAWN_HEIGHT_SHARE: float = 0.6
"""Share of the crown height the 3-D prisms are drawn with (full height would overlap the arches)."""
RING_POINTS: int = 8
"""Points on each drawn crown's outline (a prism has 2 rings and 2 cap centres)."""
DECIMALS: int = 4
"""Decimals of the coordinates and measures written into the page (0.1 micrometre)."""
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
# One plan on one case: arrays from the environment
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanView:
    """One plan's treatment of a case, as the environment computes it. Stage axis 0..24 (25 rows;
    stage 0 is the initial arch, whose per-stage measures are 0).

    planned, achieved: (25, 28, 7) aligner shapes and achieved poses (the stepwise environment's).
    pdl_kpa: (25, 28) PDL stress at each aligner's insertion (:func:`server.scoring.pdl_stress_kpa`
        of the session's StageMeasures mismatches).
    limit: (25, 28) planned increment over the per-stage limit (:func:`server.scoring.limit_ratio`).
    increment_mm: (25, 28) planned movement per aligner, mm-equivalent (MM_PER_DEG mm per degree).
    penetration: (25, 26) adjacent-crown penetration of the achieved arch (mm; ADJACENT_PAIRS order).
    step_reward, accuracy: (25,) the environment's step reward and its running accuracy.
    limit_penalty, collision_penalty: (25,) the two penalties the step reward subtracts
        (STEP_PENALTY x share of teeth over the limit, x the stage's collision severity).
    violations: (25, 3) the environment's running counts of limit violations, colliding contacts
        and PDL events.
    result: the plan's score (:func:`server.treatment.plan_result`: terminal and scaled reward,
        broken rules, reward breakdown, diagnostics) as GRPO's rewards and the evaluation score it.
    """

    name: str
    plan: dict
    planned: np.ndarray
    achieved: np.ndarray
    pdl_kpa: np.ndarray
    limit: np.ndarray
    increment_mm: np.ndarray
    penetration: np.ndarray
    step_reward: np.ndarray
    accuracy: np.ndarray
    limit_penalty: np.ndarray
    collision_penalty: np.ndarray
    violations: np.ndarray
    result: dict
    text: str | None = None

    @property
    def strategy(self) -> str | None:
        return self.result.get("strategy")


def plan_view(case: Case, plan: dict, name: str, text: str | None = None) -> PlanView:
    """A plan (JSON-like dict) on a generated case, through the environment.

    The aligners are the plan's (:func:`server.treatment.rollout_plans`); each is worn in turn in
    a :class:`server.dental_environment.StepwiseDentalEnvironment` episode of the case, which gives
    the achieved poses, the step rewards and the per-stage measures. ``text``: the completion the
    plan was read from, shown on the page.
    """
    spec = normalize_plan(plan)
    planned = rollout_plans([spec], [case])[0][0]
    env = StepwiseDentalEnvironment(max_sessions=1)
    obs = env.reset(case.task_id, case.seed, case.force_decay, non_compliance=case.non_compliance)
    episode = obs["episode_id"]
    step_reward = np.zeros(N_STAGES + 1)
    accuracy = np.zeros(N_STAGES + 1)
    for s in range(1, N_STAGES + 1):
        obs = env.step(episode, planned[s], strategy=spec.strategy, expected_stage=s - 1)
        step_reward[s] = obs["step_reward"]
        accuracy[s] = obs["reward_breakdown"]["accuracy"]
    session = env.sessions.get(episode)
    m = session.stage_measures()  # a batch of one, stages 1..24
    pad = np.zeros((1, N_TEETH))
    pdl = np.concatenate((pad, pdl_stress_kpa(m.mis_t, m.mis_r)[0]))
    ratio = np.concatenate((pad, limit_ratio(m.inc_t, m.inc_r)[0]))
    increment = np.concatenate((pad, np.hypot(m.inc_t, MM_PER_DEG * m.inc_r)[0]))
    penetration = session.penetration.copy()
    violations = session.violations.copy()
    over_limit = np.diff(violations[:, 0], prepend=0)
    limit_penalty = STEP_PENALTY * over_limit / N_TEETH
    collision_penalty = STEP_PENALTY * collision_severity(penetration)
    collision_penalty[0] = 0.0
    result = score_plan_specs([spec], [case])[0]
    env.close_episode(episode)
    return PlanView(
        name=name,
        plan=plan,
        planned=planned,
        achieved=session.achieved.copy(),
        pdl_kpa=pdl,
        limit=ratio,
        increment_mm=increment,
        penetration=penetration,
        step_reward=step_reward,
        accuracy=accuracy,
        limit_penalty=limit_penalty,
        collision_penalty=collision_penalty,
        violations=violations,
        result=result,
        text=text,
    )


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
    (:func:`orthojob.rewards.parsing.find_plan`); :class:`PlanSourceError` naming ``where`` when it holds none."""
    plan = find_plan(text)[0]
    if plan is None or "tooth_groups" not in plan:
        raise PlanSourceError(
            f"{where}: the completion holds no plan (no JSON object with 'tooth_groups'); it begins {text[:200]!r}"
        )
    return name, plan, text


# ---------------------------------------------------------------------------------------------
# Drawing: pure functions of the arrays
# ---------------------------------------------------------------------------------------------


def crown_prisms(poses: np.ndarray, width_mm: np.ndarray, depth_mm: np.ndarray) -> np.ndarray:
    """Vertices (..., 28, V, 3) of the drawn crowns of poses (..., 28, 7): per tooth a bottom ring,
    a top ring (RING_POINTS each, the occlusal ellipse of half-width and half-depth in the crown's
    local x-y plane) and the two cap centres, turned by the crown's rotation about its centroid."""
    angle = np.linspace(0.0, 2.0 * np.pi, RING_POINTS, endpoint=False)
    half_h = 0.5 * DRAWN_HEIGHT_SHARE * CROWN_HEIGHT_MM  # (28,)
    ring_x = 0.5 * width_mm[:, None] * np.cos(angle)  # (28, R)
    ring_y = 0.5 * depth_mm[:, None] * np.sin(angle)
    zeros = np.zeros((N_TEETH, 1))
    local = np.concatenate(
        (
            np.stack((ring_x, ring_y, np.broadcast_to(-half_h[:, None], ring_x.shape)), axis=-1),
            np.stack((ring_x, ring_y, np.broadcast_to(half_h[:, None], ring_x.shape)), axis=-1),
            np.stack((zeros, zeros, -half_h[:, None]), axis=-1),
            np.stack((zeros, zeros, half_h[:, None]), axis=-1),
        ),
        axis=1,
    )  # (28, V, 3)
    q = poses[..., :4][..., None, :]  # (..., 28, 1, 4)
    return (
        quaternion_rotate(np.broadcast_to(q, (*poses.shape[:-1], local.shape[1], 4)), local)
        + poses[..., None, 4:]
    )


def prism_triangles() -> tuple[list[int], list[int], list[int]]:
    """Mesh3d's ``i, j, k`` of 28 prisms laid out as :func:`crown_prisms` flattened (tooth-major)."""
    r = RING_POINTS
    per_tooth = 2 * r + 2
    tris = []
    for a in range(r):
        b = (a + 1) % r
        tris += [(a, b, r + a), (b, r + b, r + a), (2 * r, b, a), (2 * r + 1, r + a, r + b)]
    ii, jj, kk = [], [], []
    for t in range(N_TEETH):
        off = t * per_tooth
        for x, y, z in tris:
            ii.append(off + x)
            jj.append(off + y)
            kk.append(off + z)
    return ii, jj, kk


def collision_segments(achieved: np.ndarray, penetration: np.ndarray) -> list[dict]:
    """Per stage, the colliding contacts (penetration over COLLISION_TOLERANCE_MM) as line segments
    between the two crowns' centroids: ``{"x", "y", "z"}`` lists with None between segments,
    ``"label"`` per point (the contact and its penetration, mm)."""
    out = []
    for s in range(achieved.shape[0]):
        x, y, z, label = [], [], [], []
        for k in np.flatnonzero(penetration[s] > COLLISION_TOLERANCE_MM):
            a, b = ADJACENT_PAIRS[k]
            text = f"{TOOTH_IDS[a]}-{TOOTH_IDS[b]}: {penetration[s, k]:.2f} mm"
            for i in (a, b):
                x.append(_r(achieved[s, i, 4]))
                y.append(_r(achieved[s, i, 5]))
                z.append(_r(achieved[s, i, 6]))
                label.append(text)
            x.append(None)
            y.append(None)
            z.append(None)
            label.append(None)
        out.append({"x": x, "y": y, "z": z, "label": label})
    return out


def _r(x: float) -> float | None:
    x = float(x)
    return round(x, DECIMALS) if math.isfinite(x) else None


def _rounded(a: np.ndarray) -> list:
    """A nested list of ``a`` rounded to DECIMALS (non-finite -> None)."""
    a = np.asarray(a, dtype=np.float64)
    if np.isfinite(a).all():
        return np.round(a, DECIMALS).tolist()
    return [None if not math.isfinite(v) else round(v, DECIMALS) for v in a.ravel().tolist()]


def stage_data(view: PlanView, case: Case) -> dict:
    """The page's per-stage arrays of one plan (JSON-safe): mesh coordinates of the achieved and the
    planned crowns, the centroids, the collisions, the colour measures (PDL kPa, limit ratio, the lag
    of each tooth behind its aligner in mm-equivalent: :func:`server.scoring.movement_mm` of the planned
    and the achieved pose) and the stage summaries (with the mean wear factor under non-compliance)."""
    ach = crown_prisms(view.achieved, case.crown_width_mm, case.crown_depth_mm)  # (25, 28, V, 3)
    pla = crown_prisms(view.planned, case.crown_width_mm, case.crown_depth_mm)
    flat_a = ach.reshape(ach.shape[0], -1, 3)
    flat_p = pla.reshape(pla.shape[0], -1, 3)
    v = ach.shape[2]
    over = view.limit > 1.0 + LIMIT_TOLERANCE
    over_pdl = view.pdl_kpa > PDL_CRITICAL_KPA
    colliding = view.penetration > COLLISION_TOLERANCE_MM
    lag = movement_mm(view.planned, view.achieved)  # (25, 28) the teeth behind (or past) their aligner
    return {
        "name": view.name,
        "vertices_per_tooth": v,
        "mesh": {key: _rounded(flat_a[..., k]) for k, key in enumerate("xyz")},
        "aligner": {key: _rounded(flat_p[..., k]) for k, key in enumerate("xyz")},
        "centroid": {key: _rounded(view.achieved[..., 4 + k]) for k, key in enumerate("xyz")},
        "collisions": collision_segments(view.achieved, view.penetration),
        "pdl_kpa": _rounded(view.pdl_kpa),
        "limit": _rounded(view.limit),
        "lag_mm": _rounded(lag),
        "summary": [
            {
                "step_reward": _r(view.step_reward[s]),
                "accuracy": _r(view.accuracy[s]),
                "over_limit": int(over[s].sum()),
                "pdl_over_critical": int(over_pdl[s].sum()),
                "colliding": int(colliding[s].sum()),
                "peak_pdl_kpa": _r(view.pdl_kpa[s].max()),
                "peak_limit": _r(view.limit[s].max()),
                "peak_lag_mm": _r(lag[s].max()),
                "worn": None if case.wear is None or s == 0 else _r(case.wear[s - 1].mean()),
            }
            for s in range(N_STAGES + 1)
        ],
    }


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
    PDL over critical (circles) and the teeth of colliding contacts (triangles) marked; a line at
    the slider's stage (shape 0). ``zmax``: the colour scale's top (one for every plan of a page)."""
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
    fig.update_layout(
        height=520,
        margin={"l": 40, "r": 10, "t": 30, "b": 40},
        title={"text": "staging: movement per aligner", "font": {"size": 13}},
        xaxis={"title": {"text": "aligner"}, "dtick": 2},
        yaxis={"title": {"text": "tooth (FDI)"}, "type": "category", "autorange": "reversed"},
        legend={"orientation": "h", "y": -0.12},
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
            f"{html.escape(rules)}</h2>"
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
        f"<div class='grid'>{''.join(panels)}</div>"
        f"<script type='application/json' id='viewer-data'>{_script_json(payload)}</script>"
        f"<script type='application/json' id='figure-data'>{_script_json(figures)}</script>"
        f"<script type='text/javascript'>{_SCRIPT}</script></body></html>"
    )


def _script_json(value: object) -> str:
    """JSON safe inside a <script> element (no '</' sequence can close it)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")


def write_viewer(
    path: str | Path, case: Case, plans: Sequence[tuple[str, dict, str | None]], title: str | None = None
) -> Path:
    """Write the viewer of ``plans`` ``(name, plan, completion text or None)`` on ``case`` to ``path``."""
    views = [plan_view(case, plan, name, text) for name, plan, text in plans]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(case, views, title), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# MLflow artifacts: evaluations and GRPO runs
# ---------------------------------------------------------------------------------------------


def _active_mlflow():
    """The mlflow module when a run is active in this process (it was imported by the job), else None."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or mlflow.active_run() is None:
        return None
    return mlflow


def log_viewer(
    case: Case, plans: Sequence[tuple[str, dict, str | None]], artifact_path: str, file_name: str
) -> Path | None:
    """Write a viewer and log it to the active MLflow run under ``artifact_path``; None (nothing
    written) when no run is active. A failure is logged and never stops the caller."""
    mlflow = _active_mlflow()
    if mlflow is None:
        return None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = write_viewer(Path(tmp) / file_name, case, plans)
            mlflow.log_artifact(str(path), artifact_path=artifact_path)
        return Path(artifact_path) / file_name
    except Exception as exc:  # a picture never fails a job
        log.warning("viewer %s/%s not logged: %s", artifact_path, file_name, exc)
        return None


def reference_plans(case: Case) -> list[tuple[str, dict, None]]:
    """The oracle's and uniform SLERP's plans for a case (the references a viewer compares with)."""

    return [
        ("oracle", oracle_plan(initial_observation(case)), None),
        ("uniform_slerp", BASELINE_PLANS["uniform_slerp"], None),
    ]


def log_checkpoint_viewers(episodes, name: str, per_task: int = EVALUATION_VIEWER_CASES) -> list[Path]:
    """Viewers of a checkpoint's evaluation (:class:`orthojob.eval.evaluation.CheckpointEpisodes`): for the
    first ``per_task`` held-out cases of each task, the checkpoint's greedy plan against the oracle's
    and uniform SLERP's, under ``viewers/evaluate/<name>/``. A completion without a plan is shown
    by the references only, its text in the title. Nothing when no MLflow run is active."""
    if _active_mlflow() is None:
        return []
    logged = []
    for task_id in dict.fromkeys(episodes.task_ids):
        for i in episodes.select(task_id)[:per_task]:
            case = generate_case(task_id, episodes.seeds[i], episodes.force_decay)
            rollout = episodes.rollouts[i]
            mine = [(name, rollout.plan, episodes.texts[i])] if rollout.error is None else []
            path = log_viewer(
                case, mine + reference_plans(case), f"{VIEWER_ARTIFACT_DIR}/evaluate/{name}",
                f"{task_id}_seed{case.seed}.html",
            )  # fmt: skip
            if path is not None:
                logged.append(path)
    return logged


def log_baseline_viewers(
    task_ids: Sequence[str],
    seed_start: int,
    force_decay: bool = False,
    non_compliance: bool = False,
    per_task: int = EVALUATION_VIEWER_CASES,
) -> list[Path]:
    """Viewers of a baseline evaluation: oracle against uniform SLERP on the first ``per_task``
    held-out cases of each task, under ``viewers/evaluate/baselines/``. Nothing without an MLflow run."""
    if _active_mlflow() is None:
        return []
    logged = []
    for task_id in task_ids:
        for seed in range(seed_start, seed_start + per_task):
            case = generate_case(task_id, seed, force_decay, non_compliance and task_id == "task_hard")
            path = log_viewer(
                case, reference_plans(case), f"{VIEWER_ARTIFACT_DIR}/evaluate/baselines",
                f"{task_id}_seed{seed}.html",
            )  # fmt: skip
            if path is not None:
                logged.append(path)
    return logged


def best_and_worst(records: Sequence[dict]) -> tuple[int, int] | None:
    """Indices of the best and the worst scored completion among GRPO's ``completions.jsonl``
    records (``completion``, ``task_id``, ``seed``, ``force_decay``), by the scaled reward the
    environment gives them (:func:`orthojob.rewards.rollouts.score_texts`, the rewards' own rollouts);
    completions holding no plan are not candidates. None when none holds one."""

    rolls = score_texts([r["completion"] for r in records], [CaseKey.of_row(r) for r in records])
    scored = [i for i, r in enumerate(rolls) if r.error is None]
    if not scored:
        return None
    key = [rolls[i].scaled_reward for i in scored]
    return scored[int(np.argmax(key))], scored[int(np.argmin(key))]


def new_records(path: Path, offset: int) -> tuple[list[dict], int]:
    """The JSON lines of ``path`` from byte ``offset`` on (whole lines only) and the new offset."""
    if not path.is_file():
        return [], offset
    with open(path, "rb") as fh:
        fh.seek(offset)
        chunk = fh.read()
    end = chunk.rfind(b"\n") + 1
    lines = chunk[:end].decode("utf-8", errors="replace").splitlines()
    return [json.loads(line) for line in lines if line.strip()], offset + end


def log_grpo_viewers(records: Sequence[dict], step: int) -> list[Path]:
    """The best and the worst completion of a GRPO step's records, each against the oracle on its
    case, under ``viewers/grpo/`` (``step_000010_best.html``); nothing without an MLflow run."""
    if _active_mlflow() is None or not records:
        return []
    picked = best_and_worst(records)
    if picked is None:
        log.info("GRPO step %d: no completion holds a plan; no viewer", step)
        return []
    logged = []
    for label, i in zip(("best", "worst"), picked):
        r = records[i]
        case = generate_case(r["task_id"], int(r["seed"]), bool(r.get("force_decay", False)))
        plan = find_plan(r["completion"])[0]
        oracle = reference_plans(case)[0]
        path = log_viewer(
            case, [(f"step {step} {label}", plan, r["completion"]), oracle],
            f"{VIEWER_ARTIFACT_DIR}/grpo", f"step_{step:06d}_{label}.html",
        )  # fmt: skip
        if path is not None:
            logged.append(path)
    return logged


def grpo_viewer_callback(completions_path: str | Path, every: int = GRPO_VIEWER_EVERY):
    """A TrainerCallback (rank 0) that every ``every`` optimizer steps, and at the end of training,
    logs the viewers of the best and the worst completion generated since its last look (the new
    records of GRPO's ``completions.jsonl``) to the active MLflow run."""
    from transformers import TrainerCallback

    path = Path(completions_path)

    class GrpoViewers(TrainerCallback):
        def __init__(self):
            self.offset = 0
            self.logged: list[Path] = []

        def _look(self, step: int) -> None:
            records, self.offset = new_records(path, self.offset)
            if records:  # the latest generation batch among the new records
                last = max(int(r.get("step", 0)) for r in records)
                self.logged += log_grpo_viewers([r for r in records if int(r.get("step", 0)) == last], step)

        def on_step_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero and every > 0 and state.global_step % every == 0:
                self._look(state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero and every > 0 and state.global_step % every != 0:
                self._look(state.global_step)

    return GrpoViewers()


__all__ = [
    "PLAN_SOURCES_HELP",
    "PlanSourceError",
    "PlanView",
    "best_and_worst",
    "grpo_viewer_callback",
    "log_baseline_viewers",
    "log_checkpoint_viewers",
    "log_grpo_viewers",
    "plan_view",
    "render_html",
    "resolve_plan",
    "write_viewer",
]
