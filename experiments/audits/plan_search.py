"""An optimiser's attack on the reward: hill climbing over plans, as GRPO would climb.

A policy trained with GRPO finds whatever the summed reward pays for. This module searches
plan space directly for the plans that earn the most, and reports what they break:

* the search space: a strategy and, for each of the 14 tooth types (FDI number 1-7 in each
  arch), a start aligner (``start_stage``) and a ``fraction`` - every plan an LLM could write
  with one group per tooth type;
* the objective: the weighted sum of the five TRL reward functions (default weights 1, what GRPO's
  default ``reward_weights`` add up; any weighting the trainer accepts), called as TRL calls them, or
  the scaled terminal alone;
* the moves: steepest ascent over :data:`PROPOSALS` random mutations per round (a group's start
  moved by up to 4 aligners, its fraction scaled by 0.5-2 or redrawn in [0, 1], the strategy
  redrawn), from uniform SLERP, from the oracle's plan, or from a random plan;
* or a population search (:func:`population_search`) over per-tooth plans: each of the 28 teeth
  its own start aligner, duration (aligners to its target) and overcorrection, (mu + lambda)
  evolution from the oracle, uniform SLERP and random plans.

:func:`orthojob.rewards.canaries.degenerate_form` names the degenerate plans (doing nothing, everything in one aligner,
every treated tooth in one group); :func:`search_case` reports the best plan found, its
reward against the oracle's, the hard rules it breaks and its degenerate form, if any.
``experiments/audits/reward_search.py`` runs it over many seeds; ``tests/test_reward_search.py`` a fast version.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from orthojob.core.prompts import plan_to_completion
from orthojob.rewards.canaries import degenerate_form
from orthojob.rewards.reward_functions import DEFAULT_REWARD_WEIGHTS, REWARD_FUNCS, check_ordering
from server.cases import Case
from server.clinical_profiles import STRATEGIES, STRATEGY_LEVELS
from server.dental_constants import IS_UPPER, N_STAGES, TOOTH_IDS, TYPE_INDEX
from server.oracle import plan_for_case
from server.plans import MAX_OVERCORRECTION, normalize_plan
from server.treatment import score_plan_specs

GROUP_OF_TOOTH: np.ndarray = TYPE_INDEX + 7 * (~IS_UPPER)
"""(28,) the search group (tooth type and arch, 0..13) of each tooth."""
N_GROUPS: int = 14
MEMBERS: tuple[np.ndarray, ...] = tuple(np.flatnonzero(np.equal(GROUP_OF_TOOTH, g)) for g in range(N_GROUPS))
"""Tooth indices of each search group."""
PROPOSALS: int = 48
"""Mutations scored per round."""


@dataclass(frozen=True)
class SearchResult:
    """The best plan a search found for a case, and the oracle's for comparison."""

    case: tuple[str, int, bool]
    start_from: str
    best_plan: dict
    best_total: float
    best_terminal: float
    oracle_total: float
    oracle_terminal: float
    broken_rules: tuple[str, ...]
    degenerate: str | None
    evaluations: int
    start_total: float
    """The objective of the plan the search started from (the best of the first population)."""
    above_oracle: tuple[tuple[dict, tuple[str, ...], str | None], ...] = ()
    """Every plan of a population search's last population above the oracle on the objective, with
    the hard rules it breaks and its degenerate form (None: not degenerate)."""

    @property
    def beats_oracle(self) -> bool:
        return self.best_total > self.oracle_total + 1e-9


def _plan(strategy: str | None, start: np.ndarray, fraction: np.ndarray) -> dict:
    groups = [
        {
            "teeth": [TOOTH_IDS[i] for i in MEMBERS[g]],
            "fraction": round(float(fraction[g]), 4),
            "start_stage": int(start[g]),
        }
        for g in range(N_GROUPS)
    ]
    return {"strategy": strategy, "tooth_groups": groups} if strategy else {"tooth_groups": groups}


