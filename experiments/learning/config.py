"""The learning experiment's settings: :class:`LearnConfig` (every ``python -m experiments.learning`` flag)
and the seed ranges and lengths the experiment fixes (experiments/learning/NOTEBOOK.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from orthojob.core.prompts import PROMPT_FORMATS
from orthojob.data.format_demos import STAGINGS
from orthojob.rewards.strategy_advantage import STRATEGY_ADVANTAGES
from orthojob.stages.grpo_config import LEVEL_WEIGHT_FLAG, LR_SCHEDULERS, OBJECTIVES
from server.cases import TRAIN_SEED_START

GRPO_PROMPT_SEED_START = TRAIN_SEED_START + 50_000
"""The GRPO training prompts' first seed (away from the SFT demonstrations' seeds)."""
RSFT_PROMPT_SEED_START = TRAIN_SEED_START + 60_000
"""RSFT's training prompts' first seed (away from BC's demonstrations and GRPO's prompts)."""
MAX_SEQ_LENGTH = 2048
CHAIN_FILE = "chain.json"
"""What the chain's process (BC, GRPO from BC) hands the main process."""

_SWITCH = {"negatable": True}
"""A switch's flag pair --x / --no-x (:func:`orthojob.stages.flags.add_config_arguments`)."""


def _level_weights(run: str, flag: str, example: str) -> dict:
    """The metadata of a repeatable ``LEVEL=W`` field (:data:`LEVEL_WEIGHT_FLAG`): one GRPO start's prompt mix."""
    return {
        **LEVEL_WEIGHT_FLAG,
        "help": f"{run}: a task level's turns per round of the prompt mix (repeatable; default 1 each: "
        f"{example}=2 gives {example} half the prompts)",
        "flag": flag,
    }


