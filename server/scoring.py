"""Episode scoring: a whole 24-stage trajectory -> components and a terminal reward.

Pure, vectorised over a batch of B episodes. Inputs are the planned (aligner)
trajectory and the achieved one, each ``(B, 25, 28, 7)`` (stage 0 = initial), and
the cases' arrays. Every component is in [0, 1] except ``strategy_multiplier``.

Components (ENVIRONMENT.md §5):

* ``accuracy`` - share of the required movement achieved: ``1 - sum_i e_i / sum_i e0_i``
  with ``e`` the final and ``e0`` the initial mm-equivalent distance of each tooth to
  its target (rotation weighs MM_PER_DEG mm per degree); reaching the target is 1.
* ``occlusion_composite`` - Andrews' six keys + ABO items on the final achieved arch.
* ``collision_free`` - ``1 - mean over stages of`` the collision severity of the
  achieved arch (:func:`server.collisions.collision_severity`).
* ``pdl_feasibility`` - mean over treated teeth of a PDL score of the tooth's peak
  stress at aligner insertion: (K_T |dt| + K_R |dθ|) / root area, with the mismatch
  between the aligner and the tooth it is put on; 1 up to the top of the optimal band
  (2.6 kPa), 0.5 at the critical 4.7 kPa, 0 at 1.5 x critical.
* ``limits_compliance`` - mean over treated teeth of ``1 - (r - 1.05)`` clipped to
  [0, 1], ``r`` the tooth's largest planned increment over the per-stage limit.
* ``smoothness`` - mean over moved teeth of ``mean(d)^2 / mean(d^2)`` over the 24
  planned increments ``d`` (1 for constant speed through the treatment, k/24 for a
  tooth moving in k stages, lower for uneven speed).
* ``staging`` - ``(rho + 1) / 2`` with ``rho`` the Kendall-style concordance between
  the declared strategy's staging order and the treated teeth's start stages
  (:func:`staging_concordance`; 0.5 when no strategy is declared).
* ``strategy_multiplier`` - 1.2 optimal, 1.0 neutral, 0.6 wrong; a declared strategy
  the staging contradicts (rho < -0.2) counts as wrong, and the optimal one is only
  paid 1.2 when the staging follows it (rho >= 0.3).
* ``realism``, ``anchorage``, ``movement_prior`` - :mod:`server.movement_priors` on
  (initial, final achieved) and, for anchorage, the achieved trajectory's staging load.

Terminal reward (documented composite):
``(multiplier / 1.2) * (0.30 accuracy + accuracy * (0.20 occlusion + 0.15 collision_free
+ 0.10 pdl + 0.10 limits + 0.05 smoothness + 0.05 staging + 0.05 movement_prior))``,
times the plan's validity (share of usable groups), clipped to [0, 1]. Dividing by the
optimal multiplier keeps the top of the scale for plans that stage by the right
strategy (a neutral plan tops out at 0.83) instead of saturating at the clip. The process
components are credited in proportion to accuracy: a plan is only as good as the
treatment it delivers, so doing nothing scores 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from server.clinical_profiles import STRATEGY_LEVELS, strategy_multiplier_class
from server.collisions import COLLISION_TOLERANCE_MM, collision_severity, penetration_mm
from server.dental_constants import (
    ALIGNER_FORCE_N_PER_DEG,
    ALIGNER_FORCE_N_PER_MM,
    LIMIT_TOLERANCE,
    MAX_ROTATION_DEG,
    MAX_TRANSLATION_MM,
    MM_PER_DEG,
    PDL_CRITICAL_KPA,
    PDL_OPTIMAL_KPA,
    ROOT_AREA_MM2,
)
from server.movement_priors import MOVING_EPS_MM, CombinedPrior
from server.occlusion import occlusion_composite
from server.quaternion_utils import quaternion_angle, vector_norm

MOVEMENT_EPS_MM: float = 0.05
"""A tooth whose target is closer than this (mm-equivalent) needs no treatment."""
INCREMENT_EPS_MM: float = 1e-6

TERMINAL_WEIGHTS: dict[str, float] = {
    "accuracy": 0.30,
    "occlusion_composite": 0.20,
    "collision_free": 0.15,
    "pdl_feasibility": 0.10,
    "limits_compliance": 0.10,
    "smoothness": 0.05,
    "staging": 0.05,
    "movement_prior": 0.05,
}
STRATEGY_MULTIPLIERS: dict[str, float] = {"optimal": 1.2, "neutral": 1.0, "wrong": 0.6}
MAX_MULTIPLIER: float = STRATEGY_MULTIPLIERS["optimal"]
STAGING_AGAINST_RHO: float = -0.2
STAGING_FOLLOWS_RHO: float = 0.3

_PRIOR = CombinedPrior()


def movement_mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-tooth mm-equivalent distance between poses (..., 28, 7) a and b."""
    t = vector_norm(a[..., 4:] - b[..., 4:])
    r = np.degrees(quaternion_angle(a[..., :4], b[..., :4]))
    return np.hypot(t, MM_PER_DEG * r)


