"""Cases: ``(task_id, seed, force_decay, non_compliance)`` -> initial and target configurations.

Seeded with ``numpy.random.default_rng([seed, task_index])`` (PCG64), so ``(task_id, seed)``
gives bit-identical arrays in every process, whatever the dynamics and compliance options (the
non-compliance schedule has a stream of its own, :mod:`server.compliance`). The target is an ideal Class I arch
(:mod:`server.arch`); the initial is the target with the malocclusion of one
clinical profile (two on ``task_hard``), made penetration-free (crowded teeth are
pushed buccolingually, never overlapped) and feasible (every tooth within
:data:`FEASIBLE_TRANSLATION_MM` / :data:`FEASIBLE_ROTATION_DEG` of its target, so
uniform SLERP over 24 stages respects the per-stage limits).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import NamedTuple

import numpy as np

from server import staging
from server.absent_teeth import SUMMARY_KEY as ABSENT_SUMMARY_KEY
from server.absent_teeth import absent_ids
from server.arch import ArchParameters, build_ideal_arch, occlusal_points
from server.clinical_profiles import (
    PROFILE_GENERATORS,
    PROFILES,
    SECONDARY_PROFILES,
    SECONDARY_SCALE,
    Displacement,
    optimal_strategy,
)
from server.collisions import (
    CONTACT_CROWNS,
    CrownContacts,
    crown_contacts,
    pair_axes,
    penetration_along_axes,
    penetration_mm,
)
from server.compliance import COMPLIANCE_TASKS, compliance_schedule
from server.dental_constants import (
    ADJACENT_PAIRS,
    FEASIBLE_ROTATION_DEG,
    FEASIBLE_TRANSLATION_MM,
    MM_PER_DEG,
    N_STAGES,
    TOOTH_IDS,
    TOOTH_NUMBER,
)
from server.errors import InvalidActionError
from server.occlusion import (
    arch_contacts,
    arch_widths_mm,
    curve_of_spee_mm,
    midline_mm,
    molar_relation_mm,
    overbite_mm,
    overjet_mm,
)
from server.plans import interpolate_poses
from server.quaternion_utils import (
    quaternion_angle,
    quaternion_axis,
    quaternion_from_rotvec,
    quaternion_multiply,
    quaternion_slerp,
    vector_norm,
)
from server.seed_ranges import TRAINING, TUNING

TASK_IDS: tuple[str, ...] = ("task_easy", "task_medium", "task_hard")
TASK_SEVERITY: dict[str, str] = {"task_easy": "mild", "task_medium": "moderate", "task_hard": "severe"}
TASK_DESCRIPTIONS: dict[str, str] = {
    "task_easy": "one mild malocclusion of few teeth",
    "task_medium": "one moderate malocclusion",
    "task_hard": "a severe malocclusion combined with a second, milder one",
}
GENERATOR_TOLERANCE_MM: float = 0.1
"""The contact tolerance the case generator's clearances are set from (the scoring's collision
tolerance, :data:`server.collisions.COLLISION_TOLERANCE_MM`, is calibrated above it)."""
INITIAL_CLEARANCE_MM: float = GENERATOR_TOLERANCE_MM / 2
"""Largest penetration allowed between neighbours of an initial configuration."""
SWEEP_CLEARANCE_MM: float = 0.8 * GENERATOR_TOLERANCE_MM
"""Largest penetration allowed along uniform staging (:func:`sweep_penetration_mm`)."""
SWEEP_SAMPLES: np.ndarray = np.arange(2, N_STAGES, 2) / N_STAGES
"""Progress values at which uniform staging's penetration is sampled: every other aligner (the clearance
margin, SWEEP_CLEARANCE_MM below the tolerance, covers the aligners between)."""
CASE_CACHE_SIZE: int = 4096
TRAIN_SEED_START: int = TRAINING.start
"""Training prompts use seeds from here upwards (:data:`server.seed_ranges.TRAINING`)."""
HELDOUT_SEED_START: int = TUNING.start
"""Held-out evaluation uses seeds from here upwards, never seen in training
(:data:`server.seed_ranges.TUNING`; the gates draw theirs from :data:`server.seed_ranges.GATES`)."""


IMPORTED_TASK = "imported"
"""The ``task_id`` of a case from a case set (docs/cases.md); its seed is a digest of its content."""
MAX_IMPORTED_CASES = 1_000_000
"""Imported cases one process holds (about 6 KB each)."""
_IMPORTED: dict[int, Case] = {}
_IMPORTED_VARIANTS: dict[tuple[int, bool], Case] = {}


class CaseKey(NamedTuple):
    """What names a case, in the order of :func:`generate_case`'s arguments. Every module that
    keys, records or scores cases (rollouts, rewards, evaluation, gates, ``treatment.score_plans``,
    analysis, diagnostics) uses this key and this order."""

    task_id: str
    seed: int
    force_decay: bool = False
    non_compliance: bool = False

    @classmethod
    def of_row(cls, row: dict) -> CaseKey:
        """The key of a dataset row or record ``{"task_id", "seed", "force_decay", ...}``."""
        return cls(
            row["task_id"],
            int(row["seed"]),
            bool(row.get("force_decay", False)),
            bool(row.get("non_compliance", False)),
        )


@dataclass(frozen=True)
class Case:
    """One patient: configurations (28, 7), crown dimensions (28,) mm, clinical facts."""

    task_id: str
    seed: int
    force_decay: bool
    profile: str
    secondary_profile: str | None
    optimal_strategy: str
    initial: np.ndarray
    target: np.ndarray
    crown_width_mm: np.ndarray
    crown_depth_mm: np.ndarray
    summary: dict = field(repr=False)
    wear: np.ndarray | None = field(default=None, repr=False)
    """(24, 28) compliance schedule (:mod:`server.compliance`) when non-compliance is on."""
    absent: np.ndarray | None = field(default=None, repr=False)
    """(28,) bool, the teeth the patient does not have (:mod:`server.absent_teeth`: their rows hold a
    placeholder, the same in ``initial`` and ``target``); None when every tooth is present."""

    @property
    def non_compliance(self) -> bool:
        return self.wear is not None

    @cached_property
    def long_axis(self) -> np.ndarray:
        """(28, 3) each target crown's local z (long) axis in the patient frame (force decay)."""
        return quaternion_axis(self.target[:, :4], 2)

    @cached_property
    def contacts(self) -> CrownContacts:
        """The crowns' ellipse terms at each contact (:func:`server.collisions.crown_contacts`)."""
        return crown_contacts(self.crown_width_mm, self.crown_depth_mm)

    @cached_property
    def need(self) -> np.ndarray:
        """(2, 28) translation (mm) and rotation (deg) of each tooth from initial to target."""
        need = np.stack(
            (
                vector_norm(self.target[:, 4:] - self.initial[:, 4:]),
                np.degrees(quaternion_angle(self.target[:, :4], self.initial[:, :4])),
            )
        )
        need.setflags(write=False)
        return need

    @cached_property
    def need_mm(self) -> float:
        """The summed mm-equivalent movement initial -> target (MM_PER_DEG per degree)."""
        return float(np.hypot(self.need[0], MM_PER_DEG * self.need[1]).sum())

    @cached_property
    def inv_need(self) -> np.ndarray:
        """(2, 28) 1 / need; 0 for a tooth with (almost) nothing to do."""
        inv = np.where(self.need > 1e-9, 1.0 / np.maximum(self.need, 1e-9), 0.0)
        inv.setflags(write=False)
        return inv

    @cached_property
    def overcorrection_room(self) -> np.ndarray:
        """(28,) each tooth's overcorrection room for this case's crowns and absent teeth
        (:func:`server.staging.overcorrection_room`); read-only."""
        room = staging.overcorrection_room(
            self.initial, self.target, self.crown_width_mm, self.crown_depth_mm, self.absent
        )
        room.setflags(write=False)
        return room

    @cached_property
    def initial_list(self) -> list:
        """``initial.tolist()``, shared: copy it before handing it out."""
        return self.initial.tolist()

    @cached_property
    def target_list(self) -> list:
        """``target.tolist()``, shared: copy it before handing it out."""
        return self.target.tolist()

    @property
    def present_ids(self) -> list[int]:
        """The FDI ids of the teeth the patient has, in TOOTH_IDS order."""
        return [int(t) for k, t in enumerate(TOOTH_IDS) if self.absent is None or not self.absent[k]]

    @property
    def follows_plan(self) -> bool:
        """Whether the achieved poses are the aligners' (ideal dynamics, full wear)."""
        return not self.force_decay and self.wear is None


