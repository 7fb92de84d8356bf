"""The SFT stages' configuration: :class:`SFTJobConfig` (stage 2, BC: ``orthojob bc-sft`` / ``sft``)
and :class:`FormatSFTConfig` (stage 0, format SFT: ``orthojob format-sft``); RSFT's
(:class:`orthojob.stages.rsft_config.RSFTConfig`, stage 4) extends them.

Like :mod:`orthojob.stages.grpo_config`: frozen dataclasses, help text in the fields' metadata, flags
generated from the fields (:func:`orthojob.stages.flags.add_config_arguments`), checks in
``__post_init__`` (a bad value raises :class:`ConfigError` naming the flag). ``demos`` names where
:func:`orthojob.stages.sft.run_sft` takes its demonstrations (:data:`DEMO_SOURCES`).

Default output folders: ``./checkpoints/<key>``, the stage's key (:data:`orthojob.stages.stage_table.STAGE_TABLE`:
``format_sft``, ``tool_sft``, ``bc_sft``; GRPO's ``grpo``, RSFT's ``rsft``), as the pipeline's stage folders
``<out>/<key>`` are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orthojob.data.format_demos import STAGINGS
from orthojob.modeling.models import TINY_MODEL
from orthojob.stages.flags import non_negative_int, positive_int, task_list
from orthojob.stages.training_config import ConfigError, TrainingConfig, cases_field, output_field
from server.cases import TASK_IDS

SFT_LOG_FILE = "sft_log.json"
SFT_CONFIG_FILE = "sft_config.json"
DEMO_SOURCES: dict[str, str] = {
    "oracle": "the oracle's plans the environment judges safe (stage 2, BC; orthojob.data.oracle_demos.demonstrations)",
    "format": "valid plans with random strategies and random feasible groups, no clinical choice "
    "(stage 0; orthojob.data.format_demos)",
    "tool": "the oracle's episodes through the agentic tools: inspect, check collisions, submit its plan "
    "(stage 1; orthojob.stages.tool_sft)",
    "rsft": "a checkpoint's own samples the environment scored best (stage 4; orthojob.stages.rsft)",
}
"""Where an SFT stage's demonstrations come from (``demos``)."""


def bc_only_field(default):
    """A BC setting that a stage inheriting SFTJobConfig keeps at ``default`` and hides from its CLI."""
    return field(default=default, metadata={"help": "BC only (not this stage)", "cli": False})


