"""The staging engine: the planner proposes a staging, the engine executes one that breaks no hard rule.

Clinical planning software does not emit an aligner beyond the per-stage limits or one that drives
crowns into each other: the clinician gives the sequence and the speed, the software computes the
staging within the rules. Here the planner's plan (:class:`server.plans.PlanSpec`) is that input and
:func:`execute_plans` returns the *executed* plan: the plan itself where it breaks no hard rule (the
same object, bit for bit), else the plan changed as little as the repairs below manage, checked on the
simulator with the case's dynamics and compliance (:func:`server.treatment.score_plan_specs`, the
rules of :mod:`server.reward_scaler`).

Repairs (:mod:`server.staging_repairs`), in the order a clinician's planning software applies them, each round tried as one batch
and only the plans that still break a rule going on:

1. **speed** (analytic, no simulation): a tooth over its per-stage limit (:data:`LIMIT_TOLERANCE`
   included) is slowed to its *safe speed*, the fraction whose every planned step (overcorrected
   steps included) is within the limits (:func:`server.staging.limit_speeds`) and whose insertion
   stress, even with the aligner engaging :data:`server.dynamics.SEAT_FACTOR` steps on a lagging
   tooth, stays within :data:`server.staging_repairs.PDL_SHARE` of the critical stress; a tooth over that stress bound is
   slowed when the plan breaks the PDL rule. A slowed tooth that could no longer finish from its
   start is started as much earlier as it needs (from aligner 1 at the latest), so it keeps its
   movement. **Overcorrection** is trimmed where it overshoots under ideal dynamics (to what the
   overshoot tolerance allows) or where the aligner shapes collide (:func:`server.staging_repairs.relieve`: the planned
   shapes' geometry, trimmed by :data:`server.staging_repairs.RELIEF_KEEP` until they clear).
2. **per tooth, on the simulator** (at most :data:`REPAIR_ROUNDS` rounds): the teeth in the breaching
   contacts, aligner shapes, antagonists (front teeth, premolars and molars) or overshoots
   (:func:`rollout_breaches`) get, as alternatives tried in turn (each tried only for the plans no
   earlier one made safe): their overcorrection halved; slowed to finish at the last aligner (start
   kept, the movement spread over the rest of the treatment); started up to :data:`server.staging_repairs.RETIME_STAGES`
   aligners later at their speed (re-timed to clear the contact, as late as still finishes); staged
   uniformly, with their neighbours (start 1, 1/24, no overcorrection). The first safe alternative is
   kept; none safe, the least breaching one goes to the next round.
3. **fallback**, for what the repairs cannot fix: uniform staging (the strategy kept), then uniform
   staging slowed by :data:`server.staging_repairs.FALLBACK_SLOWER`, then no movement, each checked; no movement breaks no
   rule by construction (the initial arch is penetration-free and is its own aligner). If even that
   broke a rule the record says so (``safe`` False) rather than claim safety.

The record of each plan (:class:`Repair`) names the rules the raw plan broke, the teeth changed and
each change (field, old -> new, the repair that made it), the share of the planned movement kept,
whether the fallback was used, and the rules the executed plan still breaks (none but in the case above).

**Reward of a repaired plan** (:func:`engine_reward`): a planner must gain nothing by leaning on the
engine. An unchanged plan earns its own scaled reward; a repaired one the executed plan's scaled reward
less :func:`repair_cost` (> 0), so strictly less than the executed plan written directly earns; a plan
the fallback replaced earns its raw (failing-band) reward, as without the engine.

Cost: the plans are scored once (a safe plan costs exactly that, nothing when its result is passed in).
Every staging tried after that is rolled out once and its breaches attributed to teeth
(:func:`rollout_breaches`, a share of the scoring's cost); only those the per-tooth check shows
breaking no contact, shape, bite or overshoot rule are scored in full (the limits, PDL and format
parts), and identical stagings of one case are tried once. The next round's repairs read the per-tooth
breaches of the same rollout. ``bench/staging_engine.py`` measures the cost against plain scoring.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from server.absent_teeth import batch_absent, mask_pairs
from server.cases import Case
from server.collisions import (
    ALL_PAIR_CROWNS,
    COLLISION_TOLERANCE_MM,
    all_pairs_penetration_mm,
)
from server.contact_rules import OCCLUSAL_TOLERANCE_MM, occlusal_excess
from server.dental_constants import (
    N_TEETH,
    PRIORITY_START_STAGE,
    TOOTH_IDS,
)
from server.occlusion import (
    ANTERIOR_ANTAGONISTS,
    POSTERIOR_ANTAGONISTS,
)
from server.plans import UNIFORM_FRACTION, PlanSpec, normalize_plan
from server.reward_scaler import breach_total
from server.scoring import (
    OVERSHOOT_TOLERANCE_MM,
    OVERSHOOT_TOLERANCE_SHARE,
    movement_mm,
    overshoot,
)
from server.staging_repairs import (
    Staging,
    alternatives,
    analytic_repair,
    fallbacks,
    final_progress,
    relieve,
)
from server.treatment import BATCH_CHUNK, plan_rollout, score_rollout

ENGINE_VERSION: str = "2"
"""Version of the engine's repairs; a model registered with the engine records it. Bump it whenever
an executed plan can change for the same raw plan and case."""

REPAIR_ROUNDS: int = 2
"""Rounds of per-tooth repairs on the simulator before the fallback."""
REPAIR_COST_BASE: float = 0.5
"""Scaled-reward cost of any repair (:func:`repair_cost`), 1/16 of the [0, 8] safe band; a choice, for
the training objective to tune."""
REPAIR_COST_CHANGED: float = 2.0
"""Scaled-reward cost per share of the planned movement the repair changed (:func:`repair_cost`)."""

UNCHANGED, REPAIRED, FALLBACK = "unchanged", "repaired", "fallback"


@dataclass
class Change:
    """One field of one tooth changed by the engine."""

    tooth: int
    """FDI id."""
    field: str
    """``start_stage``, ``fraction`` or ``overcorrection``."""
    old: float
    new: float
    repair: str
    """The repair that made it: ``speed``, ``overcorrection``, ``slow``, ``retime``, ``uniform``,
    ``fallback``."""


@dataclass
class Repair:
    """What the engine did to one plan (JSON-safe via :meth:`as_dict`)."""

    status: str
    """``unchanged``, ``repaired`` or ``fallback``."""
    raw_broken_rules: list[str]
    """The hard rules the raw plan broke (empty when unchanged)."""
    broken_rules: list[str] = field(default_factory=list)
    """The hard rules the executed plan still breaks: empty, unless even the last fallback broke one."""
    changes: list[Change] = field(default_factory=list)
    kept_share: float = 1.0
    """Share of the raw plan's planned movement (mm-equivalent, overcorrection included) the executed
    plan still plans, tooth by tooth (the smaller of the two per tooth, summed)."""
    changed_share: float = 0.0
    """Share of the raw plan's planned movement on the teeth whose staging changed."""
    fallback: str | None = None
    """The fallback used: ``uniform``, ``uniform_x0.75`` ..., ``nothing``; None when none was."""
    rounds: int = 0
    """Scoring rounds after the raw plan's."""
    engine_version: str = ENGINE_VERSION

    @property
    def safe(self) -> bool:
        return not self.broken_rules

    @property
    def teeth(self) -> list[int]:
        """FDI ids of the teeth changed."""
        return sorted({c.tooth for c in self.changes})

    def as_dict(self) -> dict:
        return {
            "status": self.status,
            "safe": self.safe,
            "raw_broken_rules": list(self.raw_broken_rules),
            "broken_rules": list(self.broken_rules),
            "teeth": self.teeth,
            "changes": [vars(c).copy() for c in self.changes],
            "kept_share": self.kept_share,
            "changed_share": self.changed_share,
            "fallback": self.fallback,
            "rounds": self.rounds,
            "engine_version": self.engine_version,
        }


