"""Checkpoints that survive the pod: each save synced to the output's store (run identity written in,
manifest last), and the newest complete one found, downloaded and verified to resume from.

Only rank 0 calls any of this.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orthojob.ops import run_identity, storage

log = logging.getLogger(__name__)


def checkpoint_sync_callback(out_uri: str | None, config: Mapping[str, Any] | None = None) -> Any:
    """TrainerCallback: after each save, write the run identity (``config``'s digest, see
    :mod:`orthojob.ops.run_identity`) into ``<output_dir>/checkpoint-<step>`` and, with ``out_uri``,
    upload that folder to ``<out_uri>/checkpoint-<step>`` (manifest last)."""
    from transformers import TrainerCallback

    class CheckpointSync(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if not state.is_world_process_zero:
                return
            name = f"checkpoint-{state.global_step}"
            folder = Path(args.output_dir) / name
            if not folder.is_dir():
                return
            if config is not None:
                run_identity.write_identity(folder, config)
            if out_uri:
                uri = f"{out_uri.rstrip('/')}/{name}"
                storage.upload_dir(folder, uri)
                log.info("synced %s to %s", name, uri)

    return CheckpointSync()


def resume_checkpoint(
    out: str, work_dir: Path, config: Mapping[str, Any] | None = None, on_foreign: str | None = None
) -> tuple[int, Path] | None:
    """``(step, local folder)`` of the newest complete checkpoint of ``out`` (downloaded if on S3).

    With ``config``, the checkpoint's run identity is checked first
    (:func:`orthojob.ops.run_identity.check_resume`): a checkpoint of another config raises
    RunIdentityError (exit 14) unless ``on_foreign`` (or ORTHORL_ON_FOREIGN_CHECKPOINT) is
    ``fresh`` (then None: train from the start) or ``continue``."""

    if storage.is_s3_uri(out):
        found = storage.latest_checkpoint(out)
        if found is None:
            return None
        step, uri = found
        folder = storage.download_dir(uri, work_dir / f"checkpoint-{step}")
    else:
        root = Path(out)
        steps = sorted(
            (int(m.group(1)), p)
            for p in (root.iterdir() if root.is_dir() else [])
            if (m := storage.CHECKPOINT_RE.match(p.name)) and (p / "trainer_state.json").is_file()
        )
        if not steps:
            return None
        step, folder = steps[-1]
        uri = str(folder)
    if config is not None and not run_identity.check_resume(folder, config, on_foreign, where=uri):
        return None
    return step, folder
