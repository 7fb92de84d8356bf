"""Cached rollouts: one scored episode per (completion, case), shared by the rewards.

TRL calls each reward function with the same batch of completions. The first call reads
every completion once (:func:`server.plan_text.read_plan_text`, the reading every face of the
environment uses) and scores **all plans of the batch's misses in one call** to
:func:`server.treatment.score_plan_specs` (vectorised over plans, stages and teeth); the
other rewards read the cached :class:`Rollout` objects.

A completion that is not a plan (no JSON object, no object holding ``tooth_groups``, a repeated
key in the plan, or no usable tooth group: :mod:`server.plan_text`) is not scored: its rollout
carries ``error`` = :data:`NO_PLAN` and ``not_a_plan`` the reader's reason, so every reward gives
it its minimum, as garbage, and the environment's ``score_plan`` scores it
:data:`server.reward_scaler.REWARD_MIN` too. (Only the internal baseline API,
:func:`server.treatment.score_plans`, reads a value with no usable group as uniform SLERP.)

Keys are ``(sha256 of the completion text, task_id, seed, force_decay, non_compliance, engine)`` (the :class:`server.cases.CaseKey` order, then whether the staging engine judged it): a full digest, so
two different completions never share an episode.
The cache is an LRU bounded by ``max_entries`` and safe to share between threads.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from orthojob.core.parsing import FORMAT_CHECKS, completion_text, format_checks
from server import treatment
from server.cases import CaseKey, generate_case
from server.plan_text import PlanReading, read_plan, read_plan_text
from server.plans import PlanSpec
from server.reward_scaler import REWARD_MIN
from server.staging_engine import REPAIRED, UNCHANGED, execute_plans, repair_cost, spec_to_plan

logger = logging.getLogger(__name__)

DEFAULT_MAX_ENTRIES: int = 4096
"""64 prompts x 64 generations, or many steps of a smaller batch."""
NO_PLAN: str = "the completion holds no plan"
"""The error of a completion that holds no plan (:mod:`server.plan_text`; its reason is the
rollout's ``not_a_plan``): it is not scored (no SLERP fallback credit)."""


@dataclass(frozen=True)
class Rollout:
    """One scored episode. Treat the dicts as read-only: cached rollouts are shared.

    Attributes:
        terminal_reward: the environment's raw terminal score in [0, 1] (before scaling).
        scaled_reward: the scale GRPO sees (:mod:`server.reward_scaler`), REWARD_MIN for an error.
        broken_rules: the hard clinical rules the plan breaks (empty for a safe plan).
        reward_breakdown: every scoring component by name (``collision_free``, ``movement_prior``, ...).
        diagnostics: counts and extremes of the episode (limit violations, peak PDL kPa, ...).
        format: :func:`orthojob.core.parsing.format_checks` of the parsed plan.
        plan: the parsed plan, or None when the completion held no JSON object.
        strategy: the plan's strategy if it is a known one, else None.
        error: None, or why the episode was not scored (NO_PLAN, or a failure); the rewards then
            give their minimum and the breakdown and diagnostics are empty.
        plan_format: the server's counts of usable and ignored plan parts (PlanFormat).
        not_a_plan: None for a plan, else why the completion is not one
            (:attr:`server.plan_text.PlanReading.reason`).
        repair: with the staging engine on (:func:`score_texts`), its record of this plan
            (:meth:`server.staging_engine.Repair.as_dict`: ``status`` unchanged, repaired or fallback,
            the rules the raw plan broke, the changes per tooth, the share of movement changed); None
            with the engine off or for a completion that is not a plan.
        executed: with the engine on, the rollout of the plan the engine executed where it changed the
            plan (its ``plan`` the executed plan dict, its ``format`` the completion's); None where the
            plan was executed as written (see :attr:`shipped`).
    """

    terminal_reward: float
    scaled_reward: float
    broken_rules: tuple
    reward_breakdown: dict
    diagnostics: dict
    format: dict
    plan: dict | None
    strategy: str | None
    error: str | None = None
    plan_format: dict = field(default_factory=dict)
    not_a_plan: str | None = None
    repair: dict | None = None
    executed: Rollout | None = None

    @property
    def shipped(self) -> Rollout:
        """The rollout of the plan that is carried out: the engine's executed plan where it changed the
        plan, else this one."""
        return self.executed if self.executed is not None else self

    @property
    def objective(self) -> Rollout:
        """What GRPO's objective judges with the engine in the loop at the engine's own repair cost:
        :meth:`objective_at` 1."""
        return self.objective_at(1.0)

    def objective_at(self, cost_scale: float) -> Rollout:
        """What GRPO's objective judges with the engine in the loop (a prompt row's ``engine`` column,
        :mod:`orthojob.rewards.reward_functions`): where the engine repaired the plan, the executed plan's
        rollout with its scaled reward less the repair's cost (:func:`server.staging_engine.repair_cost`
        at ``cost_scale`` > 0), strictly below what the executed plan earns written directly; else this
        one (a plan executed as written; a plan the fallback replaced keeps its raw, failing-band score;
        a completion that is not a plan)."""
        if self.executed is None or self.repair is None or self.repair["status"] != REPAIRED:
            return self
        cost = repair_cost(self.repair, cost_scale)
        return replace(self.executed, scaled_reward=self.executed.scaled_reward - cost)

    @property
    def changed(self) -> bool:
        """Whether the engine changed the plan (repaired it, or replaced it by its fallback)."""
        return self.repair is not None and self.repair["status"] != UNCHANGED


def completion_digest(text: str) -> str:
    """sha256 hex digest of a completion text (surrogates escaped, never raises)."""
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


def _case_key(seed: object, task_id: object, force_decay: object, non_compliance: object = False) -> CaseKey:
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"column 'seed' must hold integers, got {seed!r:.40}")
    if not isinstance(task_id, str):
        raise ValueError(f"column 'task_id' must hold strings, got {task_id!r:.40}")
    if force_decay is not None and not isinstance(force_decay, (bool, np.bool_)):
        raise ValueError(f"column 'force_decay' must hold booleans, got {force_decay!r:.40}")
    if non_compliance is not None and not isinstance(non_compliance, (bool, np.bool_)):
        raise ValueError(f"column 'non_compliance' must hold booleans, got {non_compliance!r:.40}")
    return CaseKey(task_id, int(seed), bool(force_decay), bool(non_compliance))


