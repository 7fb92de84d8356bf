"""The five GRPO reward functions, in TRL's contract ``f(completions, **columns) -> list[float]``.

Every function takes the batch's completions (strings, or conversational
``[{"role": "assistant", "content": ...}]`` lists) and the dataset's per-prompt columns, which
TRL passes as lists repeated per generation: ``seed``, ``task_id``, ``force_decay`` (rows built
by :func:`orthojob.prompts.prompt_rows` carry all three). Other TRL keywords (``prompts``,
``completion_ids``, ``trainer_state``, ``log_metric`` ...) are accepted and ignored. A missing
or misaligned column raises ValueError naming it; nothing is defaulted silently.

All five read one cached rollout per (completion, seed, task_id, force_decay)
(:mod:`orthojob.rollouts`): the first call of a batch scores it, the other four hit the cache.
None of them raises because of a completion's content, and every value is finite:

================  =========  ==============================================================
name              range      value
================  =========  ==============================================================
reward_terminal   [-2, 8]    ``scale_reward(terminal)``: 10 x terminal - 2, overridden by -1.0
                             when ``collision_free`` < 0.9 and by -0.5 when
                             ``pdl_feasibility`` < 0.5 (the collision wins)
reward_occlusion  [0, 1]     ``occlusion_composite`` of the final achieved arch
reward_strategy   [0, 1]     ``(strategy_multiplier - 0.6) / 0.6``: wrong 0, neutral 2/3,
                             optimal 1
reward_format     [0, 1]     mean of the five format checks (:func:`orthojob.parsing.format_checks`)
reward_anchorage  [0, 1]     ``movement_prior``: CombinedPrior (realism + anchorage) of the
                             initial vs the final *achieved* configuration, so it differs
                             between completions that move the teeth differently
================  =========  ==============================================================

A rollout that could not be scored (``error``), in particular a completion that holds no JSON
object (:data:`orthojob.rollouts.NO_PLAN`: garbage earns no uniform-SLERP credit), gets each
reward's minimum. The seed's names
are kept as aliases (``accuracy_reward_func`` = reward_terminal, ``occlusion_reward_func``,
``compliance_reward_func`` = reward_format, ``staging_reward_func`` = reward_strategy).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from orthojob.parsing import completion_text, extract_plan, format_checks
from orthojob.rollouts import DEFAULT_CACHE, Rollout
from server.reward_scaler import REWARD_MAX, REWARD_MIN, detect_collision, detect_pdl_stress, scale_reward
from server.scoring import STRATEGY_MULTIPLIERS

REQUIRED_COLUMNS: tuple[str, ...] = ("seed", "task_id", "force_decay")
_WRONG = STRATEGY_MULTIPLIERS["wrong"]
_OPTIMAL = STRATEGY_MULTIPLIERS["optimal"]

RewardFunc = Callable[..., list[float]]


def _column(name: str, kwargs: dict, n: int, caller: str) -> Sequence:
    values = kwargs.get(name)
    if values is None:
        raise ValueError(
            f"{caller} needs the dataset column {name!r} (one value per prompt; TRL passes dataset columns "
            f"to reward functions): add {name!r} to the training dataset rows, as "
            "orthojob.prompts.prompt_rows does (columns seed, task_id, force_decay)"
        )
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        values = [values] * n  # a scalar column value: one for the whole batch
    if len(values) != n:
        raise ValueError(f"{caller}: column {name!r} has {len(values)} values for {n} completions")
    return values


def _rollouts(completions: Sequence, kwargs: dict, caller: str) -> list[Rollout]:
    n = len(completions)
    seeds, tasks, decays = (_column(c, kwargs, n, caller) for c in REQUIRED_COLUMNS)
    return DEFAULT_CACHE.get_many(list(completions), seeds, tasks, decays)


def _finite(x: object, low: float, high: float) -> float:
    """float(x) clipped to [low, high]; the minimum for anything non-finite or non-numeric."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return low
    return min(max(v, low), high) if math.isfinite(v) else low


def _component(rollouts: list[Rollout], name: str) -> list[float]:
    return [0.0 if r.error else _finite(r.reward_breakdown.get(name), 0.0, 1.0) for r in rollouts]


def reward_terminal(completions: Sequence, **kwargs) -> list[float]:
    """Terminal score scaled to [-2, 8] with the hard-fail overrides (see the module docstring)."""
    out = []
    for r in _rollouts(completions, kwargs, "reward_terminal"):
        if r.error:
            out.append(REWARD_MIN)
            continue
        bd = r.reward_breakdown
        scaled, _ = scale_reward(
            _finite(r.terminal_reward, 0.0, 1.0),
            collision=detect_collision(_finite(bd.get("collision_free"), 0.0, 1.0)),
            pdl_stress_exceeded=detect_pdl_stress(_finite(bd.get("pdl_feasibility"), 0.0, 1.0)),
        )
        out.append(_finite(scaled, REWARD_MIN, REWARD_MAX))
    return out


def reward_occlusion(completions: Sequence, **kwargs) -> list[float]:
    """Andrews' six keys + ABO composite of the final achieved arch, in [0, 1]."""
    return _component(_rollouts(completions, kwargs, "reward_occlusion"), "occlusion_composite")


