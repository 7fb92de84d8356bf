"""Clinical constants of the aligner-staging simulation — the one place each number lives.

Coordinate frame (one patient frame for every tooth)
----------------------------------------------------
* ``x`` points to the patient's **left**, ``y`` **anterior** (towards the lips),
  ``z`` **occlusal-up** (from the lower towards the upper jaw). Units: mm.
* The occlusal plane is ``z = 0``: upper crowns sit above it, lower crowns below.
* A pose is ``[qw, qx, qy, qz, tx, ty, tz]``: a unit quaternion (w first) for the
  crown orientation and the crown centroid in mm.
* Each crown has a local frame: local ``x`` = mesiodistal axis (pointing away
  from the midline along the arch), local ``y`` = buccolingual axis (pointing
  labially/buccally, out of the arch), local ``z`` = the patient's ``z``
  rotated by the crown's tip and torque. Rotation errors are decomposed in this
  frame: about local x = torque (inclination), about local y = tip
  (angulation), about local z = rotation.

Arrays indexed by tooth follow :data:`TOOTH_IDS` (FDI order 11-17, 21-27,
31-37, 41-47). Per-type tables are indexed by the FDI last digit minus one
(1 central incisor … 7 second molar).
"""

from __future__ import annotations

import itertools

import numpy as np

# --- Teeth and stages -------------------------------------------------------

N_STAGES: int = 24
"""Aligners in a treatment; stage 0 is the initial state, stage 24 the last aligner."""

N_TEETH: int = 28
POSE_DIM: int = 7

TOOTH_IDS: tuple[int, ...] = (
    *range(11, 18),
    *range(21, 28),
    *range(31, 38),
    *range(41, 48),
)
"""FDI ids in array order; third molars are out of scope."""

TOOTH_INDEX: dict[int, int] = {fdi: i for i, fdi in enumerate(TOOTH_IDS)}

_FDI = np.array(TOOTH_IDS)
QUADRANT: np.ndarray = _FDI // 10  # 1 upper right, 2 upper left, 3 lower left, 4 lower right
TOOTH_NUMBER: np.ndarray = _FDI % 10  # 1..7
TYPE_INDEX: np.ndarray = TOOTH_NUMBER - 1  # 0..6, indexes the per-type tables below
IS_UPPER: np.ndarray = QUADRANT <= 2
SIDE: np.ndarray = np.where((QUADRANT == 2) | (QUADRANT == 3), 1.0, -1.0)  # +1 patient's left

TOOTH_CLASSES: tuple[str, ...] = ("incisor", "canine", "premolar", "molar")
CLASS_OF_NUMBER: tuple[int, ...] = (0, 0, 1, 2, 2, 3, 3)
"""Tooth class (index into TOOTH_CLASSES) of FDI last digits 1..7."""
TOOTH_CLASS: np.ndarray = np.array(CLASS_OF_NUMBER)[TYPE_INDEX]
IS_INCISOR: np.ndarray = TOOTH_CLASS == 0
IS_MOLAR: np.ndarray = TOOTH_CLASS == 3

# --- Per-stage movement limits ------------------------------------------------

MAX_TRANSLATION_MM: float = 0.25
"""Translation per tooth per stage (aligner design rule; vendor default, ArchForm)."""
MAX_ROTATION_DEG: float = 2.0
"""Rotation per tooth per stage (aligner design rule; vendor default, ArchForm)."""
LIMIT_TOLERANCE: float = 0.05
"""Relative slack before an increment counts as a violation (numerical tolerance)."""
MM_PER_DEG: float = MAX_TRANSLATION_MM / MAX_ROTATION_DEG
"""Exchange rate between rotation and translation used in combined distances:
one per-stage rotation limit weighs as much as one per-stage translation limit."""

FEASIBLE_TRANSLATION_MM: float = 5.75
"""Case generator cap on a tooth's total translation (23 stages at 0.25 mm, < 24 x 0.25 = 6 mm), so every
case is reachable by uniform SLERP within the limits, with margin."""
FEASIBLE_ROTATION_DEG: float = 44.0
"""Case generator cap on a tooth's total rotation (< 24 x 2 = 48 deg)."""

# --- Crown dimensions (Wheeler's Dental Anatomy, mean values) -------------------