def _apply(target: np.ndarray, d: Displacement) -> np.ndarray:
    poses = target.copy()
    poses[:, :4] = quaternion_multiply(target[:, :4], quaternion_from_rotvec(d.rotation))
    poses[:, 4:7] += d.translation
    return poses


def sweep_penetration_mm(
    initial: np.ndarray, target: np.ndarray, width: np.ndarray, depth: np.ndarray
) -> np.ndarray:
    """(26,) each contact's deepest penetration (mm) along uniform staging (every tooth moving
    together at constant speed), sampled at :data:`SWEEP_SAMPLES` progress values."""
    return penetration_mm(interpolate_poses(initial, target, _SWEEP_PROGRESS), width, depth).max(axis=0)


_SWEEP_PROGRESS: np.ndarray = np.broadcast_to(SWEEP_SAMPLES[:, None], (SWEEP_SAMPLES.size, 28))
_STACK_PROGRESS: np.ndarray = np.concatenate(([0.0], SWEEP_SAMPLES))[:, None, None, None]
"""(12, 1, 1, 1) progress of :func:`_resolve_penetration`'s rows: the poses, then the sweep."""


def _resolve_penetration(
    d: Displacement, target: np.ndarray, width: np.ndarray, depth: np.ndarray, labial: np.ndarray
) -> np.ndarray:
    """Poses (28, 7) of ``d`` applied to ``target``, with overlapping neighbours pushed
    buccolingually until every contact clears, and stays clear along uniform staging
    (:func:`sweep_penetration_mm`: a crown rotating in place can sweep through a tight
    neighbour, and a blocked-out crown coming back into the arch can cut the corner of its
    neighbour; such a crown is blocked out further, which makes its way back clear). Every case
    therefore has a safe plan; plans that rush some teeth ahead of others still collide."""
    t = d.translation.copy()
    poses = _apply(target, d)  # the rotations stay; only translations change below
    # one penetration pass a round over the contacts' crowns: row 0 the poses, rows 1.. the sweep;
    # the rotations' SLERP, the crown axes and the crowns' contact terms are computed once
    q = poses[None, :, :4]
    axes = pair_axes(np.concatenate((q, quaternion_slerp(q, target[None, :, :4], _SWEEP_PROGRESS))))
    # the poses' row alone until it clears (most rounds), then the sweep's rows: element by element
    # the same numbers as one pass over all rows
    axes_poses = tuple(a[:1] for a in axes)
    axes_sweep = tuple(a[1:] for a in axes)
    crowns = crown_contacts(width, depth)
    end = target[CONTACT_CROWNS, 4:6]  # (2, 26, 2) the contacts' crowns' target positions
    for _ in range(60):
        start = end + t[CONTACT_CROWNS, :2]  # the poses' positions (target + t, as below)
        # the same arithmetic as interpolate_poses' translation (row 0: start + 0)
        delta = end - start
        pen = penetration_along_axes(axes_poses, start + _STACK_PROGRESS[:1] * delta, crowns)
        excess = pen[0] - INITIAL_CLEARANCE_MM
        over = excess > 0.0
        if not np.count_nonzero(over):
            pen = penetration_along_axes(axes_sweep, start + _STACK_PROGRESS[1:] * delta, crowns)
            excess = np.maximum.reduce(pen, axis=0) - SWEEP_CLEARANCE_MM
            over = excess > 0.0
            if not np.count_nonzero(over):
                break
        # each tooth is pushed by its contacts' largest excess (+ 0.1 mm); 0 for the others
        excess = np.where(over, excess + 0.1, 0.0)
        push = np.maximum(excess[_PUSHED_BY[0]], excess[_PUSHED_BY[1]]) * _PUSHABLE
        # keep the side a tooth was already displaced to; else block it out labially (on a
        # convex arch a lingual push first moves a crown towards its neighbours). A lingually
        # displaced crown whose pushing neighbour lies lingual of it goes labially too: where the arch
        # turns at the canine, the lateral incisor's neighbour is beside it, and a lingual push only
        # slides the incisor along the canine
        worst = np.where(excess[_PUSHED_BY[0]] >= excess[_PUSHED_BY[1]], _PUSHED_BY[0], _PUSHED_BY[1])
        other = np.where(
            CONTACT_CROWNS[0, worst] == _TEETH, CONTACT_CROWNS[1, worst], CONTACT_CROWNS[0, worst]
        )
        at = target[:, 4:6] + t[:, :2]
        behind = np.einsum("ij,ij->i", at - at[other], labial[:, :2]) > 0.0
        sign = np.where((np.einsum("ij,ij->i", t, labial) < -0.5) & ~behind, -1.0, 1.0)
        t += labial * (sign * push)[:, None]
    poses[:, 4:7] = target[:, 4:7] + t
    return poses


