"""Staging in arrays: a strategy's sequence as per-tooth start aligners and speeds, and as plan JSON.

The oracle's arithmetic (:mod:`server.oracle` searches and repairs over it): each level of the
strategy's sequence gets a start aligner, spread evenly over :data:`LEVEL_SPAN` aligners; the first
level moves briskly, later ones at the slowest constant speed that finishes in time; speeds are
shares of a tooth's whole movement per aligner (a plan's ``fraction``), capped at
:data:`MAX_SPEED` of the per-stage limits. Shapes: (28,) arrays in ``TOOTH_IDS`` order.
"""

from __future__ import annotations

import numpy as np

from server.absent_teeth import mask_pairs
from server.clinical_profiles import SEQUENCED_TEETH, STRATEGY_LEVELS
from server.collisions import ALL_PAIR_CROWNS, COLLISION_TOLERANCE_MM, all_pairs_penetration_mm
from server.dental_constants import (
    MAX_ROTATION_DEG,
    MAX_TRANSLATION_MM,
    N_STAGES,
    PRIORITY_START_STAGE,
    TOOTH_IDS,
)
from server.plans import MAX_OVERCORRECTION, interpolate_poses
from server.quaternion_utils import (
    quaternion_angle,
)

LEVEL_SPAN: int = 12
"""Aligners over which the strategy's levels' start stages are spread (first at 1)."""

BRISK: float = 0.8
"""Speed of the first level, as a share of the per-stage limits."""

MAX_SPEED: float = 0.95
"""Fastest speed the oracle plans, as a share of the per-stage limits."""

Staging = tuple[np.ndarray, np.ndarray, np.ndarray]
"""Per-tooth start stages (28,) int, fractions (28,) and overcorrections (28,): a plan in arrays."""

FRACTION_QUANTUM: float = 1e-4
"""Fractions are written rounded up to this (what the plan JSON carries)."""

OC_QUANTUM: float = 0.05
"""Overcorrections are written rounded down to this (the oracle's); :func:`overcorrection_room` checks
the aligner shapes at its multiples."""


def limit_speeds(initial: np.ndarray, target: np.ndarray) -> np.ndarray:
    """(28,) fraction per stage that moves each tooth at exactly the per-stage limits."""
    t = np.linalg.norm(target[:, 4:] - initial[:, 4:], axis=-1)
    r = np.degrees(quaternion_angle(initial[:, :4], target[:, :4]))
    stages_at_limit = np.maximum(t / MAX_TRANSLATION_MM, r / MAX_ROTATION_DEG)
    return np.where(stages_at_limit > 1e-9, 1.0 / np.maximum(stages_at_limit, 1e-9), 1.0)


def overcorrection_room(
    initial: np.ndarray,
    target: np.ndarray,
    width_mm: np.ndarray,
    depth_mm: np.ndarray,
    absent: np.ndarray | None = None,
) -> np.ndarray:
    """(28,) the largest overcorrection, in steps of OC_QUANTUM up to MAX_OVERCORRECTION, at which
    each tooth's aligner shape clears its neighbours and the crowns one apart (penetration within
    COLLISION_TOLERANCE_MM) when every tooth is overcorrected alike: the final aligner's shape, each
    tooth at ``1 + oc`` of its movement (:func:`server.plans.interpolate_poses`). A technician sees
    this on the overcorrected setup. It needs no plan; the oracle's collision relief
    (:func:`server.setup_refinement.relieve_aligner_collisions`) instead trims a given plan's overcorrection on
    the simulator, and mostly ends within it (its neighbours are not always overcorrected alike).

    initial, target: (28, 7) poses; width_mm, depth_mm: (28,) crown sizes; ``absent`` (28,) bool:
    an absent crown's pairs are not judged. A tooth already colliding at its target gets 0.
    """
    levels = np.arange(round(MAX_OVERCORRECTION / OC_QUANTUM) + 1) * OC_QUANTUM  # (L,)
    progress = np.broadcast_to(1.0 + levels[:, None], (levels.size, len(TOOTH_IDS)))
    poses = interpolate_poses(initial, target, progress)  # (L, 28, 7)
    pen = all_pairs_penetration_mm(poses, width_mm, depth_mm)  # (L, 50)
    if absent is not None:
        pen = mask_pairs(pen[None], np.asarray(absent, dtype=bool)[None], ALL_PAIR_CROWNS)[0]
    hit = pen > COLLISION_TOLERANCE_MM  # (L, 50)
    tooth_hit = np.zeros((levels.size, len(TOOTH_IDS)), dtype=bool)
    for side in ALL_PAIR_CROWNS:  # each pair's collision counts against both its crowns
        np.logical_or.at(tooth_hit, (slice(None), side), hit)
    first = np.where(tooth_hit.any(axis=0), tooth_hit.argmax(axis=0), levels.size)  # first colliding level
    return levels[np.maximum(first - 1, 0)] * (first > 0)