def objective(
    case: Case, plans: list[dict], weights: dict[str, float] | None = None, target: str = "sum"
) -> tuple[np.ndarray, np.ndarray]:
    """(objective, scaled terminal) of plans on a case, through the TRL reward functions.

    ``target="sum"``: the sum of the five rewards weighted by ``weights`` (reward name -> weight,
    :data:`orthojob.rewards.reward_functions.DEFAULT_REWARD_WEIGHTS` where absent; checked as the trainer checks them,
    :func:`orthojob.rewards.reward_functions.check_ordering`); ``"sum_engine"``: the same sum with the staging
    engine in the loop (GRPO's ``--objective engine``: the rows' ``engine`` column); ``"terminal"``: the
    scaled terminal alone (the returned terminal is always the plan's own, as written)."""
    completions = [plan_to_completion(p) for p in plans]
    n = len(plans)
    cols = {
        "seed": [case.seed] * n,
        "task_id": [case.task_id] * n,
        "force_decay": [case.force_decay] * n,
        "non_compliance": [case.non_compliance] * n,
    }
    if target == "sum_engine":
        cols["engine"] = [True] * n
    values = {name: np.asarray(f(completions, **cols)) for name, f in REWARD_FUNCS.items()}
    if target == "terminal":
        return values["reward_terminal"], values["reward_terminal"]
    w = {**DEFAULT_REWARD_WEIGHTS, **(weights or {})}
    check_ordering(w)
    terminal = values["reward_terminal"]
    if target == "sum_engine":  # the plan as written, for the audit's hard-rule and terminal columns
        del cols["engine"]
        terminal = np.asarray(REWARD_FUNCS["reward_terminal"](completions, **cols))
    return sum(w[k] * v for k, v in values.items()), terminal


def exploit_plans(case: Case) -> dict[str, dict]:
    """The plans an optimiser of the summed rewards was seen to exploit, for a case, by name: doing
    nothing; everything in one aligner; the oracle's plan at three times its fractions; every tooth
    overcorrected by its whole movement (the malocclusion mirrored); the lower incisors and one upper
    central rushed in 5 aligners while the others take 24; and the strategy's first level left
    unmoved while the rest follows uniform staging (when the oracle declares a strategy)."""
    oracle = plan_for_case(case)
    strategy = oracle.get("strategy")
    every = [int(t) for t in TOOTH_IDS]
    rushed = [11, 31, 41]
    plans = {
        "nothing": {"tooth_groups": [{"teeth": every, "fraction": 0.0}]},
        "all_at_once": {"strategy": strategy, "tooth_groups": [{"teeth": every, "fraction": 1.0}]},
        "oracle_x3": {
            **oracle,
            "tooth_groups": [
                {**g, "fraction": min(1.0, 3 * g.get("fraction", 1 / N_STAGES))}
                for g in oracle["tooth_groups"]
            ],
        },
        "mirrored": {
            "strategy": strategy,
            "tooth_groups": [{"teeth": every, "fraction": 1 / N_STAGES, "overcorrection": 1.0}],
        },
        "rushed_incisors": {
            "strategy": strategy,
            "tooth_groups": [
                {"teeth": rushed, "fraction": 0.2},
                {"teeth": [t for t in every if t not in rushed], "fraction": 1 / N_STAGES},
            ],
        },
    }
    if strategy in STRATEGY_LEVELS:
        levels = STRATEGY_LEVELS[strategy]
        first = [t for t, level in zip(every, levels) if level == levels.min()]
        plans["unmoved_first_level"] = {
            "strategy": strategy,
            "tooth_groups": [
                {"teeth": first, "fraction": 0.0},
                {"teeth": [t for t in every if t not in first], "fraction": 1 / N_STAGES},
            ],
        }
    return plans


def _from_plan(plan: dict) -> tuple[str | None, np.ndarray, np.ndarray]:
    """The search state nearest a plan: each group takes its teeth's mean start and fraction."""
    spec = normalize_plan(plan)
    start = np.array([round(spec.start[m].mean()) for m in MEMBERS], dtype=np.int64)
    fraction = np.array([spec.fraction[m].mean() for m in MEMBERS])
    return spec.strategy, start, fraction