_BLOCKED_OUT: np.ndarray = np.where(
    TOOTH_NUMBER[ADJACENT_PAIRS[:, 0]] < TOOTH_NUMBER[ADJACENT_PAIRS[:, 1]],
    ADJACENT_PAIRS[:, 0],
    ADJACENT_PAIRS[:, 1],
)
"""(26,) the tooth of each contact that a penetration pushes: the more anterior one
(incisors and canines get blocked out)."""
_PUSHED_BY: np.ndarray = np.array(
    [(([k for k, tooth in enumerate(_BLOCKED_OUT) if tooth == i] or [0]) * 2)[:2] for i in range(28)]
).T
"""(2, 28) the (at most two) contacts that push each tooth (a tooth with one listed twice)."""
_TEETH: np.ndarray = np.arange(28)
_PUSHABLE: np.ndarray = np.isin(np.arange(28), _BLOCKED_OUT).astype(float)
"""(28,) 1 for a tooth some contact pushes, 0 for the others (the second molars)."""


def _within_caps(initial: np.ndarray, target: np.ndarray) -> bool:
    trans = vector_norm(initial[:, 4:7] - target[:, 4:7])
    rot = np.degrees(quaternion_angle(initial[:, :4], target[:, :4]))
    return bool(np.all(trans <= FEASIBLE_TRANSLATION_MM) and np.all(rot <= FEASIBLE_ROTATION_DEG))


