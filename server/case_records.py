"""Case records: one patient's case as data, validated, and the :class:`~server.cases.Case` it makes.

The case-set format (docs/cases.md), version :data:`FORMAT`: one JSON object per case with

* ``format``: ``"orthorl-case/1"``;
* ``case_id`` and ``patient_id``: non-empty strings (a patient may have several cases);
* ``teeth``: the FDI ids of the teeth whose poses follow (any order, each once), and ``absent``
  (optional): the FDI ids of the teeth the patient does not have. Together they are the 28 teeth of
  :data:`server.dental_constants.TOOTH_IDS`;
* ``initial`` and ``target``: one pose per entry of ``teeth``, ``[qw, qx, qy, qz, tx, ty, tz]``: a
  unit quaternion (w first) and the crown centroid in mm, in the patient frame (x to the patient's
  left, y anterior, z occlusal-up); or ``initial_transforms`` and ``target_transforms``: one 4 x 4
  rigid transform per entry (rotation columns the tooth's axes, translation the crown centroid),
  converted to poses (:func:`pose_transforms` is the inverse);
* ``crown_width_mm`` and ``crown_depth_mm`` (optional): one per entry of ``teeth``; the norms of
  :data:`server.dental_constants.CROWN_WIDTH_MM` / ``CROWN_DEPTH_MM`` when absent (and counted);
* ``labels`` (optional): ``profile`` (one of :data:`server.clinical_profiles.PROFILES`),
  ``secondary_profile``, ``notes``; without a ``profile`` the diagnosis (profile, secondary profile
  and so the optimal strategy) is computed from the initial and target poses
  (:func:`server.diagnosis.diagnose`), kept in :attr:`Checked.diagnosis` and counted in the notes
  (``diagnosis_computed``); given labels are checked and used as given;
* ``force_decay`` (optional, default false): the dynamics the case is simulated under;
* ``split`` (optional): ``"train"`` or ``"heldout"`` (:data:`SPLITS`);
* ``task_id`` and ``seed`` (optional): a generated case's key, which an exported record keeps so that
  its observations are the generated case's; an imported case is ``task_id`` ``"imported"``.

:func:`case_of_record` checks a record, its schema and its geometry (crowns of anatomical size, each
quadrant on its own side of the midline, no crown far from its neighbours, no crown upside down, no
crowns interpenetrating, neighbours or antagonists, the upper arch above the lower one and in occlusion
in the target: docs/cases.md; the anatomical checks are :mod:`server.case_anatomy`'s, the record's
format, units and feasibility in :data:`server.dental_constants.N_STAGES` aligners this module's),
and reports every problem by case id and FDI tooth (:class:`Problem`); nothing is silently fixed
except quaternions within :data:`QUATERNION_TOLERANCE` of unit length, which are normalised and
counted. Pure numpy and the standard library: file and S3
reading are :mod:`orthojob.data.case_sets`'.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from server.absent_teeth import ARCH_ROWS, absent_ids, absent_mask, placeholder_poses
from server.case_anatomy import (
    MIN_CROWN_DEPTH_MM,
    MIN_CROWN_WIDTH_MM,
    bite_problems,
    crown_collisions,
    gap_problems,
    layout_problems,
)
from server.cases import (
    IMPORTED_TASK,
    TASK_IDS,
    Case,
    CaseKey,
    case_summary,
    generate_case,
    register_imported,
)
from server.clinical_profiles import PROFILES, SECONDARY_PROFILES, optimal_strategy
from server.collisions import COLLISION_TOLERANCE_MM
from server.dental_constants import (
    CROWN_DEPTH_MM,
    CROWN_WIDTH_MM,
    MAX_ROTATION_DEG,
    MAX_TRANSLATION_MM,
    N_STAGES,
    N_TEETH,
    TOOTH_CLASS,
    TOOTH_CLASSES,
    TOOTH_IDS,
    TOOTH_INDEX,
)
from server.diagnosis import Diagnosis, diagnose_many
from server.quaternion_utils import quaternion_angle, quaternion_from_matrix, quaternion_to_matrix

FORMAT = "orthorl-case/1"
TRANSFORM_TOLERANCE = 1e-3
"""A 4 x 4 transform's rotation part must be orthonormal within this (max |R^T R - I|)."""
QUATERNION_TOLERANCE = 1e-3
"""A quaternion whose norm is within this of 1 is normalised (and counted); beyond it, refused."""
MAX_CENTROID_MM = 80.0
"""No crown centroid lies this far from the frame's origin in a real arch (generated ones: < 40 mm)."""
ARCH_SPAN_MM = (20.0, 120.0)
"""Plausible span of the crown centroids along x (mm); outside it the units are likely wrong."""
CROWN_SIZE_MM = (1.0, 20.0)
"""Plausible crown widths and depths (mm): outside it the units are likely wrong."""
FIELDS = frozenset(
    {"format", "case_id", "patient_id", "teeth", "absent", "initial", "target", "crown_width_mm",
     "crown_depth_mm", "labels", "force_decay", "task_id", "seed", "split", "initial_transforms",
     "target_transforms"}
)  # fmt: skip
SPLITS = ("train", "heldout")
"""The values of a record's optional ``split``: training cases, or cases held out for evaluation."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a record: its case id (None when it has none), the FDI tooth it concerns
    (None for the whole case) and what to fix."""

    case_id: str | None
    tooth: int | None
    message: str

    def __str__(self) -> str:
        where = f"case {self.case_id!r}" if self.case_id is not None else "a case without a case_id"
        return f"{where}{f', tooth {self.tooth}' if self.tooth is not None else ''}: {self.message}"


