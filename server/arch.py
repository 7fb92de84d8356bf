"""The ideal (target) arch of a case: crowns placed in contact along an arch form.

The arch form is a power curve ``y = -b |x|^p`` (mm, incisal point at the origin),
fitted once at import so that, with Wheeler's mean crown widths placed in contact
along the curve, the centroid widths between the canines and the first molars
equal the Class I norms (35.4 / 53.8 mm upper, 26.9 / 51.7 mm lower). Per case the
arch is scaled (overall size, transverse, sagittal), the lower arch is placed for an
ideal overjet and a Class I molar relation (its sagittal scale solves that exactly),
and crown widths follow from the positions so that neighbours just touch.
A power curve is used rather than Braun's beta function because the beta curve
ends at the molars' width and cannot hold Wheeler's 55 mm half-arch; catenary
and beta forms differ from it by well under a millimetre anteriorly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from server.dental_constants import (
    CLASS_I_MOLAR_OFFSET_MM,
    CROWN_DEPTH_MM,
    CROWN_HEIGHT_MM,
    IDEAL_OVERJET_MM,
    INTERCANINE_WIDTH_MM,
    INTERMOLAR_WIDTH_MM,
    IS_UPPER,
    LOWER_CROWN_WIDTH_MM,
    LOWER_PAIRS,
    N_TEETH,
    SIDE,
    TIP_DEG,
    TOOTH_NUMBER,
    TORQUE_DEG,
    TYPE_INDEX,
    UPPER_CROWN_WIDTH_MM,
    UPPER_PAIRS,
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


def _fit_power_curve(widths: np.ndarray, intercanine: float, intermolar: float) -> tuple[float, float]:
    """Solve (b, p) of y = -b x^p so that canine and first-molar centroids hit the norms."""
    from scipy.optimize import least_squares  # import-time fit only

    def residual(params: np.ndarray) -> list[float]:
        x, _ = _place_on_curve(params[0], params[1], widths)
        return [2 * x[2] - intercanine, 2 * x[5] - intermolar]

    fit = least_squares(residual, [1e-3, 3.0], bounds=([1e-7, 1.0], [1.0, 6.0]), xtol=1e-12)
    return float(fit.x[0]), float(fit.x[1])


def _place_on_curve(b: float, p: float, widths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of 7 crown centroids placed in contact along y = -b x^p from the midline."""
    x = np.linspace(0.0, 45.0, 9001)
    y = -b * x**p
    s = np.concatenate(([0.0], np.cumsum(np.hypot(np.diff(x), np.diff(y)))))
    along = np.cumsum(widths) - widths / 2
    return np.interp(along, s, x), np.interp(along, s, y)


def _nominal_arch(widths: np.ndarray, arch: str) -> tuple[np.ndarray, np.ndarray, float, float]:
    b, p = _fit_power_curve(widths, INTERCANINE_WIDTH_MM[arch][0], INTERMOLAR_WIDTH_MM[arch][0])
    x, y = _place_on_curve(b, p, widths)
    return x, y, b, p


_UX, _UY, _UB, _UP = _nominal_arch(UPPER_CROWN_WIDTH_MM, "upper")
_LX, _LY, _LB, _LP = _nominal_arch(LOWER_CROWN_WIDTH_MM, "lower")
NOMINAL_XY: np.ndarray = np.stack(
    [
        np.where(IS_UPPER, _UX[TYPE_INDEX], _LX[TYPE_INDEX]),
        np.where(IS_UPPER, _UY[TYPE_INDEX], _LY[TYPE_INDEX]),
    ],
    axis=-1,
)
"""(28, 2) nominal centroid x (always >= 0, unsigned) and y of each tooth."""
NOMINAL_SLOPE: np.ndarray = np.where(
    IS_UPPER,
    -_UB * _UP * _UX[TYPE_INDEX] ** (_UP - 1),
    -_LB * _LP * _LX[TYPE_INDEX] ** (_LP - 1),
)
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
        """Draw one patient's arch: about 1 SD of the Class I norms in each dimension."""
        size = _clip(rng.normal(1.0, 0.03), 0.92, 1.08)
        transverse = _clip(rng.normal(1.0, 0.03), 0.93, 1.07)
        return cls(
            size=size,
            upper_transverse=transverse,
            upper_sagittal=_clip(rng.normal(1.0, 0.03), 0.93, 1.07),
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
    width = _widths_from_contacts(poses[:, 4:6])
    depth = CROWN_DEPTH_MM * params.size
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


def _widths_from_contacts(xy: np.ndarray) -> np.ndarray:
    """Mesiodistal widths (28,) such that neighbours along each arch half touch.

    Central incisors span the midline contact; each next tooth takes twice the
    centroid distance to its mesial neighbour minus that neighbour's width.
    """
    width = np.empty(N_TEETH)
    dist = vector_norm(xy[_HALF_ARCHES] - xy[_CONTACT_A])  # (4, 7)
    # w_0 = d_0, w_k = 2 d_k - w_(k-1): an alternating sum, one product per half arch
    width[_HALF_ARCHES] = dist @ _ALTERNATING.T
    return width


_HALF_ARCHES: np.ndarray = np.concatenate((UPPER_PAIRS.T, LOWER_PAIRS.T))
"""(4, 7) tooth indices of each half arch (upper right, upper left, lower right, lower left),
central incisor first."""
_CONTACT_A: np.ndarray = np.concatenate(
    (np.concatenate((UPPER_PAIRS.T[::-1], LOWER_PAIRS.T[::-1]))[:, :1], _HALF_ARCHES[:, :-1]), axis=1
)
"""(4, 7) the mesial neighbour of each tooth in _HALF_ARCHES (the other central for a central)."""
_ALTERNATING: np.ndarray = (
    np.tril((-1.0) ** np.subtract.outer(np.arange(7), np.arange(7))) * np.r_[1.0, np.full(6, 2.0)]
)
"""(7, 7) w = _ALTERNATING @ d solves w_0 = d_0, w_k = 2 d_k - w_(k-1)."""
