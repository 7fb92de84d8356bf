"""The learning experiment (issue 12): format stage 0, then GRPO, beside BC and RSFT, on held-out seeds.

``make learn`` (or ``python -m orthojob.learning``; docs/learning_experiment.md) runs, on CPU and
offline, in two processes (one per core):

1. **model**: the offline tiny Qwen2 (:func:`base_model`, :func:`orthojob.models.build_tiny`; hidden
   96, 3 layers, ~0.5M parameters), tokenizer trained on training prompts only, in the ``compact``
   prompt format (:data:`orthojob.prompts.PROMPT_FORMATS`: the case without the plan-format text);
2. **stage 0 (format SFT)** on :func:`orthojob.format_demos.format_demonstrations`: valid,
   executable plans with random strategies and random feasible groups (no clinical choice), the
   strategy written after the groups. The checkpoint is kept in ``<out>/stage0`` and reused by later
   runs with the same settings (``--fresh-stage0`` rebuilds it);
3. **BC and RSFT** (:func:`run_baselines`, the second process, started before stage 0): BC from the
   base model on the oracle's safe plans, RSFT from stage 0 on its best-of-k samples;
4. **GRPO** through the job's trainer (:func:`orthojob.grpo_trainer.train` with the
   :class:`~orthojob.grpo_config.GRPOJobConfig` of :func:`grpo_job_config`: TRL's GRPOTrainer, the
   project's five reward functions, ``reward_strategy`` weighted ``strategy_weight``) from stage 0:
   4 prompts x 8 completions per step, temperature 0.8, DAPO loss, group-scaled rewards, and three
   settings that let it learn the case-dependent strategy (docs/learning_experiment.md, runs 7A-7Q):
   the tokens naming the strategy get the ``counterfactual`` advantage
   (:mod:`orthojob.strategy_advantage`: the plan as written against the same plan under each of the
   five strategies, centred per strategy over the batch), the output layer's strategy rows learn
   at ``strategy_lr_scale`` x the learning rate, and a KL anchor to stage 0 (``beta`` 0.1) holds the
   strategy distribution of every case near stage 0's until the case-dependent part wins;
5. **evaluation** every ``--eval-every`` steps (and at step 0 = stage 0), and of BC and RSFT, on
   held-out seeds (:data:`server.cases.HELDOUT_SEED_START`), greedy decoding: the headline metric, the
   scaled terminal reward (``scaled_reward``, :mod:`orthojob.metrics`), strategy accuracy, and clinical canaries that are NOT in the reward (limit violations,
   colliding contacts, peak PDL kPa, hard-rule share, degenerate-plan share,
   :func:`orthojob.plan_search.degenerate_form`), each as mean and 95 % t-interval over the seeds, and
   the strategy probe (:func:`strategy_distribution`, :func:`strategy_conditioning`). The oracle and
   uniform SLERP are scored on the same seeds as reference rows.

Writes ``<out>/learning.json`` (settings, references, per-step evaluations, the BC and RSFT rows, the
comparison, TRL's log history with ``frac_reward_zero_std``, entropy, clip ratios, completion lengths,
per-reward std and within-group std, ``reward_time_share`` per step), ``<out>/learning.png`` and
``<out>/comparison.md``, inside an MLflow run ``learn`` (:func:`run`): the evaluations as
``heldout/<metric>`` per step, the comparison table, the files as artifacts, and GRPO's own metrics
and completion table (README, "What a GRPO run logs to MLflow").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from orthojob.canaries import CANARIES, METRICS, episode_values, rollout_record  # noqa: F401 (re-exported)
from orthojob.metrics import BANDS, SCALED_REWARD
from orthojob.strategy_advantage import STRATEGY_ADVANTAGES, STRATEGY_KEY
from server.cases import HELDOUT_SEED_START, TRAIN_SEED_START, CaseKey, generate_case

log = logging.getLogger("orthojob.learning")


GRPO_PROMPT_SEED_START = TRAIN_SEED_START + 50_000
"""The GRPO training prompts' first seed (away from the stage-0 demonstrations' seeds)."""
MAX_SEQ_LENGTH = 2048


_SWITCH = {"negatable": True}
"""A switch's flag pair --x / --no-x (:func:`orthojob.flags.add_config_arguments`)."""


