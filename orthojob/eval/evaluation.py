"""Held-out evaluation: baselines and checkpoints on unseen seeds.

Baselines (docs/environment.md, "Scoring"):
* ``oracle`` - the rule-based clinical stager (:mod:`server.oracle`), the upper baseline;
* ``uniform_slerp`` - every tooth moves 1/24 of its way per stage from stage 1;
* ``do_nothing`` - every fraction 0.

A checkpoint (:func:`evaluate_checkpoint`, ``orthojob evaluate --checkpoint DIR``) writes one plan
per held-out case by greedy decoding of the same prompt the policy trains on
(:func:`orthojob.core.prompts.build_messages`); each completion is parsed and scored exactly as the GRPO
rewards score it (:func:`orthojob.rewards.rollouts.score_texts`): a completion without a JSON plan is a
failed episode: it scores -2 on the scaled reward (the bottom of its scale) and 0 on the raw terminal
score and on every component. Its row adds the parse rate, the mean format score
(:func:`orthojob.core.parsing.format_checks`), the strategy accuracy (declared strategy == the case's
optimal strategy) and the share of completions cut at ``max_new_tokens``.

Every row leads with the headline metric, the scaled reward (:mod:`orthojob.core.metrics`), and the
hard-rule share; the raw terminal score (``terminal_raw``) follows as a secondary column.

Seeds come from :data:`server.cases.HELDOUT_SEED_START` upwards (the tuning range,
:data:`server.seed_ranges.TUNING`), never used for training; the gates judge their own windows
(:mod:`orthojob.stages.gate`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from orthojob.core.metrics import BANDS, HARD_RULE_SHARE, SCALED_REWARD, TERMINAL_RAW, mean_of
from orthojob.core.parsing import FORMAT_CHECKS
from orthojob.core.prompts import build_messages, prompt_format_of
from orthojob.eval.viewer_logging import log_checkpoint_viewers
from orthojob.modeling.models import load_for_inference
from orthojob.ops.progress import progress
from orthojob.rewards.rollouts import score_texts
from server.cases import HELDOUT_SEED_START, TASK_IDS, CaseKey, generate_case
from server.dental_constants import TOOTH_IDS
from server.dental_environment import initial_observation
from server.oracle import oracle_plan
from server.plans import UNIFORM_FRACTION
from server.staging_engine import ENGINE_VERSION, FALLBACK, UNCHANGED
from server.treatment import score_plans

log = logging.getLogger(__name__)

UNIFORM_SLERP_PLAN: dict = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": UNIFORM_FRACTION}]}
DO_NOTHING_PLAN: dict = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 0.0}]}
BASELINES: dict[str, Callable[[dict], dict]] = {
    "oracle": oracle_plan,
    "uniform_slerp": lambda obs: UNIFORM_SLERP_PLAN,
    "do_nothing": lambda obs: DO_NOTHING_PLAN,
}
SUMMARY_KEYS: tuple[str, ...] = (
    SCALED_REWARD,
    HARD_RULE_SHARE,
    TERMINAL_RAW,
    "accuracy",
    "occlusion_composite",
    "collision_free",
    "pdl_feasibility",
    "limits_compliance",
    "smoothness",
    "staging",
    "strategy_multiplier",
    "movement_prior",
)


def observations(
    task_id: str,
    n_seeds: int,
    seed_start: int = HELDOUT_SEED_START,
    force_decay: bool = False,
    non_compliance: bool = False,
) -> list[dict]:
    """Stage-0 observations of ``n_seeds`` consecutive seeds (what a planner sees;
    :func:`server.dental_environment.initial_observation`)."""
    return [
        initial_observation(generate_case(task_id, seed_start + i, bool(force_decay), bool(non_compliance)))
        for i in range(n_seeds)
    ]


def keys_by_task(
    task_ids: Sequence[str],
    n_seeds: int,
    seed_start: int,
    force_decay: bool,
    non_compliance: bool = False,
    keys: Sequence[CaseKey] | None = None,
) -> dict[str, list[CaseKey]]:
    """The held-out cases of each task: ``n_seeds`` consecutive seeds of each of ``task_ids``, or the
    given ``keys`` (an imported case set's, :func:`orthojob.data.case_sets.register`) grouped by task."""
    if keys is None:
        return {
            t: [CaseKey(t, seed_start + i, bool(force_decay), bool(non_compliance)) for i in range(n_seeds)]
            for t in task_ids
        }
    out: dict[str, list[CaseKey]] = {}
    for key in keys:
        out.setdefault(key.task_id, []).append(key)
    return out


def summarize(results: Sequence[dict]) -> dict[str, dict[str, float]]:
    """Mean and SD over episodes (:data:`SUMMARY_KEYS`) of the scaled reward GRPO sees (the headline),
    the share of plans breaking a hard rule, the raw terminal score (``terminal_raw``; the server's
    results call it ``terminal_reward``) and every summary component."""
    out = {}
    for key in SUMMARY_KEYS:
        if key == HARD_RULE_SHARE:
            values = np.array([float(bool(r["broken_rules"])) for r in results])
        elif key == SCALED_REWARD:
            values = np.array([r["scaled_reward"] for r in results])
        elif key == TERMINAL_RAW:
            values = np.array([r["terminal_reward"] for r in results])
        else:
            values = np.array([r["reward_breakdown"][key] for r in results])
        out[key] = {"mean": float(values.mean()), "sd": float(values.std(ddof=1)) if len(values) > 1 else 0.0}
    return out


def evaluate_planners(
    planners: dict[str, Callable[[dict], dict]],
    task_ids: Sequence[str] = TASK_IDS,
    n_seeds: int = 200,
    seed_start: int = HELDOUT_SEED_START,
    force_decay: bool = False,
    non_compliance: bool = False,
    keys: Sequence[CaseKey] | None = None,
) -> dict:
    """Score each planner on the same held-out cases: ``{task: {planner: summary}}``.
    ``non_compliance`` (task_hard only) scores the plans under the cases' compliance schedules;
    ``keys``: these cases instead of seeds (:func:`keys_by_task`)."""
    report: dict = {}
    for task_id, cases in keys_by_task(
        task_ids, n_seeds, seed_start, force_decay, non_compliance, keys
    ).items():
        obs = [initial_observation(generate_case(*c)) for c in cases]
        report[task_id] = {}
        for name, planner in planners.items():
            results = score_plans([planner(o) for o in obs], cases)
            report[task_id][name] = summarize(results)
            log.info("%s %s: scaled reward %.3f", task_id, name, report[task_id][name][SCALED_REWARD]["mean"])
    return report


def evaluate_baselines(
    task_ids: Sequence[str] = TASK_IDS,
    n_seeds: int = 200,
    seed_start: int = HELDOUT_SEED_START,
    force_decay: bool = False,
    non_compliance: bool = False,
    keys: Sequence[CaseKey] | None = None,
) -> dict:
    """The three baselines on held-out seeds, or on ``keys`` (see module docstring)."""
    return evaluate_planners(BASELINES, task_ids, n_seeds, seed_start, force_decay, non_compliance, keys)


def format_table(
    report: dict,
    n_seeds: int,
    force_decay: bool = False,
    non_compliance: bool = False,
    source: str | None = None,
) -> str:
    """A plain-text table: one row per task and planner, mean ± sd of each summary key; a checkpoint's
    row is followed by its parse rate, format score, strategy accuracy and its scaled-reward margins
    over the baselines."""
    short = {
        SCALED_REWARD: "scaled_reward",
        HARD_RULE_SHARE: "hard_rules",
        TERMINAL_RAW: "terminal_raw",
        "accuracy": "accuracy",
        "occlusion_composite": "occlusion",
        "collision_free": "coll_free",
        "pdl_feasibility": "pdl",
        "limits_compliance": "limits",
        "smoothness": "smooth",
        "staging": "staging",
        "strategy_multiplier": "strat_mult",
        "movement_prior": "prior",
    }
    header = f"{'task':<12}{'planner':<15}" + "".join(f"{short[k]:>14}" for k in SUMMARY_KEYS)
    cases = (
        f"{n_seeds} held-out cases of {source}"
        if source
        else f"{n_seeds} seeds per task from {HELDOUT_SEED_START}"
    )
    lines = [
        f"Held-out evaluation: {cases}, force_decay={force_decay}"
        + (", non_compliance=True" if non_compliance else "")
        + "; mean ± sd; headline: scaled_reward ("
        + BANDS
        + "), hard_rules: share breaking a hard rule; terminal_raw: the unscaled [0, 1] score, for reference",
        header,
        "-" * len(header),
    ]
    for task_id, planners in report.items():
        for name, summary in planners.items():
            cells = "".join(f"{summary[k]['mean']:>8.3f}±{summary[k]['sd']:<5.3f}" for k in SUMMARY_KEYS)
            lines.append(f"{task_id:<12}{name:<15}{cells}")
        if {"oracle", "uniform_slerp"} <= planners.keys():
            margin = (
                planners["oracle"][SCALED_REWARD]["mean"] - planners["uniform_slerp"][SCALED_REWARD]["mean"]
            )
            lines.append(f"{'':<12}oracle margin over uniform SLERP: {margin:+.3f} scaled_reward")
        for name, summary in planners.items():
            model = summary.get("model_metrics")
            if not model:
                continue
            extra = (
                f"{'':<12}{name}: parse_rate {model['parse_rate']:.3f}  format {model['format_reward']:.3f}  "
                f"strategy_accuracy {model['strategy_accuracy']:.3f}  truncated {model['truncated_rate']:.3f}  "
                f"tokens {model['mean_completion_tokens']:.0f}"
            )
            for base in ("uniform_slerp", "oracle"):
                if base in planners:
                    diff = summary[SCALED_REWARD]["mean"] - planners[base][SCALED_REWARD]["mean"]
                    extra += f"  scaled_reward vs {base} {diff:+.3f}"
            lines.append(extra)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


@dataclass
class CheckpointEpisodes:
    """A checkpoint's greedy plans for held-out cases, one entry per case, and their scores
    (``observations``: the cases' reset observations the prompts were built from)."""

    task_ids: list[str]
    seeds: list[int]
    force_decay: bool
    texts: list[str]
    n_tokens: list[int]
    terminated: list[bool]
    rollouts: list = field(default_factory=list)
    optimal_strategies: list[str] = field(default_factory=list)
    generate_seconds: float = 0.0
    observations: list[dict] = field(default_factory=list)
    engine: str | None = None
    """The staging engine's version where the plans went through it (each rollout then carries its
    ``repair`` record and its ``shipped`` plan), None where the raw plans were judged."""

    def shipped(self, i: int):
        """Episode ``i``'s judged rollout: the executed plan's with the engine, else the raw plan's."""
        return self.rollouts[i].shipped if self.engine else self.rollouts[i]

    def select(self, task_id: str) -> list[int]:
        return [i for i, t in enumerate(self.task_ids) if t == task_id]


def generate_completions(
    model,
    tokenizer,
    observations: Sequence[dict],
    max_new_tokens: int = 256,
    batch_size: int = 16,
    samples: int = 0,
    temperature: float = 1.0,
) -> tuple[list[str], list[int], list[bool]]:
    """Greedy completions for the observations' prompts, in batches (left padding); with ``samples``
    k >= 1, k sampled completions per prompt at ``temperature`` instead (prompt-major: the first
    prompt's k, then the next prompt's; seed torch for reproducible samples).

    Returns (texts, completion token counts, whether each ended with an end-of-turn token before
    ``max_new_tokens``). Texts are decoded without special tokens, as TRL gives them to the rewards.
    """
    import torch

    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    texts: list[str] = []
    counts: list[int] = []
    ended: list[bool] = []
    prompt_format = prompt_format_of(model)  # the policy's own format (its config.json)
    prompts = [
        tokenizer.apply_chat_template(
            build_messages(o, prompt_format), add_generation_prompt=True, tokenize=False
        )
        for o in observations
    ]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    bar = progress(len(prompts), "generate", unit="prompt")
    try:
        for lo in range(0, len(prompts), batch_size):
            batch = tokenizer(
                prompts[lo : lo + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(device)
            with torch.inference_mode():
                sampling = (
                    {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0,
                     "num_return_sequences": samples}
                    if samples
                    else {"do_sample": False}
                )  # fmt: skip
                out = model.generate(
                    **batch,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=sorted(eos_ids),
                    pad_token_id=pad_id,
                    **sampling,
                )
            for seq in out[:, batch["input_ids"].shape[1] :].tolist():
                n = len(seq)
                stop = next((k for k, t in enumerate(seq) if t in eos_ids), None)
                if stop is not None:
                    n = stop + 1
                counts.append(n)
                ended.append(stop is not None)
                texts.append(tokenizer.decode(seq[:n], skip_special_tokens=True))
            bar.update(len(batch["input_ids"]))
    finally:
        bar.close()
        tokenizer.padding_side = side
    return texts, counts, ended


Policy = Callable[[Sequence[dict]], Sequence[str]]
"""A scripted policy: the completion text for each observation (a planner that is not a model, e.g.
a rule-based planner or a test's rule-breaking one), evaluated exactly as a model's completions are."""


def run_checkpoint(
    model,
    tokenizer,
    task_ids: Sequence[str],
    n_seeds: int,
    seed_start: int = HELDOUT_SEED_START,
    force_decay: bool = False,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    policy: Policy | None = None,
    keys: Sequence[CaseKey] | None = None,
    engine: bool = True,
) -> CheckpointEpisodes:
    """Generate and score a model's plans for ``n_seeds`` held-out cases of each task (or for
    ``keys``); with ``policy``, its completions instead of the model's (no tokens counted, none
    truncated). ``engine``: execute each plan through the staging engine (what ships is the planner
    with the engine: :mod:`server.staging_engine`); False judges the raw plans."""

    cases = [
        c
        for group in keys_by_task(task_ids, n_seeds, seed_start, force_decay, False, keys).values()
        for c in group
    ]
    obs = [initial_observation(generate_case(*c)) for c in cases]
    t0 = time.perf_counter()
    if policy is not None:
        texts = [str(t) for t in policy(obs)]
        if len(texts) != len(obs):
            raise ValueError(f"the policy gave {len(texts)} completions for {len(obs)} observations")
        counts, ended = [0] * len(texts), [True] * len(texts)
    else:
        texts, counts, ended = generate_completions(model, tokenizer, obs, max_new_tokens, batch_size)
    seconds = time.perf_counter() - t0
    return CheckpointEpisodes(
        task_ids=[c.task_id for c in cases],
        seeds=[c.seed for c in cases],
        force_decay=bool(force_decay),
        texts=texts,
        n_tokens=counts,
        terminated=ended,
        rollouts=score_texts(texts, cases, engine=engine),
        optimal_strategies=[generate_case(*c).optimal_strategy for c in cases],
        generate_seconds=seconds,
        observations=obs,
        engine=ENGINE_VERSION if engine else None,
    )


def episode_metrics(ep: CheckpointEpisodes, index: Sequence[int] | None = None) -> dict:
    """Parse rate, format score (mean and per check), the headline ``scaled_reward_mean`` / ``_sd``,
    ``hard_rule_share``, strategy accuracy, lengths, and the secondary ``terminal_raw_mean``.

    The headline, the hard-rule share and the raw terminal score judge the plans that ship: with the
    engine (``ep.engine``) the executed plans, beside the raw plans' figures (:func:`engine_metrics`)."""

    idx = list(range(len(ep.texts))) if index is None else list(index)
    if not idx:
        raise ValueError("no episodes to summarise")
    rolls = [ep.rollouts[i] for i in idx]
    judged = [ep.shipped(i) for i in idx]
    scaled = np.array([r.scaled_reward for r in judged], dtype=float)
    return {
        "n": len(idx),
        "parse_rate": float(np.mean([r.plan is not None for r in rolls])),
        "format_reward": float(np.mean([r.format["total"] for r in rolls])),
        "format_checks": {k: float(np.mean([r.format[k] for r in rolls])) for k in FORMAT_CHECKS},
        mean_of(SCALED_REWARD): float(scaled.mean()),
        f"{SCALED_REWARD}_sd": float(scaled.std(ddof=1)) if len(idx) > 1 else 0.0,
        HARD_RULE_SHARE: float(np.mean([bool(r.broken_rules) for r in judged])),
        mean_of(TERMINAL_RAW): float(np.mean([r.terminal_reward for r in judged])),
        "strategy_accuracy": float(
            np.mean([rolls[k].strategy == ep.optimal_strategies[i] for k, i in enumerate(idx)])
        ),
        "mean_completion_tokens": float(np.mean([ep.n_tokens[i] for i in idx])),
        "truncated_rate": float(np.mean([not ep.terminated[i] for i in idx])),
        **engine_metrics(rolls, ep.engine),
    }


def engine_metrics(rollouts: Sequence, engine: str | None) -> dict:
    """The raw plans beside the executed ones (:mod:`server.staging_engine`), over ``rollouts``:

    * ``engine``: the engine's version, or ``off`` (the raw plans were judged);
    * ``raw_scaled_reward_mean``, ``raw_hard_rule_share``: the planner's plans as written;
    * ``repair_share``: the share of the cases whose plan the engine changed (repaired, or replaced by
      its fallback; 0 with the engine off), ``fallback_share`` the share it replaced;
    * ``repaired_movement_share``: the mean share of a plan's planned movement on the teeth the engine
      changed (0 for a plan it left alone, or a completion that is not a plan): how much was repaired.
    """
    records = [r.repair for r in rollouts]
    changed = [rec is not None and rec["status"] != UNCHANGED for rec in records]
    return {
        "engine": engine or "off",
        f"raw_{mean_of(SCALED_REWARD)}": float(np.mean([r.scaled_reward for r in rollouts])),
        f"raw_{HARD_RULE_SHARE}": float(np.mean([bool(r.broken_rules) for r in rollouts])),
        "repair_share": float(np.mean(changed)),
        "fallback_share": float(np.mean([rec is not None and rec["status"] == FALLBACK for rec in records])),
        "repaired_movement_share": float(
            np.mean([rec["changed_share"] if c else 0.0 for rec, c in zip(records, changed)])
        ),
    }


def episode_summary(ep: CheckpointEpisodes, index: Sequence[int]) -> dict[str, dict[str, float]]:
    """:func:`summarize` of a checkpoint's episodes; a failed episode scores 0 on every component."""
    results = [
        {
            "terminal_reward": r.terminal_reward,
            "scaled_reward": r.scaled_reward,
            "broken_rules": r.broken_rules,
            "reward_breakdown": {k: r.reward_breakdown.get(k, 0.0) for k in SUMMARY_KEYS},
        }
        for r in (ep.shipped(i) for i in index)
    ]
    return summarize(results)


def evaluate_checkpoint(
    path: str,
    task_ids: Sequence[str] = TASK_IDS,
    n_seeds: int = 200,
    seed_start: int = HELDOUT_SEED_START,
    force_decay: bool = False,
    baselines: bool = True,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    name: str = "checkpoint",
    policy: Policy | None = None,
    keys: Sequence[CaseKey] | None = None,
    engine: bool = True,
) -> dict:
    """A checkpoint (and, with ``baselines``, the three baselines) on the same held-out cases;
    ``policy``: a scripted policy's completions instead of the checkpoint's (``path`` is not loaded).
    ``engine``: the checkpoint's row judges the plans the staging engine executes, and its
    ``model_metrics`` hold the raw plans' figures beside them (:func:`engine_metrics`); False judges
    the raw plans.

    Returns ``{task: {planner: summary}}`` like :func:`evaluate_baselines`; the checkpoint's summary
    also holds ``model_metrics`` (:func:`episode_metrics`).
    """

    model = tokenizer = None
    if policy is None:
        model, tokenizer = load_for_inference(path)
    ep = run_checkpoint(
        model,
        tokenizer,
        task_ids,
        n_seeds,
        seed_start,
        force_decay,
        max_new_tokens,
        batch_size,
        policy,
        keys,
        engine=engine,
    )
    log_checkpoint_viewers(ep, name)  # viewers of a few cases, when an MLflow run is active
    report = evaluate_baselines(task_ids, n_seeds, seed_start, force_decay, keys=keys) if baselines else {}
    for task_id in dict.fromkeys(ep.task_ids):
        index = ep.select(task_id)
        summary = episode_summary(ep, index) | {"model_metrics": episode_metrics(ep, index)}
        report[task_id] = {name: summary, **report.get(task_id, {})}
    return report
