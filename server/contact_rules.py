"""The contact rules beyond neighbouring teeth: crowns one apart and across gaps, the aligner shapes,
and the bite closing through the opposing crowns (incisors and canines against the target's bite,
premolars and molars against the tightest bite their own paths pass through).

:func:`arch_breaches` gives each rule's breach for a batch of trajectories; :mod:`server.scoring`
adds them to the per-stage rules (limits, PDL stress, neighbour collisions) and the overshoot rule.
Distances in mm; poses ``[qw, qx, qy, qz, tx, ty, tz]`` (:mod:`server.dental_constants`).
"""

from __future__ import annotations

import numpy as np

from server.absent_teeth import antagonists_present, gap_pairs, mask_pairs
from server.collisions import (
    ALL_PAIR_CROWNS,
    COLLISION_TOLERANCE_MM,
    SECOND_CROWNS,
    all_pairs_penetration_mm,
    pair_penetration_mm,
    second_neighbour_penetration_mm,
)
from server.occlusion import (
    ANTERIOR_ANTAGONISTS,
    POSTERIOR_ANTAGONISTS,
    occlusal_clearance_mm,
    posterior_clearance_floor_mm,
    posterior_clearance_mm,
)

OCCLUSAL_TOLERANCE_MM: float = COLLISION_TOLERANCE_MM
"""How far an antagonist clearance (:func:`server.occlusion.occlusal_clearance_mm`) may fall below
the smaller of its initial and target values before the bite closes through the opposing crowns."""


def arch_breaches(
    initial: np.ndarray,
    target: np.ndarray,
    width_mm: np.ndarray,
    depth_mm: np.ndarray,
    planned: np.ndarray,
    achieved: np.ndarray,
    second_penetration: np.ndarray | None = None,
    absent: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The contact rules beyond neighbouring teeth, (B,) each (0 for a plan that breaks none).

    * ``second_collision_breach``: crowns one apart (:data:`server.dental_constants.SECOND_NEIGHBOUR_PAIRS`),
      and crowns facing each other across two or more absent teeth (:func:`server.absent_teeth.gap_pairs`),
      of the achieved arch penetrating beyond COLLISION_TOLERANCE_MM, ``sum (pen - tol)+ / tol``.
    * ``aligner_collision_breach``: the same for the aligner shapes (the planned poses), neighbours and
      crowns one apart, on the rows whose aligners differ from the achieved teeth (force decay,
      non-compliance: overcorrected shapes); where they coincide the teeth's own check covers them.
      Interpenetrating tooth sockets cannot be thermoformed into one aligner.
    * ``occlusal_breach``: the bite closing through the opposing crowns: an antagonist clearance
      (:func:`server.occlusion.occlusal_clearance_mm`) of the achieved arch below the smaller of its
      initial and target values by more than OCCLUSAL_TOLERANCE_MM, ``sum (excess) / tol``. Initial
      and target are real bites; a path between them that is tighter than both (a Class II
      retracted before its deep bite is opened) drives the incisors through each other. The aligner
      shapes are not held to it: upper and lower aligners are two shells and the bite rests on
      their plastic, so an overcorrected shape may pass the target bite. The premolars and molars
      are held to the same tolerance below the tightest bite their own paths pass through
      (:func:`server.occlusion.posterior_clearance_floor_mm`): a plan interpolated from initial to
      target never reaches below it, an aligner series driving a tooth off its path into its
      antagonist does.

    Args: (B, 28, 7) initial and target, (B, 28) crown sizes, (B, 25, 28, 7) trajectories;
    ``second_penetration`` (B, 24, 24) the achieved arch's, when at hand (:class:`StageMeasures`);
    ``absent`` (B, 28) bool the absent teeth: their pairs and antagonists are not judged.
    """
    tol = COLLISION_TOLERANCE_MM
    w, d = width_mm[:, None], depth_mm[:, None]
    if second_penetration is None:
        second_penetration = mask_pairs(
            second_neighbour_penetration_mm(achieved[:, 1:], w, d), absent, SECOND_CROWNS
        )
    second = np.sum(np.maximum(second_penetration - tol, 0.0), axis=(-2, -1))
    if absent is not None:  # crowns facing each other across two or more absent teeth
        for b in np.flatnonzero(absent.any(axis=-1)):
            gaps = gap_pairs(absent[b])
            if gaps.shape[1]:
                pen = pair_penetration_mm(achieved[b, 1:], width_mm[b], depth_mm[b], gaps)
                second[b] += np.sum(np.maximum(pen - tol, 0.0))
    aligner = np.zeros(initial.shape[0])
    front, back = occlusal_excess(initial, target, achieved, absent)
    occlusal = np.sum(np.maximum(front, 0.0), axis=(-2, -1)) + np.sum(np.maximum(back, 0.0), axis=(-2, -1))
    if planned is not achieved:
        differs = np.flatnonzero(np.any(planned[:, 1:] != achieved[:, 1:], axis=(1, 2, 3)))
        if differs.size:
            p = planned[differs, 1:]
            pw, pd = w[differs], d[differs]
            pen = all_pairs_penetration_mm(p, pw, pd)
            if absent is not None:
                pen = mask_pairs(pen, absent[differs], ALL_PAIR_CROWNS)
            aligner[differs] = np.sum(np.maximum(pen - tol, 0.0), axis=(-2, -1))
    return {
        "second_collision_breach": second / tol,
        "aligner_collision_breach": aligner / tol,
        "occlusal_breach": occlusal / OCCLUSAL_TOLERANCE_MM,
    }


def occlusal_excess(
    initial: np.ndarray, target: np.ndarray, achieved: np.ndarray, absent: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """How far each antagonist pair's clearance at each aligner falls below its reference by more than
    OCCLUSAL_TOLERANCE_MM (mm; positive is a breach): ``(front, back)``, (B, 24, A) over
    :data:`server.occlusion.ANTERIOR_ANTAGONISTS` (reference: the smaller of the initial and target
    clearances) and (B, 24, P) over :data:`server.occlusion.POSTERIOR_ANTAGONISTS` (reference: the
    tightest bite their own paths pass through). ``initial``/``target`` (B, 28, 7), ``achieved``
    (B, 25, 28, 7); pairs with an absent tooth (``absent`` (B, 28) bool) are 0."""
    clear_ref = np.minimum(occlusal_clearance_mm(initial, target), occlusal_clearance_mm(target, target))
    front = (
        clear_ref[:, None] - OCCLUSAL_TOLERANCE_MM - occlusal_clearance_mm(achieved[:, 1:], target[:, None])
    )
    back = (
        posterior_clearance_floor_mm(initial, target)[:, None]
        - OCCLUSAL_TOLERANCE_MM
        - posterior_clearance_mm(achieved[:, 1:])
    )
    if absent is not None:
        front = np.where(antagonists_present(absent, ANTERIOR_ANTAGONISTS)[:, None], front, 0.0)
        back = np.where(antagonists_present(absent, POSTERIOR_ANTAGONISTS)[:, None], back, 0.0)
    return front, back
