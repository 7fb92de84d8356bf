"""Wide-range reward scaling with hard-fail overrides (the seed's spec 2.5).

``scale_reward(raw)`` maps a terminal score in [0, 1] linearly to [-2, +8]
(``10 * raw - 2``). A collision (``collision_free`` < 0.9) overrides it with
-1.0; excessive PDL stress (``pdl_feasibility`` < 0.5) with -0.5; when both
apply, the collision (the lower value) wins.
"""

from __future__ import annotations

import math

import numpy as np

REWARD_MIN: float = -2.0
REWARD_MAX: float = 8.0
COLLISION_THRESHOLD: float = 0.9
PDL_THRESHOLD: float = 0.5
COLLISION_REWARD: float = -1.0
PDL_STRESS_REWARD: float = -0.5


def detect_collision(collision_free: float) -> bool:
    """True when the collision-free score is below COLLISION_THRESHOLD (NaN counts as a collision)."""
    return not collision_free >= COLLISION_THRESHOLD


def detect_pdl_stress(pdl_feasibility: float) -> bool:
    """True when PDL feasibility is below PDL_THRESHOLD (NaN counts as stress)."""
    return not pdl_feasibility >= PDL_THRESHOLD


def scale_reward(raw: float, collision: bool = False, pdl_stress_exceeded: bool = False) -> tuple[float, str]:
    """Scaled reward and the reason: ``(10*raw - 2, "scaled")`` or a hard-fail override.

    ``raw`` is clipped to [0, 1]; a non-finite raw scores REWARD_MIN.
    """
    if collision:
        return COLLISION_REWARD, "collision"
    if pdl_stress_exceeded:
        return PDL_STRESS_REWARD, "pdl_stress"
    if not math.isfinite(raw):
        return REWARD_MIN, "non_finite"
    raw = min(max(raw, 0.0), 1.0)
    return REWARD_MIN + (REWARD_MAX - REWARD_MIN) * raw, "scaled"


def scale_rewards(raw: np.ndarray, collision_free: np.ndarray, pdl_feasibility: np.ndarray) -> np.ndarray:
    """Vectorised :func:`scale_reward` over arrays of equal shape."""
    raw = np.nan_to_num(np.asarray(raw, dtype=np.float64), nan=-np.inf, posinf=-np.inf)
    scaled = np.where(
        np.isfinite(raw), REWARD_MIN + (REWARD_MAX - REWARD_MIN) * np.clip(raw, 0.0, 1.0), REWARD_MIN
    )
    scaled = np.where(~(np.asarray(pdl_feasibility) >= PDL_THRESHOLD), PDL_STRESS_REWARD, scaled)
    return np.where(~(np.asarray(collision_free) >= COLLISION_THRESHOLD), COLLISION_REWARD, scaled)