@dataclass(frozen=True)
class LearnConfig:
    """Every setting of one learning run (the CLI flags are generated from these fields)."""

    out: str = "runs/learn"
    task_id: str = "task_easy"
    # model
    hidden_size: int = 96
    layers: int = 3
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    model_seed: int = 0
    prompt_format: str = "compact"
    # stage 0
    sft_examples: int = 1600
    sft_steps: int = 500
    sft_batch_size: int = 4
    sft_lr: float = 3e-3
    demo_seed: int = 0
    strategy_last: bool = field(default=True, metadata=_SWITCH)
    fresh_stage0: bool = field(default=False, metadata=_SWITCH)
    # GRPO
    steps: int = 90
    num_generations: int = 8
    prompts_per_step: int = 4
    num_prompts: int = 1000
    lr: float = 3e-4
    temperature: float = 0.8
    beta: float = 0.1
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    strategy_weight: float = 3.0
    strategy_advantage: str = field(default="counterfactual", metadata={"choices": STRATEGY_ADVANTAGES})
    strategy_advantage_scale: float = 1.0
    strategy_lr_scale: float = 10.0
    max_completion_length: int = 128
    seed: int = 0
    # baselines on the same held-out seeds (a second process, the other core): BC and RSFT
    baselines: bool = field(default=True, metadata=_SWITCH)
    baselines_only: bool = field(default=False, metadata=_SWITCH)
    bc_steps: int = 240
    rsft_prompts: int = 128
    rsft_samples: int = 8
    rsft_steps: int = 120
    # evaluation
    eval_every: int = 15
    eval_seeds: int = 48
    eval_max_new_tokens: int = 256  # every planner's budget (the oracle's plans, BC's, take 145-249 tokens)
    time_limit_min: float = 45.0


def _ci(values: Sequence[float]) -> dict:
    """Mean and 95 % t-interval of values (NaN dropped)."""
    from scipy import stats

    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if len(x) == 0:
        return {"mean": None, "lo": None, "hi": None, "n": 0}
    mean = float(x.mean())
    if len(x) < 2:
        return {"mean": mean, "lo": mean, "hi": mean, "n": 1}
    half = float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": len(x)}


def summarise(episodes: Sequence[dict[str, float]]) -> dict[str, dict]:
    return {m: _ci([e[m] for e in episodes]) for m in METRICS}


def heldout_cases(task_id: str, n: int) -> list[CaseKey]:
    return [CaseKey(task_id, HELDOUT_SEED_START + i, False) for i in range(n)]


def reference_rows(cases: Sequence[CaseKey]) -> dict[str, dict]:
    """The oracle and uniform SLERP on the held-out cases."""
    from orthojob.evaluation import UNIFORM_SLERP_PLAN
    from server.oracle import plan_for_case
    from server.treatment import score_plans

    resolved = [generate_case(*c) for c in cases]
    rows = {}
    for name, planner in (("oracle", plan_for_case), ("uniform_slerp", lambda c: UNIFORM_SLERP_PLAN)):
        plans = [planner(c) for c in resolved]
        results = score_plans(plans, resolved)
        episodes = [
            episode_values({**r, "plan": p}, c, c.optimal_strategy)
            for r, p, c in zip(results, plans, resolved)
        ]
        rows[name] = summarise(episodes)
    return rows


"""Where a plan names its strategy: the probe reads the next token's distribution there."""


