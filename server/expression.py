"""How much of the planned movement a treatment expressed, by movement type.

This is the measure of the aligner accuracy studies (Kravitz 2009, Haouili 2020, Lombardo
2017): for each tooth and each movement type, the share of the required movement (initial ->
target) found in the achieved one (initial -> final), i.e. the projection of the achieved
movement on the required one over the required magnitude. Movement types, in the target
crown's frame (``long_axis`` = its local z, :attr:`server.cases.Case.long_axis`):

* ``translation`` - the part of the translation across the long axis (buccolingual and
  mesiodistal; lingual constriction, expansion, distalisation);
* ``intrusion`` / ``extrusion`` - the part along the long axis, by its sign (upper crowns intrude
  upwards, lower downwards);
* ``rotation`` - rotation about the long axis;
* ``tip_torque`` - rotation about the other two crown axes.

A tooth counts for a type when it needs at least :data:`MIN_MM` (mm) or :data:`MIN_DEG` of it.
Shares are pooled over teeth as ``sum(expressed) / sum(required)`` (so a tooth needing more
weighs more, as in the studies' mean accuracy over movements).
"""

from __future__ import annotations

import numpy as np

from server.dental_constants import IS_UPPER, MM_PER_DEG, TOOTH_CLASS, TOOTH_CLASSES
from server.quaternion_utils import (
    dot_last,
    quaternion_inverse,
    quaternion_multiply,
    quaternion_to_rotvec,
)

MOVEMENT_TYPES: tuple[str, ...] = ("translation", "intrusion", "extrusion", "rotation", "tip_torque")
MIN_MM: float = 0.5
"""Smallest translation component (mm) a tooth must need for it to count (a tooth needing less than 0.5 mm
of extrusion is left out of the extrusion share)."""
MIN_DEG: float = 5.0
"""Smallest rotation component (deg) a tooth must need for it to count."""
_INTRUSION_SIGN = np.where(IS_UPPER, 1.0, -1.0)


def components(initial: np.ndarray, target: np.ndarray, final: np.ndarray, long_axis: np.ndarray) -> dict:
    """Per movement type, ``(required, expressed)`` arrays (..., 28): required magnitude (mm or deg)
    and the achieved movement's projection on it (same unit; below 0 when it went the wrong way)."""
    need = target[..., 4:] - initial[..., 4:]
    got = final[..., 4:] - initial[..., 4:]
    z = long_axis
    need_v = dot_last(need, z)
    got_v = dot_last(got, z)
    need_h = need - need_v[..., None] * z
    got_h = got - got_v[..., None] * z
    need_h_len = np.linalg.norm(need_h, axis=-1)
    got_h_on = dot_last(got_h, need_h) / np.maximum(need_h_len, 1e-12)
    intrudes = need_v * _INTRUSION_SIGN > 0.0
    # rotations in the initial crown's frame: about its local z (the long axis) and the other two
    q0_inv = quaternion_inverse(initial[..., :4])
    need_r = np.degrees(quaternion_to_rotvec(quaternion_multiply(q0_inv, target[..., :4])))
    got_r = np.degrees(quaternion_to_rotvec(quaternion_multiply(q0_inv, final[..., :4])))
    need_tt = np.linalg.norm(need_r[..., :2], axis=-1)
    got_tt_on = dot_last(got_r[..., :2], need_r[..., :2]) / np.maximum(need_tt, 1e-12)
    need_rot = np.abs(need_r[..., 2])
    got_rot_on = got_r[..., 2] * np.sign(need_r[..., 2])
    vertical_need = np.abs(need_v)
    vertical_got = got_v * np.sign(need_v)
    return {
        "translation": (need_h_len, got_h_on),
        "intrusion": (np.where(intrudes, vertical_need, 0.0), np.where(intrudes, vertical_got, 0.0)),
        "extrusion": (np.where(intrudes, 0.0, vertical_need), np.where(intrudes, 0.0, vertical_got)),
        "rotation": (need_rot, got_rot_on),
        "tip_torque": (need_tt, got_tt_on),
    }


def expression_table(cases_final: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> dict:
    """Pooled expression over many treatments ``(initial, target, final, long_axis)``.

    Returns ``{type: share}``, ``{f"rotation_{class}": share}`` per tooth class, and ``overall``:
    every counted component pooled, rotations weighing MM_PER_DEG mm per degree.
    """
    sums: dict[str, list[float]] = {}

    def add(key: str, need: np.ndarray, got: np.ndarray, weight: float = 1.0) -> None:
        acc = sums.setdefault(key, [0.0, 0.0])
        acc[0] += float(np.sum(need)) * weight
        acc[1] += float(np.sum(got)) * weight

    for initial, target, final, axis in cases_final:
        parts = components(initial, target, final, axis)
        for kind, (need, got) in parts.items():
            angular = kind in ("rotation", "tip_torque")
            counted = need >= (MIN_DEG if angular else MIN_MM)
            add(kind, need[counted], got[counted])
            add("overall", need[counted], got[counted], MM_PER_DEG if angular else 1.0)
            if kind == "rotation":
                for k, name in enumerate(TOOTH_CLASSES):
                    mask = counted & np.equal(TOOTH_CLASS, k)
                    add(f"rotation_{name}", need[mask], got[mask])
    return {k: (g / n if n > 0 else float("nan")) for k, (n, g) in sums.items()}


__all__ = ["MIN_DEG", "MIN_MM", "MOVEMENT_TYPES", "components", "expression_table"]
