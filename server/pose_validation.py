"""Validating an action: an aligner's 28 poses, and a strategy name, checked before the simulation sees them."""

from __future__ import annotations

from itertools import chain

import numpy as np

from server.clinical_profiles import STRATEGIES
from server.dental_constants import (
    N_TEETH,
    POSE_DIM,
    TOOTH_IDS,
)
from server.errors import InvalidActionError
from server.quaternion_utils import vector_norm

POSE_FIELDS: tuple[str, ...] = ("qw", "qx", "qy", "qz", "tx", "ty", "tz")

_TOOTH_POSITION = {i: fdi for i, fdi in enumerate(TOOTH_IDS)}


def validate_poses(poses: object) -> np.ndarray:
    """A (28, 7) float array from ``poses``, or InvalidActionError naming what is wrong.

    Accepts a nested list/tuple of numbers or a numeric numpy array. Booleans,
    strings, None, NaN and infinities are refused. Quaternions are normalised; a
    zero quaternion is refused.
    """
    if isinstance(poses, np.ndarray):
        if poses.dtype.kind not in "fiu":
            raise InvalidActionError(f"poses must be numbers, got an array of dtype {poses.dtype}")
        arr = poses.astype(np.float64)
        if arr.shape != (N_TEETH, POSE_DIM):
            raise InvalidActionError(
                f"poses must have shape (28, 7) [teeth x {list(POSE_FIELDS)}], got {arr.shape}"
            )
    elif _all_float_rows(poses):  # the common case (e.g. validated JSON): no per-value checks to name
        # 28 rows of 7 floats: fromiter builds the same array about twice as fast as np.array
        arr = np.fromiter(chain.from_iterable(poses), dtype=np.float64, count=N_TEETH * POSE_DIM)
        arr = arr.reshape(N_TEETH, POSE_DIM)
    else:
        if not isinstance(poses, (list, tuple)) or len(poses) != N_TEETH:
            n = len(poses) if isinstance(poses, (list, tuple)) else type(poses).__name__
            raise InvalidActionError(f"poses must be a list of 28 rows (one per tooth, FDI order), got {n}")
        for i, row in enumerate(poses):
            if not isinstance(row, (list, tuple)) or len(row) != POSE_DIM:
                got = len(row) if isinstance(row, (list, tuple)) else type(row).__name__
                raise InvalidActionError(
                    f"tooth {_TOOTH_POSITION[i]} (row {i}): a pose has 7 numbers {list(POSE_FIELDS)}, got {got}"
                )
            for j, v in enumerate(row):
                if type(v) not in (float, int) and not isinstance(v, (np.floating, np.integer)):
                    raise InvalidActionError(
                        f"tooth {_TOOTH_POSITION[i]} field {POSE_FIELDS[j]}: expected a number, "
                        f"got {type(v).__name__} {v!r:.40}"
                    )
        arr = np.array(poses, dtype=np.float64)
    if not np.maximum.reduce(np.abs(arr), axis=None) <= 1e6:  # also false for NaN
        _raise_out_of_range(arr)
    norms = vector_norm(arr[:, :4])
    if np.minimum.reduce(norms) < 1e-9:
        i = int(np.argmax(norms < 1e-9))
        raise InvalidActionError(f"tooth {_TOOTH_POSITION[i]}: quaternion (qw, qx, qy, qz) has zero norm")
    arr[:, :4] /= norms[:, None]
    return arr


def _all_float_rows(poses: object) -> bool:
    """``poses`` is 28 lists (or tuples) of 7 Python floats (C-level type and length sets)."""
    if type(poses) not in (list, tuple) or len(poses) != N_TEETH:
        return False
    if not set(map(type, poses)) <= {list, tuple} or set(map(len, poses)) != {POSE_DIM}:
        return False
    return set(map(type, chain.from_iterable(poses))) == {float}


def _raise_out_of_range(arr: np.ndarray) -> None:
    """The InvalidActionError for the first non-finite or implausibly large number of ``arr``."""
    finite = np.isfinite(arr)
    if not finite.all():
        i, j = np.argwhere(~finite)[0]
        raise InvalidActionError(
            f"tooth {_TOOTH_POSITION[int(i)]} field {POSE_FIELDS[j]}: {arr[i, j]} is not a finite number"
        )
    i, j = np.argwhere(np.abs(arr) > 1e6)[0]
    raise InvalidActionError(
        f"tooth {_TOOTH_POSITION[int(i)]} field {POSE_FIELDS[j]}: |{arr[i, j]}| > 1e6 mm"
    )


def check_strategy(strategy: object) -> str | None:
    if strategy is None:
        return None
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise InvalidActionError(
            f"strategy must be one of {', '.join(STRATEGIES)} or null, got {strategy!r:.60}"
        )
    return strategy
