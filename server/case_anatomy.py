"""Case anatomy: is an arrangement of crowns anatomically possible? The geometric checks of an imported
case (:mod:`server.case_records` runs them on a record's initial and target poses, and its crown
sizes): crowns of anatomical size, each quadrant on its own side of its arch's midline, no crown far
from its neighbours or upside down, no crowns interpenetrating (neighbours, second neighbours, crowns
facing each other across absent teeth, antagonists), the upper arch above the lower one, and the
target a bite (posterior cusps meeting, incisor and canine bites not too tight).

Poses are (28, 7) ``[qw, qx, qy, qz, tx, ty, tz]`` in :data:`server.dental_constants.TOOTH_IDS` order
(the patient frame: x to the patient's left, y anterior, z occlusal-up; mm), crown sizes (28,) mm,
``absent`` a (28,) mask of the teeth the patient does not have (their placeholders are not judged).
The ``*_problems`` checks return ``(tooth, message)`` pairs (the FDI tooth, None for several; what
to fix) and :func:`crown_collisions` the interpenetrating pairs, which the record's check reports as
its problems. Each bound's sources are kept with it. Pure numpy.
"""

from __future__ import annotations

import itertools

import numpy as np

from server.absent_teeth import ARCH_ROWS, gap_pairs, mask_pairs
from server.collisions import (
    ALL_PAIR_CROWNS,
    COLLISION_TOLERANCE_MM,
    all_pairs_penetration_mm,
    pair_penetration_mm,
)
from server.dental_constants import (
    ADJACENT_PAIRS,
    ANTAGONIST_PAIRS,
    CROWN_DEPTH_MM,
    CROWN_WIDTH_MM,
    IDEAL_OVERBITE_MM,
    IDEAL_OVERJET_MM,
    IS_UPPER,
    LOWER_PAIRS,
    N_TEETH,
    QUADRANT,
    SECOND_NEIGHBOUR_PAIRS,
    SIDE,
    TOOTH_CLASS,
    TOOTH_CLASSES,
    TOOTH_IDS,
    TOOTH_NUMBER,
    UPPER_PAIRS,
)
from server.occlusion import (
    ANTERIOR_ANTAGONISTS,
    POSTERIOR_ANTAGONISTS,
    occlusal_clearance_mm,
    posterior_clearance_mm,
)
from server.quaternion_utils import quaternion_axis