def increments(poses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Translation (mm) and rotation (deg) from each stage to the next: (..., S-1, 28) each."""
    t = vector_norm(np.diff(poses[..., 4:], axis=-3))
    r = np.degrees(quaternion_angle(poses[..., 1:, :, :4], poses[..., :-1, :, :4]))
    return t, r


def limit_ratio(inc_t: np.ndarray, inc_r: np.ndarray) -> np.ndarray:
    """Increment over the per-stage limit (1 = at the limit), the worse of translation/rotation."""
    return np.maximum(inc_t / MAX_TRANSLATION_MM, inc_r / MAX_ROTATION_DEG)


def pdl_stress_kpa(mismatch_t: np.ndarray, mismatch_r: np.ndarray) -> np.ndarray:
    """PDL pressure (kPa) of aligner/tooth mismatches (mm, deg), per tooth (..., 28)."""
    force_n = ALIGNER_FORCE_N_PER_MM * mismatch_t + ALIGNER_FORCE_N_PER_DEG * mismatch_r
    return 1000.0 * force_n / ROOT_AREA_MM2


def pdl_tooth_score(stress_kpa: np.ndarray) -> np.ndarray:
    """1 up to the optimal band's top, 0.5 at critical, 0 at 1.5 x critical."""
    hi = PDL_OPTIMAL_KPA[1]
    first = np.clip((stress_kpa - hi) / (PDL_CRITICAL_KPA - hi), 0.0, 1.0)
    second = np.clip((stress_kpa - PDL_CRITICAL_KPA) / (0.5 * PDL_CRITICAL_KPA), 0.0, 1.0)
    return 1.0 - 0.5 * first - 0.5 * second


def _masked_mean(x: np.ndarray, mask: np.ndarray, empty: float) -> np.ndarray:
    n = mask.sum(axis=-1)
    return np.where(n > 0, np.sum(np.where(mask, x, 0.0), axis=-1) / np.maximum(n, 1), empty)


def staging_concordance(levels: np.ndarray, starts: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Kendall-style agreement in [-1, 1] between a staging order and start stages.

    Over pairs of masked teeth with different ``levels`` (B, 28): +1 when the
    lower-level tooth starts strictly earlier, -1 when strictly later, 0 when they
    start together; averaged. 1.0 when no such pair exists (nothing to stage).
    """
    dl = np.sign(levels[:, :, None] - levels[:, None, :])
    ds = np.sign(starts[:, :, None] - starts[:, None, :])
    pair = (mask[:, :, None] & mask[:, None, :]) & (dl != 0)
    n = pair.sum(axis=(1, 2))
    agree = np.sum(np.where(pair, dl * ds, 0.0), axis=(1, 2))
    return np.where(n > 0, agree / np.maximum(n, 1), 1.0)


@dataclass(frozen=True)
class StageMeasures:
    """Per-stage quantities of B trajectories; axis -2 is stage 1..24.

    inc_t, inc_r: (B, 24, 28) planned increments, aligner s vs aligner s-1 (mm, deg).
    mis_t, mis_r: (B, 24, 28) insertion mismatch, aligner s vs the poses achieved at s-1.
    achieved_mm: (B, 24, 28) achieved increments (mm-equivalent).
    penetration: (B, 24, 26) adjacent-crown penetration of the achieved arch (mm).
    """

    inc_t: np.ndarray
    inc_r: np.ndarray
    mis_t: np.ndarray
    mis_r: np.ndarray
    achieved_mm: np.ndarray
    penetration: np.ndarray


def stage_measures(
    planned: np.ndarray, achieved: np.ndarray, width_mm: np.ndarray, depth_mm: np.ndarray
) -> StageMeasures:
    """StageMeasures of (B, 25, 28, 7) planned and achieved trajectories; ``achieved is
    planned`` (ideal dynamics) skips the second pass."""
    inc_t, inc_r = increments(planned)
    if achieved is planned:  # the teeth sit exactly in the previous aligner
        mis_t, mis_r = inc_t, inc_r
        achieved_mm = np.hypot(inc_t, MM_PER_DEG * inc_r)
    else:
        mis_t = vector_norm(planned[:, 1:, :, 4:] - achieved[:, :-1, :, 4:])
        mis_r = np.degrees(quaternion_angle(planned[:, 1:, :, :4], achieved[:, :-1, :, :4]))
        a_t, a_r = increments(achieved)
        achieved_mm = np.hypot(a_t, MM_PER_DEG * a_r)
    pen = penetration_mm(achieved[:, 1:], width_mm[:, None], depth_mm[:, None])
    return StageMeasures(inc_t, inc_r, mis_t, mis_r, achieved_mm, pen)


@dataclass
class EpisodeScores:
    """Per-episode components (B,) and diagnostics (B,) of a scored batch."""

    components: dict[str, np.ndarray]
    terminal: np.ndarray
    diagnostics: dict[str, np.ndarray]
    start_stage: np.ndarray  # (B, 28), 25 = never moved

    def breakdown(self, i: int) -> dict[str, float]:
        """JSON-safe reward breakdown of episode i."""
        return {k: float(v[i]) for k, v in self.components.items()}


def start_stages(inc_mm: np.ndarray) -> np.ndarray:
    """(B, 28) first stage (1..24) at which each tooth's planned increment is non-zero; 25 if never."""
    moving = inc_mm > INCREMENT_EPS_MM
    first = np.argmax(moving, axis=-2) + 1
    return np.where(moving.any(axis=-2), first, inc_mm.shape[-2] + 1)


def score_episodes(
    initial: np.ndarray,
    target: np.ndarray,
    width_mm: np.ndarray,
    depth_mm: np.ndarray,
    planned: np.ndarray,
    achieved: np.ndarray,
    profiles: list[str],
    strategies: list[str | None],
    validity: np.ndarray | None = None,
    measures: StageMeasures | None = None,
) -> EpisodeScores:
    """Score B episodes.

    Args:
        initial, target: (B, 28, 7) case configurations.
        width_mm, depth_mm: (B, 28) crown dimensions.
        planned, achieved: (B, 25, 28, 7) aligner shapes and achieved poses, stage 0 = initial.
        profiles: B primary clinical profiles (they set the optimal strategy).
        strategies: B declared strategies (None when none was declared).
        validity: (B,) share of a plan's usable groups (1 for stepwise episodes).
        measures: the trajectories' StageMeasures when already at hand (the stepwise
            environment collects them step by step); computed here otherwise.
    """
    b = initial.shape[0]
    final = achieved[:, -1]
    need = movement_mm(initial, target)  # (B, 28)
    treated = need > MOVEMENT_EPS_MM

    m = stage_measures(planned, achieved, width_mm, depth_mm) if measures is None else measures
    inc_t, inc_r = m.inc_t, m.inc_r  # (B, 24, 28)
    inc_mm = np.hypot(inc_t, MM_PER_DEG * inc_r)
    moved = (inc_mm > INCREMENT_EPS_MM).any(axis=-2)
    judged = treated | moved

    ratio = limit_ratio(inc_t, inc_r)
    violations = ratio > 1.0 + LIMIT_TOLERANCE
    limits = _masked_mean(np.clip(1.0 - (ratio.max(axis=-2) - 1.0 - LIMIT_TOLERANCE), 0.0, 1.0), judged, 1.0)

    stress = pdl_stress_kpa(m.mis_t, m.mis_r)  # (B, 24, 28)
    peak = stress.max(axis=-2)
    pdl = _masked_mean(pdl_tooth_score(peak), judged, 1.0)

    pen = m.penetration  # (B, 24, 26)
    collision_free = 1.0 - collision_severity(pen).mean(axis=-1)

    accuracy = np.clip(1.0 - movement_mm(final, target).sum(-1) / np.maximum(need.sum(-1), 1e-9), 0.0, 1.0)
    occlusion = occlusion_composite(final, target, width_mm)

    mean_d = inc_mm.mean(axis=-2)
    mean_d2 = (inc_mm**2).mean(axis=-2)
    tooth_smooth = np.clip(np.where(mean_d2 > 0, mean_d**2 / np.maximum(mean_d2, 1e-30), 1.0), 0.0, 1.0)
    smoothness = _masked_mean(tooth_smooth, moved, 1.0)

    starts = start_stages(inc_mm)
    declared = [s if s in STRATEGY_LEVELS else None for s in strategies]
    levels = np.stack([STRATEGY_LEVELS[s] if s else np.zeros(28, dtype=np.int64) for s in declared]).astype(
        float
    )
    rho = staging_concordance(levels, starts.astype(float), treated)
    has_strategy = np.array([s is not None for s in declared])
    staging = np.where(has_strategy, (rho + 1.0) / 2.0, 0.5)

    classes = [strategy_multiplier_class(p, s) for p, s in zip(profiles, declared)]
    classes = [
        "wrong"
        if s is not None and r < STAGING_AGAINST_RHO
        else ("neutral" if c == "optimal" and r < STAGING_FOLLOWS_RHO else c)
        for c, s, r in zip(classes, declared, rho)
    ]
    multiplier = np.array([STRATEGY_MULTIPLIERS[c] for c in classes])

    realism, anchorage, prior = (
        np.asarray(x, dtype=float).reshape(b)
        for x in _PRIOR.parts_from_movement(movement_mm(initial, final), moving=m.achieved_mm > MOVING_EPS_MM)
    )

    components = {
        "accuracy": accuracy,
        "occlusion_composite": occlusion,
        "collision_free": collision_free,
        "pdl_feasibility": pdl,
        "limits_compliance": limits,
        "smoothness": smoothness,
        "staging": staging,
        "strategy_multiplier": multiplier,
        "realism": realism,
        "anchorage": anchorage,
        "movement_prior": prior,
    }
    process = sum(TERMINAL_WEIGHTS[k] * components[k] for k in TERMINAL_WEIGHTS if k != "accuracy")
    raw = multiplier / MAX_MULTIPLIER * (TERMINAL_WEIGHTS["accuracy"] * accuracy + accuracy * process)
    if validity is not None:
        raw = raw * validity
    terminal = np.clip(raw, 0.0, 1.0)
    diagnostics = {
        "limit_violations": violations.sum(axis=(-2, -1)),
        "colliding_contacts": (pen > COLLISION_TOLERANCE_MM).sum(axis=(-2, -1)),
        "pdl_over_critical": (stress > PDL_CRITICAL_KPA).sum(axis=(-2, -1)),
        "staging_concordance": rho,
        "peak_pdl_kpa": np.where(judged, peak, 0.0).max(axis=-1),
    }
    return EpisodeScores(components, terminal, diagnostics, starts)