def strategy_distribution(model, tokenizer, cases: Sequence[CaseKey], texts: Sequence[str]) -> np.ndarray:
    """(n_cases, 5) the policy's probabilities of each strategy (:data:`server.clinical_profiles.STRATEGIES`
    order) where its own greedy plan (``texts``) names one: the next-token probabilities of each
    strategy's first token after the plan's text up to ``"strategy": "``, renormalised over the five
    (one forward pass per case; NaN where the plan names none)."""
    import torch

    from orthojob.prompts import build_messages, prompt_format_of, reset_observation
    from server.clinical_profiles import STRATEGIES

    head = tokenizer(STRATEGY_KEY, add_special_tokens=False)["input_ids"]
    first = []
    for s in STRATEGIES:  # the token after the key as the policy writes it
        ids = tokenizer(STRATEGY_KEY + s, add_special_tokens=False)["input_ids"]
        if ids[: len(head)] != head:
            raise ValueError(f"the tokenizer splits {STRATEGY_KEY!r} differently before {s!r}; cannot probe")
        first.append(ids[len(head)])
    if len(set(first)) != len(first):
        raise ValueError("two strategies share a first token; cannot probe strategies")
    fmt = prompt_format_of(model)
    device = next(model.parameters()).device
    out = np.full((len(cases), len(STRATEGIES)), np.nan)
    with torch.inference_mode():
        for i, (c, text) in enumerate(zip(cases, texts)):
            at = text.find(STRATEGY_KEY)
            if at < 0:
                continue
            messages = build_messages(reset_observation(c.seed, c.task_id, c.force_decay), fmt)
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(
                prompt + text[: at + len(STRATEGY_KEY)], return_tensors="pt", add_special_tokens=False
            )
            p = torch.softmax(model(input_ids=ids["input_ids"].to(device)).logits[0, -1].float(), dim=-1)[
                first
            ]
            out[i] = (p / p.sum()).cpu().numpy()
    return out


def strategy_conditioning(probs: np.ndarray, optimal: Sequence[str]) -> dict:
    """How much the policy's strategy depends on the case: ``p_optimal`` (mean probability of the
    case's optimal strategy; a case-blind uniform policy has 0.2), ``case_dependence`` (mean total
    variation distance between a case's distribution and the mean over cases: 0 = the same
    distribution for every case), and the mean distribution by the case's optimal strategy, over the
    cases whose plan names a strategy (rows of ``probs`` without NaN)."""
    from server.clinical_profiles import STRATEGIES

    named = ~np.isnan(probs).any(axis=1)
    probs = probs[named]
    index = [STRATEGIES.index(o) for o, n in zip(optimal, named) if n]
    if not index:
        return {"p_optimal": _ci([]), "case_dependence": _ci([]), "by_optimal": {}}
    mean = probs.mean(axis=0)
    return {
        "p_optimal": _ci(probs[np.arange(len(index)), index].tolist()),
        "case_dependence": _ci((0.5 * np.abs(probs - mean).sum(axis=1)).tolist()),
        "by_optimal": {
            s: np.round(probs[[k for k, i in enumerate(index) if i == j]].mean(axis=0), 4).tolist()
            for j, s in enumerate(STRATEGIES)
            if j in index
        },
    }


def evaluate_model(model, tokenizer, cases: Sequence[CaseKey], max_new_tokens: int) -> dict:
    """Greedy plans of ``model`` for the held-out cases, scored as the rewards score them."""
    from orthojob.evaluation import generate_completions
    from orthojob.prompts import reset_observation
    from orthojob.rollouts import score_texts

    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    obs = [reset_observation(c.seed, c.task_id, c.force_decay) for c in cases]
    texts, counts, ended = generate_completions(model, tokenizer, obs, max_new_tokens, batch_size=16)
    probs = strategy_distribution(model, tokenizer, cases, texts)
    if was_training:
        model.train()
    rolls = score_texts(texts, list(cases))
    episodes = []
    for r, c in zip(rolls, cases):
        record = rollout_record(r, generate_case(*c))
        episodes.append({m: record[m] for m in METRICS})
    summary = summarise(episodes)
    summary["strategies"] = {
        s: sum(str(r.strategy) == s for r in rolls) for s in sorted({str(r.strategy) for r in rolls})
    }
    summary["strategy_conditioning"] = strategy_conditioning(
        probs, [generate_case(*c).optimal_strategy for c in cases]
    )
    summary["mean_tokens"] = float(np.mean(counts))
    summary["truncated"] = float(np.mean([not e for e in ended]))
    summary["eval_seconds"] = time.perf_counter() - t0
    summary["example"] = texts[0]
    return summary