_IN_CLASS = np.arange(len(TOOTH_CLASSES))[:, None] == TOOTH_CLASS  # (4, 28)
_CLASS_SMALLEST_WIDTH = np.where(_IN_CLASS, CROWN_WIDTH_MM, np.inf).min(axis=1)
_CLASS_SMALLEST_DEPTH = np.where(_IN_CLASS, CROWN_DEPTH_MM, np.inf).min(axis=1)
MIN_CROWN_WIDTH_MM: np.ndarray = 0.6 * _CLASS_SMALLEST_WIDTH[TOOTH_CLASS]
"""(28,) the smallest mesiodistal crown width (mm) a tooth may have: 60 % of the smallest mean width
of its class (Wheeler's Dental Anatomy, :data:`server.dental_constants.CROWN_WIDTH_MM`): incisors
3.0 mm (the lower central incisor, the smallest crown, is 5.0 mm), canines and premolars 4.2 mm
(7.0 mm), molars 5.4 mm (the upper second molar, 9.0 mm). Tooth-size studies give standard deviations
of 0.3-0.7 mm for these widths (Bishara et al. 1989, AJO-DO, three populations), so each floor
lies five or more SDs below its class, under a peg-shaped upper lateral incisor (the commonest
microdont) too. Smaller crowns are a segmentation or a units error, and they turn the collision rules
off: crowns of 1 x 1 mm never touch."""
MIN_CROWN_DEPTH_MM: np.ndarray = 0.5 * _CLASS_SMALLEST_DEPTH[TOOTH_CLASS]
"""(28,) the smallest buccolingual crown depth (mm) a tooth may have: half the smallest of its class in
the model (:data:`server.dental_constants.CROWN_DEPTH_MM`: Wheeler's diameters, the incisal third for
incisors and canines): incisors 1.5 mm, canines 2.5 mm, premolars 3.5 mm, molars 4.5 mm."""
MIN_TARGET_INCISOR_CLEARANCE_MM: float = IDEAL_OVERJET_MM[0] - (IDEAL_OVERBITE_MM[1] + 1.0)
"""The tightest incisor bite a target may have (-2 mm), as :func:`server.occlusion.occlusal_clearance_mm`
measures it (each mm of overbite takes a mm of overjet): the bottom of the ideal overjet (2 mm, ABO)
with a 4 mm overbite, 1 mm past the ideal band, where a deep bite starts (Proffit; grade 1 of
``deep_bite`` in :mod:`server.diagnosis`). A tighter target puts the lower incisal edges inside the
upper crowns, and the occlusal rule, which takes the target's bite as a reference, would then let a
plan drive them there. Generated targets' incisors measure +0.1 mm at the tightest, a real jaw's
incisors -1.2 mm (``tests/test_real_jaw.py``). Canines are not judged: the model's cusp tips read -1.9
and -4.3 mm on that real jaw's canines. Nor is the initial bite: in a deep bite the lower incisors
rest behind the upper ones' cingulum, which this model reads as the same overlap (generated task_hard
initial arches reach -5.9 mm)."""
POSTERIOR_INTERDIGITATION_MM: float = 2.0
"""How far (mm) a lower premolar's or molar's cusp tip may rise above its antagonist's where the two
crowns overlap in the occlusal plane: the cusps interdigitate by about their height, some 2 mm (the
lower buccal cusps seat in the upper central fossae; Andrews 1972, key I). Beyond it the crowns pass
through each other. Generated arches measure at most 0.3 mm, a real jaw 0.6 mm in the model's cusp
points (``tests/test_real_jaw.py``)."""
ANTAGONISTS = ANTAGONIST_PAIRS.reshape(-1, 2)
"""(14, 2) (upper, lower) indices of the opposing crowns, teeth 1..7, right then left."""
MAX_NEIGHBOUR_GAP_MM: float = 8.0
"""How far (mm) a crown's centroid may lie beyond the contact distance from its nearest present neighbour
along the arch: their half widths plus the widths of the absent teeth between them (the space those
teeth held). A diastema or residual extraction space is a few mm (a midline diastema over 2 mm is
already large; Proffit); 8 mm would hold a whole premolar (about 7 mm, Wheeler), so a crown that far
from both its neighbours is a misplaced crown or a tooth missing from ``absent``. Generated arches
measure at most 1.5 mm beyond contact, a real jaw 0.7 mm (``tests/test_real_jaw.py``)."""
MAX_CROWN_TILT_DEG: float = 90.0
"""How far (deg) a crown's local z (its long axis, occlusal-up in the pose convention of
:mod:`server.dental_constants`, for both arches) may lean from the patient's z. Tip and torque lean a
crown by tens of degrees at most;
beyond 90 deg its occlusal end faces away from the other arch: a crown upside down or a quaternion in
another convention. Generated crowns lean at most 35 deg, a real jaw's 33 deg."""
MAX_TARGET_POSTERIOR_GAP_MM: float = 5.0
"""The widest vertical gap (mm) a target may leave between an upper premolar's or molar's cusp tip and
its antagonist's (:func:`server.occlusion.posterior_clearance_mm`): a target is a bite, its posterior
cusps meeting on the occlusal plane (Andrews 1972, key I: 0 mm in every generated target). Even the
mandible's rest position leaves only the 2-4 mm freeway space (Proffit); a wider gap is arches not in
occlusion (an arch displaced vertically, or a scan taken open). A real jaw at rest reads 1.5 mm."""
MIN_TARGET_CANINE_CLEARANCE_MM: float = -6.0
"""The tightest canine bite a target may have (mm, :func:`server.occlusion.occlusal_clearance_mm`), looser
than the incisors' :data:`MIN_TARGET_INCISOR_CLEARANCE_MM`: the model's 45-degree lingual contour fits
an incisor, not a canine, whose cusp overlaps its antagonist's long lingual ridge more deeply (canine
guidance), so a sound bite reads negative: a real jaw's canines -1.9 and -4.3 mm (``tests/test_real_jaw.py``),
generated targets' -0.8 mm at the tightest. -6 mm leaves 1.7 mm (40 %) below that real jaw and still
refuses a lower cusp tip driven into the upper crown. As for the incisors, the initial bite is not
judged (a deep bite reads the same overlap)."""
_POSTERIOR = TOOTH_NUMBER[ANTAGONISTS[:, 0]] >= 4
_INCISOR = TOOTH_NUMBER[ANTAGONISTS[:, 0]] <= 2
_CANINE = TOOTH_NUMBER[ANTAGONISTS[:, 0]] == 3
_INCISOR_ANTAGONISTS = ANTERIOR_ANTAGONISTS[:4]
"""The central and lateral incisors' pairs, the first four of :func:`server.occlusion.occlusal_clearance_mm`."""
_CANINE_ANTAGONISTS = ANTERIOR_ANTAGONISTS[4:]
"""The canines' pairs, the last two of :func:`server.occlusion.occlusal_clearance_mm`."""
_ARCH_PAIRS = (UPPER_PAIRS, LOWER_PAIRS)
_QUADRANT_NAMES = {1: ("upper", "right"), 2: ("upper", "left"), 3: ("lower", "left"), 4: ("lower", "right")}
PAIRS = np.concatenate((ADJACENT_PAIRS, SECOND_NEIGHBOUR_PAIRS))
"""The 26 contacts then the 24 second neighbours (:func:`server.collisions.all_pairs_penetration_mm`)."""


