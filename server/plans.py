"""Treatment plans: what the LLM writes, and the 24 aligner shapes it means.

Plan semantics (the one statement of them; the prompt and README quote it):

* ``priority`` sets when a group starts moving: ``high`` at stage 1, ``medium`` at
  stage 7, ``low`` at stage 13 (:data:`PRIORITY_START_STAGE`); missing = ``high``.
  ``start_stage`` (optional, an integer 1-24) sets the first moving stage directly and
  overrides ``priority``: a clinical sequence of more than three steps needs it.
* ``fraction`` is the share of each tooth's total planned movement performed per
  stage once it starts (constant-speed SLERP for rotation, linear for
  translation) until the tooth reaches its target: planned progress at stage
  ``s`` is ``clip((s - start + 1) * fraction, 0, 1)``. ``1/24`` from stage 1 is
  uniform SLERP; ``0`` keeps a tooth where it is.
* Teeth in no group follow uniform SLERP. A tooth listed twice takes its first
  group. Unknown FDI ids, non-integer ids (booleans included), fractions outside
  [0, 1], non-finite or non-numeric fractions and unknown priorities are ignored
  (a group with a bad fraction is ignored whole; a bad ``start_stage`` falls back to the
  priority) and counted in :class:`PlanFormat`; nothing here raises. A group is *usable*
  when it sets at least one tooth; a plan with no usable group is not a plan (every face reads
  plans through :mod:`server.plan_text` and scores it the minimum), while this module still
  reads it as uniform SLERP for the internal baseline API (:func:`server.treatment.score_plans`).
* ``overcorrection`` (optional, a number in [0, :data:`MAX_OVERCORRECTION`], default 0) plans
  the group's teeth beyond their targets, to ``1 + overcorrection`` times their movement, as
  clinicians overcorrect movements that under-express (extrusion, rotation of round teeth):
  planned progress at stage ``s`` is ``(1 + overcorrection) * clip((s - start + 1) * fraction,
  0, 1)``; the per-stage limits apply to the overcorrected steps. Under force decay the
  expressed movement then lands nearer the target; under ideal dynamics, or overdone, the
  overshoot is expressed and costs accuracy. An invalid value is ignored (0) and counted.
* A group that names a tooth the case lacks (:mod:`server.absent_teeth`) is not usable on that case:
  :func:`validity_on` counts it out (the plan itself does not know the case; :attr:`PlanSpec.group`
  keeps which group set each tooth).
* ``strategy`` is one of :data:`server.clinical_profiles.STRATEGIES`; it is
  judged against the case and against the plan's own staging order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from server.clinical_profiles import STRATEGIES
from server.dental_constants import DEFAULT_PRIORITY, N_STAGES, N_TEETH, PRIORITY_START_STAGE, TOOTH_INDEX
from server.quaternion_utils import components, quaternion_normalize, slerp_components

UNIFORM_FRACTION: float = 1.0 / N_STAGES
MAX_OVERCORRECTION: float = 1.0
"""Largest overcorrection a group may plan (the movement planned at most doubled)."""
MAX_GROUPS: int = 64
"""Groups beyond this many are ignored (and counted), bounding the work per plan."""


@dataclass
class PlanFormat:
    """Counts of what a plan got right and wrong (feeds the format score)."""

    is_object: bool = False
    has_groups: bool = False
    groups: int = 0
    valid_groups: int = 0
    invalid_fractions: int = 0
    invalid_priorities: int = 0
    invalid_starts: int = 0
    invalid_overcorrections: int = 0
    invalid_teeth: int = 0
    duplicate_teeth: int = 0
    ignored_groups: int = 0
    usable_groups: int = 0
    strategy_known: bool = False

    @property
    def validity(self) -> float:
        """Share of the plan's groups that were usable (1.0 for a plan with no groups)."""
        return 1.0 if self.groups == 0 else self.valid_groups / self.groups