def case_summary(initial: np.ndarray, width: np.ndarray, absent: np.ndarray | None = None) -> dict:
    """What a clinician measures on the initial casts (mm). No strategy, no diagnosis. With
    ``absent`` (28,) bool, ``absent_teeth`` lists their FDI ids last (the measures read an absent
    tooth's placeholder, :mod:`server.absent_teeth`, as a crown at rest in its space)."""
    irr_u, irr_l, sp_u, sp_l = arch_contacts(initial, width)
    molar = molar_relation_mm(initial)
    widths = arch_widths_mm(initial)
    mean_molar = float(np.mean(molar))
    edge = occlusal_points(initial)
    return {
        "upper_irregularity_mm": round(float(irr_u), 2),
        "lower_irregularity_mm": round(float(irr_l), 2),
        "upper_spacing_mm": round(float(sp_u), 2),
        "lower_spacing_mm": round(float(sp_l), 2),
        "overjet_mm": round(float(overjet_mm(initial, edge)), 2),
        "overbite_mm": round(float(overbite_mm(initial, edge)), 2),
        "molar_relation_right_mm": round(float(molar[0]), 2),
        "molar_relation_left_mm": round(float(molar[1]), 2),
        "molar_class": "II" if mean_molar > 1.0 else ("III" if mean_molar < -1.0 else "I"),
        "midline_mm": round(float(midline_mm(initial)), 2),
        "curve_of_spee_mm": round(float(curve_of_spee_mm(initial, edge)), 2),
        **{f"{k}_width_mm": round(float(v), 2) for k, v in widths.items()},
        **({ABSENT_SUMMARY_KEY: absent_ids(absent)} if absent is not None else {}),
    }


def _task_index(task_id: str) -> int:
    if task_id not in TASK_IDS:
        raise InvalidActionError(f"unknown task_id {task_id!r}: use one of {', '.join(TASK_IDS)}")
    return TASK_IDS.index(task_id)


@lru_cache(maxsize=CASE_CACHE_SIZE)
def _generate(task_id: str, seed: int, force_decay: bool, non_compliance: bool) -> Case:
    case = _geometry(task_id, seed)
    if not force_decay and not non_compliance:
        return case
    wear = compliance_schedule(seed, _task_index(task_id)) if non_compliance else None
    return replace(case, force_decay=force_decay, wear=wear)


