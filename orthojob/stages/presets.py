"""The one preset table: a preset name -> the config objects of every stage.

``orthojob grpo --preset P`` takes ``PRESETS[P].grpo``, ``orthojob bc-sft --preset P`` takes
``PRESETS[P].bc_sft``, and ``orthojob pipeline --preset P`` runs every stage with the same objects,
so a preset means the same run whichever command starts it (``tests/test_pipeline.py`` checks
it). Explicit flags override a preset's values (``orthojob grpo``), and so does the pipeline's
``--set section.key=value`` (:func:`apply_overrides`).

The values a stage shares with the others (``model``, ``task_id``, ``force_decay``, ``tiny_arch``)
are set once on the :class:`Preset` and copied into the stage configs when it is built.

``stages`` chooses the pipeline's training stages, in order, from :data:`PIPELINE_STAGES` (the keys of
:data:`orthojob.stages.stage_table.STAGE_TABLE`, numbered as in docs/stages.md): ``format_sft`` (stage 0,
format SFT), ``tool_sft`` (stage 1, tool-use SFT), ``bc_sft`` (stage 2, behaviour cloning of the oracle),
``grpo`` (stage 3), ``rsft`` (stage 4, rejection fine-tuning). Each stage starts from the previous stage's
gated checkpoint; the first must be an SFT stage that starts from the base model (``format_sft``,
``tool_sft`` or ``bc_sft``). Both presets keep ``("bc_sft", "grpo")``, the chain ``make run`` has always
run; ``--set stages=format_sft,grpo`` or ``--set stages=format_sft,bc_sft,grpo,rsft`` selects others. A
chain with ``tool_sft`` and ``grpo`` trains GRPO in agentic mode, the tool calls stage 1 teaches (``--set
stages=format_sft,tool_sft,grpo --set grpo.mode=agentic``; a one-shot GRPO there is refused).

``tiny-cpu``: offline, CPU, 2 cores, < 10 min. Its tiny model is built for the ``compact`` prompt
format (``tiny_arch["prompt_format"]``, :data:`orthojob.core.prompts.PROMPT_FORMATS`: the case without the
plan-format text, which the BC stage teaches), recorded in the model's ``config.json`` so every later
stage prompts it the same way. Its BC stage learns every level under both dynamics (the cells its
gate judges); its GRPO stage (20 steps, prompts up to 1760 tokens, 512-token completions: the oracle's
plans under force decay run to about 550 of the tiny tokenizer's tokens) is the one table
``orthojob grpo --preset tiny-cpu`` uses too. Its format
and RSFT stages (not in the default chain) are set by analogy with its BC stage and not tuned.

Gate sizes (:mod:`orthojob.stages.gate`: a quality gate judges ``n_seeds`` seeds in each of its six
cells, every level under both dynamics, drawn for the run): tiny-cpu's quality gates judge
:data:`TINY_GATE_SEEDS` per cell, 96 cases, which rule out a hard-rule rate above 3.1 % at 95 %
confidence when none breaks one (what fits ``make run``'s ten minutes with two gates); qwen2.5-3b's judge
:data:`GPU_GATE_SEEDS` per cell, 300 cases, which rule out 1.0 %.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from orthojob.lifecycle.gate_file import (
    BC_SFT,
    DEFAULT_THRESHOLDS,
    FORMAT_SFT,
    GRPO,
    RSFT,
    TOOL_SFT,
    GateThresholds,
)
from orthojob.modeling.models import TINY_MODEL
from orthojob.stages.flags import ENGINE_CHOICES
from orthojob.stages.gate import GateSettings
from orthojob.stages.grpo_config import ConfigError, GRPOJobConfig
from orthojob.stages.rsft_config import RSFTConfig
from orthojob.stages.sft_config import FormatSFTConfig, SFTJobConfig, ToolSFTConfig
from orthojob.stages.stage_table import (
    OLD_PIPELINE_NAMES,
    OLD_SECTIONS,
    SFT_SECTIONS,
    STAGE_TABLE,
    current_name,
)
from server.cases import TASK_IDS

PIPELINE_STAGES: tuple[str, ...] = tuple(STAGE_TABLE)
"""The pipeline's stages: their keys (:data:`orthojob.stages.stage_table.STAGE_TABLE`), each also its output
folder ``<out>/<key>``, MLflow stage run and gate stage."""
FIRST_STAGES: tuple[str, ...] = tuple(s.key for s in STAGE_TABLE.values() if s.first)
"""The stages that can start from the base model."""
DEFAULT_STAGES: tuple[str, ...] = (BC_SFT, GRPO)

TINY_GATE_SEEDS = 16
"""tiny-cpu's quality gates: seeds per cell (96 cases; no break rules out a hard-rule rate above 3.1 %)."""
GPU_GATE_SEEDS = 50
"""qwen2.5-3b's quality gates: seeds per cell (300 cases; no break rules out a hard-rule rate above 1.0 %)."""