UPPER_CROWN_WIDTH_MM: np.ndarray = np.array([8.5, 6.5, 7.5, 7.0, 7.0, 10.0, 9.0])
"""Mesiodistal crown widths, upper teeth 1..7 (Wheeler)."""
LOWER_CROWN_WIDTH_MM: np.ndarray = np.array([5.0, 5.5, 7.0, 7.0, 7.0, 11.0, 10.5])
"""Mesiodistal crown widths, lower teeth 1..7 (Wheeler)."""
UPPER_CROWN_DEPTH_MM: np.ndarray = np.array([3.5, 3.0, 5.5, 8.0, 8.0, 10.0, 9.5])
"""Buccolingual crown thickness at the contact level, upper 1..7 (mm). Model values:
Wheeler's buccolingual diameters for premolars and molars; for incisors and canines
the thinner incisal third, where their contacts are, rather than the cervical 6-8 mm."""
LOWER_CROWN_DEPTH_MM: np.ndarray = np.array([3.0, 3.0, 5.0, 7.0, 7.5, 9.5, 9.0])
"""Buccolingual crown thickness at the contact level, lower 1..7 (mm); as above."""
UPPER_CROWN_HEIGHT_MM: np.ndarray = np.array([10.5, 9.0, 10.0, 8.5, 7.5, 7.5, 7.0])
"""Crown heights (cervical line to incisal edge / cusp tip), upper 1..7 (Wheeler)."""
LOWER_CROWN_HEIGHT_MM: np.ndarray = np.array([9.0, 9.5, 11.0, 8.5, 8.0, 7.5, 7.0])
"""Crown heights, lower 1..7 (Wheeler)."""

BOLTON_OVERALL: float = 0.913
"""Bolton overall ratio, lower/upper sum of widths of teeth 1-6 (Bolton 1958)."""
BOLTON_ANTERIOR: float = 0.772
"""Bolton anterior ratio, lower/upper sum of widths of teeth 1-3 (Bolton 1958)."""

# --- Arch dimensions (Class I norms) -------------------------------------------

INTERCANINE_WIDTH_MM: dict[str, tuple[float, float]] = {"upper": (35.4, 1.5), "lower": (26.9, 1.6)}
"""Intercanine width, mean and SD (Class I norms), measured where the literature measures it: between
the canine cusp tips (Bishara 1997; Staley 1985), not between the crown centroids."""
INTERMOLAR_WIDTH_MM: dict[str, tuple[float, float]] = {"upper": (53.8, 2.8), "lower": (51.7, 2.6)}
"""Intermolar width, mean and SD (Class I norms), measured across the first molars' buccal surfaces
(the greatest transverse width of the crowns), not between the crown centroids. The lower value
places the landmark: the lower buccal cusps occlude in the upper central fossae, some 5 mm inside
the upper buccal cusps (Andrews 1972, key I), so a lower width only 2 mm below the upper one is not
a cusp-tip width; the real jaw of ``tests/data`` measures 51.6 / 50.6 mm across its first molars'
buccal surfaces, and 48.3 mm between its upper mesiobuccal cusp tips."""
WIDTH_LANDMARK_OFFSET_MM: dict[str, tuple[float, float]] = {"upper": (2.3, 5.5), "lower": (0.4, 5.25)}
"""How far (mm) the landmark of each arch-width norm lies outward of its crown's centroid, along the
crown's labial (buccal) direction in the occlusal plane: (canine cusp tip, first molar's buccal
surface) per arch. Molars: half Wheeler's buccolingual crown diameter (11.0 mm upper, 10.5 mm lower;
the diameter is taken between the buccal and lingual heights of contour). Canine cusp tips: measured
on a real jaw's crown meshes (Open-Full-Jaw, Patient 26, CBCT; Gholamalizadeh et al. 2022):
2.3 mm upper, 0.4 mm lower (0.29 and 0.05 of Wheeler's 8.0 / 7.5 mm canine diameters): the upper
canine's cusp is labial of its crown's centre, the lower one's almost over it. Centroid widths are the
norms less twice these offsets' transverse parts (:func:`server.arch.width_landmarks_xy`)."""
ARCH_FORM_EXPONENT: float = 0.8
"""Exponent of the beta-function arch form y = D (1 - (2x/W)^2)^0.8 (Braun 1998)."""

# --- Occlusion ideals (ABO; Andrews 1972) ----------------------------------------

IDEAL_OVERJET_MM: tuple[float, float] = (2.0, 3.0)
"""Ideal overjet range (ABO)."""
IDEAL_OVERBITE_MM: tuple[float, float] = (2.0, 3.0)
"""Ideal overbite range (ABO)."""
MAX_CURVE_OF_SPEE_MM: float = 1.5
"""Ideal curve of Spee depth at most (Andrews 1972)."""
CLASS_I_MOLAR_OFFSET_MM: float = 2.0
"""Class I: the upper first molar's crown centroid lies this far distal (-y) of the
lower first molar's, i.e. its mesiobuccal cusp sits in the lower buccal groove
(Angle 1899; Andrews key I). A model value of the simulation."""
CUSP_WIDTH_MM: float = 7.0
"""One premolar width: a full-cusp Class II molar relation (Angle)."""

