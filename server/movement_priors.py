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
Parameters come from ``server/data/movement_reference.json`` (loaded once and
cached) or from any file of the same layout via ``from_file(path)``::

    {"metadata": {"provenance": ..., "sources": [...], "fitted_from": ..., "n_pairs": ..., ...},
     "classes": {"incisor": {"mu": ..., "sigma": ..., "p90_mm": ..., "n_teeth": ...}, ...}}

``mu`` and ``sigma`` are the mean and standard deviation of ``ln m`` (m in
mm-equivalent) over teeth that moved at least 0.05 mm-equivalent; ``p90_mm`` is
the 90th percentile of ``m`` over all teeth of the class (the molar value is used
by :class:`AnchoragePrior`). No patient data ships: the default file is fitted to
synthetic pairs drawn from published order-of-magnitude summary statistics, and
its metadata says so.

Refitting from real pre/post pairs
----------------------------------
``python -m server.movement_priors refit --pairs DIR --out FILE.json`` reads every
``*.json`` file directly inside ``DIR``. Each file holds one treated arch pair::

    {"pre": [[qw, qx, qy, qz, tx, ty, tz], ... 28 rows],
     "post": [[qw, qx, qy, qz, tx, ty, tz], ... 28 rows]}

rows in the FDI order of ``TOOTH_IDS`` (11-17, 21-27, 31-37, 41-47), unit
quaternions w first, translations in mm in one frame shared by ``pre`` and
``post``. Files that are not valid (unreadable JSON, missing keys, wrong shape,
non-finite numbers, quaternions not of unit norm) are skipped with a logged
warning naming the file and the problem. The output has the same layout, with
provenance ``"fitted from N pre/post pairs in DIR"``. An empty folder or no valid
pair exits with status 2 and a message saying what to fix.

``python -m server.movement_priors build-default --out FILE.json`` regenerates the
default reference from its summary values (seeded, reproducible).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from server.dental_constants import (
    IS_MOLAR,
    IS_UPPER,
    MAX_TRANSLATION_MM,
    MM_PER_DEG,
    N_TEETH,
    POSE_DIM,
    ROOT_AREA_MM2,
    TOOTH_CLASS,
    TOOTH_CLASSES,
    TOOTH_IDS,
)
from server.quaternion_utils import (
    quaternion_angle,
    quaternion_from_rotvec,
    quaternion_multiply,
    quaternion_normalize,
)

logger = logging.getLogger("server.movement_priors")

DEFAULT_REFERENCE_PATH: Path = Path(__file__).resolve().parent / "data" / "movement_reference.json"
"""The shipped reference distribution (synthetic, see its metadata)."""

MIN_MOVEMENT_MM: float = 0.05
"""Movement (mm-equivalent) below which a tooth counts as not moved: realism 0.5, not fitted."""
NO_MOVEMENT_REALISM: float = 0.5
"""Realism score of a tooth that did not move (uninformative)."""
QUATERNION_NORM_TOLERANCE: float = 0.01
"""Refit input check: a quaternion's norm must lie within 1 +/- this."""
Z_90: float = 1.2815515655446004
"""Standard normal 90th percentile (p90 of a log-normal = exp(mu + Z_90 sigma))."""

# Order-of-magnitude summary values of the default reference (median mm-equivalent
# movement per course, log-space sigma), per class in TOOTH_CLASSES order. See
# REFERENCE_SOURCES: approximate, not verified against the papers' tables.
SUMMARY_MEDIAN_MM: dict[str, float] = {"incisor": 2.0, "canine": 1.8, "premolar": 1.4, "molar": 0.8}
SUMMARY_SIGMA: dict[str, float] = {"incisor": 0.65, "canine": 0.70, "premolar": 0.70, "molar": 0.72}
DEFAULT_N_PAIRS: int = 500
DEFAULT_SEED: int = 20240601

