"""Episode scoring: a whole 24-stage trajectory -> components and a terminal reward.

Pure, vectorised over a batch of B episodes. Inputs are the planned (aligner)
trajectory and the achieved one, each ``(B, 25, 28, 7)`` (stage 0 = initial), and
the cases' arrays. Every component is in [0, 1] except ``strategy_multiplier``.

Components (docs/environment.md, "Scoring"):

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
* ``executable`` - share of the treated teeth whose prescription an aligner series can carry
  out: every planned increment within the per-stage limits (with LIMIT_TOLERANCE) and the
  aligners reaching the target by the last stage (a plan-level check; not in the terminal).
* ``smoothness`` - mean over moved teeth of ``mean(d)^2 / mean(d^2)`` over the 24
  planned advances ``d`` (each increment as far as it extends the aligners' reach from the
  initial poses, :func:`server.dynamics.reach_advances`: the increment itself on an interpolated
  plan's straight path, 0 for a step back over ground already covered) (1 for constant speed
  through the treatment, k/24 for a tooth moving in k stages, lower for uneven speed), times the
  tooth's path efficiency
  (:func:`path_efficiency`: its net planned movement over the path its aligners take, less a
  share for every millimetre of detour, 1 on the straight path of an interpolated plan): a tooth
  that reverses (a jiggle, a round trip) moves more than it needs and is not paid for the
  evenness of its detours.
* ``staging`` - ``(rho + 1) / 2`` with ``rho`` the *sequence concordance* in [-1, 1]
  between the declared strategy's staging order and the order in which the treated teeth
  actually move (:func:`server.movement_order.sequence_concordance`: by each tooth's movement centroid, the mean
  aligner of its planned movement, not by its start stage alone; 0.5 when no strategy is
  declared).
* ``strategy_multiplier`` - 1.2 optimal, 1.0 neutral, 0.6 wrong; a declared strategy
  the sequence contradicts (rho < -0.2) counts as wrong, and the optimal one is only
  paid 1.2 when the movement follows its sequence (rho >= 0.45: on average a lead of 1.1
  aligners or more between consecutive levels). On a case with no tooth to treat (``treated_teeth``
  0 in the diagnostics) there is nothing to stage: a declared strategy counts as none (staging 0.5,
  multiplier 1.0), so no label is paid where nothing is done (:func:`strategy_terms`).
* ``occlusion_course`` - occlusion over the course of treatment: the mean, over aligners
  4, 8, ..., 24 (:data:`OCCLUSION_CHECKPOINTS`), of the achieved arch's occlusion gain
  ``(occ_s - occ_0) / max(occ_target - occ_0, 0.02)``, clipped to [0, 1]. A plan that
  reaches a functional bite early and keeps it scores high; one that wrecks the bite
  midway, or arrives only at the end, scores lower; doing nothing scores 0.
* ``realism``, ``anchorage``, ``movement_prior`` - :mod:`server.movement_priors` on
  (initial, final achieved) and, for anchorage, the achieved trajectory's staging load
  (the root area at rest behind each millimetre moved).

Hard-rule breaches (diagnostics; :mod:`server.reward_scaler` orders every breaking plan below
every safe one): ``limit_breach`` = sum over stages and judged teeth of ``(r - 1 - LIMIT_TOLERANCE)+``;
``pdl_breach`` = sum over stages and teeth of ``(stress / PDL_CRITICAL_KPA - 1)+``;
``collision_breach`` = sum over stages and contacts of ``(pen - tol)+ / tol`` with ``tol`` =
COLLISION_TOLERANCE_MM. ``scaled_reward`` is :func:`server.reward_scaler.scale_rewards` of the
terminal score and their sum.

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

from server.absent_teeth import mask_pairs
from server.clinical_profiles import SEQUENCED_TEETH, STRATEGY_LEVELS, strategy_multiplier_class
from server.collisions import (
    ALL_PAIR_CROWNS,
    COLLISION_TOLERANCE_MM,
    all_pairs_penetration_mm,
    collision_severity,
    contact_major,
)
from server.contact_rules import arch_breaches
from server.dental_constants import (
    ADJACENT_PAIRS,
    ALIGNER_FORCE_N_PER_DEG,
    ALIGNER_FORCE_N_PER_MM,
    LIMIT_TOLERANCE,
    MAX_ROTATION_DEG,
    MAX_TRANSLATION_MM,
    MIRROR_INDEX,
    MM_PER_DEG,
    N_STAGES,
    PDL_CRITICAL_KPA,
    PDL_OPTIMAL_KPA,
    ROOT_AREA_MM2,
)
from server.dynamics import designed_steps, engaged, engaging_steps, reach_advances
from server.movement_order import movement_centroid, sequence_concordance
from server.movement_priors import CombinedPrior
from server.occlusion import (
    occlusion_composite,
)
from server.quaternion_utils import components, pose_distances, quaternion_angle, vector_norm
from server.reward_scaler import scale_rewards

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
"""Sequence concordance below which a declared strategy is contradicted by the plan (wrong)."""
STAGING_FOLLOWS_RHO: float = 0.45
"""Sequence concordance from which the optimal strategy earns its 1.2."""
RHO_ROUNDING: float = 1e-9
"""A concordance this close below a threshold is on it: leads in whole aligners over LEAD_STAGES give
concordances such as 0.45 exactly, which the floating-point mean can put at 0.44999999999999996."""
OCCLUSION_CHECKPOINTS: tuple[int, ...] = (4, 8, 12, 16, 20, 24)
"""Aligners at which ``occlusion_course`` judges the achieved bite (24 = the final one)."""
OCCLUSION_GAIN_FLOOR: float = 0.02
"""Smallest occlusion gap (target - initial) a gain is measured against."""
OVERSHOOT_WEIGHT: float = 1.0
"""Extra error per mm-equivalent a tooth ends past its target: overshooting by x costs ``(1 +
OVERSHOOT_WEIGHT) x`` of accuracy, stopping short by x costs x. Stopping short leaves a movement
to finish; going past it moves the tooth into a position it never needed (the root too) and must
be undone: a mirrored malocclusion is no better than the one treated."""
OVERSHOOT_TOLERANCE_MM: float = 0.1
"""An achieved overshoot up to OVERSHOOT_TOLERANCE_SHARE of the tooth's movement, or up to this
(mm-equivalent, the model's resolution) if that is more, is a finishing error (it costs accuracy);
past both it is the hard rule ``overshoot``: the plan drove the tooth well beyond the position it was
prescribed, into a malocclusion of its own."""
OVERSHOOT_TOLERANCE_SHARE: float = 0.25
"""Share of a tooth's movement it may overshoot before the hard rule (see OVERSHOOT_TOLERANCE_MM)."""
_CHECKPOINTS = np.array(OCCLUSION_CHECKPOINTS)
_SCHEDULE = _CHECKPOINTS / N_STAGES
"""(C,) the share of the treatment uniform staging has delivered at each occlusion checkpoint."""
_NO_LEVELS = np.zeros(28, dtype=np.int64)
_ALL_TEETH = np.ones(28, dtype=bool)

_PRIOR = CombinedPrior()


def movement_mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-tooth mm-equivalent distance between poses (..., 28, 7) a and b."""
    t = vector_norm(a[..., 4:] - b[..., 4:])
    r = np.degrees(quaternion_angle(a[..., :4], b[..., :4]))
    return np.hypot(t, MM_PER_DEG * r)


def increments(poses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Translation (mm) and rotation (deg) from each stage to the next: (..., S-1, 28) each."""
    t, r = designed_steps(poses)
    return t, np.degrees(r)


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


@dataclass(frozen=True)
class StageMeasures:
    """Per-stage quantities of B trajectories; axis -2 is stage 1..24.

    inc_t, inc_r: (B, 24, 28) planned increments, aligner s vs aligner s-1 (mm, deg).
    mis_t, mis_r: (B, 24, 28) insertion mismatch, aligner s vs the poses achieved at s-1, as far as
        the aligner engages it (:func:`server.dynamics.engaged`).
    achieved_mm: (B, 24, 28) achieved increments (mm-equivalent).
    penetration: (B, 24, 26) adjacent-crown penetration of the achieved arch (mm).
    """

    inc_t: np.ndarray
    inc_r: np.ndarray
    mis_t: np.ndarray
    mis_r: np.ndarray
    achieved_mm: np.ndarray
    penetration: np.ndarray
    second_penetration: np.ndarray | None = None
    """(B, 24, 24) second-neighbour penetration of the achieved arch, when measured with the rest."""


def stage_measures(
    planned: np.ndarray,
    achieved: np.ndarray,
    width_mm: np.ndarray,
    depth_mm: np.ndarray,
    lagging: np.ndarray | None = None,
    steps: tuple[np.ndarray, np.ndarray] | None = None,
    absent: np.ndarray | None = None,
) -> StageMeasures:
    """StageMeasures of (B, 25, 28, 7) planned and achieved trajectories.

    ``achieved is planned`` (ideal dynamics) skips the second pass; ``lagging`` (B,) bool marks
    the rows whose teeth may lag the plan (the others' achieved trajectory is their planned one, so
    their mismatches and achieved increments are the planned increments: only the lagging rows
    are measured twice); None: every row. ``steps``: the planned trajectories' designed steps (mm,
    rad), (B, 24, 28) each, when at hand (:func:`server.dynamics.designed_steps`). ``absent``
    (B, 28) bool: the cases' absent teeth, whose pairs read no contact (:mod:`server.absent_teeth`).
    """
    inc_t, inc_r = designed_steps(planned) if steps is None else steps
    inc_r = np.degrees(inc_r)
    if lagging is not None and not lagging.any():
        achieved = planned
    if achieved is planned:  # the teeth sit exactly in the previous aligner
        mis_t, mis_r = inc_t, inc_r
        achieved_mm = np.hypot(inc_t, MM_PER_DEG * inc_r)
    elif lagging is None or lagging.all():
        mis_t, mis_r, achieved_mm = _lag_measures(planned, achieved, inc_t, inc_r)
    else:
        mis_t, mis_r, achieved_mm = inc_t.copy(), inc_r.copy(), np.hypot(inc_t, MM_PER_DEG * inc_r)
        mis_t[lagging], mis_r[lagging], achieved_mm[lagging] = _lag_measures(
            planned[lagging], achieved[lagging], inc_t[lagging], inc_r[lagging]
        )
    both = all_pairs_penetration_mm(achieved[:, 1:], width_mm[:, None], depth_mm[:, None])
    both = mask_pairs(both, absent, ALL_PAIR_CROWNS)
    pen = contact_major(both[..., : len(ADJACENT_PAIRS)])
    return StageMeasures(inc_t, inc_r, mis_t, mis_r, achieved_mm, pen, both[..., len(ADJACENT_PAIRS) :])


def _lag_measures(
    planned: np.ndarray, achieved: np.ndarray, inc_t: np.ndarray, inc_r: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """StageMeasures' ``mis_t``, ``mis_r`` and ``achieved_mm`` of trajectories whose teeth lag the
    plan, given their planned increments (mm, deg)."""
    planned, achieved = components(planned), components(achieved)  # (7, B, 25, 28)
    mis_t, mis_r = pose_distances(planned[..., 1:, :], achieved[..., :-1, :])
    a_t, a_r = pose_distances(achieved[..., 1:, :], achieved[..., :-1, :])
    return (
        engaged(mis_t, inc_t),
        engaged(np.degrees(mis_r), inc_r),
        np.hypot(a_t, MM_PER_DEG * np.degrees(a_r)),
    )


def hard_rule_breaches(
    m: StageMeasures, ratio: np.ndarray | None = None, stress: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """The three hard rules' breaches (B,) of trajectories' StageMeasures (see the module docstring):
    ``limit_breach``, ``pdl_breach``, ``collision_breach``; all 0 for a plan that breaks none.
    ``ratio`` (:func:`limit_ratio`) and ``stress`` (:func:`pdl_stress_kpa`), (B, 24, 28), when at hand."""
    if ratio is None:
        ratio = limit_ratio(m.inc_t, m.inc_r)
    if stress is None:
        stress = pdl_stress_kpa(m.mis_t, m.mis_r)
    return {
        "limit_breach": np.sum(np.maximum(ratio - 1.0 - LIMIT_TOLERANCE, 0.0), axis=(-2, -1)),
        "pdl_breach": np.sum(np.maximum(stress / PDL_CRITICAL_KPA - 1.0, 0.0), axis=(-2, -1)),
        "collision_breach": np.sum(np.maximum(m.penetration - COLLISION_TOLERANCE_MM, 0.0), axis=(-2, -1))
        / COLLISION_TOLERANCE_MM,
    }


def all_breaches(
    initial: np.ndarray,
    target: np.ndarray,
    width_mm: np.ndarray,
    depth_mm: np.ndarray,
    planned: np.ndarray,
    achieved: np.ndarray,
    measures: StageMeasures | None = None,
    absent: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Every hard rule's breach (B,) of trajectories (what :func:`score_episodes` reports, without the
    quality terms): :func:`hard_rule_breaches`, :func:`server.contact_rules.arch_breaches` and ``overshoot_breach``."""
    m = stage_measures(planned, achieved, width_mm, depth_mm, absent=absent) if measures is None else measures
    out = hard_rule_breaches(m)
    out.update(
        arch_breaches(initial, target, width_mm, depth_mm, planned, achieved, m.second_penetration, absent)
    )
    need, error, delivered = movement_mm(
        np.array((initial, achieved[:, -1], initial)), np.array((target, target, achieved[:, -1]))
    )
    out["overshoot_breach"] = overshoot_breach(need, overshoot(need, delivered, error))
    return out


PATH_DETOUR_EPS_MM: float = 1e-6
"""A planned path longer than the net movement by no more than this (mm-equivalent) is straight:
floating-point noise of an interpolated plan's increments, not a detour."""
PATH_DETOUR_SCALE_MM: float = MAX_TRANSLATION_MM
"""Detour (planned path beyond the net movement, mm-equivalent) at which a tooth's path efficiency
reaches 0 whatever its net movement: a tooth whose aligners travel one per-stage limit more than it
needs has no even staging to be paid for. The ratio alone charges a round trip by its share of the
net movement, next to nothing on a tooth moving several millimetres."""


def path_efficiency(net_mm: np.ndarray, inc_mm: np.ndarray) -> np.ndarray:
    """(..., 28) each tooth's path efficiency, in [0, 1]: its net planned movement over the length
    of its planned path, times ``1 - detour / PATH_DETOUR_SCALE_MM`` (clipped at 0) with ``detour``
    the path beyond the net movement.

    ``net_mm`` (..., 28): the mm-equivalent distance from the first to the last aligner;
    ``inc_mm`` (..., S, 28): the mm-equivalent increments between consecutive aligners. An
    interpolated plan moves each tooth along one straight path (translation on a line, rotation
    about one axis, both at the same share per stage), so its path is its net movement: 1. A tooth
    that reverses (jiggles, goes out and back) travels more than it moves: less than 1, and 0 for a
    tooth moved and returned to where it started or one whose detour reaches PATH_DETOUR_SCALE_MM.
    A tooth that never moves: 1.
    """
    path = inc_mm.sum(axis=-2)
    detour = path - net_mm
    ratio = net_mm / np.maximum(path, 1e-30) * np.clip(1.0 - detour / PATH_DETOUR_SCALE_MM, 0.0, 1.0)
    return np.where(detour > PATH_DETOUR_EPS_MM, ratio, 1.0)


def overshoot(need: np.ndarray, delivered: np.ndarray, error: np.ndarray) -> np.ndarray:
    """(..., 28) mm-equivalent by which each tooth ended past its target: the movement delivered
    beyond the movement needed, at most the final error (a tooth moved off its path by its need is
    off target, not past it)."""
    return np.clip(delivered - need, 0.0, error)


def overshoot_breach(need: np.ndarray, over: np.ndarray) -> np.ndarray:
    """(B,) the hard rule ``overshoot``: sum over teeth of the overshoot ``over`` (B, 28) beyond
    ``max(OVERSHOOT_TOLERANCE_MM, OVERSHOOT_TOLERANCE_SHARE * need)``, in OVERSHOOT_TOLERANCE_MM."""
    tol = np.maximum(OVERSHOOT_TOLERANCE_MM, OVERSHOOT_TOLERANCE_SHARE * need)
    return np.sum(np.maximum(over - tol, 0.0), axis=-1) / OVERSHOOT_TOLERANCE_MM


def occlusion_course(
    occ: np.ndarray, progress: np.ndarray, need: np.ndarray, treated: np.ndarray
) -> np.ndarray:
    """(B,) the bite over the course of treatment, in [0, 1].

    ``occ`` (B, C + 2): the occlusion composite at the checkpoints, then of the initial and the
    target arch; ``progress`` (B, C, 28): each tooth's share of its movement achieved at each
    checkpoint; ``need`` (B, 28) mm-equivalent; ``treated`` (B, 28).

    The occlusion gain at checkpoint ``s`` is credited up to the share of the treatment uniform
    staging has delivered by then (``s / 24``), so being on schedule earns full credit and rushing
    some teeth ahead earns nothing more; the credit is then discounted by the arch's left-right
    imbalance: the need-weighted mean gap in progress between contralateral treated teeth, at the
    checkpoint where it is widest. A plan
    that keeps a functional, symmetric bite throughout scores 1; one that wrecks it midway, lags,
    or finishes one side long before the other scores less; doing nothing scores 0.
    """
    c = len(OCCLUSION_CHECKPOINTS)
    gap = np.maximum(occ[:, -1] - occ[:, -2], OCCLUSION_GAIN_FLOOR)
    gain = (occ[:, :c] - occ[:, -2:-1]) / gap[:, None]
    on_schedule = np.sum(np.clip(gain, 0.0, _SCHEDULE), axis=-1) / np.sum(_SCHEDULE)
    paired = treated & treated[:, MIRROR_INDEX]
    weight = np.where(paired, np.minimum(need, need[:, MIRROR_INDEX]), 0.0)  # each pair counted twice
    imbalance = np.abs(progress - progress[..., MIRROR_INDEX])  # (B, C, 28)
    imbalance = np.sum(imbalance * weight[:, None], axis=-1) / np.maximum(weight.sum(-1), 1e-9)[:, None]
    return np.clip(on_schedule * (1.0 - imbalance.max(axis=-1)), 0.0, 1.0)


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


def strategy_terms(
    profiles: list[str],
    strategies: list[str | None],
    secondary_profiles: list[str | None],
    inc_mm: np.ndarray,
    treated: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(staging, strategy_multiplier, sequence_concordance)``, (B,) each, of B plans' declared
    strategies (see the module docstring).

    Args:
        profiles, secondary_profiles: the B cases' profiles (they set the optimal strategy).
        strategies: the B declared strategies (None, or an unknown one: none declared).
        inc_mm: (B, 24, 28) planned increments (mm-equivalent).
        treated: (B, 28) the teeth each case needs moved.

    A strategy counts only on a case with a tooth to treat: a case with nothing to move has nothing
    to stage, so a strategy declared for it counts as none (staging 0.5, multiplier neutral) and no
    label is paid where nothing is done; doing nothing there scores as a plan without a strategy.
    """
    stageable = treated.any(axis=-1)
    declared = [s if s in STRATEGY_LEVELS and ok else None for s, ok in zip(strategies, stageable)]
    levels = np.array([STRATEGY_LEVELS[s] if s else _NO_LEVELS for s in declared])
    sequenced = np.array([SEQUENCED_TEETH[s] if s else _ALL_TEETH for s in declared])
    rho = sequence_concordance(levels, movement_centroid(inc_mm), treated & sequenced)
    has_strategy = np.array([s is not None for s in declared])
    staging = np.where(has_strategy, (rho + 1.0) / 2.0, 0.5)
    classes = [strategy_multiplier_class(p, s, q) for p, s, q in zip(profiles, declared, secondary_profiles)]
    classes = [
        "wrong"
        if s is not None and r < STAGING_AGAINST_RHO
        else ("neutral" if c == "optimal" and r < STAGING_FOLLOWS_RHO - RHO_ROUNDING else c)
        for c, s, r in zip(classes, declared, rho)
    ]
    return staging, np.array([STRATEGY_MULTIPLIERS[c] for c in classes]), rho


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
    secondary_profiles: list[str | None] | None = None,
    absent: np.ndarray | None = None,
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
        secondary_profiles: B secondary profiles (task_hard; None otherwise), which can change
            the optimal strategy (:func:`server.clinical_profiles.optimal_strategy`).
        absent: (B, 28) bool, the cases' absent teeth (None: every tooth present). Their rows are
            placeholders no plan moves (:mod:`server.absent_teeth`); ``measures`` given with it were
            measured with it.
    """
    b = initial.shape[0]
    final = achieved[:, -1]
    # every per-tooth distance in one pass: initial -> target (the need), last aligner -> target,
    # final -> target, initial -> final (the movement delivered)
    need, plan_error, final_error, delivered, planned_delivered = movement_mm(
        np.array((initial, planned[:, -1], final, initial, initial)),
        np.array((target, target, target, final, planned[:, -1])),
    )  # (B, 28) each
    treated = need > MOVEMENT_EPS_MM
    over = overshoot(need, delivered, final_error)

    m = stage_measures(planned, achieved, width_mm, depth_mm, absent=absent) if measures is None else measures
    inc_t, inc_r = m.inc_t, m.inc_r  # (B, 24, 28)
    inc_mm = np.hypot(inc_t, MM_PER_DEG * inc_r)
    moved = (inc_mm > INCREMENT_EPS_MM).any(axis=-2)
    judged = treated | moved

    ratio = limit_ratio(inc_t, inc_r)
    violations = ratio > 1.0 + LIMIT_TOLERANCE
    peak_ratio = ratio.max(axis=-2)
    limits = _masked_mean(np.clip(1.0 - (peak_ratio - 1.0 - LIMIT_TOLERANCE), 0.0, 1.0), judged, 1.0)
    # the last aligner reaches the target or, overcorrected along the tooth's path, goes beyond it
    # (force decay needs the overcorrection; what the teeth then achieve is judged by accuracy)
    reaches = (planned_delivered >= need - MOVEMENT_EPS_MM) & (
        plan_error <= MOVEMENT_EPS_MM + np.maximum(planned_delivered - need, 0.0)
    )
    executable = _masked_mean((peak_ratio <= 1.0 + LIMIT_TOLERANCE) & reaches, treated, 1.0)

    stress = pdl_stress_kpa(m.mis_t, m.mis_r)  # (B, 24, 28)
    breaches = hard_rule_breaches(m, ratio, stress)
    breaches.update(
        arch_breaches(initial, target, width_mm, depth_mm, planned, achieved, m.second_penetration, absent)
    )
    breaches["overshoot_breach"] = overshoot_breach(need, over)
    peak = stress.max(axis=-2)
    pdl = _masked_mean(pdl_tooth_score(peak), judged, 1.0)

    pen = m.penetration  # (B, 24, 26)
    collision_free = 1.0 - collision_severity(pen).mean(axis=-1)

    error = final_error + OVERSHOOT_WEIGHT * over
    accuracy = np.clip(1.0 - error.sum(-1) / np.maximum(need.sum(-1), 1e-9), 0.0, 1.0)
    checkpoints = _CHECKPOINTS
    at_checkpoints = achieved[:, checkpoints]  # (B, C, 28, 7)
    occ = occlusion_composite(
        np.concatenate((at_checkpoints, initial[:, None], target[:, None]), axis=1),
        target[:, None],
        width_mm[:, None],
        None if absent is None else absent[:, None],
    )  # (B, C + 2)
    occlusion = occ[:, len(checkpoints) - 1]
    left = movement_mm(at_checkpoints, target[:, None])  # (B, C, 28)
    progress = np.where(
        treated[:, None], np.clip(1.0 - left / np.maximum(need, 1e-9)[:, None], 0.0, 1.0), 1.0
    )
    course = occlusion_course(occ, progress, need, treated)

    forward_t, forward_r = engaging_steps(inc_t, np.radians(inc_r), *reach_advances(planned))
    forward = np.where(
        (forward_t == inc_t) & (forward_r == np.radians(inc_r)),
        inc_mm,
        np.hypot(forward_t, MM_PER_DEG * np.degrees(forward_r)),
    )  # (B, 24, 28) the increments as far as they advance: inc_mm on a straight path
    mean_d = forward.mean(axis=-2)
    mean_d2 = (forward**2).mean(axis=-2)
    tooth_smooth = np.clip(np.where(mean_d2 > 0, mean_d**2 / np.maximum(mean_d2, 1e-30), 1.0), 0.0, 1.0)
    tooth_smooth = tooth_smooth * path_efficiency(planned_delivered, inc_mm)
    smoothness = _masked_mean(tooth_smooth, moved, 1.0)

    starts = start_stages(inc_mm)
    secondary = secondary_profiles if secondary_profiles is not None else [None] * b
    staging, multiplier, rho = strategy_terms(profiles, strategies, secondary, inc_mm, treated)

    realism, anchorage, prior = (
        np.asarray(x, dtype=float).reshape(b)
        for x in _PRIOR.parts_from_movement(delivered, stage_mm=m.achieved_mm, absent=absent)
    )

    components = {
        "accuracy": accuracy,
        "occlusion_composite": occlusion,
        "occlusion_course": course,
        "collision_free": collision_free,
        "pdl_feasibility": pdl,
        "limits_compliance": limits,
        "executable": executable,
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
        "scaled_reward": scale_rewards(terminal, sum(breaches.values())),
        **breaches,
        "limit_violations": violations.sum(axis=(-2, -1)),
        "colliding_contacts": (pen > COLLISION_TOLERANCE_MM).sum(axis=(-2, -1)),
        "pdl_over_critical": (stress > PDL_CRITICAL_KPA).sum(axis=(-2, -1)),
        "sequence_concordance": rho,
        "treated_teeth": treated.sum(axis=-1).astype(float),
        "peak_pdl_kpa": np.where(judged, peak, 0.0).max(axis=-1),
        "overshoot_mm": over.max(axis=-1),
    }
    return EpisodeScores(components, terminal, diagnostics, starts)
