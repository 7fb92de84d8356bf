"""Robust demonstrations: for each case, the safe plan that stays safe when written imprecisely.

The oracle's plans sit on a knife edge: neighbouring crowns are in contact, and the oracle times
their movement to a few thousandths of a fraction. A small model that imitates them writes the
numbers a little off, and a little off is a collision: on 72 held-out cases (the three levels,
both dynamics), the oracle's plans with every fraction rounded to two decimals break a hard rule on
7, with ±5 % noise on each fraction on 9 % of the draws (``experiments/audits/plan_sensitivity.py``).

:func:`robust_plan` picks, among the oracle's plan, the same plan with its fractions rounded to
:data:`ROUNDED_DECIMALS` decimals, and uniform staging under the oracle's strategy, the candidate
whose :data:`DRAWS` copies with :data:`NOISE` relative noise on every fraction score best on average
(the scaled reward, which puts every plan that breaks a hard rule below every safe one; a candidate
that breaks a rule as written is never picked).
Behaviour cloning on these plans imitates a planner whose neighbourhood is safe.

Noise on the fractions is not the only way a small model writes a plan wrong: under force decay the
oracle overcorrects each tooth by what the simulator shows it fails to express, which splits its
staging into up to a dozen groups of one or two teeth, and the per-tooth amounts depend on teeth the
compact prompt does not list. With ``max_groups`` :func:`robust_plan` also offers the oracle's
staging with the groups that share a start and a fraction merged (:func:`merged`: the smallest
overcorrection of their teeth, or none) and picks among the candidates of at most ``max_groups``
groups (uniform staging always qualifies): a plan short enough to imitate.

Uniform staging moves every tooth at once, so it follows a strategy's sequence only where that
sequence has a single level of movement (:mod:`server.scoring`): elsewhere naming the right strategy
on it earns the neutral multiplier that naming none earns, and naming a wrong one 0.6. With
``unnamed_uniform`` a chosen uniform plan names its strategy only where that scores above naming
none (:data:`UNNAMED`), as uniform SLERP does, so a model that imitates them writes its uniform plans
without a name that could be scored as misreading the case.

A small model writes its overcorrections imprecisely too. With ``oc_noise`` the noisy copies
also have each group's overcorrection off by a normal error of that standard deviation, so a
candidate whose overcorrection is safe only when exact loses to one that overcorrects less or not at
all. With ``uniform_room`` force-decay cases are also offered uniform staging overcorrected by the
smallest overcorrection room of their teeth (:func:`server.staging.overcorrection_room`): one group
and one number, where uniform staging alone expresses too little. With ``room_oc`` force-decay cases
are also offered the candidates that do not overcorrect (``staged``, ``uniform``) with each group
overcorrected by :data:`ROOM_SHARE` of the smallest room of its teeth (``<name>+room``): an
overcorrection a planner that is shown the room (the ``room`` prompt) can read off it.
"""

from __future__ import annotations

import copy

import numpy as np

from server.cases import CaseKey, generate_case
from server.dental_constants import TOOTH_IDS
from server.plans import MAX_OVERCORRECTION, UNIFORM_FRACTION, normalize_plan
from server.staging import OC_QUANTUM, arrays_to_plan
from server.treatment import score_plans

NOISE: float = 0.05
"""Relative standard deviation of the noise put on each group's fraction (a model's imprecision)."""
DRAWS: int = 6
"""Noisy copies of each candidate scored."""
ROUNDED_DECIMALS: int = 2
"""Decimals of the rounded candidate's fractions."""
CANDIDATES: tuple[str, ...] = ("oracle", "rounded", "uniform")
MERGED_CANDIDATES: tuple[str, ...] = ("merged", "staged")
"""The candidates offered with ``max_groups``: the oracle's groups merged by start and fraction, with
the smallest overcorrection of their teeth (``merged``) or none (``staged``)."""
UNIFORM_ROOM: str = "uniform_room"
"""The candidate offered with ``uniform_room`` under force decay: uniform staging overcorrected by the
smallest overcorrection room of the present teeth (one group, one number)."""
ROOM_SHARE: float = 0.5
"""With ``room_oc``, the share of its teeth's smallest overcorrection room a group is overcorrected by
(rounded down to the quantum). Half: on the greedy force-decay plans that do not overcorrect of GRPO
from the overcorrection-noise BC (seed 0), the whole room broke a hard rule on 2-25 % of them per level
and half of it on 0-17 % (``experiments/learning/gap_decomposition.py --room-share``)."""
ROOM_SUFFIX: str = "+room"
"""The name of a ``room_oc`` candidate: the candidate's name and this."""
UNNAMED: str = "uniform_unnamed"
"""The choice's name where ``unnamed_uniform`` took the strategy off a chosen uniform plan."""


def _noisy(plan: dict, rng: np.random.Generator, oc_noise: float = 0.0) -> dict:
    out = copy.deepcopy(plan)
    for g in out["tooth_groups"]:
        g["fraction"] = float(np.clip(round(g["fraction"] * (1.0 + rng.normal(0.0, NOISE)), 4), 0.0, 1.0))
        if oc_noise > 0.0 and g.get("overcorrection"):
            oc = g["overcorrection"] + rng.normal(0.0, oc_noise)
            g["overcorrection"] = float(np.clip(round(oc / OC_QUANTUM) * OC_QUANTUM, 0.0, MAX_OVERCORRECTION))
    return out


