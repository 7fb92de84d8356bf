"""Tooth dynamics: how the achieved pose follows the aligner's (planned) shape.

* ideal (``force_decay=False``): achieved = planned.
* force decay (``force_decay=True``), calibrated to what aligners achieve at the end of
  treatment (Kravitz 2009, AJODO 135:27: mean accuracy 41 %), in three parts:

  1. **engagement** - an aligner engages the gap between its shape and the tooth only up to
     :data:`SEAT_FACTOR` times its own designed step (the step from the previous aligner);
     beyond that it does not seat on the lagging crown and its force does not grow (a
     modelling choice: thermoformed aligners are made for the planned, not the achieved,
     position). So the unexpressed part of a movement is **not** recovered by later aligners
     that hold the target (their designed step is 0), as clinicians see (refinements).
  2. **expression** - per aligner a tooth expresses a share of the engaged activation, by tooth
     class and movement type (:data:`server.dental_constants.EXPRESSION_*`, which are the
     published end-of-treatment accuracies): per stage ``EXPRESSION / SEAT_FACTOR``, so that
     uniform staging, whose lag saturates the engagement from its second aligner on, ends at
     the published accuracy. Translation splits into bodily and vertical (intrusion or
     extrusion, told apart by the sign along the crown's long axis); rotation into torque, tip
     and rotation about the long axis, in the target crown's frame.
  3. **biology** - the movement achieved per aligner is capped at :data:`BIOLOGICAL_CAP_MM`
     (about 0.25-0.33 mm per 14 days of wear; rotation at the equivalent
     :data:`BIOLOGICAL_CAP_DEG`).

  The designed step that sets the engagement counts only as far as it extends the aligner
  series' reach: each aligner's distance from the first one, at its farthest so far
  (:func:`reach_advances`; translation and rotation each). An interpolated plan moves every tooth
  along one straight path, so each step extends the reach by itself and the engagement is the
  step's; an aligner that takes a tooth back over ground already covered (a round trip, a jiggle
  back and forth) engages nothing beyond its advance, so wobbling the aligners cannot keep
  engaging the lag a steady series has left behind.

  Plans compensate as clinicians do: overcorrection (a group's ``overcorrection``,
  :mod:`server.plans`) plans each tooth beyond its target so that its expressed movement lands
  on it; an overshoot that is expressed costs accuracy.
* non-compliance (an option of ``task_hard``, :mod:`server.compliance`): after the above,
  a tooth makes only its stage's wear factor of the movement (:func:`apply_wear`). Under ideal
  dynamics the engagement cap applies too, so the aligner after a missed one loads the
  lagging teeth with up to SEAT_FACTOR steps (the PDL stress rises) and the rest of the lag is
  made up over the following aligners.

The PDL stress of an aligner (:mod:`server.scoring`) is that of its engaged activation,
:func:`engaged`: ``min(gap, SEAT_FACTOR * step)`` per tooth.
"""

from __future__ import annotations

import numpy as np

from server.dental_constants import (
    EXPRESSION_EXTRUSION,
    EXPRESSION_INTRUSION,
    EXPRESSION_ROTATION,
    EXPRESSION_TIP,
    EXPRESSION_TRANSLATION,
    IS_UPPER,
    MM_PER_DEG,
    N_TEETH,
    TOOTH_CLASS,
)
from server.quaternion_utils import (
    components,
    dot_last,
    pose_distances,
    quaternion_angle,
    quaternion_from_rotvec,
    quaternion_inverse_multiply,
    quaternion_multiply,
    quaternion_normalize,
    quaternion_slerp,
    quaternion_to_rotvec,
    vector_norm,
)

SEAT_FACTOR: float = 1.5
"""An aligner engages the gap to the tooth up to this many of its own designed steps (model choice)."""
BIOLOGICAL_CAP_MM: float = 0.3
"""Most translation a tooth achieves per aligner (about 0.25-0.33 mm per 14 days of wear; 1 mm a month,
Proffit, Contemporary Orthodontics)."""
BIOLOGICAL_CAP_DEG: float = BIOLOGICAL_CAP_MM / MM_PER_DEG
"""Most rotation per aligner, at the mm-equivalent exchange rate of the per-stage limits."""

ADVANCE_TOLERANCE: float = 1e-6
"""A designed step within this (mm, or rad) of the reach it adds counts in full: floating-point
noise of a straight path's distances from its first aligner, not a step back."""

