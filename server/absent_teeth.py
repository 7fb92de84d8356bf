"""Absent teeth: the place an absent tooth keeps in the (28, 7) arrays, and the masks that leave it out.

A case may lack any of the 28 teeth (congenitally missing, extracted; docs/cases.md). Every array
of the simulation keeps its 28 rows, so an absent tooth holds a *placeholder*: a pose that is the
same in the initial and the target arrangement (:func:`placeholder_poses`), so no plan moves it
(its need, its increments and its stress are 0, which leaves it out of accuracy, the limits, the
PDL and smoothness), and every measure that pairs it with another crown masks it:

* contacts and collisions: a pair with an absent crown is never in contact
  (:func:`mask_pairs`); across a single gap the two crowns are a second-neighbour pair, held to
  the same collision rule, and across a wider one they are measured too (:func:`gap_pairs`);
* the bite: an antagonist pair with an absent crown is not judged (:func:`antagonists_present`),
  and the occlusion keys degrade as :func:`server.occlusion.six_keys` says;
* anchorage: an absent tooth's root does not anchor (:mod:`server.movement_priors`).

``absent`` arrays are (..., 28) bool in TOOTH_IDS order; None everywhere means every tooth is
present, and then no code path changes (a generated case has no absent tooth).
"""

from __future__ import annotations

import itertools

import numpy as np

from server.dental_constants import ADJACENT_PAIRS, N_TEETH, TOOTH_IDS

SUMMARY_KEY: str = "absent_teeth"
"""The case summary's list of the FDI ids a patient lacks (only in a case that lacks some)."""
NO_CONTACT_MM: float = -100.0
"""The penetration (a clearance, mm) a pair with an absent crown reads: never a contact or a collision."""


def _arch_rows() -> tuple[list[int], list[int]]:
    """The tooth indices of each arch in arch order, distal right to distal left."""
    rows: list[list[int]] = [[], []]
    for k, (a, b) in enumerate(ADJACENT_PAIRS):
        row = rows[0 if k < len(ADJACENT_PAIRS) // 2 else 1]
        if not row:
            row.append(int(a))
        row.append(int(b))
    return rows[0], rows[1]


ARCH_ROWS: tuple[list[int], list[int]] = _arch_rows()
"""(upper, lower): each arch's 14 tooth indices in arch order (17 ... 11 21 ... 27, 47 ... 41 31 ... 37)."""


def absent_mask(absent_ids) -> np.ndarray | None:
    """(28,) bool of FDI ids (any iterable); None when it names none."""
    ids = set(int(t) for t in absent_ids)
    if not ids:
        return None
    mask = np.array([t in ids for t in TOOTH_IDS])
    mask.setflags(write=False)
    return mask


def absent_ids(absent: np.ndarray | None) -> list[int]:
    """The FDI ids an (28,) absent mask marks (empty for None)."""
    return [] if absent is None else [int(TOOTH_IDS[k]) for k in np.flatnonzero(absent)]


def placeholder_poses(poses: np.ndarray, absent: np.ndarray) -> np.ndarray:
    """(28, 7) ``poses`` with each absent tooth's row set to a placeholder in its space: the midpoint
    of its nearest present neighbours along the arch with the nearer one's rotation (the distal one's
    on a tie), or, at the end of an arch, the last present neighbour's pose. Present rows are returned
    unchanged. Raises ValueError when an arch has no present tooth."""
    out = np.array(poses, dtype=float, copy=True)
    for row in ARCH_ROWS:
        present = [i for i, k in enumerate(row) if not absent[k]]
        if not present:
            raise ValueError("an arch with every tooth absent has no arrangement to plan")
        for i, k in enumerate(row):
            if not absent[k]:
                continue
            before = [j for j in present if j < i]
            after = [j for j in present if j > i]
            if not before or not after:
                out[k] = poses[row[before[-1] if before else after[0]]]
                continue
            a, b = before[-1], after[0]
            out[k, 4:] = 0.5 * (poses[row[a], 4:] + poses[row[b], 4:])
            out[k, :4] = poses[row[a] if i - a <= b - i else row[b], :4]
    return out


def gap_pairs(absent: np.ndarray) -> np.ndarray:
    """(2, P) the pairs of present crowns with two or more absent teeth between them along the arch
    (one absent tooth between makes a second-neighbour pair, which every case measures): once the
    teeth between are gone they face each other across the space. Empty (2, 0) for none."""
    pairs = []
    for row in ARCH_ROWS:
        present = [i for i, k in enumerate(row) if not absent[k]]
        pairs += [(row[i], row[j]) for i, j in itertools.pairwise(present) if j - i >= 3]
    return np.array(pairs, dtype=np.int64).reshape(-1, 2).T


def mask_pairs(penetration: np.ndarray, absent: np.ndarray | None, pairs: np.ndarray) -> np.ndarray:
    """``penetration`` (B, ..., P) of the crown pairs ``pairs`` (2, P) with every pair that has an
    absent crown (``absent`` (B, 28)) set to :data:`NO_CONTACT_MM`; the array itself when none is."""
    if absent is None:
        return penetration
    gone = absent[:, pairs[0]] | absent[:, pairs[1]]  # (B, P)
    if not gone.any():
        return penetration
    shape = (gone.shape[0],) + (1,) * (penetration.ndim - 2) + (gone.shape[1],)
    return np.where(gone.reshape(shape), NO_CONTACT_MM, penetration)


def mask_contacts(penetration: np.ndarray, absent: np.ndarray | None) -> np.ndarray:
    """Penetrations (..., 26) of one case's contacts (ADJACENT_PAIRS order) with the contacts of an
    absent crown (``absent`` (28,) bool) set to :data:`NO_CONTACT_MM`; the array itself for None."""
    if absent is None:
        return penetration
    return np.where(absent[ADJACENT_PAIRS[:, 0]] | absent[ADJACENT_PAIRS[:, 1]], NO_CONTACT_MM, penetration)


def antagonists_present(absent: np.ndarray, antagonists: np.ndarray) -> np.ndarray:
    """(B, P) whether both crowns of each antagonist pair ``antagonists`` (P, 2) are present."""
    return ~(absent[:, antagonists[:, 0]] | absent[:, antagonists[:, 1]])


def batch_absent(cases) -> np.ndarray | None:
    """(B, 28) absent masks of cases (objects with an ``absent`` attribute, None or (28,) bool);
    None when no case has an absent tooth."""
    masks = [getattr(c, "absent", None) for c in cases]
    if all(m is None for m in masks):
        return None
    none = np.zeros(N_TEETH, dtype=bool)
    return np.stack([none if m is None else m for m in masks])
