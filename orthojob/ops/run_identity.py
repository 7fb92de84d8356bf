"""Run identity: which config wrote a checkpoint, and whether this job may resume it.

A training job resumes from the newest complete ``checkpoint-N`` under its ``--out``. Without an
identity check, a Job re-applied with another ``STEPS`` or ``TASK_ID`` into the same prefix
silently continued the old run (a 300-step run resumed at step 300 and trained nothing). So:

* every checkpoint carries ``run_identity.json``: the digest of the config that produced it
  (:func:`config_digest`, over the fields that change what is trained, not where it is written
  or how it is logged) and those fields themselves, for the message;
* before resuming, :func:`check_resume` compares it with this job's config. A mismatch raises
  :class:`RunIdentityError` (exit :attr:`ExitCode.RUN_MISMATCH`, never retried) with what differs,
  unless the resume policy says otherwise: ``--on-foreign-checkpoint fresh`` (ignore the old
  checkpoints and train from the start, into the same prefix) or ``continue`` (resume anyway, e.g.
  to train a finished run for more steps on purpose). The policy also comes from
  ``ORTHORL_ON_FOREIGN_CHECKPOINT``. A checkpoint without an identity file (written before this
  existed) is resumed, with a warning: refusing every old checkpoint would strand them.

Pure logic: no storage, no MLflow. :mod:`orthojob.ops.checkpoints` writes the file into each synced checkpoint
and calls :func:`check_resume` from ``resume_checkpoint``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orthojob.ops.exit_codes import ExitCode

log = logging.getLogger(__name__)

IDENTITY_FILE = "run_identity.json"
POLICY_ENV = "ORTHORL_ON_FOREIGN_CHECKPOINT"
POLICIES = ("refuse", "fresh", "continue")

# config fields that do not change what is trained: where it goes, how it is logged or saved,
# and resume switches themselves (steps do count: the learning-rate schedule spans them)
NOT_IDENTITY: frozenset[str] = frozenset(
    {
        "out",
        "work_dir",
        "save_steps",
        "logging_steps",
        "report_to",
        "run_name",
        "test",
        "analyze",
        "verbose",
        "on_foreign_checkpoint",
        "from_checkpoint_local",
        "completions_table_rows",
        "vllm_server_timeout",
    }
)


ADDED_DEFAULTS: dict[str, Any] = {"mode": "oneshot", "max_tool_turns": 8, "env_url": None}
"""Fields added to a config after checkpoints recorded identities (the agentic mode's fields): left
out of the identity while they hold these defaults, so a one-shot run keeps the digest it had."""


class RunIdentityError(RuntimeError):
    """The output holds checkpoints of another config; ``exit_code`` is the job's exit status."""

    exit_code = ExitCode.RUN_MISMATCH


def identity_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of ``config`` that make up the run's identity (JSON-able, sorted)."""
    out = {}
    for key in sorted(config):
        if key in NOT_IDENTITY or key.startswith("_"):
            continue
        value = config[key]
        if key in ADDED_DEFAULTS and value == ADDED_DEFAULTS[key]:
            continue
        out[key] = json.loads(json.dumps(value, default=str, sort_keys=True))
    return out


def config_digest(config: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of :func:`identity_fields` (hex, 64 characters)."""
    canonical = json.dumps(identity_fields(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def identity(config: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint records: the digest and the fields it was computed from."""
    return {"config_digest": config_digest(config), "config": identity_fields(config)}


def write_identity(folder: str | Path, config: Mapping[str, Any]) -> Path:
    """Write ``run_identity.json`` into a checkpoint folder (before it is uploaded)."""
    path = Path(folder) / IDENTITY_FILE
    path.write_text(json.dumps(identity(config), indent=1, sort_keys=True))
    return path


def read_identity(folder: str | Path) -> dict[str, Any] | None:
    path = Path(folder) / IDENTITY_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return None
    return data if isinstance(data, dict) and "config_digest" in data else None


def policy(value: str | None = None) -> str:
    """The resume policy: ``value``, else ``ORTHORL_ON_FOREIGN_CHECKPOINT``, else ``refuse``."""
    chosen = (value or os.environ.get(POLICY_ENV) or "refuse").strip().lower()
    if chosen not in POLICIES:
        raise ValueError(f"resume policy {chosen!r}: one of {', '.join(POLICIES)}")
    return chosen


def differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``key: recorded -> current`` for every identity field that differs."""
    keys = sorted(set(recorded) | set(current))
    return [
        f"{k}: {recorded.get(k, '<unset>')!r} -> {current.get(k, '<unset>')!r}"
        for k in keys
        if recorded.get(k) != current.get(k)
    ]


def check_resume(
    checkpoint: str | Path, config: Mapping[str, Any], on_foreign: str | None = None, where: str = ""
) -> bool:
    """Whether the job may resume ``checkpoint`` (a local, verified folder).

    True: same config (or ``continue``, or no identity file: legacy). False: ``fresh`` (train from
    the start). Raises :class:`RunIdentityError` when the config differs and the policy is ``refuse``.
    """
    chosen = policy(on_foreign)
    recorded = read_identity(checkpoint)
    label = where or str(checkpoint)
    if recorded is None:
        log.warning("%s has no %s (written before run identities): resuming it", label, IDENTITY_FILE)
        return True
    mine = identity(config)
    if recorded["config_digest"] == mine["config_digest"]:
        return True
    diff = differences(recorded.get("config", {}), mine["config"])
    if chosen == "continue":
        log.warning(
            "%s was written by another config (%s): resuming anyway (continue)", label, "; ".join(diff)
        )
        return True
    if chosen == "fresh":
        log.warning("%s was written by another config: not resuming it (fresh)", label)
        return False
    raise RunIdentityError(
        f"{label} holds a checkpoint of another config (digest {recorded['config_digest'][:12]}, this job's "
        f"{mine['config_digest'][:12]}): {'; '.join(diff) or 'fields differ'}. Write to a new --out (the "
        f"Kubernetes Job does, per Job), or set {POLICY_ENV}=fresh to start over there, or =continue to "
        "resume it on purpose."
    )