# Andrews straight-wire prescription: (tip, torque) in degrees, teeth 1..7.
UPPER_TIP_DEG: np.ndarray = np.array([5.0, 9.0, 11.0, 2.0, 2.0, 5.0, 5.0])
UPPER_TORQUE_DEG: np.ndarray = np.array([7.0, 3.0, -7.0, -7.0, -7.0, -9.0, -9.0])
LOWER_TIP_DEG: np.ndarray = np.array([2.0, 2.0, 5.0, 2.0, 2.0, 2.0, 2.0])
LOWER_TORQUE_DEG: np.ndarray = np.array([-1.0, -1.0, -11.0, -17.0, -22.0, -30.0, -35.0])
"""Andrews straight-wire tip/torque prescription (Andrews 1972/1976)."""

# --- Periodontal ligament ---------------------------------------------------------

UPPER_ROOT_AREA_MM2: np.ndarray = np.array([204.0, 179.0, 273.0, 234.0, 220.0, 433.0, 431.0])
LOWER_ROOT_AREA_MM2: np.ndarray = np.array([162.0, 175.0, 266.0, 197.0, 204.0, 431.0, 426.0])
"""Root surface areas, teeth 1..7 (Jepsen 1963; order of magnitude confirmed by
Mowry 2002: incisors 160-205, canines ~270, premolars 180-270, molars ~430 mm2)."""

PDL_OPTIMAL_KPA: tuple[float, float] = (2.0, 2.6)
"""Optimal orthodontic PDL pressure band (Schwarz 1932: ~ capillary pressure)."""
PDL_CRITICAL_KPA: float = 4.7
"""PDL pressure above which hyalinisation/root resorption risk is high (Schwarz 1932)."""
ALIGNER_FORCE_N_PER_MM: float = 1.06
ALIGNER_FORCE_N_PER_DEG: float = 0.1325
"""Aligner force per unit of aligner/tooth mismatch (N/mm, N/deg). Calibrated, not
measured: a mismatch at both per-stage limits (0.25 mm + 2 deg) gives 0.53 N, i.e.
2.6 kPa on an upper central incisor (204 mm2) - the top of Schwarz's optimal band -
so the limits are safe for every tooth and twice the limits exceeds 4.7 kPa on
incisors. Published aligner forces for 0.2-0.25 mm activations are 0.5-2 N."""

# --- Force decay: expression (end-of-treatment accuracy) ------------------------------

# Share of the planned movement a tooth expresses by the end of an aligner series, by class
# (incisor, canine, premolar, molar) and movement type: the end-of-treatment accuracies of
# Kravitz 2009 (AJODO 135:27-35; mean 41 %), which :mod:`server.dynamics` reproduces for uniform
# staging without compensation. Where Kravitz did not measure a class, the nearest measured
# movement of a similar tooth is used (a choice, marked "choice").
EXPRESSION_TRANSLATION: np.ndarray = np.array([0.47, 0.45, 0.47, 0.47])
"""Bodily (buccolingual, mesiodistal) translation: lingual constriction 47.1 %, the best movement
(Kravitz 2009); canines a little lower (labial expansion 40.5 %); premolars and molars: choice, as
constriction."""
EXPRESSION_ROTATION: np.ndarray = np.array([0.46, 0.32, 0.36, 0.45])
"""Rotation about the long axis: incisors ~46-48 %, maxillary canines 32.2 %, the lowest, worse above
15 deg (Kravitz 2009); premolars, round like canines: choice near them; molars: choice (Lombardo 2017
reports molar rotations expressed better)."""
EXPRESSION_TIP: np.ndarray = np.array([0.45, 0.42, 0.5, 0.5])
"""Mesiodistal tip (Kravitz 2009: 41.5 % overall; Lombardo 2017: premolar and molar tip among the best
expressed); also used for torque, which the table does not list."""
EXPRESSION_INTRUSION: np.ndarray = np.array([0.45, 0.4, 0.4, 0.4])
"""Intrusion: 41.3 % overall, lower incisors 46.6 %, upper 44.7 % (Kravitz 2009); others: choice."""
EXPRESSION_EXTRUSION: np.ndarray = np.array([0.25, 0.3, 0.3, 0.3])
"""Extrusion: 29.6 % overall, maxillary central incisors 18.3 %, the worst movement (Kravitz 2009);
others: choice at the overall figure."""
FORCE_DECAY_TAU_H: float = 3.0
FORCE_DECAY_PLATEAU: float = 0.45
"""F(t) = F0 (f_inf + (1 - f_inf) exp(-t / tau)), tau ~ 2-4 h, f_inf ~ 0.4-0.5 at 24 h
(Lombardo 2017; Chen 2023). The expression shares above already integrate this decay over an
aligner series; the curve is kept for reporting mean delivered force."""

# --- Plan semantics ----------------------------------------------------------------