@dataclass
class Execution:
    """What :func:`execute_plans` returns, one entry per plan."""

    specs: list[PlanSpec]
    """The executed plans (a safe raw plan is returned itself)."""
    records: list[Repair]
    raw_results: list[dict]
    """:func:`server.treatment.score_plan_specs` of the raw plans."""
    results: list[dict]
    """The same of the executed plans (the raw result itself for an unchanged plan). An executed plan keeps
    the raw plan's format (:attr:`PlanSpec.format`): a plan with unusable groups keeps that share off its
    terminal score, which the same plan written out cleanly (:func:`spec_to_plan`) does not."""


# --- diagnosis -----------------------------------------------------------------------------------


def rollout_breaches(
    planned: np.ndarray, achieved: np.ndarray, cases: Sequence[Case]
) -> dict[str, np.ndarray]:
    """Each tooth's share of the contact rules' breaches of planned and achieved trajectories
    (B, 25, 28, 7) on their cases, (B, 28) per kind, in the units of
    :func:`server.contact_rules.arch_breaches` (each pair's excess counted on both its crowns):

    * ``contact``: the achieved crowns (neighbours and crowns one apart) and the antagonists: the front
      bite tighter than both the initial and the target one, the premolars' and molars' cusps below the
      tightest bite their own paths pass through (:func:`server.occlusion.posterior_clearance_floor_mm`),
      each beyond OCCLUSAL_TOLERANCE_MM;
    * ``aligner``: the aligner shapes, where they differ from the achieved teeth;
    * ``overshoot``: the overshoot beyond its tolerance (:func:`server.scoring.overshoot_breach`'s terms).

    A tooth with a share above 0 breaks a rule, so a plan with one does (the check that spares the
    full scoring). Crowns facing each other across two or more absent teeth are not attributed (rare;
    the scoring catches them, the fallback covers them).
    """
    b = len(cases)
    initial = planned[:, 0]
    target = np.stack([c.target for c in cases])
    w = np.stack([c.crown_width_mm for c in cases])[:, None]
    d = np.stack([c.crown_depth_mm for c in cases])[:, None]
    absent = batch_absent(cases)
    tol = COLLISION_TOLERANCE_MM
    out = {k: np.zeros((b, N_TEETH)) for k in ("contact", "aligner", "overshoot")}

    def spread(kind: str, rows: np.ndarray, excess: np.ndarray, pairs: np.ndarray) -> None:
        for side in pairs:  # each pair's excess counts against both its crowns
            np.add.at(out[kind], (rows[:, None], side[None, :]), excess)

    rows = np.arange(b)
    pen = mask_pairs(all_pairs_penetration_mm(achieved[:, 1:], w, d), absent, ALL_PAIR_CROWNS)
    spread("contact", rows, np.maximum(pen - tol, 0.0).sum(axis=1) / tol, ALL_PAIR_CROWNS)
    front, back = occlusal_excess(initial, target, achieved, absent)
    for excess, pairs in ((front, ANTERIOR_ANTAGONISTS), (back, POSTERIOR_ANTAGONISTS)):
        spread("contact", rows, np.maximum(excess, 0.0).sum(axis=1) / OCCLUSAL_TOLERANCE_MM, pairs.T)
    differs = np.flatnonzero(np.any(planned[:, 1:] != achieved[:, 1:], axis=(1, 2, 3)))
    if differs.size:
        pen = all_pairs_penetration_mm(planned[differs, 1:], w[differs], d[differs])
        if absent is not None:
            pen = mask_pairs(pen, absent[differs], ALL_PAIR_CROWNS)
        spread("aligner", differs, np.maximum(pen - tol, 0.0).sum(axis=1) / tol, ALL_PAIR_CROWNS)
    need, error, delivered = movement_mm(
        np.array((initial, achieved[:, -1], initial)), np.array((target, target, achieved[:, -1]))
    )
    over = overshoot(need, delivered, error)
    allowed = np.maximum(OVERSHOOT_TOLERANCE_MM, OVERSHOOT_TOLERANCE_SHARE * need)
    out["overshoot"] = np.maximum(over - allowed, 0.0) / OVERSHOOT_TOLERANCE_MM
    return out