@lru_cache(maxsize=CASE_CACHE_SIZE)
def _geometry(task_id: str, seed: int) -> Case:
    """The case with ideal dynamics and full wear (the other options share its geometry)."""
    rng = np.random.default_rng([seed, _task_index(task_id)])
    arch = build_ideal_arch(ArchParameters.sample(rng))
    target = arch.poses
    labial = quaternion_axis(target[:, :4], 1)  # (28, 3) each crown's local y in the patient frame
    severity = TASK_SEVERITY[task_id]
    profile = PROFILES[int(rng.integers(len(PROFILES)))]
    d = PROFILE_GENERATORS[profile](rng, severity, labial)
    secondary = None
    if task_id == "task_hard":
        options = SECONDARY_PROFILES[profile]
        secondary = options[int(rng.integers(len(options)))]
        d = d + PROFILE_GENERATORS[secondary](rng, "moderate", labial).scaled(SECONDARY_SCALE)
    for _ in range(8):
        initial = _resolve_penetration(d, target, arch.crown_width_mm, arch.crown_depth_mm, labial)
        if _within_caps(initial, target):
            break
        d = d.scaled(0.8)  # too much movement for 24 aligners: a milder instance of the same case
    else:  # pragma: no cover - guarded by the feasibility test over thousands of seeds
        raise RuntimeError(f"case {task_id}/{seed} could not be made feasible")
    for arr in (initial, target, arch.crown_width_mm, arch.crown_depth_mm):
        arr.setflags(write=False)
    return Case(
        task_id=task_id,
        seed=seed,
        force_decay=False,
        profile=profile,
        secondary_profile=secondary,
        optimal_strategy=optimal_strategy(profile, secondary),
        initial=initial,
        target=target,
        crown_width_mm=arch.crown_width_mm,
        crown_depth_mm=arch.crown_depth_mm,
        summary=case_summary(initial, arch.crown_width_mm),
    )


def generate_case(task_id: str, seed: int, force_decay: bool = False, non_compliance: bool = False) -> Case:
    """The case of ``(task_id, seed, force_decay, non_compliance)``; cached (LRU, CASE_CACHE_SIZE),
    read-only arrays. ``non_compliance`` (missed and partial wear, a lost attachment) is an option
    of task_hard only (:mod:`server.compliance`). ``task_id`` :data:`IMPORTED_TASK` names a case of a
    loaded case set (:func:`register_imported`), under the dynamics ``force_decay`` names."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise InvalidActionError(f"seed must be an integer, got {seed!r}")
    if not 0 <= int(seed) < 2**63:
        raise InvalidActionError(f"seed must be in [0, 2**63), got {seed}")
    if task_id == IMPORTED_TASK:
        case = _IMPORTED.get(int(seed))
        if case is None:
            raise InvalidActionError(
                f"no imported case with seed {seed} is loaded: load its case set first (--cases FILE)"
            )
        if non_compliance:
            raise InvalidActionError(
                "non_compliance is an option of generated task_hard cases, not of imported ones"
            )
        if case.force_decay != bool(
            force_decay
        ):  # the other dynamics, made once (its cached properties kept)
            case = _IMPORTED_VARIANTS.get((int(seed), bool(force_decay)))
            if case is None:
                case = replace(_IMPORTED[int(seed)], force_decay=bool(force_decay))
                _IMPORTED_VARIANTS[(int(seed), bool(force_decay))] = case
        return case
    if non_compliance and task_id not in COMPLIANCE_TASKS:
        raise InvalidActionError(
            f"non_compliance is an option of {', '.join(COMPLIANCE_TASKS)} only, not of {task_id!r}: "
            "drop it or use task_hard"
        )
    return _generate(task_id, int(seed), bool(force_decay), bool(non_compliance))


def register_imported(case: Case) -> CaseKey:
    """Make an imported case reachable by key: ``CaseKey(IMPORTED_TASK, seed)``, ``seed`` the case's
    own (a content digest, :func:`orthojob.data.case_sets.register`); in this process only, at most
    :data:`MAX_IMPORTED_CASES`. A seed already loaded with other content is refused."""
    if case.task_id != IMPORTED_TASK:
        raise ValueError(f"only imported cases are registered, not {case.task_id!r}")
    held = _IMPORTED.get(case.seed)
    if (
        held is not None
        and held is not case
        and not (np.array_equal(held.initial, case.initial) and np.array_equal(held.target, case.target))
    ):
        raise ValueError(f"imported seed {case.seed} is already another case's")
    if held is None and len(_IMPORTED) >= MAX_IMPORTED_CASES:
        raise ValueError(f"at most {MAX_IMPORTED_CASES} imported cases can be loaded in one process")
    _IMPORTED[case.seed] = case
    _IMPORTED_VARIANTS.pop((case.seed, not case.force_decay), None)
    return CaseKey(IMPORTED_TASK, case.seed, case.force_decay)


def clear_case_cache() -> None:
    """Forget every cached case (benchmarks of the cold path; tests that corrupt one)."""
    _generate.cache_clear()
    _geometry.cache_clear()