# ---------------------------------------------------------------------------------------------
# Stage 0
# ---------------------------------------------------------------------------------------------


def _stage0_key(cfg: LearnConfig) -> dict:
    keys = ("task_id", "prompt_format", "hidden_size", "layers", "heads", "kv_heads", "intermediate", "model_seed",
            "sft_examples", "sft_steps", "sft_batch_size", "sft_lr", "demo_seed", "strategy_last")  # fmt: skip
    return {k: getattr(cfg, k) for k in keys}


def base_model(cfg: LearnConfig) -> Path:
    """The experiment's tiny base model in ``<out>/base-model`` (built unless one with the same
    settings is there), in ``cfg.prompt_format``."""
    from orthojob import models

    path = Path(cfg.out) / "base-model"
    keys = (
        "task_id",
        "prompt_format",
        "hidden_size",
        "layers",
        "heads",
        "kv_heads",
        "intermediate",
        "model_seed",
    )
    key = {k: getattr(cfg, k) for k in keys}
    key_file = path / "learn_base.json"
    if key_file.is_file() and json.loads(key_file.read_text()) == key:  # built deterministically
        return path
    models.build_tiny(path, [cfg.task_id], prompt_format=cfg.prompt_format, hidden_size=cfg.hidden_size,
                      layers=cfg.layers, heads=cfg.heads, kv_heads=cfg.kv_heads, intermediate=cfg.intermediate,
                      max_position_embeddings=MAX_SEQ_LENGTH, seed=cfg.model_seed)  # fmt: skip
    key_file.write_text(json.dumps(key))
    return path


def _cached_stage0(cfg: LearnConfig) -> dict | None:
    meta_file = Path(cfg.out) / "stage0" / "stage0.json"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        if meta.get("key") == _stage0_key(cfg):
            return meta
    return None


def wait_for_stage0(cfg: LearnConfig, timeout_s: float) -> Path:
    """Stage 0's checkpoint once the main process has saved it (the baselines' process, for RSFT)."""
    deadline = time.monotonic() + timeout_s
    while _cached_stage0(cfg) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no stage 0 checkpoint in {Path(cfg.out) / 'stage0'} after {timeout_s:.0f} s")
        time.sleep(5)
    return Path(cfg.out) / "stage0"


def stage0(cfg: LearnConfig) -> tuple[Path, dict]:
    """Train format SFT on random-choice demos from :func:`base_model` with the project's one SFT
    routine (:func:`orthojob.sft.run_sft`, stage 0's :class:`~orthojob.sft_config.FormatSFTConfig`);
    reuse a matching checkpoint unless ``fresh_stage0``."""
    from orthojob.sft import run_sft
    from orthojob.sft_config import FormatSFTConfig

    out = Path(cfg.out) / "stage0"
    key = _stage0_key(cfg)
    meta_file = out / "stage0.json"
    if not cfg.fresh_stage0 and (meta := _cached_stage0(cfg)) is not None:
        log.info("reusing stage 0 checkpoint %s", out)
        return out, meta
    meta_file.unlink(missing_ok=True)
    t0 = time.perf_counter()
    base = base_model(cfg)
    config = _sft_stage_config(
        cfg, FormatSFTConfig, model=str(base), out=str(out), examples=cfg.sft_examples, demo_seed=cfg.demo_seed,
        strategy_last=cfg.strategy_last, steps=cfg.sft_steps,
    )  # fmt: skip
    summary = run_sft(config)
    meta = {
        "key": key,
        "demos": {k: v for k, v in summary["demos"].items() if k not in ("source", "examples")},
        "parameters": summary["parameters"]["total"],
        "sft_seconds": summary["train_seconds"],
        "sft_seconds_per_step": summary["seconds_per_step"],
        "loss_first": summary["first_loss"],
        "loss_last": summary["final_loss"],
        "wall_seconds": time.perf_counter() - t0,
    }
    meta_file.write_text(json.dumps(meta, indent=1))
    return out, meta


