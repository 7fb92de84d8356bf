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
    N_TEETH,
    SIDE,
    TIP_DEG,
    TOOTH_NUMBER,
    TORQUE_DEG,
    TYPE_INDEX,
    UPPER_CROWN_WIDTH_MM,
)
from server.quaternion_utils import quaternion_about_axis, quaternion_multiply, quaternion_rotate

_X = np.array([1.0, 0.0, 0.0])
_Y = np.array([0.0, 1.0, 0.0])
_Z = np.array([0.0, 0.0, 1.0])

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
        size = float(np.clip(rng.normal(1.0, 0.03), 0.92, 1.08))
        transverse = float(np.clip(rng.normal(1.0, 0.03), 0.93, 1.07))
        return cls(
            size=size,
            upper_transverse=transverse,
            upper_sagittal=float(np.clip(rng.normal(1.0, 0.03), 0.93, 1.07)),
            lower_size=float(np.clip(rng.normal(1.0, 0.01), 0.97, 1.03)),
            lower_transverse=float(np.clip(transverse * rng.normal(1.0, 0.01), 0.92, 1.08)),
            curve_of_spee_mm=float(rng.uniform(0.3, 1.2)),
        )


def crown_frames(yaw: np.ndarray, tip_deg: np.ndarray, torque_deg: np.ndarray) -> np.ndarray:
    """Crown orientations (..., 4): yaw about z, then tip about local y, then torque about local x."""
    q_yaw = quaternion_about_axis(_Z, yaw)
    q_tip = quaternion_about_axis(_Y, np.radians(tip_deg) * TIP_SIGN)
    q_torque = quaternion_about_axis(_X, np.radians(torque_deg) * TORQUE_SIGN)
    return quaternion_multiply(q_yaw, quaternion_multiply(q_tip, q_torque))


def occlusal_points(poses: np.ndarray) -> np.ndarray:
    """Incisal edge / cusp tip of each crown (..., 28, 3) from poses (..., 28, 7)."""
    offset = np.zeros((*poses.shape[:-1], 3))
    offset[..., 2] = OCCLUSAL_END * CROWN_HEIGHT_MM / 2
    return poses[..., 4:7] + quaternion_rotate(poses[..., :4], offset)


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
    lower_sagittal = 1.0
    for _ in range(2):  # yaw depends weakly on the lower sagittal scale: iterate once
        sy = np.where(upper, sy_upper, s_lower * lower_sagittal)
        x = SIDE * NOMINAL_XY[:, 0] * sx
        y = NOMINAL_XY[:, 1] * sy
        # tangent pointing towards the patient's left: (1, slope) on the left, (1, -slope) on the right
        slope = NOMINAL_SLOPE * sy / sx * SIDE
        yaw = np.arctan2(slope, 1.0)
        q = crown_frames(yaw, TIP_DEG, TORQUE_DEG)
        poses = np.concatenate((q, np.stack((x, y, np.zeros(N_TEETH)), axis=-1)), axis=-1)
        levels = _occlusal_levels(y, params.curve_of_spee_mm)
        edge = occlusal_points(poses)
        # z: put each crown's occlusal point at its level
        poses[:, 6] = levels - (edge[:, 2] - poses[:, 6])
        edge = occlusal_points(poses)
        # lower sagittal scale for Class I given an overjet of exactly `overjet`:
        # y_U6 - (y_L6 + dy) = -C with dy = ey_U1 - overjet - ey_L1, ey = edge y; y_L = k * base
        u1 = (TOOTH_NUMBER == 1) & upper
        l1 = (TOOTH_NUMBER == 1) & ~upper
        u6 = (TOOTH_NUMBER == 6) & upper
        l6 = (TOOTH_NUMBER == 6) & ~upper
        base = NOMINAL_XY[:, 1] * s_lower
        edge_offset_l1 = np.mean(edge[l1, 1] - y[l1])
        a1 = np.mean(base[l1])
        a6 = np.mean(base[l6])
        rhs = -CLASS_I_MOLAR_OFFSET_MM - np.mean(y[u6]) + np.mean(edge[u1, 1]) - overjet - edge_offset_l1
        lower_sagittal = rhs / (a1 - a6)
    dy = np.mean(edge[u1, 1]) - overjet - np.mean(edge[l1, 1])
    poses[~upper, 5] += dy
    width = _widths_from_contacts(poses[:, 4:6])
    depth = CROWN_DEPTH_MM * params.size
    return IdealArch(poses=poses, crown_width_mm=width, crown_depth_mm=depth, params=params)


def _occlusal_levels(y: np.ndarray, spee_mm: float) -> np.ndarray:
    """z (mm) of each crown's incisal edge / cusp tip in the ideal occlusion.

    Incisors and canines overlap vertically (INCISAL_LEVEL_MM); the lower buccal
    cusps follow the line from the lower central edge to the second molar cusp,
    dipped by ``spee_mm`` x SPEE_PROFILE (so the curve of Spee measures spee_mm);
    upper buccal cusps meet the lower ones.
    """
    incisal = INCISAL_LEVEL_MM[TYPE_INDEX]
    lower = ~IS_UPPER
    y1 = np.mean(y[lower & (TOOTH_NUMBER == 1)])
    y7 = np.mean(y[lower & (TOOTH_NUMBER == 7)])
    line = incisal[TOOTH_NUMBER == 1][0] * (y - y7) / (y1 - y7)
    lower_level = np.where(TOOTH_NUMBER <= 2, incisal, line - spee_mm * SPEE_PROFILE[TYPE_INDEX])
    lower_level = np.where(TOOTH_NUMBER == 3, np.maximum(lower_level, incisal), lower_level)
    # an upper buccal crown meets the lower crown of the same number
    by_number = np.array([np.mean(lower_level[lower & (n == TOOTH_NUMBER)]) for n in range(1, 8)])
    upper_level = np.where(TOOTH_NUMBER <= 3, -incisal, by_number[TYPE_INDEX])
    return np.where(IS_UPPER, upper_level, lower_level)


def _widths_from_contacts(xy: np.ndarray) -> np.ndarray:
    """Mesiodistal widths (28,) such that neighbours along each arch half touch.

    Central incisors span the midline contact; each next tooth takes twice the
    centroid distance to its mesial neighbour minus that neighbour's width.
    """
    width = np.zeros(N_TEETH)
    for arch_upper in (True, False):
        for side in (-1.0, 1.0):
            idx = [
                int(np.flatnonzero((arch_upper == IS_UPPER) & (side == SIDE) & (n == TOOTH_NUMBER))[0])
                for n in range(1, 8)
            ]
            mirror = int(np.flatnonzero((arch_upper == IS_UPPER) & (-side == SIDE) & (TOOTH_NUMBER == 1))[0])
            width[idx[0]] = np.linalg.norm(xy[idx[0]] - xy[mirror])
            for k in range(1, 7):
                width[idx[k]] = 2 * np.linalg.norm(xy[idx[k]] - xy[idx[k - 1]]) - width[idx[k - 1]]
    return width
