"""Adjacent-crown penetration along the arch.

Each crown is an ellipse in the occlusal plane: semi-axes half its mesiodistal
width (along its local x) and half its buccolingual depth (local y), turned by the
crown's orientation. Two neighbours penetrate by ``r_i(u) + r_j(u) - |d|`` where
``d`` is the centroid-to-centroid vector in the occlusal plane, ``u = d/|d|`` and
``r(u)`` the ellipse radius in that direction. Crowded teeth displaced
buccolingually or rotated therefore clear their neighbours, as in the mouth.
"""

from __future__ import annotations

import numpy as np

from server.dental_constants import ADJACENT_PAIRS
from server.quaternion_utils import vector_norm

COLLISION_TOLERANCE_MM: float = 0.1
"""Penetration below this is interproximal contact, not a collision (model resolution)."""
PENETRATION_SCALE_MM: float = 1.0
"""Penetration summed over one stage's contacts that makes that stage fully colliding."""

_A = ADJACENT_PAIRS[:, 0]
_B = ADJACENT_PAIRS[:, 1]


def mesiodistal_axis_xy(q: np.ndarray) -> np.ndarray:
    """Unit local-x axes of crowns (..., 4) projected on the occlusal plane: (..., 2)."""
    w, x, y, z = q[..., 0], q[..., 1], q[..., 2], q[..., 3]
    ax = np.stack((1.0 - 2.0 * (y * y + z * z), 2.0 * (x * y + w * z)), axis=-1)
    return ax / np.maximum(vector_norm(ax), 1e-12)[..., None]


def penetration_mm(poses: np.ndarray, width_mm: np.ndarray, depth_mm: np.ndarray) -> np.ndarray:
    """Penetration depth (mm, negative = clearance) of the 26 adjacent pairs.

    Args:
        poses: (..., 28, 7) crown poses.
        width_mm, depth_mm: (28,) or (..., 28) crown mesiodistal widths and buccolingual depths.
    Returns:
        (..., 26) array in ADJACENT_PAIRS order.

    With ``c`` the cosine between a crown's mesiodistal axis and ``u``, the ellipse
    radius is ``1 / sqrt(c^2 / a^2 + (1 - c^2) / b^2)`` (semi-axes a, b), so only
    ``c^2`` is needed: this is the training loop's hot path.
    """
    return penetration_along_axes(pair_axes(poses), poses, width_mm, depth_mm)


def pair_axes(poses: np.ndarray) -> tuple[np.ndarray, ...]:
    """Each contact's two crowns' unnormalised mesiodistal axes in the occlusal plane.

    poses: (..., 28, 7) (only the rotations are read). Returns six (..., 26) arrays: x, y and
    squared norm of the first crown's axis, then of the second's. Poses that share rotations and
    differ in translation (a case being resolved) reuse them in :func:`penetration_along_axes`.
    """
    w, x, y, z = poses[..., 0], poses[..., 1], poses[..., 2], poses[..., 3]
    ax = 1.0 - 2.0 * (y * y + z * z)  # (..., 28) local x axis in the occlusal plane, unnormalised
    ay = 2.0 * (x * y + w * z)
    n2 = ax * ax + ay * ay
    return ax[..., _A], ay[..., _A], n2[..., _A], ax[..., _B], ay[..., _B], n2[..., _B]


def penetration_along_axes(
    axes: tuple[np.ndarray, ...], poses: np.ndarray, width_mm: np.ndarray, depth_mm: np.ndarray
) -> np.ndarray:
    """:func:`penetration_mm` with the crowns' axes given (:func:`pair_axes` of the same
    rotations); only the translations of ``poses`` (..., 28, 7) are read."""
    ax_a, ay_a, n2_a, ax_b, ay_b, n2_b = axes
    dx = poses[..., _B, 4] - poses[..., _A, 4]
    dy = poses[..., _B, 5] - poses[..., _A, 5]
    dist2 = dx * dx + dy * dy
    dist = np.sqrt(dist2)
    # coinciding centroids have no line between them: use the first crown's own axis
    same = dist <= 1e-9
    if same.any():
        dx, dy, dist2 = np.where(same, ax_a, dx), np.where(same, ay_a, dy), np.where(same, n2_a, dist2)
    dot_a = ax_a * dx + ay_a * dy
    dot_b = ax_b * dx + ay_b * dy
    c2_a = np.minimum(dot_a * dot_a / np.maximum(n2_a * dist2, 1e-300), 1.0)
    c2_b = np.minimum(dot_b * dot_b / np.maximum(n2_b * dist2, 1e-300), 1.0)
    inv_d2 = 4.0 / np.square(depth_mm)  # 1 / (half depth)^2
    k2 = 4.0 / np.square(width_mm) - inv_d2
    r_a = 1.0 / np.sqrt(inv_d2[..., _A] + c2_a * k2[..., _A])
    r_b = 1.0 / np.sqrt(inv_d2[..., _B] + c2_b * k2[..., _B])
    return r_a + r_b - dist


_AB = np.concatenate((_A, _B))
_AB_ROWS = _AB.reshape(2, -1)


def arch_penetration_mm(poses: np.ndarray, width_mm: np.ndarray, depth_mm: np.ndarray) -> np.ndarray:
    """:func:`penetration_mm` of one arch (poses (28, 7), widths and depths (28,)), in half the
    numpy calls (the stepwise environment's hot path: call overhead, not arithmetic): both
    crowns of every contact in one (2, 26) array. The same operations on the same numbers,
    element by element, so the same bits (tested)."""
    q = poses[_AB]  # (52, 7): the first crowns of the 26 contacts, then the second ones
    w, x, y, z = q[:, 0], q[:, 1], q[:, 2], q[:, 3]
    ax = (1.0 - 2.0 * (y * y + z * z)).reshape(2, -1)
    ay = (2.0 * (x * y + w * z)).reshape(2, -1)
    n2 = ax * ax + ay * ay
    d = poses[_B, 4:6] - poses[_A, 4:6]
    dx, dy = d[:, 0], d[:, 1]
    dist2 = dx * dx + dy * dy
    dist = np.sqrt(dist2)
    if (dist <= 1e-9).any():  # coinciding centroids: the general path handles them
        return penetration_mm(poses, width_mm, depth_mm)
    dot = ax * dx + ay * dy
    c2 = np.minimum(dot * dot / np.maximum(n2 * dist2, 1e-300), 1.0)
    inv_d2 = 4.0 / np.square(depth_mm)
    k2 = 4.0 / np.square(width_mm) - inv_d2
    r = 1.0 / np.sqrt(inv_d2[_AB_ROWS] + c2 * k2[_AB_ROWS])
    return r[0] + r[1] - dist


def collision_severity(penetration: np.ndarray) -> np.ndarray:
    """Per-stage collision severity in [0, 1] from (..., 26) penetrations: summed
    penetration beyond the contact tolerance over PENETRATION_SCALE_MM, capped at 1."""
    excess = np.maximum(penetration - COLLISION_TOLERANCE_MM, 0.0)
    return np.minimum(np.sum(excess, axis=-1) / PENETRATION_SCALE_MM, 1.0)