# ---------------------------------------------------------------------------------------------
# Baselines: stage 2 (BC) and stage 4 (RSFT)
# ---------------------------------------------------------------------------------------------

BASELINES_FILE = "baselines.json"


def _sft_stage_config(cfg: LearnConfig, kind: type | None = None, **changes):
    """An SFT stage's config (``kind``, default :class:`~orthojob.sft_config.SFTJobConfig`) with the
    experiment's one set of SFT optimiser settings (full fine-tuning), for stage 0, BC and RSFT."""
    from orthojob.sft_config import SFTJobConfig

    kind = kind or SFTJobConfig
    settings = dict(task_ids=[cfg.task_id], batch_size=cfg.sft_batch_size, lr=cfg.sft_lr, lr_scheduler="cosine",
                    warmup_steps=10, lora_r=0, max_length=MAX_SEQ_LENGTH, seed=cfg.model_seed, logging_steps=20)  # fmt: skip
    return kind(**{**settings, **changes})


def run_baselines(cfg: LearnConfig, cases: Sequence[CaseKey]) -> dict:
    """The other stages on the experiment's model and held-out seeds, for one table with GRPO:

    * **BC** (stage 2): the base model fine-tuned on the oracle's safe plans
      (:func:`orthojob.sft.oracle_demonstrations`), as many examples and ``bc_steps`` steps;
    * **RSFT** (stage 4): stage 0 samples ``rsft_samples`` completions per training prompt at
      temperature 1, keeps each prompt's best plan that breaks no hard rule and scores above doing
      nothing (:class:`orthojob.rsft.KeepRule`'s default), and fine-tunes for ``rsft_steps``.

    Each is evaluated greedily as GRPO's steps are. Written to ``<out>/baselines.json``."""
    import dataclasses as dc

    from orthojob import models
    from orthojob.prompts import prompt_format_of
    from orthojob.rsft import RSFTError, run_rsft
    from orthojob.rsft_config import RSFTConfig
    from orthojob.sft import oracle_demonstrations, run_sft

    out = Path(cfg.out)
    base = base_model(cfg)
    rows: dict = {}

    def evaluate(name: str, checkpoint: Path, summary: dict) -> None:
        model, tokenizer = models.load_policy(str(checkpoint), lora_r=0, max_seq_length=MAX_SEQ_LENGTH)
        rows[name] = {
            **evaluate_model(model, tokenizer, cases, cfg.eval_max_new_tokens),
            "train_seconds": summary.get("train_seconds"),
            **({"rsft": summary["rsft"]} if "rsft" in summary else {}),
        }
        (out / BASELINES_FILE).write_text(json.dumps(rows, indent=1, default=float))

    t0 = time.perf_counter()
    demos, info = oracle_demonstrations(cfg.sft_examples, [cfg.task_id], False, prompt_format_of(base))
    bc = _sft_stage_config(
        cfg, model=str(base), out=str(out / "bc"), examples=cfg.sft_examples, steps=cfg.bc_steps
    )
    evaluate("bc", out / "bc", run_sft(bc, demos, info))
    log.info("BC done in %.0f s", time.perf_counter() - t0)
    stage0_dir = wait_for_stage0(cfg, timeout_s=3600)
    t0 = time.perf_counter()
    rsft = RSFTConfig(
        **{k: v for k, v in dc.asdict(_sft_stage_config(cfg, steps=cfg.rsft_steps)).items() if k not in ("demos", "examples", "out", "model", "from_checkpoint")},
        model=str(base),
        out=str(out / "rsft"),
        from_checkpoint=str(stage0_dir),
        prompts=cfg.rsft_prompts,
        prompt_seed_start=GRPO_PROMPT_SEED_START,
        samples_per_prompt=cfg.rsft_samples,
        max_new_tokens=cfg.eval_max_new_tokens,
        skip_gate_check=True,  # stage 0 is not gated in the experiment; its step-0 row is its evaluation
    )  # fmt: skip
    try:
        summary = run_rsft(rsft)
    except RSFTError as exc:  # nothing met the keep rule: a row that says so, not a crash
        rows["rsft"] = {"error": str(exc)}
        (out / BASELINES_FILE).write_text(json.dumps(rows, indent=1, default=float))
        return rows
    log.info("RSFT kept %s in %.0f s", summary["rsft"], time.perf_counter() - t0)
    evaluate("rsft", out / "rsft", summary)
    return rows