def crown_collisions(
    poses: np.ndarray, width: np.ndarray, depth: np.ndarray, absent: np.ndarray | None
) -> list[tuple[int, int, float]]:
    """``(tooth, tooth, mm)``: the pairs of present crowns (FDI ids; neighbours, second neighbours,
    crowns facing each other across absent teeth) of ``poses`` (28, 7) with crown sizes (28,) mm that
    interpenetrate beyond :data:`server.collisions.COLLISION_TOLERANCE_MM`, and by how much."""
    pen = all_pairs_penetration_mm(poses, width, depth)
    pairs = PAIRS
    if absent is not None:
        pen = mask_pairs(pen[None], absent[None], ALL_PAIR_CROWNS)[0]
        gaps = gap_pairs(absent)
        pen = np.concatenate((pen, pair_penetration_mm(poses, width, depth, gaps)))
        pairs = np.concatenate((PAIRS, gaps.T))
    return [
        (int(TOOTH_IDS[pairs[k, 0]]), int(TOOTH_IDS[pairs[k, 1]]), float(pen[k]))
        for k in np.flatnonzero(pen > COLLISION_TOLERANCE_MM)
    ]


def _midlines(poses: np.ndarray, absent: np.ndarray) -> np.ndarray:
    """(2,) the x (mm) of the upper and the lower arch's midline in ``poses`` (28, 7): halfway between
    the most mesial pair of contralateral teeth both present (the central incisors in a full arch), so
    a missing tooth on one side does not shift it; the arch's mean x when no pair is."""
    out = np.empty(2)
    for a, (pairs, row) in enumerate(zip(_ARCH_PAIRS, ARCH_ROWS)):
        both = np.flatnonzero(~absent[pairs].any(axis=1))
        teeth = pairs[both[0]] if len(both) else [k for k in row if not absent[k]]
        out[a] = poses[teeth, 4].mean()
    return out


