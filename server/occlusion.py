"""Occlusal measures and Andrews' six keys (+ ABO items) as pure vectorised functions.

Every function takes poses of shape ``(..., 28, 7)`` and broadcasts over the
leading axes (plans, stages). Distances in mm, angles in degrees.

Measures (definitions of this simulation):
* overjet: sagittal (y) distance from the lower to the upper central incisal edges;
* overbite: vertical (z) overlap of those edges;
* molar relation: ``y(U6) - y(L6) + CLASS_I_MOLAR_OFFSET_MM`` per side, 0 in Class I,
  positive when the upper molar is mesial (Class II), negative for Class III;
* curve of Spee: deepest lower canine/premolar/first-molar cusp below the line from
  the lower central incisal edge to the second molar's cusp, per side;
* contacts: distance between the facing contact points of neighbours (Little 1975
  sums it over the five lower canine-to-canine contacts: the irregularity index);
* rotation errors: the rotation from target to achieved crown, in the target
  crown's local frame: about x = torque (inclination), y = tip (angulation),
  z = rotation.
"""

from __future__ import annotations

import numpy as np

from server.arch import WIDTH_NAMES, WIDTH_TEETH, occlusal_points, occlusal_points_of, width_landmarks_xy
from server.collisions import mesiodistal_axis_xy
from server.dental_constants import (
    ADJACENT_PAIRS,
    ANTAGONIST_PAIRS,
    ANTERIOR_CONTACTS,
    CLASS_I_MOLAR_OFFSET_MM,
    IDEAL_OVERBITE_MM,
    IDEAL_OVERJET_MM,
    IS_UPPER,
    LOWER_PAIRS,
    MAX_CURVE_OF_SPEE_MM,
    MIRROR_INDEX,
    UPPER_PAIRS,
    side_mean,
)
from server.quaternion_utils import quaternion_inverse, quaternion_multiply, quaternion_to_rotvec, vector_norm

OCCLUSION_WEIGHTS: dict[str, float] = {
    "molar_relation": 0.20,
    "overjet": 0.15,
    "overbite": 0.10,
    "angulation": 0.10,
    "inclination": 0.10,
    "rotations": 0.10,
    "contacts": 0.10,
    "curve_of_spee": 0.05,
    "symmetry": 0.10,
}
"""Weights of the occlusion composite (Andrews 1972 six keys + ABO grading items)."""


_U1, _U6 = UPPER_PAIRS[[0, 5]]  # (right, left) indices
_L1, _L6, _L7 = LOWER_PAIRS[[0, 5, 6]]
_L_SPEE = LOWER_PAIRS[2:6].T  # (2, 4): (right, left) x lower teeth 3..6
_LOWER_ANTERIOR_CONTACTS = np.array([k for k in ANTERIOR_CONTACTS if not IS_UPPER[ADJACENT_PAIRS[k, 0]]])
_UPPER_ANTERIOR_CONTACTS = np.array([k for k in ANTERIOR_CONTACTS if IS_UPPER[ADJACENT_PAIRS[k, 0]]])


def band_score(value: np.ndarray, lo: float, hi: float, falloff: float) -> np.ndarray:
    """1 inside [lo, hi], falling linearly to 0 at ``falloff`` outside the band."""
    outside = np.maximum(lo - value, 0.0) + np.maximum(value - hi, 0.0)
    return np.clip(1.0 - outside / falloff, 0.0, 1.0)


def overjet_mm(poses: np.ndarray, edge: np.ndarray | None = None) -> np.ndarray:
    edge = occlusal_points(poses) if edge is None else edge
    return side_mean(edge[..., _U1, 1] - edge[..., _L1, 1])


def overbite_mm(poses: np.ndarray, edge: np.ndarray | None = None) -> np.ndarray:
    edge = occlusal_points(poses) if edge is None else edge
    return side_mean(edge[..., _L1, 2] - edge[..., _U1, 2])


def molar_relation_mm(poses: np.ndarray) -> np.ndarray:
    """(..., 2) right and left molar relation, 0 = Class I, > 0 Class II."""
    return poses[..., _U6, 5] - poses[..., _L6, 5] + CLASS_I_MOLAR_OFFSET_MM


