"""Case sets: patients' cases read from JSON Lines or Parquet files (local or ``s3://``), validated,
and generated cases exported in the same format (docs/cases.md; the record is
:mod:`server.case_records`').

* :func:`read_records` yields each record of a file with where it came from, or why it could not be
  read (a line that is not JSON, a line over :data:`MAX_LINE_BYTES`, a truncated last line), without
  ever holding more than one line: a hostile file cannot exhaust memory.
* :func:`validate` checks every record (:func:`server.case_records.case_of_record`) and the set
  (duplicate case ids), and returns a :class:`Validation` that names every problem by case id and FDI
  tooth; ``orthojob cases validate FILE|s3://…`` prints it and exits 0 when the set is usable, 2 when
  not (30 when S3 cannot be read).
* :func:`split_by_patient` splits the usable cases into training and held-out ones by patient
  (a record's own ``split``, else the patient id's hash), with a digest of the assignment.
* :func:`export` writes generated cases (``orthojob cases export --task … --seeds A:B``): importing
  them gives back the generated cases bit for bit (their poses, crown sizes, labels and key).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from orthojob.ops import storage
from orthojob.ops.exit_codes import ExitCode, epilog
from server.case_records import Problem, case_digest, cases_of_records, record_of_case
from server.cases import IMPORTED_TASK, TASK_IDS, Case, CaseKey, generate_case, register_imported

MAX_LINE_BYTES = 4 << 20
"""A JSON Lines record longer than this (4 MiB; a case is about 6 KB) is refused unread."""
_CHUNK = 1 << 16
HELDOUT_SHARE = 0.2
"""Share of the patients held out for evaluation when the records do not say (``split``)."""
CHECK_BATCH = 512
"""Records checked together (their diagnoses computed in one batch); memory stays bounded by it."""


@dataclass(frozen=True)
class Unreadable:
    """A record that could not be read: where (``line N`` or ``row N``) and why."""

    where: str
    message: str


@dataclass
class Validation:
    """The outcome of :func:`validate`: the usable cases, every problem, and what was filled in."""

    source: str
    records: int = 0
    cases: list[Case] = field(default_factory=list)
    case_ids: list[str] = field(default_factory=list)
    patient_ids: list[str] = field(default_factory=list)
    splits: list[str | None] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: Counter = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return not self.problems and bool(self.cases)

    def summary(self) -> str:
        head = (
            f"{self.source}: {self.records} records, {len(self.cases)} usable cases of "
            f"{len(set(self.patient_ids))} patients, {len(self.problems)} problems"
        )
        notes = "".join(f"\n  note: {k.replace('_', ' ')}: {v}" for k, v in sorted(self.notes.items()))
        shown = self.problems[:200]
        more = (
            f"\n  ... and {len(self.problems) - len(shown)} more" if len(self.problems) > len(shown) else ""
        )
        return head + notes + "".join(f"\n  {p}" for p in shown) + more


def _json_lines(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, record | Unreadable)`` per non-blank line, each line read in bounded chunks."""
    with path.open("rb") as f:
        number, buffer, overlong = 0, bytearray(), False
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            start = 0
            while True:
                end = chunk.find(b"\n", start)
                piece = chunk[start:] if end < 0 else chunk[start:end]
                if not overlong:
                    buffer += piece
                    if len(buffer) > MAX_LINE_BYTES:
                        overlong, buffer = True, bytearray()
                if end < 0:
                    break
                number += 1
                yield from _line(number, buffer, overlong, final=False)
                buffer, overlong, start = bytearray(), False, end + 1
        if buffer or overlong:
            yield from _line(number + 1, buffer, overlong, final=True)


def _line(number: int, raw: bytearray, overlong: bool, final: bool) -> Iterator[tuple[str, Any]]:
    where = f"line {number}"
    if overlong:
        yield where, Unreadable(where, f"longer than {MAX_LINE_BYTES} bytes: not a case record")
        return
    if not raw.strip():
        return
    try:
        yield where, json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        cut = " (the file ends mid-record: truncated?)" if final else ""
        yield where, Unreadable(where, f"not JSON{cut}: {exc}")


def _parquet(path: Path) -> Iterator[tuple[str, Any]]:
    from datasets import Dataset

    try:
        data = Dataset.from_parquet(str(path))
    except Exception as exc:  # pyarrow's errors for a file that is not Parquet, or a truncated one
        yield "file", Unreadable("file", f"not a readable Parquet file: {exc}")
        return
    for i in range(len(data)):
        yield f"row {i + 1}", data[i]