@dataclass
class Checked:
    """What :func:`case_of_record` made of a record: the case (None when a problem was found),
    the problems, what was filled in or normalised (counts by kind), and the diagnosis computed from
    the geometry when the record's labels gave no profile (None when the labels' were used)."""

    case: Case | None
    case_id: str | None
    patient_id: str | None
    problems: list[Problem] = field(default_factory=list)
    notes: dict[str, int] = field(default_factory=dict)
    diagnosis: Diagnosis | None = None
    split: str | None = None


def case_digest(case: Case) -> str:
    """A case's content digest (sha256 hex): its poses, crown sizes, dynamics and labels, whatever its
    id or key; two records of the same case share it, so caches and splits can key by it."""
    h = hashlib.sha256()
    for arr in (case.initial, case.target, case.crown_width_mm, case.crown_depth_mm):
        h.update(np.ascontiguousarray(arr, dtype="<f8").tobytes())
    if case.wear is not None:
        h.update(np.ascontiguousarray(case.wear, dtype="<f8").tobytes())
    h.update(repr((bool(case.force_decay), case.profile, case.secondary_profile)).encode())
    if case.absent is not None:
        h.update(b"absent:" + np.packbits(case.absent).tobytes())
    return h.hexdigest()


def register_case(case: Case) -> CaseKey:
    """The key a validated case is reached by in this process: its generated key when it is its
    generated case (an export read back), else ``CaseKey("imported", seed)`` with ``seed`` the first 60
    bits of its content digest (under ideal dynamics: both dynamics share the key's seed), registered
    with :func:`server.cases.register_imported`."""
    generated = case.task_id in TASK_IDS and generate_case(case.task_id, case.seed, case.force_decay)
    if generated and case_digest(generated) == case_digest(case):
        return CaseKey(case.task_id, case.seed, case.force_decay)
    seed = int(case_digest(replace(case, force_decay=False))[:15], 16)
    return register_imported(replace(case, task_id=IMPORTED_TASK, seed=seed))


