"""The agentic tools of one aligner-staging episode: what an LLM agent calls, over TRL
(:class:`orthojob.agentic.tools.DentalToolEnv`) or MCP (:mod:`server.serving.mcp_tools`), with one implementation.

Tools (every argument checked; a bad one raises :class:`ToolError`, answered as ``"error: ..."``
text by :func:`_tool`, and changes nothing):

====================  ==========================================================================
inspect_tooth         one tooth's remaining movement (mm, deg), planned progress, crown data
simulate_stage        the next aligner tried, not worn: step reward, accuracy, new violations
check_collisions      contacts of the current arch, or of a proposed aligner's shape
commit_stage          wear the next aligner (:meth:`StepwiseDentalEnvironment.commit_stage`);
                      the 24th finishes the episode, scored as the stepwise episode
rollback_stage        undo the last aligner (at most 2 per episode)
submit_plan           score a whole plan in the plan format (:mod:`server.plans`) with the
                      plan scoring of :func:`server.treatment.score_plan_specs`; finishes the episode
                      (a text that is not a plan, :mod:`server.plan_text`, is refused with the reason)
====================  ==========================================================================

**A stage** (the ``groups`` argument) is a list of tooth groups ``{"teeth": [FDI ids],
"fraction": f}``: this aligner moves each listed tooth a further share ``f`` in [0, 1] of its total
movement (initial to target; translation linearly, rotation by SLERP, as :mod:`server.plans`),
capped at the target; teeth in no group hold their planned position. A tooth may be in one group;
unknown keys, ids or non-finite fractions are errors.

:class:`StagingTools` works on anything with the episode store's tool calls
(:class:`server.dental_environment.StepwiseDentalEnvironment`, or the job's remote client of the
server); it keeps the episode's planned progress and violation history, which turn a stage's groups
into poses and a step's counters into the stage report. Its public methods are exactly the tools
(TRL exposes every public function of the class as one).
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from server.cases import Case, CaseKey
from server.clinical_profiles import STRATEGIES
from server.dental_constants import (
    MAX_ROTATION_DEG,
    MAX_TRANSLATION_MM,
    N_TEETH,
    TOOTH_IDS,
    TOOTH_INDEX,
)
from server.dental_environment import MAX_ROLLBACKS, StepwiseDentalEnvironment
from server.errors import InvalidActionError, StageConflictError, UnknownEpisodeError
from server.plan_text import read_plan
from server.plans import StagePoses
from server.reward_scaler import REWARD_MAX, REWARD_MIN
from server.treatment import score_plan_specs

log = logging.getLogger(__name__)

TOOL_NAMES: tuple[str, ...] = (
    "inspect_tooth",
    "simulate_stage",
    "check_collisions",
    "commit_stage",
    "rollback_stage",
    "submit_plan",
)
"""The tools of :class:`StagingTools`, in the order the instructions list them."""
GROUP_KEYS: frozenset[str] = frozenset({"teeth", "fraction"})
"""The keys of one tooth group of a stage."""


class ToolError(ValueError):
    """A tool argument the environment refuses; its message goes back to the model."""


@dataclass
class EpisodeMetrics:
    """Per-episode tool metrics: calls by tool, invalid calls, rollbacks used, how it finished."""

    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOOL_NAMES, 0))
    invalid: int = 0
    rollbacks: int = 0
    stages_committed: int = 0
    finished_by: str | None = None  # "submit_plan" or "commit_stage" (24 stages), None if unfinished
    env_seconds: float = field(default=0.0, compare=False)  # wall time in reset and the tools (not compared)


def _tool(func: Callable) -> Callable:
    """A tool method: counts the call, turns every bad argument or refused action into an
    ``"error: ..."`` string (counted as invalid) and never raises. Signature and docstring are
    kept (``functools.wraps``), so TRL derives the same schema as for the bare method."""
    signature = inspect.signature(func)
    params = list(signature.parameters.values())[1:]  # after self
    names = frozenset(p.name for p in params)
    required = frozenset(p.name for p in params if p.default is inspect.Parameter.empty)

    @functools.wraps(func)
    def tool(self: StagingTools, *args, **kwargs) -> str:
        name = func.__name__
        metrics = self._metrics
        metrics.calls[name] = metrics.calls.get(name, 0) + 1
        t0 = time.perf_counter()
        try:
            # TRL calls with keywords: known names, the required ones present, bind not needed (its
            # cost is a tenth of a fast tool's); anything else is bound for the exact message
            if args or not (required <= kwargs.keys() <= names):
                try:
                    signature.bind(self, *args, **kwargs)
                except TypeError as exc:
                    raise ToolError(f"bad arguments for {name}: {exc}") from None
            if self._case is None:
                raise ToolError("no episode: the environment was not reset")
            if metrics.finished_by is not None:
                raise ToolError(
                    f"the episode is finished ({metrics.finished_by}); no further tool calls count"
                )
            return func(self, *args, **kwargs)
        except (ToolError, InvalidActionError, StageConflictError, UnknownEpisodeError) as exc:
            metrics.invalid += 1
            message = exc.args[0] if exc.args else str(exc)
            return f"error: {message}"
        except Exception as exc:  # a tool never raises out to the trainer
            metrics.invalid += 1
            log.warning("tool %s failed: %s: %s", name, type(exc).__name__, exc)
            return f"error: {name} failed ({type(exc).__name__}: {str(exc)[:200]})"
        finally:
            metrics.env_seconds += time.perf_counter() - t0

    return tool


def _compact(value: object) -> str:
    """Compact JSON of a tool result, floats rounded to 4 digits."""

    def rounded(v: object) -> object:
        if isinstance(v, float):
            return round(v, 4) if math.isfinite(v) else None
        if isinstance(v, dict):
            return {k: rounded(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [rounded(x) for x in v]
        return v

    return json.dumps(rounded(value), separators=(",", ":"))


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


class StagingTools:
    """One agentic episode's tools over an episode store (module docstring).

    A subclass starts the episode (its own ``reset``) and then calls :meth:`_begin` with the stage-0
    observation and the case. After an episode: :attr:`reward`, :attr:`result`, :attr:`metrics`,
    :attr:`finished`.
    """

    def __init__(self, env: Any) -> None:
        self._env = env
        self._violations: list[dict] = []
        self._episode_id: str | None = None
        self._case: Case | None = None
        self._stage_poses_of: StagePoses | None = None
        self._key: CaseKey | None = None
        self._progress: list[np.ndarray] = []
        self._result: dict | None = None
        self._metrics = EpisodeMetrics()

    def _begin(self, observation: dict, case: Case) -> None:
        """Attach to a fresh episode (stage 0): its observation and case; the metrics start anew."""
        self._episode_id = observation["episode_id"]
        self._case = case
        self._key = CaseKey(case.task_id, int(case.seed), bool(case.force_decay))
        self._stage_poses_of = StagePoses(case.initial, case.target)
        self._violations = [observation["violations"]]
        self._progress = [np.zeros(N_TEETH)]
        self._result = None
        self._metrics = EpisodeMetrics()

    @property
    def finished(self) -> bool:
        """Whether the episode ended (a plan submitted, or all 24 stages committed)."""
        return self._metrics.finished_by is not None

    @property
    def metrics(self) -> EpisodeMetrics:
        """This episode's tool metrics."""
        return self._metrics

    @property
    def result(self) -> dict | None:
        """The finished episode's score: ``scaled_reward``, ``terminal_reward``, ``reward_breakdown``,
        ``broken_rules``, ``finished_by``; None while unfinished."""
        return self._result

    @property
    def reward(self) -> float:
        """The scaled terminal reward in [REWARD_MIN, REWARD_MAX]; REWARD_MIN while unfinished."""
        if self._result is None:
            return REWARD_MIN
        value = float(self._result["scaled_reward"])
        return min(max(value, REWARD_MIN), REWARD_MAX) if math.isfinite(value) else REWARD_MIN

    # --- tools -----------------------------------------------------------------------------

    @_tool
    def inspect_tooth(self, tooth_id: int) -> str:
        """Inspect one tooth: its remaining movement, planned progress and crown data.

        Args:
            tooth_id: FDI id of the tooth (11-17, 21-27, 31-37, 41-47).

        Returns:
            JSON: tooth class, current stage, translation_remaining_mm (mm), rotation_remaining_deg
            (degrees), planned_progress (share of its total movement planned so far, 0-1),
            min_stages_left (fewest stages within the per-stage limits), crown width (mm) and
            root area (mm^2).
        """
        if not (isinstance(tooth_id, (int, np.integer)) and not isinstance(tooth_id, bool)) or (
            int(tooth_id) not in TOOTH_INDEX
        ):
            raise ToolError(f"unknown tooth_id {tooth_id!r:.20}: use an FDI id of {list(TOOTH_IDS)}")
        info = self._env.inspect_tooth(self._episode_id, int(tooth_id))
        t, r = info["translation_remaining_mm"], info["rotation_remaining_deg"]
        return _compact(
            {
                "tooth_id": info["tooth_id"],
                "tooth_class": info["tooth_class"],
                "current_stage": info["current_stage"],
                "translation_remaining_mm": t,
                "rotation_remaining_deg": r,
                "planned_progress": float(self._progress[-1][TOOTH_INDEX[int(tooth_id)]]),
                "min_stages_left": math.ceil(max(t / MAX_TRANSLATION_MM, r / MAX_ROTATION_DEG) - 1e-9),
                "crown_width_mm": info["crown_width_mm"],
                "root_area_mm2": info["root_area_mm2"],
            }
        )

    @_tool
    def simulate_stage(self, groups: list[dict], strategy: str | None = None) -> str:
        """Try the next aligner on the simulator without wearing it (the episode does not change).

        Args:
            groups: the stage, a list of tooth groups {"teeth": [FDI ids], "fraction": f}; the aligner
                moves each listed tooth a further share f in [0, 1] of its total movement (initial to
                target); teeth in no group hold still.
            strategy: the treatment strategy, optional (one of the plan format's strategies).

        Returns:
            JSON: the stage number, step_reward, accuracy (share of the required movement achieved,
            0-1), the stage's new violations (teeth over the per-stage limits, colliding contacts,
            ligament-stress events) and the colliding pairs with their penetration (mm).
        """
        poses, _ = self._stage_poses(groups)
        obs = self._env.simulate_step(self._episode_id, poses, _strategy(strategy))
        return _compact(self._stage_report(obs, committed=False))

    @_tool
    def check_collisions(self, groups: list[dict] | None = None) -> str:
        """Check adjacent-crown contacts of the current arch, or of a proposed aligner's shape.

        Args:
            groups: optional stage in the simulate_stage format; without it, the current arch.

        Returns:
            JSON: collision_free, severity (0-1) and the colliding pairs with penetration (mm).
        """
        poses = None if groups is None else self._stage_poses(groups)[0]
        return _compact(self._env.check_collisions(self._episode_id, poses))

    @_tool
    def commit_stage(self, groups: list[dict], strategy: str | None = None) -> str:
        """Wear the next aligner: the episode advances one stage; the 24th stage finishes it.

        Args:
            groups: the stage, in the simulate_stage format.
            strategy: the treatment strategy, optional (the last one given is scored).

        Returns:
            JSON: as simulate_stage, plus stages_remaining; after stage 24 the episode's score.
        """
        poses, progress = self._stage_poses(groups)
        obs = self._env.commit_stage(self._episode_id, poses, _strategy(strategy))
        self._progress.append(progress)
        self._violations.append(obs["violations"])
        self._metrics.stages_committed = obs["current_stage"]
        report = self._stage_report(obs, committed=True)
        if obs["done"]:
            terminal = (
                self._env.sessions.get(self._episode_id).terminal
                if isinstance(self._env, StepwiseDentalEnvironment)
                else self._env.terminal()
            )
            self._finish("commit_stage", terminal)
            report["score"] = self._score_report()
        return _compact(report)

    @_tool
    def rollback_stage(self) -> str:
        """Undo the last worn aligner and its violations (at most 2 rollbacks per episode).

        Returns:
            JSON: the stage the episode is back at and the rollbacks left.
        """
        obs = self._env.rollback_stage(self._episode_id)
        self._progress.pop()
        self._violations.pop()
        self._metrics.rollbacks += 1
        self._metrics.stages_committed = obs["current_stage"]
        return _compact(
            {"current_stage": obs["current_stage"], "rollbacks_left": MAX_ROLLBACKS - self._metrics.rollbacks}
        )

    @_tool
    def submit_plan(self, plan: str) -> str:
        """Submit the whole treatment plan; it is scored and the episode finishes.

        Args:
            plan: the plan as JSON text in the plan format: {"strategy": ..., "tooth_groups": [{"teeth":
                [FDI ids], "fraction": share per stage, "priority": "high" | "medium" | "low"}, ...]}.

        Returns:
            JSON: the plan's score (scaled reward, terminal score, broken hard rules).
        """
        if not isinstance(plan, (str, dict)):
            raise ToolError(f"plan must be JSON text (a string), got {type(plan).__name__}")
        self._finish("submit_plan", self._score_plan_text(plan))
        return _compact(self._score_report())

    # --- internals -------------------------------------------------------------------------

    def _score_plan_text(self, plan: str | dict) -> dict:
        """The score of a submitted plan text on this episode's case: ``terminal_reward``,
        ``scaled_reward``, ``reward_breakdown``, ``broken_rules``. The text is read as every face
        reads a plan (:func:`server.plan_text.read_plan_text`, as the one-shot rewards read a
        completion; a plan sent as an object, as MCP and the WebSocket decode it, by
        :func:`server.plan_text.read_plan`); one that is not a plan is a ToolError with the reader's reason."""
        reading = read_plan(plan)
        if not reading.is_plan:
            raise ToolError(reading.reason)
        (res,) = score_plan_specs([reading.spec], [self._case])
        if "error" in res:
            raise ToolError(f"the plan could not be scored: {res['error']}")
        return {k: res[k] for k in ("terminal_reward", "scaled_reward", "reward_breakdown", "broken_rules")}

    def _stage_poses(self, groups: object) -> tuple[np.ndarray, np.ndarray]:
        """The next aligner's poses (28, 7) and planned progress (28,) of a stage's groups."""
        increment = _stage_increment(groups, self._case.absent if self._case is not None else None)
        progress = np.minimum(self._progress[-1] + increment, 1.0)
        return self._stage_poses_of(progress), progress

    def _stage_report(self, obs: dict, committed: bool) -> dict:
        stage = obs["current_stage"]
        before = self._violations[-2] if committed else self._violations[-1]
        after = obs["violations"]
        new = {k: int(after[k]) - int(before[k]) for k in ("limits", "collisions", "pdl")}
        # the colliding pairs, only when the step counted a colliding contact (most stages have
        # none: then the list is empty and the arch is not checked a second time)
        pairs = (
            self._env.check_collisions(self._episode_id, obs["current_config"])["pairs"]
            if new["collisions"]
            else []
        )
        report = {
            "stage": stage,
            "committed": committed,
            "step_reward": obs["step_reward"],
            "accuracy": obs["reward_breakdown"].get("accuracy"),
            "new_violations": new,
            "colliding_pairs": pairs,
        }
        if committed:
            report["stages_remaining"] = obs["stages_remaining"]
        return report

    def _finish(self, how: str, terminal: dict) -> None:
        self._metrics.finished_by = how
        self._result = {
            "finished_by": how,
            "terminal_reward": float(terminal["terminal_reward"]),
            "scaled_reward": float(terminal["scaled_reward"]),
            "reward_breakdown": dict(terminal["reward_breakdown"]),
            "broken_rules": list(terminal["broken_rules"]),
        }

    def _score_report(self) -> dict:
        r = self._result
        return {
            "finished": True,
            "scaled_reward": r["scaled_reward"],
            "terminal_reward": r["terminal_reward"],
            "broken_rules": r["broken_rules"],
        }


