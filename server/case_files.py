"""Case files: the records of a local JSON Lines or Parquet case set read one at a time in bounded
memory (:func:`read_records`), and checked (:func:`validate_file`) into a :class:`Validation`.

Local files only (the server's ``--cases``); :mod:`orthojob.data.case_sets` adds ``s3://`` sources,
the split by patient and the ``orthojob cases`` command. The record format is
:mod:`server.case_records`'.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.case_records import Problem, cases_of_records, register_case
from server.cases import Case, CaseKey

CHECK_BATCH = 512
"""Records checked together (their diagnoses computed in one batch); memory stays bounded by it."""


@dataclass
class Validation:
    """The outcome of :func:`validate_file`: the usable cases, every problem, and what was filled in."""

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


MAX_LINE_BYTES = 4 << 20
"""A JSON Lines record longer than this (4 MiB; a case is about 6 KB) is refused unread."""

_CHUNK = 1 << 16


@dataclass(frozen=True)
class Unreadable:
    """A record that could not be read: where (``line N`` or ``row N``) and why."""

    where: str
    message: str


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


def validate_file(path: str | os.PathLike, source: str | None = None) -> Validation:
    """Read and check every record of a local case file (``source``: the name it is reported by,
    default the path): each record (:func:`server.case_records.cases_of_records`, in batches of
    :data:`CHECK_BATCH`), duplicate case ids, and patients given both splits."""
    out = Validation(str(path) if source is None else source)
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

    for where, record in read_records(path):
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


def load_case_set(path: str) -> dict[str, CaseKey]:
    """Case id -> key of every case of a local case file, each registered in this process; ValueError
    with the validation report when any record has a problem (nothing is served half-loaded)."""
    report = validate_file(path)
    if not report.ok:
        raise ValueError(report.summary())
    return {case_id: register_case(case) for case_id, case in zip(report.case_ids, report.cases)}