def record_of_case(case: Case, case_id: str | None = None, patient_id: str | None = None) -> dict:
    """A case as a :data:`FORMAT` record: its present teeth and its absent ones, its own crown sizes,
    its labels, and its key (``task_id``, ``seed``) so an import gives back the same case."""
    cid = case_id or f"{case.task_id}-{case.seed}{'-fd' if case.force_decay else ''}"
    here = slice(None) if case.absent is None else ~case.absent
    record = {
        "format": FORMAT,
        "case_id": cid,
        "patient_id": patient_id or f"{case.task_id}-{case.seed}",
        "teeth": case.present_ids,
        "initial": case.initial[here].tolist(),
        "target": case.target[here].tolist(),
        "crown_width_mm": case.crown_width_mm[here].tolist(),
        "crown_depth_mm": case.crown_depth_mm[here].tolist(),
        "labels": {"profile": case.profile, "secondary_profile": case.secondary_profile},
        "force_decay": bool(case.force_decay),
        "task_id": case.task_id,
        "seed": int(case.seed),
    }
    if case.absent is not None:
        record["absent"] = absent_ids(case.absent)
    return record


_NUMBER_TYPES = {float, int}


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _poses(value: Any, name: str, teeth: list[int], report, notes: dict) -> np.ndarray | None:
    """(28, 7) poses in TOOTH_IDS order from a list aligned with ``teeth``; None after a problem."""
    if not isinstance(value, (list, tuple)) or len(value) != len(teeth):
        report(None, f"{name} must be a list of {len(teeth)} poses, one per entry of teeth, got "
                     f"{type(value).__name__}{f' of {len(value)}' if isinstance(value, (list, tuple)) else ''}")  # fmt: skip
        return None
    rows: list[int] = []  # teeth whose pose is 7 numbers
    for tooth, pose in zip(teeth, value):
        if not isinstance(pose, (list, tuple)) or len(pose) != 7:
            report(tooth, f"{name} pose must be 7 numbers [qw, qx, qy, qz, tx, ty, tz]")
        elif not set(map(type, pose)) <= _NUMBER_TYPES:  # a bool is not a number here
            report(tooth, f"{name} pose has a value that is not a number: {pose!r}")
        else:
            rows.append(tooth)
    if len(rows) != len(teeth):
        return None
    p = np.array(value, dtype=float)  # (n, 7), one row per entry of teeth: checked row-wise at once
    finite = np.isfinite(p).all(axis=1)
    norm = np.linalg.norm(np.where(finite[:, None], p[:, :4], 1.0), axis=1)
    off = np.abs(norm - 1.0)
    far = finite & (np.abs(np.where(finite[:, None], p[:, 4:], 0.0)).max(axis=1) > MAX_CENTROID_MM)
    for k in np.flatnonzero(~finite):
        report(teeth[k], f"{name} pose has a non-finite value: {value[k]!r}")
    for k in np.flatnonzero(finite & (off > QUATERNION_TOLERANCE)):
        report(teeth[k], f"{name} quaternion has norm {norm[k]:.4f}, not 1 (within {QUATERNION_TOLERANCE})")
    if far.any():  # one message for the case: the units or the frame are wrong, not one tooth
        teeth_far = [teeth[k] for k in np.flatnonzero(far)]
        report(teeth_far[0] if len(teeth_far) == 1 else None, f"{name} crown centroids over {MAX_CENTROID_MM:.0f} mm "
               f"from the origin (teeth {', '.join(map(str, teeth_far))}): are the units mm and the frame the patient's?")  # fmt: skip
    if not finite.all() or (off > QUATERNION_TOLERANCE).any() or far.any():
        return None
    fix = off > 1e-9  # unit to float precision otherwise: left bit for bit as given
    if fix.any():
        p[fix, :4] /= norm[fix, None]
        notes["quaternions_normalised"] = notes.get("quaternions_normalised", 0) + int(fix.sum())
    out = np.zeros((N_TEETH, 7))
    out[[TOOTH_INDEX[t] for t in teeth]] = p
    return out