def _failed(plan: dict | None, fmt: dict, error: str, reason: str | None = None) -> Rollout:
    return Rollout(0.0, REWARD_MIN, (), {}, {}, fmt, plan, None, error, not_a_plan=reason)


def is_plan(plan: object) -> bool:
    """What the rewards count as a plan, for an already-decoded value
    (:func:`server.plan_text.read_plan`): an object holding ``tooth_groups`` with at least one
    usable tooth group (:func:`score_texts` gives anything else :data:`NO_PLAN`)."""
    return read_plan(plan).is_plan


def score_texts(texts: Sequence[str], cases: Sequence[CaseKey], engine: bool = False) -> list[Rollout]:
    """Rollouts of completion texts on cases (:class:`server.cases.CaseKey`): one batched server call.

    ``engine``: also execute every plan through the staging engine
    (:func:`server.staging_engine.execute_plans`, given the raw results, so a plan it leaves unchanged
    costs nothing more): each plan's rollout then carries the engine's ``repair`` record and, where the
    engine changed the plan, the ``executed`` plan's rollout. The raw rollout is scored as without it.

    Raises the environment's InvalidActionError for an unknown task id or a bad seed (a dataset
    error); never raises because of a completion's content.
    """
    resolved = [generate_case(*CaseKey(*case)) for case in cases]
    readings = []
    for t in texts:
        try:
            readings.append(read_plan_text(t))
        except Exception as exc:  # the reader promises never to raise; stay safe if it does
            readings.append(PlanReading(None, f"plan not readable: {type(exc).__name__}: {exc}"[:200]))
    plans = [r.found for r in readings]
    formats = [format_checks(r.found, r.plan_objects) for r in readings]
    out: list[Rollout | None] = [None] * len(plans)
    todo: list[int] = []
    specs: list[PlanSpec] = []
    for i, reading in enumerate(readings):
        if not reading.is_plan:
            out[i] = _failed(plans[i], formats[i], NO_PLAN, reading.reason)
            continue
        specs.append(reading.spec)
        todo.append(i)
    cases_todo = [resolved[i] for i in todo]
    try:
        results = treatment.score_plan_specs(specs, cases_todo) if todo else []
    except Exception:
        logger.exception("batch plan scoring failed; scoring the %d plans one by one", len(specs))
        results = []
        for spec, case in zip(specs, cases_todo):
            try:
                results.append(treatment.score_plan_specs([spec], [case])[0])
            except Exception as exc:
                results.append({"error": f"scoring failed: {type(exc).__name__}: {exc}"[:200]})
    for i, spec, res in zip(todo, specs, results):
        if "error" in res:
            out[i] = _failed(plans[i], formats[i], res["error"])
            continue
        if res["format"].get("absent_teeth_groups"):  # a tooth the patient lacks is not one of its ids
            formats[i] = {**formats[i], "teeth_ints": 0.0}
            formats[i]["total"] = sum(formats[i][k] for k in FORMAT_CHECKS) / len(FORMAT_CHECKS)
        out[i] = Rollout(
            terminal_reward=res["terminal_reward"],
            scaled_reward=res["scaled_reward"],
            broken_rules=tuple(res["broken_rules"]),
            reward_breakdown=res["reward_breakdown"],
            diagnostics=res["diagnostics"],
            format=formats[i],
            plan=plans[i],
            strategy=res["strategy"],
            error=None,
            plan_format=res.get("format") or asdict(spec.format),
        )
    if engine:
        _execute(out, todo, specs, cases_todo, results)
    return out


