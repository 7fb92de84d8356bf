"""The ideal (target) arch of a case: crowns placed in contact along an arch form.

The arch form is an even polynomial ``y = -(a x^2 + c x^6)`` (mm, incisal point at the origin;
polynomials fit human arches well: Pepe 1975, Ferrario 1994), fitted once at import so that,
with Wheeler's mean crown widths placed in contact along the curve, the arch widths equal the
Class I norms at the landmarks they are measured at: 35.4 / 26.9 mm (upper / lower) between the
canine cusp tips, 53.8 / 51.7 mm across the first molars' buccal surfaces. Each landmark lies
outward of its crown's centroid by :data:`WIDTH_LANDMARK_OFFSET_MM` (along the crown's labial
direction in the occlusal plane), so the centroids sit inside the norms: 31.4 / 26.4 mm between
the canines and 42.9 / 41.3 mm between the first molars on the nominal arch (a real jaw's
centroids, Open-Full-Jaw Patient 26: 28.2 / 23.2 and 43.4 / 41.8 mm, its canine cusp tips
4.1 / 2.7 mm inside the norms). Neighbours touch in the collision model's terms
(:mod:`server.collisions`: occlusal ellipses turned along the curve), so where the arch turns at
the canines the centroids are closer than the half widths' sum. The x^2 term rounds the incisor
segment and the x^6 term turns the posterior segments back, which a single power of x (or Braun's
beta curve, which ends at the molars' width) cannot do for arches this narrow at the centroids
without a sharp corner at the lateral incisors. Per case the arch is scaled (overall size,
transverse, sagittal), the lower arch is placed for an ideal overjet and a Class I molar relation
(its sagittal scale solves that exactly), and crown widths follow from the positions so that
neighbours just touch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from server.collisions import mesiodistal_axis_xy
from server.dental_constants import (
    CLASS_I_MOLAR_OFFSET_MM,
    CROWN_DEPTH_MM,
    CROWN_HEIGHT_MM,
    IDEAL_OVERJET_MM,
    INTERCANINE_WIDTH_MM,
    INTERMOLAR_WIDTH_MM,
    IS_UPPER,
    LOWER_CROWN_DEPTH_MM,
    LOWER_CROWN_WIDTH_MM,
    LOWER_PAIRS,
    N_TEETH,
    SIDE,
    TIP_DEG,
    TOOTH_NUMBER,
    TORQUE_DEG,
    TYPE_INDEX,
    UPPER_CROWN_DEPTH_MM,
    UPPER_CROWN_WIDTH_MM,
    UPPER_PAIRS,
    WIDTH_LANDMARK_OFFSET_MM,
    side_mean,
)
from server.quaternion_utils import (
    quaternion_about_axis,
    quaternion_axis,
    quaternion_multiply,
    stack_components,
    vector_norm,
)

_X = np.array([1.0, 0.0, 0.0])
_Y = np.array([0.0, 1.0, 0.0])

TIP_SIGN: np.ndarray = np.where(IS_UPPER, SIDE, -SIDE)
"""Sign turning a prescribed (mesial-crown) tip into a rotation about local y."""
TORQUE_SIGN: np.ndarray = np.where(IS_UPPER, 1.0, -1.0)
"""Sign turning a prescribed (labial-crown) torque into a rotation about local x."""
OCCLUSAL_END: np.ndarray = np.where(IS_UPPER, -1.0, 1.0)
"""Direction (local z) from the centroid to the incisal edge / cusp tip."""

SPEE_PROFILE: np.ndarray = np.array([0.0, 0.0, 0.5, 1.0, 1.0, 0.5, 0.0])
"""Relative depth of the occlusal line below the incisor-molar line, teeth 1..7."""
INCISAL_LEVEL_MM: np.ndarray = np.array([1.25, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0])
"""How far the incisal edges / cusp tips of teeth 1..7 pass the occlusal plane
(upper below it, lower above it): the centrals overlap by 2 x 1.25 = 2.5 mm of overbite."""


def _curve(coef: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """y and dy/dx of the arch form y = -(a x^2 + c x^6) at x (mm), ``coef`` = (a, c)."""
    a, c = coef
    x2 = x * x
    x4 = x2 * x2
    return -(a + c * x4) * x2, -(2.0 * a + 6.0 * c * x4) * x


def _fit_curve(
    widths: np.ndarray, depths: np.ndarray, intercanine: float, intermolar: float, arch: str
) -> np.ndarray:
    """Solve (a, c) of the arch form so that the canine cusp tips and the first molars' buccal surfaces
    (their centroids plus :data:`WIDTH_LANDMARK_OFFSET_MM` along the curve's outward normal) are
    the norms apart."""
    from scipy.optimize import least_squares  # import-time fit only

    offset = np.array(WIDTH_LANDMARK_OFFSET_MM[arch])

    def residual(coef: np.ndarray) -> np.ndarray:
        x, _ = _place_on_curve(coef, widths, depths)
        _, slope = _curve(coef, x[[2, 5]])
        normal_x = -slope / np.hypot(1.0, slope)  # transverse part of the outward unit normal
        return 2 * (x[[2, 5]] + offset * normal_x) - [intercanine, intermolar]

    fit = least_squares(
        residual, [0.01, 1e-6], bounds=([0.0, 0.0], [1.0, 1.0]), x_scale=[0.01, 1e-6], xtol=1e-15
    )
    return fit.x


def _ellipse_radius(width: np.ndarray, depth: np.ndarray, c2: np.ndarray) -> np.ndarray:
    """Radius (mm) of a crown's occlusal ellipse (semi-axes width/2, depth/2) in a direction at
    squared cosine ``c2`` to its mesiodistal axis (:mod:`server.collisions`' crown model)."""
    inv_d2 = 4.0 / np.square(depth)
    return 1.0 / np.sqrt(inv_d2 + c2 * (4.0 / np.square(width) - inv_d2))


def _place_on_curve(
    coef: np.ndarray, widths: np.ndarray, depths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of 7 crown centroids placed along the arch form from the midline so that neighbours touch
    in the collision model: each crown an ellipse turned along the curve's tangent, the central
    incisor touching its mirror image and each next crown the one before it (where the arch turns,
    crowns touch at less than their half widths' sum)."""
    x = np.linspace(0.0, 45.0, 9001)
    y, slope = _curve(coef, x)
    ax, ay = 1.0 / np.hypot(1.0, slope), slope / np.hypot(1.0, slope)  # the tangent, unit
    # the central incisor: 2 x = twice its radius along the transverse line to its mirror image
    gap = x - _ellipse_radius(widths[0], depths[0], ax * ax)
    i = int(np.argmax(gap >= 0.0))
    k = [i - 1 + gap[i - 1] / (gap[i - 1] - gap[i])]  # fractional sample index of each centroid
    for n in range(1, 7):
        j = int(k[-1])
        t = k[-1] - j
        px, py = (1 - t) * x[j] + t * x[j + 1], (1 - t) * y[j] + t * y[j + 1]
        pax, pay = (1 - t) * ax[j] + t * ax[j + 1], (1 - t) * ay[j] + t * ay[j + 1]
        dx, dy = x[j + 1 :] - px, y[j + 1 :] - py
        dist = np.hypot(dx, dy)
        c2_prev = np.square((dx * pax + dy * pay) / dist) / (pax * pax + pay * pay)
        c2_here = np.square((dx * ax[j + 1 :] + dy * ay[j + 1 :]) / dist)
        gap = (
            dist
            - _ellipse_radius(widths[n - 1], depths[n - 1], c2_prev)
            - _ellipse_radius(widths[n], depths[n], c2_here)
        )
        i = int(np.argmax(gap >= 0.0))
        k.append(j + i + (gap[i - 1] / (gap[i - 1] - gap[i]) if i > 0 else 1.0))
    cx = np.interp(np.array(k), np.arange(x.size), x)
    return cx, _curve(coef, cx)[0]


def _nominal_arch(
    widths: np.ndarray, depths: np.ndarray, arch: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    coef = _fit_curve(widths, depths, INTERCANINE_WIDTH_MM[arch][0], INTERMOLAR_WIDTH_MM[arch][0], arch)
    x, y = _place_on_curve(coef, widths, depths)
    return x, y, _curve(coef, x)[1]


_UX, _UY, _US = _nominal_arch(UPPER_CROWN_WIDTH_MM, UPPER_CROWN_DEPTH_MM, "upper")
_LX, _LY, _LS = _nominal_arch(LOWER_CROWN_WIDTH_MM, LOWER_CROWN_DEPTH_MM, "lower")
NOMINAL_XY: np.ndarray = np.stack(
    [
        np.where(IS_UPPER, _UX[TYPE_INDEX], _LX[TYPE_INDEX]),
        np.where(IS_UPPER, _UY[TYPE_INDEX], _LY[TYPE_INDEX]),
    ],
    axis=-1,
)
"""(28, 2) nominal centroid x (always >= 0, unsigned) and y of each tooth."""
NOMINAL_SLOPE: np.ndarray = np.where(IS_UPPER, _US[TYPE_INDEX], _LS[TYPE_INDEX])
"""(28,) dy/dx of the nominal arch form at each crown (for x >= 0)."""


def _clip(x: float, lo: float, hi: float) -> float:
    """np.clip for one finite number, as a float."""
    return float(min(max(x, lo), hi))


@dataclass(frozen=True)
class ArchParameters:
    """Per-case randomisation of the ideal arch (dimensionless scale factors)."""

    size: float = 1.0  # overall scale of the upper arch (crown widths and arch)
    upper_transverse: float = 1.0
    upper_sagittal: float = 1.0
    lower_size: float = 1.0  # relative to the upper arch
    lower_transverse: float = 1.0
    curve_of_spee_mm: float = 0.8

    @classmethod
    def sample(cls, rng: np.random.Generator) -> ArchParameters:
        """Draw one patient's arch: about 1 SD of the Class I norms in each dimension. The upper arch's
        depth is clipped at 2 SD: the posterior segments run almost sagittally, so the crowns there
        (whose widths follow from the positions) lengthen with it, the lower ones more (the lower
        arch's depth is solved for Class I from the upper one's)."""
        size = _clip(rng.normal(1.0, 0.03), 0.92, 1.08)
        transverse = _clip(rng.normal(1.0, 0.03), 0.93, 1.07)
        return cls(
            size=size,
            upper_transverse=transverse,
            upper_sagittal=_clip(rng.normal(1.0, 0.03), 0.94, 1.06),
            lower_size=_clip(rng.normal(1.0, 0.01), 0.97, 1.03),
            lower_transverse=_clip(transverse * rng.normal(1.0, 0.01), 0.92, 1.08),
            curve_of_spee_mm=float(rng.uniform(0.3, 1.2)),
        )


_PRESCRIPTION_Q: np.ndarray = quaternion_multiply(
    quaternion_about_axis(_Y, np.radians(TIP_DEG) * TIP_SIGN),
    quaternion_about_axis(_X, np.radians(TORQUE_DEG) * TORQUE_SIGN),
)
"""(28, 4) each crown's prescription: tip about local y, then torque about local x
(a crown's orientation is its yaw about z along the arch, then this)."""


def occlusal_points(poses: np.ndarray) -> np.ndarray:
    """Incisal edge / cusp tip of each crown (..., 28, 3) from poses (..., 28, 7)."""
    # the offset is along local z: its length times the rotation matrix's third column
    return poses[..., 4:7] + _OCCLUSAL_HEIGHT[:, None] * quaternion_axis(poses[..., :4], 2)


def occlusal_points_of(poses: np.ndarray, teeth: np.ndarray) -> np.ndarray:
    """:func:`occlusal_points` of the crowns ``teeth`` (indices, (T,)) only: (..., T, 3)."""
    some = poses[..., teeth, :]
    return some[..., 4:7] + _OCCLUSAL_HEIGHT[teeth, None] * quaternion_axis(some[..., :4], 2)


WIDTH_TEETH: np.ndarray = np.stack((UPPER_PAIRS[2], LOWER_PAIRS[2], UPPER_PAIRS[5], LOWER_PAIRS[5]))
"""(4, 2) (right, left) indices of the crowns the arch widths are measured on: upper canines, lower
canines, upper first molars, lower first molars."""
WIDTH_NAMES: tuple[str, ...] = (
    "upper_intercanine",
    "lower_intercanine",
    "upper_intermolar",
    "lower_intermolar",
)
_WIDTH_OFFSET: np.ndarray = np.array(
    [
        WIDTH_LANDMARK_OFFSET_MM["upper"][0],
        WIDTH_LANDMARK_OFFSET_MM["lower"][0],
        WIDTH_LANDMARK_OFFSET_MM["upper"][1],
        WIDTH_LANDMARK_OFFSET_MM["lower"][1],
    ]
)


def width_landmarks_xy(poses: np.ndarray) -> np.ndarray:
    """Occlusal-plane position (mm) of each arch-width landmark, (..., 4, 2, 2) [width (WIDTH_NAMES),
    side (right, left), (x, y)] from poses (..., 28, 7): the canine cusp tips and the first molars'
    buccal surfaces, each its crown's centroid plus :data:`WIDTH_LANDMARK_OFFSET_MM` along the crown's
    labial axis (local y) projected on the occlusal plane."""
    some = poses[..., WIDTH_TEETH, :]  # (..., 4, 2, 7)
    labial = quaternion_axis(some[..., :4], 1)[..., :2]
    labial = labial / np.maximum(vector_norm(labial), 1e-12)[..., None]
    return some[..., 4:6] + _WIDTH_OFFSET[:, None, None] * labial


_OCCLUSAL_HEIGHT: np.ndarray = OCCLUSAL_END * CROWN_HEIGHT_MM / 2
"""(28,) centroid -> incisal edge / cusp tip along each crown's local z (mm)."""
_U1, _L1, _U6, _L6, _L7 = UPPER_PAIRS[0], LOWER_PAIRS[0], UPPER_PAIRS[5], LOWER_PAIRS[5], LOWER_PAIRS[6]


@dataclass(frozen=True)
class IdealArch:
    """The target configuration and the per-case crown dimensions."""

    poses: np.ndarray  # (28, 7)
    crown_width_mm: np.ndarray  # (28,) mesiodistal, derived so neighbours touch
    crown_depth_mm: np.ndarray  # (28,) buccolingual
    params: ArchParameters


def build_ideal_arch(params: ArchParameters) -> IdealArch:
    """Place 28 crowns in an ideal Class I occlusion (overjet, overbite 2.5 mm)."""
    upper = IS_UPPER
    sx = np.where(
        upper,
        params.size * params.upper_transverse,
        params.size * params.lower_size * params.lower_transverse,
    )
    sy_upper = params.size * params.upper_sagittal
    s_lower = params.size * params.lower_size
    overjet = float(np.mean(IDEAL_OVERJET_MM))

    # The lower sagittal scale k gives Class I at an overjet of exactly `overjet`:
    # y_U6 - (y_L6 + dy) = -C with dy = ey_U1 - overjet - ey_L1 (ey: incisal edge y) and
    # y_L = k * base. The edges depend weakly on the crowns' yaw, hence on k: take them at k = 1.
    base = NOMINAL_XY[:, 1] * s_lower
    sy = np.where(upper, sy_upper, s_lower)
    y_1 = NOMINAL_XY[:, 1] * sy
    edge_y_1 = y_1 + _orient(sx, sy)[4]
    rhs = (
        -CLASS_I_MOLAR_OFFSET_MM
        - side_mean(y_1[_U6])
        + side_mean(edge_y_1[_U1])
        - overjet
        - side_mean(edge_y_1[_L1] - y_1[_L1])
    )
    lower_sagittal = rhs / (side_mean(base[_L1]) - side_mean(base[_L6]))

    sy = np.where(upper, sy_upper, s_lower * lower_sagittal)
    x = SIDE * NOMINAL_XY[:, 0] * sx
    y = NOMINAL_XY[:, 1] * sy
    qw, qx, qy, qz, offset_y, offset_z = _orient(sx, sy)
    # z: put each crown's occlusal point at its level
    z = _occlusal_levels(y, params.curve_of_spee_mm) - offset_z
    poses = stack_components((qw, qx, qy, qz, x, y, z))
    edge_y = y + offset_y
    dy = side_mean(edge_y[_U1]) - overjet - side_mean(edge_y[_L1])
    poses[~upper, 5] += dy
    depth = CROWN_DEPTH_MM * params.size
    width = _widths_from_contacts(poses, depth)
    return IdealArch(poses=poses, crown_width_mm=width, crown_depth_mm=depth, params=params)


def _orient(sx: np.ndarray, sy: np.ndarray) -> tuple[np.ndarray, ...]:
    """Orientation (qw, qx, qy, qz) and occlusal offset (y, z; mm) of the 28 crowns on the
    arch form scaled by ``sx``, ``sy`` (28,)."""
    # tangent pointing towards the patient's left: (1, slope) on the left, (1, -slope) on the right
    slope = NOMINAL_SLOPE * sy / sx * SIDE
    half_yaw = 0.5 * np.arctan2(slope, 1.0)
    # the yaw about z, then the prescription (their Hamilton product written out)
    cy, sz = np.cos(half_yaw), np.sin(half_yaw)
    pw, px, py, pz = _PRESCRIPTION_Q.T
    qw, qx, qy, qz = cy * pw - sz * pz, cy * px - sz * py, cy * py + sz * px, cy * pz + sz * pw
    # the occlusal offset is along local z: its length times the rotation matrix's third column
    height = _OCCLUSAL_HEIGHT
    offset_y = height * 2.0 * (qy * qz - qw * qx)
    offset_z = height * (1.0 - 2.0 * (qx * qx + qy * qy))
    return qw, qx, qy, qz, offset_y, offset_z


def _occlusal_levels(y: np.ndarray, spee_mm: float) -> np.ndarray:
    """z (mm) of each crown's incisal edge / cusp tip in the ideal occlusion.

    Incisors and canines overlap vertically (INCISAL_LEVEL_MM); the lower buccal
    cusps follow the line from the lower central edge to the second molar cusp,
    dipped by ``spee_mm`` x SPEE_PROFILE (so the curve of Spee measures spee_mm);
    upper buccal cusps meet the lower ones.
    """
    incisal = _INCISAL_LEVEL
    y1 = side_mean(y[_L1])
    y7 = side_mean(y[_L7])
    line = INCISAL_LEVEL_MM[0] * (y - y7) / (y1 - y7)
    lower_level = np.where(TOOTH_NUMBER <= 2, incisal, line - spee_mm * _SPEE)
    lower_level = np.where(TOOTH_NUMBER == 3, np.maximum(lower_level, incisal), lower_level)
    # an upper buccal crown meets the lower crown of the same number
    by_number = side_mean(lower_level[LOWER_PAIRS])
    upper_level = np.where(TOOTH_NUMBER <= 3, -incisal, by_number[TYPE_INDEX])
    return np.where(IS_UPPER, upper_level, lower_level)


_INCISAL_LEVEL: np.ndarray = INCISAL_LEVEL_MM[TYPE_INDEX]
_SPEE: np.ndarray = SPEE_PROFILE[TYPE_INDEX]


def _widths_from_contacts(poses: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Mesiodistal widths (28,) such that neighbours along each arch half just touch in the collision
    model (:mod:`server.collisions`: ellipses of these widths and depths ``depth`` (28,), turned by
    the poses (28, 7)).

    Central incisors touch across the midline at half their centroids' distance each; along each
    half arch, a crown's radius towards its mesial neighbour is the centroids' distance less that
    neighbour's radius, and its width follows from that radius and the direction.
    """
    width = np.empty(N_TEETH)
    axis = mesiodistal_axis_xy(poses[:, :4])
    d = poses[_HALF_ARCHES, 4:6] - poses[_CONTACT_A, 4:6]  # (4, 7, 2) from the mesial neighbour
    dist = vector_norm(d)
    u = d / dist[..., None]
    c2_here = np.square(np.sum(u * axis[_HALF_ARCHES], axis=-1))  # (4, 7)
    c2_mesial = np.square(np.sum(u * axis[_CONTACT_A], axis=-1))
    dep = depth[_HALF_ARCHES]
    inv_d2 = 4.0 / np.square(dep)
    w = np.empty((4, 7))
    r = dist[:, 0] / 2  # the centrals: mirror images across the midline
    for n in range(7):
        if n:
            r = dist[:, n] - _ellipse_radius(w[:, n - 1], dep[:, n - 1], c2_mesial[:, n])
        # 1 / r^2 = inv_d2 + c2 (4 / w^2 - inv_d2), solved for w
        w[:, n] = 2.0 * np.sqrt(
            c2_here[:, n] / np.maximum(1.0 / np.square(r) - inv_d2[:, n] * (1.0 - c2_here[:, n]), 1e-12)
        )
    width[_HALF_ARCHES] = w
    return width


_HALF_ARCHES: np.ndarray = np.concatenate((UPPER_PAIRS.T, LOWER_PAIRS.T))
"""(4, 7) tooth indices of each half arch (upper right, upper left, lower right, lower left),
central incisor first."""
_CONTACT_A: np.ndarray = np.concatenate(
    (np.concatenate((UPPER_PAIRS.T[::-1], LOWER_PAIRS.T[::-1]))[:, :1], _HALF_ARCHES[:, :-1]), axis=1
)
"""(4, 7) the mesial neighbour of each tooth in _HALF_ARCHES (the other central for a central)."""
