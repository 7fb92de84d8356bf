"""The scale GRPO sees: a terminal score in [0, 1] and the plan's hard-rule breaches -> [-2, 8].

**The ordering principle.** Every plan that breaks a hard clinical rule scores below every plan
that breaks none, doing nothing included. The hard rules, each judged at every stage on every
tooth or contact (:func:`server.scoring.score_episodes` measures them):

* **collision** - adjacent crowns of the achieved arch penetrating by more than
  :data:`server.collisions.COLLISION_TOLERANCE_MM` (0.11 mm: contact, not collision);
* **PDL stress** - the periodontal-ligament pressure at aligner insertion above
  :data:`server.dental_constants.PDL_CRITICAL_KPA` (4.7 kPa, Schwarz 1932) on *any* tooth;
* **per-stage limits** - a planned increment beyond 0.25 mm / 2 deg by more than
  :data:`server.dental_constants.LIMIT_TOLERANCE` (5 %);
* **crowns one apart** - crowns with one crown between them (it blocked out of the arch) meeting
  beyond the same 0.11 mm;
* **aligner collision** - the aligner shapes (planned poses), where they differ from the teeth
  (force decay, non-compliance: overcorrected shapes), penetrating as neighbours or crowns one
  apart beyond 0.11 mm: such an aligner cannot be made;
* **occlusal collision** - the bite closing through the opposing crowns: an upper-lower clearance
  of the achieved or the planned arch tighter than both the initial and the target bite by more
  than :data:`server.contact_rules.OCCLUSAL_TOLERANCE_MM` (:func:`server.contact_rules.arch_breaches`);
* **overshoot** - a tooth ending past its target by more than 25 % of its movement and 0.1
  mm-equivalent (:data:`server.scoring.OVERSHOOT_TOLERANCE_SHARE`): a malocclusion made, not treated.

The scale has two bands and a floor:

===============  =======================  ==============================================
band             scaled reward            graded by
===============  =======================  ==============================================
safe             ``8 * raw`` in [0, 8]    clinical quality (the terminal score ``raw``);
                                          doing nothing is 0
failing          in (-2, FAIL_TOP]        how much is broken: ``FAIL_TOP - (FAIL_TOP + 2)
                 = (-2, -0.25]            * b / (b + BREACH_SCALE)`` with ``b`` the breach
                                          (below); never reaches -2
not a plan       -2 (REWARD_MIN)          a completion with no usable tooth group, garbage,
                                          a non-finite score
===============  =======================  ==============================================

The breach ``b`` adds the rules' excesses in comparable units, summed over stages and
teeth (or contacts): ``(r - 1 - LIMIT_TOLERANCE)+`` for each increment ``r`` times the limit;
``(p / PDL_CRITICAL_KPA - 1)+`` for each stress ``p``; ``(pen - tol) / tol`` for each
penetration ``pen`` beyond the tolerance ``tol`` (crowns, aligner shapes, antagonists); the
overshoot beyond its tolerance over 0.1 mm. A group of failing plans therefore still has
an advantage to climb (fewer, smaller breaches), and its top lies below the safe band.

The plainer scale of the project's original specification, ``10 * raw - 2`` with overrides (-1.0
for collision_free < 0.9, -0.5 for pdl_feasibility < 0.5), lets compressed plans that break the
limits, moving every tooth in one aligner, and stress judged on the mean over teeth out-earn safe
staging; this scale ranks every such plan below doing nothing.
"""

from __future__ import annotations

import math

import numpy as np

REWARD_MIN: float = -2.0
"""Not a plan: no usable tooth group, no JSON object, a non-finite score."""
REWARD_MAX: float = 8.0
"""A perfect safe plan."""
SAFE_SCALE: float = REWARD_MAX
"""Safe band: ``SAFE_SCALE * raw``."""
FAIL_TOP: float = -0.25
"""The best a plan that breaks a hard rule can score (an infinitesimal breach)."""
BREACH_SCALE: float = 10.0
"""Breach at which a failing plan sits halfway between FAIL_TOP and REWARD_MIN."""

BREACH_KEYS: dict[str, str] = {
    "collision": "collision_breach",
    "pdl_stress": "pdl_breach",
    "limits": "limit_breach",
    "second_neighbour_collision": "second_collision_breach",
    "aligner_collision": "aligner_collision_breach",
    "occlusal_collision": "occlusal_breach",
    "overshoot": "overshoot_breach",
}
"""Diagnostic key of each hard rule's breach (see :mod:`server.scoring`)."""
HARD_RULES: tuple[str, ...] = tuple(BREACH_KEYS)
"""The hard clinical rules (the names :func:`broken_rules` gives)."""


def breach_total(diagnostics: dict) -> np.ndarray | float:
    """The summed breach of a result's (or a batch's) diagnostics; NaN counts as infinite."""
    total = sum(diagnostics[k] for k in BREACH_KEYS.values())
    if isinstance(total, np.ndarray):
        return np.where(np.isnan(total), np.inf, total)
    return math.inf if math.isnan(total) else float(total)


def broken_rules(diagnostics: dict) -> list[str]:
    """Names of the hard rules a result's diagnostics break (empty for a safe plan)."""
    return [rule for rule, key in BREACH_KEYS.items() if not float(diagnostics.get(key, math.inf)) <= 0.0]


def scale_rewards(raw: np.ndarray, breach: np.ndarray) -> np.ndarray:
    """Scaled rewards of terminal scores ``raw`` and breaches ``breach`` (equal shapes).

    Safe (breach 0): ``SAFE_SCALE * clip(raw, 0, 1)``. Failing (breach > 0, or NaN):
    ``FAIL_TOP - (FAIL_TOP - REWARD_MIN) * b / (b + BREACH_SCALE)``. Non-finite raw: REWARD_MIN.
    """
    raw = np.asarray(raw, dtype=np.float64)
    b = np.nan_to_num(np.asarray(breach, dtype=np.float64), nan=np.inf)
    b = np.maximum(b, 0.0)
    safe = SAFE_SCALE * np.clip(np.nan_to_num(raw, nan=0.0), 0.0, 1.0)
    with np.errstate(invalid="ignore"):
        share = np.where(np.isinf(b), 1.0, b / (b + BREACH_SCALE))
    failing = FAIL_TOP - (FAIL_TOP - REWARD_MIN) * share
    failing = np.maximum(np.nextafter(REWARD_MIN, 0.0), failing)  # the floor belongs to non-plans
    out = np.where(b > 0.0, failing, safe)
    return np.where(np.isfinite(raw), out, REWARD_MIN)


def scale_reward(raw: float, breach: float = 0.0) -> tuple[float, str]:
    """One scaled reward and its band: ``"safe"``, ``"failing"`` or ``"non_finite"``."""
    if not math.isfinite(raw):
        return REWARD_MIN, "non_finite"
    value = float(scale_rewards(np.array([raw]), np.array([breach]))[0])
    return value, "safe" if breach == 0.0 else "failing"
