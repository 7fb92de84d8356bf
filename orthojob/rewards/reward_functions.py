"""The five GRPO reward functions, in TRL's contract ``f(completions, **columns) -> list[float]``.

Every function takes the batch's completions (strings, or conversational
``[{"role": "assistant", "content": ...}]`` lists) and the dataset's per-prompt columns, which
TRL passes as lists repeated per generation: ``seed``, ``task_id``, ``force_decay`` (rows built
by :func:`orthojob.core.prompts.prompt_rows` carry all three). Other TRL keywords (``prompts``,
``completion_ids``, ``trainer_state``, ``log_metric`` ...) are accepted and ignored. A missing
or misaligned column raises ValueError naming it; nothing is defaulted silently.

All five read one cached rollout per (completion, seed, task_id, force_decay[, non_compliance])
(:mod:`orthojob.rewards.rollouts`): the first call of a batch scores it, the other four hit the cache. A
``non_compliance`` column is optional (False when absent); when a row carries it, its case is the
case with that compliance schedule.
None of them raises because of a completion's content, and every value is finite. Each judges
a different clinical question, so each carries its own within-group signal
(``experiments/audits/reward_signal.py`` measures it):

================  =========  ==============================================================
name              range      value
================  =========  ==============================================================
reward_terminal   [-2, 8]    the scaled terminal reward (:mod:`server.reward_scaler`): safe
                             plans 8 x quality in [0, 8]; a plan breaking a hard rule
                             (collision, PDL over critical, per-stage limits) in (-2, -0.25],
                             graded by how much it breaks
reward_occlusion  [0, 1]     ``occlusion_course``: the bite over the course of treatment
                             (the achieved occlusion's gain at aligners 4, 8, ..., 24)
reward_strategy   [0, 1]     diagnosis x sequence x delivery: ``d * (1 + rho) / 2 * accuracy``
                             with ``d`` 1 for the case's optimal strategy, 1/2 for a neutral
                             one, 0 for a wrong or missing one, ``rho`` the sequence concordance
                             of the movement with the declared strategy's order, and accuracy
                             the share of the movement achieved; 0 on a case with
                             nothing to move (no sequence to stage)
reward_format     [0, 1]     mean of the six format checks (:func:`orthojob.core.parsing.format_checks`)
                             and ``executable``: the share of treated teeth whose prescription
                             stays within the per-stage limits and reaches (or, overcorrected,
                             passes) the target
reward_anchorage  [0, 1]     ``accuracy x anchorage``: molar anchorage and the root area at rest
                             behind each millimetre moved, for the treatment actually delivered
================  =========  ==============================================================

**The ordering principle holds for the sum GRPO trains on.** The four auxiliary rewards are 0
for a plan that breaks a hard rule (``Rollout.broken_rules``), so such a plan's weighted sum is
``w_terminal * reward_terminal`` <= ``-0.25 w_terminal`` < 0, while every safe plan, doing nothing
included, sums to at least 0; within the failing band the sum is graded by the breach, through
the terminal. :func:`reward_weights` refuses the weights under which this would not hold (a
negative weight, or auxiliaries without a positive terminal weight).

A completion that is not a plan (no usable tooth group, :data:`orthojob.rewards.rollouts.NO_PLAN`) or
could not be scored gets each reward's minimum. The reward names of the project's original
specification are kept as aliases
(``accuracy_reward_func`` = reward_terminal, ``occlusion_reward_func``,
``compliance_reward_func`` = reward_format, ``staging_reward_func`` = reward_strategy).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from orthojob.core.parsing import FORMAT_CHECKS, completion_text, format_checks, read_plan_text
from orthojob.rewards.rollouts import DEFAULT_CACHE, Rollout
from server.reward_scaler import REWARD_MAX, REWARD_MIN
from server.scoring import STRATEGY_MULTIPLIERS

REQUIRED_COLUMNS: tuple[str, ...] = ("seed", "task_id", "force_decay")
OPTIONAL_COLUMNS: tuple[str, ...] = ("non_compliance", "engine", "repair_cost_scale")
"""Columns read when a dataset row carries them (missing: False; ``repair_cost_scale`` missing: 1)."""
DIAGNOSIS_CREDIT: dict[float, float] = {
    STRATEGY_MULTIPLIERS["optimal"]: 1.0,
    STRATEGY_MULTIPLIERS["neutral"]: 0.5,
    STRATEGY_MULTIPLIERS["wrong"]: 0.0,
}
"""reward_strategy's credit for the declared strategy, by the multiplier class it earned."""

