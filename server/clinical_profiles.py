"""Clinical profiles (malocclusions), treatment strategies and their staging orders.

A profile turns the ideal arch into an initial configuration by per-tooth
displacements: a translation in the patient frame (mm) and a rotation vector in
the crown's local frame (torque about x, tip about y, rotation about z; rad).
Magnitudes by severity follow the clinical ranges of docs/environment.md, "Cases"
(Little's irregularity index 1-3 / 4-6 / 7-9 mm; overbite 4-6 mm in deep bite).

Each strategy is a staging order: ``STRATEGY_LEVELS[s][i]`` is the order in which
tooth ``i`` (TOOTH_IDS order) should start moving, 0 first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np

from server.dental_constants import IDEAL_OVERJET_MM, IS_UPPER, SIDE, TOOTH_NUMBER, TYPE_INDEX

IDEAL_OVERJET_MID_MM: float = 0.5 * sum(IDEAL_OVERJET_MM)
"""The target arch's overjet (the middle of the ideal range)."""

STRATEGIES: tuple[str, ...] = (
    "anterior_first",
    "distal_first",
    "retraction_first",
    "intrusion_first",
    "expansion_first",
)
"""The five strategy names a plan may declare (those of the project's original specification's prompt)."""

PROFILES: tuple[str, ...] = ("crowding", "class_ii", "protrusion_spacing", "deep_bite", "mild_irregularity")

OPTIMAL_STRATEGY: dict[str, str] = {
    "crowding": "expansion_first",
    "class_ii": "distal_first",
    "protrusion_spacing": "retraction_first",
    "deep_bite": "intrusion_first",
    "mild_irregularity": "anterior_first",
}
NEUTRAL_STRATEGIES: dict[str, tuple[str, ...]] = {
    "crowding": ("distal_first",),  # distalisation also gains arch length
    "class_ii": ("expansion_first",),  # transverse expansion helps a Class II a little
    "protrusion_spacing": ("anterior_first",),
    "deep_bite": ("anterior_first",),
    "mild_irregularity": ("retraction_first", "intrusion_first"),
}
"""Strategies that are clinically acceptable but not optimal; every other one is wrong."""

# Staging order by FDI last digit 1..7 (same in both arches unless stated).
_LEVELS_BY_NUMBER: dict[str, tuple[int, ...]] = {
    "anterior_first": (0, 0, 1, 2, 2, 3, 3),  # align incisors, then canines, then posteriors
    "expansion_first": (2, 2, 0, 0, 0, 1, 1),  # expand canines/premolars to gain space, then align incisors
    "distal_first": (4, 4, 3, 2, 2, 1, 0),  # sequential distalisation from the second molars forward
    "retraction_first": (1, 1, 0, 2, 2, 3, 3),  # retract canines into the spaces, then the incisors
    "intrusion_first": (0, 0, 2, 1, 1, 3, 3),  # intrude incisors, level the curve of Spee, then the rest
}
STRATEGY_LEVELS: dict[str, np.ndarray] = {s: np.array(v)[TYPE_INDEX] for s, v in _LEVELS_BY_NUMBER.items()}
"""(28,) staging order of each tooth under each strategy (0 starts first)."""
SEQUENCED_TEETH: dict[str, np.ndarray] = {
    s: (IS_UPPER.copy() if s == "distal_first" else np.ones(len(TYPE_INDEX), dtype=bool))
    for s in _LEVELS_BY_NUMBER
}
"""(28,) the teeth whose order a strategy's sequence judges: ``distal_first`` is the sequential
distalisation of the upper dentition (second molars first); the lower dentition of a Class II moves
as a block with the elastics (:data:`CLASS_II_DISTALISATION_MAX_MM`), in no sequence. Every tooth for
the other strategies."""
for _mask in SEQUENCED_TEETH.values():
    _mask.setflags(write=False)

SEVERITIES: tuple[str, ...] = ("mild", "moderate", "severe")


