"""Stage-0 (format SFT) demonstrations that carry no clinical choice.

Each demonstration is the policy's own prompt (:func:`orthojob.core.prompts.build_messages`) and, as the
completion, a *valid, executable* plan whose choices are random:

* ``strategy``: drawn uniformly from :data:`server.clinical_profiles.STRATEGIES`, independently of
  the case (so a policy cloned from these demos starts at chance strategy accuracy, 1/5);
* ``tooth_groups``: the case's treated teeth (movement above :data:`server.scoring.MOVEMENT_EPS_MM`)
  shuffled and cut into 1..:data:`MAX_DEMO_GROUPS` groups; each group gets a random priority among
  those that still let its slowest tooth reach the target by aligner 24 within the per-stage limits,
  and a fraction drawn uniformly from the feasible interval
  ``[1 / (24 - start + 1), 1 / stages_needed]`` of its teeth (so the plan is executable: every
  treated tooth stays within the per-stage limits and reaches its target).

With ``staging="sequenced"`` the groups are instead the named strategy's levels
(:data:`server.clinical_profiles.STRATEGY_LEVELS`, among the treated teeth; the teeth its sequence
does not judge, :data:`server.clinical_profiles.SEQUENCED_TEETH`, join the first group), in the
strategy's order: each later group starts 2-6 aligners after the one before (an explicit
``start_stage``; fewer where a later group needs the time to finish) and finishes no earlier, at a
random aligner that the per-stage limits allow (:func:`sequenced_format_plan`). The plan then moves
the teeth in the order the strategy it names prescribes, which is what the plan semantics state a
strategy means; the strategy itself, the starts and the speeds stay random. A random staging rarely
follows any strategy's sequence, so a policy cloned from random staging rarely sees the plans that
earn the optimal multiplier.

Nothing here looks at which strategy or sequence suits the case, and nothing is filtered on the
clinical score. By default some demos break a hard rule (collisions between teeth moved at different
times: about a quarter on ``task_easy``, 44 % on ``task_hard``), which GRPO then has to unlearn; with
``safe=True`` a demo whose plan breaks a hard rule is redrawn (up to :data:`SAFE_DRAWS` draws, the
simulator's own rule check, :func:`server.reward_scaler.broken_rules`, deciding), so the policy copies
random choices that are safe. Safety is the only thing the redraw looks at: with random staging the
strategy and the groups stay as random as before. With sequenced staging the strategy does not: the
redraw keeps plans naming the case's optimal strategy more often (0.46 of 1,600 safe demonstrations
over every level, against 0.21 with random staging), as the optimal strategy's sequence breaks fewer
rules on its case. :func:`demo_stats` reports the hard-rule share and the optimal share either way.

Example::

    from orthojob.data.format_demos import format_demonstrations
    rows = format_demonstrations(400, ["task_easy"], seed=0)
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence

import numpy as np

from orthojob.core.prompts import TRAIN_SEED_START, build_messages, plan_to_completion
from server.cases import Case, CaseKey, generate_case
from server.clinical_profiles import SEQUENCED_TEETH, STRATEGIES, STRATEGY_LEVELS
from server.dental_constants import (
    MAX_ROTATION_DEG,
    MAX_TRANSLATION_MM,
    MM_PER_DEG,
    N_STAGES,
    PRIORITY_START_STAGE,
    TOOTH_IDS,
)
from server.dental_environment import initial_observation
from server.scoring import MOVEMENT_EPS_MM
from server.treatment import score_plans

MAX_DEMO_GROUPS: int = 3
"""Most groups in a demo plan (keeps completions short: about 60-110 tokens with the tiny tokenizer)."""
SAFE_DRAWS: int = 24
"""Most draws of a ``safe`` demo's plan; a row with no safe draw keeps its last one (reported by
:func:`demo_stats`)."""
FRACTION_DIGITS: int = 4
STAGINGS: tuple[str, ...] = ("random", "sequenced")
"""How a demo plan groups and times the teeth: :func:`random_format_plan` or :func:`sequenced_format_plan`."""
SEQUENCE_GAP_STAGES: tuple[int, int] = (2, 6)
"""Aligners between the starts of consecutive groups of a sequenced demo (inclusive range)."""


def _floor(x: float) -> float:
    return math.floor(x * 10**FRACTION_DIGITS) / 10**FRACTION_DIGITS


def _ceil(x: float) -> float:
    return math.ceil(x * 10**FRACTION_DIGITS) / 10**FRACTION_DIGITS


def _fastest_fraction(need: float) -> float:
    """The largest fraction (rounded down) that keeps a group needing ``need`` stages within the limits."""
    return _floor(1.0 / need * (1 - 1e-6))


def treated_teeth(case: Case) -> tuple[list[int], np.ndarray]:
    """Indices of the teeth the case moves, and the exact stages each needs within the limits."""
    dist, rot = case.need
    treated = np.flatnonzero(np.hypot(dist, MM_PER_DEG * rot) > MOVEMENT_EPS_MM)
    stages = np.maximum(dist / MAX_TRANSLATION_MM, rot / MAX_ROTATION_DEG)
    return [int(i) for i in treated], stages


def random_format_plan(case: Case, rng: random.Random) -> dict:
    """One random, executable plan for ``case`` (see the module docstring)."""
    strategy = rng.choice(STRATEGIES)
    teeth, stages = treated_teeth(case)
    if not teeth:  # nothing to move: one group (of the first tooth the patient has) at uniform SLERP
        first = case.present_ids[0]
        return {"strategy": strategy, "tooth_groups": [{"teeth": [first], "fraction": _floor(1 / N_STAGES)}]}
    rng.shuffle(teeth)
    k = rng.randint(1, min(MAX_DEMO_GROUPS, len(teeth)))
    cuts = sorted(rng.sample(range(1, len(teeth)), k - 1)) if k > 1 else []
    bounds = [0, *cuts, len(teeth)]
    groups = []
    for lo, hi in itertools.pairwise(bounds):
        members = teeth[lo:hi]
        need = max(1.0, float(max(stages[i] for i in members)))
        f_max = _fastest_fraction(need)
        options = [
            p for p, start in PRIORITY_START_STAGE.items() if _ceil(1.0 / (N_STAGES - start + 1)) <= f_max
        ]
        priority = rng.choice(options or ["high"])
        f_min = _ceil(1.0 / (N_STAGES - PRIORITY_START_STAGE[priority] + 1))
        fraction = round(rng.uniform(f_min, max(f_min, f_max)), FRACTION_DIGITS)
        fraction = min(max(fraction, f_min), max(f_min, f_max))
        groups.append(
            {"teeth": sorted(TOOTH_IDS[i] for i in members), "fraction": fraction, "priority": priority}
        )
    return {"strategy": strategy, "tooth_groups": groups}


def sequenced_format_plan(case: Case, rng: random.Random) -> dict:
    """One random, executable plan for ``case`` that moves its teeth in the order of the strategy it
    names (see the module docstring): a group per level of the strategy's sequence present among the
    treated teeth, later levels starting later and finishing no earlier."""
    strategy = rng.choice(STRATEGIES)
    teeth, stages = treated_teeth(case)
    if not teeth:
        return {**random_format_plan(case, rng), "strategy": strategy}
    levels, judged = STRATEGY_LEVELS[strategy], SEQUENCED_TEETH[strategy]
    order = sorted({int(levels[i]) for i in teeth if judged[i]})
    members = [[i for i in teeth if judged[i] and levels[i] == lv] for lv in order] or [[]]
    members[0] += [i for i in teeth if not judged[i]]
    needs = [max(1.0, float(max(stages[i] for i in group))) for group in members]
    # the latest start from which a group and every later one can still finish: starts that never
    # decrease along the sequence then stay feasible
    spans = [math.ceil(need - 1e-9) for need in needs]  # whole aligners each group needs
    latest = [N_STAGES - span + 1 for span in spans]
    for j in range(len(latest) - 2, -1, -1):
        latest[j] = min(latest[j], latest[j + 1])
    groups: list[dict] = []
    start = end = 0
    for group, need, span, last_start in zip(members, needs, spans, latest):
        start = 1 if not groups else min(last_start, start + rng.randint(*SEQUENCE_GAP_STAGES))
        end = rng.randint(min(max(start + span - 1, end), N_STAGES), N_STAGES)
        fraction = min(_ceil(1.0 / (end - start + 1)), _fastest_fraction(need))
        groups.append(
            {"teeth": sorted(TOOTH_IDS[i] for i in group), "fraction": fraction, "start_stage": start}
        )
    return {"strategy": strategy, "tooth_groups": groups}


PLAN_SOURCES = {"random": random_format_plan, "sequenced": sequenced_format_plan}
"""The demo plan of each :data:`STAGINGS` entry."""


def format_demonstrations(
    n: int,
    task_ids: Sequence[str],
    force_decay: bool = False,
    seed: int = 0,
    seed_start: int = TRAIN_SEED_START,
    prompt_format: str = "full",
    strategy_last: bool = False,
    safe: bool = False,
    staging: str = "random",
) -> list[dict]:
    """``n`` SFT rows ``{"prompt", "completion", "seed", "task_id", "force_decay", "plan"}`` on training
    seeds from ``seed_start`` (tasks take turns), each with a random format plan (``seed`` seeds the
    random choices, not the cases), prompts in ``prompt_format`` (:data:`orthojob.core.prompts.PROMPT_FORMATS`); ``strategy_last`` writes
    the strategy after the tooth groups; ``safe`` redraws plans that break a hard rule
    (:func:`redraw_unsafe`); ``staging`` is one of :data:`STAGINGS`."""
    rng = random.Random(seed)
    tasks = list(task_ids)
    keys = (CaseKey(tasks[k % len(tasks)], seed_start + k // len(tasks), bool(force_decay)) for k in range(n))
    rows = [format_row(key, rng, prompt_format, strategy_last, staging) for key in keys]
    return redraw_unsafe(rows, rng, strategy_last, staging=staging) if safe else rows


def case_set_format_demonstrations(
    keys: Sequence[CaseKey],
    case_ids: Sequence[str],
    n: int,
    seed: int = 0,
    prompt_format: str = "full",
    strategy_last: bool = False,
    safe: bool = False,
    staging: str = "random",
) -> list[dict]:
    """``n`` format rows on the cases ``keys`` (a case set's training patients,
    :meth:`orthojob.data.case_sets.LoadedCaseSet.case_ids` naming them), the cases taking turns in
    order (a case repeats, with other random choices, when ``n`` exceeds them); each row as
    :func:`format_demonstrations`' with its ``case_id``."""
    if not keys:
        raise ValueError("no cases to write format demonstrations on")
    rng = random.Random(seed)
    rows = [
        {
            **format_row(keys[k % len(keys)], rng, prompt_format, strategy_last, staging),
            "case_id": case_ids[k % len(keys)],
        }
        for k in range(n)
    ]
    return redraw_unsafe(rows, rng, strategy_last, staging=staging) if safe else rows