RewardFunc = Callable[..., list[float]]


def _column(name: str, kwargs: dict, n: int, caller: str) -> Sequence:
    values = kwargs.get(name)
    if values is None:
        raise ValueError(
            f"{caller} needs the dataset column {name!r} (one value per prompt; TRL passes dataset columns "
            f"to reward functions): add {name!r} to the training dataset rows, as "
            "orthojob.core.prompts.prompt_rows does (columns seed, task_id, force_decay)"
        )
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        values = [values] * n  # a scalar column value: one for the whole batch
    if len(values) != n:
        raise ValueError(f"{caller}: column {name!r} has {len(values)} values for {n} completions")
    return values


def _rollouts(completions: Sequence, kwargs: dict, caller: str) -> list[Rollout]:
    """The rollouts the rewards judge: the plans as written, or, where the rows' ``engine`` column is
    true, what the objective with the staging engine in the loop judges (:attr:`Rollout.objective`)."""
    n = len(completions)
    seeds, tasks, decays = (_column(c, kwargs, n, caller) for c in REQUIRED_COLUMNS)
    worn = _column("non_compliance", kwargs, n, caller) if kwargs.get("non_compliance") is not None else None
    engine = bool(_batch_value("engine", kwargs, n, caller, False))
    scale = float(_batch_value("repair_cost_scale", kwargs, n, caller, 1.0))
    if engine and not scale > 0:
        raise ValueError(f"{caller}: column 'repair_cost_scale' must be > 0 (got {scale!r})")
    rolls = DEFAULT_CACHE.get_many(list(completions), seeds, tasks, decays, worn, engine=engine)
    return [r.objective_at(scale) for r in rolls] if engine else rolls


def _batch_value(name: str, kwargs: dict, n: int, caller: str, default: object) -> object:
    """The one value an optional column holds for the whole batch (``default`` where it is absent)."""
    if kwargs.get(name) is None:
        return default
    column = set(_column(name, kwargs, n, caller))
    if len(column) > 1:
        raise ValueError(
            f"{caller}: column {name!r} must be the same for the whole batch, got {sorted(column)}"
        )
    return column.pop()


def _unsafe(r: Rollout) -> bool:
    """Whether an auxiliary reward must give its minimum: not a plan, or a plan breaking a hard rule."""
    return r.error is not None or bool(r.broken_rules)


