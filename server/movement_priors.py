"""Movement priors: how plausible is the movement a plan achieved, tooth by tooth?

Three scorers compare an initial configuration with the final (achieved) one:

* :class:`RealismPrior` - per tooth class (incisor, canine, premolar, molar) a
  log-normal density of the total movement one course of aligner treatment
  achieves; a tooth scores ``exp(-0.5 z^2)`` with ``z = (ln m - mu_c) / sigma_c``
  (the density relative to its mode in log space), a tooth that did not move
  (``m < 0.05`` mm-equivalent) scores 0.5 (no movement is uninformative).
* :class:`AnchoragePrior` - molars are the anchorage units; each molar scores
  ``exp(-max(0, m - p90) / p90)`` against the reference 90th percentile ``p90``
  of molar movement. Given the achieved trajectory it also scores the staging's
  anchorage demand (moving vs resting root area per stage, Jepsen 1963) and
  averages the two: moving every tooth at once strains anchorage.
* :class:`CombinedPrior` - the weighted mean of the two, clamped to [0, 1].

Movement of a tooth
-------------------
A pose is ``[qw, qx, qy, qz, tx, ty, tz]`` (unit quaternion, w first; crown
centroid in mm, patient frame of :mod:`server.dental_constants`). A configuration
is a ``(28, 7)`` array in the FDI order of :data:`server.dental_constants.TOOTH_IDS`
(11-17, 21-27, 31-37, 41-47). Between an initial and a final pose the movement is
``m = sqrt(t^2 + (MM_PER_DEG * r)^2)`` mm-equivalent, with ``t`` the centroid
translation (mm) and ``r`` the rotation angle (deg). A tooth whose pose holds a
non-finite number or a zero quaternion counts as not moved, so scores are always
finite.

Shapes: every ``score(initial, final)`` takes ``(28, 7)`` arrays and returns a
float, or ``(B, 28, 7)`` arrays (or one ``(28, 7)`` and one ``(B, 28, 7)``, which
broadcast) and returns a ``(B,)`` array. Everything is vectorised numpy.

Reference data
--------------
The per-class parameters come from :mod:`server.movement_reference` (its file format, its
sources and the command that refits it from real pre/post pairs).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from server.dental_constants import (
    IS_MOLAR,
    IS_UPPER,
    MAX_TRANSLATION_MM,
    ROOT_AREA_MM2,
    TOOTH_CLASS,
    TOOTH_CLASSES,
)
from server.movement_reference import (
    MIN_MOVEMENT_MM,
    MovementReference,
    load_reference,
    tooth_movement_mm,
)

NO_MOVEMENT_REALISM: float = 0.5
"""Realism score of a tooth that did not move (uninformative)."""
Z_90: float = 1.2815515655446004
"""Standard normal 90th percentile (p90 of a log-normal = exp(mu + Z_90 sigma))."""


MOVING_EPS_MM: float = 0.01
"""A tooth moving less than this in a stage (mm-equivalent) counts as anchorage."""
LOAD_WEIGHT: float = 0.5
"""Share of the anchorage score given to the staging load (with a trajectory)."""


# --- Movement ------------------------------------------------------------------------------


def _as_output(x: np.ndarray) -> float | np.ndarray:
    return float(x) if x.ndim == 0 else x


# --- Reference ------------------------------------------------------------------------------


# --- Priors ------------------------------------------------------------------------------


class RealismPrior:
    """Per-class log-normal density of achieved movement, relative to its mode in log space."""

    def __init__(self, reference: MovementReference | None = None) -> None:
        self.reference = reference if reference is not None else load_reference()
        self._mu = self.reference.mu[TOOTH_CLASS]  # (28,)
        self._sigma = self.reference.sigma[TOOTH_CLASS]  # (28,)

    @classmethod
    def from_file(cls, path: str | Path) -> RealismPrior:
        """Prior with parameters from a reference JSON file."""
        return cls(load_reference(path))

    def tooth_scores(self, initial: np.ndarray, final: np.ndarray) -> np.ndarray:
        """``(..., 28)`` per-tooth realism in [0, 1] (0.5 for teeth that did not move)."""
        return self.tooth_scores_from_movement(tooth_movement_mm(initial, final))

    def tooth_scores_from_movement(self, m: np.ndarray) -> np.ndarray:
        """Per-tooth realism of movements ``m`` (..., 28) mm-equivalent (see tooth_movement_mm)."""
        moved = m >= MIN_MOVEMENT_MM
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            z = (np.log(np.where(moved, m, 1.0)) - self._mu) / self._sigma
            s = np.exp(-0.5 * z * z)
        return np.where(moved, s, NO_MOVEMENT_REALISM)

    def score(self, initial: np.ndarray, final: np.ndarray) -> float | np.ndarray:
        """Mean per-tooth realism: float for ``(28, 7)`` inputs, ``(B,)`` for batches."""
        return _as_output(np.mean(self.tooth_scores(initial, final), axis=-1))


class AnchoragePrior:
    """Penalises molar movement above the reference 90th percentile of molar movement."""

    def __init__(self, reference: MovementReference | None = None) -> None:
        self.reference = reference if reference is not None else load_reference()
        self.p90_mm = float(self.reference.p90_mm[TOOTH_CLASSES.index("molar")])

    @classmethod
    def from_file(cls, path: str | Path) -> AnchoragePrior:
        """Prior with parameters from a reference JSON file."""
        return cls(load_reference(path))

    def molar_scores(self, initial: np.ndarray, final: np.ndarray) -> np.ndarray:
        """``(..., 8)`` per-molar score ``exp(-max(0, m - p90) / p90)`` in [0, 1]."""
        return self.molar_scores_from_movement(tooth_movement_mm(initial, final))

    def molar_scores_from_movement(self, m: np.ndarray) -> np.ndarray:
        """Per-molar score of movements ``m`` (..., 28) mm-equivalent."""
        m = m[..., IS_MOLAR]
        with np.errstate(over="ignore", invalid="ignore"):
            return np.exp(-np.maximum(0.0, m - self.p90_mm) / self.p90_mm)

    def load_scores(self, trajectory: np.ndarray) -> np.ndarray:
        """Anchorage of an achieved trajectory ``(..., S + 1, 28, 7)`` -> ``(...,)`` in [0, 1].

        At each stage the teeth that move (achieved increment > MOVING_EPS_MM) react against
        the teeth at rest, the anchorage unit (Proffit, *Contemporary Orthodontics*, ch. 9:
        anchorage grows with the root area at rest, the demand with the force on the moving
        teeth). Per arch and stage, the score is ``rest / (rest + demand)``: ``rest`` the root
        area (Jepsen 1963) at rest, ``demand`` the moving teeth's root area times their
        activation (the increment in per-stage limits, MAX_TRANSLATION_MM per unit; a model
        choice: aligner force grows with activation). Stages are averaged **weighted by the
        movement delivered** (mm-equivalent), so what counts is how well anchored each
        millimetre was: moving every tooth at once scores near 0 however fast it is done;
        staging a few teeth at a time at moderate speed against the rest scores high. An arch
        that does not move scores 1. Averaged over both arches.
        """
        return self.load_scores_from_movement(_stage_movement(trajectory))

    def load_scores_from_movement(self, stage_mm: np.ndarray, absent: np.ndarray | None = None) -> np.ndarray:
        """:meth:`load_scores` from the ``(..., S, 28)`` achieved movement of each tooth in each stage (mm);
        ``absent`` (..., 28) bool: teeth the patient lacks, whose roots anchor nothing."""
        moving = stage_mm > MOVING_EPS_MM
        demand_area = np.where(moving, ROOT_AREA_MM2 * stage_mm / MAX_TRANSLATION_MM, 0.0)
        rest_area = np.where(moving, 0.0, ROOT_AREA_MM2)
        if absent is not None:
            rest_area = np.where(absent[..., None, :], 0.0, rest_area)
        per_arch = []
        for arch in (IS_UPPER, ~IS_UPPER):
            rest = np.sum(rest_area[..., arch], axis=-1)
            demand = np.sum(demand_area[..., arch], axis=-1)
            score = np.where(demand > 0.0, rest / np.maximum(rest + demand, 1e-30), 1.0)  # (..., S)
            weight = np.sum(stage_mm[..., arch], axis=-1)
            total = weight.sum(axis=-1)
            per_arch.append(
                np.where(total > 0.0, np.sum(weight * score, axis=-1) / np.maximum(total, 1e-30), 1.0)
            )
        return 0.5 * (per_arch[0] + per_arch[1])

    def score(
        self, initial: np.ndarray, final: np.ndarray, trajectory: np.ndarray | None = None
    ) -> float | np.ndarray:
        """Mean over the 8 molars; with an achieved ``trajectory`` (..., S, 28, 7), the mean of
        that and :meth:`load_scores`. Float for ``(28, 7)`` inputs, ``(B,)`` for batches."""
        stage_mm = None if trajectory is None else _stage_movement(trajectory)
        return _as_output(self._score_from_movement(tooth_movement_mm(initial, final), stage_mm))

    def _score_from_movement(
        self, m: np.ndarray, stage_mm: np.ndarray | None, absent: np.ndarray | None = None
    ) -> np.ndarray:
        """:meth:`score` from movements ``m`` (..., 28) and, when scored, the per-stage movement
        ``stage_mm`` (..., S, 28) of :meth:`load_scores_from_movement`; ``absent`` (..., 28) bool
        leaves the absent molars out of the mean (1 when every molar is absent)."""
        scores = self.molar_scores_from_movement(m)
        if absent is None:
            molar = np.mean(scores, axis=-1)
        else:
            here = ~absent[..., IS_MOLAR]
            n = here.sum(axis=-1)
            molar = np.where(n > 0, np.sum(np.where(here, scores, 0.0), axis=-1) / np.maximum(n, 1), 1.0)
        if stage_mm is None:
            return molar
        return (1.0 - LOAD_WEIGHT) * molar + LOAD_WEIGHT * self.load_scores_from_movement(stage_mm, absent)


def _stage_movement(trajectory: np.ndarray) -> np.ndarray:
    """(..., S, 28) mm-equivalent movement of each tooth in each stage of a trajectory (..., S + 1, 28, 7)."""
    traj = np.asarray(trajectory, dtype=np.float64)
    return tooth_movement_mm(traj[..., :-1, :, :], traj[..., 1:, :, :])


class CombinedPrior:
    """``weight_realism * realism + (1 - weight_realism) * anchorage``, clamped to [0, 1]."""

    def __init__(
        self,
        realism: RealismPrior | None = None,
        anchorage: AnchoragePrior | None = None,
        weight_realism: float = 0.5,
    ) -> None:
        if not 0.0 <= weight_realism <= 1.0:
            raise ValueError(f"weight_realism must lie in [0, 1], got {weight_realism}")
        self.realism = realism if realism is not None else RealismPrior()
        self.anchorage = anchorage if anchorage is not None else AnchoragePrior()
        self.weight_realism = float(weight_realism)

    @classmethod
    def from_file(cls, path: str | Path, weight_realism: float = 0.5) -> CombinedPrior:
        """Both priors from one reference JSON file."""
        ref = load_reference(path)
        return cls(RealismPrior(ref), AnchoragePrior(ref), weight_realism)

    def score(
        self, initial: np.ndarray, final: np.ndarray, trajectory: np.ndarray | None = None
    ) -> float | np.ndarray:
        """Combined prior in [0, 1], always finite: float for ``(28, 7)``, ``(B,)`` for batches."""
        return _as_output(self.parts(initial, final, trajectory)[2])

    def parts(
        self, initial: np.ndarray, final: np.ndarray, trajectory: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(realism, anchorage, combined)`` arrays from one movement computation."""
        stage_mm = None if trajectory is None else _stage_movement(trajectory)
        return self.parts_from_movement(tooth_movement_mm(initial, final), stage_mm=stage_mm)

    def parts_from_movement(
        self, m: np.ndarray, *, stage_mm: np.ndarray | None = None, absent: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`parts` from per-tooth movements ``m`` (..., 28) mm-equivalent, for callers
        that have them from finite, unit-quaternion poses (see tooth_movement_mm), and the
        movement ``stage_mm`` (..., S, 28) of each tooth in each stage (None: no anchorage load;
        see :meth:`AnchoragePrior.load_scores_from_movement`); ``absent`` (..., 28) bool: teeth the
        patient lacks, left out of the realism mean, the molars and the anchorage."""
        tooth = self.realism.tooth_scores_from_movement(m)
        if absent is None:
            r = np.mean(tooth, axis=-1)
        else:
            r = np.sum(np.where(absent, 0.0, tooth), axis=-1) / np.maximum(np.sum(~absent, axis=-1), 1)
        a = self.anchorage._score_from_movement(m, stage_mm, absent)
        s = self.weight_realism * r + (1.0 - self.weight_realism) * a
        return r, a, np.clip(np.where(np.isfinite(s), s, 0.0), 0.0, 1.0)


# --- Fitting ------------------------------------------------------------------------------