def format_row(
    key: CaseKey,
    rng: random.Random,
    prompt_format: str = "full",
    strategy_last: bool = False,
    staging: str = "random",
) -> dict:
    """One format demonstration on the case ``key``: its prompt and a random format plan
    (:data:`PLAN_SOURCES` ``[staging]``, drawn from ``rng``) as the completion."""
    case = generate_case(*key)
    plan = _plan_source(staging)(case, rng)
    return {
        "prompt": build_messages(initial_observation(case), prompt_format),
        "completion": _completion(plan, strategy_last),
        "seed": key.seed,
        "task_id": key.task_id,
        "force_decay": bool(key.force_decay),
        "plan": plan,
    }


def _plan_source(staging: str):
    if staging not in PLAN_SOURCES:
        raise ValueError(f"unknown demo staging {staging!r}: use one of {', '.join(STAGINGS)}")
    return PLAN_SOURCES[staging]


def _completion(plan: dict, strategy_last: bool) -> list[dict]:
    return [{"role": "assistant", "content": plan_to_completion(plan, strategy_last)}]


def _key(row: dict) -> CaseKey:
    return CaseKey(row["task_id"], row["seed"], row["force_decay"])


def redraw_unsafe(
    rows: list[dict],
    rng: random.Random,
    strategy_last: bool = False,
    draws: int = SAFE_DRAWS,
    staging: str = "random",
) -> list[dict]:
    """``rows`` with each plan that breaks a hard rule redrawn from ``rng`` (:data:`PLAN_SOURCES`
    ``[staging]``), in rounds over the rows still unsafe, until it is safe or has had ``draws`` draws;
    the prompts stay. Returns new rows (the input is not changed); a row never made safe keeps its
    last draw."""
    source = _plan_source(staging)
    rows = [dict(r) for r in rows]
    pending = list(range(len(rows)))
    for round_ in range(draws):
        results = score_plans([rows[i]["plan"] for i in pending], [_key(rows[i]) for i in pending])
        pending = [i for i, res in zip(pending, results) if res["broken_rules"]]
        if not pending or round_ == draws - 1:
            break
        for i in pending:
            plan = source(generate_case(*_key(rows[i])), rng)
            rows[i] = {**rows[i], "plan": plan, "completion": _completion(plan, strategy_last)}
    return rows