def _finite(x: object, low: float, high: float) -> float:
    """float(x) clipped to [low, high]; the minimum for anything non-finite or non-numeric."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return low
    return min(max(v, low), high) if math.isfinite(v) else low


def _part(r: Rollout, name: str) -> float:
    return _finite(r.reward_breakdown.get(name), 0.0, 1.0)


def reward_terminal(completions: Sequence, **kwargs) -> list[float]:
    """The scaled terminal reward: clinical quality for safe plans, below zero for harmful ones.

    Args:
        completions: the generations (strings or conversational message lists).
        **kwargs: the dataset columns ``seed``, ``task_id``, ``force_decay`` (one per completion).

    Returns:
        One float per completion in [-2, 8]: ``8 * terminal`` when the plan breaks no hard rule;
        in (-2, -0.25] graded by the breach when it breaks one; -2 when it is not a plan.

    Example:
        >>> reward_terminal(['{"tooth_groups": [{"teeth": [11], "fraction": 0.0417}]}'],
        ...                 seed=[0], task_id=["task_easy"], force_decay=[False])  # doctest: +SKIP
        [5.1...]
    """
    rolls = _rollouts(completions, kwargs, "reward_terminal")
    return [REWARD_MIN if r.error else _finite(r.scaled_reward, REWARD_MIN, REWARD_MAX) for r in rolls]


def reward_occlusion(completions: Sequence, **kwargs) -> list[float]:
    """The bite over the course of treatment (``occlusion_course``, :mod:`server.scoring`).

    Args:
        completions, **kwargs: as :func:`reward_terminal`.

    Returns:
        One float per completion in [0, 1]: the achieved occlusion's gain towards the target's at
        aligners 4, 8, ..., 24, credited up to uniform staging's schedule and discounted by the
        left-right imbalance of the teeth's progress (:func:`server.scoring.occlusion_course`). A
        plan that keeps a functional, symmetric bite while the teeth move scores above one that
        wrecks it midway or rushes single teeth; doing nothing, plans that break a hard rule and
        non-plans score 0.
    """
    return [
        0.0 if _unsafe(r) else _part(r, "occlusion_course")
        for r in _rollouts(completions, kwargs, "reward_occlusion")
    ]


def reward_strategy(completions: Sequence, **kwargs) -> list[float]:
    """The diagnosis (which strategy) times the sequence (does the movement follow it).

    Args:
        completions, **kwargs: as :func:`reward_terminal`.

    Returns:
        One float per completion in [0, 1]: ``d * staging * accuracy`` with ``d`` =
        :data:`DIAGNOSIS_CREDIT` of the strategy class the plan earned, ``staging`` =
        ``(1 + rho) / 2`` its sequence concordance and ``accuracy`` the share of the movement it
        achieves: the credit grows with the treatment actually delivered, so a sequence that
        moves almost nothing earns almost nothing. Naming the optimal strategy while moving every
        tooth together to its target earns 0.5; following its sequence earns up to 1; a wrong,
        missing or contradicted strategy, a plan breaking a hard rule, and any plan for a case with
        no tooth to treat (diagnostics ``treated_teeth`` 0: nothing to stage), earn 0.
    """
    out = []
    for r in _rollouts(completions, kwargs, "reward_strategy"):
        if _unsafe(r) or r.strategy is None or not r.diagnostics.get("treated_teeth"):
            out.append(0.0)  # nothing declared, or nothing to stage: no label is paid
            continue
        credit = DIAGNOSIS_CREDIT.get(r.reward_breakdown.get("strategy_multiplier"), 0.0)
        out.append(_finite(credit * _part(r, "staging") * _part(r, "accuracy"), 0.0, 1.0))
    return out


def _format_checks(r: Rollout) -> dict[str, float]:
    """The rollout's :data:`FORMAT_CHECKS`; on a case with no tooth to treat (nothing to stage) the
    strategy check passes whatever the plan declares, so a label is not what the format pays."""
    checks = {k: float(r.format.get(k, 0.0)) for k in FORMAT_CHECKS}
    if not r.diagnostics.get("treated_teeth"):
        checks["strategy_ok"] = 1.0
    return checks


def reward_format(completions: Sequence, **kwargs) -> list[float]:
    """A well-formed, executable prescription: six format checks and ``executable``.

    Args:
        completions: the generations. **kwargs: the dataset columns (without them only the six
        format checks are scored, ``executable`` counting 0).

    Returns:
        One float per completion in [0, 1]: the mean of the checks of
        :func:`orthojob.core.parsing.format_checks` and the share of treated teeth whose
        prescription stays within the per-stage limits and reaches the target (on a case with no
        tooth to treat the strategy check passes whatever is declared). A completion that
        is not a plan, or a plan breaking a hard rule, scores 0. Without the case columns nothing
        is simulated: only the six checks count (executable 0) and no safety is judged, so GRPO
        always passes the columns (:data:`REQUIRED_COLUMNS`).
    """
    parts = len(FORMAT_CHECKS) + 1
    if all(kwargs.get(c) is not None for c in REQUIRED_COLUMNS):
        return [
            0.0
            if _unsafe(r)
            else _finite((sum(_format_checks(r).values()) + _part(r, "executable")) / parts, 0.0, 1.0)
            for r in _rollouts(completions, kwargs, "reward_format")
        ]
    out = []
    for c in completions:
        reading = read_plan_text(completion_text(c))
        checks = format_checks(reading.found, reading.plan_objects)
        out.append(
            _finite(sum(checks[k] for k in FORMAT_CHECKS) / parts, 0.0, 1.0) if reading.is_plan else 0.0
        )
    return out


def reward_anchorage(completions: Sequence, **kwargs) -> list[float]:
    """Anchorage of the treatment delivered: ``accuracy * anchorage`` (:mod:`server.movement_priors`).

    Args:
        completions, **kwargs: as :func:`reward_terminal`.

    Returns:
        One float per completion in [0, 1]: molar anchorage and the root area at rest behind
        each millimetre moved, times the share of the required movement achieved. Moving every
        tooth at once and doing nothing both score low; staging a few teeth at a time against
        the rest scores high; a plan breaking a hard rule scores 0.
    """
    return [
        0.0 if _unsafe(r) else _finite(_part(r, "accuracy") * _part(r, "anchorage"), 0.0, 1.0)
        for r in _rollouts(completions, kwargs, "reward_anchorage")
    ]


REWARD_FUNCS: dict[str, RewardFunc] = {
    "reward_terminal": reward_terminal,
    "reward_occlusion": reward_occlusion,
    "reward_strategy": reward_strategy,
    "reward_format": reward_format,
    "reward_anchorage": reward_anchorage,
}
"""The five rewards, in the order they are registered with GRPOTrainer."""

DEFAULT_REWARD_WEIGHTS: dict[str, float] = dict.fromkeys(REWARD_FUNCS, 1.0)
"""TRL's default, which the project's original specification trains with: every reward weighs 1
(terminal's [-2, 8] range dominates the sum)."""

# The original specification's reward names (kept so scripts written against them keep working).
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

    Names may be canonical (``reward_terminal``), short (``terminal``) or another alias (:data:`ALIASES`);
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


def check_ordering(weights: dict[str, float]) -> None:
    """Raise ValueError unless weights (canonical name -> weight) keep the ordering principle for
    their sum: every weight >= 0 and, when any auxiliary weighs, ``reward_terminal`` active with a
    weight > 0 (the auxiliaries are 0 for a plan that breaks a hard rule, so only the terminal puts
    it below the safe plans). A terminal alone must weigh > 0 too."""
    for name, w in weights.items():
        if w < 0.0:
            raise ValueError(
                f"weight {w} for {name!r} is negative: a negative weight pays GRPO for doing worse on "
                "that reward and breaks the ordering principle (every plan that breaks a hard rule sums "
                "below every safe plan); use a weight >= 0 (0 switches it off)"
            )
    weighing = [n for n, w in weights.items() if w > 0.0]
    if weighing and weights.get("reward_terminal", 0.0) <= 0.0:
        raise ValueError(
            f"rewards {', '.join(weighing)} weigh without reward_terminal: the auxiliary rewards do not "
            "see the hard rules (they are 0 for a plan that breaks one, like a safe plan that earns "
            "nothing), so the sum would not rank rule-breakers below safe plans; add reward_terminal "
            "with a weight > 0"
        )
    if not weighing:
        raise ValueError("every reward weight is 0: GRPO would have nothing to learn from")


def reward_weights(funcs: Sequence[RewardFunc], overrides: dict[str, float] | None = None) -> list[float]:
    """GRPOConfig.reward_weights for ``funcs``: DEFAULT_REWARD_WEIGHTS with ``overrides`` (by any name).

    An override for an unknown reward, or for one not in ``funcs``, a non-finite weight, or weights
    that break the ordering principle (:func:`check_ordering`) raise ValueError.
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
    check_ordering(weights)
    return [weights[f.__name__] for f in funcs]


__all__ = [
    "ALIASES",
    "DEFAULT_REWARD_WEIGHTS",
    "REQUIRED_COLUMNS",
    "REWARD_FUNCS",
    "accuracy_reward_func",
    "active_reward_funcs",
    "check_ordering",
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
