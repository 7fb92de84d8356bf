"""The oracle's fallbacks under non-compliance: what it plans when no candidate staging is safe
because a tooth whose attachment debonds lags its neighbours while the aligners it does not wear move
on (:mod:`server.compliance`).

* :func:`lagging_windows`: the teeth a compliance schedule (24, 28) leaves behind, and the aligners
  (1-24) they lag in;
* :func:`safe_fallback`: the lagging tooth (alone, with its neighbours, its quadrant, its arch or every
  tooth) rescheduled to move before or after those aligners, within the per-stage limits
  (compensated and trimmed under force decay, repaired where needed); failing that, the staging
  slowed by :data:`FALLBACK_FACTORS` until it breaks no rule (slowed to nothing it keeps the teeth
  where they are: a safe plan that leaves movement undone outranks one that harms);
* :func:`slower_fallback`: uniform staging slowed by :data:`SLOWER_FACTORS`, repaired where needed,
  when the oracle's search found nothing safe.

Stagings are :mod:`server.setup_refinement`'s ``(start, fraction, overcorrection)``, each (28,).
"""

from __future__ import annotations

import numpy as np

from server.cases import Case
from server.dental_constants import ADJACENT_PAIRS, IS_UPPER, N_STAGES, QUADRANT, TOOTH_IDS
from server.reward_scaler import breach_total
from server.setup_refinement import (
    RELIEF_TRIMS,
    REPAIR_STARTS,
    compensate,
    relieve_aligner_collisions,
    repair_staging,
    score_stagings,
    staging_breaches,
)
from server.staging import MAX_SPEED, Staging, limit_speeds, quantise_fractions

SLOWER_FACTORS: tuple[float, ...] = (0.9, 0.75, 0.6, 0.45)
"""Speeds (shares of uniform staging's) tried when no candidate or repair is safe."""
FALLBACK_FACTORS: tuple[float, ...] = (0.9, 0.75, 0.6, 0.45, 0.3, 0.15, 0.0)
"""Speeds (shares of a staging's) of the last fallback for a staging no candidate makes safe; 0 keeps
every tooth where it is."""


def slower_fallback(
    case: Case, strategy: str, uniform: Staging, failing: dict
) -> tuple[Staging, dict] | None:
    """When nothing safe was found (a compliance schedule that overloads a lagging tooth): uniform
    staging slowed by SLOWER_FACTORS, repaired where needed; the fastest safe one, even if it does
    not finish (a safe plan that leaves movement undone outranks one that harms)."""
    start, fraction, oc = uniform
    slower = [(start, quantise_fractions(fraction * k), oc) for k in SLOWER_FACTORS]
    results = score_stagings(case, strategy, slower)
    for staging, result in zip(slower, results):
        if not result["broken_rules"]:
            return staging, result
        breach = breach_total(result["diagnostics"])
        fixed = repair_staging(case, staging, breach, N_STAGES)
        if fixed is not None:
            fixed_result = score_stagings(case, strategy, [fixed])[0]
            if fixed_result["scaled_reward"] > failing["scaled_reward"]:
                return fixed, fixed_result
    return None


def lagging_windows(wear: np.ndarray | None) -> list[tuple[int, int, int]]:
    """``(tooth, first, last)``: each tooth that a compliance schedule (24, 28) leaves behind the
    others (its wear below the stage's most worn tooth's) and the first and last such stage (1-24).
    None (full wear): none."""
    if wear is None:
        return []
    behind = wear < wear.max(axis=1, keepdims=True) - 1e-9  # (24, 28)
    out = []
    for i in np.flatnonzero(behind.any(axis=0)):
        stages = np.flatnonzero(behind[:, i]) + 1
        out.append((int(i), int(stages[0]), int(stages[-1])))
    return out


def _reschedules(case: Case, staging: Staging, last: int) -> list[Staging]:
    """Variants of a staging that keep a lagging tooth (:func:`lagging_windows`) from moving while
    its aligner is not worn as prescribed: the tooth, alone, with its neighbours, its quadrant, its
    arch or every tooth, done before its window or started after it, within the per-stage limits
    (the margin MAX_SPEED keeps is spent here: the simulator checks each variant); or started at
    aligner 1 at MAX_SPEED of them."""
    start, fraction, oc = staging
    cap = limit_speeds(case.initial, case.target) / (1.0 + oc)
    out: list[Staging] = []
    for tooth, first, final in lagging_windows(case.wear):
        neighbours = np.unique(ADJACENT_PAIRS[np.isin(ADJACENT_PAIRS, tooth).any(axis=1)])
        quadrant = np.flatnonzero(QUADRANT[tooth] == QUADRANT)
        arch = np.flatnonzero(IS_UPPER[tooth] == IS_UPPER)
        for teeth in (np.array([tooth]), neighbours, quadrant, arch, np.arange(len(TOOTH_IDS))):
            timings = [(s0, first - 1) for s0 in sorted({1, *start[teeth].tolist()}) if s0 < first]
            timings += [(final + 1, end) for end in sorted({last, N_STAGES}) if final < end]
            for s0, end in timings:
                s, f = start.copy(), fraction.copy()
                s[teeth] = np.minimum(start[teeth], s0) if end < first else s0
                f[teeth] = np.maximum(fraction[teeth] if end < first else 0.0, 1.0 / (end - s[teeth] + 1))
                if np.all(f[teeth] <= cap[teeth]):
                    out.append((s, quantise_fractions(f), oc))
            # too far to move outside the window: as far as MAX_SPEED allows before it (the rest of
            # the limits left to overcorrection)
            s, f = start.copy(), fraction.copy()
            s[teeth], f[teeth] = 1, np.maximum(fraction[teeth], MAX_SPEED * cap[teeth])
            out.append((s, quantise_fractions(f), oc))
    return out


def safe_fallback(case: Case, strategy: str, stagings: list[Staging]) -> tuple[Staging, dict] | None:
    """The best safe staging (and its result) among reschedules of ``stagings`` around their lagging
    teeth's windows (:func:`_reschedules`, under force decay also compensated, repaired where
    needed), and, failing those, the stagings and the reschedules slowed by FALLBACK_FACTORS: the best
    at the fastest factor where one breaks no rule. None if none is safe."""
    last = N_STAGES - (5 if case.force_decay else 0)
    variants = [v for x in stagings for v in _reschedules(case, x, last)]
    if case.force_decay:  # a lagging tooth overcorrected by what it fails to express, trimmed if need be
        extra = compensate(case, [*stagings, *variants])
        variants += extra + relieve_aligner_collisions(case, extra, RELIEF_TRIMS)
    if variants:
        breach = staging_breaches(case, variants)
        safe = [v for v, b in zip(variants, breach) if b <= 0.0]
        for k in np.argsort(breach, kind="stable")[:REPAIR_STARTS] if not safe else ():
            fixed = repair_staging(case, variants[k], float(breach[k]), last)
            safe += [fixed] if fixed is not None else []
        results = score_stagings(case, strategy, safe) if safe else []
        kept = [j for j, r in enumerate(results) if not r["broken_rules"]]
        if kept:
            best = max(kept, key=lambda j: results[j]["scaled_reward"])
            return safe[best], results[best]
    for k in FALLBACK_FACTORS:
        slower = [(s, quantise_fractions(f * k), oc) for s, f, oc in [*stagings, *variants]]
        results = score_stagings(case, strategy, slower)
        safe = [j for j, r in enumerate(results) if not r["broken_rules"]]
        if safe:
            best = max(safe, key=lambda j: results[j]["scaled_reward"])
            return slower[best], results[best]
    return None