# ---------------------------------------------------------------------------------------------
# GRPO
# ---------------------------------------------------------------------------------------------


@dataclass
class Progress:
    evals: list = field(default_factory=list)
    step_seconds: list = field(default_factory=list)


def grpo_job_config(cfg: LearnConfig, checkpoint: Path):
    """The :class:`orthojob.grpo_config.GRPOJobConfig` of the experiment's GRPO stage: full fine-tuning
    of the stage-0 checkpoint, ``prompts_per_step`` prompt groups of ``num_generations`` per step, the
    five rewards with weight 1, a constant learning rate, no checkpoints until the end."""
    from orthojob.grpo_config import GRPOJobConfig

    return GRPOJobConfig(
        model=str(checkpoint),
        steps=cfg.steps,
        num_generations=cfg.num_generations,
        batch_size=cfg.num_generations * cfg.prompts_per_step,
        grad_accum=1,
        lr=cfg.lr,
        lr_scheduler_type="constant",
        lora_r=0,
        max_prompt_length=MAX_SEQ_LENGTH - cfg.max_completion_length,
        max_completion_length=cfg.max_completion_length,
        max_seq_length=MAX_SEQ_LENGTH,
        out=str(Path(cfg.out) / "grpo"),
        task_id=cfg.task_id,
        force_decay=False,
        seed=cfg.seed,
        num_prompts=cfg.num_prompts,
        prompt_seed_start=GRPO_PROMPT_SEED_START,
        beta=cfg.beta,
        temperature=cfg.temperature,
        loss_type=cfg.loss_type,
        scale_rewards=cfg.scale_rewards,
        reward_weights={"reward_strategy": cfg.strategy_weight} if cfg.strategy_weight != 1.0 else {},
        strategy_advantage=cfg.strategy_advantage,
        strategy_advantage_scale=cfg.strategy_advantage_scale,
        strategy_lr_scale=cfg.strategy_lr_scale,
        gradient_checkpointing=False,
        save_steps=0,
    )


