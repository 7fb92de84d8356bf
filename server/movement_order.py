"""The order in which a plan moves the teeth: each tooth's movement centroid, and how well that order
follows a strategy's staging sequence (the ``staging`` component and the strategy multiplier of
:mod:`server.scoring`)."""

from __future__ import annotations

import numpy as np

LEAD_STAGES: float = 2.5
"""Aligners by which a level's movement centroid must precede the next level's for a full
lead (+1) in :func:`sequence_concordance`; smaller leads count in proportion."""


def movement_centroid(inc_mm: np.ndarray) -> np.ndarray:
    """(B, 28) mean aligner (1..24) of each tooth's planned movement, weighted by its increments
    ``inc_mm`` (B, 24, 28); ``S + 1`` (25 for 24 aligners) for a tooth that never moves.

    A tooth the plan leaves where it is has not moved first: for the order of movement it comes
    after every aligner, as if its treatment were left to a later course. (Counting it at 0 read
    leaving a strategy's first level untreated as following the sequence.)"""
    total = inc_mm.sum(axis=-2)
    stages = np.arange(1, inc_mm.shape[-2] + 1, dtype=float)[:, None]
    never = inc_mm.shape[-2] + 1.0
    return np.where(total > 0.0, np.sum(inc_mm * stages, axis=-2) / np.maximum(total, 1e-30), never)


def sequence_concordance(levels: np.ndarray, centroid: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Agreement in [-1, 1] between a staging order and the order in which teeth move.

    For each pair of consecutive levels ``a < b`` present among the masked teeth (B, 28), the
    lead of every ``(i in a, j in b)`` pair is ``clip((centroid_j - centroid_i) / LEAD_STAGES,
    -1, 1)``: +1 when j's movement is centred at least LEAD_STAGES aligners after i's, -1 when
    as far before, 0 when they move together. The pairs' mean is taken per level pair, then
    over level pairs, so every step of the sequence counts alike (a plan that moves the first
    four levels together and only delays the last earns a quarter of a five-level sequence).
    1 when fewer than two levels are present: there is nothing to sequence, any order follows
    the strategy, and only the diagnosis (which strategy) is judged.
    """
    b = levels.shape[0]
    lv = np.where(mask, levels, -1).astype(np.int64)
    n_levels = int(levels.max(initial=0)) + 1
    present = np.stack([(lv == k).any(axis=-1) for k in range(n_levels)], axis=-1)  # (B, L)
    lead = np.clip((centroid[:, None, :] - centroid[:, :, None]) / LEAD_STAGES, -1.0, 1.0)  # [i, j]
    total = np.zeros(b)
    pairs = np.zeros(b)
    for k in range(n_levels - 1):
        later = present[:, k + 1 :]
        has_next = present[:, k] & later.any(axis=-1)
        nxt = k + 1 + np.argmax(later, axis=-1)
        in_a = lv == k
        in_b = lv == nxt[:, None]
        pair = in_a[:, :, None] & in_b[:, None, :]
        count = pair.sum(axis=(1, 2))
        mean = np.sum(np.where(pair, lead, 0.0), axis=(1, 2)) / np.maximum(count, 1)
        total += np.where(has_next, mean, 0.0)
        pairs += has_next
    return np.where(pairs > 0, total / np.maximum(pairs, 1), 1.0)