def stage_list(value: Any) -> tuple[str, ...]:
    """``stages`` as a tuple, checked: a comma string or a list of :data:`PIPELINE_STAGES`, no stage
    twice, the first one of :data:`FIRST_STAGES`. Raises :class:`ConfigError`."""
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value or ())
    stages = tuple(current_name(v, OLD_PIPELINE_NAMES, "stage name") for v in items if v)
    unknown = [v for v in stages if v not in PIPELINE_STAGES]
    if unknown or not stages:
        raise ConfigError(f"stages must be a comma list of {', '.join(PIPELINE_STAGES)}, got {value!r}")
    if len(set(stages)) != len(stages):
        raise ConfigError(f"stages: a stage appears twice in {list(stages)}")
    if stages[0] not in FIRST_STAGES:
        raise ConfigError(
            f"stages: the chain must start with {' or '.join(FIRST_STAGES)} (from the base model), got {list(stages)}"
        )
    return stages


_GATE_SECTIONS = (*(STAGE_TABLE[k].gate_section for k in SFT_SECTIONS), "evaluate")
"""A preset's gate and evaluation settings: each takes the preset's ``engine``."""


@dataclass(frozen=True)
class GRPOGateSettings:
    """GRPO's own gate: its thresholds. Its held-out seeds and completion budget are the GRPO
    config's ``gate_seeds`` and ``max_completion_length``."""

    thresholds: GateThresholds = field(default_factory=lambda: DEFAULT_THRESHOLDS[GRPO])


@dataclass(frozen=True)
class EvaluateSettings:
    """The pipeline's final held-out evaluation of both checkpoints (and the baselines)."""

    n_seeds: int = 200
    baselines: bool = True
    max_new_tokens: int = 512
    batch_size: int = 32
    engine: str = "on"
    """Judge the plans the staging engine executes (``on``) or the raw plans (``off``): the preset's
    ``engine``."""


@dataclass(frozen=True)
class Preset:
    """Every hyper-parameter of one run: the shared values and one config object per stage.

    One section per stage of :data:`orthojob.stages.stage_table.STAGE_TABLE` (its key) and one for its gate
    (``<key>_gate``): ``format_sft``/``format_sft_gate`` stage 0; ``tool_sft``/``tool_sft_gate`` stage 1 (by
    default trained as the BC stage is); ``bc_sft``/``bc_sft_gate`` stage 2, BC; ``rsft``/``rsft_gate``:
    stage 4. ``grpo_gate``: the thresholds of GRPO's own gate, passed
    into the GRPO stage, which writes its gate file once with them. ``stages``: which of them the
    pipeline runs (module docstring).
    """

    name: str
    description: str
    model: str
    task_id: str
    force_decay: bool
    bc_sft: SFTJobConfig
    bc_sft_gate: GateSettings
    grpo: GRPOJobConfig
    grpo_gate: GRPOGateSettings
    evaluate: EvaluateSettings
    tiny_arch: dict[str, Any] = field(default_factory=dict)
    base_eval: bool = True
    stages: tuple[str, ...] = DEFAULT_STAGES
    format_sft: FormatSFTConfig = field(default_factory=FormatSFTConfig)
    format_sft_gate: GateSettings = field(
        default_factory=lambda: GateSettings(thresholds=DEFAULT_THRESHOLDS[FORMAT_SFT])
    )
    tool_sft: ToolSFTConfig | None = None  # None: trained as the BC stage is (_tool_stage)
    tool_sft_gate: GateSettings = field(
        default_factory=lambda: GateSettings(thresholds=DEFAULT_THRESHOLDS[TOOL_SFT])
    )
    rsft: RSFTConfig = field(default_factory=RSFTConfig)
    rsft_gate: GateSettings = field(default_factory=lambda: GateSettings(thresholds=DEFAULT_THRESHOLDS[RSFT]))
    engine: str = "on"
    """Every gate and the evaluation judge the plans the staging engine executes (``on``: what ships,
    beside the raw plans' figures) or the raw plans (``off``); ``orthojob pipeline --engine``."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_CHOICES:
            raise ConfigError(f"engine must be one of {', '.join(ENGINE_CHOICES)}, got {self.engine!r}")
        # the shared values, copied into the stage configs (one source of truth: the preset's)
        shared = {"model": self.model, "force_decay": self.force_decay, "tiny_arch": dict(self.tiny_arch)}
        if self.tool_sft is None:
            object.__setattr__(self, "tool_sft", _tool_stage(self.bc_sft))
        for name in SFT_SECTIONS:
            object.__setattr__(self, name, dataclasses.replace(getattr(self, name), **shared))
        for name in _GATE_SECTIONS:
            object.__setattr__(self, name, dataclasses.replace(getattr(self, name), engine=self.engine))
        grpo = dataclasses.replace(
            self.grpo,
            model=self.model,
            task_id=self.task_id,
            force_decay=self.force_decay,
            preset=self.name,
            engine=self.engine,
        )
        object.__setattr__(self, "grpo", grpo)
        object.__setattr__(self, "stages", stage_list(self.stages))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _tool_stage(bc: SFTJobConfig) -> ToolSFTConfig:
    """Stage 1 trained as the BC stage is (the same model, steps and optimiser), on tool
    conversations, with room for the tools' schemas in the prompt (at least
    :class:`~orthojob.stages.sft_config.ToolSFTConfig`'s default ``max_length``)."""
    shared = {
        f.name: getattr(bc, f.name)
        for f in dataclasses.fields(SFTJobConfig)
        if f.name not in ("out", "demos", "max_length")
    }
    return ToolSFTConfig(**shared, max_length=max(bc.max_length, ToolSFTConfig.max_length))