@dataclass
class PlanSpec:
    """A plan reduced to per-tooth arrays: start stage (28,) int, fraction (28,) float, and
    overcorrection (28,) float (None: 0 for every tooth)."""

    start: np.ndarray
    fraction: np.ndarray
    strategy: str | None
    format: PlanFormat = field(default_factory=PlanFormat)
    overcorrection: np.ndarray | None = None
    group: np.ndarray | None = None
    """(28,) int: the index of the group that set each tooth, -1 for a tooth in no group (None: no
    group set any)."""

    def overcorrections(self) -> np.ndarray:
        """(28,) overcorrection of each tooth (zeros when none was planned)."""
        return np.zeros(N_TEETH) if self.overcorrection is None else self.overcorrection


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def normalize_plan(plan: object) -> PlanSpec:
    """Reduce any JSON-like value to a PlanSpec, applying the semantics above. Never raises."""
    fmt = PlanFormat()
    strategy = None
    if not isinstance(plan, dict):
        return _plan_spec(None, None, None, None, fmt)
    fmt.is_object = True
    raw_strategy = plan.get("strategy")
    if isinstance(raw_strategy, str) and raw_strategy in STRATEGIES:
        strategy = raw_strategy
        fmt.strategy_known = True
    groups = plan.get("tooth_groups")
    if not isinstance(groups, list):
        return _plan_spec(None, None, None, strategy, fmt)
    fmt.has_groups = True
    fmt.groups = len(groups)
    # per-tooth values as Python lists (one array each at the end)
    start = [1] * N_TEETH
    fraction = [UNIFORM_FRACTION] * N_TEETH
    over = [0.0] * N_TEETH
    group_of = [-1] * N_TEETH
    for k, group in enumerate(groups):
        if k >= MAX_GROUPS:
            fmt.ignored_groups = len(groups) - MAX_GROUPS
            break
        if not isinstance(group, dict):
            continue
        f = group.get("fraction")
        if not _is_number(f) or not 0 <= f <= 1 or (isinstance(f, float) and not math.isfinite(f)):
            fmt.invalid_fractions += 1
            continue
        priority = group.get("priority", DEFAULT_PRIORITY)
        if not isinstance(priority, str) or priority not in PRIORITY_START_STAGE:
            fmt.invalid_priorities += 1
            priority = DEFAULT_PRIORITY
        first = PRIORITY_START_STAGE[priority]
        if "start_stage" in group:
            s = group["start_stage"]
            if isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= N_STAGES:
                first = s
            else:
                fmt.invalid_starts += 1
        oc = 0.0
        if "overcorrection" in group:
            o = group["overcorrection"]
            if _is_number(o) and 0 <= o <= MAX_OVERCORRECTION and math.isfinite(o):
                oc = float(o)
            else:
                fmt.invalid_overcorrections += 1
        teeth = group.get("teeth")
        if not isinstance(teeth, list):
            fmt.invalid_teeth += 1
            continue
        fmt.valid_groups += 1
        set_any = False
        f = float(f)
        for tooth in teeth[: N_TEETH * 4]:
            index = TOOTH_INDEX.get(tooth) if type(tooth) is int or _is_tooth_id(tooth) else None
            if index is None:
                fmt.invalid_teeth += 1
            elif group_of[index] >= 0:
                fmt.duplicate_teeth += 1
            else:
                group_of[index] = k
                set_any = True
                start[index] = first
                fraction[index] = f
                over[index] = oc
        fmt.usable_groups += set_any
    spec = _plan_spec(start, fraction, over, strategy, fmt)
    if fmt.usable_groups:
        spec.group = np.array(group_of, dtype=np.int64)
    return spec


def overcorrects(plan: object) -> bool:
    """Whether ``plan`` overcorrects any tooth as the simulator reads it (:func:`normalize_plan`: False
    for something that is not a plan, an out-of-range value ignored)."""
    return bool(normalize_plan(plan).overcorrections().any())


def groups_naming(spec: PlanSpec, teeth: np.ndarray | None) -> int:
    """How many of the plan's groups set a tooth of the mask ``teeth`` (28,) bool (0 for None):
    the groups that move a tooth the patient does not have."""
    if teeth is None or spec.group is None:
        return 0
    named = spec.group[teeth]
    return len(set(named[named >= 0].tolist()))


def validity_on(spec: PlanSpec, absent: np.ndarray | None) -> float:
    """:attr:`PlanFormat.validity` on a case whose absent teeth are ``absent`` (28,) bool: a group that
    sets an absent tooth is not usable (a format error: the prompt lists the teeth there are)."""
    bad = groups_naming(spec, absent)
    if not bad:
        return spec.format.validity
    return max(spec.format.valid_groups - bad, 0) / spec.format.groups


