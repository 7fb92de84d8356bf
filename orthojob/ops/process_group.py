"""Data-parallel runs: ending a process group cleanly once the trainer lets go of it."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import torch
from trl import GRPOTrainer

log = logging.getLogger(__name__)

# logged by end_process_group when a gloo thread outlives the group (a launch's output is checked for it)
PROCESS_GROUP_LEFT = "process group threads still running after destroy_process_group"
"""A completion's text in the MLflow table is cut to this many characters (completions.jsonl keeps it whole)."""


def process_group_threads() -> list[str]:
    """The names of this process's threads that belong to a gloo process group (Linux ``/proc``;
    elsewhere an empty list)."""
    tasks = Path("/proc/self/task")
    names = []
    for task in tasks.iterdir() if tasks.is_dir() else ():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended while listed
            continue
    return sorted(name for name in names if "gloo" in name)


def end_process_group(trainer: GRPOTrainer) -> None:
    """Destroy the process group once nothing holds it (data parallel; no-op in one process).

    The DDP wrapper, held by the trainer (``model_wrapped``) and its accelerator, keeps the gloo
    process group and its threads alive past ``destroy_process_group`` until the interpreter's
    teardown joins them. In CI a rank that had finished its work once aborted there (SIGABRT,
    ``terminate called without an active exception``), failing the whole torchrun job. So the
    trainer keeps the unwrapped model, the accelerator lets go of the wrapper, and the group and its
    threads end here; a gloo thread still left is logged.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    trainer.accelerator.free_memory()
    trainer.model = trainer.model_wrapped = unwrapped
    gc.collect()  # the wrapper sits in reference cycles
    torch.distributed.destroy_process_group()
    left = process_group_threads()
    if left:
        log.warning("%s: %s", PROCESS_GROUP_LEFT, left)