REFERENCE_SOURCES: tuple[str, ...] = (
    (
        "Kravitz ND et al. 2009, Am J Orthod Dentofacial Orthop 135:27-35 - how well does Invisalign work? "
        "Order-of-magnitude summary values taken: mean accuracy of achieved vs predicted movement ~40 %; "
        "planned anterior movements of a few mm / up to ~10-20 deg per tooth."
    ),
    (
        "Simon M et al. 2014, BMC Oral Health 14:68 - treatment outcome and efficacy of an aligner "
        "technique (incisor torque, premolar derotation, molar distalisation). Order-of-magnitude "
        "summary values taken: achieved share of planned movement ~60 % on average; molar "
        "distalisation of ~1-3 mm when planned, otherwise molars are anchorage units."
    ),
    (
        "Haouili N et al. 2020, Am J Orthod Dentofacial Orthop 158:420-425 - has Invisalign improved? "
        "Accuracy of tooth movements. Order-of-magnitude summary values taken: mean accuracy ~50 %; "
        "incisors and canines move most, premolars less, molars least (mostly < 1 mm)."
    ),
    (
        "All numbers are approximate order-of-magnitude summary values recalled from these papers; they "
        "have NOT been verified against the papers' tables. The per-class medians (incisor ~2.0, canine "
        "~1.8, premolar ~1.4, molar ~0.8 mm-equivalent; log-space sigma ~0.65-0.72; molar p90 ~2.0 "
        "mm-equivalent) are modelling choices consistent with them, not measurements."
    ),
)