@dataclass(frozen=True)
class Displacement:
    """Per-tooth malocclusion: translation (28, 3) mm, local rotation vector (28, 3) rad."""

    translation: np.ndarray
    rotation: np.ndarray

    @classmethod
    def zero(cls) -> Displacement:
        return cls(np.zeros((28, 3)), np.zeros((28, 3)))

    def __add__(self, other: Displacement) -> Displacement:
        return Displacement(self.translation + other.translation, self.rotation + other.rotation)

    def scaled(self, k: float) -> Displacement:
        return Displacement(self.translation * k, self.rotation * k)


@cache
def _teeth(numbers: tuple[int, ...], upper: bool | None = None) -> np.ndarray:
    """(28,) read-only mask of the teeth numbered ``numbers`` (FDI last digit), in one arch or both."""
    mask = np.isin(TOOTH_NUMBER, numbers)
    if upper is not None:
        mask &= upper == IS_UPPER
    mask.setflags(write=False)
    return mask


def _signs(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random signs +-1 (the draws of ``rng.choice([-1.0, 1.0], n)``, without its overhead)."""
    return _SIGNS[rng.integers(0, 2, size=n)]


_SIGNS = np.array([-1.0, 1.0])


def _range(rng: np.random.Generator, table: dict[str, tuple[float, float]], severity: str) -> float:
    lo, hi = table[severity]
    return float(rng.uniform(lo, hi))


LITTLE_INDEX_MM: dict[str, tuple[float, float]] = {
    "mild": (1.0, 3.0),
    "moderate": (4.0, 6.0),
    "severe": (7.0, 9.0),
}
"""Lower anterior irregularity (Little 1975) that the crowding profile aims at."""
LITTLE_CALIBRATION: float = 0.92
"""The drawn deficit's scale: resolving overlaps (blocking crowded teeth out, :mod:`server.cases`)
adds irregularity, so the measured Little index centres in LITTLE_INDEX_MM with this (a fitted
model constant; measured means mild 1.95, moderate 5.3, severe 8.5 mm on 300 seeds)."""
CLASS_II_MM: dict[str, tuple[float, float]] = {
    "mild": (2.0, 3.5),
    "moderate": (3.5, 5.0),
    "severe": (5.0, 7.0),
}
"""Class II molar relation (mm distal of Class I): up to a quarter-to-half cusp mild, half cusp
moderate, up to a full cusp severe; a full cusp is one premolar width, ~7 mm (Angle 1899; the
code's CUSP_WIDTH_MM)."""
CLASS_II_DISTALISATION_MAX_MM: float = 3.5
"""Most of a Class II the setup corrects by distalising the upper dentition; the rest (up to 3.5 mm
in a full cusp) by moving the lower dentition mesially with Class II elastics. A modelling choice
that keeps every severe case finishable in 24 aligners within the per-stage limits (a full-cusp
distalisation alone at 0.25 mm per aligner needs ~28): aligner distalisation achieves 2-4 mm
(Ravera 2016: 2.25 mm of molar distalisation), larger Class II corrections combine elastics."""
OVERJET_MM: dict[str, tuple[float, float]] = {
    "mild": (5.0, 8.0),
    "moderate": (6.5, 9.5),
    "severe": (8.0, 11.0),
}
"""Overjet of a Class II case by level (ideal 2-3 mm, ABO; increased from 4 mm, severe beyond ~7-9 mm,
Proffit): the molar relation plus the proclination of the upper incisors."""
PROCLINATION_OVERJET_MM: float = 0.4
"""Overjet the upper incisors' 3-7 deg proclination adds at their incisal edges (fitted)."""
SPACING_MM: dict[str, tuple[float, float]] = {
    "mild": (1.0, 3.0),
    "moderate": (4.0, 6.0),
    "severe": (6.0, 8.0),
}
"""Upper anterior spacing (sum of the gaps between the anterior teeth) the protrusion profile aims at:
mild 1-3, moderate 4-6, severe > 6 mm (the arch-length-excess grading mirroring Little's crowding
grades, Little 1975)."""
SPACING_CALIBRATION: float = 1.2
"""Labial flaring per mm of spacing aimed at (fitted with SPACING_BASELINE_MM so the measured spacing
lands in SPACING_MM)."""
SPACING_BASELINE_MM: float = 2.0
"""Spacing the flaring first spends (fitted): in the ideal arch the upper anterior crowns' contact
points overlap where the arch turns at the canines (up to ~0.45 mm a contact, ~1.4 mm in all; crowns
touch as the collision model's ellipses, :mod:`server.arch`), and flaring opens those before it
opens gaps."""
OVERBITE_MM: dict[str, tuple[float, float]] = {
    "mild": (4.0, 5.0),
    "moderate": (5.0, 6.0),
    "severe": (6.0, 8.0),
}
"""Deep-bite overbite: ideal 2-3 mm (ABO); mild 4-5, moderate 5-6, severe 6 mm or more (an
impinging bite at the top of the severe range; Proffit)."""
ROTATION_DEG: dict[str, tuple[float, float]] = {
    "mild": (4.0, 8.0),
    "moderate": (8.0, 14.0),
    "severe": (12.0, 20.0),
}
"""Rotations of irregular teeth about their long axes."""


def crowding(rng: np.random.Generator, severity: str, labial: np.ndarray) -> Displacement:
    """Arch-length deficit: constricted buccal segments, blocked-out and rotated incisors."""
    d = Displacement.zero()
    arches = (False,) if severity == "mild" else (False, True)
    for upper in arches:
        deficit = _range(rng, LITTLE_INDEX_MM, severity) * (0.8 if upper else 1.0) * LITTLE_CALIBRATION
        delta = 0.22 * deficit
        for number, share in ((3, 0.8), (4, 1.0), (5, 1.0), (6, 0.5), (7, 0.3)):
            m = _teeth((number,), upper)
            d.translation[m, 0] -= SIDE[m] * delta * share
        for number, bl, rot in ((1, -0.06, 1.0), (2, 0.2, 1.5), (3, 0.1, 0.6)):
            m = np.flatnonzero(_teeth((number,), upper))
            sign = _signs(rng, m.size)
            d.translation[m] += labial[m] * (bl * deficit * rng.uniform(0.8, 1.2, m.size))[:, None]
            d.rotation[m, 2] += np.radians(rot * deficit) * sign * rng.uniform(0.7, 1.0, m.size)
    return d


def class_ii(rng: np.random.Generator, severity: str, labial: np.ndarray) -> Displacement:
    """Distal molar relation m (CLASS_II_MM): the upper arch mesial by up to
    CLASS_II_DISTALISATION_MAX_MM, the lower arch distal by the rest; the upper incisors proclined to
    the level's overjet (OVERJET_MM)."""
    d = Displacement.zero()
    m = _range(rng, CLASS_II_MM, severity)
    upper_share = min(m, CLASS_II_DISTALISATION_MAX_MM)
    d.translation[IS_UPPER, 1] += upper_share
    d.translation[~IS_UPPER, 1] -= m - upper_share  # corrected by Class II elastics
    incisors = _teeth((1, 2), True)
    overjet = _range(rng, OVERJET_MM, severity)
    d.translation[incisors, 1] += max(overjet - IDEAL_OVERJET_MID_MM - m - PROCLINATION_OVERJET_MM, 0.1)
    d.rotation[incisors, 0] += np.radians(rng.uniform(3.0, 7.0))
    return d


def protrusion_spacing(rng: np.random.Generator, severity: str, labial: np.ndarray) -> Displacement:
    """Proclined, spaced anteriors: labial flaring of incisors (and canines) opens contacts."""
    d = Displacement.zero()
    arches = (True,) if severity == "mild" else (True, False)
    numbers = (1, 2) if severity == "mild" else (1, 2, 3)
    for upper in arches:
        spacing = (_range(rng, SPACING_MM, severity) + SPACING_BASELINE_MM) * (1.0 if upper else 0.6)
        for number in numbers:
            share = {1: 1.0, 2: 0.85, 3: 0.45}[number]
            m = _teeth((number,), upper)
            d.translation[m] += labial[m] * 0.45 * SPACING_CALIBRATION * spacing * share
            if number < 3:
                d.rotation[m, 0] += np.radians(rng.uniform(4.0, 9.0))
    return d


def deep_bite(rng: np.random.Generator, severity: str, labial: np.ndarray) -> Displacement:
    """Deep overbite: extruded incisors, deep curve of Spee, retroclined upper incisors."""
    d = Displacement.zero()
    extra = _range(rng, OVERBITE_MM, severity) - 2.5
    up_inc = _teeth((1, 2), True)
    lo_inc = _teeth((1, 2), False)
    d.translation[up_inc, 2] -= 0.5 * extra
    d.translation[lo_inc, 2] += 0.5 * extra
    if severity != "mild":
        d.translation[_teeth((3,), False), 2] += 0.2 * extra
        spee = 0.6 * extra
        d.translation[_teeth((4, 5)), 2] -= spee
        d.rotation[up_inc, 0] -= np.radians(rng.uniform(3.0, 7.0))
    return d


def mild_irregularity(rng: np.random.Generator, severity: str, labial: np.ndarray) -> Displacement:
    """Class I with rotations and minor buccolingual misalignment of a few teeth."""
    d = Displacement.zero()
    pool = np.flatnonzero(_teeth((1, 2, 3)) if severity == "mild" else _teeth((1, 2, 3, 4, 5)))
    count = {"mild": (2, 5), "moderate": (4, 9), "severe": (6, 11)}[severity]
    chosen = rng.choice(pool, size=int(rng.integers(*count)), replace=False)
    lo, hi = ROTATION_DEG[severity]
    n = chosen.size
    d.rotation[chosen, 2] += np.radians(rng.uniform(lo, hi, n)) * _signs(rng, n)
    d.rotation[chosen, 1] += np.radians(rng.uniform(1.0, 4.0, n)) * _signs(rng, n)
    d.translation[chosen] += labial[chosen] * (rng.uniform(0.2, 0.8, n) * _signs(rng, n))[:, None]
    return d


PROFILE_GENERATORS: dict[str, Callable[[np.random.Generator, str, np.ndarray], Displacement]] = {
    "crowding": crowding,
    "class_ii": class_ii,
    "protrusion_spacing": protrusion_spacing,
    "deep_bite": deep_bite,
    "mild_irregularity": mild_irregularity,
}
"""Each profile's generator ``(rng, severity, labial) -> Displacement``; ``labial`` (28, 3) is
each target crown's local y axis (labial / buccal) in the patient frame."""

SECONDARY_PROFILES: dict[str, tuple[str, ...]] = {
    "crowding": ("deep_bite", "class_ii", "mild_irregularity"),
    "class_ii": ("deep_bite", "crowding", "mild_irregularity"),
    "protrusion_spacing": ("deep_bite", "mild_irregularity"),
    "deep_bite": ("crowding", "class_ii", "mild_irregularity"),
    "mild_irregularity": ("deep_bite", "protrusion_spacing"),
}
"""Profiles that combine with a primary one on task_hard (the primary sets the strategy)."""
SECONDARY_SCALE: float = 0.5
"""A hard case's secondary profile is drawn 'moderate' and applied at this scale."""


def optimal_strategy(profile: str, secondary: str | None = None) -> str:
    """The one documented optimal strategy of a case with a primary and (task_hard) a secondary profile.

    A secondary Class II leaves the buccal segments mesial: the anterior teeth cannot be
    retracted, intruded or aligned into them before they are distalised, so the case is staged
    ``distal_first`` (sequential distalisation precedes anterior correction in aligner Class II
    treatment; Ravera 2016, Rossini 2021); the primary profile's own strategy is then neutral.
    Otherwise the primary profile's strategy.
    """
    if secondary == "class_ii" and profile != "class_ii":
        return OPTIMAL_STRATEGY["class_ii"]
    return OPTIMAL_STRATEGY[profile]


def strategy_multiplier_class(profile: str, strategy: str | None, secondary: str | None = None) -> str:
    """'optimal', 'neutral' or 'wrong' for a declared strategy (None/unknown: 'neutral')."""
    if strategy not in STRATEGIES:
        return "neutral"
    best = optimal_strategy(profile, secondary)
    if strategy == best:
        return "optimal"
    neutral = (
        (*NEUTRAL_STRATEGIES[profile], OPTIMAL_STRATEGY[profile])
        if best != OPTIMAL_STRATEGY[profile]
        else NEUTRAL_STRATEGIES[profile]
    )
    return "neutral" if strategy in neutral else "wrong"
