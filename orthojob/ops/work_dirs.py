"""A job's local folders: where an ``s3://`` ``--out`` trains locally, where ``s3://`` inputs are
downloaded and verified, and the upload of a finished output.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orthojob.ops import storage


def work_root() -> Path:
    """The local work folder: ``ORTHORL_WORK_DIR``, or ./.orthorl-work."""
    return Path(os.environ.get("ORTHORL_WORK_DIR") or ".orthorl-work")


def local_work_dir(out: str) -> Path:
    """Where a job whose ``--out`` is ``s3://...`` trains locally (below :func:`work_root`)."""
    return storage.local_mirror(work_root(), out)


def download_cache() -> Path:
    """Where ``s3://`` inputs (checkpoints, base models) are downloaded and verified."""
    return work_root() / ".downloads"


def local_input(path_or_uri: str, say: Callable[[str], Any] = print) -> Path:
    """A local folder for a stage's input: the folder itself, or a verified download of an
    ``s3://`` URI into :func:`download_cache` (reused when its digests still match)."""
    if storage.is_s3_uri(path_or_uri):
        say(f"downloading {path_or_uri} (digests checked)")
    return storage.materialize(path_or_uri, download_cache())


def publish_output(local: Path, uri: str) -> dict:
    """Upload a finished output folder to ``uri`` without its ``checkpoint-N`` folders (already
    synced); the manifest is written last, so a reader never sees a half-uploaded result."""
    return storage.upload_dir(
        Path(local), uri, skip=lambda rel: bool(storage.CHECKPOINT_RE.match(rel.split("/", 1)[0]))
    )