PRIORITY_START_STAGE: dict[str, int] = {"high": 1, "medium": 7, "low": 13}
"""Stage at which a plan group starts moving, by priority."""
DEFAULT_PRIORITY: str = "high"


def per_tooth(upper: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """Expand two per-type tables (teeth 1..7) to a (28,) array in TOOTH_IDS order."""
    return np.where(IS_UPPER, np.asarray(upper)[TYPE_INDEX], np.asarray(lower)[TYPE_INDEX])


CROWN_WIDTH_MM: np.ndarray = per_tooth(UPPER_CROWN_WIDTH_MM, LOWER_CROWN_WIDTH_MM)
CROWN_DEPTH_MM: np.ndarray = per_tooth(UPPER_CROWN_DEPTH_MM, LOWER_CROWN_DEPTH_MM)
CROWN_HEIGHT_MM: np.ndarray = per_tooth(UPPER_CROWN_HEIGHT_MM, LOWER_CROWN_HEIGHT_MM)
ROOT_AREA_MM2: np.ndarray = per_tooth(UPPER_ROOT_AREA_MM2, LOWER_ROOT_AREA_MM2)
TIP_DEG: np.ndarray = per_tooth(UPPER_TIP_DEG, LOWER_TIP_DEG)
TORQUE_DEG: np.ndarray = per_tooth(UPPER_TORQUE_DEG, LOWER_TORQUE_DEG)


def _adjacent_pairs() -> np.ndarray:
    """Adjacent teeth along each arch, distal to distal: 17-16-...-11-21-...-27, same below."""
    pairs = []
    for right, left in ((1, 2), (4, 3)):
        row = [right * 10 + n for n in range(7, 0, -1)] + [left * 10 + n for n in range(1, 8)]
        pairs += [(TOOTH_INDEX[a], TOOTH_INDEX[b]) for a, b in itertools.pairwise(row)]
    return np.array(pairs)


ADJACENT_PAIRS: np.ndarray = _adjacent_pairs()
"""(26, 2) indices of neighbouring teeth (13 contacts per arch)."""
ANTERIOR_CONTACTS: np.ndarray = np.array(
    [k for k, (a, b) in enumerate(ADJACENT_PAIRS) if TOOTH_NUMBER[a] <= 3 and TOOTH_NUMBER[b] <= 3]
)
"""Indices into ADJACENT_PAIRS of the 5+5 canine-to-canine contacts (Little 1975)."""
MIRROR_INDEX: np.ndarray = np.array(
    [TOOTH_INDEX[{1: 2, 2: 1, 3: 4, 4: 3}[q] * 10 + n] for q, n in zip(QUADRANT, TOOTH_NUMBER)]
)
"""Index of each tooth's contralateral counterpart."""


def tooth_pair(number: int, upper: bool) -> np.ndarray:
    """(2,) indices of the (right, left) teeth numbered ``number`` (FDI last digit 1..7) in one arch."""
    return np.array([TOOTH_INDEX[quadrant * 10 + number] for quadrant in ((1, 2) if upper else (4, 3))])


UPPER_PAIRS: np.ndarray = np.stack([tooth_pair(n, True) for n in range(1, 8)])
"""(7, 2) indices of the (right, left) upper teeth numbered 1..7 (row n - 1)."""
LOWER_PAIRS: np.ndarray = np.stack([tooth_pair(n, False) for n in range(1, 8)])
"""(7, 2) indices of the (right, left) lower teeth numbered 1..7 (row n - 1)."""


def side_mean(a: np.ndarray) -> np.ndarray:
    """Mean over the last axis of (..., 2) right/left values (np.mean without its overhead)."""
    return (a[..., 0] + a[..., 1]) / 2


def _second_neighbour_pairs() -> np.ndarray:
    """Teeth two apart along each arch (one crown between them): 17-15, 16-14, ..., 12-21, 11-22, ..."""
    pairs = []
    for right, left in ((1, 2), (4, 3)):
        row = [right * 10 + n for n in range(7, 0, -1)] + [left * 10 + n for n in range(1, 8)]
        pairs += [(TOOTH_INDEX[a], TOOTH_INDEX[b]) for a, b in zip(row, row[2:])]
    return np.array(pairs)


SECOND_NEIGHBOUR_PAIRS: np.ndarray = _second_neighbour_pairs()
"""(24, 2) indices of teeth with one crown between them (12 per arch): when the crown between is
blocked out of the arch (crowding) these two can meet."""
ANTAGONIST_PAIRS: np.ndarray = np.stack(
    [np.stack([UPPER_PAIRS[n], LOWER_PAIRS[n]], axis=-1) for n in range(7)]
)
"""(7, 2, 2) [tooth number - 1, side (right, left), (upper, lower)] indices of opposing crowns."""