def run_grpo(cfg: LearnConfig, checkpoint: Path, cases: Sequence[CaseKey], progress: Progress, save) -> dict:
    """GRPO from the stage-0 checkpoint through :func:`orthojob.grpo_trainer.train` (the job's trainer:
    completions, MLflow table and diagnostics when a run is active), with an evaluation callback;
    returns timing, the reward functions' share of a step and TRL's logs."""
    from transformers import TrainerCallback

    from orthojob import models
    from orthojob.grpo_config import validate

    models.device_info()  # Unsloth (on a GPU) before TRL
    from orthojob import grpo_trainer

    job = grpo_job_config(cfg, checkpoint)
    validate(job)
    deadline = time.monotonic() + cfg.time_limit_min * 60
    clock = {"train_begin": 0.0, "train_seconds": 0.0}

    class EvalAndTime(TrainerCallback):
        t0 = 0.0

        def on_train_begin(self, args, state, control, **kw):
            clock["train_begin"] = time.perf_counter()

        def on_train_end(self, args, state, control, **kw):
            clock["train_seconds"] = time.perf_counter() - clock["train_begin"]

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            progress.step_seconds.append(time.perf_counter() - self.t0)
            step = state.global_step
            if step % cfg.eval_every == 0 or step == cfg.steps or time.monotonic() > deadline:
                row = {
                    "step": step,
                    **evaluate_model(kw["model"], kw["processing_class"], cases, cfg.eval_max_new_tokens),
                }
                progress.evals.append(row)
                log.info(
                    "step %d: %s %s, strategy %s",
                    step,
                    SCALED_REWARD,
                    row[SCALED_REWARD],
                    row["strategy_accuracy"],
                )
                save()
            if time.monotonic() > deadline:
                log.warning("time limit reached at step %d", step)
                control.should_training_stop = True

    result = grpo_trainer.train(job, callbacks=[EvalAndTime()])
    trainer = result.trainer
    return {
        "grpo_seconds": clock["train_seconds"],
        "steps_done": trainer.state.global_step,
        "seconds_per_step": float(np.mean(progress.step_seconds)) if progress.step_seconds else None,
        "reward_seconds": result.reward_seconds,
        # the optimizer steps' wall time, evaluations excluded (as the trainer's reward_time_share)
        "reward_share_of_step": result.reward_seconds / max(1e-9, trainer.step_seconds),
        "grpo_config": job.to_dict(),
        "log_history": trainer.state.log_history,
    }


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = report["evaluations"]
    steps = [e["step"] for e in evals]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, metric, title in zip(
        axes,
        (SCALED_REWARD, "strategy_accuracy", "hard_rule"),
        ("scaled_reward (scaled terminal)", "strategy accuracy", "hard-rule share"),
    ):
        mean, lo, hi = (
            [np.nan if e[metric][k] is None else e[metric][k] for e in evals] for k in ("mean", "lo", "hi")
        )
        ax.plot(steps, mean, "o-", label="policy (greedy)")
        ax.fill_between(steps, lo, hi, alpha=0.25)
        for name, style in (("oracle", "g--"), ("uniform_slerp", "k:")):
            ax.axhline(report["references"][name][metric]["mean"], ls=style[1:], color=style[0], label=name)
        ax.set_title(title)
        ax.set_xlabel("GRPO step")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"held-out {report['config']['task_id']}, {report['config']['eval_seeds']} seeds, 95 % CI")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _argv(cfg: LearnConfig, **changes) -> list[str]:
    """The command-line flags that rebuild ``cfg`` with ``changes`` (for the baselines' process)."""
    argv = []
    for name, value in {**dataclasses.asdict(cfg), **changes}.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def comparison(report: dict) -> list[dict]:
    """One row per planner on the held-out seeds: stage 0, BC, RSFT, GRPO (last evaluation), the
    oracle and uniform SLERP; each metric's mean and 95 % CI."""
    rows = [("stage 0 (format SFT)", report["evaluations"][0]), *[
        (name, report.get("baselines", {}).get(key)) for name, key in (("BC (stage 2)", "bc"), ("RSFT (stage 4)", "rsft"))
    ], (f"GRPO step {report['evaluations'][-1]['step']}", report["evaluations"][-1]),
        ("oracle", report["references"]["oracle"]), ("uniform SLERP", report["references"]["uniform_slerp"])]  # fmt: skip
    return [
        {"planner": name, **{m: row[m] for m in METRICS}} for name, row in rows if row and "error" not in row
    ]


def markdown_table(rows: Sequence[dict]) -> str:
    """The comparison as a markdown table: mean [95 % CI] per metric."""

    def cell(ci: dict) -> str:
        if ci["mean"] is None:
            return "-"
        return (
            f"{ci['mean']:.3f} [{ci['lo']:.3f}, {ci['hi']:.3f}]"
            if ci["n"] > 1 and ci["hi"] != ci["lo"]
            else f"{ci['mean']:.3f}"
        )

    lines = ["| planner | " + " | ".join(METRICS) + " |", "|---" * (len(METRICS) + 1) + "|"]
    lines += ["| " + r["planner"] + " | " + " | ".join(cell(r[m]) for m in METRICS) + " |" for r in rows]
    return "\n".join(lines)


def run(cfg: LearnConfig) -> dict:
    """Stage 0, then GRPO with evaluations (this process) beside BC and RSFT (a second process);
    inside an MLflow stage run ``learn`` (the embedded sqlite store unless MLFLOW_TRACKING_URI)."""
    from orthojob import tracking

    with tracking.stage_run("learn", params=dataclasses.asdict(cfg)):
        report = _run(cfg)
        _log_report(report, Path(cfg.out))
    return report