def _share_breach(share: dict[str, np.ndarray]) -> np.ndarray:
    """(...,) the breach, in :func:`server.reward_scaler.breach_total`'s units, that per-tooth shares
    (..., 28) per kind account for (pairs counted once)."""
    return (share["contact"].sum(axis=-1) + share["aligner"].sum(axis=-1)) / 2.0 + share["overshoot"].sum(
        axis=-1
    )


@dataclass
class _Tried:
    """One staging tried on the simulator."""

    spec: PlanSpec
    result: dict | None
    """Its :func:`server.treatment.score_plan_specs` result; None when its per-tooth breaches already
    showed it breaking a rule (not scored further)."""
    share: dict[str, np.ndarray]
    """Its :func:`rollout_breaches` rows (28,) per kind."""
    breach: float
    """Its breach total (:func:`server.reward_scaler.breach_total`; that of ``share`` unscored)."""

    @property
    def safe(self) -> bool:
        return self.result is not None and not self.result["broken_rules"]


def _subset(rollout: tuple, rows: list[int]) -> tuple:
    """The rows of a :func:`server.treatment.plan_rollout` (achieved kept the planned array where it is)."""
    planned, achieved, lagging, steps = rollout
    part = planned[rows]
    return (
        part,
        part if achieved is planned else achieved[rows],
        lagging[rows],
        None if steps is None else (steps[0][rows], steps[1][rows]),
    )