def layout_problems(
    initial: np.ndarray, target: np.ndarray, absent: np.ndarray | None
) -> list[tuple[int | None, str]]:
    """``(tooth, message)`` for crowns out of place in the initial or the target arrangement ((28, 7)
    poses each), where the collision and bite measures would mean nothing:

    * a quadrant's crowns on the wrong side of their arch's midline (:func:`_midlines`): x is the
      patient's left, quadrants 1 and 4 the patient's right (:mod:`server.dental_constants`); each
      crown's centroid on its own side, which a real jaw's central incisors keep by half their
      width (2.3 mm in ``tests/test_real_jaw.py``, 2.1 mm in generated arches);
    * a crown leaning more than :data:`MAX_CROWN_TILT_DEG` from occlusal-up.

    Absent teeth (their placeholders) are not judged."""
    gone = np.zeros(N_TEETH, dtype=bool) if absent is None else absent
    out: list[tuple[int | None, str]] = []
    for name, poses in (("initial", initial), ("target", target)):
        mid = _midlines(poses, gone)[np.where(IS_UPPER, 0, 1)]
        wrong = ((poses[:, 4] - mid) * SIDE <= 0.0) & ~gone
        for quadrant in np.unique(QUADRANT[wrong]):
            teeth = [int(t) for t in np.array(TOOTH_IDS)[wrong & np.equal(QUADRANT, quadrant)]]
            arch, side = _QUADRANT_NAMES[int(quadrant)]
            out.append((teeth[0] if len(teeth) == 1 else None,
                        f"the {name} crowns {', '.join(map(str, teeth))} of quadrant {quadrant} (the {arch} {side}) "
                        f"lie on the patient's {'left' if side == 'right' else 'right'} of the {arch} midline (x "
                        f"points to the patient's left; FDI quadrants 1 and 4 are the patient's right): are x "
                        f"mirrored or the quadrants' teeth swapped?"))  # fmt: skip
        tilt = np.degrees(np.arccos(np.clip(quaternion_axis(poses[:, :4], 2)[:, 2], -1.0, 1.0)))
        for k in np.flatnonzero((tilt > MAX_CROWN_TILT_DEG) & ~gone):
            out.append((int(TOOTH_IDS[k]), f"the {name} crown's long axis (local z) leans {tilt[k]:.0f} deg from "
                        f"occlusal-up (at most {MAX_CROWN_TILT_DEG:.0f} deg: local z points occlusal-up in both "
                        f"arches): is the crown upside down, or its quaternion in another convention?"))  # fmt: skip
    return out


def gap_problems(
    initial: np.ndarray, target: np.ndarray, width: np.ndarray, absent: np.ndarray | None
) -> list[tuple[int, str]]:
    """``(tooth, message)`` for each present crown of the initial or the target arrangement ((28, 7)
    poses each, (28,) crown widths mm) more than :data:`MAX_NEIGHBOUR_GAP_MM` beyond contact with its
    nearest present neighbour along the arch, the absent teeth between them allowed their widths."""
    gone = np.zeros(N_TEETH, dtype=bool) if absent is None else absent
    out: list[tuple[int, str]] = []
    for name, poses in (("initial", initial), ("target", target)):
        excess = np.full(N_TEETH, -np.inf)
        for row in ARCH_ROWS:
            here = [i for i, k in enumerate(row) if not gone[k]]
            for i, j in itertools.pairwise(here):
                a, b = row[i], row[j]
                reach = 0.5 * (width[a] + width[b]) + sum(width[row[m]] for m in range(i + 1, j))
                gap = float(np.linalg.norm(poses[a, 4:] - poses[b, 4:])) - reach
                for k in (a, b):
                    excess[k] = gap if excess[k] == -np.inf else min(excess[k], gap)
        for k in np.flatnonzero(excess > MAX_NEIGHBOUR_GAP_MM):
            out.append((int(TOOTH_IDS[k]), f"the {name} crown lies {excess[k]:.1f} mm beyond contact with its nearest "
                        f"present neighbour along the arch (at most {MAX_NEIGHBOUR_GAP_MM:.0f} mm; absent teeth's "
                        f"spaces allowed): check its position, or list the teeth missing beside it in absent"))  # fmt: skip
    return out


