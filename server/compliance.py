"""Patient non-compliance: an option of ``task_hard`` (docs/environment.md, "Cases").

A compliance schedule is a ``(24, 28)`` array of wear factors in [0, 1]: the share of each
stage's movement a tooth makes (1 = the aligner worn as prescribed), applied after the
dynamics (:func:`server.dynamics.apply_wear`). It belongs to the case: it is drawn from
``numpy.random.default_rng([seed, task_index, COMPLIANCE_STREAM])``, so every process and
every rollback sees the same schedule, and the case's geometry (drawn from its own stream)
is the same with or without it.

Events, one of each per case. Their sizes are modelling choices, not fitted to data
(aligner wear-time reports fall short of the prescribed 20-22 h a day, and attachments
debond between visits):

* partial wear: a run of 3-6 stages worn about 14-18 h a day (factor 0.6-0.8, every tooth);
* missed wear: 1-2 stages with the aligner mostly out (factor 0.0-0.3, every tooth);
* lost attachment: a canine or premolar whose attachment debonds for 3-6 stages until it
  is bonded again (factor x 0.3-0.5 for that tooth).
"""

from __future__ import annotations

import numpy as np

from server.dental_constants import N_STAGES, N_TEETH, TOOTH_NUMBER

COMPLIANCE_STREAM: int = 1
"""Third word of the schedule's seed sequence (the case geometry uses ``[seed, task_index]``)."""
COMPLIANCE_TASKS: tuple[str, ...] = ("task_hard",)
"""Task levels that offer non-compliance."""
PARTIAL_WEAR_FACTOR: tuple[float, float] = (0.6, 0.8)
MISSED_WEAR_FACTOR: tuple[float, float] = (0.0, 0.3)
LOST_ATTACHMENT_FACTOR: tuple[float, float] = (0.3, 0.5)
_ATTACHMENT_TEETH = np.flatnonzero(np.isin(TOOTH_NUMBER, (3, 4, 5)))


def compliance_schedule(seed: int, task_index: int) -> np.ndarray:
    """The (24, 28) wear factors of a case (read-only; see the module docstring)."""
    rng = np.random.default_rng([seed, task_index, COMPLIANCE_STREAM])
    wear = np.ones((N_STAGES, N_TEETH))
    start, length = int(rng.integers(0, N_STAGES - 3)), int(rng.integers(3, 7))
    wear[start : start + length] = rng.uniform(*PARTIAL_WEAR_FACTOR)
    for stage in rng.choice(N_STAGES, size=int(rng.integers(1, 3)), replace=False):
        wear[stage] = np.minimum(wear[stage], rng.uniform(*MISSED_WEAR_FACTOR))
    tooth = int(rng.choice(_ATTACHMENT_TEETH))
    start, length = int(rng.integers(0, N_STAGES - 3)), int(rng.integers(3, 7))
    wear[start : start + length, tooth] *= rng.uniform(*LOST_ATTACHMENT_FACTOR)
    wear.setflags(write=False)
    return wear