def _pose_rows(record: dict, name: str, teeth: list[int], report, notes: dict) -> Any:
    """The record's ``name`` poses, or its ``name_transforms`` (4 x 4 per tooth) converted to poses;
    None (after a report) when a transform is not a rigid motion, or both or neither are given."""
    key = f"{name}_transforms"
    if key not in record:
        return record.get(name)
    if name in record:
        report(None, f"give {name} (poses) or {key} (4 x 4 transforms), not both")
        return None
    value = record[key]
    if not isinstance(value, (list, tuple)) or len(value) != len(teeth):
        report(None, f"{key} must be a list of {len(teeth)} 4 x 4 matrices, one per entry of teeth")
        return None
    shaped = [
        isinstance(m, (list, tuple)) and len(m) == 4
        and all(isinstance(r, (list, tuple)) and len(r) == 4 and set(map(type, r)) <= _NUMBER_TYPES for r in m)
        for m in value
    ]  # fmt: skip
    for tooth, m, good in zip(teeth, value, shaped):
        if not good:
            report(tooth, f"{key} must hold a 4 x 4 matrix of numbers (row-major), got {m!r}"[:300])
    t = np.array([m if good else np.eye(4) for m, good in zip(value, shaped)], dtype=float)  # (n, 4, 4)
    rot = t[:, :3, :3]
    finite = np.isfinite(t).all(axis=(1, 2))
    safe = np.where(finite[:, None, None], rot, np.eye(3))
    off = np.abs(np.einsum("nij,nik->njk", safe, safe) - np.eye(3)).max(axis=(1, 2))
    det = np.linalg.det(safe)
    bottom = np.abs(np.where(finite[:, None], t[:, 3], 0.0) - [0.0, 0.0, 0.0, 1.0]).max(axis=1)
    for k, tooth in enumerate(teeth):
        if not finite[k]:
            report(tooth, f"{key} has a non-finite value")
        elif bottom[k] > 1e-9:
            report(tooth, f"{key}: the last row must be [0, 0, 0, 1], got {t[k, 3].tolist()}")
        elif off[k] > TRANSFORM_TOLERANCE:
            report(tooth, f"{key}: the rotation part is not orthonormal (off by {off[k]:.2g}, tolerance "
                          f"{TRANSFORM_TOLERANCE}): a scale or shear is not a tooth's motion; are the units mm?")  # fmt: skip
        elif det[k] < 0.0:
            report(
                tooth,
                f"{key}: the rotation part is a reflection (determinant {det[k]:.3f}): a left-handed frame",
            )
    if not (all(shaped) and finite.all() and (bottom <= 1e-9).all() and (off <= TRANSFORM_TOLERANCE).all()
            and (det > 0).all()):  # fmt: skip
        return None
    notes["transforms_converted"] = notes.get("transforms_converted", 0) + 1
    return np.concatenate((quaternion_from_matrix(rot), t[:, :3, 3]), axis=1).tolist()


def pose_transforms(poses: np.ndarray) -> np.ndarray:
    """(..., 4, 4) rigid transforms of poses (..., 7): rotation from the quaternion, the centroid as
    translation (the inverse of a record's ``*_transforms``)."""
    poses = np.asarray(poses, dtype=float)
    out = np.zeros((*poses.shape[:-1], 4, 4))
    out[..., :3, :3] = quaternion_to_matrix(poses[..., :4])
    out[..., :3, 3] = poses[..., 4:]
    out[..., 3, 3] = 1.0
    return out