def _log_report(report: dict, out: Path) -> None:
    """Evaluations as step metrics, the comparison and both files as artifacts of the active run."""
    import mlflow

    from orthojob import tracking

    for e in report["evaluations"]:
        tracking.log_metrics(
            {f"heldout/{m}": e[m]["mean"] for m in METRICS if e[m]["mean"] is not None}, step=e["step"]
        )
    tracking.log_table_rows([{"planner": r["planner"], **{m: r[m]["mean"] for m in METRICS}} for r in report["comparison"]], "comparison.json")  # fmt: skip
    for name in ("learning.json", "learning.png", "comparison.md"):
        if (out / name).is_file():
            mlflow.log_artifact(str(out / name))


def _run(cfg: LearnConfig) -> dict:
    import subprocess

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cases = heldout_cases(cfg.task_id, cfg.eval_seeds)
    report: dict = {
        "config": dataclasses.asdict(cfg),
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "references": reference_rows(cases),
    }
    base_model(cfg)
    if cfg.fresh_stage0:
        (out / "stage0" / "stage0.json").unlink(missing_ok=True)
    (out / BASELINES_FILE).unlink(missing_ok=True)
    baselines = None
    if cfg.baselines:  # the other core: BC from the base model while stage 0 trains, then RSFT
        with (out / "baselines.log").open("w") as log_file:
            baselines = subprocess.Popen(
                [sys.executable, "-m", "orthojob.learning", *_argv(cfg, baselines_only=True, fresh_stage0=False)],
                stdout=log_file, stderr=subprocess.STDOUT,
            )  # fmt: skip
    checkpoint, meta = stage0(cfg)
    report["stage0"] = meta
    progress = Progress()
    report["evaluations"] = progress.evals

    def save() -> None:
        (out / "learning.json").write_text(json.dumps(report, indent=1, default=float))

    from orthojob import models

    model, tokenizer = models.load_policy(str(checkpoint), lora_r=0, max_seq_length=2048)
    progress.evals.append({"step": 0, **evaluate_model(model, tokenizer, cases, cfg.eval_max_new_tokens)})
    del model
    save()
    report["grpo"] = run_grpo(cfg, checkpoint, cases, progress, save)
    if baselines is not None:
        code = baselines.wait()
        if code == 0 and (out / BASELINES_FILE).is_file():
            report["baselines"] = json.loads((out / BASELINES_FILE).read_text())
        else:
            log.warning("the baselines' process exited %s: see %s", code, out / "baselines.log")
            report["baselines_error"] = f"exit {code}, see baselines.log"
    report["comparison"] = comparison(report)
    caption = f"{SCALED_REWARD}: the scaled terminal reward, the headline metric ({BANDS}).\n\n"
    (out / "comparison.md").write_text(caption + markdown_table(report["comparison"]) + "\n")
    first, last = progress.evals[0][SCALED_REWARD], progress.evals[-1][SCALED_REWARD]
    report["verdict"] = {
        f"{SCALED_REWARD}_stage0": first,
        f"{SCALED_REWARD}_final": last,
        "cis_apart_above": bool(last["lo"] > first["hi"]),
        "strategy_accuracy_final": progress.evals[-1]["strategy_accuracy"],
    }
    report["wall_seconds"] = time.perf_counter() - t0
    save()
    try:
        plot(report, out / "learning.png")
    except Exception as exc:  # the plot never fails the run
        log.warning("no plot: %s", exc)
    return report


def build_parser() -> argparse.ArgumentParser:
    """``python -m orthojob.learning``'s flags, one per :class:`LearnConfig` field (the project's one
    flag generator, :func:`orthojob.flags.add_config_arguments`)."""
    from orthojob.flags import add_config_arguments

    parser = argparse.ArgumentParser(prog="orthojob.learning", description=__doc__.splitlines()[0])
    return add_config_arguments(parser, LearnConfig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    cfg = LearnConfig(**vars(parser.parse_args(argv)))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    if cfg.baselines_only:
        run_baselines(cfg, heldout_cases(cfg.task_id, cfg.eval_seeds))
        return 0
    report = run(cfg)
    v = report["verdict"]
    print(markdown_table(report["comparison"]))
    print(json.dumps({"verdict": v, "seconds_per_step": report["grpo"]["seconds_per_step"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