def quantise_fractions(fraction: np.ndarray) -> np.ndarray:
    """Fractions rounded up to :data:`FRACTION_QUANTUM` (never slower than asked), at most 1."""
    return np.minimum(np.ceil(np.asarray(fraction) / FRACTION_QUANTUM - 1e-9) * FRACTION_QUANTUM, 1.0)


def level_starts(n_levels: int, span: int = LEVEL_SPAN) -> np.ndarray:
    """Start aligner of each of ``n_levels`` sequence levels: evenly from 1 to ``1 + span``."""
    if n_levels <= 1:
        return np.ones(1, dtype=np.int64)
    return 1 + np.round(np.arange(n_levels) * span / (n_levels - 1)).astype(np.int64)


def _fit_speed(start: np.ndarray, last_stage: int, limit_fraction: np.ndarray, slot: np.ndarray) -> tuple:
    """Per-tooth (start, fraction): the slowest speed finishing by ``last_stage``; the first slot brisk."""
    start = start.copy()
    need_slow = 1.0 / np.maximum(last_stage - start + 1, 1)
    fraction = np.where(
        slot == 0,
        np.maximum(
            np.minimum(np.maximum(BRISK * limit_fraction, need_slow), MAX_SPEED * limit_fraction), 0.0
        ),
        need_slow,
    )
    fraction = np.maximum(fraction, 1.0 / (N_STAGES - start + 1))
    # a tooth that cannot finish from its slot within the limits starts as early as it must
    cap = MAX_SPEED * limit_fraction
    late = fraction > cap
    if late.any():
        stages_needed = np.ceil(1.0 / cap[late])
        start[late] = np.maximum(1, np.minimum(start[late], last_stage - stages_needed + 1)).astype(np.int64)
        fraction[late] = np.maximum(1.0 / (last_stage - start[late] + 1), 1.0 / (N_STAGES - start[late] + 1))
        # still too fast to finish by last_stage: use the refinement aligners rather than break the limits
        fraction[late] = np.maximum(np.minimum(fraction[late], cap[late]), 1.0 / (N_STAGES - start[late] + 1))
    return start, quantise_fractions(fraction)


def stage_arrays(
    initial: np.ndarray,
    target: np.ndarray,
    strategy: str,
    last_stage: int,
    brisk: bool = True,
    span: int = LEVEL_SPAN,
    lead_levels: np.ndarray | None = None,
    all_brisk: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-tooth start stages (28,) and fractions (28,) staging the teeth in ``strategy``'s order.

    ``lead_levels``: (28,) bool, teeth that also start with the first level (a second profile's
    first movers); ``brisk=False`` moves the first level at the slowest speed too; ``all_brisk``
    moves every level briskly (a long correction that leaves little slack to stagger).
    """
    limit_fraction = limit_speeds(initial, target)
    levels = STRATEGY_LEVELS[strategy]
    sequenced = SEQUENCED_TEETH[strategy]
    ranks = np.searchsorted(np.unique(levels[sequenced]), levels)
    if lead_levels is not None:
        ranks = np.where(lead_levels, 0, ranks)
    starts = level_starts(int(ranks[sequenced].max()) + 1, span)
    slot = np.zeros_like(ranks) if all_brisk else (ranks if brisk else ranks + 1)
    start = np.where(sequenced, starts[np.minimum(ranks, len(starts) - 1)], 1)
    slot = np.where(sequenced, slot, 1)  # the teeth outside the sequence move together, unhurried
    return _fit_speed(start, last_stage, limit_fraction, slot)


def arrays_to_plan(
    strategy: str | None,
    start: np.ndarray,
    fraction: np.ndarray,
    overcorrection: np.ndarray | None = None,
    absent: np.ndarray | None = None,
) -> dict:
    """The plan JSON of per-tooth start stages, fractions and overcorrections (teeth grouped by all
    three), leaving out the ``absent`` (28,) bool teeth."""
    by_stage = {v: k for k, v in PRIORITY_START_STAGE.items()}
    oc = np.zeros(len(TOOTH_IDS)) if overcorrection is None else overcorrection
    groups: dict[tuple[int, float, float], list[int]] = {}
    for i, fdi in enumerate(TOOTH_IDS):
        if absent is not None and absent[i]:
            continue
        groups.setdefault((int(start[i]), float(fraction[i]), float(oc[i])), []).append(fdi)
    out = []
    for (s, f, o), teeth in sorted(groups.items()):
        group = {"teeth": teeth, "fraction": round(f, 6)}
        if s in by_stage:
            group["priority"] = by_stage[s]
        else:
            group["start_stage"] = s
        if o > 0.0:
            group["overcorrection"] = round(o, 2)
        out.append(group)
    plan = {"tooth_groups": out}
    return {"strategy": strategy, **plan} if strategy else plan


def stage_plan(
    initial: np.ndarray,
    target: np.ndarray,
    strategy: str,
    last_stage: int,
    brisk: bool = True,
    span: int = LEVEL_SPAN,
) -> dict:
    """A plan staging the teeth in ``strategy``'s order, each tooth done by ``last_stage``."""
    return arrays_to_plan(strategy, *stage_arrays(initial, target, strategy, last_stage, brisk, span))
