"""The advantage of a plan's strategy choice, apart from the advantage of its staging.

TRL gives every token of a completion the same advantage: ``(reward - group mean) / std``, each
group one case. Summed over a batch of cases, the gradient on the tokens that name the strategy
then has two parts: a *marginal* one (a strategy that scores above its group on most cases is
pushed up for every case) and a *conditional* one (which strategy wins on which case). The
marginal part is the larger while the policy is case-blind -- stage 0's format demonstrations
carry random strategies, so it is -- and GRPO spends its samples collapsing one strategy
distribution shared by every case (docs/learning_experiment.md, runs B-H: ``anterior_first``
for all 48 held-out cases, ``case dependence`` flat).

``centred`` removes the marginal part from the strategy tokens only. Each strategy-naming
completion's strategy tokens get its advantage less its strategy's mean advantage over the batch
(plus the mean over every strategy-naming completion, so naming a valid strategy at all keeps its
credit against non-plans). Within each strategy the advantages are unchanged, so on the strategy
tokens the batch's gradient is the conditional part alone: a strategy gains on the cases where it
beats the strategies named for other cases. Every other token keeps TRL's advantage, so the
staging learns exactly as before. The same idea as a per-action baseline (a state-independent
baseline per arm); it is biased for the marginal by design.

Pure numpy on already-decoded text; :class:`orthojob.grpo_trainer.RecordingGRPOTrainer` applies it
to the token-level advantages TRL accepts with shape ``(B, T)``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from orthojob.parsing import extract_plan
from server.clinical_profiles import STRATEGIES

STRATEGY_ADVANTAGES: tuple[str, ...] = ("sequence", "centred")
"""``sequence``: TRL's, one advantage per completion. ``centred``: the strategy tokens' advantage
less their strategy's batch mean (:func:`centred_strategy_advantages`)."""

_STRATEGY_VALUE = re.compile(r'"strategy"\s*:\s*"([A-Za-z_]+)"')


def strategy_spans(text: str) -> tuple[str | None, list[tuple[int, int]]]:
    """The strategy the plan in ``text`` names (one of :data:`STRATEGIES`, else None) and the
    character spans ``[start, end)`` of its name wherever ``"strategy": "<name>"`` writes it."""
    plan = extract_plan(text)
    strategy = plan.get("strategy") if isinstance(plan, dict) else None
    if strategy not in STRATEGIES:
        return None, []
    spans = [m.span(1) for m in _STRATEGY_VALUE.finditer(text) if m.group(1) == strategy]
    return (strategy, spans) if spans else (None, [])


def centred_strategy_advantages(advantages: np.ndarray, strategies: Sequence[str | None]) -> np.ndarray:
    """``advantages`` (B,) less each named strategy's mean over the batch, plus the mean over every
    completion that names one; completions naming none (None) keep theirs. Returns (B,) float.

    Over the completions naming strategy ``s`` the result sums to ``n_s`` times the named mean, the
    same for every ``s``: no strategy gains on every case at once.
    """
    a = np.asarray(advantages, dtype=float)
    if a.ndim != 1 or len(a) != len(strategies):
        raise ValueError(f"advantages {a.shape} and {len(strategies)} strategies do not match")
    names = np.array([s if s is not None else "" for s in strategies], dtype=object)
    named = names != ""
    out = a.copy()
    if not named.any():
        return out
    overall = a[named].mean()
    for s in np.unique(names[named]):
        rows = names == s
        out[rows] = a[rows] - a[rows].mean() + overall
    return out


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
) -> tuple[np.ndarray, dict[str, float]]:
    """Token-level advantages (B, T) for ``centred``: every token keeps its completion's advantage
    except those naming the strategy, which get :func:`centred_strategy_advantages` x ``scale``.

    ``advantages`` (B,): TRL's; ``pieces``: per completion, the decoded text of each of its T
    (padded) completion tokens, padding as ''. Also returns diagnostics: ``named`` (share of
    completions with strategy tokens) and ``marginal`` (mean |removed marginal| over them).
    """
    a = np.asarray(advantages, dtype=float)
    width = max((len(p) for p in pieces), default=0)
    out = np.repeat(a[:, None], width, axis=1)
    found = [strategy_spans("".join(p)) for p in pieces]
    strategies = [s for s, _ in found]
    centred = centred_strategy_advantages(a, strategies)
    for row, (p, (strategy, spans)) in enumerate(zip(pieces, found)):
        if strategy is not None:
            mask = token_spans_mask(p, spans)
            out[row, : len(p)][mask] = centred[row] * scale
    named = np.array([s is not None for s in strategies])
    diagnostics = {
        "named": float(named.mean()) if len(named) else 0.0,
        "marginal": float(np.abs(a - centred)[named].mean()) if named.any() else 0.0,
    }
    return out, diagnostics


__all__ = [
    "STRATEGY_ADVANTAGES",
    "centred_strategy_advantages",
    "strategy_spans",
    "strategy_token_advantages",
    "token_spans_mask",
]