def _is_tooth_id(x: object) -> bool:
    """An integer that can be a tooth id (booleans are not)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _plan_spec(
    start: list | None, fraction: list | None, over: list | None, strategy: str | None, fmt: PlanFormat
) -> PlanSpec:
    """The PlanSpec of per-tooth lists (None: uniform SLERP from stage 1, no overcorrection)."""
    return PlanSpec(
        np.ones(N_TEETH, dtype=np.int64) if start is None else np.array(start, dtype=np.int64),
        np.full(N_TEETH, UNIFORM_FRACTION) if fraction is None else np.array(fraction, dtype=np.float64),
        strategy,
        fmt,
        np.array(over, dtype=np.float64) if over is not None and any(over) else None,
    )


def planned_progress(
    start: np.ndarray, fraction: np.ndarray, overcorrection: np.ndarray | None = None
) -> np.ndarray:
    """(..., 25, 28) planned share of each tooth's movement at stages 0..24 (above 1 where overcorrected)."""
    stages = np.arange(N_STAGES + 1)[:, None]
    steps = stages - start[..., None, :] + 1
    progress = np.clip(steps * fraction[..., None, :], 0.0, 1.0) * (stages >= 1)
    if overcorrection is not None:
        progress = progress * (1.0 + overcorrection[..., None, :])
    return progress


def interpolate_poses(initial: np.ndarray, target: np.ndarray, progress: np.ndarray) -> np.ndarray:
    """Poses (..., S, 28, 7) a share ``progress`` (..., S, 28) of the way from initial to target.

    initial, target: (..., 28, 7). Rotation by SLERP, translation linearly; a progress above 1
    continues past the target along the same path (overcorrection).
    """
    q0 = initial[..., None, :, :4]
    q1 = target[..., None, :, :4]
    t0 = initial[..., None, :, 4:]
    t1 = target[..., None, :, 4:]
    out = np.empty((*np.broadcast_shapes(progress.shape, t0.shape[:-1]), 7))
    planes = np.moveaxis(out, -1, 0)  # computed plane by plane (long inner loops), the same numbers
    planes[:4] = slerp_components(q0, q1, progress)
    planes[4:] = components(t0) + progress * components(t1 - t0)
    return out


class StagePoses:
    """:func:`interpolate_poses` of one case for one progress vector at a time, the same numbers:
    ``StagePoses(initial, target)(progress)`` equals ``interpolate_poses(initial, target,
    progress[None])[0]`` bit for bit. What does not depend on the progress (each tooth's SLERP
    angle, the sign-aligned target rotations, the translations' span) is computed once, so a
    stage costs a few small numpy calls (the agentic tools' hot path, :mod:`orthojob.agentic.tools`).

    initial, target: (28, 7) poses; progress: (28,) shares (above 1: overcorrection).
    """

    def __init__(self, initial: np.ndarray, target: np.ndarray) -> None:
        initial = np.asarray(initial, dtype=np.float64)
        target = np.asarray(target, dtype=np.float64)
        # the progress-free part of SLERP's weights (server.quaternion_utils._slerp_weights): the
        # target rotations sign-aligned with the initial ones, each tooth's angle and its sine
        q0, q1 = initial[:, :4], target[:, :4]
        dot = np.add.reduce(q0 * q1, axis=-1, keepdims=True)
        opposite = dot < 0.0
        self._q0 = np.ascontiguousarray(q0)
        self._q1 = np.ascontiguousarray(np.where(opposite, -q1, q1) if np.count_nonzero(opposite) else q1)
        dot = np.minimum(np.abs(dot), 1.0)
        self._theta = np.arccos(dot)
        sin_theta = np.sin(self._theta)
        self._small = sin_theta < 1e-6
        self._any_small = bool(np.count_nonzero(self._small))
        self._sin_theta = np.where(self._small, 1.0, sin_theta) if self._any_small else sin_theta
        self._t0 = np.ascontiguousarray(initial[:, 4:])
        self._span = target[:, 4:] - initial[:, 4:]

    def __call__(self, progress: np.ndarray) -> np.ndarray:
        """(28, 7) poses a share ``progress`` (28,) of the way from initial to target."""
        t = np.asarray(progress, dtype=np.float64)[:, None]
        u = 1.0 - t
        theta, sin_theta = self._theta, self._sin_theta
        w0 = np.sin(u * theta) / sin_theta
        w1 = np.sin(t * theta) / sin_theta
        if self._any_small:
            w0 = np.where(self._small, u, w0)
            w1 = np.where(self._small, t, w1)
        out = np.empty((N_TEETH, 7))
        out[:, :4] = quaternion_normalize(w0 * self._q0 + w1 * self._q1)
        out[:, 4:] = self._t0 + t * self._span
        return out