def read_records(path: str | os.PathLike) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` for each record of a local ``.jsonl`` / ``.json`` / ``.parquet`` file; a
    record that cannot be read comes as an :class:`Unreadable`."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no case file {p}")
    if p.suffix == ".parquet":
        yield from _parquet(p)
    else:
        yield from _json_lines(p)


def _local(source: str, tmp: str) -> Path:
    """The local path of ``source``; an ``s3://`` object is downloaded into ``tmp`` first."""

    if not storage.is_s3_uri(source):
        return Path(source)
    loc = storage.parse_s3_uri(source)
    target = Path(tmp) / Path(loc.prefix).name
    client = storage.s3_client()
    storage.with_retries(
        f"reading {source}", lambda: client.download_file(loc.bucket, loc.prefix, str(target))
    )
    return target


def validate(source: str) -> Validation:
    """Read and check every record of a case file (local path or ``s3://`` URI)."""
    out = Validation(source)
    seen: Counter = Counter()
    batch: list[tuple[str, Any]] = []

    def check(batch: list[tuple[str, Any]]) -> None:
        for (where, _), checked in zip(batch, cases_of_records([r for _, r in batch])):
            out.notes.update(checked.notes)
            out.problems.extend(f"{where}, {p}" for p in checked.problems)
            if checked.case_id is not None:
                seen[checked.case_id] += 1
                if seen[checked.case_id] == 2:
                    out.problems.append(f"{where}, {Problem(checked.case_id, None, 'case_id used twice')}")
            if checked.case is not None and seen[checked.case_id] == 1:
                out.cases.append(checked.case)
                out.case_ids.append(checked.case_id)
                out.patient_ids.append(checked.patient_id)
                out.splits.append(checked.split)

    with tempfile.TemporaryDirectory() as tmp:
        for where, record in read_records(_local(source, tmp)):
            out.records += 1
            if isinstance(record, Unreadable):
                out.problems.append(f"{where}: {record.message}")
                continue
            batch.append((where, record))
            if len(batch) == CHECK_BATCH:
                check(batch)
                batch = []
        check(batch)
    if out.records == 0:
        out.problems.append("no case records in the file")
    given: dict[str, set[str]] = {}
    for patient, split in zip(out.patient_ids, out.splits):
        if split is not None:
            given.setdefault(patient, set()).add(split)
    for patient in sorted(p for p, s in given.items() if len(s) > 1):
        ids = [c for c, p in zip(out.case_ids, out.patient_ids) if p == patient]
        out.problems.append(
            f"patient {patient!r} has cases in both splits ({', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''}): "
            "a held-out patient's cases must all be held out, or the evaluation has seen the patient"
        )
    return out


@dataclass(frozen=True)
class CaseSplit:
    """A case set split by patient: indices into :attr:`Validation.cases` of the training and the
    held-out cases, the held-out share asked for, and a digest of the assignment (case content digests
    with their split, in file order) that a run and its gate file record."""

    train: tuple[int, ...]
    heldout: tuple[int, ...]
    heldout_share: float
    digest: str


def split_by_patient(validation: Validation, heldout_share: float = HELDOUT_SHARE) -> CaseSplit:
    """Training and held-out cases, never a patient in both: a record's own ``split`` when it gives
    one (for all of a patient's cases, :func:`validate` checks), else by the patient id's hash, so the
    same patients are held out in every run, on every machine, whatever the file's order."""
    if not 0.0 <= heldout_share <= 1.0:
        raise ValueError(f"heldout_share must lie in [0, 1], got {heldout_share}")
    given = {p: s for p, s in zip(validation.patient_ids, validation.splits) if s is not None}
    train, heldout = [], []
    h = hashlib.sha256(f"heldout_share={heldout_share!r}".encode())
    for k, (case, patient) in enumerate(zip(validation.cases, validation.patient_ids)):
        split = given.get(patient) or ("heldout" if _patient_draw(patient) < heldout_share else "train")
        (heldout if split == "heldout" else train).append(k)
        h.update(f"{split}:{case_digest(case)}\n".encode())
    return CaseSplit(tuple(train), tuple(heldout), heldout_share, h.hexdigest())


def register(validation: Validation, index: Sequence[int] | None = None) -> list[CaseKey]:
    """The keys of the validated cases (all, or those at ``index``), each made reachable by key in this
    process: a record whose poses are its generated case's keeps that case's key (an export read
    back); any other case is registered as ``CaseKey("imported", seed)``, the seed a digest of its
    content (:func:`server.cases.register_imported`), so caches keyed by case key by its content."""
    keys = []
    for k in range(len(validation.cases)) if index is None else index:
        case = validation.cases[k]
        if case.task_id in TASK_IDS:
            generated = generate_case(case.task_id, case.seed, case.force_decay)
            if case_digest(generated) == case_digest(case):
                keys.append(CaseKey(case.task_id, case.seed, case.force_decay))
                continue
        seed = int(case_digest(replace(case, force_decay=False))[:15], 16)
        keys.append(register_imported(replace(case, task_id=IMPORTED_TASK, seed=seed)))
    return keys


def load_split(source: str, heldout_share: float = HELDOUT_SHARE) -> tuple[Validation, CaseSplit]:
    """Validate a case set and split it by patient; :class:`CaseSetError` (exit 2) says what to fix."""
    report = validate(source)
    if not report.ok:
        raise CaseSetError(report.summary())
    return report, split_by_patient(report, heldout_share)


class CaseSetError(Exception):
    """A case set that cannot be used: its validation report, every problem named."""

    exit_code = ExitCode.USAGE

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _patient_draw(patient_id: str) -> float:
    """A number in [0, 1) fixed by the patient id (sha256), the same on every machine."""
    return int.from_bytes(hashlib.sha256(patient_id.encode()).digest()[:8], "big") / 2.0**64


def export(task_id: str, seeds: Sequence[int], force_decay: bool, out: str | os.PathLike) -> int:
    """Write generated cases as records (JSON Lines, or Parquet for a ``.parquet`` path); returns
    how many were written."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = (record_of_case(generate_case(task_id, int(s), force_decay)) for s in seeds)
    if path.suffix == ".parquet":
        from datasets import Dataset

        rows = list(records)
        Dataset.from_list(rows).to_parquet(str(path))
        return len(rows)
    n = 0
    with path.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
            n += 1
    return n


def seed_range(text: str) -> range:
    """``"A:B"`` (B excluded) or ``"N"`` (seeds 0..N-1) as a range; ValueError says what to write."""
    try:
        if ":" in text:
            a, b = (int(x) for x in text.split(":", 1))
        else:
            a, b = 0, int(text)
    except ValueError:
        raise ValueError(f"--seeds takes A:B or N, got {text!r}") from None
    if not 0 <= a < b:
        raise ValueError(f"--seeds {text!r} is empty: A:B with 0 <= A < B")
    return range(a, b)


# --- the `orthojob cases` command ------------------------------------------------------


def add_cases_arguments(sub: argparse._SubParsersAction) -> None:
    """``orthojob cases validate|export`` on the CLI's subparsers."""
    ca = sub.add_parser(
        "cases",
        help="case sets: validate a file of patients' cases, or export generated cases (docs/cases.md)",
        epilog=epilog(ExitCode.OK, ExitCode.USAGE, ExitCode.STORAGE),
    )
    csub = ca.add_subparsers(dest="cases_command", required=True)
    cv = csub.add_parser("validate", help="check every record; print every problem by case id and FDI tooth")
    cv.add_argument("source", help="a .jsonl or .parquet file, or an s3:// URI of one")
    cv.add_argument("--heldout-share", type=float, default=HELDOUT_SHARE,
                    help="share of the patients held out where the records give no split")  # fmt: skip
    ce = csub.add_parser("export", help="write generated cases in the case-set format")
    ce.add_argument("--task", required=True, choices=TASK_IDS)
    ce.add_argument("--seeds", required=True, help="A:B (B excluded) or N (0..N-1)")
    ce.add_argument("--force-decay", action="store_true")
    ce.add_argument("--out", required=True, help="a .jsonl or .parquet file")
    ca.set_defaults(func=run_cases_cli)


def run_cases_cli(args: argparse.Namespace) -> int:
    """``orthojob cases validate SOURCE`` / ``orthojob cases export --task T --seeds A:B --out FILE``."""

    if args.cases_command == "export":
        try:
            seeds = seed_range(args.seeds)
        except ValueError as exc:
            print(f"orthojob cases export: {exc}", file=sys.stderr)
            return ExitCode.USAGE
        n = export(args.task, seeds, args.force_decay, args.out)
        print(f"wrote {n} {args.task} cases{' (force decay)' if args.force_decay else ''} to {args.out}")
        return 0
    try:
        report = validate(args.source)
    except FileNotFoundError as exc:
        print(f"orthojob cases validate: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    print(report.summary())
    if report.ok:
        try:
            split = split_by_patient(report, args.heldout_share)
        except ValueError as exc:
            print(f"orthojob cases validate: {exc}", file=sys.stderr)
            return ExitCode.USAGE
        print(format_split(report, split))
    return 0 if report.ok else ExitCode.USAGE


def format_split(validation: Validation, split: CaseSplit) -> str:
    """One line: how many cases and patients each side of the split holds, and its digest."""
    sides = []
    for name, index in (("train", split.train), ("heldout", split.heldout)):
        patients = {validation.patient_ids[k] for k in index}
        sides.append(f"{name} {len(index)} cases of {len(patients)} patients")
    return f"split by patient: {', '.join(sides)} (digest {split.digest[:12]})"
