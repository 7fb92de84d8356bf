"""Movement reference: how far teeth move in one course of treatment, fitted per tooth class.

:mod:`server.movement_priors` scores a plan's achieved movement against this reference. Here:
the movement of a tooth between two poses (:func:`tooth_movement_mm`), the reference itself
(:class:`MovementReference`, :func:`load_reference`), its fit from pre/post pairs
(:func:`fit_reference`) and the command that writes it.

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
``python -m server.movement_reference refit --pairs DIR --out FILE.json`` reads every
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

``python -m server.movement_reference build-default --out FILE.json`` regenerates the
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
    MM_PER_DEG,
    N_TEETH,
    POSE_DIM,
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

logger = logging.getLogger("server.movement_reference")

DEFAULT_REFERENCE_PATH: Path = Path(__file__).resolve().parent / "data" / "movement_reference.json"
"""The shipped reference distribution (synthetic, see its metadata)."""

MIN_MOVEMENT_MM: float = 0.05
"""Movement (mm-equivalent) below which a tooth counts as not moved: realism 0.5, not fitted."""

QUATERNION_NORM_TOLERANCE: float = 0.01
"""Refit input check: a quaternion's norm must lie within 1 +/- this."""

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
        "created_by": "python -m server.movement_reference build-default",
        "units": "m = sqrt(t_mm^2 + (MM_PER_DEG * r_deg)^2) mm-equivalent; mu/sigma of ln m",
        "mm_per_deg": MM_PER_DEG,
        "min_movement_mm": MIN_MOVEMENT_MM,
    }
    return fit_reference(pairs, metadata)


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
        "created_by": "python -m server.movement_reference refit",
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
        prog="python -m server.movement_reference", description=__doc__.split("\n")[0]
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