def _key(spec: PlanSpec, case: Case) -> tuple:
    """What a plan's result depends on: its case and everything of the plan the scoring reads."""
    return (
        id(case),
        spec.overcorrection is None,
        None if spec.group is None else spec.group.tobytes(),
        spec.start.tobytes(),
        spec.fraction.tobytes(),
        spec.overcorrections().tobytes(),
        spec.strategy,
        tuple(sorted(vars(spec.format).items())),
    )


def _try(specs: Sequence[PlanSpec], cases: Sequence[Case], check: bool = True) -> list[_Tried]:
    """Roll out the plans (identical plans on one case once, in chunks of BATCH_CHUNK), attribute their
    breaches to teeth and score those whose per-tooth breaches are all 0 (all, ``check`` False)."""
    keys = [_key(s, c) for s, c in zip(specs, cases)]
    first: dict[tuple, int] = {}
    unique = [k for k, key in enumerate(keys) if first.setdefault(key, k) == k]
    tried: dict[int, _Tried] = {}
    for lo in range(0, len(unique), BATCH_CHUNK):
        part = unique[lo : lo + BATCH_CHUNK]
        part_specs, part_cases = [specs[k] for k in part], [cases[k] for k in part]
        rollout = plan_rollout(part_specs, part_cases)
        share = rollout_breaches(rollout[0], rollout[1], part_cases)
        breach = _share_breach(share)
        score = [r for r in range(len(part)) if not check or breach[r] == 0.0]
        scored = dict(
            zip(
                score,
                score_rollout(
                    [part_specs[r] for r in score], [part_cases[r] for r in score], _subset(rollout, score)
                ),
            )
            if score
            else ()
        )
        for r, k in enumerate(part):
            result = scored.get(r)
            tried[k] = _Tried(
                specs[k],
                result,
                {kind: v[r] for kind, v in share.items()},
                float(breach[r]) if result is None else breach_total(result["diagnostics"]),
            )
    out = []
    for s, key in zip(specs, keys):
        t = tried[first[key]]
        out.append(t if t.spec is s else _Tried(s, copy.deepcopy(t.result), t.share, t.breach))
    return out


# --- the engine ----------------------------------------------------------------------------------


