"""A plan as the treatment viewer draws it: one plan's per-stage arrays (:func:`plan_view`), crowns as elliptic prisms, colliding
contacts as segments, per-stage arrays rounded for the page (mm, kPa).

Crowns are drawn as elliptic prisms of the crown's mesiodistal width and buccolingual depth,
:data:`DRAWN_HEIGHT_SHARE` of its crown height tall, centred on the crown
centroid and turned by its orientation (a drawing, not the scoring geometry, which is the occlusal
ellipse).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from server.cases import Case
from server.collisions import COLLISION_TOLERANCE_MM, collision_severity
from server.dental_constants import (
    ADJACENT_PAIRS,
    CROWN_HEIGHT_MM,
    LIMIT_TOLERANCE,
    MM_PER_DEG,
    N_STAGES,
    N_TEETH,
    PDL_CRITICAL_KPA,
    TOOTH_IDS,
)
from server.dental_environment import STEP_PENALTY, StepwiseDentalEnvironment
from server.plans import normalize_plan
from server.quaternion_utils import quaternion_rotate
from server.scoring import limit_ratio, movement_mm, pdl_stress_kpa
from server.treatment import rollout_plans, score_plan_specs

DRAWN_HEIGHT_SHARE: float = 0.6
"""Share of the crown height the 3-D prisms are drawn with (full height would overlap the arches)."""


RING_POINTS: int = 8
"""Points on each drawn crown's outline (a prism has 2 rings and 2 cap centres)."""


DECIMALS: int = 4
"""Decimals of the coordinates and measures written into the page (0.1 micrometre)."""


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
    engine: the staging engine's record of the plan (:meth:`server.staging_engine.Repair.as_dict`) where
        the page shows what the engine did (:mod:`orthojob.eval.engine_view`); None otherwise.
    written: on the view of a plan the engine executed in place of the written one, the written plan's
        view; None otherwise.
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
    engine: dict | None = None
    written: PlanView | None = None

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