def reward_strategy(completions: Sequence, **kwargs) -> list[float]:
    """Strategy multiplier mapped to [0, 1]: ``(m - 0.6) / 0.6`` (wrong 0, neutral 2/3, optimal 1)."""
    out = []
    for r in _rollouts(completions, kwargs, "reward_strategy"):
        m = (
            _finite(r.reward_breakdown.get("strategy_multiplier"), _WRONG, _OPTIMAL)
            if not r.error
            else _WRONG
        )
        out.append(_finite((m - _WRONG) / (_OPTIMAL - _WRONG), 0.0, 1.0))
    return out


def reward_format(completions: Sequence, **kwargs) -> list[float]:
    """Mean of the five format checks, in [0, 1]. Needs no episode: without the dataset columns it
    parses the completions directly; with them it reads the shared cached parse."""
    if all(kwargs.get(c) is not None for c in REQUIRED_COLUMNS):
        return [
            _finite(r.format.get("total"), 0.0, 1.0) for r in _rollouts(completions, kwargs, "reward_format")
        ]
    return [_finite(format_checks(extract_plan(completion_text(c)))["total"], 0.0, 1.0) for c in completions]


def reward_anchorage(completions: Sequence, **kwargs) -> list[float]:
    """Movement prior (realism + molar anchorage) of initial vs final achieved poses, in [0, 1]."""
    return _component(_rollouts(completions, kwargs, "reward_anchorage"), "movement_prior")


REWARD_FUNCS: dict[str, RewardFunc] = {
    "reward_terminal": reward_terminal,
    "reward_occlusion": reward_occlusion,
    "reward_strategy": reward_strategy,
    "reward_format": reward_format,
    "reward_anchorage": reward_anchorage,
}
"""The five rewards, in the order they are registered with GRPOTrainer."""

DEFAULT_REWARD_WEIGHTS: dict[str, float] = dict.fromkeys(REWARD_FUNCS, 1.0)
"""TRL's default (the seed's): every reward weighs 1 (terminal's [-2, 8] range dominates the sum)."""

# The seed's names (kept so its callers keep working).
accuracy_reward_func = reward_terminal
occlusion_reward_func = reward_occlusion
compliance_reward_func = reward_format
staging_reward_func = reward_strategy

ALIASES: dict[str, str] = {
    "accuracy_reward_func": "reward_terminal",
    "occlusion_reward_func": "reward_occlusion",
    "compliance_reward_func": "reward_format",
    "staging_reward_func": "reward_strategy",
    "terminal": "reward_terminal",
    "occlusion": "reward_occlusion",
    "strategy": "reward_strategy",
    "format": "reward_format",
    "anchorage": "reward_anchorage",
}
"""Other names accepted by :func:`active_reward_funcs` and :func:`reward_weights`."""


def _canonical(name: object) -> str:
    if isinstance(name, str):
        if name in REWARD_FUNCS:
            return name
        if name in ALIASES:
            return ALIASES[name]
    raise ValueError(
        f"unknown reward {name!r}: use one of {', '.join(REWARD_FUNCS)} (or {', '.join(ALIASES)})"
    )


def active_reward_funcs(names: Sequence[str] | None = None) -> list[RewardFunc]:
    """The reward functions to register with GRPOTrainer: all five by default, else ``names`` in order.

    Names may be canonical (``reward_terminal``), short (``terminal``) or the seed's aliases;
    repeats are dropped. Unknown names raise ValueError.
    """
    if names is None:
        return list(REWARD_FUNCS.values())
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    chosen: list[str] = []
    for name in names:
        canonical = _canonical(name.strip() if isinstance(name, str) else name)
        if canonical not in chosen:
            chosen.append(canonical)
    if not chosen:
        raise ValueError(f"no reward functions selected: use some of {', '.join(REWARD_FUNCS)}")
    return [REWARD_FUNCS[n] for n in chosen]


def reward_weights(funcs: Sequence[RewardFunc], overrides: dict[str, float] | None = None) -> list[float]:
    """GRPOConfig.reward_weights for ``funcs``: DEFAULT_REWARD_WEIGHTS with ``overrides`` (by any name).

    An override for an unknown reward, or for one not in ``funcs``, or a non-finite weight raises
    ValueError.
    """
    weights = {f.__name__: DEFAULT_REWARD_WEIGHTS.get(f.__name__, 1.0) for f in funcs}
    for name, value in (overrides or {}).items():
        canonical = _canonical(name)
        if canonical not in weights:
            raise ValueError(
                f"weight given for {name!r}, which is not an active reward ({', '.join(weights)})"
            )
        try:
            w = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"weight for {name!r} must be a number, got {value!r}") from None
        if not math.isfinite(w):
            raise ValueError(f"weight for {name!r} must be finite, got {value!r}")
        weights[canonical] = w
    return [weights[f.__name__] for f in funcs]


__all__ = [
    "ALIASES",
    "DEFAULT_REWARD_WEIGHTS",
    "REQUIRED_COLUMNS",
    "REWARD_FUNCS",
    "accuracy_reward_func",
    "active_reward_funcs",
    "compliance_reward_func",
    "occlusion_reward_func",
    "reward_anchorage",
    "reward_format",
    "reward_occlusion",
    "reward_strategy",
    "reward_terminal",
    "reward_weights",
    "staging_reward_func",
]
