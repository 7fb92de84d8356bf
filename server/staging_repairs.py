"""The staging engine's repairs (:mod:`server.staging_engine`): a plan's per-tooth arrays while it is
repaired, and each repair that changes them, least change first.

* the *safe speed* of each tooth (:func:`safe_speeds`) and the analytic repair to it, with the
  overcorrection trimmed to the overshoot tolerance (:func:`analytic_repair`, no simulation);
* the overcorrection relief where the aligner shapes collide (:func:`relieve`, geometry only);
* the per-tooth alternatives tried on the simulator for the teeth in a breach (:func:`alternatives`);
* the fallbacks (:func:`fallbacks`): uniform staging, slowed, no movement.

Which of them runs, and when, is the engine's (:func:`server.staging_engine.execute_plans`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from server.absent_teeth import batch_absent, mask_pairs
from server.cases import Case
from server.collisions import (
    ALL_PAIR_CROWNS,
    COLLISION_TOLERANCE_MM,
    all_pairs_penetration_mm,
    pair_penetration_mm,
)
from server.dental_constants import (
    ADJACENT_PAIRS,
    ALIGNER_FORCE_N_PER_DEG,
    ALIGNER_FORCE_N_PER_MM,
    LIMIT_TOLERANCE,
    N_STAGES,
    N_TEETH,
    PDL_CRITICAL_KPA,
    ROOT_AREA_MM2,
)
from server.dynamics import SEAT_FACTOR
from server.plans import UNIFORM_FRACTION, PlanSpec, interpolate_poses, planned_progress
from server.scoring import OVERSHOOT_TOLERANCE_MM, OVERSHOOT_TOLERANCE_SHARE, movement_mm
from server.staging import OC_QUANTUM, limit_speeds
from server.treatment import BATCH_CHUNK

PDL_SHARE: float = 0.98
"""Share of the critical PDL stress the safe speed keeps a tooth under, engaged steps included."""
OVERSHOOT_SHARE: float = 0.9
"""Share of the overshoot tolerance an overcorrection trimmed for overshoot keeps (ideal dynamics)."""
RELIEF_KEEP: float = 0.75
"""Share of its overcorrection a tooth whose aligner shape collides keeps, per round of relief."""
RELIEF_ROUNDS: int = 8
"""Rounds of overcorrection relief at most (:func:`relieve`)."""
RETIME_STAGES: int = 3
"""Aligners by which a re-timed tooth starts later, at most."""
FALLBACK_SLOWER: tuple[float, ...] = (0.75, 0.5)
"""Shares of uniform staging's speed the fallback tries after uniform staging itself."""


# --- per-tooth arithmetic ------------------------------------------------------------------------