def execute_plans(
    specs: Sequence[PlanSpec], cases: Sequence[Case], raw_results: Sequence[dict] | None = None
) -> Execution:
    """Execute B parsed plans on their B cases (see the module docstring).

    ``raw_results``: :func:`server.treatment.score_plan_specs` of ``specs`` when already at hand (the
    engine then adds no cost for a safe plan). Deterministic: the same plans and cases give the same
    executed plans and records.
    """
    specs, cases = list(specs), list(cases)
    if len(specs) != len(cases):
        raise ValueError(f"got {len(specs)} plans for {len(cases)} cases: pass one case per plan")
    share: dict[int, dict[str, np.ndarray]] = {}
    """The per-tooth breaches of each breaking plan's current staging."""
    if raw_results is None:
        raw = []
        for lo in range(0, len(specs), BATCH_CHUNK):  # score_plan_specs, keeping the rollout at hand
            part_specs, part_cases = specs[lo : lo + BATCH_CHUNK], cases[lo : lo + BATCH_CHUNK]
            rollout = plan_rollout(part_specs, part_cases)
            raw += score_rollout(part_specs, part_cases, rollout)
            rows = [r for r in range(len(part_specs)) if raw[lo + r]["broken_rules"]]
            if rows:
                part = _subset(rollout, rows)
                found = rollout_breaches(part[0], part[1], [part_cases[r] for r in rows])
                share.update({lo + r: {kind: v[i] for kind, v in found.items()} for i, r in enumerate(rows)})
    else:
        raw = list(raw_results)
    out_specs: list[PlanSpec] = list(specs)
    results: list[dict] = list(raw)
    records = [Repair(UNCHANGED, []) for _ in specs]
    todo = [k for k, r in enumerate(raw) if r["broken_rules"]]
    stagings: dict[int, Staging] = {}
    breach: dict[int, float] = {}
    for k in todo:
        records[k] = Repair(REPAIRED, list(raw[k]["broken_rules"]))
        stagings[k] = analytic_repair(specs[k], cases[k], raw[k]["broken_rules"])
        breach[k] = breach_total(raw[k]["diagnostics"])
    shapes = [k for k in todo if "aligner_collision" in raw[k]["broken_rules"]]
    relieve([stagings[k] for k in shapes], [cases[k] for k in shapes])
    # round 1: the analytic repairs, checked (a plan they leave as it was goes straight on)
    changed = [k for k in todo if stagings[k].how]
    todo = [k for k in todo if not stagings[k].how]
    for k, t in zip(
        changed, _try([stagings[k].spec(specs[k]) for k in changed], [cases[k] for k in changed])
    ):
        records[k].rounds += 1
        if t.safe:
            out_specs[k], results[k] = t.spec, t.result
        else:
            share[k], breach[k] = t.share, t.breach
            todo.append(k)
    todo.sort()
    # rounds 2..: per-tooth repairs on the simulator
    for _ in range(REPAIR_ROUNDS):
        if not todo:
            break
        unknown = [k for k in todo if k not in share]  # raw plans scored by the caller
        for lo in range(0, len(unknown), BATCH_CHUNK):
            part = unknown[lo : lo + BATCH_CHUNK]
            part_cases = [cases[k] for k in part]
            planned, achieved = plan_rollout([specs[k] for k in part], part_cases)[:2]
            found = rollout_breaches(planned, achieved, part_cases)
            share.update({k: {kind: v[r] for kind, v in found.items()} for r, k in enumerate(part)})
        options = {k: alternatives(stagings[k], cases[k], share[k]) for k in todo}
        todo = _choose(todo, options, stagings, specs, cases, out_specs, results, records, breach, share)
    if todo:  # the fallback
        tries = {k: fallbacks(specs[k], cases[k]) for k in todo}
        options = {k: [s for _, s in tries[k]] for k in todo}
        names = {k: [n for n, _ in tries[k]] for k in todo}
        left = _choose(
            todo, options, stagings, specs, cases, out_specs, results, records, breach, share, names
        )
        for k in left:  # not even the last fallback is safe: say so
            records[k].broken_rules = list(results[k]["broken_rules"])
    for k, record in enumerate(records):
        if record.status != UNCHANGED:
            _describe(record, specs[k], out_specs[k], cases[k], stagings[k])
    return Execution(out_specs, records, raw, results)


