"""The one table of training stages: each stage's key and everything named after it.

A stage's key is its gate-file stage name (:data:`orthojob.lifecycle.gate_file.STAGES`, where the names are
defined), and every other name of the stage is derived from it: the pipeline's ``stages`` value, the preset
section (``--set <key>.steps=...``), the gate section (``<key>_gate``), the command (``orthojob <key with - for
_>``), the default output folder (``./checkpoints/<key>``), the pipeline's stage folder (``<out>/<key>``) and
MLflow stage run. Stages are numbered as docs/stages.md numbers them.

The names a stage had before are accepted one release with a deprecation message (:func:`current_name`):
:data:`OLD_PIPELINE_NAMES`, :data:`OLD_SECTIONS` and :data:`OLD_COMMANDS`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from orthojob.lifecycle.gate_file import BC_SFT, FORMAT_SFT, GRPO, PREFLIGHT_REFUSALS, RSFT, TOOL_SFT
from orthojob.ops.exit_codes import ExitCode
from orthojob.stages.grpo_config import GRPOJobConfig
from orthojob.stages.rsft_config import RSFTConfig
from orthojob.stages.sft_config import FormatSFTConfig, SFTJobConfig, ToolSFTConfig

CHECKPOINTS = "./checkpoints"
"""The folder under which a stage command writes by default (``./checkpoints/<key>``)."""


@dataclass(frozen=True)
class Stage:
    """One training stage. ``trainer``: how its command runs it (``sft``: TRL's SFTTrainer then its gate,
    :func:`orthojob.stages.sft.run_sft_stage_cli`; ``grpo``: :func:`orthojob.stages.grpo.run_train`, which
    gates itself; ``rsft``: :func:`orthojob.stages.rsft.run_rsft_cli`). ``summary``: the command's help line;
    ``exit_codes``: its epilog's exit codes."""

    key: str
    number: int
    summary: str
    config: type
    trainer: str
    first: bool
    """Whether the stage can start a chain from the base model."""
    exit_codes: tuple[ExitCode, ...] = ()

    @property
    def command(self) -> str:
        """The CLI command: ``orthojob <command>``."""
        return self.key.replace("_", "-")

    @property
    def section(self) -> str:
        """The preset section of its config (``--set <section>.steps=...``)."""
        return self.key

    @property
    def gate_section(self) -> str:
        """The preset section of its gate settings."""
        return f"{self.key}_gate"

    @property
    def gate_failed_code(self) -> ExitCode:
        """The exit code of a chain this stage's failed gate ends: 3 for GRPO (training finished, its
        quality gate failed), else 12."""
        return ExitCode.GRPO_GATE_FAILED if self.trainer == "grpo" else ExitCode.GATE_FAILED

    @property
    def out(self) -> str:
        """The stage command's default output folder."""
        return f"{CHECKPOINTS}/{self.key}"


_SFT_CODES = (ExitCode.OK, ExitCode.USAGE, ExitCode.GATE_FAILED, ExitCode.STORAGE, ExitCode.TRACKING)

STAGE_TABLE: dict[str, Stage] = {
    s.key: s
    for s in (
        Stage(
            FORMAT_SFT,
            0,
            "format SFT on demonstrations that carry no clinical choice, then its format gate",
            FormatSFTConfig,
            "sft",
            True,
            _SFT_CODES,
        ),
        Stage(
            TOOL_SFT,
            1,
            "tool-use SFT on the oracle's tool conversations, then its tool-call gate",
            ToolSFTConfig,
            "sft",
            True,
            _SFT_CODES,
        ),
        Stage(
            BC_SFT,
            2,
            "BC SFT on the oracle's safe plans, then its gate",
            SFTJobConfig,
            "sft",
            True,
            _SFT_CODES,
        ),
        Stage(
            GRPO,
            3,
            "GRPO training; refuses without a passed gate of an earlier stage",
            GRPOJobConfig,
            "grpo",
            False,
            (
                ExitCode.OK,
                ExitCode.USAGE,
                ExitCode.GRPO_GATE_FAILED,
                *PREFLIGHT_REFUSALS,
                ExitCode.RUN_MISMATCH,
                ExitCode.STORAGE,
                ExitCode.TRACKING,
                ExitCode.TERMINATED,
            ),
        ),
        Stage(
            RSFT,
            4,
            "rejection fine-tuning (sample k per prompt, keep the env's best, fine-tune), then its gate",
            RSFTConfig,
            "rsft",
            False,
            (ExitCode.OK, ExitCode.USAGE, *PREFLIGHT_REFUSALS, ExitCode.STORAGE, ExitCode.TRACKING),
        ),
    )
}
"""Every training stage by key, in training order (the order of :data:`orthojob.lifecycle.gate_file.STAGES`)."""
SFT_SECTIONS: dict[str, type] = {s.key: s.config for s in STAGE_TABLE.values() if s.trainer != "grpo"}
"""The stages trained with TRL's SFTTrainer: key -> config class."""

OLD_PIPELINE_NAMES: dict[str, str] = {"format": FORMAT_SFT, "tool": TOOL_SFT, "bc": BC_SFT}
"""Deprecated pipeline ``stages`` values -> keys (accepted one more release)."""
OLD_SECTIONS: dict[str, str] = {
    "sft": BC_SFT,
    "sft_gate": STAGE_TABLE[BC_SFT].gate_section,
    "format_gate": STAGE_TABLE[FORMAT_SFT].gate_section,
}
"""Deprecated preset sections -> the current ones (accepted one more release)."""
OLD_COMMANDS: dict[str, str] = {"train": "grpo", "sft": "bc-sft --no-gate"}
"""Deprecated commands -> what replaces them (accepted one more release)."""
COMMANDS: dict[str, Stage] = {
    **{s.command: s for s in STAGE_TABLE.values()},
    **{
        old: next(s for s in STAGE_TABLE.values() if s.command == new.split()[0])
        for old, new in OLD_COMMANDS.items()
    },
}
"""Every stage command, the deprecated ones last -> its stage."""


def deprecated(kind: str, old: str, new: str) -> None:
    """Say on stderr that ``old`` (a ``kind`` of name) is deprecated for ``new``."""
    print(
        f"orthojob: {kind} {old!r} is deprecated, use {new!r} (the old name goes in the next release)",
        file=sys.stderr,
    )


def current_name(name: str, old_names: dict[str, str], kind: str) -> str:
    """``name``, or the current name of a deprecated one (saying so on stderr)."""
    if name in old_names:
        deprecated(kind, name, old_names[name])
        return old_names[name]
    return name


__all__ = [
    "CHECKPOINTS",
    "COMMANDS",
    "OLD_COMMANDS",
    "OLD_PIPELINE_NAMES",
    "OLD_SECTIONS",
    "SFT_SECTIONS",
    "STAGE_TABLE",
    "Stage",
    "current_name",
    "deprecated",
]
