"""Crown penetration: neighbours along the arch, and crowns one apart.

Each crown is an ellipse in the occlusal plane: semi-axes half its mesiodistal
width (along its local x) and half its buccolingual depth (local y), turned by the
crown's orientation. Two neighbours penetrate by ``r_i(u) + r_j(u) - |d|`` where
``d`` is the centroid-to-centroid vector in the occlusal plane, ``u = d/|d|`` and
``r(u)`` the ellipse radius in that direction. Crowded teeth displaced
buccolingually or rotated therefore clear their neighbours, as in the mouth.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from server.dental_constants import ADJACENT_PAIRS, SECOND_NEIGHBOUR_PAIRS
from server.quaternion_utils import stack_components, vector_norm

COLLISION_TOLERANCE_MM: float = 0.11
"""Penetration up to this is interproximal contact, not a collision (model resolution). Calibrated
so that uniform SLERP breaks no rule on 1,000 held-out seeds per level under both dynamics: under
force decay its lagging teeth touch by up to 0.103 mm on task_hard (``experiments/audits/baselines.py``)."""
PENETRATION_SCALE_MM: float = 1.0
"""Penetration summed over one stage's contacts that makes that stage fully colliding."""

CONTACT_CROWNS: np.ndarray = np.ascontiguousarray(ADJACENT_PAIRS.T)
"""(2, 26) the first and the second crown of each contact (ADJACENT_PAIRS transposed): indexing
per-tooth values (..., 28) with it gives (..., 2, 26), both crowns of every contact in one gather."""


def mesiodistal_axis_xy(q: np.ndarray) -> np.ndarray:
    """Unit local-x axes of crowns (..., 4) projected on the occlusal plane: (..., 2)."""
    w, x, y, z = q[..., 0], q[..., 1], q[..., 2], q[..., 3]
    ax = stack_components((1.0 - 2.0 * (y * y + z * z), 2.0 * (x * y + w * z)))
    return ax / np.maximum(vector_norm(ax), 1e-12)[..., None]


class CrownContacts(NamedTuple):
    """The two crowns' ellipse terms at each contact, (..., 2, 26) each (first, second crown x
    contact): ``inv_d2 = 1 / (half depth)^2`` and ``k2 = 1 / (half width)^2 - inv_d2``. Constant
    per case (:attr:`server.cases.Case.contacts`)."""

    inv_d2: np.ndarray
    k2: np.ndarray


def crown_contacts(width_mm: np.ndarray, depth_mm: np.ndarray) -> CrownContacts:
    """CrownContacts of crowns of mesiodistal widths and buccolingual depths (28,) or (..., 28) mm."""
    inv_d2 = 4.0 / np.square(depth_mm)  # 1 / (half depth)^2
    k2 = 4.0 / np.square(width_mm) - inv_d2
    return CrownContacts(inv_d2[..., CONTACT_CROWNS], k2[..., CONTACT_CROWNS])


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
    return contact_penetration_mm(poses, crown_contacts(width_mm, depth_mm))


def contact_penetration_mm(poses: np.ndarray, crowns: CrownContacts) -> np.ndarray:
    """:func:`penetration_mm` of poses (..., 28, 7) with the crowns' CrownContacts at hand -> (..., 26)."""
    if poses.size <= _FEW_POSES:  # both crowns of every contact, (..., 2, 26, 7), in one gather
        pairs = np.take(poses, CONTACT_CROWNS, axis=-2)
        return penetration_along_axes(_axes(pairs), pairs[..., 4:6], crowns)
    return _gathered_penetration(poses, crowns, CONTACT_CROWNS)