def _sizes(
    value: Any, name: str, default: np.ndarray, teeth: list[int], report, notes: dict
) -> np.ndarray | None:
    """(28,) crown sizes (mm) from a list aligned with ``teeth`` (the norms ``default`` where none is
    given); None after a problem: not a finite number, implausible units, or below the anatomical
    minimum (:data:`server.case_anatomy.MIN_CROWN_WIDTH_MM`, ``MIN_CROWN_DEPTH_MM``)."""
    floor, what = (
        (MIN_CROWN_WIDTH_MM, "mesiodistal width between its contact points")
        if name == "crown_width_mm"
        else (MIN_CROWN_DEPTH_MM, "buccolingual depth at its contacts")
    )
    if value is None:
        notes[f"{name}_from_norms"] = notes.get(f"{name}_from_norms", 0) + 1
        return default.copy()
    if not isinstance(value, (list, tuple)) or len(value) != len(teeth):
        report(None, f"{name} must be a list of {len(teeth)} numbers (mm), one per entry of teeth")
        return None
    out = default.copy()
    ok = True
    for tooth, v in zip(teeth, value):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            report(tooth, f"{name} must be a finite number of mm, got {v!r}")
            ok = False
        elif not CROWN_SIZE_MM[0] <= v <= CROWN_SIZE_MM[1]:
            report(
                tooth, f"{name} {v} mm is outside {CROWN_SIZE_MM[0]}-{CROWN_SIZE_MM[1]} mm: are the units mm?"
            )
            ok = False
        elif v < floor[TOOTH_INDEX[tooth]]:
            cls = TOOTH_CLASSES[TOOTH_CLASS[TOOTH_INDEX[tooth]]]
            report(tooth, f"{name} {v} mm is below the smallest {cls} crown ({floor[TOOTH_INDEX[tooth]]:.1f} mm): "
                          f"measure the crown's {what}; crowns this small never touch, so the collision "
                          f"rules would not apply")  # fmt: skip
            ok = False
        else:
            out[TOOTH_IDS.index(tooth)] = float(v)
    return out if ok else None


def case_of_record(record: Any) -> Checked:
    """Check a record and build its case (see the module docstring); every problem is reported."""
    return cases_of_records([record])[0]


def cases_of_records(records: Sequence[Any]) -> list[Checked]:
    """:func:`case_of_record` of each record, the unlabelled ones diagnosed in one batch
    (:func:`server.diagnosis.diagnose_many`): the same results, a fraction of the time."""
    checked = [_checked(record) for record in records]
    pending = [k for k, (_, parts) in enumerate(checked) if parts is not None and parts["profile"] is None]
    diagnoses: dict[int, Diagnosis] = {}
    if pending:
        found = diagnose_many(
            np.stack([checked[k][1]["initial"] for k in pending]),
            np.stack([checked[k][1]["target"] for k in pending]),
            np.stack([checked[k][1]["width"] for k in pending]),
        )
        diagnoses = dict(zip(pending, found))
    return [_finish(c, parts, diagnoses.get(k)) for k, (c, parts) in enumerate(checked)]