def _format_stage(bc: SFTJobConfig) -> FormatSFTConfig:
    """Stage 0 trained as the BC stage is (the same model, examples, steps and optimiser), on format
    demonstrations instead of the oracle's."""
    shared = {
        f.name: getattr(bc, f.name)
        for f in dataclasses.fields(SFTJobConfig)
        if f.name not in ("out", "demos")
    }
    return FormatSFTConfig(**shared)


def _quality_gate(stage: str, n_seeds: int, **budget: int) -> GateSettings:
    """A gate of ``stage`` judging ``n_seeds`` seeds per cell with ``stage``'s thresholds
    (:data:`DEFAULT_THRESHOLDS`): 512-token completions in batches of 16 unless ``budget`` says otherwise."""
    return GateSettings(
        n_seeds=n_seeds,
        **{"max_new_tokens": 512, "batch_size": 16, **budget},
        thresholds=DEFAULT_THRESHOLDS[stage],
    )


def _preset(
    *,
    gate_seeds: int,
    sft: dict[str, Any],
    grpo: dict[str, Any],
    rsft: dict[str, Any],
    format_gate: dict[str, Any],
    evaluate: dict[str, Any],
    **shared: Any,
) -> Preset:
    """A preset: the values every preset shares, with one preset's differences laid over them.

    ``sft``, ``grpo`` and ``rsft``: the keywords of the BC, GRPO and RSFT configs that differ from
    the shared ones below; ``format_gate`` and ``evaluate``: those of the format gate and the final
    evaluation. ``gate_seeds``: seeds per cell of every quality gate (BC, RSFT and GRPO's own);
    ``shared``: the :class:`Preset` fields (``name``, ``description``, ``model``, ``tiny_arch``).
    Every preset trains on ``task_easy`` without force decay, runs :data:`DEFAULT_STAGES`, and trains
    its format stage as its BC stage (:func:`_format_stage`); its tool stage likewise (:func:`_tool_stage`).
    """
    bc = SFTJobConfig(**{"task_ids": list(TASK_IDS), "lr_scheduler": "cosine", "max_length": 2048, **sft})
    return Preset(
        task_id="task_easy",
        force_decay=False,
        stages=DEFAULT_STAGES,
        bc_sft=bc,
        bc_sft_gate=_quality_gate(BC_SFT, gate_seeds),
        format_sft=_format_stage(bc),
        format_sft_gate=_quality_gate(FORMAT_SFT, **format_gate),
        grpo=GRPOJobConfig(**{"grad_accum": 1, "max_completion_length": 512, **grpo}, gate_seeds=gate_seeds),
        grpo_gate=GRPOGateSettings(),
        rsft=RSFTConfig(
            **{
                "temperature": 1.0,
                "max_new_tokens": 512,
                "sample_batch_size": 8,
                "max_length": 2048,
                **rsft,
            }
        ),
        rsft_gate=_quality_gate(RSFT, gate_seeds),
        evaluate=EvaluateSettings(**{"baselines": True, "max_new_tokens": 512, **evaluate}),
        **shared,
    )