def _gathered_penetration(poses: np.ndarray, crowns: CrownContacts, pairs: np.ndarray) -> np.ndarray:
    """Penetration (..., P) of the crown pairs ``pairs`` (2, P) of many poses (..., 28, 7): each
    tooth's axis once, then each value gathered by pair along the last axis (a pair-major result;
    whole-pose gathers are slow on big batches)."""
    ax, ay, n2 = _axes_of(poses[..., 0], poses[..., 1], poses[..., 2], poses[..., 3])
    a, b = pairs
    dx = poses[..., b, 4] - poses[..., a, 4]
    dy = poses[..., b, 5] - poses[..., a, 5]
    ax_a, ay_a, n2_a, ax_b, ay_b, n2_b = (
        ax[..., a],
        ay[..., a],
        n2[..., a],
        ax[..., b],
        ay[..., b],
        n2[..., b],
    )
    dist2 = dx * dx + dy * dy
    dist = np.sqrt(dist2)
    same = dist <= 1e-9
    if np.count_nonzero(same):
        dx, dy, dist2 = np.where(same, ax_a, dx), np.where(same, ay_a, dy), np.where(same, n2_a, dist2)
    dot_a = ax_a * dx + ay_a * dy
    dot_b = ax_b * dx + ay_b * dy
    c2_a = np.minimum(dot_a * dot_a / np.maximum(n2_a * dist2, 1e-300), 1.0)
    c2_b = np.minimum(dot_b * dot_b / np.maximum(n2_b * dist2, 1e-300), 1.0)
    r_a = 1.0 / np.sqrt(crowns.inv_d2[..., 0, :] + c2_a * crowns.k2[..., 0, :])
    r_b = 1.0 / np.sqrt(crowns.inv_d2[..., 1, :] + c2_b * crowns.k2[..., 1, :])
    return r_a + r_b - dist


_FEW_POSES = 8 * 28 * 7
"""Poses (numbers) up to which :func:`contact_penetration_mm` gathers whole poses (fewer calls)."""


