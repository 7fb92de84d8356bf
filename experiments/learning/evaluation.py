"""Held-out evaluation for the learning experiment: the cells' cases, each planner's episodes, their means and 95 % intervals, and the strategy read-out."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from experiments.learning.report import (
    cell_name,
    mean_ci,
)
from orthojob.core.metrics import SCALED_REWARD
from orthojob.core.parsing import read_plan_text
from orthojob.core.prompts import CELLS, build_messages, prompt_format_of, reset_observation
from orthojob.eval.evaluation import DO_NOTHING_PLAN, UNIFORM_SLERP_PLAN, engine_metrics, generate_completions
from orthojob.rewards.canaries import METRICS, episode_record, rollout_record
from orthojob.rewards.rollouts import is_plan, score_texts
from orthojob.rewards.strategy_advantage import STRATEGY_KEY
from server.cases import CaseKey, generate_case
from server.clinical_profiles import STRATEGIES
from server.oracle import plan_for_case
from server.reward_scaler import REWARD_MIN
from server.scoring import STRATEGY_MULTIPLIERS
from server.seed_ranges import FINAL, TUNING
from server.staging_engine import ENGINE_VERSION
from server.treatment import score_plans

WAYS: tuple[str, ...] = ("as_written", "no_strategy", "optimal_named")
"""The three ways :func:`strategy_counterfactuals` scores a plan."""
CLASS_OF_MULTIPLIER: dict[float, str] = {v: k for k, v in STRATEGY_MULTIPLIERS.items()}
ENGINE_METRICS: tuple[str, ...] = (
    "raw_scaled_reward_mean",
    "raw_hard_rule_share",
    "repair_share",
    "fallback_share",
    "repaired_movement_share",
)
"""The raw plans' figures beside the executed ones, per episode (:func:`orthojob.eval.evaluation.engine_metrics`
of one rollout: the plan's scaled reward and hard-rule break as written, whether the staging engine
changed it, replaced it by its fallback, and the share of its planned movement on the teeth it changed),
summarised as :data:`METRICS` are. None for a reference planner, whose plans are scored as they are."""


def strategy_counterfactuals(plans: Sequence[dict | None], keys: Sequence[CaseKey]) -> list[dict]:
    """Per case, the plan's scaled reward as written, without its strategy and with the case's
    optimal strategy named (1.2 only where its movement follows that strategy's sequence), and the
    multiplier class (optimal / neutral / wrong) it earned as written. A completion that is not a plan
    (None, or no usable group) scores ``REWARD_MIN`` every way, class None, as the rewards score it."""

    plans = [p if is_plan(p) else None for p in plans]
    cases = [generate_case(*k) for k in keys]
    parsed = [p if isinstance(p, dict) else {} for p in plans]
    scored = {
        "as_written": score_plans(parsed, keys),
        "no_strategy": score_plans([{k: v for k, v in p.items() if k != "strategy"} for p in parsed], keys),
        "optimal_named": score_plans(
            [{**p, "strategy": c.optimal_strategy} for p, c in zip(parsed, cases)], keys
        ),
    }
    out = []
    for i, plan in enumerate(plans):
        if plan is None:
            out.append({**dict.fromkeys(WAYS, REWARD_MIN), "class": None})
            continue
        mult = float(scored["as_written"][i]["reward_breakdown"]["strategy_multiplier"])
        out.append(
            {**{w: float(scored[w][i]["scaled_reward"]) for w in WAYS}, "class": CLASS_OF_MULTIPLIER[mult]}
        )
    return out


def summarise(episodes: Sequence[dict[str, float]], strata: Sequence[str] | None = None) -> dict[str, dict]:
    """Each metric of :data:`METRICS` and :data:`ENGINE_METRICS`: mean and 95 % CI over the episodes
    (stratified by ``strata``, one label per episode, where given: :func:`experiments.learning.report.mean_ci`;
    an engine metric an episode lacks counts as missing)."""
    return {
        **{m: mean_ci([e[m] for e in episodes], strata) for m in METRICS},
        **{m: mean_ci([e.get(m) for e in episodes], strata) for m in ENGINE_METRICS},
    }


CHECKS: tuple[str, ...] = ("as_written", "checked", "no_overcorrection", "first_safe_sample")
"""The ways :func:`safety_counterfactuals` scores a planner's plan for a case."""


def _without_overcorrection(plan: dict) -> dict:
    groups = [
        {k: v for k, v in g.items() if k != "overcorrection"} if isinstance(g, dict) else g
        for g in plan.get("tooth_groups") or []
    ]
    return {**plan, "tooth_groups": groups}


def safety_counterfactuals(
    plans: Sequence[dict | None],
    keys: Sequence[CaseKey],
    samples: Sequence[Sequence[dict | None]] | None = None,
) -> list[dict]:
    """How much of a planner's score its hard-rule breaks cost, per case (scaled reward each way):

    * ``as_written``: the plan;
    * ``checked``: the plan checked once on the simulator and replaced by uniform SLERP where it breaks
      a hard rule (what one call of the environment's check and a fixed fallback would give);
    * ``no_overcorrection``: the plan with every group's overcorrection removed;
    * ``first_safe_sample``: the first of the case's ``samples`` (the policy's sampled plans) that breaks
      no rule, else uniform SLERP (None when no samples are given).

    Each row also has ``broken`` (the rules the plan as written breaks: ``server.treatment``'s
    ``broken_rules``). A completion that is not a plan scores ``REWARD_MIN`` as written and with its
    overcorrection removed, as the rewards score it, and counts as broken (``["not_a_plan"]``)."""
    plans = [p if is_plan(p) else None for p in plans]
    parsed = [p if p is not None else {} for p in plans]
    written = score_plans(parsed, keys)
    bare = score_plans([_without_overcorrection(p) for p in parsed], keys)
    slerp = score_plans([UNIFORM_SLERP_PLAN] * len(keys), keys)
    first_safe: list[float | None] = [None] * len(keys)
    if samples is not None:
        flat = [(i, p) for i, ps in enumerate(samples) for p in ps if is_plan(p)]
        scored = score_plans([p for _, p in flat], [keys[i] for i, _ in flat])
        for (i, _), r in zip(flat, scored):
            if first_safe[i] is None and not r["broken_rules"]:
                first_safe[i] = float(r["scaled_reward"])
        first_safe = [
            v if v is not None else float(slerp[i]["scaled_reward"]) for i, v in enumerate(first_safe)
        ]
    out = []
    for i, plan in enumerate(plans):
        broken = list(written[i]["broken_rules"]) if plan is not None else ["not_a_plan"]
        as_written = float(written[i]["scaled_reward"]) if plan is not None else REWARD_MIN
        out.append(
            {
                "as_written": as_written,
                "checked": float(slerp[i]["scaled_reward"]) if broken else as_written,
                "no_overcorrection": float(bare[i]["scaled_reward"]) if plan is not None else REWARD_MIN,
                "first_safe_sample": first_safe[i],
                "broken": broken,
            }
        )
    return out


def sampled_plans(
    model, tokenizer, cases: Sequence[CaseKey], max_new_tokens: int, k: int, temperature: float
) -> list[list[dict | None]]:
    """``k`` sampled plans per case at ``temperature`` (None where a completion has no plan the rewards
    would count); seed torch beforehand for reproducible samples."""
    obs = [reset_observation(c.seed, c.task_id, c.force_decay) for c in cases]
    texts = generate_completions(
        model, tokenizer, obs, max_new_tokens, batch_size=16, samples=k, temperature=temperature
    )[0]
    plans = [read_plan_text(t).plan for t in texts]
    return [plans[i * k : (i + 1) * k] for i in range(len(cases))]


def uniform_strategy_signal(keys: Sequence[CaseKey]) -> dict[str, dict]:
    """What naming each strategy earns on uniform staging (the staging GRPO from the format stage
    converges to): per strategy, each case's multiplier class (optimal / neutral / wrong) and scaled
    reward; and ``"case_aware_best"``, each case's best over the five (a perfect read-out of the case's
    strategy on uniform staging). Uniform SLERP itself names none (the neutral multiplier)."""
    out: dict[str, dict] = {}
    for s in STRATEGIES:
        r = score_plans([{**UNIFORM_SLERP_PLAN, "strategy": s}] * len(keys), keys)
        out[s] = {
            "class": [CLASS_OF_MULTIPLIER[float(x["reward_breakdown"]["strategy_multiplier"])] for x in r],
            "scaled": [float(x["scaled_reward"]) for x in r],
        }
    out["case_aware_best"] = {"scaled": np.max([out[s]["scaled"] for s in STRATEGIES], axis=0).tolist()}
    return out


def heldout_cases(n: int, cells: Sequence[tuple[str, bool]] = CELLS) -> list[CaseKey]:
    """``n`` held-out seeds of each cell, cell by cell, from the tuning range
    (:data:`server.seed_ranges.TUNING`: the experiment's curves, on which its defaults were chosen)."""
    return [CaseKey(t, TUNING.start + i, fd) for t, fd in cells for i in range(n)]


def final_cases(n: int, cells: Sequence[tuple[str, bool]] = CELLS) -> list[CaseKey]:
    """``n`` seeds of each cell, cell by cell, from the final range (:data:`server.seed_ranges.FINAL`):
    the cases of the experiment's final table, on which no default was chosen."""
    if not FINAL.holds(FINAL.start, n):
        raise ValueError(f"the final range holds {FINAL.size} seeds a cell, asked for {n}")
    return [CaseKey(t, FINAL.start + i, fd) for t, fd in cells for i in range(n)]


def grouped(cases: Sequence[CaseKey], episodes: Sequence[dict]) -> dict:
    """Episodes (:func:`orthojob.rewards.canaries.episode_record` dicts, one per case) summarised per cell,
    per task level (both dynamics) and pooled over every case, the level and pooled intervals stratified
    by cell (:func:`experiments.learning.report.mean_ci`): ``{"cells": {cell: summary},
    "levels": {level: summary}, "pooled": summary, "degenerate_forms": {cell: {form: count}},
    "per_case": {cell: [scaled reward of each case, in the cases' order]}, "seeds": {cell: [its seeds, in
    that order]}}`` (the per-case scores let two planners be compared on the same cases:
    :func:`experiments.learning.report.paired_differences`)."""
    by_cell: dict[str, list] = {}
    by_level: dict[str, list] = {}
    level_cells: dict[str, list] = {}
    forms: dict[str, Counter] = {}
    for c, e in zip(cases, episodes):
        by_cell.setdefault(cell_name(c), []).append(e)
        by_level.setdefault(c.task_id, []).append(e)
        level_cells.setdefault(c.task_id, []).append(cell_name(c))
        if e.get("degenerate_form"):
            forms.setdefault(cell_name(c), Counter())[e["degenerate_form"]] += 1
    return {
        "cells": {k: summarise(v) for k, v in by_cell.items()},
        "levels": {k: summarise(v, level_cells[k]) for k, v in by_level.items()},
        "pooled": summarise(episodes, [cell_name(c) for c in cases]),
        "degenerate_forms": {k: dict(v) for k, v in forms.items()},
        "per_case": {k: [round(float(e[SCALED_REWARD]), 4) for e in v] for k, v in by_cell.items()},
        "seeds": {k: [c.seed for c in cases if cell_name(c) == k] for k in by_cell},
    }


def reference_rows(cases: Sequence[CaseKey]) -> dict[str, dict]:
    """The oracle, uniform SLERP and doing nothing on the held-out cases (:func:`grouped`), their plans
    scored as they are, without the staging engine (plans written to full precision by the project's own
    code, not text a model wrote): the raw figures are the same as the scored ones, the repair figures
    missing."""

    resolved = [generate_case(*c) for c in cases]
    planners: dict[str, Callable] = {
        "oracle": plan_for_case,
        "uniform_slerp": lambda c: UNIFORM_SLERP_PLAN,
        "do_nothing": lambda c: DO_NOTHING_PLAN,
    }
    rows = {}
    for name, planner in planners.items():
        plans = [planner(c) for c in resolved]
        results = score_plans(plans, list(cases))
        episodes = [
            episode_record({**r, "plan": p}, c, c.optimal_strategy)
            for r, p, c in zip(results, plans, resolved)
        ]
        for e in episodes:
            e |= {"raw_scaled_reward_mean": e[SCALED_REWARD], "raw_hard_rule_share": e["hard_rule"]}
        rows[name] = grouped(cases, episodes)
    return rows


def strategy_distribution(model, tokenizer, cases: Sequence[CaseKey], texts: Sequence[str]) -> np.ndarray:
    """(n_cases, 5) the policy's probabilities of each strategy (:data:`server.clinical_profiles.STRATEGIES`
    order) where its own greedy plan (``texts``) names one: the next-token probabilities of each
    strategy's first token after the plan's text up to ``"strategy": "``, renormalised over the five
    (one forward pass per case; NaN where the plan names none)."""
    import torch

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

    named = ~np.isnan(probs).any(axis=1)
    probs = probs[named]
    index = [STRATEGIES.index(o) for o, n in zip(optimal, named) if n]
    if not index:
        return {"p_optimal": mean_ci([]), "case_dependence": mean_ci([]), "by_optimal": {}}
    mean = probs.mean(axis=0)
    return {
        "p_optimal": mean_ci(probs[np.arange(len(index)), index].tolist()),
        "case_dependence": mean_ci((0.5 * np.abs(probs - mean).sum(axis=1)).tolist()),
        "by_optimal": {
            s: np.round(probs[[k for k, i in enumerate(index) if i == j]].mean(axis=0), 4).tolist()
            for j, s in enumerate(STRATEGIES)
            if j in index
        },
    }


def greedy_texts(model, tokenizer, cases: Sequence[CaseKey], max_new_tokens: int) -> tuple:
    """``model``'s greedy completions for the cases' prompts: (texts, token counts, ended with EOS)."""
    obs = [reset_observation(c.seed, c.task_id, c.force_decay) for c in cases]
    return generate_completions(model, tokenizer, obs, max_new_tokens, batch_size=16)


def greedy_plans(model, tokenizer, cases: Sequence[CaseKey], max_new_tokens: int) -> list[dict | None]:
    """The plan in each greedy completion, None where there is none the rewards would count
    (:func:`orthojob.core.parsing.read_plan_text`)."""
    texts = greedy_texts(model, tokenizer, cases, max_new_tokens)[0]
    return [read_plan_text(t).plan for t in texts]


def evaluate_model(model, tokenizer, cases: Sequence[CaseKey], max_new_tokens: int) -> dict:
    """Greedy plans of ``model`` for the held-out cases, each executed by the staging engine
    (:func:`orthojob.rewards.rollouts.score_texts` with ``engine``): :func:`grouped` summaries of the
    executed plans (what ships: :attr:`orthojob.rewards.rollouts.Rollout.shipped`) with the raw plans'
    figures beside them (:data:`ENGINE_METRICS`), the engine's version, the strategy probe (pooled),
    tokens, truncation and timing."""

    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    texts, counts, ended = greedy_texts(model, tokenizer, cases, max_new_tokens)
    probs = strategy_distribution(model, tokenizer, cases, texts)
    if was_training:
        model.train()
    rolls = score_texts(texts, list(cases), engine=True)
    resolved = [generate_case(*c) for c in cases]
    episodes = [
        {**rollout_record(r.shipped, c), **engine_metrics([r], ENGINE_VERSION)}
        for r, c in zip(rolls, resolved)
    ]
    summary = grouped(cases, episodes)
    summary["engine_version"] = ENGINE_VERSION
    summary["strategies"] = dict(sorted(Counter(str(r.shipped.strategy) for r in rolls).items()))
    summary["strategy_conditioning"] = strategy_conditioning(probs, [c.optimal_strategy for c in resolved])
    summary["mean_tokens"] = float(np.mean(counts))
    summary["truncated"] = float(np.mean([not e for e in ended]))
    summary["eval_seconds"] = time.perf_counter() - t0
    summary["examples"] = {cell_name(c): t for c, t in reversed(list(zip(cases, texts)))}
    return summary
