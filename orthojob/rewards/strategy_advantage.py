"""The advantage of a plan's strategy choice, apart from the advantage of its staging.

TRL gives every token of a completion the same advantage: ``(reward - group mean) / std``, each
group one case. Summed over a batch of cases, the gradient on the tokens that name the strategy
then has two parts: a *marginal* one (a strategy that scores above its group on most cases is
pushed up for every case) and a *conditional* one (which strategy wins on which case). The
marginal part is the larger while the policy is case-blind -- stage 0's format demonstrations
carry random strategies, so it is -- and GRPO spends its samples collapsing one strategy
distribution shared by every case (experiments/learning/NOTEBOOK.md, runs B-H: ``anterior_first``
for all 48 held-out cases, ``case dependence`` flat).

``centred`` removes the marginal part from the strategy tokens only. Each strategy-naming
completion's strategy tokens get its advantage less its strategy's mean advantage over the batch.
Within each strategy the differences are unchanged, so on the strategy tokens the batch's
gradient is the conditional part alone: a strategy gains on the cases where it beats the
strategies named for other cases. Every other token keeps TRL's advantage, so the
staging learns exactly as before. The same idea as a per-action baseline (a state-independent
baseline per arm); it is biased for the marginal by design.

Pure numpy on already-decoded text; :class:`orthojob.stages.grpo_trainer.RecordingGRPOTrainer` applies it
to the token-level advantages TRL accepts with shape ``(B, T)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np

from orthojob.core.parsing import extract_plan
from server.clinical_profiles import STRATEGIES

STRATEGY_ADVANTAGES: tuple[str, ...] = ("sequence", "centred", "counterfactual")
"""``sequence``: TRL's, one advantage per completion. ``centred``: the strategy tokens' advantage
less their strategy's batch mean (:func:`centred_strategy_advantages`). ``counterfactual``: the
strategy tokens' advantage is the reward of the plan as written less the mean reward of the same
plan under each of the five strategies (:func:`counterfactual_strategy_advantages`), then centred
the same way."""

STRATEGY_KEY = '"strategy": "'
"""What a plan writes before its strategy's name (the canonical JSON of
:func:`orthojob.core.prompts.plan_to_completion`)."""

_STRATEGY_VALUE = re.compile(r'"strategy"\s*:\s*"([A-Za-z_]+)"')


INVALID = "(invalid)"
"""The arm of a plan that declares a strategy outside :data:`STRATEGIES` (``"strategy": "medium"``):
centred with the five, so writing a non-strategy is no way around their centring."""


def strategy_spans(text: str) -> tuple[str | None, list[tuple[int, int]]]:
    """The strategy arm of the plan in ``text`` -- its strategy if one of :data:`STRATEGIES`,
    :data:`INVALID` for any other string, None where it declares no string -- and the character
    spans ``[start, end)`` of the declared value wherever ``"strategy": "<value>"`` writes it."""
    plan = extract_plan(text)
    declared = plan.get("strategy") if isinstance(plan, dict) else None
    if not isinstance(declared, str):
        return None, []
    spans = [m.span(1) for m in _STRATEGY_VALUE.finditer(text) if m.group(1) == declared]
    if not spans:
        return None, []
    return (declared if declared in STRATEGIES else INVALID), spans


def centred_strategy_advantages(advantages: np.ndarray, strategies: Sequence[str | None]) -> np.ndarray:
    """``advantages`` (B,) less each named strategy's mean over the batch; completions naming none
    (None) keep theirs. Returns (B,) float.

    Over the completions naming any one strategy the result sums to 0: no strategy gains or loses
    on every case at once, not even by the chance of being sampled more often in this batch
    (adding back a shared mean would make each strategy's push proportional to its sample count,
    a random walk of the marginal). Differences within a strategy are kept.
    """
    a = np.asarray(advantages, dtype=float)
    if a.ndim != 1 or len(a) != len(strategies):
        raise ValueError(f"advantages {a.shape} and {len(strategies)} strategies do not match")
    names = np.array([s if s is not None else "" for s in strategies], dtype=object)
    out = a.copy()
    for s in np.unique(names[names != ""]):
        rows = names == s
        out[rows] = a[rows] - a[rows].mean()
    return out


def with_strategy(text: str, spans: Sequence[tuple[int, int]], strategy: str) -> str:
    """``text`` with each span of :func:`strategy_spans` replaced by ``strategy``."""
    out, end = [], 0
    for a, b in sorted(spans):
        out += [text[end:a], strategy]
        end = b
    return "".join(out) + text[end:]


def counterfactual_strategy_advantages(q: np.ndarray, chosen: Sequence[str | None]) -> np.ndarray:
    """The counterfactual advantage of each completion's strategy (COMA's baseline, Foerster et al.
    2018, with a uniform weighting). ``q`` (B, 6): columns 0-4 the summed, weighted reward of
    completion i's plan with its strategy replaced by ``STRATEGIES[k]``, column 5 of the plan as
    written. The result (B,) is ``q[i, 5] - mean_k q[i, :5]``, divided by the std of ``q[:, 5]``
    over the batch (as TRL's ``scale_rewards=batch``); NaN where ``chosen`` (the arms of
    :func:`strategy_spans`) is None.

    The baseline holds everything but the strategy fixed, so the plan's own quality cancels, and it
    does not depend on the sampled strategy, so the policy gradient stays unbiased.
    """
    q = np.asarray(q, dtype=float)
    if q.shape != (len(chosen), len(STRATEGIES) + 1):
        raise ValueError(f"q {q.shape} must be ({len(chosen)}, {len(STRATEGIES) + 1})")
    out = np.full(len(chosen), np.nan)
    rows = [i for i, s in enumerate(chosen) if s is not None]
    if not rows:
        return out
    mine = q[rows, -1]
    scale = float(np.nanstd(mine)) if len(rows) > 1 else 0.0
    out[rows] = (mine - np.nanmean(q[rows, :-1], axis=1)) / (scale + 1e-4)
    return out


def strategy_token_ids(tokenizer) -> list[int]:
    """The token ids that spell the five strategy names after :data:`STRATEGY_KEY` (sorted): the
    rows of the output layer that read out the diagnosis."""
    head = tokenizer(STRATEGY_KEY, add_special_tokens=False)["input_ids"]
    ids: set[int] = set()
    for s in STRATEGIES:
        full = tokenizer(STRATEGY_KEY + s, add_special_tokens=False)["input_ids"]
        ids.update(
            full[len(head) :]
            if full[: len(head)] == head
            else tokenizer(s, add_special_tokens=False)["input_ids"]
        )
    return sorted(ids)


def token_spans_mask(pieces: Sequence[str], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """(T,) bool: which of the tokens whose decoded ``pieces`` concatenate to the text overlap a
    character span of :func:`strategy_spans`."""
    ends = np.cumsum([len(p) for p in pieces])
    starts = ends - np.array([len(p) for p in pieces], dtype=int)
    mask = np.zeros(len(pieces), dtype=bool)
    for a, b in spans:
        mask |= (starts < b) & (ends > a)
    return mask


def strategy_token_advantages(
    advantages: np.ndarray,
    pieces: Sequence[Sequence[str]],
    scale: float = 1.0,
    kind: str = "centred",
    score: Callable[[list[str], list[int]], np.ndarray] | None = None,
) -> tuple[np.ndarray, dict[str, float]]:
    """Token-level advantages (B, T): every token keeps its completion's advantage except those
    naming the strategy, which get ``kind``'s strategy advantage x ``scale``:
    :func:`centred_strategy_advantages` or :func:`counterfactual_strategy_advantages`.

    ``advantages`` (B,): TRL's; ``pieces``: per completion, the decoded text of each of its T
    (padded) completion tokens, padding as ''. ``score(texts, rows) -> (len(texts),)`` (for
    ``counterfactual``): the summed, weighted reward of each text, a plan of completion ``rows[j]``'s
    case. Also returns diagnostics: ``named`` (share of completions with strategy tokens),
    ``invalid`` (share declaring a non-strategy) and
    ``marginal`` (centred: mean |removed marginal|) or ``gap`` (counterfactual: mean of the best
    strategy's reward less the mean strategy's, per plan).
    """
    if kind not in STRATEGY_ADVANTAGES[1:]:
        raise ValueError(f"kind must be one of {', '.join(STRATEGY_ADVANTAGES[1:])}, got {kind!r}")
    a = np.asarray(advantages, dtype=float)
    width = max((len(p) for p in pieces), default=0)
    out = np.repeat(a[:, None], width, axis=1)
    texts = ["".join(p) for p in pieces]
    found = [strategy_spans(t) for t in texts]
    strategies = [s for s, _ in found]
    named = np.array([s is not None for s in strategies], dtype=bool)
    diagnostics = {
        "named": float(named.mean()) if len(named) else 0.0,
        "invalid": float(np.mean([s == INVALID for s in strategies])) if strategies else 0.0,
    }
    if kind == "centred":
        strategy_adv = centred_strategy_advantages(a, strategies)
        diagnostics["marginal"] = float(np.abs(a - strategy_adv)[named].mean()) if named.any() else 0.0
    else:
        if score is None:
            raise ValueError("counterfactual strategy advantages need score(texts, rows)")
        rows = [i for i in range(len(texts)) if named[i]]
        q = np.full((len(texts), len(STRATEGIES) + 1), np.nan)
        if rows:
            variants = [
                v
                for i in rows
                for v in (*(with_strategy(texts[i], found[i][1], s) for s in STRATEGIES), texts[i])
            ]
            owners = [i for i in rows for _ in range(len(STRATEGIES) + 1)]
            q[rows] = np.asarray(score(variants, owners), dtype=float).reshape(len(rows), len(STRATEGIES) + 1)
        strategy_adv = centred_strategy_advantages(
            counterfactual_strategy_advantages(q, strategies), strategies
        )
        diagnostics["gap"] = (
            float(np.nanmean(np.nanmax(q[rows, :-1], 1) - np.nanmean(q[rows, :-1], 1))) if rows else 0.0
        )
    for row, (p, (strategy, spans)) in enumerate(zip(pieces, found)):
        if strategy is not None and np.isfinite(strategy_adv[row]):
            mask = token_spans_mask(p, spans)
            out[row, : len(p)][mask] = strategy_adv[row] * scale
    return out, diagnostics


__all__ = [
    "INVALID",
    "STRATEGY_ADVANTAGES",
    "STRATEGY_KEY",
    "centred_strategy_advantages",
    "counterfactual_strategy_advantages",
    "strategy_spans",
    "strategy_token_advantages",
    "strategy_token_ids",
    "token_spans_mask",
    "with_strategy",
]