def pair_axes(poses: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each contact's two crowns' unnormalised mesiodistal axes in the occlusal plane.

    poses: (..., 28, >= 4) (only the rotations, the first four, are read). Returns three
    (..., 2, 26) arrays (first, second crown x contact): the axes' x, y and squared norm. Poses that
    share rotations and differ in translation (a case being resolved) reuse them in
    :func:`penetration_along_axes`.
    """
    return _axes(np.take(poses, CONTACT_CROWNS, axis=-2))


def _axes(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`pair_axes` of the contacts' crowns' poses (..., 2, 26, >= 4)."""
    return _axes_of(pairs[..., 0], pairs[..., 1], pairs[..., 2], pairs[..., 3])


def _axes_of(
    w: np.ndarray, x: np.ndarray, y: np.ndarray, z: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Crowns' unnormalised mesiodistal axes in the occlusal plane (x, y, squared norm) from their
    rotations' components."""
    ax = 1.0 - 2.0 * (y * y + z * z)  # local x axis in the occlusal plane, unnormalised
    ay = 2.0 * (x * y + w * z)
    return ax, ay, ax * ax + ay * ay


def penetration_along_axes(
    axes: tuple[np.ndarray, np.ndarray, np.ndarray], xy: np.ndarray, crowns: CrownContacts
) -> np.ndarray:
    """:func:`penetration_mm` with the crowns' axes (:func:`pair_axes` of the same rotations) and
    CrownContacts given, and the crowns' occlusal-plane positions ``xy`` (..., 2, 26, 2) (first,
    second crown x contact x (x, y) mm: ``poses[..., CONTACT_CROWNS, 4:6]``). -> (..., 26)."""
    ax, ay, n2 = axes
    x, y = xy[..., 0], xy[..., 1]
    dx = x[..., 1, :] - x[..., 0, :]
    dy = y[..., 1, :] - y[..., 0, :]
    dist2 = dx * dx + dy * dy
    dist = np.sqrt(dist2)
    # coinciding centroids have no line between them: use the first crown's own axis
    same = dist <= 1e-9
    if np.count_nonzero(same):
        dx, dy, dist2 = (np.where(same, a[..., 0, :], b) for a, b in ((ax, dx), (ay, dy), (n2, dist2)))
    dot = ax * dx[..., None, :] + ay * dy[..., None, :]
    c2 = np.minimum(dot * dot / np.maximum(n2 * dist2[..., None, :], 1e-300), 1.0)
    r = 1.0 / np.sqrt(crowns.inv_d2 + c2 * crowns.k2)
    return r[..., 0, :] + r[..., 1, :] - dist


def contact_major(per_contact: np.ndarray) -> np.ndarray:
    """Per-contact values (..., 26) laid out contact-major in memory (the array itself when it is,
    else a copy), as indexing per-tooth arrays (..., 28) by contact lays out its result: sums over
    contacts (and over stages) add in the order they always have."""
    n = per_contact.ndim
    out = np.empty((per_contact.shape[-1], *per_contact.shape[:-1])).transpose(*range(1, n), 0)
    if per_contact.strides == out.strides:  # laid out so already
        return per_contact
    out[...] = per_contact
    return out


SECOND_CROWNS: np.ndarray = np.ascontiguousarray(SECOND_NEIGHBOUR_PAIRS.T)
"""(2, 24) the two crowns of each second-neighbour pair (teeth with one crown between them)."""


def second_neighbour_penetration_mm(
    poses: np.ndarray, width_mm: np.ndarray, depth_mm: np.ndarray
) -> np.ndarray:
    """Penetration depth (mm, negative = clearance) of the 24 second-neighbour pairs
    (:data:`server.dental_constants.SECOND_NEIGHBOUR_PAIRS`), the same ellipse model as
    :func:`penetration_mm`: (..., 28, 7) poses, (28,) or (..., 28) crown sizes -> (..., 24).

    In an aligned arch these crowns are a whole crown apart (clearance of 5-10 mm); they can only
    meet when the crown between them is blocked out of the arch and they close the space. So the
    ellipses are measured only when some pair of the batch is within reach (:func:`_far_apart`).
    """
    width, depth = np.asarray(width_mm), np.asarray(depth_mm)
    far = _far_apart(poses, width, depth)
    if far is not None:
        return far
    return _gathered_penetration(poses, _crowns(width, depth, SECOND_CROWNS), SECOND_CROWNS)


ALL_PAIR_CROWNS: np.ndarray = np.ascontiguousarray(np.concatenate((CONTACT_CROWNS, SECOND_CROWNS), axis=1))
"""(2, 50) the 26 contacts, then the 24 second-neighbour pairs."""


def all_pairs_penetration_mm(poses: np.ndarray, width_mm: np.ndarray, depth_mm: np.ndarray) -> np.ndarray:
    """:func:`penetration_mm` and :func:`second_neighbour_penetration_mm` of the same poses: (..., 50),
    the 26 contacts, then the 24 second-neighbour pairs (in one pass where some of the latter are
    within reach)."""
    width, depth = np.asarray(width_mm), np.asarray(depth_mm)
    far = _far_apart(poses, width, depth)
    if far is not None:
        return np.concatenate((penetration_mm(poses, width, depth), far), axis=-1)
    return _gathered_penetration(poses, _crowns(width, depth, ALL_PAIR_CROWNS), ALL_PAIR_CROWNS)


def pair_penetration_mm(
    poses: np.ndarray, width_mm: np.ndarray, depth_mm: np.ndarray, pairs: np.ndarray
) -> np.ndarray:
    """Penetration depth (mm, negative = clearance) of any crown pairs ``pairs`` (2, P) of poses
    (..., 28, 7), the ellipse model of :func:`penetration_mm`, crown sizes (28,) or (..., 28) -> (..., P)."""
    width, depth = np.asarray(width_mm), np.asarray(depth_mm)
    return _gathered_penetration(poses, _crowns(width, depth, pairs), pairs)


def _crowns(width: np.ndarray, depth: np.ndarray, pairs: np.ndarray) -> CrownContacts:
    inv_d2 = 4.0 / np.square(depth)
    return CrownContacts(inv_d2[..., pairs], (4.0 / np.square(width) - inv_d2)[..., pairs])


def _far_apart(poses: np.ndarray, width: np.ndarray, depth: np.ndarray) -> np.ndarray | None:
    """When every second-neighbour pair of the poses (..., 28, 7) is out of reach (centroids farther
    apart than the sum of the two crowns' larger half-dimensions, which bounds each ellipse's radius
    in any direction): that bound less the distance, (..., 24), a clearance no deeper than the
    ellipses' own and negative like it, so every threshold (collision tolerance, the oracle's relief)
    reads the same. None when some pair is within reach: then they are measured."""
    a, b = SECOND_CROWNS
    dx = poses[..., b, 4] - poses[..., a, 4]
    dy = poses[..., b, 5] - poses[..., a, 5]
    dist = np.sqrt(dx * dx + dy * dy)
    reach = 0.5 * np.maximum(width, depth)
    bound = reach[..., a] + reach[..., b]
    return None if np.any(dist < bound) else bound - dist


def collision_severity(penetration: np.ndarray) -> np.ndarray:
    """Per-stage collision severity in [0, 1] from (..., 26) penetrations: summed
    penetration beyond the contact tolerance over PENETRATION_SCALE_MM, capped at 1."""
    excess = np.maximum(penetration - COLLISION_TOLERANCE_MM, 0.0)
    return np.minimum(np.add.reduce(excess, axis=-1) / PENETRATION_SCALE_MM, 1.0)