TINY_CPU = _preset(
    name="tiny-cpu",
    description=(
        "offline, CPU, 2 cores, < 10 min: a ~0.2M-parameter Qwen2 built here, fully fine-tuned "
        "(SFT reaches >= 0.9 greedy parse rate); GRPO proves the loop, it does not make a planner"
    ),
    model=TINY_MODEL,
    tiny_arch={
        "hidden_size": 64,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "intermediate": 128,
        "vocab_size": 1024,
        "max_position_embeddings": 2048,
        "seed": 0,
        # the case without the plan-format text (orthojob.core.prompts): a held-out prompt is ~893 tokens
        # instead of ~1,709, and an SFT example trains ~2.5x faster
        "prompt_format": "compact",
    },
    gate_seeds=TINY_GATE_SEEDS,
    sft={
        # every level under both dynamics: the cells a quality gate judges
        "both_dynamics": True,
        "examples": 2400,
        # 2 epochs of the compact-prompt demonstrations (docs/stages.md: the tiny BC's gate, measured)
        "steps": 600,
        "batch_size": 8,
        "grad_accum": 1,
        "lr": 5e-3,
        "warmup_steps": 10,
        "lora_r": 0,
        "gradient_checkpointing": False,
        "logging_steps": 20,
    },
    grpo={
        # the offline tiny model, fully fine-tuned on CPU: proves the loop, learns little. 512-token
        # completions: the oracle's plans under force decay run to about 550 of its tokens
        "steps": 20,
        "num_generations": 4,
        "batch_size": 4,
        "lr": 1e-4,
        "lora_r": 0,
        "max_prompt_length": 1760,
        "max_seq_length": 2272,
        "gradient_checkpointing": False,
    },
    format_gate={"n_seeds": 32, "max_new_tokens": 256},
    rsft={
        # best of 4 samples on 32 training prompts, then a short fine-tune at a fifth of SFT's rate
        "task_ids": ["task_easy"],
        "prompts": 32,
        "samples_per_prompt": 4,
        "steps": 40,
        "batch_size": 4,
        "lr": 1e-3,
        "lr_scheduler": "constant",
        "warmup_steps": 0,
        "lora_r": 0,
        "logging_steps": 10,
    },
    evaluate={"n_seeds": 32, "batch_size": 16},
)

QWEN25_3B = _preset(
    name="qwen2.5-3b",
    description="one GPU: Qwen2.5-3B-Instruct, LoRA r 16 (Unsloth 4-bit when it imports), SFT then GRPO",
    model="Qwen/Qwen2.5-3B-Instruct",
    gate_seeds=GPU_GATE_SEEDS,
    sft={
        "examples": 3000,
        "steps": 375,
        "batch_size": 4,
        "grad_accum": 2,
        "lr": 2e-4,
        "warmup_steps": 20,
        "lora_r": 16,
        "lora_alpha": 32,
        "gradient_checkpointing": True,
        "logging_steps": 10,
    },
    grpo={
        # the Unsloth Qwen2.5-3B GRPO recipe on one GPU (LoRA r 16, 8 completions per prompt) with what
        # made the CPU learning experiment learn that holds in both modes: a KL anchor (beta 0.1) to the
        # previous stage and temperature 0.8. The experiment's prompts of every cell (mixed_cells) and
        # counterfactual strategy advantage are one-shot only, and the preset also serves
        # --mode agentic: one-shot runs add them with --set (experiments/learning/NOTEBOOK.md). Not carried
        # over: the strategy rows' faster learning rate needs a trainable lm_head, which LoRA freezes
        "beta": 0.1,
        "temperature": 0.8,
        "steps": 300,
        "num_generations": 8,
        "batch_size": 8,
        "lr": 5e-6,
        "lora_r": 16,
        "max_prompt_length": 1536,
        "max_seq_length": 2048,
        "gradient_checkpointing": True,
        "save_steps": 60,
    },
    format_gate={"n_seeds": 50},
    rsft={
        # continues the previous stage's LoRA adapter: best of 8 on 512 training prompts
        "task_ids": list(TASK_IDS),
        "prompts": 512,
        "samples_per_prompt": 8,
        "steps": 200,
        "batch_size": 4,
        "grad_accum": 2,
        "lr": 5e-5,
        "lr_scheduler": "cosine",
        "warmup_steps": 10,
        "lora_r": 16,
        "lora_alpha": 32,
        "gradient_checkpointing": True,
        "logging_steps": 10,
    },
    evaluate={"n_seeds": 200, "batch_size": 32},
)