def _choose(
    todo, options, stagings, specs, cases, out_specs, results, records, breach, share, names=None
) -> list[int]:
    """Try the plans' alternatives in turn, the j-th of every plan still breaking in one batch: each
    plan takes its first safe one, else (when it breaches less) its least breaching one and stays to do.
    An alternative's per-tooth breaches that already show it breaking spare its scoring. ``names``: the
    fallbacks' names (the plan is then marked as replaced, and the one kept is scored in full);
    without, each alternative's overcorrection is relieved (:func:`relieve`) before it is tried.
    Returns the plans still breaking."""
    tried: dict[int, list[tuple[int, _Tried]]] = {k: [] for k in todo}
    pending = [k for k in todo if options[k]]
    fixed: set[int] = set()
    for j in range(max((len(options[k]) for k in todo), default=0)):
        batch = [k for k in pending if k not in fixed and j < len(options[k])]
        if not batch:
            break
        if (
            names is None
        ):  # a re-timed or slowed tooth's aligner shape may now meet an overcorrected neighbour's
            relieve([options[k][j] for k in batch], [cases[k] for k in batch])
        for k, t in zip(
            batch, _try([options[k][j].spec(specs[k]) for k in batch], [cases[k] for k in batch])
        ):
            tried[k].append((j, t))
            if t.safe:
                fixed.add(k)
    left = []
    for k in todo:
        if not tried[k]:
            left.append(k)
            continue
        records[k].rounds += 1
        safe = [x for x in tried[k] if x[1].safe]
        j, t = safe[0] if safe else min(tried[k], key=lambda x: x[1].breach)
        if not safe:
            left.append(k)
            if names is None:
                if t.breach >= breach[k]:
                    continue  # no alternative breaches less: keep the staging as it is
            elif t.result is None:
                t = _try([t.spec], [cases[k]], check=False)[0]
        stagings[k] = options[k][j]
        out_specs[k], results[k], breach[k], share[k] = t.spec, t.result, t.breach, t.share
        if names is not None:
            records[k].status = FALLBACK
            records[k].fallback = names[k][j]
    return left


def _describe(record: Repair, raw: PlanSpec, executed: PlanSpec, case: Case, staging: Staging) -> None:
    """Fill a record's changes and movement shares from the raw and executed plans' arrays."""
    old = (raw.start, raw.fraction, raw.overcorrections())
    new = (executed.start, executed.fraction, executed.overcorrections())
    changed = np.zeros(N_TEETH, dtype=bool)
    for name, key, a, b in zip(
        ("start_stage", "fraction", "overcorrection"), ("start", "fraction", "oc"), old, new
    ):
        for i in np.flatnonzero(a != b).tolist():
            changed[i] = True
            how = FALLBACK if record.status == FALLBACK else staging.how.get((i, key), "speed")
            record.changes.append(Change(TOOTH_IDS[i], name, _number(a[i]), _number(b[i]), how))
    record.changes.sort(key=lambda c: (c.tooth, c.field))
    need = movement_mm(case.initial, case.target)
    planned_raw = need * final_progress(*old)
    planned_new = need * final_progress(*new)
    total = float(planned_raw.sum())
    record.kept_share = float(np.minimum(planned_raw, planned_new).sum() / total) if total > 0 else 1.0
    record.changed_share = float(planned_raw[changed].sum() / total) if total > 0 else float(changed.any())


def _number(x) -> float | int:
    return int(x) if isinstance(x, (np.integer, int)) else float(x)


# --- rewards and plans ---------------------------------------------------------------------------


