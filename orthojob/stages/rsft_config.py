"""Stage 4's configuration: :class:`RSFTConfig`, every ``orthojob rsft`` flag.

RSFT (rejection fine-tuning) samples ``samples_per_prompt`` completions per training prompt from
``from_checkpoint``, scores them with the environment and fine-tunes on the ones the keep rule
(:mod:`orthojob.stages.rsft`) keeps. The SFT fields (steps, lr, LoRA, ...) are :class:`SFTJobConfig`'s;
``examples`` has no flag here (the kept rows are the examples).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orthojob.core.prompts import TRAIN_SEED_START
from orthojob.stages.flags import positive_int
from orthojob.stages.sft_config import SFTJobConfig, bc_only_field
from orthojob.stages.training_config import ConfigError, cases_field, output_field

RSFT_SAMPLES_FILE = "rsft_samples.jsonl"
"""Every sampled completion with its prompt, scores and whether it was kept (in ``--out``)."""


@dataclass(frozen=True)
class RSFTConfig(SFTJobConfig):
    """Every ``orthojob rsft`` flag (field ``x_y`` is flag ``--x-y``)."""

    out: str = output_field("./checkpoints/rsft")
    from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "the gated checkpoint (folder or s3:// URI) to sample from and fine-tune (required)"
        },
    )
    demos: str = field(default="rsft", metadata={"help": "demonstration source", "cli": False})
    robust_demos: bool = bc_only_field(False)
    cases: str | None = cases_field(
        "the prompts are its training "
        "patients' cases (each once, at most --prompts), the gate runs on its held-out ones "
        "(task_id and prompt_seed_start then unused)"
    )
    examples: int = field(
        default=1, metadata={"help": "unused: the kept samples are the examples", "cli": False}
    )
    prompts: int = field(
        default=256, metadata={"help": "training prompts, spread over --task-id", "type": positive_int}
    )
    prompt_seed_start: int = field(
        default=TRAIN_SEED_START,
        metadata={"help": "first training seed of the prompts", "show_default": True},
    )
    samples_per_prompt: int = field(
        default=8, metadata={"help": "completions sampled per prompt (k)", "type": positive_int}
    )
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    max_new_tokens: int = field(
        default=512, metadata={"help": "completion budget when sampling", "type": positive_int}
    )
    sample_batch_size: int = field(
        default=8, metadata={"help": "prompts per generate call when sampling", "type": positive_int}
    )
    keep_per_prompt: int = field(
        default=1, metadata={"help": "best eligible completions kept per prompt", "type": positive_int}
    )
    keep_min_reward: float = field(
        default=0.0,
        metadata={"help": "keep only a scaled reward strictly above this (0 = doing nothing's score)",
                  "show_default": True},
    )  # fmt: skip
    keep_min_margin_over_slerp: float | None = field(
        default=None,
        metadata={"help": "also keep only a scaled reward >= uniform SLERP's on the same case + this"},
    )
    skip_gate_check: bool = field(
        default=False, metadata={"help": "do not require --from-checkpoint's passed gate (NOT recommended)"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.demos != "rsft":
            raise ConfigError(f"RSFT trains on its kept samples, got demos={self.demos!r}")
        for name in (
            "prompts",
            "samples_per_prompt",
            "max_new_tokens",
            "sample_batch_size",
            "keep_per_prompt",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.keep_per_prompt > self.samples_per_prompt:
            raise ConfigError(
                f"--keep-per-prompt ({self.keep_per_prompt}) cannot exceed --samples-per-prompt "
                f"({self.samples_per_prompt})"
            )
        if not self.temperature > 0:
            raise ConfigError(f"--temperature must be > 0 (RSFT samples), got {self.temperature!r}")


__all__ = ["RSFT_SAMPLES_FILE", "ConfigError", "RSFTConfig"]
