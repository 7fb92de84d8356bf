"""A case's diagnosis from its geometry: clinical profile, secondary profile, severity, strategy.

For a case without labels (an imported patient), :func:`diagnose` reads what the setup corrects:
each measure of :mod:`server.occlusion` on the initial arrangement minus the same measure on the
target (the setup the orthodontist approved). Differences rather than absolute values, so that what
a measure's landmark gets wrong (crown centroids and the model's incisal points, not cusp tips) and
the patient's own arch form cancel: an arch read against itself needs nothing.

Each profile is graded by the correction that defines it, on that finding's clinical scale, mapped
to one common grade: 0 nothing, 1 where the finding starts, 2 where moderate starts, 3 where severe
starts, linear in between and beyond (:data:`GRADE_ANCHORS`):

* ``class_ii``: the molar relation the setup corrects (mm, mean of both sides; + = the upper first
  molar mesial of Class I): a quarter cusp starts it, half a cusp is moderate, from 5 mm towards a
  full cusp (one premolar, ~7 mm) severe (Angle 1899; :data:`server.clinical_profiles.CLASS_II_MM`);
* ``deep_bite``: the overbite the setup reduces, or the curve of Spee it levels, whichever is larger
  (mm): an overbite of 4-5 mm is mild, 5-6 moderate, 6 or more severe against the ideal 2-3 (ABO;
  Proffit), i.e. 1.5 / 2.5 / 3.5 mm of reduction; a curve of Spee deeper than 1.5 mm is not ideal
  (Andrews 1972) and levelling it is the same intrusion;
* ``protrusion_spacing``: how far the setup retracts the upper central incisal edges (mm, sagittal,
  the smaller of the two sides: a protrusion proclines both, one displaced incisor is an
  irregularity), on the overjet's scale (the lower incisors in place, the overjet falls by as much):
  an overjet of 4, 6 and 8 mm against the ideal 2-3 (ABO), increased from 4 mm, severe from 7-9 mm
  (Proffit), i.e. 1.5 / 3.5 / 5.5 mm of retraction. Not the spacing it closes: proclined incisors
  need not have opened their contacts, and one displaced incisor opens a gap;
* ``crowding``: the lower anterior irregularity the setup resolves (Little's index, mm: 1-3 minimal,
  4-6 moderate, 7-9 severe; Little 1975) in an arch the setup widens between the first molars
  (:data:`EXPANSION_MIN_MM`): an arch-length deficit resolved by expansion. The widening (mm) grades
  it on the same scale where it is the larger: blocked-out incisors can keep their contacts, and the
  target arch need not have a Little index of 0;
* ``mild_irregularity``: the largest rotation of a crown about its long axis the setup corrects
  (deg; :data:`server.clinical_profiles.ROTATION_DEG`). A mild irregularity is a Class I arch without
  an arch-length deficit: in an arch the setup widens it is at most the crowding's companion (graded
  no higher than the crowding), and only the premolars' and molars' rotations count (the crowded
  anterior teeth's are the crowding's).

The primary profile is the highest grade, with one clinical rule: with a Class II molar relation
(:data:`CLASS_II_MIN_MM` or more to correct) the upper incisors' retraction is not a protrusion (the
proclined upper incisors are the Class II's overjet). The secondary profile is the highest-graded of
the primary's possible companions (:data:`server.clinical_profiles.SECONDARY_PROFILES`) at
:data:`SECONDARY_MIN_GRADE` or more. The severity is the primary's grade band. A case whose every
grade is below :data:`FINDING_MIN_GRADE` has no named finding and reads ``mild_irregularity``,
``mild`` (the generic staging, ``anterior_first``); it needs treatment only if the setup moves a
crown at all (:data:`MOVEMENT_MIN`). A Class III (a molar relation corrected the other way) has no
profile here: it reads as whatever else the setup corrects. The strategy is
:func:`server.clinical_profiles.optimal_strategy` of the two profiles.

Pure numpy; the measures broadcast over leading axes (cases): :func:`diagnose_many` does a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from server.arch import occlusal_points
from server.clinical_profiles import PROFILES, SECONDARY_PROFILES, SEVERITIES, optimal_strategy
from server.dental_constants import LOWER_PAIRS, N_TEETH, TOOTH_NUMBER, UPPER_PAIRS
from server.occlusion import (
    arch_contacts,
    curve_of_spee_mm,
    midline_mm,
    molar_relation_mm,
    overbite_mm,
    overjet_mm,
    rotation_errors_deg,
)
from server.quaternion_utils import quaternion_angle, vector_norm

GRADE_ANCHORS: dict[str, tuple[float, float, float]] = {
    "crowding": (1.0, 3.5, 6.5),
    "class_ii": (1.75, 3.5, 5.0),
    "protrusion_spacing": (1.5, 3.5, 5.5),
    "deep_bite": (1.5, 2.5, 3.5),
    "mild_irregularity": (4.0, 8.0, 14.0),
}
"""Per profile, its defining correction (the module docstring; mm, deg for ``mild_irregularity``) at
grades 1, 2 and 3: where the finding starts, where moderate starts, where severe starts. Where the literature's grades
leave a gap (Little's 1-3 and 4-6 mm) the boundary is the middle of the gap; where they overlap
(rotations of 8-14 and 12-20 deg) the top of the milder one."""
EXPANSION_MIN_MM: float = 0.15
"""Intermolar widening (mm, the larger of the two arches) from which the setup expands the arch:
below what can be measured on casts (~0.5 mm), above the numbers' noise (a setup that leaves the
molars in place widens them by 0)."""
CLASS_II_MIN_MM: float = 1.0
"""A molar relation correction beyond the Class I band (|molar relation| <= 1 mm, the occlusion
key's band and ``case_summary``'s molar class) makes the upper incisors' retraction a Class II's, not
a protrusion."""
SECONDARY_MIN_GRADE: float = 0.5
"""Grade from which a companion finding is a secondary profile (half its clinical onset: the
companions of a combined case are drawn at half a moderate finding)."""
FINDING_MIN_GRADE: float = 0.1
"""Below this grade on every profile the setup corrects no named finding (a tenth of each onset:
0.1 mm of Little's index, 0.4 deg of rotation)."""
MOVEMENT_MIN: tuple[float, float] = (0.1, 1.0)
"""(mm, deg) a crown must move, initial to target, for the case to need treatment: below it the
movement is within a segmentation's accuracy."""

_U1, _U6, _L6 = UPPER_PAIRS[0], UPPER_PAIRS[5], LOWER_PAIRS[5]
_POSTERIOR = TOOTH_NUMBER >= 4


@dataclass(frozen=True)
class Diagnosis:
    """A case's diagnosis and the corrections (initial minus target) it was decided on, rounded to 0.001.

    Attributes:
        profile: one of :data:`server.clinical_profiles.PROFILES`.
        secondary_profile: one of ``SECONDARY_PROFILES[profile]``, or None.
        severity: one of :data:`server.clinical_profiles.SEVERITIES`.
        optimal_strategy: ``optimal_strategy(profile, secondary_profile)``.
        treatment_needed: whether the setup moves any crown by :data:`MOVEMENT_MIN` or more.
        molar_relation_mm: molar relation corrected (mean of sides; + = a Class II corrected).
        overjet_mm: overjet reduced.
        overbite_mm: overbite reduced.
        curve_of_spee_mm: curve of Spee levelled.
        midline_mm: |midline| shift corrected.
        upper_spacing_mm: upper spacing closed (summed gaps between neighbours).
        incisor_retraction_mm: how far the upper central incisal edges are retracted (y; the
            smaller of the two sides).
        lower_irregularity_mm: lower Little index resolved.
        expansion_mm: intermolar widening (the larger of the two arches).
        rotation_deg: the largest crown rotation about its long axis.
        posterior_rotation_deg: the same over the premolars and molars.
        grades: each profile's grade (>= 0), in PROFILES order.
    """

    profile: str
    secondary_profile: str | None
    severity: str
    optimal_strategy: str
    treatment_needed: bool
    molar_relation_mm: float
    overjet_mm: float
    overbite_mm: float
    curve_of_spee_mm: float
    midline_mm: float
    upper_spacing_mm: float
    incisor_retraction_mm: float
    lower_irregularity_mm: float
    expansion_mm: float
    rotation_deg: float
    posterior_rotation_deg: float
    grades: tuple[float, ...]


MEASURES: tuple[str, ...] = (
    "molar_relation_mm",
    "overjet_mm",
    "overbite_mm",
    "curve_of_spee_mm",
    "midline_mm",
    "upper_spacing_mm",
    "incisor_retraction_mm",
    "lower_irregularity_mm",
    "expansion_mm",
    "rotation_deg",
    "posterior_rotation_deg",
)
"""The corrections :func:`corrections` returns, in :class:`Diagnosis`' field order."""


def corrections(initial: np.ndarray, target: np.ndarray, crown_width_mm: np.ndarray) -> dict[str, np.ndarray]:
    """What the setup corrects: each measure of ``initial`` minus the same measure of ``target``.

    Args:
        initial: (..., 28, 7) initial poses (unit quaternion w first, crown centroid in mm;
            TOOTH_IDS order).
        target: (..., 28, 7) target poses.
        crown_width_mm: (..., 28) or (28,) mesiodistal crown widths (mm).

    Returns:
        :data:`MEASURES` -> (...,) arrays (mm; the rotations in degrees).
    """
    rotation = rotation_errors_deg(initial, target)[..., 2]  # (..., 28) about each crown's long axis
    both = np.stack(np.broadcast_arrays(initial, target))  # (2, ..., 28, 7): both measured in one pass
    edge = occlusal_points(both)
    _, irr_l, sp_u, _ = arch_contacts(both, crown_width_mm)
    upper_width = np.abs(both[..., _U6[1], 4] - both[..., _U6[0], 4])
    lower_width = np.abs(both[..., _L6[1], 4] - both[..., _L6[0], 4])
    return {
        "molar_relation_mm": _change(np.mean(molar_relation_mm(both), axis=-1)),
        "overjet_mm": _change(overjet_mm(both, edge)),
        "overbite_mm": _change(overbite_mm(both, edge)),
        "curve_of_spee_mm": _change(curve_of_spee_mm(both, edge)),
        "midline_mm": np.abs(_change(midline_mm(both))),
        "upper_spacing_mm": _change(sp_u),
        "incisor_retraction_mm": np.min(_change(edge[..., _U1, 1]), axis=-1),
        "lower_irregularity_mm": _change(irr_l),
        "expansion_mm": np.maximum(-_change(upper_width), -_change(lower_width)),
        "rotation_deg": np.max(rotation, axis=-1),
        "posterior_rotation_deg": np.max(rotation[..., _POSTERIOR], axis=-1),
    }


def _change(measure: np.ndarray) -> np.ndarray:
    """(...,) initial minus target of a measure of the (2, ...) stack (initial, target)."""
    return measure[0] - measure[1]


_ANCHORS: np.ndarray = np.array([GRADE_ANCHORS[p] for p in PROFILES]).T  # (3, 5): a1, a2, a3
_CROWDING, _PROTRUSION, _IRREGULARITY = map(
    PROFILES.index, ("crowding", "protrusion_spacing", "mild_irregularity")
)


def _grade(value: np.ndarray) -> np.ndarray:
    """(..., 5) piecewise-linear grades of (..., 5) corrections (PROFILES order): 0 at 0, 1 / 2 / 3
    at the anchors, on the last segment's slope beyond them; 0 for a correction the other way."""
    a1, a2, a3 = _ANCHORS
    v = np.maximum(value, 0.0)
    return (
        np.minimum(v, a1) / a1
        + np.clip(v - a1, 0.0, a2 - a1) / (a2 - a1)
        + np.maximum(v - a2, 0.0) / (a3 - a2)
    )


def grades(measures: dict[str, np.ndarray]) -> np.ndarray:
    """(..., 5) each profile's grade, PROFILES order, from :func:`corrections`' measures."""
    expanded = measures["expansion_mm"] >= EXPANSION_MIN_MM
    value = {
        "crowding": np.where(
            expanded, np.maximum(measures["lower_irregularity_mm"], measures["expansion_mm"]), 0.0
        ),
        "class_ii": measures["molar_relation_mm"],
        "protrusion_spacing": measures["incisor_retraction_mm"],
        "deep_bite": np.maximum(measures["overbite_mm"], measures["curve_of_spee_mm"]),
        "mild_irregularity": np.where(expanded, measures["posterior_rotation_deg"], measures["rotation_deg"]),
    }
    g = _grade(np.stack([value[p] for p in PROFILES], axis=-1))
    g[..., _PROTRUSION] *= measures["molar_relation_mm"] < CLASS_II_MIN_MM
    g[..., _IRREGULARITY] = np.where(
        expanded, np.minimum(g[..., _IRREGULARITY], g[..., _CROWDING]), g[..., _IRREGULARITY]
    )
    return g


_COMPANIONS: np.ndarray = np.array([[q in SECONDARY_PROFILES[p] for q in PROFILES] for p in PROFILES])
"""(5, 5) whether profile j may be profile i's secondary."""


def diagnose_many(initial: np.ndarray, target: np.ndarray, crown_width_mm: np.ndarray) -> list[Diagnosis]:
    """The diagnoses of N cases at once (see the module docstring).

    Args:
        initial: (N, 28, 7) initial poses (unit quaternions w first, centroids in mm).
        target: (N, 28, 7) target poses.
        crown_width_mm: (N, 28) or (28,) mesiodistal crown widths (mm).

    Raises:
        ValueError: on other shapes or a non-finite value (a validated case has none).
    """
    initial, target = np.asarray(initial, dtype=float), np.asarray(target, dtype=float)
    width = np.asarray(crown_width_mm, dtype=float)
    if initial.ndim != 3 or initial.shape[1:] != (N_TEETH, 7) or target.shape != initial.shape:
        raise ValueError(
            f"initial and target must be (N, {N_TEETH}, 7), got {initial.shape} and {target.shape}"
        )
    if width.shape not in ((N_TEETH,), (len(initial), N_TEETH)):
        raise ValueError(f"crown_width_mm must be ({N_TEETH},) or (N, {N_TEETH}), got {width.shape}")
    if not (np.isfinite(initial).all() and np.isfinite(target).all() and np.isfinite(width).all()):
        raise ValueError("poses and crown widths must be finite")
    m = corrections(initial, target, width)
    g = grades(m)  # (N, 5)
    primary = np.argmax(g, axis=-1)
    found = g[np.arange(len(g)), primary] >= FINDING_MIN_GRADE
    companion = np.where(_COMPANIONS[primary], g, -np.inf)
    second = np.argmax(companion, axis=-1)
    paired = found & (companion[np.arange(len(g)), second] >= SECONDARY_MIN_GRADE)
    band = np.clip(np.floor(g[np.arange(len(g)), primary]).astype(int) - 1, 0, 2)
    moved = (vector_norm(target[..., 4:] - initial[..., 4:]).max(axis=-1) >= MOVEMENT_MIN[0]) | (
        np.degrees(quaternion_angle(initial[..., :4], target[..., :4])).max(axis=-1) >= MOVEMENT_MIN[1]
    )
    values = (np.round(np.stack([m[name] for name in MEASURES], axis=-1), 3) + 0.0).tolist()
    rounded = (np.round(g, 3) + 0.0).tolist()
    out = []
    for k in range(len(primary)):
        profile = PROFILES[primary[k]] if found[k] else "mild_irregularity"
        secondary = PROFILES[second[k]] if paired[k] else None
        out.append(
            Diagnosis(
                profile=profile,
                secondary_profile=secondary,
                severity=SEVERITIES[band[k]] if found[k] else "mild",
                optimal_strategy=optimal_strategy(profile, secondary),
                treatment_needed=bool(moved[k]),
                **dict(zip(MEASURES, values[k])),
                grades=tuple(rounded[k]),
            )
        )
    return out


def diagnose(initial: np.ndarray, target: np.ndarray, crown_width_mm: np.ndarray) -> Diagnosis:
    """The diagnosis of one case: initial and target poses (28, 7) and crown widths (28,) mm, the
    shapes and units of :class:`server.cases.Case` (see the module docstring)."""
    return diagnose_many(np.asarray(initial)[None], np.asarray(target)[None], crown_width_mm)[0]