def _checked(record: Any) -> tuple[Checked, dict | None]:
    """The record's problems and notes, and (when it has none) the parts its case is made of."""
    problems: list[Problem] = []
    notes: dict[str, int] = {}
    case_id = record.get("case_id") if isinstance(record, dict) else None
    cid = case_id if isinstance(case_id, str) and case_id else None

    def report(tooth: int | None, message: str) -> None:
        problems.append(Problem(cid, tooth, message))

    if not isinstance(record, dict):
        report(None, f"a case record must be a JSON object, got {type(record).__name__}")
        return Checked(None, None, None, problems, notes), None
    if record.get("format") != FORMAT:
        report(None, f"format must be {FORMAT!r}, got {record.get('format')!r}")
    unknown = sorted(set(record) - FIELDS)
    if unknown:
        report(None, f"unknown fields {unknown}: the fields are {sorted(FIELDS)}")
    if cid is None:
        report(None, f"case_id must be a non-empty string, got {case_id!r}")
    patient_id = record.get("patient_id")
    if not isinstance(patient_id, str) or not patient_id:
        report(None, f"patient_id must be a non-empty string, got {patient_id!r}")
        patient_id = None

    teeth_raw, absent_raw = record.get("teeth"), record.get("absent") or []
    teeth: list[int] = []
    if not isinstance(teeth_raw, (list, tuple)) or not isinstance(absent_raw, (list, tuple)):
        report(None, "teeth (and absent, when given) must be lists of FDI tooth ids")
    else:
        seen: set[int] = set()
        for name, ids in (("teeth", teeth_raw), ("absent", absent_raw)):
            for t in ids:
                if not _is_int(t) or int(t) not in TOOTH_IDS:
                    report(t if _is_int(t) else None, f"{name} has {t!r}, not an FDI id of the 28 teeth "
                           f"(11-17, 21-27, 31-37, 41-47)")  # fmt: skip
                elif int(t) in seen:
                    report(int(t), f"listed twice (in {name})")
                else:
                    seen.add(int(t))
        teeth = [int(t) for t in teeth_raw if _is_int(t) and int(t) in TOOTH_IDS]
        missing = [int(t) for t in TOOTH_IDS if int(t) not in seen]
        for t in missing:
            report(t, "neither in teeth nor in absent: list its poses, or mark it absent")
        absent = absent_mask(int(t) for t in absent_raw if _is_int(t) and int(t) in TOOTH_IDS)
        for arch, row in zip(("upper", "lower"), ARCH_ROWS):
            if absent is not None and absent[row].all():
                report(None, f"every {arch} tooth is absent: a case needs at least one tooth in each arch")
    if problems:
        return Checked(None, cid, patient_id, problems, notes), None
    absent = absent_mask(int(t) for t in absent_raw)

    initial, target = (
        None if rows is None and f"{name}_transforms" in record else _poses(rows, name, teeth, report, notes)
        for name, rows in ((n, _pose_rows(record, n, teeth, report, notes)) for n in ("initial", "target"))
    )
    width = _sizes(record.get("crown_width_mm"), "crown_width_mm", CROWN_WIDTH_MM, teeth, report, notes)
    depth = _sizes(record.get("crown_depth_mm"), "crown_depth_mm", CROWN_DEPTH_MM, teeth, report, notes)

    labels = {} if record.get("labels") is None else record.get("labels")
    profile = secondary = None
    if not isinstance(labels, dict):
        report(None, "labels must be an object {profile, secondary_profile, notes}")
    else:
        profile, secondary = labels.get("profile"), labels.get("secondary_profile")
        if profile is None:
            if secondary is not None:
                report(None, "labels.secondary_profile without labels.profile: give both, or neither and the "
                             "diagnosis is computed from the poses")  # fmt: skip
        elif profile not in PROFILES:
            report(None, f"labels.profile {profile!r} is not one of {', '.join(PROFILES)}")
        elif secondary is not None and secondary not in SECONDARY_PROFILES.get(profile, ()):
            report(None, f"labels.secondary_profile {secondary!r} does not go with {profile!r}: one of "
                         f"{', '.join(SECONDARY_PROFILES.get(profile, ())) or 'none'}")  # fmt: skip
    split = record.get("split")
    if split is not None and split not in SPLITS:
        report(None, f"split must be one of {', '.join(map(repr, SPLITS))} or left out (then assigned by patient), "
                     f"got {split!r}")  # fmt: skip
    force_decay = record.get("force_decay", False)
    if not isinstance(force_decay, bool):
        report(None, f"force_decay must be true or false, got {force_decay!r}")
    task_id, seed = record.get("task_id", IMPORTED_TASK), record.get("seed", 0)
    if task_id != IMPORTED_TASK and task_id not in TASK_IDS:
        report(None, f"task_id must be one of {', '.join(TASK_IDS)} (a generated case) or {IMPORTED_TASK!r}")
    if not _is_int(seed) or not 0 <= int(seed) < 2**63:
        report(None, f"seed must be an integer in [0, 2**63), got {seed!r}")
    if problems:
        return Checked(None, cid, patient_id, problems, notes), None

    if absent is not None:  # each absent tooth's placeholder: in its target space, never moved
        target = placeholder_poses(target, absent)
        initial = np.where(absent[:, None], target, initial)
    for name, poses in (("initial", initial), ("target", target)):
        span = float(np.ptp(poses[:, 4]))
        if not ARCH_SPAN_MM[0] <= span <= ARCH_SPAN_MM[1]:
            report(None, f"the {name} arch spans {span:.1f} mm across (x), outside {ARCH_SPAN_MM[0]:.0f}-"
                         f"{ARCH_SPAN_MM[1]:.0f} mm: are the units mm?")  # fmt: skip
    for tooth, message in layout_problems(initial, target, absent):
        report(tooth, message)
    if problems:
        return Checked(None, cid, patient_id, problems, notes), None
    normed = (
        " (the crown widths are the norms: give crown_width_mm)"
        if record.get("crown_width_mm") is None
        else ""
    )
    for a, b, p in crown_collisions(initial, width, depth, absent):
        report(a, f"the initial crowns of {a} and {b} interpenetrate by {p:.2f} mm (tolerance "
                  f"{COLLISION_TOLERANCE_MM} mm): check the segmentation or the crown sizes{normed}")  # fmt: skip
    for a, b, p in crown_collisions(target, width, depth, absent):
        report(a, f"the target crowns of {a} and {b} interpenetrate by {p:.2f} mm at rest (tolerance "
                  f"{COLLISION_TOLERANCE_MM} mm): the setup breaks the collision rule{normed}")  # fmt: skip
    for tooth, message in gap_problems(initial, target, width, absent):
        report(tooth, message)
    for tooth, message in bite_problems(initial, target, width, depth, absent):
        report(tooth, message)
    trans = np.linalg.norm(target[:, 4:] - initial[:, 4:], axis=-1)
    rot = np.degrees(quaternion_angle(initial[:, :4], target[:, :4]))
    needed = np.ceil(np.maximum(trans / MAX_TRANSLATION_MM, rot / MAX_ROTATION_DEG) - 1e-9).astype(int)
    for t, n, mm, deg in zip(TOOTH_IDS, needed, trans, rot):
        if n > N_STAGES:
            report(int(t), f"infeasible in {N_STAGES} aligners: {mm:.2f} mm and {deg:.1f} deg need {n} aligners "
                           f"within the per-stage limits ({MAX_TRANSLATION_MM} mm, {MAX_ROTATION_DEG} deg)")  # fmt: skip
    if problems:
        return Checked(None, cid, patient_id, problems, notes), None
    parts = {"initial": initial, "target": target, "width": width, "depth": depth, "profile": profile,
             "secondary": secondary, "force_decay": force_decay, "task_id": task_id, "seed": int(seed),
             "absent": absent}  # fmt: skip
    return Checked(None, cid, patient_id, problems, notes, split=split), parts


def _finish(checked: Checked, parts: dict | None, diagnosis: Diagnosis | None) -> Checked:
    """The checked record with its case built (the computed ``diagnosis`` when its labels had none)."""
    if parts is None:
        return checked
    profile, secondary = parts["profile"], parts["secondary"]
    if diagnosis is not None:
        profile, secondary = diagnosis.profile, diagnosis.secondary_profile
        checked.notes["diagnosis_computed"] = checked.notes.get("diagnosis_computed", 0) + 1
    initial, target, width, depth = (parts[k] for k in ("initial", "target", "width", "depth"))
    for arr in (initial, target, width, depth):
        arr.setflags(write=False)
    checked.case = Case(
        task_id=parts["task_id"],
        seed=parts["seed"],
        force_decay=parts["force_decay"],
        profile=profile,
        secondary_profile=secondary,
        optimal_strategy=optimal_strategy(profile, secondary),
        initial=initial,
        target=target,
        crown_width_mm=width,
        crown_depth_mm=depth,
        summary=case_summary(initial, width, parts["absent"]),
        absent=parts["absent"],
    )
    checked.diagnosis = diagnosis
    return checked
