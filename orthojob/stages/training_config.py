"""What every training stage's configuration shares: :class:`TrainingConfig`.

:class:`~orthojob.stages.grpo_config.GRPOJobConfig` (``orthojob grpo``) and
:class:`~orthojob.stages.sft_config.SFTJobConfig` (and so the format, tool-use and RSFT configs) extend
it, as TRL's ``GRPOConfig`` and ``SFTConfig`` extend ``transformers.TrainingArguments``: the base model,
the output folder, the checkpoint to continue, the optimizer's steps, batch and learning rate, LoRA's
rank, the training seed, gradient checkpointing and a case set. Each field's help text is in its
metadata (flags are generated from the fields: :func:`orthojob.stages.flags.add_config_arguments`).

A stage's config restates a field whose default or help is its own (``out``, ``steps``, ``lr`` and
``batch_size`` in every stage; the base has no default for them, so :class:`TrainingConfig` itself
cannot be built), and adds its own checks after ``super().__post_init__()``. A dataclass lists a
base's fields first, so every training command lists these flags before its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from orthojob.modeling.models import TINY_MODEL
from orthojob.stages.flags import finite_float, non_negative_int, positive_int


class ConfigError(ValueError):
    """A configuration that cannot train; the message names the flags to change."""


OUTPUT_HELP = "output folder or s3:// URI"
"""Every stage's ``--out`` help; the default folder is the stage's."""

CASE_SET_HELP = "a case set (.jsonl, .parquet or s3:// URI, docs/cases.md): "
"""How every stage's ``--cases`` help begins; each stage adds what it does with the set."""


def output_field(default: str):
    """A stage's ``out`` field: its default folder, help :data:`OUTPUT_HELP`."""
    return field(default=default, metadata={"help": OUTPUT_HELP})


def cases_field(uses: str):
    """A stage's ``cases`` field (None: generated cases), its help :data:`CASE_SET_HELP` then ``uses``."""
    return field(default=None, metadata={"help": CASE_SET_HELP + uses})


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """The fields every training stage has (field ``x_y`` is flag ``--x-y``).

    ``model``: hub id, folder or s3:// URI, or ``"tiny"`` (the offline tiny model); ``from_checkpoint``:
    an earlier stage's output to continue instead. ``steps`` optimizer steps of ``batch_size x
    grad_accum`` examples (completions, in GRPO) per device; ``lr``: the learning rate; ``lora_r``: the
    LoRA adapter's rank, 0 for full fine-tuning. ``cases``: a case set split by patient
    (:mod:`orthojob.data.case_sets`), ``heldout_share`` of the patients held out where its records
    give no split.
    """

    model: str = field(
        default="Qwen/Qwen2.5-3B-Instruct",
        metadata={
            "help": f"base model: hub id, folder or s3:// URI (fetched once, cached), or '{TINY_MODEL}'"
        },
    )
    out: str = field(metadata={"help": OUTPUT_HELP})
    from_checkpoint: str | None = field(
        default=None,
        metadata={"help": "continue an earlier stage's checkpoint (folder or s3:// URI) instead of --model"},
    )
    steps: int = field(metadata={"help": "optimizer steps", "type": positive_int})
    batch_size: int = field(metadata={"help": "examples per device per step", "type": positive_int})
    grad_accum: int = field(default=1, metadata={"help": "gradient accumulation steps", "type": positive_int})
    lr: float = field(metadata={"help": "learning rate"})
    lora_r: int = field(
        default=16, metadata={"help": "LoRA rank; 0 = full fine-tuning", "type": non_negative_int}
    )
    seed: int = field(default=0, metadata={"help": "training seed", "show_default": True})
    gradient_checkpointing: bool = field(metadata={"help": "gradient checkpointing"})
    cases: str | None = cases_field("train on its training patients and gate on its held-out ones")
    heldout_share: float = field(
        default=0.2,
        metadata={
            "help": "with --cases: share of the patients held out where the records give no split",
            "type": finite_float,
        },
    )

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.lora_r < 0:
            raise ConfigError(f"--lora-r must be >= 0 (0 = full fine-tuning), got {self.lora_r}")
        if not 0.0 <= self.heldout_share <= 1.0:
            raise ConfigError(f"--heldout-share must lie in [0, 1], got {self.heldout_share}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


__all__ = [
    "CASE_SET_HELP",
    "OUTPUT_HELP",
    "ConfigError",
    "TrainingConfig",
    "cases_field",
    "output_field",
]