@dataclass(frozen=True)
class LearnConfig:
    """Every setting of one learning run (the CLI flags are generated from these fields)."""

    out: str = field(default="runs/learn", metadata={"help": "output folder"})
    seed: int = field(
        default=0, metadata={"help": "the whole run's seed: model init, SFT order, GRPO sampling"}
    )
    # model
    hidden_size: int = 96
    layers: int = 3
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    prompt_format: str = field(
        default="terse",
        metadata={
            "help": "the prompt the base model is trained and evaluated with: terse lists every tooth that "
            "moves, compact the 12 furthest from target, room is terse with each tooth's overcorrection room "
            "under force decay (orthojob.core.prompts)",
            "choices": PROMPT_FORMATS,
        },
    )
    # SFT (stage 0 and BC share the optimiser settings)
    sft_batch_size: int = 4
    sft_lr: float = 3e-3
    sft_examples: int = field(default=1600, metadata={"help": "stage 0's format demonstrations"})
    sft_steps: int = field(default=500, metadata={"help": "stage 0's steps"})
    strategy_last: bool = field(default=True, metadata=_SWITCH)
    safe_format_demos: bool = field(
        default=True,
        metadata={
            **_SWITCH,
            "help": "stage 0's random demonstrations redrawn where they break a hard rule (the simulator's rule "
            "check; strategy and groups stay random: orthojob/data/format_demos.py)",
        },
    )
    format_demo_staging: str = field(
        default="random",
        metadata={
            "help": "stage 0's demonstrations: random groups, or a group per level of the strategy each names, "
            "in that strategy's order (strategy, starts and speeds random: orthojob/data/format_demos.py)",
            "choices": STAGINGS,
        },
    )
    stage0_only: bool = field(
        default=False,
        metadata={
            **_SWITCH,
            "help": "run stage 0 and GRPO from it only, without the chain (BC, GRPO from BC): its targets "
            "then read missing",
        },
    )
    fresh_stage0: bool = field(default=False, metadata=_SWITCH)
    bc_examples: int = field(
        default=3600,
        metadata={
            "help": "BC's oracle demonstrations, over every cell (1,800 gave a higher BC but a lower GRPO from "
            "BC on both seeds: experiments/learning/NOTEBOOK.md)"
        },
    )
    bc_steps: int = field(
        default=1600,
        metadata={
            "help": "BC's steps (1,000 reached the same BC pooled but a weaker start for GRPO: "
            "experiments/learning/NOTEBOOK.md)"
        },
    )
    bc_demos: str = field(
        default="robust",
        metadata={
            "help": "BC's plans: the oracle's (oracle), or per case the candidate that stays safe when written "
            "imprecisely (robust: orthojob/data/robust_plans.py)",
            "choices": ("oracle", "robust"),
        },
    )
    bc_max_groups: int = field(
        default=6,
        metadata={
            "help": "robust demonstrations of at most this many groups: the oracle's staging merged by start and "
            "fraction where it is longer (orthojob/data/robust_plans.py; 0: no limit)"
        },
    )
    bc_unnamed_uniform: bool = field(
        default=False,
        metadata={
            "help": "robust demonstrations that stage uniformly name no strategy where naming the right one "
            "earns nothing (orthojob/data/robust_plans.py)",
            **_SWITCH,
        },
    )
    bc_oc_noise: float = field(
        default=0.0,
        metadata={
            "help": "robust demonstrations judged with each group's overcorrection also off by this standard "
            "deviation (absolute; orthojob/data/robust_plans.py; 0: fractions only)"
        },
    )
    bc_uniform_room: bool = field(
        default=False,
        metadata={
            "help": "robust demonstrations may also be, under force decay, uniform staging overcorrected by the "
            "smallest overcorrection room of the case's teeth (orthojob/data/robust_plans.py)",
            **_SWITCH,
        },
    )
    bc_room_oc: bool = field(
        default=False,
        metadata={
            "help": "robust demonstrations may also be, under force decay, the plans that do not overcorrect "
            "with each group overcorrected by half its teeth's smallest room (for --prompt-format room; "
            "orthojob/data/robust_plans.py)",
            **_SWITCH,
        },
    )
    # RSFT between BC and GRPO (stage 4 on BC's own samples)
    rsft_prompts: int = field(
        default=0,
        metadata={"help": "RSFT after BC on this many training prompts over every cell (0: no RSFT)"},
    )
    rsft_samples: int = field(default=8, metadata={"help": "RSFT: completions sampled per prompt"})
    rsft_margin: float = field(
        default=0.0,
        metadata={"help": "RSFT keeps a prompt's best safe sample only if it scores >= uniform SLERP + this"},
    )
    rsft_steps: int = field(default=150, metadata={"help": "RSFT's fine-tuning steps"})
    rsft_lr: float = field(default=1e-3, metadata={"help": "RSFT's learning rate (cosine, as BC's)"})
    # GRPO (both runs)
    steps: int = field(
        default=200,
        metadata={
            "help": "GRPO's steps from BC (on two cores the time limit can end it first; bench/grpo_step.py times a step)"
        },
    )
    stage0_steps: int = field(
        default=180,
        metadata={
            "help": "GRPO's steps from stage 0 (its process has no BC to train: 300 fit in the time limit, but "
            "did no better than 180 on either seed: experiments/learning/NOTEBOOK.md)"
        },
    )
    num_generations: int = 8
    prompts_per_step: int = 4
    num_prompts: int = 1200
    lr: float = 3e-4
    bc_lr: float = field(default=3e-4, metadata={"help": "GRPO's learning rate from BC"})
    lr_scheduler: str = field(
        default="constant",
        metadata={"help": "GRPO's learning-rate schedule over each run's steps", "choices": LR_SCHEDULERS},
    )
    temperature: float = field(default=0.8, metadata={"help": "GRPO's sampling temperature from stage 0"})
    bc_temperature: float = field(default=0.8, metadata={"help": "GRPO's sampling temperature from BC"})
    beta: float = field(default=0.1, metadata={"help": "GRPO's KL coefficient to its start, from stage 0"})
    bc_beta: float = field(default=0.1, metadata={"help": "GRPO's KL coefficient to its start (BC), from BC"})
    bc_ema: float = field(
        default=0.0,
        metadata={
            "help": "GRPO from BC: evaluate and save an exponential moving average of its weights with this "
            "decay per step (0: the weights as trained; 0.9 averages about the last 10 steps)"
        },
    )
    bc_level_weights: dict[str, float] = field(
        default_factory=dict, metadata=_level_weights("GRPO from BC", "--bc-level-weight", "task_hard")
    )
    stage0_level_weights: dict[str, float] = field(
        default_factory=dict,
        metadata=_level_weights("GRPO from stage 0", "--stage0-level-weight", "task_easy"),
    )
    objective: str = field(
        default="engine",
        metadata={
            "help": "what GRPO's rewards judge (both runs): engine, the plan the staging engine executes, a "
            "repaired plan paying the repair's cost (orthojob.rewards.rollouts.Rollout.objective_at); raw, the "
            "plan as written (GRPO from BC then writes safer plans that move less, and its executed plans "
            "fall below BC's: experiments/learning/NOTEBOOK.md)",
            "choices": OBJECTIVES,
        },
    )
    repair_cost_scale: float = field(
        default=0.25,
        metadata={
            "help": "with --objective engine, the repair cost's multiplier (> 0; 1: the engine's own, under "
            "which GRPO from BC moves less and its executed plans fall; 0.05-0.5 raise them, chosen on the "
            "tuning range: experiments/learning/NOTEBOOK.md)"
        },
    )
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    strategy_weight: float = 3.0
    strategy_advantage: str = field(default="counterfactual", metadata={"choices": STRATEGY_ADVANTAGES})
    strategy_advantage_scale: float = 1.0
    strategy_lr_scale: float = 10.0
    max_completion_length: int = field(
        default=384, metadata={"help": "GRPO's completion budget from BC (tokens)"}
    )
    stage0_completion_length: int = field(
        default=128,
        metadata={
            "help": "GRPO's completion budget from stage 0 (tokens; a third of its demonstrations are longer, "
            "but 256 did no better: experiments/learning/NOTEBOOK.md)"
        },
    )
    # the two processes
    parallel: bool = field(default=True, metadata={"help": "the chain in a second process", **_SWITCH})
    chain_only: bool = field(
        default=False,
        metadata={
            **_SWITCH,
            "help": "run only the chain (BC, GRPO from BC: make learn's second process), written to "
            "<out>/chain.json; experiments/learning/combine_halves.py joins it with a --stage0-only run",
        },
    )
    # evaluation
    eval_every: int = 30
    eval_seeds: int = field(
        default=64, metadata={"help": "held-out seeds per (level x dynamics) cell (at least 32)"}
    )
    eval_max_new_tokens: int = 384
    time_limit_min: float = field(
        default=55.0, metadata={"help": "each process stops GRPO at this wall time (minutes)"}
    )
