"""Case sets: patients' cases read from JSON Lines or Parquet files (local or ``s3://``), validated,
and generated cases exported in the same format (docs/cases.md; the record is
:mod:`server.case_records`').

* :func:`validate` reads a local or ``s3://`` file and checks it (:func:`server.case_files.validate_file`:
  each record read in bounded memory, each checked, the set's duplicate case ids and patients given
  both splits) into a :class:`~server.case_files.Validation` that names every problem by case id and
  FDI tooth; ``orthojob cases validate FILE|s3://…`` prints it and exits 0 when the set is usable, 2
  when not (30 when S3 cannot be read).
* :func:`split_by_patient` splits the usable cases into training and held-out ones by patient
  (a record's own ``split``, else the patient id's hash), with a digest of the assignment.
* :func:`export` writes generated cases (``orthojob cases export --task … --seeds A:B``): importing
  them gives back the generated cases bit for bit (their poses, crown sizes, labels and key).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from orthojob.core.prompts import key_prompt_rows
from orthojob.ops import storage, tracking
from orthojob.ops.exit_codes import ExitCode, epilog
from server.case_files import Validation, validate_file
from server.case_records import case_digest, record_of_case, register_case
from server.cases import TASK_IDS, CaseKey, generate_case

HELDOUT_SHARE = 0.2
"""Share of the patients held out for evaluation when the records do not say (``split``)."""


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
    """Read and check every record of a case file (local path or ``s3://`` URI,
    :func:`server.case_files.validate_file`)."""
    with tempfile.TemporaryDirectory() as tmp:
        return validate_file(_local(source, tmp), source)


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
    process (:func:`server.case_records.register_case`: an export read back keeps its generated key;
    any other case is ``CaseKey("imported", seed)``, the seed a digest of its content, so caches keyed
    by case key by its content)."""
    return [
        register_case(validation.cases[k]) for k in (range(len(validation.cases)) if index is None else index)
    ]


def load_split(source: str, heldout_share: float = HELDOUT_SHARE) -> tuple[Validation, CaseSplit]:
    """Validate a case set and split it by patient; :class:`CaseSetError` (exit 2) says what to fix."""
    report = validate(source)
    if not report.ok:
        raise CaseSetError(report.summary())
    return report, split_by_patient(report, heldout_share)


@dataclass(frozen=True)
class LoadedCaseSet:
    """A case set validated, split by patient and registered (:func:`load_case_set`): the keys of each
    side, and what a run records of it (:meth:`info`)."""

    source: str
    validation: Validation
    split: CaseSplit
    train: list[CaseKey]
    heldout: list[CaseKey]

    def info(self, side: str) -> dict:
        """Source, side, split digest and counts: the gate file's and the run's record of the set."""
        index = self.split.train if side == "train" else self.split.heldout
        return {"source": self.source, "split": side, "split_digest": self.split.digest, "n_cases": len(index),
                "n_patients": len({self.validation.patient_ids[k] for k in index})}  # fmt: skip

    def log_input(self, side: str) -> dict:
        """Record one side as the active MLflow run's dataset input (:func:`orthojob.ops.tracking.log_case_set`:
        ``train`` as training, ``heldout`` as evaluation); returns :meth:`info`."""
        info = self.info(side)
        context = "training" if side == "train" else "evaluation"
        tracking.log_case_set(
            self.source, self.split.digest, side, info["n_cases"], info["n_patients"], context
        )
        return info

    def case_ids(self, side: str) -> list[str]:
        """The case ids of one side's cases, in file order (those of :attr:`train` or :attr:`heldout`)."""
        index = self.split.train if side == "train" else self.split.heldout
        return [self.validation.case_ids[k] for k in index]

    def rows(self, side: str, prompt_format: str = "full") -> list[dict]:
        """Dataset rows of one side's cases (:func:`orthojob.core.prompts.key_prompt_rows`), each with
        its ``case_id``, which TRL passes to the rewards with the key's columns."""
        keys = self.train if side == "train" else self.heldout
        return key_prompt_rows(keys, self.case_ids(side), prompt_format)


@functools.lru_cache(maxsize=4)
def load_case_set(
    source: str, heldout_share: float = HELDOUT_SHARE, force_decay: bool = False
) -> LoadedCaseSet:
    """Validate, split by patient and register a case set (:func:`load_split`, :func:`register`); with
    ``force_decay`` every case is simulated under force decay, else under its record's dynamics.

    Cached per process (a stage checks the set before loading a model, trains on it and gates on it:
    one read and validation for all three); a set that fails is not cached. Treat the result as
    read-only."""
    validation, split = load_split(source, heldout_share)

    def keys(index):
        found = register(validation, index)
        return [k._replace(force_decay=True) for k in found] if force_decay else found

    return LoadedCaseSet(source, validation, split, keys(split.train), keys(split.heldout))


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


def heldout_cases(
    source: str, heldout_share: float = HELDOUT_SHARE, force_decay: bool = False
) -> tuple[list, dict]:
    """The keys of a case set's held-out patients (:func:`load_case_set`) and what a gate or an evaluation
    records of the set, logged as the run's evaluation input; :class:`CaseSetError` when none is held out."""
    loaded = load_case_set(source, heldout_share, force_decay)
    if not loaded.heldout:
        raise CaseSetError(
            f'{source} holds out no patient: raise --heldout-share or give records "split": "heldout"'
        )
    return loaded.heldout, loaded.log_input("heldout")


def heldout_case_keys(args: argparse.Namespace, command: str) -> tuple[list, dict] | int:
    """:func:`heldout_cases` of ``--cases`` (every case under force decay with ``--force-decay``, else
    under its record's dynamics), the split printed; an exit code after saying what to fix."""
    try:
        keys, info = heldout_cases(args.cases, args.heldout_share, args.force_decay)
    except (CaseSetError, FileNotFoundError, ValueError) as exc:
        print(f"orthojob {command}: --cases {args.cases}: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return ExitCode.USAGE
    loaded = load_case_set(args.cases, args.heldout_share, args.force_decay)
    print(format_split(loaded.validation, loaded.split))
    return keys, info


def check_case_set(
    source: str, heldout_share: float, force_decay: bool, command: str, heldout: bool = True
) -> int | None:
    """Before any model loads: validate, split and register the training stage's case set
    (:func:`load_case_set`), its split printed. None when it is usable: training patients and, with
    ``heldout`` (a stage that gates), held-out ones; else the exit code (2) after saying what to fix."""
    try:
        loaded = load_case_set(source, heldout_share, force_decay)
        if not loaded.train:
            raise CaseSetError(
                'it leaves no training patient: lower --heldout-share or give records "split": "train"'
            )
        if heldout and not loaded.heldout:
            raise CaseSetError(
                'it holds out no patient for the gate: raise --heldout-share or give records "split": "heldout"'
            )
    except (CaseSetError, FileNotFoundError, ValueError) as exc:
        print(f"orthojob {command}: --cases {source}: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return ExitCode.USAGE
    print(format_split(loaded.validation, loaded.split))
    return None


def add_case_set_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """``--cases`` and ``--heldout-share`` of a command that judges on a case set's held-out patients."""
    parser.add_argument(
        "--cases",
        help=f"a case set (.jsonl, .parquet or s3:// URI, docs/cases.md): {what} on its held-out patients "
        "instead of generated seeds (--task-id and --seeds then do not apply)",
    )
    parser.add_argument("--heldout-share", type=float, default=HELDOUT_SHARE,
                        help="with --cases: share of the patients held out where the records give no split")  # fmt: skip


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