def bite_problems(
    initial: np.ndarray, target: np.ndarray, width: np.ndarray, depth: np.ndarray, absent: np.ndarray | None
) -> list[tuple[int | None, str]]:
    """``(tooth, message)`` for what is wrong between the upper and the lower arch of the initial and
    the target arrangement ((28, 7) poses each, (28,) crown sizes mm), both measured at once:

    * the arches in the wrong vertical order: an upper crown's centroid not above its antagonist's
      (z is occlusal-up, :mod:`server.dental_constants`); then nothing else of that arrangement is judged;
    * a lower premolar's or molar's cusp tip more than :data:`POSTERIOR_INTERDIGITATION_MM` above its
      antagonist's (:func:`server.occlusion.posterior_clearance_mm`) where the two crowns overlap in
      the occlusal plane (the ellipses of :mod:`server.collisions`);
    * the target only: a premolar or molar pair's cusp tips more than :data:`MAX_TARGET_POSTERIOR_GAP_MM`
      apart vertically (no bite), a canine bite tighter than :data:`MIN_TARGET_CANINE_CLEARANCE_MM`
      and an incisor bite tighter than :data:`MIN_TARGET_INCISOR_CLEARANCE_MM`.

    Pairs with an absent crown are not judged."""
    both = np.stack((initial, target))  # (2, 28, 7)
    ok = np.ones(len(ANTAGONISTS), dtype=bool) if absent is None else ~absent[ANTAGONISTS].any(axis=1)
    upper, lower = ANTAGONISTS[ok].T
    below = both[:, upper, 6] <= both[:, lower, 6]  # (2, P)
    post = POSTERIOR_ANTAGONISTS[ok[_POSTERIOR]]
    rise = -posterior_clearance_mm(both)[:, ok[_POSTERIOR]]  # (2, Q) the lower cusp above the upper
    pressed = (rise > POSTERIOR_INTERDIGITATION_MM) & (pair_penetration_mm(both, width, depth, post.T) > 0.0)
    front = _INCISOR_ANTAGONISTS[ok[_INCISOR]]
    anterior = occlusal_clearance_mm(target, target)
    clearance = anterior[: len(_INCISOR_ANTAGONISTS)][ok[_INCISOR]]
    canines = _CANINE_ANTAGONISTS[ok[_CANINE]]
    canine_clearance = anterior[len(_INCISOR_ANTAGONISTS) :][ok[_CANINE]]
    open_gap = -rise[1]  # the target's posterior clearance
    out: list[tuple[int | None, str]] = []
    for k, name in enumerate(("initial", "target")):
        if below[k].any():
            pairs = [(int(TOOTH_IDS[upper[i]]), int(TOOTH_IDS[lower[i]])) for i in np.flatnonzero(below[k])]
            named = ", ".join(f"{u}/{lo}" for u, lo in pairs)
            out.append((pairs[0][0] if len(pairs) == 1 else None,
                        f"the {name} upper crowns lie below their lower antagonists ({named}, upper/lower; z is "
                        f"occlusal-up, upper crowns above the occlusal plane): are the arches swapped or z reversed?"))  # fmt: skip
            continue
        for i in np.flatnonzero(pressed[k]):
            u, lo = TOOTH_IDS[post[i, 0]], TOOTH_IDS[post[i, 1]]
            out.append((int(u), f"the {name} cusp tip of {lo} rises {rise[k, i]:.2f} mm above its antagonist "
                        f"{u}'s (at most {POSTERIOR_INTERDIGITATION_MM} mm: cusps interdigitate, crowns do not "
                        f"pass through each other): check the crowns' vertical positions (z)"))  # fmt: skip
        if name == "target":
            apart = np.flatnonzero(open_gap > MAX_TARGET_POSTERIOR_GAP_MM)
            if len(apart):
                pairs = [(int(TOOTH_IDS[post[i, 0]]), int(TOOTH_IDS[post[i, 1]])) for i in apart]
                named = ", ".join(f"{u}/{lo} {open_gap[i]:.1f} mm" for (u, lo), i in zip(pairs, apart))
                out.append((pairs[0][0] if len(pairs) == 1 else None,
                            f"the target's posterior cusps do not meet: {named} apart vertically (upper/lower, at "
                            f"most {MAX_TARGET_POSTERIOR_GAP_MM:.0f} mm: a setup is a bite): bring the arches into "
                            f"occlusion (check z of the upper and the lower arch)"))  # fmt: skip
            for i in np.flatnonzero(canine_clearance < MIN_TARGET_CANINE_CLEARANCE_MM):
                u, lo = TOOTH_IDS[canines[i, 0]], TOOTH_IDS[canines[i, 1]]
                out.append((int(u), f"the target puts the cusp tip of {lo} inside its antagonist {u} (bite clearance "
                            f"{canine_clearance[i]:.2f} mm, at least {MIN_TARGET_CANINE_CLEARANCE_MM:.1f} mm for "
                            f"canines): fix the target's canine positions"))  # fmt: skip
            for i in np.flatnonzero(clearance < MIN_TARGET_INCISOR_CLEARANCE_MM):
                u, lo = TOOTH_IDS[front[i, 0]], TOOTH_IDS[front[i, 1]]
                out.append((int(u), f"the target puts the incisal edge of {lo} inside its antagonist {u} (bite "
                            f"clearance {clearance[i]:.2f} mm, at least {MIN_TARGET_INCISOR_CLEARANCE_MM:.1f} mm: a 2 mm "
                            f"overjet with a 4 mm overbite): the setup's bite is the occlusal rule's reference; fix "
                            f"the target's incisor positions"))  # fmt: skip
    return out