def safe_speeds(case: Case, overcorrection: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(28,) each tooth's largest fraction within the per-stage limits, and within PDL_SHARE of the
    critical PDL stress, of a case, for overcorrections ``overcorrection`` (28,) (the overcorrected
    steps count).

    A planned step of fraction ``f`` moves a tooth ``f (1 + oc)`` of its translation and its rotation;
    the aligner engages at most SEAT_FACTOR such steps on a lagging tooth (force decay, non-compliance;
    one under ideal dynamics), so its stress is at most that many times the step's
    (:func:`server.scoring.pdl_stress_kpa`). A tooth with nothing to do gets 1.
    """
    scale = 1.0 + overcorrection
    limit = limit_speeds(case.initial, case.target) / scale
    t, r = case.need
    stress_per_step = 1000.0 * (ALIGNER_FORCE_N_PER_MM * t + ALIGNER_FORCE_N_PER_DEG * r) / ROOT_AREA_MM2
    seat = SEAT_FACTOR if case.force_decay or case.non_compliance else 1.0
    pdl = np.where(
        stress_per_step > 1e-12,
        PDL_SHARE * PDL_CRITICAL_KPA / np.maximum(seat * stress_per_step * scale, 1e-12),
        1.0,
    )
    return np.minimum(limit, 1.0), np.minimum(pdl, 1.0)


def final_progress(start: np.ndarray, fraction: np.ndarray, overcorrection: np.ndarray) -> np.ndarray:
    """(..., 28) planned share of each tooth's movement at the last aligner (above 1: overcorrected)."""
    return planned_progress(start, fraction, overcorrection)[..., -1, :]


def _finish_start(start: np.ndarray, fraction: np.ndarray) -> np.ndarray:
    """Start stages moved earlier, only as much as a tooth at ``fraction`` needs to finish by the
    last aligner (never before aligner 1)."""
    stages = np.ceil(1.0 / np.maximum(fraction, 1e-12) - 1e-9)
    latest = np.clip(N_STAGES + 1 - stages, 1, N_STAGES).astype(np.int64)
    return np.where(fraction > 0.0, np.minimum(start, latest), start)


# --- plans as arrays -----------------------------------------------------------------------------


@dataclass
class Staging:
    """One plan's per-tooth arrays while it is repaired."""

    start: np.ndarray
    fraction: np.ndarray
    oc: np.ndarray
    how: dict[tuple[int, str], str] = field(default_factory=dict)
    """(tooth index, field) -> the repair that last changed it."""

    @classmethod
    def of(cls, spec: PlanSpec) -> Staging:
        return cls(
            spec.start.copy(), spec.fraction.astype(np.float64), spec.overcorrections().astype(np.float64)
        )

    def copy(self) -> Staging:
        return Staging(self.start.copy(), self.fraction.copy(), self.oc.copy(), dict(self.how))

    def set(self, field_: str, teeth: np.ndarray, values: np.ndarray, repair: str) -> None:
        arr = {"start": self.start, "fraction": self.fraction, "oc": self.oc}[field_]
        teeth = np.asarray(teeth, dtype=np.int64)
        values = np.broadcast_to(values, teeth.shape)
        for i, v in zip(teeth.tolist(), values.tolist()):
            if arr[i] != v:
                arr[i] = v
                self.how[(i, field_)] = repair

    def spec(self, raw: PlanSpec) -> PlanSpec:
        """The PlanSpec of these arrays, with the raw plan's strategy, format and groups."""
        return PlanSpec(
            self.start.copy(),
            self.fraction.copy(),
            raw.strategy,
            raw.format,
            self.oc.copy() if self.oc.any() else None,
            None if raw.group is None else raw.group.copy(),
        )


def uniform_staging(raw: PlanSpec, case: Case, k: float = 1.0) -> Staging:
    """Uniform staging at ``k`` times its speed (the case's absent teeth as the raw plan has them)."""
    s = Staging(np.ones(N_TEETH, dtype=np.int64), np.full(N_TEETH, UNIFORM_FRACTION * k), np.zeros(N_TEETH))
    if case.absent is not None:
        s.start[case.absent] = raw.start[case.absent]
        s.fraction[case.absent] = raw.fraction[case.absent]
        s.oc[case.absent] = raw.overcorrections()[case.absent]
    return s


# --- the repairs ---------------------------------------------------------------------------------


def analytic_repair(spec: PlanSpec, case: Case, broken: list[str]) -> Staging:
    """Repair 1 (see the module docstring): speeds within the limits and the PDL bound, the
    overcorrection within the overshoot tolerance under ideal dynamics; no simulation (the aligner
    shapes' relief, :func:`relieve`, follows in one batch)."""
    s = Staging.of(spec)
    if "overshoot" in broken and not (case.force_decay or case.non_compliance):
        # ideal dynamics express the overcorrection whole: over = oc * need
        need = movement_mm(case.initial, case.target)
        allowed = OVERSHOOT_SHARE * np.maximum(
            OVERSHOOT_TOLERANCE_SHARE, OVERSHOOT_TOLERANCE_MM / np.maximum(need, 1e-9)
        )
        progress = final_progress(s.start, s.fraction, s.oc)
        over = np.maximum(progress - 1.0, 0.0)
        teeth = np.flatnonzero(over > allowed + 1e-12)
        # a tooth that reaches its target overshoots by its whole overcorrection
        s.set(
            "oc",
            teeth,
            np.floor(np.minimum(s.oc[teeth], allowed[teeth]) / OC_QUANTUM) * OC_QUANTUM,
            "overcorrection",
        )
    limit, pdl = safe_speeds(case, s.oc)
    slow = np.zeros(N_TEETH, dtype=bool)
    if "limits" in broken:
        slow |= s.fraction > (1.0 + LIMIT_TOLERANCE) * limit
    if "pdl_stress" in broken:
        slow |= s.fraction > pdl
    if "limits" in broken or "pdl_stress" in broken:
        teeth = np.flatnonzero(slow & (s.fraction > np.minimum(limit, pdl)))
        s.set("fraction", teeth, np.minimum(limit, pdl)[teeth], "speed")
        s.set("start", teeth, _finish_start(s.start[teeth], s.fraction[teeth]), "speed")
    return s


def relieve(stagings: Sequence[Staging], cases: Sequence[Case]) -> None:
    """Trim, in place, the overcorrection of the teeth whose aligner shapes collide (neighbours or
    crowns one apart beyond COLLISION_TOLERANCE_MM at any aligner) to RELIEF_KEEP of it (in steps of
    OC_QUANTUM, below one step to none), up to RELIEF_ROUNDS times, as a technician trims an
    overcorrected setup whose tooth sockets overlap: geometry of the planned poses only, no simulation;
    every staging of a round in one batch."""
    if len(stagings) > BATCH_CHUNK:  # bounded memory, as the scoring's chunks
        for lo in range(0, len(stagings), BATCH_CHUNK):
            relieve(stagings[lo : lo + BATCH_CHUNK], cases[lo : lo + BATCH_CHUNK])
        return
    active = [k for k, s in enumerate(stagings) if s.oc.any()]
    for _ in range(RELIEF_ROUNDS):
        if not active:
            return
        rows = [stagings[k] for k in active]
        batch = [cases[k] for k in active]
        oc = np.stack([s.oc for s in rows])
        # only the pairs with an overcorrected crown can be relieved: their crowns' poses alone
        pairs = ALL_PAIR_CROWNS[:, oc.any(axis=0)[ALL_PAIR_CROWNS].any(axis=0)]  # (2, P)
        crowns = np.unique(pairs)
        progress = planned_progress(
            np.stack([s.start for s in rows]), np.stack([s.fraction for s in rows]), oc
        )
        poses = interpolate_poses(
            np.stack([c.initial[crowns] for c in batch]),
            np.stack([c.target[crowns] for c in batch]),
            progress[:, 1:, crowns],
        )
        w = np.stack([c.crown_width_mm[crowns] for c in batch])[:, None]
        d = np.stack([c.crown_depth_mm[crowns] for c in batch])[:, None]
        if pairs.shape[1] == ALL_PAIR_CROWNS.shape[1]:  # every pair: the all-pairs pass skips far ones
            pen = all_pairs_penetration_mm(poses, w, d)
        else:
            pen = pair_penetration_mm(poses, w, d, np.searchsorted(crowns, pairs))
        worst = mask_pairs(pen, batch_absent(batch), pairs).max(axis=1)
        still = []
        for k, s, row in zip(active, rows, worst):
            hit = np.unique(pairs[:, row > COLLISION_TOLERANCE_MM])
            teeth = hit[s.oc[hit] > 0.0]
            if teeth.size:
                s.set(
                    "oc",
                    teeth,
                    np.floor(s.oc[teeth] * RELIEF_KEEP / OC_QUANTUM + 1e-9) * OC_QUANTUM,
                    "overcorrection",
                )
                if s.oc.any():
                    still.append(k)
        active = still


def _neighbours(teeth: np.ndarray) -> np.ndarray:
    """The teeth and their neighbours along the arch."""
    mask = np.zeros(N_TEETH, dtype=bool)
    mask[teeth] = True
    a, b = ADJACENT_PAIRS.T
    grown = mask.copy()
    grown[a[mask[b]]] = True
    grown[b[mask[a]]] = True
    return np.flatnonzero(grown)


def alternatives(s: Staging, case: Case, share: dict[str, np.ndarray]) -> list[Staging]:
    """Repair 2's alternatives for one plan (see the module docstring), least change first; ``share``
    the plan's :func:`server.staging_engine.rollout_breaches` rows (28,) per kind."""
    involved = np.flatnonzero(share["contact"] + share["aligner"] + share["overshoot"] > 0.0)
    if not involved.size:
        return []
    out = []
    over = involved[s.oc[involved] > 0.0]
    if over.size:
        t = s.copy()
        t.set("oc", over, np.floor(s.oc[over] * 0.5 / OC_QUANTUM + 1e-9) * OC_QUANTUM, "overcorrection")
        out.append(t)
    contact = np.flatnonzero(share["contact"] > 0.0)
    moving = contact[s.fraction[contact] > 0.0]
    if moving.size:
        # slowed to finish at the last aligner, its start kept (the movement spread over its window)
        stretch = 1.0 / (N_STAGES - s.start[moving] + 1)
        faster = moving[s.fraction[moving] > stretch]
        if faster.size:
            t = s.copy()
            t.set("fraction", faster, 1.0 / (N_STAGES - s.start[faster] + 1), "slow")
            out.append(t)
        # started later at its speed, as late as still finishes by the last aligner
        latest = _finish_start(np.full(moving.size, N_STAGES), s.fraction[moving])
        t = s.copy()
        t.set(
            "start",
            moving,
            np.maximum(s.start[moving], np.minimum(s.start[moving] + RETIME_STAGES, latest)),
            "retime",
        )
        out.append(t)
    t = s.copy()
    teeth = _neighbours(involved)
    if case.absent is not None:
        teeth = teeth[~case.absent[teeth]]
    t.set("start", teeth, np.ones(teeth.size, dtype=np.int64), "uniform")
    t.set("fraction", teeth, np.full(teeth.size, UNIFORM_FRACTION), "uniform")
    t.set("oc", teeth, np.zeros(teeth.size), "uniform")
    out.append(t)
    return [
        t
        for t in out
        if not (
            np.array_equal(t.start, s.start)
            and np.array_equal(t.fraction, s.fraction)
            and np.array_equal(t.oc, s.oc)
        )
    ]


def fallbacks(spec: PlanSpec, case: Case) -> list[tuple[str, Staging]]:
    """Fallback stagings, in order: uniform, uniform slowed, no movement."""
    out = [("uniform", uniform_staging(spec, case))]
    out += [(f"uniform_x{k:g}", uniform_staging(spec, case, k)) for k in FALLBACK_SLOWER]
    out.append(("nothing", uniform_staging(spec, case, 0.0)))
    return out