def _execute(out: list, todo: list[int], specs: list[PlanSpec], cases: list, results: list[dict]) -> None:
    """Attach the staging engine's record, and the executed plan's rollout where it changed the plan, to
    the rollouts ``out[todo]`` of ``specs`` on ``cases`` (their raw ``results``); a plan whose scoring
    failed is left as it is."""
    keep = [k for k, res in enumerate(results) if "error" not in res]
    if not keep:
        return
    run = execute_plans([specs[k] for k in keep], [cases[k] for k in keep], [results[k] for k in keep])
    for k, spec, record, res in zip(keep, run.specs, run.records, run.results):
        i, raw = todo[k], out[todo[k]]
        record = record.as_dict()
        executed = None
        if record["status"] != UNCHANGED:
            executed = replace(
                raw,
                terminal_reward=res["terminal_reward"],
                scaled_reward=res["scaled_reward"],
                broken_rules=tuple(res["broken_rules"]),
                reward_breakdown=res["reward_breakdown"],
                diagnostics=res["diagnostics"],
                plan=spec_to_plan(spec, cases[k].absent),
                strategy=res["strategy"],
                plan_format=res.get("format") or asdict(spec.format),
                repair=record,
            )
        out[i] = replace(raw, repair=record, executed=executed)


class RolloutCache:
    """Thread-safe LRU cache of rollouts keyed by (completion sha256, task_id, seed, force_decay)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be a positive integer, got {max_entries!r}")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, Rollout] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        """``{"hits", "misses", "entries", "max_entries"}``; a miss is one episode scored."""
        with self._lock:
            return {
                "hits": self.hits,
                "misses": self.misses,
                "entries": len(self._entries),
                "max_entries": self.max_entries,
            }

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def get_many(
        self,
        completions: Sequence[object],
        seeds: Sequence[object],
        task_ids: Sequence[object],
        force_decays: Sequence[object],
        non_compliances: Sequence[object] | None = None,
        engine: bool = False,
    ) -> list[Rollout]:
        """One rollout per completion (str or conversational), scoring every miss in one batched call.

        ``non_compliances``: the optional column (None: every case fully compliant). Duplicate keys
        within a batch are scored once (the repeats count as hits). ``engine``: rollouts that carry the
        staging engine's record (:func:`score_texts`), cached apart from those without.
        """
        n = len(completions)
        worn = [False] * n if non_compliances is None else non_compliances
        columns = (
            ("seed", seeds),
            ("task_id", task_ids),
            ("force_decay", force_decays),
            ("non_compliance", worn),
        )
        for name, column in columns:
            if len(column) != n:
                raise ValueError(f"column {name!r} has {len(column)} values for {n} completions")
        texts = [completion_text(c) for c in completions]
        cases = [_case_key(s, t, d, w) for s, t, d, w in zip(seeds, task_ids, force_decays, worn)]
        keys = [(completion_digest(text), *case, bool(engine)) for text, case in zip(texts, cases)]
        found: dict[tuple, Rollout] = {}
        todo: dict[tuple, int] = {}
        with self._lock:
            for i, key in enumerate(keys):
                if key in found or key in todo:
                    continue
                hit = self._entries.get(key)
                if hit is not None:
                    self._entries.move_to_end(key)
                    found[key] = hit
                else:
                    todo[key] = i
            self.misses += len(todo)
            self.hits += n - len(todo)
        if todo:
            idx = list(todo.values())
            fresh = score_texts([texts[i] for i in idx], [cases[i] for i in idx], engine=engine)
            with self._lock:
                for key, rollout in zip(todo, fresh):
                    found[key] = rollout
                    self._entries[key] = rollout
                    self._entries.move_to_end(key)
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
        return [found[k] for k in keys]


DEFAULT_CACHE = RolloutCache()
"""The cache the reward functions share (one per process)."""


__all__ = [
    "DEFAULT_CACHE",
    "DEFAULT_MAX_ENTRIES",
    "Rollout",
    "RolloutCache",
    "completion_digest",
    "score_texts",
]