def curve_of_spee_mm(poses: np.ndarray, edge: np.ndarray | None = None) -> np.ndarray:
    """Mean over sides of the deepest lower cusp below the incisor-molar line."""
    edge = occlusal_points(poses) if edge is None else edge
    y0, z0 = edge[..., _L1, 1], edge[..., _L1, 2]  # (..., 2)
    y1, z1 = edge[..., _L7, 1], edge[..., _L7, 2]
    ys, zs = edge[..., _L_SPEE, 1], edge[..., _L_SPEE, 2]  # (..., 2, 4)
    dy = np.where(np.abs(y1 - y0) < 1e-6, 1e-6, y1 - y0)
    t = (ys - y0[..., None]) / dy[..., None]
    line = z0[..., None] + t * (z1 - z0)[..., None]
    return side_mean(np.max(line - zs, axis=-1))


def midline_mm(poses: np.ndarray) -> np.ndarray:
    """Upper dental midline minus lower (x, mm; + = upper to the patient's left)."""
    return side_mean(poses[..., _U1, 4]) - side_mean(poses[..., _L1, 4])


def contact_vectors(poses: np.ndarray, width_mm: np.ndarray) -> np.ndarray:
    """(..., 26, 2) vectors between the facing contact points of neighbours (xy, mm)."""
    return _contact_vectors(poses, width_mm, mesiodistal_axis_xy(poses[..., :4]))


def _contact_vectors(poses: np.ndarray, width_mm: np.ndarray, axis: np.ndarray) -> np.ndarray:
    """contact_vectors given the crowns' mesiodistal_axis_xy ``axis``."""
    half = (np.asarray(width_mm) / 2)[..., None]
    a, b = ADJACENT_PAIRS[:, 0], ADJACENT_PAIRS[:, 1]
    p_a = poses[..., a, 4:6] + half[..., a, :] * axis[..., a, :]
    p_b = poses[..., b, 4:6] - half[..., b, :] * axis[..., b, :]
    return p_b - p_a


def contact_distance_mm(poses: np.ndarray, width_mm: np.ndarray) -> np.ndarray:
    """(..., 26) contact-point displacement of neighbours."""
    return vector_norm(contact_vectors(poses, width_mm))


