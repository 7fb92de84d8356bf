"""The rule-based clinical stager (the oracle): observation -> treatment plan.

It reads what a clinician reads on the initial casts and the setup (the
observation's initial and target configurations), names the malocclusion from
the movements the setup asks for, picks that profile's strategy, and stages the
teeth in the strategy's order:

1. diagnosis: transverse expansion of the premolars -> crowding; distalisation of
   the upper molars -> Class II; lingual retraction of the upper incisors beyond
   that -> protrusion/spacing; intrusion of the incisors -> deep bite; large
   long-axis rotations -> irregularity (each feature scaled by its severe magnitude,
   the largest wins; all small -> mild irregularity);
2. staging: every level of the strategy's sequence gets its own start aligner, spread
   evenly over the first half of treatment (five levels: aligners 1, 4, 7, 10, 13; written
   as ``priority`` where it is one of 1 / 7 / 13, else as ``start_stage``); the first level
   moves briskly (80 % of the per-stage limits) to open space early, later levels at the
   slowest constant speed that still finishes in time (aligners near the end are kept for
   refinement under force decay); a level that cannot finish from its slot at 95 % of
   the limits starts earlier. A long correction (a severe distalisation) that leaves little
   slack is staggered within that slack, every level brisk. On task_hard the second
   malocclusion is read too: a secondary Class II makes the case ``distal_first``
   (:func:`server.clinical_profiles.optimal_strategy`), and a candidate starts the second
   profile's first level at aligner 1;
3. the candidates are checked on the simulator (as a clinician checks the setup's
   animation, with the case's dynamics and compliance schedule), and the best by the scaled
   reward is kept; a staging that breaks a hard rule is *repaired* as a clinician refines a
   setup: the teeth in the colliding contacts, over-stressed or over-limit are started
   earlier or later or slowed, a lagging tooth's mesial chain is delayed, two colliding
   neighbours are moved one after the other, and the result re-checked, for a few rounds.
   Under force decay the best staged candidates are also tried *compensated*: each tooth
   overcorrected by the share of its movement the simulator shows it fails to express, within
   the per-stage limits (:func:`server.setup_refinement.compensate`), and tried again with the overcorrection trimmed on
   the teeth whose aligner shapes would collide (:func:`~server.setup_refinement.relieve_aligner_collisions`, coarsely and
   finely, both teeth of a pair or the more overcorrected one); the best safe staging (uniform
   included) is compensated too, as trimming overcorrection cannot undo a staging's own
   collisions. Teeth outside the strategy's sequence (the lower dentition of a Class II, moved
   by elastics) move together at the slowest speed.
   Uniform staging with the strategy named is a candidate too, so the oracle never scores
   below uniform SLERP (with full wear every case has a safe uniform staging, :mod:`server.cases`). A
   diagnosis the check judges wrong (the wrong multiplier) is revised to the next most
   likely malocclusion.
4. with non-compliance a tooth whose attachment debonds lags its neighbours while the aligners it
   does not wear move on; where the chosen staging still breaks a rule, the lagging tooth (alone, with
   its neighbours, its quadrant, its arch or every tooth) is rescheduled to move before or after the
   aligners it lags in, within the limits (:func:`server.oracle_fallback.safe_fallback`); failing that, the staging is slowed
   until it breaks none (a safe plan that leaves movement undone outranks one that harms: slowed to
   nothing it keeps the teeth where they are). A staging that already breaks no rule is kept as it is.

It is the expert that writes SFT demonstrations and the upper baseline of every
evaluation. It never sees the case's profile or optimal strategy, but it does use the
simulator, the case's dynamics and compliance schedule to check its candidates: an upper
baseline, not a model of what a planner can know from the observation alone.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from functools import lru_cache

import numpy as np

from server.cases import Case, generate_case
from server.clinical_profiles import OPTIMAL_STRATEGY, STRATEGY_LEVELS, optimal_strategy
from server.dental_constants import IS_UPPER, N_STAGES, SIDE, TOOTH_IDS, TOOTH_NUMBER
from server.oracle_fallback import safe_fallback, slower_fallback
from server.quaternion_utils import (
    quaternion_inverse,
    quaternion_multiply,
    quaternion_rotate,
    quaternion_to_rotvec,
)
from server.reward_scaler import breach_total
from server.scoring import STRATEGY_MULTIPLIERS
from server.setup_refinement import (
    RELIEF_TRIMS,
    REPAIR_STARTS,
    compensate,
    relieve_aligner_collisions,
    repair_staging,
    score_stagings,
)
from server.staging import (
    BRISK,
    LEVEL_SPAN,
    Staging,
    arrays_to_plan,
    limit_speeds,
    quantise_fractions,
    stage_arrays,
)

FEATURE_SCALE: dict[str, float] = {
    "crowding": 1.76,  # mm of premolar expansion in a severe crowding
    "class_ii": 4.0,  # mm of upper molar distalisation
    "protrusion_spacing": 2.25,  # mm of upper incisor retraction beyond the molars'
    "deep_bite": 3.0,  # mm of incisor intrusion, both arches together
    "mild_irregularity": 16.0,  # deg, mean of the six largest long-axis rotations
}
DIAGNOSIS_THRESHOLD: float = 0.12
"""Scaled features below this everywhere mean a mild irregularity."""
SECONDARY_THRESHOLD: float = 0.2
"""A second scaled feature from this size is read as a second malocclusion."""
COMPENSATED: int = 1
"""Staged candidates (the best by terminal score) also tried overcorrected under force decay."""
ORACLE_CACHE_SIZE: int = 4096
"""Oracle plans kept per process (LRU) for generated cases, as many as the case cache holds."""


def _arch_max(values: np.ndarray, mask: np.ndarray) -> float:
    """The larger of the upper-arch and lower-arch means of ``values`` over ``mask``."""
    return max(float(np.mean(values[mask & IS_UPPER])), float(np.mean(values[mask & ~IS_UPPER])))


def diagnose(initial: np.ndarray, target: np.ndarray) -> dict[str, float]:
    """Scaled movement features of the setup (initial -> target), one per profile."""
    delta = target[:, 4:] - initial[:, 4:]
    labial = quaternion_rotate(target[:, :4], np.array([0.0, 1.0, 0.0]))
    long_axis = quaternion_rotate(target[:, :4], np.array([0.0, 0.0, 1.0]))
    rel = quaternion_to_rotvec(quaternion_multiply(quaternion_inverse(initial[:, :4]), target[:, :4]))
    rotation = np.degrees(np.abs(np.sum(quaternion_rotate(initial[:, :4], rel) * long_axis, axis=-1)))
    premolars = np.isin(TOOTH_NUMBER, (4, 5))
    upper_molars = np.isin(TOOTH_NUMBER, (6, 7)) & IS_UPPER
    upper_incisors = np.isin(TOOTH_NUMBER, (1, 2)) & IS_UPPER
    lower_incisors = np.isin(TOOTH_NUMBER, (1, 2)) & ~IS_UPPER
    expansion = _arch_max(SIDE * delta[:, 0], premolars)
    distal = float(np.mean(-delta[upper_molars, 1]))
    retraction = float(np.mean(-np.sum(delta[upper_incisors] * labial[upper_incisors], axis=-1))) - max(
        distal, 0
    )
    intrusion = float(np.mean(delta[upper_incisors, 2]) - np.mean(delta[lower_incisors, 2]))
    irregularity = float(np.mean(np.sort(rotation)[-6:]))
    raw = {
        "crowding": expansion,
        "class_ii": distal,
        "protrusion_spacing": retraction,
        "deep_bite": intrusion,
        "mild_irregularity": irregularity,
    }
    return {k: v / FEATURE_SCALE[k] for k, v in raw.items()}


def infer_profile(initial: np.ndarray, target: np.ndarray) -> str:
    """The malocclusion the setup mainly corrects (the largest scaled feature)."""
    return infer_profiles(initial, target)[0]


def infer_profiles(initial: np.ndarray, target: np.ndarray) -> tuple[str, str | None]:
    """The main malocclusion and a second one (the next largest feature above the threshold), if any."""
    features = diagnose(initial, target)
    ranked = sorted(features, key=features.get, reverse=True)
    if features[ranked[0]] < DIAGNOSIS_THRESHOLD:
        return "mild_irregularity", None
    if ranked[0] != "class_ii" and features["class_ii"] >= SECONDARY_THRESHOLD:
        return ranked[0], "class_ii"  # it sets the sequence (optimal_strategy), whatever ranks second
    second = ranked[1] if features[ranked[1]] >= SECONDARY_THRESHOLD else None
    return ranked[0], second


def _candidates(case: Case, strategy: str, secondary: str | None) -> list[Staging]:
    """Stagings to check: the strategy's sequence (brisk or not, three spans), a second profile's
    first movers leading (when it has another strategy), the sequence packed into the slack of a
    long correction, and uniform staging (always last)."""
    last = N_STAGES - (5 if case.force_decay else 0)
    ini, tgt = case.initial, case.target
    out = [
        stage_arrays(ini, tgt, strategy, last, brisk, span)
        for brisk in (True, False)
        for span in (LEVEL_SPAN, LEVEL_SPAN - 4, LEVEL_SPAN + 4)
    ]
    out += [
        stage_arrays(ini, tgt, strategy, last, span=span, all_brisk=True)
        for span in (LEVEL_SPAN - 4, LEVEL_SPAN)
    ]
    if secondary is not None and OPTIMAL_STRATEGY[secondary] != strategy:
        lead = STRATEGY_LEVELS[OPTIMAL_STRATEGY[secondary]] == 0
        out += [stage_arrays(ini, tgt, strategy, last, brisk, LEVEL_SPAN, lead) for brisk in (True, False)]
    # the slack a long correction leaves: stagger the levels within it, every level at brisk speed
    # (under force decay also without keeping the last aligners for refinement)
    limit_fraction = limit_speeds(ini, tgt)
    treated = limit_fraction < 1.0
    for end in sorted({last, N_STAGES}):
        if end != last:
            out.append(stage_arrays(ini, tgt, strategy, end))
        if treated.any():
            slack = end - int(np.ceil(1.0 / (BRISK * limit_fraction[treated].min()) - 1e-9))
            if 1 <= slack < LEVEL_SPAN - 4:
                out.append(stage_arrays(ini, tgt, strategy, end, span=slack, all_brisk=True))
    return [*((st, f, np.zeros(len(TOOTH_IDS))) for st, f in out), uniform_staging()]


def uniform_staging() -> Staging:
    """Uniform staging to 6 decimals: within ~1e-5 of exact uniform SLERP on the scaled reward."""
    n = len(TOOTH_IDS)
    return np.ones(n, dtype=np.int64), np.full(n, round(1.0 / N_STAGES, 6)), np.zeros(n)


def _slowest(staging: Staging) -> Staging:
    """The staging with every tooth at the slowest speed that still finishes by the last aligner
    (more room under the limits for overcorrection)."""
    start, _, oc = staging
    return start, quantise_fractions(1.0 / (N_STAGES - start + 1)), oc


def _best_staging(case: Case, strategy: str, secondary: str | None) -> tuple[Staging, dict]:
    """The best checked (and, where needed, repaired) staging under ``strategy``, and its result.
    Under force decay the best staged candidates are also tried compensated
    (:func:`server.setup_refinement.compensate`)."""
    last = N_STAGES - (5 if case.force_decay else 0)
    candidates = _candidates(case, strategy, secondary)
    results = score_stagings(case, strategy, candidates)
    if case.force_decay:
        terminal = np.array([r["terminal_reward"] for r in results])
        safe = np.array([not r["broken_rules"] for r in results])
        quality = list(np.argsort(-terminal[:-1], kind="stable")[:COMPENSATED])
        if safe.any():  # and the best safe staging (uniform included): a breaking one's collisions stay
            best_safe = int(np.flatnonzero(safe)[np.argmax(terminal[safe])])
            quality += [best_safe] if best_safe not in quality else []
        extra = compensate(case, [x for k in quality for x in (candidates[k], _slowest(candidates[k]))])
        extra = extra + relieve_aligner_collisions(case, extra, RELIEF_TRIMS)
        # uniform staging stays last (the fallback the repair logic knows)
        candidates = [*candidates[:-1], *extra, candidates[-1]]
        results = [*results[:-1], *score_stagings(case, strategy, extra), results[-1]]
    scaled = np.array([r["scaled_reward"] for r in results])
    best = int(np.argmax(scaled))
    uniform = len(candidates) - 1
    if results[best]["broken_rules"] or best == uniform:
        # refine the staged candidates with the best terminal scores, in turn, until one comes out
        # safe; uniform staging last, when it breaks a rule itself
        breach = np.array([breach_total(r["diagnostics"]) for r in results])
        quality = np.array([-r["terminal_reward"] for r in results])
        staged = [k for k in np.argsort(quality, kind="stable") if k != uniform and breach[k] > 0.0]
        order = staged[:REPAIR_STARTS] + ([uniform] if breach[uniform] > 0.0 else [])
        for k in order:
            fixed = repair_staging(case, candidates[k], float(breach[k]), last)
            if fixed is None:
                continue
            fixed_result = score_stagings(case, strategy, [fixed])[0]
            if fixed_result["scaled_reward"] > scaled[best]:
                return fixed, fixed_result
            break
    if results[best]["broken_rules"]:
        return slower_fallback(case, strategy, candidates[-1], results[best]) or (
            candidates[best],
            results[best],
        )
    return candidates[best], results[best]


def plan_for_case(case: Case) -> dict:
    """The oracle's plan for a case (its dynamics and compliance included).

    A diagnosis that the simulator's check judges wrong (the strategy earns the wrong
    multiplier) is revised: the next most likely malocclusion's strategy is staged and checked too.
    A staging that still breaks a rule (a tooth the wear leaves behind, which no candidate survived)
    is replaced by the best safe one :func:`server.oracle_fallback.safe_fallback` finds from it and from uniform staging.
    """
    primary, secondary = infer_profiles(case.initial, case.target)
    strategy = optimal_strategy(primary, secondary)
    staging, result = _best_staging(case, strategy, secondary)
    if result["reward_breakdown"]["strategy_multiplier"] < STRATEGY_MULTIPLIERS["neutral"]:
        features = diagnose(case.initial, case.target)
        for profile in sorted(features, key=features.get, reverse=True)[:3]:
            other = optimal_strategy(profile, secondary if secondary != profile else None)
            if other == strategy:
                continue
            alt, alt_result = _best_staging(case, other, secondary)
            if alt_result["scaled_reward"] > result["scaled_reward"]:
                strategy, staging, result = other, alt, alt_result
    if result["broken_rules"]:
        found = safe_fallback(case, strategy, [staging, uniform_staging()])
        if found is not None:
            staging, result = found
    return arrays_to_plan(strategy, *staging, absent=case.absent)


def oracle_plan(observation: dict) -> dict:
    """The oracle's plan for an observation (a reset observation of the environment)."""
    initial = np.asarray(observation["initial_config"], dtype=np.float64)
    target = np.asarray(observation["target_config"], dtype=np.float64)
    key = (
        observation["task_id"],
        int(observation["seed"]),
        bool(observation.get("force_decay", False)),
        bool(observation.get("non_compliance", False)),
    )
    case = generate_case(*key)
    if not (np.array_equal(case.initial, initial) and np.array_equal(case.target, target)):
        return plan_for_case(replace(case, initial=initial, target=target))
    return copy.deepcopy(_plan_for_key(*key))


@lru_cache(maxsize=ORACLE_CACHE_SIZE)
def _plan_for_key(task_id: str, seed: int, force_decay: bool, non_compliance: bool) -> dict:
    """The oracle's plan for a generated case, cached: the oracle is deterministic and costs
    20-150 ms a case (SFT data, tokenizer corpora, baselines and gates ask for the same seeds)."""
    return plan_for_case(generate_case(task_id, seed, force_decay, non_compliance))