@dataclass(frozen=True)
class SFTJobConfig(TrainingConfig):
    """Every ``orthojob bc-sft`` flag (field ``x_y`` is flag ``--x-y``): stage 2, BC;
    the shared training fields are :class:`~orthojob.stages.training_config.TrainingConfig`'s.

    ``model``: hub id or folder, or ``"tiny"`` (build the offline tiny model into ``<out>/base-model``
    with ``tiny_arch``); ``from_checkpoint``: an earlier stage's output to continue instead (its full
    model, or its LoRA adapter). ``examples`` demonstrations are spread evenly over ``task_ids``;
    ``steps`` optimizer steps of ``batch_size x grad_accum`` examples each (epochs repeat as needed).
    ``cases``: a case set (:mod:`orthojob.data.case_sets`) split by patient: every SFT stage (BC, format,
    tool-use, RSFT) then trains on its training patients' cases and gates on its held-out ones, and
    records the split's digest (``demos.split_digest`` of the summary, the gate file's ``case_set``).
    """

    out: str = output_field("./checkpoints/bc_sft")
    demos: str = field(
        default="oracle", metadata={"help": "demonstration source (DEMO_SOURCES)", "cli": False}
    )
    task_ids: list[str] = field(
        default_factory=lambda: ["task_easy"],
        metadata={
            "help": "'all' or a comma list (default task_easy)",
            "flag": "--task-id",
            "type": task_list,
            "show_default": False,
        },
    )
    force_decay: bool = field(default=False, metadata={"help": "demonstrations for force-decay cases"})
    both_dynamics: bool = field(
        default=False,
        metadata={
            "help": "demonstrations under both dynamics (ideal and force decay, taking turns), the cells a "
            "quality gate judges; --force-decay then unused"
        },
    )
    cases: str | None = cases_field(
        "BC on the oracle's plans for its "
        "training patients, the gate on its held-out ones (task_id then unused)"
    )
    examples: int = field(default=2000, metadata={"help": "oracle demonstrations", "type": positive_int})
    robust_demos: bool = field(
        default=False,
        metadata={
            "help": "BC on robust demonstrations: per case the safe candidate (the oracle's plan, its two-decimal "
            "rounding, uniform staging) whose imprecise copies score best (orthojob/data/robust_plans.py; "
            "for small models, which write the oracle's numbers a little off)"
        },
    )
    steps: int = field(default=500, metadata={"help": "optimizer steps", "type": positive_int})
    batch_size: int = field(
        default=4, metadata={"help": "examples per device per step", "type": positive_int}
    )
    lr: float = field(default=2e-4, metadata={"help": "peak learning rate"})
    lr_scheduler: str = field(default="cosine", metadata={"help": "transformers scheduler name"})
    warmup_steps: int = field(default=10, metadata={"help": "warm-up steps", "type": non_negative_int})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay", "cli": False})
    lora_alpha: int | None = field(
        default=None, metadata={"help": "LoRA alpha (default 2 x rank)", "type": positive_int}
    )
    max_length: int = field(
        default=2048, metadata={"help": "longest example in tokens", "type": positive_int}
    )
    gradient_checkpointing: bool = field(
        default=False, metadata={"help": "gradient checkpointing", "cli": False}
    )
    logging_steps: int = field(default=10, metadata={"help": "log every N steps", "cli": False})
    tiny_arch: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "the tiny model's build keywords: architecture and prompt_format (presets)",
            "cli": False,
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("examples", "max_length", "logging_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if not self.task_ids or any(t not in TASK_IDS for t in self.task_ids):
            raise ConfigError(f"--task-id must be 'all' or a comma list of {TASK_IDS}, got {self.task_ids!r}")
        if self.demos not in DEMO_SOURCES:
            raise ConfigError(f"demos must be one of {sorted(DEMO_SOURCES)}, got {self.demos!r}")
        if self.model == TINY_MODEL and self.lora_r > 0 and not self.from_checkpoint:
            raise ConfigError(
                "--model tiny needs --lora-r 0 (full fine-tuning): LoRA on a randomly initialised "
                "base never learns the plan format"
            )


@dataclass(frozen=True)
class FormatSFTConfig(SFTJobConfig):
    """Every ``orthojob format-sft`` flag: stage 0, format SFT on demonstrations that carry no clinical
    choice (:func:`orthojob.data.format_demos.format_demonstrations`: a uniformly random strategy, random
    feasible groups), so the policy learns the plan format and starts at chance strategy accuracy."""

    out: str = output_field("./checkpoints/format_sft")
    demos: str = field(default="format", metadata={"help": "demonstration source", "cli": False})
    robust_demos: bool = bc_only_field(False)
    both_dynamics: bool = bc_only_field(False)
    cases: str | None = cases_field(
        "format demonstrations on its "
        "training patients' cases (taking turns up to --examples), the gate on its held-out ones "
        "(task_id then unused)"
    )
    examples: int = field(default=2000, metadata={"help": "format demonstrations", "type": positive_int})
    demo_seed: int = field(
        default=0,
        metadata={
            "help": "seed of the demonstrations' random choices (not of the cases)",
            "show_default": True,
        },
    )
    strategy_last: bool = field(
        default=False,
        metadata={
            "help": "write the strategy after the tooth groups, so the policy names it having read the case "
            "and written its plan (any key order parses)"
        },
    )
    safe_demos: bool = field(
        default=False,
        metadata={
            "help": "redraw a demonstration whose random plan breaks a hard rule (the simulator's rule check "
            "decides; the strategy and groups stay random), so the policy does not copy collisions"
        },
    )
    demo_staging: str = field(
        default="random",
        metadata={
            "help": "how a demonstration groups and times the teeth: random groups, or a group per level of "
            "the strategy it names, started in that strategy's order (the strategy, starts and speeds stay "
            "random; orthojob/data/format_demos.py)",
            "choices": STAGINGS,
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.demos != "format":
            raise ConfigError(f"format SFT trains on format demonstrations, got demos={self.demos!r}")


@dataclass(frozen=True)
class ToolSFTConfig(SFTJobConfig):
    """Every ``orthojob tool-sft`` flag: stage 1, tool-use SFT on the oracle's tool conversations
    (:func:`orthojob.stages.tool_sft.tool_demonstrations`: inspect a tooth or two, check collisions, submit the
    oracle's plan), with the tool-calling chat template (:func:`orthojob.agentic.chat_template.prepare_tokenizer`).
    Its gate runs greedy agentic episodes (:func:`orthojob.agentic.episodes.tool_gate_metrics`)."""

    out: str = output_field("./checkpoints/tool_sft")
    demos: str = field(default="tool", metadata={"help": "demonstration source", "cli": False})
    robust_demos: bool = bc_only_field(False)
    both_dynamics: bool = bc_only_field(False)
    cases: str | None = cases_field(
        "the oracle's tool conversations "
        "on its training patients' cases (each once, at most --examples), the tool-use gate's episodes on "
        "its held-out ones (task_id then unused)"
    )
    examples: int = field(default=1000, metadata={"help": "tool-call demonstrations", "type": positive_int})
    max_length: int = field(
        default=8192,
        metadata={
            "help": "longest example in tokens (the tools' schemas make prompts long: 3960-4240 tokens "
            "with the tiny model's tokenizer); a longer one loses its end",
            "type": positive_int,
        },
    )
    demo_seed: int = field(
        default=0,
        metadata={
            "help": "seed of the demonstrations' choices (which teeth are inspected)",
            "show_default": True,
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.demos != "tool":
            raise ConfigError(f"tool-use SFT trains on tool demonstrations, got demos={self.demos!r}")


__all__ = [
    "DEMO_SOURCES",
    "SFT_CONFIG_FILE",
    "SFT_LOG_FILE",
    "ConfigError",
    "FormatSFTConfig",
    "SFTJobConfig",
    "ToolSFTConfig",
]
