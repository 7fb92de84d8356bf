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
    return ax / np.maximum(np.sqrt(np.einsum("...i,...i->...", ax, ax)), 1e-12)[..., None]


def _radius(axis: np.ndarray, u: np.ndarray, half_width: np.ndarray, half_depth: np.ndarray) -> np.ndarray:
    ax, ay, ux, uy = axis[..., 0], axis[..., 1], u[..., 0], u[..., 1]
    c = (ax * ux + ay * uy) / half_width
    s = (ax * uy - ay * ux) / half_depth
    return 1.0 / np.sqrt(np.maximum(c * c + s * s, 1e-12))


def penetration_mm(poses: np.ndarray, width_mm: np.ndarray, depth_mm: np.ndarray) -> np.ndarray:
    """Penetration depth (mm, negative = clearance) of the 26 adjacent pairs.

    Args:
        poses: (..., 28, 7) crown poses.
        width_mm, depth_mm: (28,) or (..., 28) crown mesiodistal widths and buccolingual depths.
    Returns:
        (..., 26) array in ADJACENT_PAIRS order.
    """
    axis = mesiodistal_axis_xy(poses[..., :4])
    xy = poses[..., 4:6]
    d = xy[..., _B, :] - xy[..., _A, :]
    dist = np.sqrt(np.einsum("...i,...i->...", d, d))
    # coinciding centroids have no line between them: use the first crown's own axis
    u = np.where((dist > 1e-9)[..., None], d / np.maximum(dist, 1e-9)[..., None], axis[..., _A, :])
    hw = np.asarray(width_mm) / 2
    hd = np.asarray(depth_mm) / 2
    r_a = _radius(axis[..., _A, :], u, hw[..., _A], hd[..., _A])
    r_b = _radius(axis[..., _B, :], u, hw[..., _B], hd[..., _B])
    return r_a + r_b - dist


def collision_severity(penetration: np.ndarray) -> np.ndarray:
    """Per-stage collision severity in [0, 1] from (..., 26) penetrations: summed
    penetration beyond the contact tolerance over PENETRATION_SCALE_MM, capped at 1."""
    excess = np.maximum(penetration - COLLISION_TOLERANCE_MM, 0.0)
    return np.minimum(np.sum(excess, axis=-1) / PENETRATION_SCALE_MM, 1.0)
