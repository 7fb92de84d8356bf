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
2. staging: the strategy's first teeth start at stage 1 and move briskly (80 % of
   the per-stage limits) to open space early; later levels start at ``medium`` and
   ``low`` and move at the slowest constant speed that still finishes in time
   (aligners near the end are kept for refinement under force decay); a group that
   cannot finish from its slot at 95 % of the limits is started earlier;
3. the few candidate timings are checked on the simulator (as a clinician checks
   the setup's animation), and the one with the best terminal score is returned.

It is the expert that writes SFT demonstrations and the upper baseline of every
evaluation. It never sees the case's profile or optimal strategy.
"""

from __future__ import annotations

import math

import numpy as np

from server.clinical_profiles import OPTIMAL_STRATEGY, STRATEGY_LEVELS
from server.dental_constants import (
    IS_UPPER,
    MAX_ROTATION_DEG,
    MAX_TRANSLATION_MM,
    N_STAGES,
    PRIORITY_START_STAGE,
    SIDE,
    TOOTH_IDS,
    TOOTH_NUMBER,
)
from server.quaternion_utils import (
    quaternion_angle,
    quaternion_inverse,
    quaternion_multiply,
    quaternion_rotate,
    quaternion_to_rotvec,
)
from server.reward_scaler import scale_rewards

_PRIORITIES = ("high", "medium", "low")
FEATURE_SCALE: dict[str, float] = {
    "crowding": 1.76,  # mm of premolar expansion in a severe crowding
    "class_ii": 4.0,  # mm of upper molar distalisation
    "protrusion_spacing": 2.25,  # mm of upper incisor retraction beyond the molars'
    "deep_bite": 3.0,  # mm of incisor intrusion, both arches together
    "mild_irregularity": 16.0,  # deg, mean of the six largest long-axis rotations
}
DIAGNOSIS_THRESHOLD: float = 0.12
"""Scaled features below this everywhere mean a mild irregularity."""


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
    features = diagnose(initial, target)
    best = max(features, key=features.get)
    return best if features[best] >= DIAGNOSIS_THRESHOLD else "mild_irregularity"


def _required_speed(initial: np.ndarray, target: np.ndarray) -> np.ndarray:
    """(28,) fraction per stage that moves each tooth at exactly the per-stage limits."""
    t = np.linalg.norm(target[:, 4:] - initial[:, 4:], axis=-1)
    r = np.degrees(quaternion_angle(initial[:, :4], target[:, :4]))
    stages_at_limit = np.maximum(t / MAX_TRANSLATION_MM, r / MAX_ROTATION_DEG)
    return np.where(stages_at_limit > 1e-9, 1.0 / np.maximum(stages_at_limit, 1e-9), 1.0)


def stage_plan(
    initial: np.ndarray,
    target: np.ndarray,
    strategy: str,
    last_stage: int,
    brisk: float = 0.8,
    offsets: tuple[int, ...] | None = None,
) -> dict:
    """A plan staging the teeth in ``strategy``'s order, each tooth done by ``last_stage``."""
    limit_fraction = _required_speed(initial, target)  # moving at 100 % of the limits
    levels = STRATEGY_LEVELS[strategy]
    ranks = np.searchsorted(np.unique(levels), levels)
    slot = np.minimum(ranks, len(_PRIORITIES) - 1)
    starts = (
        np.array([PRIORITY_START_STAGE[p] for p in _PRIORITIES]) if offsets is None else np.array(offsets)
    )
    groups: dict[tuple[str, float], list[int]] = {}
    for i, fdi in enumerate(TOOTH_IDS):
        k = int(slot[i])
        while True:
            start = int(starts[k])
            if k == 0:
                f = min(
                    max(brisk * limit_fraction[i], 1.0 / (last_stage - start + 1)), 0.95 * limit_fraction[i]
                )
                f = max(f, 1.0 / (N_STAGES - start + 1))
            else:
                f = 1.0 / (last_stage - start + 1)
            if f <= 0.95 * limit_fraction[i] or k == 0:
                break
            k -= 1
        groups.setdefault((_PRIORITIES[k], math.ceil(float(f) * 1e4) / 1e4), []).append(fdi)
    return {
        "strategy": strategy,
        "tooth_groups": [
            {"teeth": teeth, "fraction": f, "priority": p} for (p, f), teeth in sorted(groups.items())
        ],
    }


def candidate_plans(initial: np.ndarray, target: np.ndarray, force_decay: bool) -> list[dict]:
    """The oracle's few rule-based candidates for a case."""
    strategy = OPTIMAL_STRATEGY[infer_profile(initial, target)]
    last = N_STAGES - (5 if force_decay else 0)
    return [
        stage_plan(initial, target, strategy, last, brisk=0.8),
        stage_plan(initial, target, strategy, last, brisk=0.6),
        stage_plan(initial, target, strategy, last, brisk=0.8, offsets=(1, 9, 15)),
        stage_plan(initial, target, strategy, last, brisk=0.6, offsets=(1, 5, 11)),
        stage_plan(initial, target, strategy, last, brisk=0.0),
        stage_plan(initial, target, strategy, last, brisk=0.95, offsets=(1, 11, 15)),
    ]


def oracle_plan(observation: dict) -> dict:
    """The oracle's plan for an observation (a reset observation of the environment)."""
    from server.treatment import score_plans  # the simulator, to check candidates

    initial = np.asarray(observation["initial_config"], dtype=np.float64)
    target = np.asarray(observation["target_config"], dtype=np.float64)
    force_decay = bool(observation.get("force_decay", False))
    plans = candidate_plans(initial, target, force_decay)
    case = (observation["task_id"], int(observation["seed"]), force_decay)
    results = score_plans(plans, [case] * len(plans))
    # choose as training does: the scaled reward, whose hard-fail overrides punish collisions and PDL stress
    scaled = scale_rewards(
        np.array([r["terminal_reward"] for r in results]),
        np.array([r["reward_breakdown"]["collision_free"] for r in results]),
        np.array([r["reward_breakdown"]["pdl_feasibility"] for r in results]),
    )
    best = int(np.argmax(scaled))
    return plans[best]
