"""Tooth dynamics: how the achieved pose follows the aligner's (planned) shape.

* ideal (``force_decay=False``): achieved = planned.
* force decay (``force_decay=True``): a first-order lag. At each stage a tooth
  closes only a share of the gap between the aligner's shape and its actual pose
  (:data:`server.dental_constants.EXPRESSION_*`, by tooth class and movement type,
  expressed in the target crown's local frame); the rest carries over to the next
  aligner. Extrusion and intrusion are told apart by the sign of the vertical gap
  along the crown's long axis (upper crowns intrude upwards, lower downwards).
* non-compliance (an option of ``task_hard``, :mod:`server.compliance`): after the above,
  a tooth makes only its stage's wear factor of the movement (:func:`apply_wear`).
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
    TOOTH_CLASS,
)
from server.quaternion_utils import (
    quaternion_from_rotvec,
    quaternion_inverse,
    quaternion_multiply,
    quaternion_normalize,
    quaternion_slerp,
    quaternion_to_rotvec,
)

_TRANSLATION_RATE = EXPRESSION_TRANSLATION[TOOTH_CLASS]
_INTRUSION_RATE = EXPRESSION_INTRUSION[TOOTH_CLASS]
_EXTRUSION_RATE = EXPRESSION_EXTRUSION[TOOTH_CLASS]
_ROTATION_RATES = np.stack(
    (EXPRESSION_TIP[TOOTH_CLASS], EXPRESSION_TIP[TOOTH_CLASS], EXPRESSION_ROTATION[TOOTH_CLASS]), axis=-1
)  # (28, 3): torque, tip, rotation
_INTRUSION_SIGN = np.where(IS_UPPER, 1.0, -1.0)


def express_stage(planned: np.ndarray, achieved: np.ndarray, long_axis: np.ndarray) -> np.ndarray:
    """Achieved poses after wearing one aligner under force decay.

    Args:
        planned: (..., 28, 7) the aligner's shape for this stage.
        achieved: (..., 28, 7) the teeth before it.
        long_axis: (..., 28, 3) the crown frames' (target crowns') local z axes in the patient
            frame (:attr:`server.cases.Case.long_axis`), along which the vertical rate applies.
    Returns:
        (..., 28, 7) achieved poses after the stage.
    """
    # translation: R diag(t, t, v) R^T gap with R the crown frame, t the bodily rate and v the
    # vertical rate along the long axis z: t gap + (v - t) (gap . z) z
    gap = planned[..., 4:] - achieved[..., 4:]
    along = np.einsum("...i,...i->...", gap, long_axis)
    vertical = np.where(along * _INTRUSION_SIGN > 0.0, _INTRUSION_RATE, _EXTRUSION_RATE)
    moved = _TRANSLATION_RATE[:, None] * gap + ((vertical - _TRANSLATION_RATE) * along)[..., None] * long_axis
    rel = quaternion_to_rotvec(quaternion_multiply(quaternion_inverse(achieved[..., :4]), planned[..., :4]))
    q = quaternion_normalize(
        quaternion_multiply(achieved[..., :4], quaternion_from_rotvec(rel * _ROTATION_RATES))
    )
    return np.concatenate((q, achieved[..., 4:] + moved), axis=-1)


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


def simulate(
    planned: np.ndarray, force_decay: bool, long_axis: np.ndarray | None, wear: np.ndarray | None = None
) -> np.ndarray:
    """Achieved trajectory (..., 25, 28, 7) from a planned one (stage 0 = initial).

    ``long_axis``: (..., 28, 3) the target crowns' long axes (:attr:`server.cases.Case.long_axis`),
    needed (not None) under force decay only. ``wear``: (..., 24, 28) compliance schedule of the cases, None for
    full wear.
    """
    if not force_decay and wear is None:
        return planned
    achieved = np.empty_like(planned)
    achieved[..., 0, :, :] = planned[..., 0, :, :]
    for s in range(1, planned.shape[-3]):
        previous = achieved[..., s - 1, :, :]
        stage = planned[..., s, :, :]
        if force_decay:
            stage = express_stage(stage, previous, long_axis)
        if wear is not None:
            stage = apply_wear(previous, stage, wear[..., s - 1, :])
        achieved[..., s, :, :] = stage
    return achieved