PRESETS: dict[str, Preset] = {p.name: p for p in (TINY_CPU, QWEN25_3B)}
"""Every preset by name."""

_SHARED = ("model", "task_id", "force_decay", "tiny_arch", "base_eval", "description", "engine")
_FREE_KEYS = ("tiny_arch", "reward_weights")
"""Dict-valued settings whose keys ``--set`` may add (others must exist already)."""


def _replace(obj: Any, path: list[str], value: Any, dotted: str) -> Any:
    """``obj`` with the setting at ``path`` replaced (nested dataclasses and dicts)."""
    head, rest = path[0], path[1:]
    names = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
    if head not in names:
        raise KeyError(f"unknown preset {'key' if not rest else 'section'} {head!r} in {dotted!r}")
    current = getattr(obj, head)
    if rest:
        if isinstance(current, dict) and head in _FREE_KEYS and len(rest) == 1:
            new_value: Any = {**current, rest[0]: value}
        elif isinstance(current, GateThresholds) and len(rest) == 1:
            new_value = current.replace(**{rest[0]: value}) if rest[0] in current.to_dict() else None
            if new_value is None:
                raise KeyError(f"unknown gate threshold {rest[0]!r} in {dotted!r}")
        elif dataclasses.is_dataclass(current):
            new_value = _replace(current, rest, value, dotted)
        else:
            raise KeyError(f"unknown preset section {head!r} in {dotted!r}")
    else:
        if isinstance(current, GateThresholds) and isinstance(value, dict):
            value = GateThresholds.from_dict(value)
        new_value = value
    return dataclasses.replace(obj, **{head: new_value})


def check_chain(preset: Preset) -> Preset:
    """``preset``, when its stages fit together: a chain with ``tool`` (stage 1) and ``grpo`` needs
    GRPO's agentic mode, whose tool calls stage 1 teaches. Raises :class:`ConfigError`."""
    if TOOL_SFT in preset.stages and GRPO in preset.stages and preset.grpo.mode != "agentic":
        raise ConfigError(
            f"stages {','.join(preset.stages)}: tool-use SFT teaches the tool calls of GRPO's agentic mode; "
            f"set grpo.mode=agentic (got {preset.grpo.mode!r}), or leave tool_sft out"
        )
    return preset


def apply_overrides(preset: Preset, overrides: dict[str, Any] | None) -> Preset:
    """``preset`` with dotted settings replaced (``{"grpo.steps": 3, "bc_sft_gate.thresholds.min_parse_rate":
    0.5, "grpo.reward_weights.format": 2}``); the preset itself is untouched. A deprecated section
    (:data:`orthojob.stages.stage_table.OLD_SECTIONS`) is taken as its new name, with a message on stderr.
    Unknown keys raise
    KeyError; a value a config refuses, or a chain whose stages do not fit together
    (:func:`check_chain`, checked once every value is set), raises
    :class:`orthojob.stages.grpo_config.ConfigError`."""
    for dotted, value in (overrides or {}).items():
        path = dotted.split(".")
        path[0] = current_name(path[0], OLD_SECTIONS, "preset section") if len(path) > 1 else path[0]
        if path[0] in (*STAGE_TABLE, *_GATE_SECTIONS) and len(path) > 1 and path[1] in _SHARED:
            raise KeyError(f"{dotted!r}: set {path[1]!r} for the whole preset (--set {path[1]}=...)")
        preset = _replace(preset, path, value, dotted)
    return check_chain(preset)


__all__ = [
    "DEFAULT_STAGES",
    "FIRST_STAGES",
    "PIPELINE_STAGES",
    "PRESETS",
    "ConfigError",
    "EvaluateSettings",
    "GRPOGateSettings",
    "GateSettings",
    "Preset",
    "apply_overrides",
    "check_chain",
    "stage_list",
]