def _strategy(strategy: object) -> str | None:
    if strategy is None:
        return None
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ToolError(f"strategy must be one of {', '.join(STRATEGIES)} or omitted, got {strategy!r:.60}")
    return strategy


def _stage_increment(groups: object, absent: np.ndarray | None = None) -> np.ndarray:
    """(28,) share of each tooth's total movement a stage adds (ToolError naming what is wrong; a
    tooth of the ``absent`` (28,) bool mask is one)."""
    if not isinstance(groups, (list, tuple)):
        raise ToolError(
            f'groups must be a list of {{"teeth": [FDI ids], "fraction": f}} objects, got {type(groups).__name__}'
        )
    if len(groups) > N_TEETH:
        raise ToolError(f"a stage has at most {N_TEETH} groups, got {len(groups)}")
    increment = np.zeros(N_TEETH)
    seen: dict[int, int] = {}
    for k, group in enumerate(groups):
        if not isinstance(group, dict):
            raise ToolError(
                f'group {k}: expected an object {{"teeth": [FDI ids], "fraction": f}}, got {type(group).__name__}'
            )
        if set(group) != GROUP_KEYS:
            raise ToolError(
                f"group {k}: keys must be exactly 'teeth' and 'fraction', got {sorted(map(str, group))}"
            )
        f = group["fraction"]
        if not _is_number(f) or not math.isfinite(float(f)) or not 0.0 <= float(f) <= 1.0:
            raise ToolError(f"group {k}: fraction must be a finite number in [0, 1], got {f!r:.40}")
        teeth = group["teeth"]
        if not isinstance(teeth, (list, tuple)) or not teeth:
            raise ToolError(f"group {k}: teeth must be a non-empty list of FDI ids, got {teeth!r:.60}")
        for tooth in teeth:
            if (
                isinstance(tooth, bool)
                or not isinstance(tooth, (int, np.integer))
                or int(tooth) not in TOOTH_INDEX
            ):
                raise ToolError(f"group {k}: unknown tooth {tooth!r:.20}: use FDI ids of {list(TOOTH_IDS)}")
            if int(tooth) in seen:
                raise ToolError(f"group {k}: tooth {int(tooth)} is already in group {seen[int(tooth)]}")
            if absent is not None and absent[TOOTH_INDEX[int(tooth)]]:
                raise ToolError(f"group {k}: tooth {int(tooth)} is absent in this patient: leave it out")
            seen[int(tooth)] = k
            increment[TOOTH_INDEX[int(tooth)]] = float(f)
    return increment