def demo_stats(rows: Sequence[dict]) -> dict:
    """Scores of the demos' plans: mean scaled reward, hard-rule share, executable share, strategy
    counts and the share naming the case's optimal strategy."""

    results = score_plans([r["plan"] for r in rows], [_key(r) for r in rows])
    optimal = [generate_case(r["task_id"], r["seed"], r["force_decay"]).optimal_strategy for r in rows]
    return {
        "n": len(rows),
        "scaled_reward_mean": float(np.mean([x["scaled_reward"] for x in results])),
        "hard_rule_share": float(np.mean([bool(x["broken_rules"]) for x in results])),
        "executable_mean": float(np.mean([x["reward_breakdown"]["executable"] for x in results])),
        "strategy_counts": {s: sum(r["plan"]["strategy"] == s for r in rows) for s in STRATEGIES},
        "optimal_share": float(np.mean([r["plan"]["strategy"] == o for r, o in zip(rows, optimal)])),
    }


__all__ = [
    "MAX_DEMO_GROUPS",
    "PLAN_SOURCES",
    "SAFE_DRAWS",
    "SEQUENCE_GAP_STAGES",
    "STAGINGS",
    "case_set_format_demonstrations",
    "demo_stats",
    "format_demonstrations",
    "format_row",
    "random_format_plan",
    "redraw_unsafe",
    "sequenced_format_plan",
    "treated_teeth",
]
