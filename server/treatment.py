"""The plan API: score whole treatment plans for cases, one or many in one vectorised call."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from server.absent_teeth import batch_absent
from server.cases import Case, CaseKey, generate_case
from server.dynamics import designed_steps, simulate
from server.plans import (
    PlanSpec,
    groups_naming,
    interpolate_poses,
    normalize_plan,
    planned_progress,
    validity_on,
)
from server.reward_scaler import broken_rules
from server.scoring import score_episodes, stage_measures

BATCH_CHUNK: int = 128
"""Plans scored per vectorised chunk: bounds memory (~25 MB a chunk) at full speed."""


def plan_result(spec: PlanSpec, scores, i: int, absent: np.ndarray | None = None) -> dict:
    """JSON-safe result of one scored plan; ``absent`` (28,) bool the case's absent teeth (the
    format then counts the groups that set one, ``absent_teeth_groups``, as not usable)."""
    diagnostics = {k: float(v[i]) for k, v in scores.diagnostics.items()}
    return {
        "terminal_reward": float(scores.terminal[i]),
        "scaled_reward": diagnostics["scaled_reward"],
        "broken_rules": broken_rules(diagnostics),
        "reward_breakdown": scores.breakdown(i),
        "diagnostics": diagnostics,
        "strategy": spec.strategy,
        "format": _format(spec, absent),
        "start_stage": scores.start_stage[i].tolist(),
    }


def _format(spec: PlanSpec, absent: np.ndarray | None) -> dict:
    """The plan's PlanFormat counts and validity on its case."""
    if absent is None:
        return {**vars(spec.format), "validity": spec.format.validity}
    return {**vars(spec.format), "validity": validity_on(spec, absent),
            "absent_teeth_groups": groups_naming(spec, absent)}  # fmt: skip


def rollout_plans(specs: Sequence[PlanSpec], cases: Sequence[Case]) -> tuple[np.ndarray, np.ndarray]:
    """Planned and achieved trajectories (B, 25, 28, 7) of plans on their cases."""
    return plan_rollout(specs, cases)[:2]


def plan_rollout(
    specs: Sequence[PlanSpec], cases: Sequence[Case]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """:func:`rollout_plans`, with the rows whose teeth may lag the plan (B,) bool and, when some
    do, the planned trajectories' designed steps (:func:`server.dynamics.designed_steps`): what
    :func:`score_rollout` scores."""
    initial = np.stack([c.initial for c in cases])
    target = np.stack([c.target for c in cases])
    over = None
    if any(s.overcorrection is not None for s in specs):
        over = np.stack([s.overcorrections() for s in specs])
    progress = planned_progress(
        np.stack([s.start for s in specs]), np.stack([s.fraction for s in specs]), over
    )
    planned = interpolate_poses(initial, target, progress)
    achieved = planned
    decay = np.array([c.force_decay for c in cases])
    worn = np.array([c.non_compliance for c in cases])
    lagging = decay | worn
    steps = None
    for force_decay, non_compliance in {(d, w) for d, w in zip(decay, worn) if d or w}:
        if achieved is planned:
            achieved = planned.copy()
            steps = designed_steps(planned)
        rows = (decay == force_decay) & (worn == non_compliance)
        wear = np.stack([c.wear for c, r in zip(cases, rows) if r]) if non_compliance else None
        long_axis = np.stack([c.long_axis for c, r in zip(cases, rows) if r]) if force_decay else None
        achieved[rows] = simulate(
            planned[rows], bool(force_decay), long_axis, wear, (steps[0][rows], steps[1][rows])
        )
    return planned, achieved, lagging, steps


def score_plan_specs(specs: Sequence[PlanSpec], cases: Sequence[Case]) -> list[dict]:
    """Score already-normalised plans on their cases (same length)."""
    if len(specs) != len(cases):
        raise ValueError(f"got {len(specs)} plans for {len(cases)} cases: pass one case per plan")
    out: list[dict] = []
    for lo in range(0, len(specs), BATCH_CHUNK):
        s_chunk, c_chunk = specs[lo : lo + BATCH_CHUNK], cases[lo : lo + BATCH_CHUNK]
        out.extend(score_rollout(s_chunk, c_chunk, plan_rollout(s_chunk, c_chunk)))
    return out


def score_rollout(specs: Sequence[PlanSpec], cases: Sequence[Case], rollout: tuple) -> list[dict]:
    """:func:`score_plan_specs` of plans whose :func:`plan_rollout` is at hand (one batch, unchunked)."""
    planned, achieved, lagging, steps = rollout
    width_mm = np.stack([c.crown_width_mm for c in cases])
    depth_mm = np.stack([c.crown_depth_mm for c in cases])
    absent = batch_absent(cases)
    validity = [
        s.format.validity if c.absent is None else validity_on(s, c.absent) for s, c in zip(specs, cases)
    ]
    scores = score_episodes(
        initial=planned[:, 0],
        target=np.stack([c.target for c in cases]),
        width_mm=width_mm,
        depth_mm=depth_mm,
        planned=planned,
        achieved=achieved,
        profiles=[c.profile for c in cases],
        secondary_profiles=[c.secondary_profile for c in cases],
        strategies=[s.strategy for s in specs],
        validity=np.array(validity),
        measures=stage_measures(planned, achieved, width_mm, depth_mm, lagging, steps, absent),
        absent=absent,
    )
    return [plan_result(s, scores, i, c.absent) for i, (s, c) in enumerate(zip(specs, cases))]


def score_plans(plans: Sequence[object], cases: Sequence[CaseKey | tuple | Case]) -> list[dict]:
    """Score B plans (JSON-like values) against B cases: :class:`server.cases.CaseKey` (or a tuple
    in its order, ``(task_id, seed, force_decay[, non_compliance])``), or Case objects.

    Never raises for a bad plan (it is normalised, see :mod:`server.plans`); raises
    InvalidActionError for an unknown task or a bad seed.
    """
    resolved = [c if isinstance(c, Case) else generate_case(*c) for c in cases]
    return score_plan_specs([normalize_plan(p) for p in plans], resolved)