_IDENTITY_POSE = np.array([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
MOVING_EPS_MM: float = 0.01
"""A tooth moving less than this in a stage (mm-equivalent) counts as anchorage."""
LOAD_WEIGHT: float = 0.5
"""Share of the anchorage score given to the staging load (with a trajectory)."""


# --- Movement ------------------------------------------------------------------------------


def _check_config_shape(a: np.ndarray, name: str) -> None:
    if a.ndim < 2 or a.shape[-2:] != (N_TEETH, POSE_DIM):
        raise ValueError(f"{name} must have shape (28, 7) or (B, 28, 7), got {a.shape}")


def _sanitised_quaternions(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unit quaternions (..., 4) of finite (..., 4) input, robust to huge or tiny norms.

    Returns ``(q_unit, ok)``; ``ok`` (...,) is false for zero quaternions (whose unit
    value is then the identity).
    """
    scale = np.max(np.abs(q), axis=-1, keepdims=True)
    ok = scale[..., 0] > 0.0
    q = np.where(ok[..., None], q / np.where(scale > 0.0, scale, 1.0), _IDENTITY_POSE[:4])
    return quaternion_normalize(q), ok


def tooth_movement_mm(initial: np.ndarray, final: np.ndarray) -> np.ndarray:
    """Per-tooth movement (mm-equivalent) from ``initial`` to ``final`` configurations.

    Args:
        initial: ``(..., 28, 7)`` poses ``[qw, qx, qy, qz, tx, ty, tz]`` (mm).
        final: ``(..., 28, 7)`` poses; broadcasts against ``initial``.

    Returns:
        ``(..., 28)`` array of ``sqrt(t^2 + (MM_PER_DEG * r_deg)^2)``, never NaN: a tooth
        with a non-finite value or a zero quaternion in either pose counts as 0 (not
        moved); finite but overflowing translations give ``inf``.
    """
    a = np.asarray(initial, dtype=np.float64)
    b = np.asarray(final, dtype=np.float64)
    _check_config_shape(a, "initial")
    _check_config_shape(b, "final")
    a, b = np.broadcast_arrays(a, b)
    valid = np.isfinite(a).all(axis=-1) & np.isfinite(b).all(axis=-1)
    a = np.where(valid[..., None], a, _IDENTITY_POSE)
    b = np.where(valid[..., None], b, _IDENTITY_POSE)
    qa, ok_a = _sanitised_quaternions(a[..., :4])
    qb, ok_b = _sanitised_quaternions(b[..., :4])
    valid &= ok_a & ok_b
    with np.errstate(over="ignore", invalid="ignore"):
        d = b[..., 4:] - a[..., 4:]
        t = np.hypot(np.hypot(d[..., 0], d[..., 1]), d[..., 2])
        r_deg = np.degrees(quaternion_angle(qa, qb))
        m = np.hypot(t, MM_PER_DEG * r_deg)
    return np.where(valid & ~np.isnan(m), m, 0.0)


def _as_output(x: np.ndarray) -> float | np.ndarray:
    return float(x) if x.ndim == 0 else x


# --- Reference ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MovementReference:
    """Per-class reference parameters (arrays ``(4,)`` in ``TOOTH_CLASSES`` order).

    Attributes:
        mu: mean of ``ln m`` (m in mm-equivalent) of moved teeth.
        sigma: standard deviation of ``ln m`` (> 0).
        p90_mm: 90th percentile of ``m`` (mm-equivalent, > 0).
        metadata: provenance block of the file (read-only by convention).
        path: file the parameters came from, if any.
    """

    mu: np.ndarray
    sigma: np.ndarray
    p90_mm: np.ndarray
    metadata: dict[str, Any] = field(default_factory=dict)
    path: str | None = None

    def __post_init__(self) -> None:
        for name in ("mu", "sigma", "p90_mm"):
            arr = np.array(getattr(self, name), dtype=np.float64)
            if arr.shape != (len(TOOTH_CLASSES),) or not np.isfinite(arr).all():
                raise ValueError(f"reference {name} must be 4 finite numbers, got {arr!r}")
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        if (self.sigma <= 0).any() or (self.p90_mm <= 0).any():
            raise ValueError("reference sigma and p90_mm must be > 0")

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str | None = None) -> MovementReference:
        """Parse the JSON layout ``{"metadata": {...}, "classes": {class: {mu, sigma, p90_mm}}}``."""
        try:
            classes = data["classes"]
            values = {
                key: [float(classes[c][key]) for c in TOOTH_CLASSES] for key in ("mu", "sigma", "p90_mm")
            }
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"invalid movement reference {path or ''}: {exc!r}") from exc
        return cls(**values, metadata=dict(data.get("metadata", {})), path=path)

    def to_dict(self, n_teeth: Sequence[int] | None = None) -> dict[str, Any]:
        """The JSON layout of this reference (``n_teeth``: moved teeth fitted per class)."""
        classes: dict[str, Any] = {}
        for i, c in enumerate(TOOTH_CLASSES):
            classes[c] = {
                "mu": round(float(self.mu[i]), 6),
                "sigma": round(float(self.sigma[i]), 6),
                "p90_mm": round(float(self.p90_mm[i]), 6),
                "median_mm": round(float(np.exp(self.mu[i])), 6),
            }
            if n_teeth is not None:
                classes[c]["n_teeth"] = int(n_teeth[i])
        return {"metadata": self.metadata, "classes": classes}


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, mtime_ns: int, size: int) -> MovementReference:
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    logger.debug("loaded movement reference %s", path)
    return MovementReference.from_dict(data, path=path)


def load_reference(path: str | Path | None = None) -> MovementReference:
    """Load a reference file (default: the shipped one); cached per file version."""
    p = Path(path) if path is not None else DEFAULT_REFERENCE_PATH
    p = p.resolve()
    st = p.stat()
    return _load_cached(str(p), st.st_mtime_ns, st.st_size)


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

    def load_scores_from_movement(self, stage_mm: np.ndarray) -> np.ndarray:
        """:meth:`load_scores` from the ``(..., S, 28)`` achieved movement of each tooth in each stage (mm)."""
        moving = stage_mm > MOVING_EPS_MM
        demand_area = np.where(moving, ROOT_AREA_MM2 * stage_mm / MAX_TRANSLATION_MM, 0.0)
        rest_area = np.where(moving, 0.0, ROOT_AREA_MM2)
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

    def _score_from_movement(self, m: np.ndarray, stage_mm: np.ndarray | None) -> np.ndarray:
        """:meth:`score` from movements ``m`` (..., 28) and, when scored, the per-stage movement
        ``stage_mm`` (..., S, 28) of :meth:`load_scores_from_movement`."""
        molar = np.mean(self.molar_scores_from_movement(m), axis=-1)
        if stage_mm is None:
            return molar
        return (1.0 - LOAD_WEIGHT) * molar + LOAD_WEIGHT * self.load_scores_from_movement(stage_mm)


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
        self, m: np.ndarray, *, stage_mm: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`parts` from per-tooth movements ``m`` (..., 28) mm-equivalent, for callers
        that have them from finite, unit-quaternion poses (see tooth_movement_mm), and the
        movement ``stage_mm`` (..., S, 28) of each tooth in each stage (None: no anchorage load;
        see :meth:`AnchoragePrior.load_scores_from_movement`)."""
        r = np.mean(self.realism.tooth_scores_from_movement(m), axis=-1)
        a = self.anchorage._score_from_movement(m, stage_mm)
        s = self.weight_realism * r + (1.0 - self.weight_realism) * a
        return r, a, np.clip(np.where(np.isfinite(s), s, 0.0), 0.0, 1.0)


# --- Fitting ------------------------------------------------------------------------------


class ReferenceFitError(ValueError):
    """The pairs cannot give a reference (no pairs, too few moved teeth in a class)."""


def fit_reference(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], metadata: dict[str, Any]
) -> tuple[MovementReference, np.ndarray]:
    """Fit per-class ``mu``, ``sigma`` of ``ln m`` (m >= 0.05) and ``p90_mm`` of ``m``.

    Args:
        pairs: ``(pre, post)`` configurations, each ``(28, 7)``.
        metadata: metadata block to store with the result.

    Returns:
        The reference and the ``(4,)`` number of moved teeth fitted per class.

    Raises:
        ReferenceFitError: no pairs, or a class with fewer than 2 moved teeth.
    """
    if len(pairs) == 0:
        raise ReferenceFitError("no pre/post pairs to fit")
    pre = np.stack([p for p, _ in pairs])
    post = np.stack([q for _, q in pairs])
    m = tooth_movement_mm(pre, post)  # (N, 28)
    mu, sigma, p90, counts = [], [], [], []
    for k, name in enumerate(TOOTH_CLASSES):
        mk = m[:, np.equal(TOOTH_CLASS, k)].ravel()
        moved = mk[mk >= MIN_MOVEMENT_MM]
        if moved.size < 2:
            raise ReferenceFitError(
                f"class {name!r} has {moved.size} teeth that moved >= {MIN_MOVEMENT_MM} mm-equivalent; "
                "need at least 2 (add pairs in which these teeth move)"
            )
        logm = np.log(moved)
        mu.append(float(np.mean(logm)))
        sigma.append(max(float(np.std(logm, ddof=1)), 1e-3))
        q = float(np.percentile(mk, 90.0))
        if q < MIN_MOVEMENT_MM:
            logger.warning(
                "class %s: p90 %.4f mm below %.2f; using %.2f", name, q, MIN_MOVEMENT_MM, MIN_MOVEMENT_MM
            )
            q = MIN_MOVEMENT_MM
        p90.append(q)
        counts.append(moved.size)
    return MovementReference(np.array(mu), np.array(sigma), np.array(p90), metadata=metadata), np.array(
        counts
    )


def _validate_config(raw: Any, key: str) -> np.ndarray:
    try:
        arr = np.asarray(raw, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{key!r} is not a numeric array ({exc})") from exc
    if arr.shape != (N_TEETH, POSE_DIM):
        raise ValueError(f"{key!r} has shape {arr.shape}, expected (28, 7)")
    if not np.isfinite(arr).all():
        raise ValueError(f"{key!r} contains non-finite numbers")
    norms = np.linalg.norm(arr[:, :4], axis=-1)
    bad = np.flatnonzero(np.abs(norms - 1.0) > QUATERNION_NORM_TOLERANCE)
    if bad.size:
        raise ValueError(
            f"{key!r} quaternion of tooth {TOOTH_IDS[bad[0]]} has norm {norms[bad[0]]:.4f}, expected 1 "
            "(poses are [qw, qx, qy, qz, tx, ty, tz], w first)"
        )
    return arr


def read_pairs(directory: str | Path) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[str], int]:
    """Read every ``*.json`` pair file directly in ``directory``.

    Returns:
        ``(pairs, skipped_names, n_files)``; invalid files are skipped with a warning.
    """
    files = sorted(p for p in Path(directory).glob("*.json") if p.is_file())
    pairs: list[tuple[np.ndarray, np.ndarray]] = []
    skipped: list[str] = []
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                data = json.load(fh)
            if not isinstance(data, dict) or "pre" not in data or "post" not in data:
                raise ValueError('expected an object with keys "pre" and "post"')
            pairs.append((_validate_config(data["pre"], "pre"), _validate_config(data["post"], "post")))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
            logger.warning("skipping %s: %s", f, exc)
            skipped.append(f.name)
    return pairs, skipped, len(files)


def synthetic_pairs(
    median_mm: Sequence[float], sigma: Sequence[float], n_pairs: int, rng: np.random.Generator
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Synthetic pre/post pairs whose per-tooth movement is log-normal per class.

    ``median_mm`` and ``sigma`` are ``(4,)`` in ``TOOTH_CLASSES`` order. Each movement
    is split at random between translation (random direction) and rotation (random
    axis) so that ``sqrt(t^2 + (MM_PER_DEG r)^2)`` equals the drawn value.
    """
    mu_t = np.log(np.asarray(median_mm, dtype=np.float64))[TOOTH_CLASS]
    sig_t = np.asarray(sigma, dtype=np.float64)[TOOTH_CLASS]
    shape = (n_pairs, N_TEETH)
    m = np.exp(rng.normal(mu_t, sig_t, size=shape))
    share = rng.uniform(0.0, 1.0, size=shape)  # share of m^2 due to rotation
    t = m * np.sqrt(1.0 - share)
    r_rad = np.radians(m * np.sqrt(share) / MM_PER_DEG)
    r_rad = np.minimum(r_rad, np.pi * 0.95)

    def unit(v: np.ndarray) -> np.ndarray:
        return v / np.linalg.norm(v, axis=-1, keepdims=True)

    pre_q = quaternion_normalize(rng.normal(size=(*shape, 4)))
    pre_t = rng.normal(0.0, 20.0, size=(*shape, 3))
    step_q = quaternion_from_rotvec(unit(rng.normal(size=(*shape, 3))) * r_rad[..., None])
    post_q = quaternion_normalize(quaternion_multiply(step_q, pre_q))
    post_t = pre_t + unit(rng.normal(size=(*shape, 3))) * t[..., None]
    pre = np.concatenate((pre_q, pre_t), axis=-1)
    post = np.concatenate((post_q, post_t), axis=-1)
    return [(pre[i], post[i]) for i in range(n_pairs)]


def build_default_reference(
    n_pairs: int = DEFAULT_N_PAIRS, seed: int = DEFAULT_SEED
) -> tuple[MovementReference, np.ndarray]:
    """The shipped reference: fitted to seeded synthetic pairs drawn from the summary values."""
    medians = [SUMMARY_MEDIAN_MM[c] for c in TOOTH_CLASSES]
    sigmas = [SUMMARY_SIGMA[c] for c in TOOTH_CLASSES]
    pairs = synthetic_pairs(medians, sigmas, n_pairs, np.random.default_rng(seed))
    metadata: dict[str, Any] = {
        "provenance": (
            "synthetic reference distribution built from published summary statistics of aligner "
            "tooth movement; NOT patient data"
        ),
        "sources": list(REFERENCE_SOURCES),
        "summary_values": {
            c: {"median_mm": SUMMARY_MEDIAN_MM[c], "sigma_log": SUMMARY_SIGMA[c]} for c in TOOTH_CLASSES
        },
        "summary_values_note": (
            "order-of-magnitude summary values, approximate, not verified against the papers' tables"
        ),
        "fitted_from": (
            f"{n_pairs} synthetic pre/post pairs drawn from per-class log-normals with the summary values "
            f"(numpy default_rng seed {seed})"
        ),
        "n_pairs": n_pairs,
        "seed": seed,
        "created_by": "python -m server.movement_priors build-default",
        "units": "m = sqrt(t_mm^2 + (MM_PER_DEG * r_deg)^2) mm-equivalent; mu/sigma of ln m",
        "mm_per_deg": MM_PER_DEG,
        "min_movement_mm": MIN_MOVEMENT_MM,
    }
    return fit_reference(pairs, metadata)


# --- CLI ------------------------------------------------------------------------------


def _write(ref: MovementReference, counts: np.ndarray, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(ref.to_dict(counts), indent=2) + "\n", encoding="utf-8")


def _refit(args: argparse.Namespace) -> int:
    pairs_dir = Path(args.pairs)
    if not pairs_dir.is_dir():
        print(
            f"error: --pairs {pairs_dir} is not a directory; pass a folder of *.json pair files",
            file=sys.stderr,
        )
        return 2
    pairs, skipped, n_files = read_pairs(pairs_dir)
    fmt = (
        'each file must be {"pre": 28x7 list, "post": 28x7 list} of [qw, qx, qy, qz, tx, ty, tz] '
        "rows in TOOTH_IDS order"
    )
    if n_files == 0:
        print(f"error: no *.json files in {pairs_dir}; add pre/post pair files ({fmt})", file=sys.stderr)
        return 2
    if not pairs:
        print(
            f"error: none of the {n_files} *.json files in {pairs_dir} is a valid pair "
            f"(see warnings above); {fmt}",
            file=sys.stderr,
        )
        return 2
    metadata: dict[str, Any] = {
        "provenance": f"fitted from {len(pairs)} pre/post pairs in {pairs_dir}",
        "sources": [f"pre/post pose pairs in {pairs_dir} (provenance as supplied by the user)"],
        "fitted_from": str(pairs_dir),
        "n_pairs": len(pairs),
        "skipped_files": skipped,
        "created_by": "python -m server.movement_priors refit",
        "units": "m = sqrt(t_mm^2 + (MM_PER_DEG * r_deg)^2) mm-equivalent; mu/sigma of ln m",
        "mm_per_deg": MM_PER_DEG,
        "min_movement_mm": MIN_MOVEMENT_MM,
    }
    try:
        ref, counts = fit_reference(pairs, metadata)
    except ReferenceFitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _write(ref, counts, Path(args.out))
    print(f"fitted from {len(pairs)} pairs ({len(skipped)} skipped) -> {args.out}")
    for i, c in enumerate(TOOTH_CLASSES):
        print(
            f"  {c:9s} median {np.exp(ref.mu[i]):.3f} mm  sigma {ref.sigma[i]:.3f}  "
            f"p90 {ref.p90_mm[i]:.3f} mm"
        )
    return 0


def _build_default(args: argparse.Namespace) -> int:
    ref, counts = build_default_reference(args.n_pairs, args.seed)
    _write(ref, counts, Path(args.out))
    print(f"wrote synthetic default reference ({args.n_pairs} pairs, seed {args.seed}) -> {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``refit`` from a folder of pairs, or ``build-default``. Returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m server.movement_priors", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_refit = sub.add_parser("refit", help="fit the reference from a folder of pre/post pair JSON files")
    p_refit.add_argument("--pairs", required=True, help="folder of *.json files {'pre': 28x7, 'post': 28x7}")
    p_refit.add_argument("--out", required=True, help="output reference JSON file")
    p_refit.set_defaults(func=_refit)
    p_build = sub.add_parser("build-default", help="regenerate the synthetic default reference")
    p_build.add_argument("--out", default=str(DEFAULT_REFERENCE_PATH), help="output reference JSON file")
    p_build.add_argument("--n-pairs", type=int, default=DEFAULT_N_PAIRS)
    p_build.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p_build.set_defaults(func=_build_default)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s", stream=sys.stderr)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