def repair_cost(record: Repair | dict, scale: float = 1.0) -> float:
    """The scaled-reward cost of a repair: 0 unchanged, else ``scale`` times (REPAIR_COST_BASE plus
    REPAIR_COST_CHANGED times the share of the planned movement the repair changed). ``record``: a
    :class:`Repair` or its :meth:`Repair.as_dict`; ``scale`` > 0 (a training objective's choice: any
    positive cost keeps a repaired plan below the executed plan written directly)."""
    if not scale > 0:
        raise ValueError(
            f"the repair cost's scale must be > 0 (got {scale!r}): at 0 leaning on the engine is free"
        )
    status, changed = (
        (record["status"], record["changed_share"])
        if isinstance(record, dict)
        else (record.status, record.changed_share)
    )
    if status == UNCHANGED:
        return 0.0
    return scale * (REPAIR_COST_BASE + REPAIR_COST_CHANGED * changed)


def engine_reward(raw_result: dict, executed_result: dict, record: Repair) -> float:
    """The scaled reward a planner earns with the engine in the loop.

    * unchanged: the plan's own scaled reward (the raw and the executed result are one);
    * repaired: the executed plan's scaled reward less :func:`repair_cost`, strictly below what the
      executed plan earns written directly (it is then unchanged), so leaning on the engine gains
      nothing over writing the safe plan;
    * the fallback used, or the executed plan still breaking a rule: the raw plan's scaled reward (the
      failing band, as without the engine: the planner's plan was not executed).
    """
    if record.status == UNCHANGED:
        return float(raw_result["scaled_reward"])
    if record.status == FALLBACK or not record.safe:
        return float(raw_result["scaled_reward"])
    return float(executed_result["scaled_reward"]) - repair_cost(record)


def execute_plan_dicts(plans: Sequence[object], cases: Sequence[Case]) -> tuple[list[dict], Execution]:
    """:func:`execute_plans` of plans written as JSON-like values: the executed plans as plan dicts
    (:func:`spec_to_plan`; a plan the engine left unchanged is returned as given) and the Execution."""
    specs = [normalize_plan(p) for p in plans]
    run = execute_plans(specs, cases)
    dicts = [
        p if r.status == UNCHANGED else spec_to_plan(s, c.absent)
        for p, s, r, c in zip(plans, run.specs, run.records, cases)
    ]
    return dicts, run


def spec_to_plan(spec: PlanSpec, absent: np.ndarray | None = None) -> dict:
    """A plan dict that :func:`server.plans.normalize_plan` reads back to ``spec``'s per-tooth arrays
    exactly: the planner's groups kept where their teeth still share one staging, split where the engine
    changed some of them, and teeth in no group written only where they are not at uniform staging.
    Fractions and overcorrections are written as the exact floats. ``absent`` (28,) bool: teeth left out."""
    by_stage = {v: k for k, v in PRIORITY_START_STAGE.items()}
    oc = spec.overcorrections()
    group = spec.group if spec.group is not None else np.full(N_TEETH, -1)
    groups: dict[tuple, list[int]] = {}
    for i, fdi in enumerate(TOOTH_IDS):
        if absent is not None and absent[i]:
            continue
        value = (int(spec.start[i]), float(spec.fraction[i]), float(oc[i]))
        if group[i] < 0 and value == (1, UNIFORM_FRACTION, 0.0):
            continue
        key = (int(group[i]) if group[i] >= 0 else math.inf, *value)
        groups.setdefault(key, []).append(fdi)
    out = []
    for (_, s, f, o), teeth in sorted(groups.items()):
        g: dict = {"teeth": teeth, "fraction": f}
        if s in by_stage:
            g["priority"] = by_stage[s]
        else:
            g["start_stage"] = s
        if o > 0.0:
            g["overcorrection"] = o
        out.append(g)
    if not out:  # every tooth at uniform staging: one explicit group keeps it a plan
        out = [
            {
                "teeth": [t for i, t in enumerate(TOOTH_IDS) if absent is None or not absent[i]],
                "fraction": UNIFORM_FRACTION,
            }
        ]
    plan = {"tooth_groups": out}
    return {"strategy": spec.strategy, **plan} if spec.strategy else plan