def merged(plan: dict, overcorrect: bool = True) -> dict:
    """``plan`` with its teeth that share a start stage and a fraction in one group, overcorrected by
    the smallest overcorrection among them rounded down to the oracle's quantum (``overcorrect``) or
    not at all; written as the oracle writes its plans (:func:`server.staging.arrays_to_plan`)."""
    spec = normalize_plan(plan)
    listed = spec.group >= 0
    oc = np.zeros(len(spec.start))
    if overcorrect:
        for start, fraction in {(s, f) for s, f in zip(spec.start[listed], spec.fraction[listed])}:
            same = listed & (spec.start == start) & (spec.fraction == fraction)
            oc[same] = np.floor(spec.overcorrections()[same].min() / OC_QUANTUM + 1e-9) * OC_QUANTUM
    return arrays_to_plan(spec.strategy, spec.start, spec.fraction, oc, absent=~listed)


def within_room(plan: dict, room: np.ndarray, share: float = ROOM_SHARE) -> dict:
    """``plan`` with each group overcorrected by ``share`` of the smallest ``room`` ((28,), per tooth in
    :data:`server.dental_constants.TOOTH_IDS` order) of its teeth, rounded down to the oracle's quantum
    (no overcorrection where that is 0; an id that is not a tooth is passed over)."""
    out = copy.deepcopy(plan)
    for g in out["tooth_groups"]:
        g.pop("overcorrection", None)
        smallest = min(
            (float(room[TOOTH_IDS.index(t)]) for t in g.get("teeth", []) if t in TOOTH_IDS), default=0.0
        )
        oc = np.floor(share * smallest / OC_QUANTUM + 1e-9) * OC_QUANTUM
        if oc > 0.0:
            g["overcorrection"] = round(float(oc), 2)
    return out


def candidates(plan: dict, teeth: list[int], with_merged: bool = False) -> dict[str, dict]:
    """The candidates of an oracle ``plan`` for a case whose present teeth are ``teeth`` (FDI ids);
    ``with_merged``: also :data:`MERGED_CANDIDATES`."""
    rounded = copy.deepcopy(plan)
    for g in rounded["tooth_groups"]:
        g["fraction"] = round(g["fraction"], ROUNDED_DECIMALS)
    uniform = {"tooth_groups": [{"teeth": list(teeth), "fraction": round(UNIFORM_FRACTION, 4)}]}
    if plan.get("strategy"):
        uniform = {"strategy": plan["strategy"], **uniform}
    found = {"oracle": plan, "rounded": rounded, "uniform": uniform}
    if with_merged:
        found |= {"merged": merged(plan), "staged": merged(plan, overcorrect=False)}
    return found


def robust_plan(
    plan: dict,
    key: CaseKey,
    teeth: list[int],
    max_groups: int | None = None,
    unnamed_uniform: bool = False,
    oc_noise: float = 0.0,
    uniform_room: bool = False,
    room_oc: bool = False,
) -> tuple[dict, str]:
    """The most robust safe candidate of the oracle's ``plan`` for the case ``key`` (present teeth
    ``teeth``) and its name (one of :data:`CANDIDATES`, and of :data:`MERGED_CANDIDATES` with
    ``max_groups``, which then leaves out every candidate of more groups than that); deterministic per
    case (the noise is seeded by the case's seed). Every candidate and noisy copy is scored in one
    batched call. ``unnamed_uniform``: a chosen uniform plan without its strategy where naming it
    scores no more than naming none (:data:`UNNAMED`). ``oc_noise``: the noisy copies' overcorrections
    also off by this standard deviation (absolute, rounded to the oracle's quantum, within [0, 1]).
    ``uniform_room``: under force decay also :data:`UNIFORM_ROOM`, where that room is above 0.
    ``room_oc``: under force decay also ``staged`` and ``uniform`` :func:`within_room`, named with
    :data:`ROOM_SUFFIX`, where that overcorrects a tooth."""
    found = candidates(plan, teeth, with_merged=max_groups is not None)
    room = generate_case(*key).overcorrection_room if key.force_decay and (uniform_room or room_oc) else None
    if uniform_room and room is not None:
        oc = float(room[[TOOTH_IDS.index(t) for t in teeth]].min())  # already on the OC_QUANTUM grid
        if oc > 0.0:
            group = {**found["uniform"]["tooth_groups"][0], "overcorrection": round(oc, 2)}
            found[UNIFORM_ROOM] = {**found["uniform"], "tooth_groups": [group]}
    if room_oc and room is not None:
        for name in ("staged", "uniform"):
            roomy = within_room(found[name], room) if name in found else None
            if roomy is not None and any("overcorrection" in g for g in roomy["tooth_groups"]):
                found[name + ROOM_SUFFIX] = roomy
    if max_groups is not None:
        found = {k: p for k, p in found.items() if k == "uniform" or len(p["tooth_groups"]) <= max_groups}
    rng = np.random.default_rng([abs(int(key.seed)) % 2**63, len(key.task_id)])
    plans: list[dict] = []
    for p in found.values():
        plans.append(p)
        plans.extend(_noisy(p, rng, oc_noise) for _ in range(DRAWS))
    results = score_plans(plans, [key] * len(plans))
    best, best_value, best_clean = next(iter(found)), None, None
    for k, name in enumerate(found):
        clean, *noisy = results[k * (DRAWS + 1) : (k + 1) * (DRAWS + 1)]
        if clean["broken_rules"]:
            continue
        value = float(np.mean([r["scaled_reward"] for r in noisy]))
        if best_value is None or value > best_value:
            best, best_value, best_clean = name, value, clean
    if unnamed_uniform and best == "uniform" and "strategy" in found[best]:
        unnamed = {k: v for k, v in found[best].items() if k != "strategy"}
        if score_plans([unnamed], [key])[0]["scaled_reward"] >= best_clean["scaled_reward"]:
            return unnamed, UNNAMED
    return found[best], best