_TRANSLATION_RATE = EXPRESSION_TRANSLATION[TOOTH_CLASS] / SEAT_FACTOR
_INTRUSION_RATE = EXPRESSION_INTRUSION[TOOTH_CLASS] / SEAT_FACTOR
_EXTRUSION_RATE = EXPRESSION_EXTRUSION[TOOTH_CLASS] / SEAT_FACTOR
_ROTATION_RATES = (
    np.stack(
        (EXPRESSION_TIP[TOOTH_CLASS], EXPRESSION_TIP[TOOTH_CLASS], EXPRESSION_ROTATION[TOOTH_CLASS]), axis=-1
    )
    / SEAT_FACTOR
)  # (28, 3): torque, tip, rotation (per aligner)
_TRANSLATION_RATE_COLUMN = _TRANSLATION_RATE[:, None]
_INTRUSION_SIGN = np.where(IS_UPPER, 1.0, -1.0)
_MAX_RATE = float(
    max(_TRANSLATION_RATE.max(), _INTRUSION_RATE.max(), _EXTRUSION_RATE.max(), _ROTATION_RATES.max())
)
_CAP_RAD = float(np.radians(BIOLOGICAL_CAP_DEG))


def engaged(gap: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The activation an aligner engages: ``min(gap, SEAT_FACTOR * step)`` (magnitudes, mm or deg)."""
    return np.minimum(gap, SEAT_FACTOR * step)


def reach_advances(planned: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """How far each aligner extends the series' reach, translation (mm) and rotation (rad),
    (..., S - 1, 28) each, of a planned trajectory (..., S, 28, 7) whose first aligner is its origin.

    The reach at aligner ``s`` is the largest distance from the first aligner of aligners 0..s; its
    advance is its growth from aligner ``s - 1`` (0 for an aligner that stays within it). On a
    straight path (an interpolated plan) the advance is the designed step.
    """
    poses = components(planned)  # (7, ..., S, 28)
    reach = np.maximum.accumulate(np.array(pose_distances(poses, poses[..., :1, :])), axis=-2)
    return tuple(np.diff(reach, axis=-2))


def engaging_steps(
    step_t: np.ndarray, step_r: np.ndarray, advance_t: np.ndarray, advance_r: np.ndarray
) -> np.ndarray:
    """(2, ...) the designed steps (mm, rad) that set the engagement: each step as far as it
    advances the series' reach (:func:`reach_advances`), within ADVANCE_TOLERANCE; the step itself
    on a straight path."""
    return np.array(
        (np.minimum(step_t, advance_t + ADVANCE_TOLERANCE), np.minimum(step_r, advance_r + ADVANCE_TOLERANCE))
    )


def _shrink(v: np.ndarray, length: np.ndarray, cap: np.ndarray | float) -> np.ndarray:
    """Vectors ``v`` (..., 3) of lengths ``length`` (...,) shortened to at most ``cap`` (...,) or a scalar."""
    return v * (np.minimum(length, cap) / np.maximum(length, 1e-30))[..., None]


def express_stage(
    planned: np.ndarray,
    planned_prev: np.ndarray,
    achieved: np.ndarray,
    long_axis: np.ndarray | None,
    force_decay: bool,
    step_t: np.ndarray | None = None,
    step_r: np.ndarray | None = None,
    earlier: np.ndarray | None = None,
) -> np.ndarray:
    """Achieved poses after wearing one aligner (see the module docstring).

    Args:
        planned: (..., 28, 7) the aligner's shape for this stage.
        planned_prev: (..., 28, 7) the previous aligner's shape (its designed step sets the engagement).
        achieved: (..., 28, 7) the teeth before it.
        long_axis: (..., 28, 3) the target crowns' local z (long) axes in the patient frame
            (:attr:`server.cases.Case.long_axis`), along which the vertical rate applies; needed
            under force decay only.
        force_decay: express a share of the engaged activation (else all of it).
        step_t, step_r: (..., 28) the designed step (mm, rad) when already at hand.
        earlier: (..., S, 28, 7) the aligners worn before this one, from stage 0 (the initial
            poses) to ``planned_prev``: the step engages only as far as it advances their reach
            (:func:`reach_advances`). None: the step engages in full (a series' first aligner).
    Returns:
        (..., 28, 7) achieved poses after the stage.
    """
    if step_t is None:
        step_t = vector_norm(planned[..., 4:] - planned_prev[..., 4:])
    if step_r is None:
        step_r = quaternion_angle(planned[..., :4], planned_prev[..., :4])
    if earlier is None:
        engage = np.array((step_t, step_r))
    else:
        advance_t, advance_r = reach_advances(np.concatenate((earlier, planned[..., None, :, :]), axis=-3))
        engage = engaging_steps(step_t, step_r, advance_t[..., -1, :], advance_r[..., -1, :])
    return _express(
        planned,
        achieved,
        long_axis,
        force_decay,
        SEAT_FACTOR * engage,
        bool(
            force_decay
            and step_t.size
            and _cap_binds(np.maximum.reduce(step_t, axis=None), BIOLOGICAL_CAP_MM)
        ),
        bool(force_decay and step_r.size and _cap_binds(np.maximum.reduce(step_r, axis=None), _CAP_RAD)),
    )


def _cap_binds(peak_step: np.ndarray | float, cap: float) -> np.ndarray | bool:
    """Whether the biological ``cap`` (mm or rad) can bind on an aligner whose largest designed step
    is ``peak_step``: the engaged step times the highest rate bounds the movement."""
    return SEAT_FACTOR * _MAX_RATE * peak_step > cap


def _express(
    planned: np.ndarray,
    achieved: np.ndarray,
    long_axis: np.ndarray | None,
    force_decay: bool,
    engage: np.ndarray,
    cap_t: bool,
    cap_r: bool,
) -> np.ndarray:
    """:func:`express_stage` given the stage's engagement limits ``SEAT_FACTOR * step``, (2, ..., 28)
    (translation mm, rotation rad), and whether the biological caps can bind (:func:`_cap_binds`)."""
    # the translation and rotation still to make, each shortened to the engaged step
    both = np.array(
        (
            planned[..., 4:] - achieved[..., 4:],
            quaternion_to_rotvec(quaternion_inverse_multiply(achieved[..., :4], planned[..., :4])),
        )
    )
    act, rel = _shrink(both, vector_norm(both), engage)
    if force_decay:
        # R diag(t, t, v) R^T act with R the crown frame, t the bodily rate and v the vertical rate
        # along the long axis z: t act + (v - t) (act . z) z
        along = dot_last(act, long_axis)
        vertical = np.where(along * _INTRUSION_SIGN > 0.0, _INTRUSION_RATE, _EXTRUSION_RATE)
        act = _TRANSLATION_RATE_COLUMN * act + ((vertical - _TRANSLATION_RATE) * along)[..., None] * long_axis
        rel = rel * _ROTATION_RATES
        if cap_t:
            act = _shrink(act, vector_norm(act), BIOLOGICAL_CAP_MM)
        if cap_r:
            rel = _shrink(rel, vector_norm(rel), _CAP_RAD)
    q = quaternion_normalize(quaternion_multiply(achieved[..., :4], quaternion_from_rotvec(rel)))
    return np.concatenate((q, achieved[..., 4:] + act), axis=-1)


def apply_wear(previous: np.ndarray, expressed: np.ndarray, wear: np.ndarray) -> np.ndarray:
    """Poses after a stage worn only part of the prescribed time (:mod:`server.compliance`).

    Args:
        previous: (..., 28, 7) the teeth before the stage.
        expressed: (..., 28, 7) where the dynamics would take them with full wear.
        wear: (..., 28) share of that movement made, in [0, 1] (translation linearly,
            rotation along the shorter arc).
    """
    t = previous[..., 4:] + wear[..., None] * (expressed[..., 4:] - previous[..., 4:])
    q = quaternion_slerp(previous[..., :4], expressed[..., :4], wear)
    return np.concatenate((q, t), axis=-1)


def designed_steps(planned: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each aligner's designed step from the previous one: translation (mm) and rotation (rad),
    (..., S - 1, 28) each, of a planned trajectory (..., S, 28, 7)."""
    poses = components(planned)  # (7, ..., S, 28)
    return pose_distances(poses[..., 1:, :], poses[..., :-1, :])


def simulate(
    planned: np.ndarray,
    force_decay: bool,
    long_axis: np.ndarray | None,
    wear: np.ndarray | None = None,
    steps: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """Achieved trajectory (..., 25, 28, 7) from a planned one (stage 0 = initial).

    ``long_axis``: (..., 28, 3) the target crowns' long axes (:attr:`server.cases.Case.long_axis`),
    needed (not None) under force decay only. ``wear``: (..., 24, 28) compliance schedule of the cases, None for
    full wear. ``steps``: the planned trajectory's designed steps (mm, rad), (..., 24, 28) each, when
    already at hand (:func:`designed_steps`).
    """
    if not force_decay and wear is None:
        return planned
    achieved = np.empty_like(planned)
    achieved[..., 0, :, :] = planned[..., 0, :, :]
    steps_t, steps_r = designed_steps(planned) if steps is None else steps
    # what does not depend on the achieved poses, for every stage at once
    n = planned.shape[-3] - 1
    engage = SEAT_FACTOR * engaging_steps(steps_t, steps_r, *reach_advances(planned))  # (2, ..., 24, 28)
    cap_t = cap_r = np.zeros(n, dtype=bool)
    if force_decay and steps_t.size:  # each aligner's largest step over the batch and the teeth
        cap_t = _cap_binds(steps_t.reshape(-1, n, N_TEETH).max(axis=(0, 2)), BIOLOGICAL_CAP_MM)
        cap_r = _cap_binds(steps_r.reshape(-1, n, N_TEETH).max(axis=(0, 2)), _CAP_RAD)
    for s in range(1, n + 1):
        previous = achieved[..., s - 1, :, :]
        stage = _express(
            planned[..., s, :, :],
            previous,
            long_axis,
            force_decay,
            engage[..., s - 1, :],
            bool(cap_t[s - 1]),
            bool(cap_r[s - 1]),
        )
        if wear is not None:
            stage = apply_wear(previous, stage, wear[..., s - 1, :])
        achieved[..., s, :, :] = stage
    return achieved