def arch_irregularity_mm(poses: np.ndarray, width_mm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Little's irregularity index (mm) of the (upper, lower) canine-to-canine segment."""
    return _irregularity(contact_vectors(poses, width_mm))


def _irregularity(vec: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d = vector_norm(vec)
    return np.sum(d[..., _UPPER_ANTERIOR_CONTACTS], axis=-1), np.sum(
        d[..., _LOWER_ANTERIOR_CONTACTS], axis=-1
    )


def arch_spacing_mm(poses: np.ndarray, width_mm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Summed mesiodistal gaps (mm) between neighbours along the (upper, lower) arch."""
    axis = mesiodistal_axis_xy(poses[..., :4])
    return _spacing(_contact_vectors(poses, width_mm, axis), axis)


def _spacing(vec: np.ndarray, axis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    tangent = axis[..., ADJACENT_PAIRS[:, 0], :] + axis[..., ADJACENT_PAIRS[:, 1], :]
    tangent = tangent / np.maximum(vector_norm(tangent), 1e-12)[..., None]
    gap = np.maximum(np.sum(vec * tangent, axis=-1), 0.0)
    return np.sum(gap[..., _UPPER_CONTACTS], axis=-1), np.sum(gap[..., ~_UPPER_CONTACTS], axis=-1)


def arch_contacts(
    poses: np.ndarray, width_mm: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(*arch_irregularity_mm, *arch_spacing_mm)``: (upper, lower) irregularity, then (upper,
    lower) spacing, from one computation of the crowns' axes and contact vectors."""
    axis = mesiodistal_axis_xy(poses[..., :4])
    vec = _contact_vectors(poses, width_mm, axis)
    return (*_irregularity(vec), *_spacing(vec, axis))


_UPPER_CONTACTS = IS_UPPER[ADJACENT_PAIRS[:, 0]]


ANTERIOR_ANTAGONISTS = ANTAGONIST_PAIRS[:3].reshape(6, 2)  # (6, (upper, lower)): teeth 1-3
_FIRST_MOLARS = UPPER_PAIRS[5]


def occlusal_clearance_mm(poses: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """(..., 6) clearance (mm) between each upper incisor and canine and its antagonist; lower =
    tighter, negative = the lower incisal edge / cusp tip inside the upper crown's lingual contour.

    The horizontal distance from the lower edge to the upper one along the upper crown's labial
    direction (from the midpoint of the ``reference`` arch's upper first molars to the upper crown),
    less their vertical overlap where they overlap: an upper incisor's lingual surface leans about 45
    degrees near the edge, so each mm of overbite takes a mm of overjet and the ideal 2.5 mm / 2.5 mm
    bite is contact (0). Premolars and molars are measured apart, vertically
    (:func:`posterior_clearance_mm`): their cusps meet on the occlusal plane rather than sliding
    past each other as the incisors do.

    Args:
        poses: (..., 28, 7) crown poses.
        reference: (28, 7) or (..., 28, 7) poses that set each upper crown's labial direction (the
            case's target: fixed through a treatment).
    """
    up = ANTERIOR_ANTAGONISTS[:, 0]
    edge = occlusal_points_of(poses, ANTERIOR_ANTAGONISTS.T.ravel())  # (..., 12, 3): uppers, lowers
    centre = reference[..., _FIRST_MOLARS, 4:6].mean(axis=-2)  # (..., 2)
    labial = reference[..., up, 4:6] - centre[..., None, :]
    labial = labial / np.maximum(vector_norm(labial), 1e-9)[..., None]
    upper, lower = edge[..., :6, :], edge[..., 6:, :]
    horizontal = np.sum((upper[..., :2] - lower[..., :2]) * labial, axis=-1)
    overlap = np.maximum(lower[..., 2] - upper[..., 2], 0.0)
    return horizontal - overlap


POSTERIOR_ANTAGONISTS = ANTAGONIST_PAIRS[3:].reshape(8, 2)  # (8, (upper, lower)): teeth 4-7


def posterior_clearance_mm(poses: np.ndarray) -> np.ndarray:
    """(..., 8) vertical clearance (mm) between each upper premolar and molar cusp tip and its
    antagonist's: ``z(upper) - z(lower)``; 0 where the cusps meet on the occlusal plane (every
    generated case's initial and target bite), negative where the lower cusp stands above the upper
    one (the crowns pass through each other).

    A tooth moved along its own path between its initial and target poses keeps the clearance
    within the range its endpoints span (:func:`posterior_clearance_floor_mm`). A cusp driven off
    that path into its antagonist is an occlusal interference: the mandible, kept fixed in this
    model, could only close on it by hinging the rest of the bite open. Interpolated plans never
    reach it; an aligner series of arbitrary shapes (the stepwise faces) can.

    Args:
        poses: (..., 28, 7) crown poses.
    """
    edge = occlusal_points_of(poses, POSTERIOR_ANTAGONISTS.T.ravel())[..., 2]  # (..., 16): uppers, lowers
    return edge[..., :8] - edge[..., 8:]


def posterior_clearance_floor_mm(initial: np.ndarray, target: np.ndarray) -> np.ndarray:
    """(..., 8) the tightest :func:`posterior_clearance_mm` of arches whose teeth each lie between
    their ``initial`` and ``target`` poses (..., 28, 7): each upper cusp at the lower of its two
    heights, each lower cusp at the higher. A plan that moves every tooth along its own path from
    initial to target, in any order and at any speed, stays above it (up to the small arc a cusp
    describes while its crown rotates)."""
    ends = occlusal_points_of(np.stack((initial, target)), POSTERIOR_ANTAGONISTS.T.ravel())[..., 2]
    return np.min(ends[..., :8], axis=0) - np.max(ends[..., 8:], axis=0)


def rotation_errors_deg(poses: np.ndarray, target: np.ndarray) -> np.ndarray:
    """(..., 28, 3) |torque|, |tip|, |rotation| errors of achieved vs target crowns (unit quaternions)."""
    rel = quaternion_multiply(quaternion_inverse(target[..., :4]), poses[..., :4])
    return np.abs(np.degrees(quaternion_to_rotvec(rel)))


def asymmetry_mm(poses: np.ndarray) -> np.ndarray:
    """Mean distance between each crown and the mirror image of its contralateral twin."""
    mirror = poses[..., MIRROR_INDEX, 4:6] * np.array([-1.0, 1.0])
    return np.mean(vector_norm(poses[..., 4:6] - mirror), axis=-1)


def arch_widths_mm(poses: np.ndarray) -> dict[str, np.ndarray]:
    """Intercanine and intermolar widths per arch (mm) at the landmarks the norms are measured at
    (:data:`server.dental_constants.INTERCANINE_WIDTH_MM`, ``INTERMOLAR_WIDTH_MM``): the transverse
    distance between the canine cusp tips and across the first molars' buccal surfaces
    (:func:`server.arch.width_landmarks_xy`)."""
    x = width_landmarks_xy(poses)[..., 0]  # (..., 4, 2)
    width = np.abs(x[..., 1] - x[..., 0])
    return {name: width[..., k] for k, name in enumerate(WIDTH_NAMES)}


def centroid_widths_mm(poses: np.ndarray) -> dict[str, np.ndarray]:
    """The same widths between the crown centroids (mm): each norm's width less its landmarks' offsets."""
    x = poses[..., WIDTH_TEETH, 4]  # (..., 4, 2)
    width = np.abs(x[..., 1] - x[..., 0])
    return {name: width[..., k] for k, name in enumerate(WIDTH_NAMES)}


def six_keys(poses: np.ndarray, target: np.ndarray, width_mm: np.ndarray) -> dict[str, np.ndarray]:
    """Each occlusion key in [0, 1], shape (...,). Keys as in OCCLUSION_WEIGHTS.

    Each key is a band_score of its measure (bands below); the per-tooth keys average
    over teeth, the molar relation over sides.
    """
    edge = occlusal_points(poses)
    measures = np.concatenate(
        (
            np.abs(molar_relation_mm(poses)),
            np.stack(
                (
                    overjet_mm(poses, edge),
                    overbite_mm(poses, edge),
                    curve_of_spee_mm(poses, edge),
                    asymmetry_mm(poses),
                    np.abs(midline_mm(poses)),
                ),
                axis=-1,
            ),
        ),
        axis=-1,
    )  # (..., 7) in _ARCH_BANDS order
    arch = band_score(measures, *_ARCH_BANDS)
    # (..., 3): |torque|, |tip|, |rotation| errors scored per tooth, averaged over teeth
    teeth = np.mean(band_score(rotation_errors_deg(poses, target), *_ROTATION_BANDS), axis=-2)
    return {
        "molar_relation": 0.5 * (arch[..., 0] + arch[..., 1]),
        "overjet": arch[..., 2],
        "overbite": arch[..., 3],
        "angulation": teeth[..., 1],
        "inclination": teeth[..., 0],
        "rotations": teeth[..., 2],
        "contacts": np.mean(band_score(contact_distance_mm(poses, width_mm), 0.0, 0.5, 1.0), axis=-1),
        "curve_of_spee": arch[..., 4],
        "symmetry": 0.5 * arch[..., 5] + 0.5 * arch[..., 6],
    }


_ARCH_BANDS: tuple[np.ndarray, np.ndarray, np.ndarray] = tuple(
    np.array(column)
    for column in zip(
        (0.0, 1.0, 3.0),  # |molar relation| right, mm
        (0.0, 1.0, 3.0),  # |molar relation| left
        (*IDEAL_OVERJET_MM, 3.0),  # overjet
        (*IDEAL_OVERBITE_MM, 3.0),  # overbite
        (-1.0, MAX_CURVE_OF_SPEE_MM, 2.5),  # curve of Spee
        (0.0, 0.5, 1.5),  # asymmetry
        (0.0, 1.0, 2.0),  # |midline|
    )
)
"""(lo, hi, falloff) of band_score for each arch measure of six_keys, (7,) each."""
_ROTATION_BANDS: tuple[np.ndarray, np.ndarray, np.ndarray] = (
    np.zeros(3),
    np.array([3.0, 2.0, 2.0]),  # torque (inclination), tip (angulation), rotation; deg
    np.array([6.0, 6.0, 8.0]),
)


def occlusion_composite(
    poses: np.ndarray, target: np.ndarray, width_mm: np.ndarray, absent: np.ndarray | None = None
) -> np.ndarray:
    """Weighted six-keys composite in [0, 1], shape (...,). With ``absent`` (..., 28) bool (broadcast
    against the poses' leading axes), the keys of :func:`present_keys`, weights renormalised over
    the keys that can be measured."""
    if absent is None or not np.any(absent):
        keys = six_keys(poses, target, width_mm)
        return np.stack([keys[k] for k in OCCLUSION_WEIGHTS], axis=-1) @ _WEIGHT_VECTOR
    keys, measured = present_keys(poses, target, width_mm, absent)
    value = np.stack([keys[k] for k in OCCLUSION_WEIGHTS], axis=-1)
    weight = np.stack([measured[k] for k in OCCLUSION_WEIGHTS], axis=-1) * _WEIGHT_VECTOR
    return np.sum(value * weight, axis=-1) / np.maximum(np.sum(weight, axis=-1), 1e-12)


def _masked_mean(values: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean over the last axis of ``values`` where ``ok``, and whether any was (0 where none)."""
    ok = np.broadcast_to(ok, values.shape)
    n = ok.sum(axis=-1)
    return np.where(ok, values, 0.0).sum(axis=-1) / np.maximum(n, 1), n > 0


def present_keys(
    poses: np.ndarray, target: np.ndarray, width_mm: np.ndarray, absent: np.ndarray
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """:func:`six_keys` of arches with absent teeth (``absent`` (..., 28) bool), and whether each key
    could be measured (..., bool); a key that cannot is left out of the composite. How each degrades:

    * molar relation: over the sides whose upper and lower first molars are both present;
    * overjet, overbite: over the sides whose upper and lower central incisors are both present;
    * curve of Spee: over the lower sides with the central incisor and the second molar present,
      the deepest of the present canine, premolars and first molar;
    * symmetry: the asymmetry over the teeth whose contralateral twin is present too; the midline
      only with all four central incisors (one absent central moves the dental midline by half a
      crown, not by the treatment);
    * angulation, inclination, rotations: over the present teeth;
    * contacts: over the contacts of two present crowns (the space of an absent tooth is not a
      contact: whether it closes is the target's business, judged by accuracy).
    """
    absent = np.asarray(absent, dtype=bool)
    present = ~absent
    edge = occlusal_points(poses)
    both = present[..., _U6] & present[..., _L6]
    molar = band_score(np.abs(molar_relation_mm(poses)), *(b[:2] for b in _ARCH_BANDS))
    molar, molar_ok = _masked_mean(molar, both)
    incisors = present[..., _U1] & present[..., _L1]
    overjet, overjet_ok = _masked_mean(edge[..., _U1, 1] - edge[..., _L1, 1], incisors)
    overbite, _ = _masked_mean(edge[..., _L1, 2] - edge[..., _U1, 2], incisors)
    y0, z0 = edge[..., _L1, 1], edge[..., _L1, 2]  # (..., 2)
    y1, z1 = edge[..., _L7, 1], edge[..., _L7, 2]
    ys, zs = edge[..., _L_SPEE, 1], edge[..., _L_SPEE, 2]  # (..., 2, 4)
    dy = np.where(np.abs(y1 - y0) < 1e-6, 1e-6, y1 - y0)
    line = z0[..., None] + (ys - y0[..., None]) / dy[..., None] * (z1 - z0)[..., None]
    cusp = np.broadcast_to(present[..., _L_SPEE], line.shape)
    deepest = np.max(np.where(cusp, line - zs, -np.inf), axis=-1)
    spee_side = present[..., _L1] & present[..., _L7] & cusp.any(axis=-1)
    spee, spee_ok = _masked_mean(np.where(np.isfinite(deepest), deepest, 0.0), spee_side)
    mirror = poses[..., MIRROR_INDEX, 4:6] * np.array([-1.0, 1.0])
    twins = present & present[..., MIRROR_INDEX]
    asym, asym_ok = _masked_mean(vector_norm(poses[..., 4:6] - mirror), twins)
    centrals = np.all(present[..., np.concatenate((_U1, _L1))], axis=-1)
    scores = band_score(
        np.stack(np.broadcast_arrays(overjet, overbite, spee, asym, np.abs(midline_mm(poses))), axis=-1),
        *(b[2:] for b in _ARCH_BANDS),
    )
    teeth = band_score(rotation_errors_deg(poses, target), *_ROTATION_BANDS)  # (..., 28, 3)
    rotation, rotation_ok = _masked_mean(np.moveaxis(teeth, -1, -2), present[..., None, :])
    contact = band_score(contact_distance_mm(poses, width_mm), 0.0, 0.5, 1.0)
    pair_ok = present[..., ADJACENT_PAIRS[:, 0]] & present[..., ADJACENT_PAIRS[:, 1]]
    contacts, contacts_ok = _masked_mean(contact, pair_ok)
    symmetry_ok = np.broadcast_to(asym_ok, scores.shape[:-1])
    symmetry = np.where(centrals, 0.5 * scores[..., 3] + 0.5 * scores[..., 4], scores[..., 3])
    keys = {
        "molar_relation": molar,
        "overjet": scores[..., 0],
        "overbite": scores[..., 1],
        "angulation": rotation[..., 1],
        "inclination": rotation[..., 0],
        "rotations": rotation[..., 2],
        "contacts": contacts,
        "curve_of_spee": scores[..., 2],
        "symmetry": symmetry,
    }
    shape = scores.shape[:-1]
    measured = {
        "molar_relation": molar_ok,
        "overjet": overjet_ok,
        "overbite": overjet_ok,
        "angulation": rotation_ok[..., 1],
        "inclination": rotation_ok[..., 0],
        "rotations": rotation_ok[..., 2],
        "contacts": contacts_ok,
        "curve_of_spee": spee_ok,
        "symmetry": symmetry_ok,
    }
    return keys, {k: np.broadcast_to(v, shape) for k, v in measured.items()}


_WEIGHT_VECTOR = np.array(list(OCCLUSION_WEIGHTS.values()))
