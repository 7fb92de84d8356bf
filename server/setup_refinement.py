"""Setup refinement: the oracle's stagings checked on the simulator and refined, as a clinician
refines a setup after watching its animation (:mod:`server.oracle` and :mod:`server.oracle_fallback`
both search with these).

A staging is ``(start, fraction, overcorrection)``, each (28,) in
:data:`server.dental_constants.TOOTH_IDS` order: the aligner (1-24) a tooth starts moving at, the
share of its movement per aligner, and its overcorrection (a share of its movement,
:data:`server.plans.MAX_OVERCORRECTION` at most). Each is checked with the case's dynamics and
compliance schedule (:func:`server.treatment.rollout_plans`), breaches in the units of
:func:`server.scoring.hard_rule_breaches`:

* repair (:func:`repair_staging`): the teeth in a breach (colliding contacts, over-stressed, over the
  per-stage limits) started earlier or later or slowed, a lagging tooth's mesial chain delayed, two
  colliding neighbours moved one after the other, round after round while the breach shrinks;
* compensation (:func:`compensate`): each tooth overcorrected by the share of its movement the
  simulator shows it fails to express under force decay, within the per-stage limits;
* collision relief (:func:`relieve_aligner_collisions`): that overcorrection trimmed on the teeth
  whose aligner shapes collide.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from server.cases import Case
from server.collisions import COLLISION_TOLERANCE_MM, all_pairs_penetration_mm
from server.dental_constants import (
    ADJACENT_PAIRS,
    LIMIT_TOLERANCE,
    MIRROR_INDEX,
    MM_PER_DEG,
    N_STAGES,
    PDL_CRITICAL_KPA,
    QUADRANT,
    SECOND_NEIGHBOUR_PAIRS,
    TOOTH_IDS,
    TOOTH_NUMBER,
)
from server.plans import MAX_OVERCORRECTION, PlanSpec
from server.quaternion_utils import quaternion_inverse, quaternion_multiply, quaternion_to_rotvec
from server.scoring import all_breaches, increments, limit_ratio, pdl_stress_kpa, stage_measures
from server.staging import MAX_SPEED, OC_QUANTUM, Staging, limit_speeds, quantise_fractions
from server.treatment import rollout_plans, score_plan_specs

REPAIR_ROUNDS: int = 10
"""Rounds of setup refinement for a candidate that breaks a hard rule."""
REPAIR_TEETH: int = 4
"""Teeth (those breaking the most) whose timing a repair round varies."""
REPAIR_STARTS: int = 3
"""Candidates (those with the best terminal score) refined, in turn, until one comes out safe."""
REPAIR_SHIFTS: tuple[int, ...] = (-6, -3, -1, 1, 2, 3, 6, 9)
"""Start-stage shifts tried on each tooth involved in a breach."""
SHORT_FACTORS: tuple[float, ...] = (0.9, 0.8, 0.65)
"""Speed factors of a repair that lets a tooth stop short of its target."""
CHAIN_SHIFTS: tuple[int, ...] = (1, 2, 3, 5, 7, 9)
"""Delays tried on the chain of teeth mesial to a lagging tooth."""
MIN_EXPRESSED_SHARE: float = 0.25
"""A tooth is assumed to express at least this share when its overcorrection is computed."""
RELIEF_TRIMS: tuple[tuple[float, int, bool], ...] = ((0.5, 4, False), (0.75, 8, False), (0.75, 12, True))
"""Share of the overcorrection kept per round, and the rounds at most, of each collision relief tried."""


def staging_spec(staging: Staging, strategy: str | None) -> PlanSpec:
    """A staging ``(start, fraction, overcorrection)``, each (28,), as the plan spec the simulator
    runs (copies; no overcorrection when it is zero everywhere)."""
    start, fraction, oc = staging
    return PlanSpec(start.copy(), fraction.copy(), strategy, overcorrection=oc.copy() if oc.any() else None)


def score_stagings(case: Case, strategy: str, stagings: list[Staging]) -> list[dict]:
    """Each staging's full result on the case under ``strategy``
    (:func:`server.treatment.score_plan_specs`, one batch)."""
    specs = [staging_spec(x, strategy) for x in stagings]
    return score_plan_specs(specs, [case] * len(specs))


def breach_teeth(case: Case, staging: Staging) -> np.ndarray:
    """(28,) each tooth's share of a staging's hard-rule breach (0 for a tooth that breaks nothing):
    half of each colliding contact's excess penetration, its stress over critical, its excess over
    the limits, in the units of :func:`server.scoring.hard_rule_breaches`."""
    planned, achieved = rollout_plans([staging_spec(staging, None)], [case])
    absent = None if case.absent is None else case.absent[None]
    m = stage_measures(planned, achieved, case.crown_width_mm[None], case.crown_depth_mm[None], absent=absent)
    out = np.zeros(len(TOOTH_IDS))
    excess = np.maximum(m.penetration[0] - COLLISION_TOLERANCE_MM, 0.0).sum(axis=0) / COLLISION_TOLERANCE_MM
    np.add.at(out, ADJACENT_PAIRS[:, 0], 0.5 * excess)
    np.add.at(out, ADJACENT_PAIRS[:, 1], 0.5 * excess)
    out += np.maximum(pdl_stress_kpa(m.mis_t[0], m.mis_r[0]) / PDL_CRITICAL_KPA - 1.0, 0.0).sum(axis=0)
    inc_t, inc_r = increments(planned[0])
    out += np.maximum(limit_ratio(inc_t, inc_r) - 1.0 - LIMIT_TOLERANCE, 0.0).sum(axis=0)
    return out


def _repairs(case: Case, staging: Staging, last: int) -> list[Staging]:
    """Variants of a breaking staging: a lagging tooth's mesial chain delayed; two colliding
    neighbours moved one after the other; each involved tooth, alone and with its contralateral
    counterpart, started earlier or later (at the slowest speed that still finishes) or slowed,
    if need be until it stops short of its target.
    Overcorrections are kept; the limits apply to the overcorrected steps."""
    start, fraction, oc = staging
    limit_fraction = limit_speeds(case.initial, case.target) / (1.0 + oc)
    out: list[Staging] = []
    share = breach_teeth(case, staging)
    involved = [i for i in np.argsort(-share, kind="stable")[:REPAIR_TEETH] if share[i] > 0.0]
    # a lagging tooth blocks the teeth mesial to it: delay the whole mesial chain of its quadrant
    for a, b in ADJACENT_PAIRS:
        if share[a] <= 0.0 or share[b] <= 0.0:
            continue
        mesial = a if TOOTH_NUMBER[a] < TOOTH_NUMBER[b] else b
        if TOOTH_NUMBER[a] == TOOTH_NUMBER[b]:  # the midline contact
            continue
        chain = (QUADRANT[mesial] == QUADRANT) & (TOOTH_NUMBER[mesial] >= TOOTH_NUMBER)
        for shift in CHAIN_SHIFTS:
            for end in sorted({last, N_STAGES}):
                s = start.copy()
                s[chain] = np.clip(start[chain] + shift, 1, N_STAGES)
                f = fraction.copy()
                f[chain] = np.maximum(fraction[chain], 1.0 / np.maximum(end - s[chain] + 1, 1))
                if np.all(f[chain] <= MAX_SPEED * limit_fraction[chain]):
                    out.append((s, quantise_fractions(f), oc))
    # neighbours that collide whatever their speeds: one finishes (at top speed) before the other starts
    for a, b in ADJACENT_PAIRS:
        if share[a] <= 0.0 or share[b] <= 0.0 or (a not in involved and b not in involved):
            continue
        for first, then in ((a, b), (b, a)):
            s, f = start.copy(), fraction.copy()
            f[first] = min(1.0, MAX_SPEED * limit_fraction[first])
            s[then] = min(N_STAGES, s[first] + int(np.ceil(1.0 / f[first] - 1e-9)))
            f[then] = 1.0 / (N_STAGES - s[then] + 1)
            if f[then] <= MAX_SPEED * limit_fraction[then]:
                out.append((s, quantise_fractions(f), oc))
            shortest = int(np.ceil(1.0 / min(1.0, MAX_SPEED * limit_fraction[then]) - 1e-9))
            for stages in (shortest, shortest + 2, shortest + 4):  # or the second late, finishing last
                s, f = start.copy(), fraction.copy()
                s[then] = max(1, N_STAGES - stages + 1)
                f[then] = 1.0 / (N_STAGES - s[then] + 1)
                out.append((s, quantise_fractions(f), oc))
    for teeth in [np.array([i]) for i in involved] + [np.array([i, MIRROR_INDEX[i]]) for i in involved]:
        for shift in REPAIR_SHIFTS:
            s = start.copy()
            s[teeth] = np.clip(start[teeth] + shift, 1, N_STAGES)
            for end in sorted(
                {last, N_STAGES}
            ):  # finishing by the planned end, or using the refinement aligners
                f = fraction.copy()
                f[teeth] = 1.0 / np.maximum(end - s[teeth] + 1, 1)
                if np.all(f[teeth] <= MAX_SPEED * limit_fraction[teeth]):
                    out.append((s, quantise_fractions(f), oc))
        f = fraction.copy()
        f[teeth] = np.maximum(1.0 / (N_STAGES - start[teeth] + 1), 0.7 * fraction[teeth])
        out.append((start.copy(), quantise_fractions(f), oc))
        for k in SHORT_FACTORS:  # or slowed so far that it stops short: less accuracy, no harm
            f = fraction.copy()
            f[teeth] = k * fraction[teeth]
            out.append((start.copy(), quantise_fractions(f), oc))
    return out


def staging_breaches(case: Case, stagings: list[Staging]) -> np.ndarray:
    """(n,) summed hard-rule breach of stagings on a case: the simulator without the quality terms."""
    specs = [staging_spec(x, None) for x in stagings]
    planned, achieved = rollout_plans(specs, [case] * len(specs))
    n = len(specs)
    breaches = all_breaches(
        np.broadcast_to(case.initial, (n, 28, 7)),
        np.broadcast_to(case.target, (n, 28, 7)),
        np.broadcast_to(case.crown_width_mm, (n, 28)),
        np.broadcast_to(case.crown_depth_mm, (n, 28)),
        planned,
        achieved,
        absent=None if case.absent is None else np.broadcast_to(case.absent, (n, 28)),
    )
    return sum(breaches.values())


def repair_staging(case: Case, staging: Staging, breach: float, last: int) -> Staging | None:
    """Greedy setup refinement: the variant with the least breach, round after round, until it
    breaks no rule (returned) or stops improving (None)."""
    for _ in range(REPAIR_ROUNDS):
        if breach <= 0.0:
            return staging
        variants = _repairs(case, staging, last)
        if not variants:
            return None
        breaches = staging_breaches(case, variants)
        k = int(np.argmin(breaches))
        if breaches[k] >= breach:
            return None
        staging, breach = variants[k], float(breaches[k])
    return staging if breach <= 0.0 else None


def expressed_shares(case: Case, stagings: list[Staging]) -> np.ndarray:
    """(n, 28) share of each tooth's required movement (mm-equivalent, rotations at MM_PER_DEG) that
    each staging expresses on the case by the last aligner; 1 for a tooth with nothing to do."""
    _, achieved = rollout_plans([staging_spec(x, None) for x in stagings], [case] * len(stagings))
    q0_inv = quaternion_inverse(case.initial[:, :4])

    def movement(poses: np.ndarray) -> np.ndarray:
        rot = np.degrees(quaternion_to_rotvec(quaternion_multiply(q0_inv, poses[..., :4]))) * MM_PER_DEG
        return np.concatenate((poses[..., 4:] - case.initial[:, 4:], rot), axis=-1)

    need, got = movement(case.target), movement(achieved[:, -1])
    norm2 = np.sum(need * need, axis=-1)
    return np.where(norm2 > 1e-12, np.sum(got * need, axis=-1) / np.maximum(norm2, 1e-12), 1.0)


def compensate(case: Case, stagings: list[Staging], rounds: int = 2) -> list[Staging]:
    """The stagings with each tooth overcorrected by what the dynamics fail to express: ``(1 + oc) /
    share - 1``, measured on the simulator and refined ``rounds`` times, within MAX_OVERCORRECTION and
    within the per-stage limits (MAX_SPEED of them) on the overcorrected steps."""
    limit_fraction = limit_speeds(case.initial, case.target)
    out = list(stagings)
    for _ in range(rounds):
        shares = expressed_shares(case, out)
        nxt = []
        for (start, fraction, oc), share in zip(out, shares):
            room = MAX_SPEED * limit_fraction / np.maximum(fraction, 1e-9) - 1.0
            want = (1.0 + oc) / np.clip(share, MIN_EXPRESSED_SHARE, None) - 1.0
            oc = np.floor(np.clip(np.minimum(want, room), 0.0, MAX_OVERCORRECTION) / OC_QUANTUM) * OC_QUANTUM
            nxt.append((start, fraction, oc))
        out = nxt
    return out


def relieve_aligner_collisions(
    case: Case, stagings: list[Staging], trims: Sequence[tuple[float, int, bool]] = ((0.5, 4, False),)
) -> list[Staging]:
    """The stagings once per trim ``(keep, rounds, one_side)`` (trim-major order), with the
    overcorrection of the teeth whose aligner shapes collide (neighbours or crowns one apart, beyond
    COLLISION_TOLERANCE_MM at any aligner) cut to the share ``keep``, ``rounds`` times at most, as a
    technician trims an overcorrected setup whose tooth sockets overlap; ``one_side`` trims only the
    more overcorrected tooth of each colliding pair. A tooth whose overcorrection falls below
    OC_QUANTUM gets none. Every trim's stagings are simulated together, one batch per round."""
    pairs = np.concatenate((ADJACENT_PAIRS, SECOND_NEIGHBOUR_PAIRS))
    out = [s for _ in trims for s in stagings]
    trim_of = [t for t in trims for _ in stagings]
    settled = [False] * len(out)  # no collision left: its overcorrection stays as it is
    for round_ in range(max((rounds for _, rounds, _ in trims), default=0)):
        todo = [
            k for k, (_, _, oc) in enumerate(out) if not settled[k] and round_ < trim_of[k][1] and oc.any()
        ]
        if not todo:
            break
        planned, _ = rollout_plans([staging_spec(out[k], None) for k in todo], [case] * len(todo))
        w, d = case.crown_width_mm, case.crown_depth_mm
        pen = all_pairs_penetration_mm(planned[:, 1:], w, d).max(axis=1)  # (n, 50) deepest over the aligners
        for row, k in enumerate(todo):
            hit = pairs[pen[row] > COLLISION_TOLERANCE_MM]
            if not hit.size:
                settled[k] = True
                continue
            keep, _, one_side = trim_of[k]
            start, fraction, oc = out[k]
            teeth = np.unique(hit)
            if one_side:
                teeth = np.unique(np.where(oc[hit[:, 0]] >= oc[hit[:, 1]], hit[:, 0], hit[:, 1]))
            oc = oc.copy()
            oc[teeth] = np.floor(oc[teeth] * keep / OC_QUANTUM + 1e-9) * OC_QUANTUM
            out[k] = (start, fraction, oc)
    return out
