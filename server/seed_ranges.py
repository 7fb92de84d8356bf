"""The case seeds' ranges: which seeds serve training, tuning, tests, audits, gates and the final table.

A generated case is named by ``(task_id, seed, force_decay, non_compliance)`` (:mod:`server.cases`). The
ranges below are disjoint and every use of a seed comes from one of them, so that a verdict is never
given on cases a default was chosen on:

========  ======================  ===================================================================
name      seeds                   what uses it
========  ======================  ===================================================================
training  0 .. 999,999            training prompts and demonstrations of every stage (format, tool-use
                                  and BC demonstrations, GRPO and RSFT prompts; the learning
                                  experiment's GRPO prompts from 50,000 and RSFT's from 60,000); the
                                  Gymnasium environment's random cases; test fixtures of training rows
tuning    1,000,000 .. 1,999,999  held-out evaluation on which defaults were chosen: ``orthojob
                                  evaluate``, the pipeline's evaluation, ``make learn``'s curves and
                                  comparisons, the benches; test fixtures of held-out cases
tests     2,000,000 .. 2,999,999  tests that need cases none of the other ranges hold
audits    3,000,000 .. 4,999,999  red-team and independent audits' measurements
final     5,000,000 .. 5,999,999  the final table of ``make learn``: no default was chosen on it
gates     10**9 .. 2 * 10**9 - 1  the quality gates: each run draws its window here
                                  (:func:`gate_window_start`)
========  ======================  ===================================================================
"""

from __future__ import annotations

import hashlib
from numbers import Integral
from typing import NamedTuple


class SeedRange(NamedTuple):
    """The seeds ``start .. stop - 1`` and what uses them."""

    name: str
    start: int
    stop: int
    use: str

    @property
    def size(self) -> int:
        return self.stop - self.start

    def __contains__(self, seed: object) -> bool:
        return isinstance(seed, Integral) and not isinstance(seed, bool) and self.start <= seed < self.stop

    def holds(self, first: int, n: int) -> bool:
        """Whether the ``n`` seeds from ``first`` all lie in this range."""
        return self.start <= first and first + n <= self.stop


TRAINING = SeedRange("training", 0, 1_000_000, "training prompts and demonstrations of every stage")
TUNING = SeedRange(
    "tuning", 1_000_000, 2_000_000, "held-out evaluation on which defaults were chosen (make learn's curves)"
)
TESTS = SeedRange("tests", 2_000_000, 3_000_000, "tests that need cases none of the other ranges hold")
AUDITS = SeedRange("audits", 3_000_000, 5_000_000, "red-team and independent audits")
FINAL = SeedRange("final", 5_000_000, 6_000_000, "the final table of make learn (no default chosen on it)")
GATES = SeedRange("gates", 1_000_000_000, 2_000_000_000, "quality gates: a window per run")

SEED_RANGES: tuple[SeedRange, ...] = (TRAINING, TUNING, TESTS, AUDITS, FINAL, GATES)
"""Every range, in seed order (disjoint: ``tests/test_gate_power.py`` checks it)."""


def range_of(seed: int) -> SeedRange | None:
    """The range that holds ``seed``, or None (a seed no range names)."""
    return next((r for r in SEED_RANGES if seed in r), None)


def gate_window_start(identity: str, n: int) -> int:
    """The first seed of a gate's window of ``n`` seeds for the run named ``identity``: the first 8 bytes
    of ``sha256("gate-window:" + identity)`` as an integer, modulo the room :data:`GATES` leaves for
    ``n`` seeds. The same identity always draws the same window; another identity draws another one
    (two windows of 50 seeds overlap with probability about 1e-7), and no window is known before
    the run's identity exists."""
    room = GATES.size - int(n) + 1
    if n < 1 or room < 1:
        raise ValueError(f"a gate window holds 1 to {GATES.size} seeds, got {n}")
    digest = hashlib.sha256(f"gate-window:{identity}".encode()).digest()
    return GATES.start + int.from_bytes(digest[:8], "big") % room