def search_case(
    case: Case,
    start_from: str,
    rounds: int,
    rng: np.random.Generator,
    weights: dict[str, float] | None = None,
    target: str = "sum",
) -> SearchResult:
    """Hill-climb from ``"slerp"``, ``"oracle"`` or ``"random"`` (a random plan of the search space)
    for ``rounds`` rounds of PROPOSALS mutations of :func:`objective` (``weights``, ``target``)."""

    def score(plans: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        return objective(case, plans, weights, target)

    oracle = plan_for_case(case)
    oracle_total, oracle_terminal = (float(v[0]) for v in score([oracle]))
    if start_from == "oracle":
        strategy, start, fraction = _from_plan(oracle)
    elif start_from == "random":
        strategy = STRATEGIES[int(rng.integers(len(STRATEGIES)))]
        start = rng.integers(1, N_STAGES + 1, N_GROUPS)
        fraction = rng.uniform(0.0, 1.0, N_GROUPS) ** 2
    else:
        strategy, start, fraction = None, np.ones(N_GROUPS, dtype=np.int64), np.full(N_GROUPS, 1.0 / N_STAGES)
    best_plan = _plan(strategy, start, fraction)
    best_total, best_terminal = (float(v[0]) for v in score([best_plan]))
    start_total = best_total
    evaluations = 1
    for _ in range(rounds):
        states = []
        for _ in range(PROPOSALS):
            s, st, fr = strategy, start.copy(), fraction.copy()
            for _ in range(int(rng.integers(1, 3))):
                g = int(rng.integers(N_GROUPS))
                move = rng.random()
                if move < 0.35:
                    st[g] = int(np.clip(st[g] + rng.integers(-4, 5), 1, N_STAGES))
                elif move < 0.75:
                    fr[g] = float(np.clip(fr[g] * rng.uniform(0.5, 2.0), 0.0, 1.0))
                elif move < 0.9:
                    fr[g] = float(rng.uniform(0.0, 1.0))
                else:
                    s = STRATEGIES[int(rng.integers(len(STRATEGIES)))]
            states.append((s, st, fr))
        plans = [_plan(*x) for x in states]
        totals, terminals = score(plans)
        evaluations += len(plans)
        k = int(np.argmax(totals))
        if totals[k] > best_total:
            (strategy, start, fraction), best_plan = states[k], plans[k]
            best_total, best_terminal = float(totals[k]), float(terminals[k])
    return _result(
        case,
        start_from,
        best_plan,
        best_total,
        best_terminal,
        oracle_total,
        oracle_terminal,
        evaluations,
        start_total,
    )


def _result(
    case: Case,
    start_from: str,
    best_plan: dict,
    best_total: float,
    best_terminal: float,
    oracle_total: float,
    oracle_terminal: float,
    evaluations: int,
    start_total: float,
) -> SearchResult:
    result = score_plan_specs([normalize_plan(best_plan)], [case])[0]
    return SearchResult(
        case=(case.task_id, case.seed, case.force_decay),
        start_from=start_from,
        best_plan=best_plan,
        best_total=best_total,
        best_terminal=best_terminal,
        oracle_total=oracle_total,
        oracle_terminal=oracle_terminal,
        broken_rules=tuple(result["broken_rules"]),
        degenerate=degenerate_form(case, best_plan),
        evaluations=evaluations,
        start_total=start_total,
    )


POPULATION: int = 16
"""Plans kept per generation of :func:`population_search`."""
OFFSPRING: int = 48
"""Mutants scored per generation."""


def _tooth_plan(strategy: str | None, start: np.ndarray, duration: np.ndarray, over: np.ndarray) -> dict:
    """A per-tooth plan: tooth i starts at ``start[i]``, reaches its (overcorrected) target in
    ``duration[i]`` aligners (0: stays where it is), overcorrected by ``over[i]``."""
    groups = []
    for i, t in enumerate(TOOTH_IDS):
        g = {
            "teeth": [int(t)],
            "fraction": round(min(1.0, 1.0 / duration[i]), 4) if duration[i] > 0 else 0.0,
            "start_stage": int(start[i]),
        }
        if over[i] > 0:
            g["overcorrection"] = round(float(over[i]), 3)
        groups.append(g)
    return {"strategy": strategy, "tooth_groups": groups} if strategy else {"tooth_groups": groups}


def _genes_of(plan: dict) -> tuple[str | None, np.ndarray, np.ndarray, np.ndarray]:
    spec = normalize_plan(plan)
    # the exact (fractional) number of aligners, so the re-encoded plan moves each tooth as the plan does
    duration = np.where(spec.fraction > 0, 1.0 / np.maximum(spec.fraction, 1e-9), 0.0)
    over = spec.overcorrections() if spec.overcorrection is not None else np.zeros(len(TOOTH_IDS))
    return spec.strategy, spec.start.astype(np.int64), np.minimum(duration, float(N_STAGES)), over


def population_search(
    case: Case,
    generations: int,
    rng: np.random.Generator,
    weights: dict[str, float] | None = None,
    target: str = "sum",
    seed_plans: Sequence[dict] = (),
) -> SearchResult:
    """(mu + lambda) evolution of per-tooth plans (start, duration, overcorrection of each tooth and
    the strategy) on :func:`objective`, seeded with the oracle's plan, uniform SLERP, ``seed_plans``
    (e.g. :func:`exploit_plans`, each as the per-tooth plan nearest it) and random plans;
    POPULATION kept and OFFSPRING mutants scored per generation."""
    oracle = plan_for_case(case)
    oracle_total, oracle_terminal = (float(v[0]) for v in objective(case, [oracle], weights, target))
    n = len(TOOTH_IDS)
    genes = [_genes_of(oracle), (None, np.ones(n, np.int64), np.full(n, N_STAGES, np.int64), np.zeros(n))]
    genes += [_genes_of(p) for p in seed_plans]
    while len(genes) < POPULATION:
        genes.append(
            (
                STRATEGIES[int(rng.integers(len(STRATEGIES)))],
                rng.integers(1, N_STAGES + 1, n),
                rng.integers(0, N_STAGES + 1, n),
                np.where(rng.random(n) < 0.2, rng.uniform(0.0, 0.5, n), 0.0),
            )
        )
    plans = [_tooth_plan(*g) for g in genes]
    totals, terminals = objective(case, plans, weights, target)
    start_total = float(totals.max())
    evaluations = len(plans)
    for _ in range(generations):
        children = []
        for _ in range(OFFSPRING):
            s, st, du, oc = genes[int(rng.integers(len(genes)))]
            st, du, oc = st.copy(), du.copy(), oc.copy()
            teeth = rng.choice(n, size=int(rng.integers(1, 5)), replace=False)
            move = rng.random()
            if move < 0.35:
                st[teeth] = np.clip(st[teeth] + rng.integers(-4, 5, teeth.size), 1, N_STAGES)
            elif move < 0.7:
                du[teeth] = np.clip(du[teeth] + rng.integers(-6, 7, teeth.size), 0, N_STAGES)
            elif move < 0.9:
                oc[teeth] = np.clip(oc[teeth] + rng.normal(0.0, 0.1, teeth.size), 0.0, MAX_OVERCORRECTION)
            else:
                s = STRATEGIES[int(rng.integers(len(STRATEGIES)))]
            children.append((s, st, du, oc))
        child_plans = [_tooth_plan(*g) for g in children]
        c_tot, c_term = objective(case, child_plans, weights, target)
        evaluations += len(child_plans)
        genes, plans = genes + children, plans + child_plans
        totals, terminals = np.concatenate((totals, c_tot)), np.concatenate((terminals, c_term))
        keep = np.argsort(-totals, kind="stable")[:POPULATION]
        genes, plans = [genes[k] for k in keep], [plans[k] for k in keep]
        totals, terminals = totals[keep], terminals[keep]
    above = [p for p, t in zip(plans, totals) if t > oracle_total + 1e-9]
    judged = score_plan_specs([normalize_plan(p) for p in above], [case] * len(above)) if above else []
    result = _result(
        case,
        "population",
        plans[0],
        float(totals[0]),
        float(terminals[0]),
        oracle_total,
        oracle_terminal,
        evaluations,
        start_total,
    )
    return replace(
        result,
        above_oracle=tuple(
            (p, tuple(j["broken_rules"]), degenerate_form(case, p)) for p, j in zip(above, judged)
        ),
    )


__all__ = [
    "GROUP_OF_TOOTH",
    "PROPOSALS",
    "SearchResult",
    "exploit_plans",
    "objective",
    "population_search",
    "search_case",
]
