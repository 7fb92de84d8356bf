"""Agentic GRPO: the stepwise environment as tools, through TRL's ``environment_factory``.

TRL 1.16's GRPOTrainer (``environment_factory=DentalToolEnv``) makes one :class:`DentalToolEnv`
per rollout (pooled and reused), calls ``reset(**row)`` with the dataset row (columns ``seed``,
``task_id``, ``force_decay``; ``prompt`` is ignored) and appends the text it returns, the case
(:func:`orthojob.prompts.case_description`), to the last user message. Every public method is a
tool: TRL derives its JSON schema from the signature and the Google-style docstring
(``transformers.utils.get_json_schema``), parses the model's ``<tool_call>`` JSON, calls the method
and feeds the returned text back as a ``tool`` message, up to ``max_tool_calling_iterations``
assistant turns.

Tools (every argument checked; a bad one returns ``"error: ..."`` and changes nothing):

====================  ==========================================================================
inspect_tooth         one tooth's remaining movement (mm, deg), planned progress, crown data
simulate_stage        the next aligner tried, not worn: step reward, accuracy, new violations
check_collisions      contacts of the current arch, or of a proposed aligner's shape
commit_stage          wear the next aligner (:meth:`StepwiseDentalEnvironment.commit_stage`);
                      the 24th finishes the episode, scored as the stepwise episode
rollback_stage        undo the last aligner (at most 2 per episode)
submit_plan           score a whole plan in the plan format (:mod:`server.plans`) with the
                      one-shot rewards' scoring (:func:`orthojob.rollouts.score_texts`);
                      finishes the episode
====================  ==========================================================================

**A stage** (the ``groups`` argument) is a list of tooth groups ``{"teeth": [FDI ids],
"fraction": f}``: this aligner moves each listed tooth a further share ``f`` in [0, 1] of its total
movement (initial to target; translation linearly, rotation by SLERP, as :mod:`server.plans`),
capped at the target; teeth in no group hold their planned position. This is the plan format's
``fraction`` applied to one stage, so a plan is a sequence of such stages; the model never types
28 x 7 poses. A tooth may be in one group; unknown keys, ids or non-finite fractions are errors.

**Reward.** The environment owns it (:attr:`DentalToolEnv.reward`): the scaled terminal reward
(:mod:`server.reward_scaler`, [-2, 8]) of the submitted plan, or of the 24 committed stages;
REWARD_MIN for an episode that did not finish. :func:`reward_agentic` is the TRL reward function
that reads it from the ``environments`` TRL passes, and logs per step (``log_metric``) the tool
metrics of :func:`episode_metrics` (``agentic/*``) and the finished episodes' scoring components.
The environment deliberately has no ``get_reward`` method: TRL would add that as a second reward
column with weight 1, counting the same score twice.

Non-tool members are private or properties: TRL exposes every public function as a tool.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from orthojob.prompts import PLAN_SEMANTICS, case_description, reset_observation
from orthojob.rollouts import NO_PLAN, score_texts
from server.cases import HELDOUT_SEED_START, TASK_IDS, CaseKey, generate_case
from server.clinical_profiles import STRATEGIES
from server.dental_constants import (
    MAX_ROTATION_DEG,
    MAX_TRANSLATION_MM,
    N_STAGES,
    N_TEETH,
    TOOTH_IDS,
    TOOTH_INDEX,
)
from server.dental_environment import MAX_ROLLBACKS, StepwiseDentalEnvironment
from server.errors import InvalidActionError, StageConflictError, UnknownEpisodeError
from server.plans import StagePoses, normalize_plan
from server.reward_scaler import REWARD_MAX, REWARD_MIN

log = logging.getLogger(__name__)

TOOL_NAMES: tuple[str, ...] = (
    "inspect_tooth",
    "simulate_stage",
    "check_collisions",
    "commit_stage",
    "rollback_stage",
    "submit_plan",
)
"""The tools of :class:`DentalToolEnv`, in the order the instructions list them."""
GROUP_KEYS: frozenset[str] = frozenset({"teeth", "fraction"})
"""The keys of one tooth group of a stage."""
MAX_TEXT_CHARS: int = 20_000
"""A submitted plan longer than this is refused (a plan is a few hundred characters)."""

AGENTIC_SYSTEM_PROMPT: str = (
    "You are an orthodontic treatment planner for clear aligner therapy. You examine a case with "
    "tools, try stages on the simulator, and finish by submitting the whole staging plan."
)

AGENTIC_INSTRUCTIONS: str = f"""\
Plan a clear-aligner treatment of {N_STAGES} aligners with the tools. The case follows this message.
- inspect_tooth(tooth_id): one tooth's remaining movement and planned progress.
- simulate_stage(groups, strategy): try the next aligner without wearing it.
- check_collisions(groups): contacts of the current arch, or of a proposed aligner.
- commit_stage(groups, strategy): wear the next aligner; the {N_STAGES}th finishes the episode.
- rollback_stage(): undo the last aligner (at most {MAX_ROLLBACKS} per episode).
- submit_plan(plan): submit the whole plan as JSON (format below); this finishes the episode.
A stage (groups) is a list of {{"teeth": [FDI ids], "fraction": f}}: the aligner moves each tooth \
a further share f in [0, 1] of its total movement (initial to target); teeth in no group hold still. \
Limits: {MAX_TRANSLATION_MM:g} mm and {MAX_ROTATION_DEG:g} deg per tooth per stage. An episode that \
ends without a submitted plan or {N_STAGES} committed stages scores the minimum.

The plan for submit_plan:
{PLAN_SEMANTICS}"""
"""The user message of an agentic prompt, before the case that ``reset`` appends."""


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
    def tool(self: DentalToolEnv, *args, **kwargs) -> str:
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


class DentalToolEnv:
    """One agentic episode on the in-process :class:`StepwiseDentalEnvironment` (module docstring).

    Usable as TRL's ``environment_factory`` (the class itself is the factory). After an episode:
    :attr:`reward`, :attr:`result`, :attr:`metrics`, :attr:`finished`.
    """

    def __init__(self, env_url: str | None = None) -> None:
        # in process: one episode at a time, a small store and a TTL no generation outlasts;
        # with env_url: the server's episode, over one WebSocket (RemoteStepwise)
        self._env = (
            StepwiseDentalEnvironment(max_sessions=2, ttl_seconds=1e9)
            if env_url is None
            else RemoteStepwise(env_url)
        )
        self._violations: list[dict] = []
        self._episode_id: str | None = None
        self._case = None
        self._stage_poses_of: StagePoses | None = None
        self._key: CaseKey | None = None
        self._progress: list[np.ndarray] = []
        self._result: dict | None = None
        self._metrics = EpisodeMetrics()

    # --- episode (not tools) ---------------------------------------------------------------

    def reset(
        self, seed: int | None = None, task_id: str = "task_easy", force_decay: bool = False, **kwargs
    ) -> str:
        """Start the episode of a dataset row (``seed``, ``task_id``, ``force_decay``; other
        columns ignored) and return the case as text (:func:`orthojob.prompts.case_description`).

        A bad row raises ValueError (a dataset error, not the model's)."""
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"column 'seed' must hold integers, got {seed!r:.40}")
        if task_id not in TASK_IDS:
            raise ValueError(f"column 'task_id' must be one of {TASK_IDS}, got {task_id!r:.40}")
        t0 = time.perf_counter()
        if self._episode_id is not None:
            self._env.close_episode(self._episode_id)
        self._key = CaseKey(task_id, int(seed), bool(force_decay))
        obs = self._env.reset(task_id=task_id, seed=int(seed), force_decay=bool(force_decay))
        self._episode_id = obs["episode_id"]
        self._case = (
            self._env.sessions.get(self._episode_id).case
            if isinstance(self._env, StepwiseDentalEnvironment)
            else generate_case(*self._key)  # the server's case: a pure function of its key
        )
        self._stage_poses_of = StagePoses(self._case.initial, self._case.target)
        self._violations = [obs["violations"]]
        self._progress = [np.zeros(N_TEETH)]
        self._result = None
        self._metrics = EpisodeMetrics()
        text = _case_text(obs)
        self._metrics.env_seconds = time.perf_counter() - t0
        return text

    def _close(self) -> None:
        """Release the episode: over the server, close the WebSocket session (the server drops its
        episode); in process, forget it. Private, so not a tool; for the end of a run (TRL calls no
        tool after training)."""
        if isinstance(self._env, RemoteStepwise):
            self._env.close()
        elif self._episode_id is not None:
            self._env.close_episode(self._episode_id)
        self._episode_id = None

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
        if isinstance(plan, dict):
            plan = json.dumps(plan)
        if not isinstance(plan, str):
            raise ToolError(f"plan must be JSON text (a string), got {type(plan).__name__}")
        if len(plan) > MAX_TEXT_CHARS:
            raise ToolError(f"plan is {len(plan)} characters; a plan is at most {MAX_TEXT_CHARS}")
        (rollout,) = score_texts([plan], [self._key])
        if rollout.error == NO_PLAN:
            raise ToolError(
                'no usable tooth group in the plan: send {"strategy": ..., "tooth_groups": [{"teeth": [FDI ids], '
                '"fraction": f, "priority": ...}]} with at least one known tooth and a fraction in [0, 1]'
            )
        if rollout.error:
            raise ToolError(f"the plan could not be scored: {rollout.error}")
        self._finish(
            "submit_plan",
            {
                "terminal_reward": rollout.terminal_reward,
                "scaled_reward": rollout.scaled_reward,
                "reward_breakdown": dict(rollout.reward_breakdown),
                "broken_rules": list(rollout.broken_rules),
            },
        )
        return _compact(self._score_report())

    # --- internals -------------------------------------------------------------------------

    def _stage_poses(self, groups: object) -> tuple[np.ndarray, np.ndarray]:
        """The next aligner's poses (28, 7) and planned progress (28,) of a stage's groups."""
        increment = _stage_increment(groups)
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


def _stage_increment(groups: object) -> np.ndarray:
    """(28,) share of each tooth's total movement a stage adds (ToolError naming what is wrong)."""
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
            seen[int(tooth)] = k
            increment[TOOTH_INDEX[int(tooth)]] = float(f)
    return increment


class RemoteStepwise:
    """What :class:`DentalToolEnv` asks of :class:`StepwiseDentalEnvironment`, over the environment
    server (``python -m server.app``): one WebSocket session (:class:`orthojob.env_client.EnvSession`,
    OpenEnv's client) per environment, reset and commits as OpenEnv's reset/step messages (with
    ``expected_stage``), the other tools as the server's ``tool`` message on the session's own
    episode. A refused action comes back as the same :class:`InvalidActionError` message as in
    process; a lost episode (server restart, idle reaping) as a :class:`ToolError`. A plan given to
    ``submit_plan`` is scored in process (the one-shot rewards' scoring), as without a server."""

    def __init__(self, url: str, message_timeout_s: float = 60.0) -> None:
        from orthojob.env_client import EnvSession

        self.url = url
        self.session = EnvSession(url, message_timeout_s=message_timeout_s)

    def _guard(self, call: Callable) -> dict:
        from orthojob.env_client import EnvServerError, EpisodeLostError

        try:
            return call()
        except EnvServerError as exc:
            message = str(exc.data.get("message") or exc)
            if exc.code == "STAGE_CONFLICT":
                raise StageConflictError(message, exc.data.get("current_stage")) from None
            raise InvalidActionError(message) from None
        except EpisodeLostError as exc:
            raise ToolError(f"the environment server lost this episode: {exc}") from None

    def reset(self, task_id: str, seed: int, force_decay: bool) -> dict:
        return self.session.reset(task_id=task_id, seed=seed, force_decay=force_decay).observation

    def close_episode(self, episode_id: str) -> bool:
        return False  # the next reset releases it on the server; close() closes the session

    def inspect_tooth(self, episode_id: str, tooth_id: int) -> dict:
        return self._guard(lambda: self.session.tool("inspect_tooth", tooth_id=int(tooth_id)))

    def simulate_step(self, episode_id: str, poses: np.ndarray, strategy: str | None = None) -> dict:
        return self._guard(lambda: self.session.tool("simulate", poses=_listed(poses), strategy=strategy))

    def check_collisions(self, episode_id: str, poses: object | None = None) -> dict:
        return self._guard(
            lambda: self.session.tool("collisions", poses=None if poses is None else _listed(poses))
        )

    def commit_stage(self, episode_id: str, poses: np.ndarray, strategy: str | None = None) -> dict:
        result = self._guard(lambda: self.session.step(_listed(poses), strategy))
        return {**result.observation, "done": result.done}  # OpenEnv's frame carries done beside it

    def rollback_stage(self, episode_id: str) -> dict:
        return self._guard(lambda: self.session.tool("rollback", expected_stage=self.session.stage))

    def terminal(self) -> dict:
        return self._guard(lambda: self.session.tool("terminal"))["terminal"]

    def close(self) -> None:
        self.session.close()


def _listed(poses: object) -> object:
    return poses.tolist() if isinstance(poses, np.ndarray) else poses


class RemoteToolEnvFactory:
    """TRL's ``environment_factory`` for ``--env-url``: ``factory()`` is a :class:`DentalToolEnv` on
    the server at ``env_url`` (its WebSocket session opened at its first ``reset``). It keeps what it
    made, so that :meth:`close` can close their sessions when training ends: TRL pools its
    environments for the whole run and never closes them; the server would otherwise hold them
    until its idle timeout reaps them."""

    def __init__(self, env_url: str) -> None:
        self.env_url = env_url
        self.made: list[DentalToolEnv] = []

    def __call__(self) -> DentalToolEnv:
        env = DentalToolEnv(env_url=self.env_url)
        self.made.append(env)
        return env

    def close(self) -> int:
        """Close every session made so far; how many environments that was."""
        made, self.made = self.made, []
        for env in made:
            env._close()
        return len(made)


def check_server_capacity(url: str, needed: int, timeout_s: float = 10.0) -> dict:
    """The server's WebSocket settings (``GET /status``), when it can hold ``needed`` sessions at
    once (one per rollout of a generation batch); else a ValueError that says what to change."""
    import urllib.error
    import urllib.request

    status_url = url.rstrip("/") + "/status"
    try:
        with urllib.request.urlopen(status_url, timeout=timeout_s) as response:
            status = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ValueError(
            f"--env-url {url}: the environment server's {status_url} did not answer ({exc})"
        ) from None
    ws = status.get("websocket_sessions") or {}
    capacity, live = ws.get("max_sessions"), ws.get("live", 0)
    if not isinstance(capacity, int):
        raise ValueError(
            f"--env-url {url}: {status_url} reports no WebSocket capacity (websocket_sessions.max_sessions)"
        )
    if capacity - live < needed:
        raise ValueError(
            f"--env-url {url}: the server holds {capacity} WebSocket sessions ({live} in use), fewer than the "
            f"{needed} rollouts of a generation batch, each holding one; start it with --max-sessions {needed + live} "
            f"(ORTHORL_MAX_SESSIONS) or lower --batch-size"
        )
    return ws


# --- the dataset and the reward ---------------------------------------------------------------


def agentic_messages() -> list[dict]:
    """The prompt of every agentic row (system + instructions); ``reset`` appends the case."""
    return [
        {"role": "system", "content": AGENTIC_SYSTEM_PROMPT},
        {"role": "user", "content": AGENTIC_INSTRUCTIONS},
    ]


def agentic_rows(n: int, seed_start: int, task_id: str, force_decay: bool) -> list[dict]:
    """``n`` dataset rows ``{"prompt", "seed", "task_id", "force_decay"}`` (seeds from seed_start,
    below the held-out seeds), as :func:`orthojob.prompts.prompt_rows` without the case in the prompt."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    if seed_start + n > HELDOUT_SEED_START:
        raise ValueError(
            f"seeds {seed_start}..{seed_start + n - 1} reach the held-out seeds ({HELDOUT_SEED_START})"
        )
    if task_id not in TASK_IDS:
        raise ValueError(f"task_id must be one of {TASK_IDS}, got {task_id!r}")
    return [
        {"prompt": agentic_messages(), "seed": seed, "task_id": task_id, "force_decay": bool(force_decay)}
        for seed in range(seed_start, seed_start + n)
    ]


def full_prompt(row: dict) -> list[dict]:
    """The messages the policy sees for a row: the row's prompt with the case appended to the last
    user message, as TRL does with the text ``reset`` returns (used to measure prompt lengths)."""
    obs = reset_observation(int(row["seed"]), row["task_id"], bool(row["force_decay"]))
    messages = [dict(m) for m in row["prompt"]]
    messages[-1]["content"] += _case_text(obs)
    return messages


def plan_stages(plan: dict) -> list[list[dict]]:
    """A plan (the plan format) as the ``groups`` of its 24 stages, for ``commit_stage``: at stage s
    each tooth whose group has started (``priority`` / ``start_stage``) moves its ``fraction``; teeth
    of one fraction share a group. Overcorrection is dropped (a stage stops at the target). What an
    agent following the oracle's plan stage by stage commits (the benchmark's stepwise episode)."""
    spec = normalize_plan(plan)
    stages = []
    for s in range(1, N_STAGES + 1):
        by_fraction: dict[float, list[int]] = {}
        for i, tooth in enumerate(TOOTH_IDS):
            if spec.start[i] <= s and spec.fraction[i] > 0:
                by_fraction.setdefault(float(spec.fraction[i]), []).append(tooth)
        stages.append([{"teeth": teeth, "fraction": f} for f, teeth in sorted(by_fraction.items())])
    return stages


def _case_text(observation: dict) -> str:
    """What ``reset`` returns (TRL appends it to the last user message): the case, after a blank line."""
    return "\n\n" + case_description(observation)


def _turns(completion: object) -> int:
    """Assistant turns of a conversational completion (1 for a plain string)."""
    if isinstance(completion, (list, tuple)):
        return sum(1 for m in completion if isinstance(m, dict) and m.get("role") == "assistant")
    return 1


def episode_metrics(
    environments: Sequence[DentalToolEnv], completions: Sequence | None = None
) -> dict[str, float]:
    """Batch means of the tool metrics (``agentic/*``): calls per episode by tool, invalid calls,
    rollbacks, stages committed, assistant turns (from ``completions``), the finished share (and by
    how), and the finished episodes' scoring components and scaled reward. Every key is present for
    any non-empty batch except the components (only when an episode finished)."""
    envs = list(environments)
    n = len(envs)
    if not n:
        return {}
    out: dict[str, float] = {}
    for name in TOOL_NAMES:
        out[f"agentic/calls/{name}"] = sum(e.metrics.calls.get(name, 0) for e in envs) / n
    out["agentic/calls/total"] = sum(sum(e.metrics.calls.values()) for e in envs) / n
    out["agentic/invalid_calls"] = sum(e.metrics.invalid for e in envs) / n
    out["agentic/rollbacks"] = sum(e.metrics.rollbacks for e in envs) / n
    out["agentic/stages_committed"] = sum(e.metrics.stages_committed for e in envs) / n
    out["agentic/finished_share"] = sum(e.finished for e in envs) / n
    out["agentic/submitted_share"] = sum(e.metrics.finished_by == "submit_plan" for e in envs) / n
    out["agentic/reward"] = sum(e.reward for e in envs) / n
    # the environment's wall time in this batch (this rank): reset and every tool call; over the
    # step's wall time (``step_time``) it is the environment's share of an agentic GRPO step
    out["agentic/env_seconds"] = sum(e.metrics.env_seconds for e in envs)
    calls = sum(sum(e.metrics.calls.values()) for e in envs)
    if calls:
        out["agentic/env_ms_per_call"] = 1e3 * sum(e.metrics.env_seconds for e in envs) / calls
    if completions is not None:
        out["agentic/turns"] = sum(_turns(c) for c in completions) / max(len(completions), 1)
    done = [e.result for e in envs if e.result is not None]
    if done:
        out["agentic/finished/scaled_reward"] = sum(r["scaled_reward"] for r in done) / len(done)
        out["agentic/finished/terminal_raw"] = sum(r["terminal_reward"] for r in done) / len(done)
        names = sorted({k for r in done for k in r["reward_breakdown"]})
        for name in names:
            values = [float(r["reward_breakdown"][name]) for r in done if name in r["reward_breakdown"]]
            values = [v for v in values if math.isfinite(v)]
            if values:
                out[f"agentic/component/{name}"] = sum(values) / len(values)
    return out


def reward_agentic(
    completions: Sequence, environments: Sequence[DentalToolEnv] | None = None, **kwargs
) -> list[float]:
    """The environment-owned reward of each rollout, read from the environments TRL passes.

    Args:
        completions: the rollouts (conversational message lists, tool messages included).
        environments: one :class:`DentalToolEnv` per completion (TRL's ``environments`` keyword).
        **kwargs: TRL's other keywords; ``log_metric(name, value)`` receives :func:`episode_metrics`.

    Returns:
        One float per completion in [-2, 8]: :attr:`DentalToolEnv.reward` (the scaled terminal reward of
        the submitted plan or the 24 committed stages; -2 for an unfinished episode).
    """
    if environments is None or len(environments) != len(completions):
        got = None if environments is None else len(environments)
        raise ValueError(
            f"reward_agentic needs one environment per completion (TRL's environments keyword, with "
            f"environment_factory=DentalToolEnv); got {got} for {len(completions)} completions"
        )
    log_metric = kwargs.get("log_metric")
    if callable(log_metric):
        for name, value in episode_metrics(environments, completions).items():
            log_metric(name, value)
    return [e.reward for e in environments]


def prepare_tokenizer(tokenizer):
    """The tokenizer, with a chat template TRL accepts for tool calling where its own does not.

    A template that cannot render tool calls (the tiny model's ChatML, :mod:`orthojob.tiny_model`) is
    replaced by TRL's Qwen2.5 template: the same ChatML turns for system/user/assistant messages plus
    the ``<tool_call>`` JSON tags and a tools section in the system message, for which TRL sets the
    response parser (``add_response_schema``). A template that already supports tools is kept.
    """
    from trl.chat_template_utils import qwen2_5_chat_template, supports_tool_calling

    if not supports_tool_calling(tokenizer):
        tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer


__all__ = [
    "AGENTIC_INSTRUCTIONS",
    "AGENTIC_SYSTEM_PROMPT",
    "TOOL_NAMES",
    "DentalToolEnv",
    "EpisodeMetrics",
    "RemoteStepwise",
    "RemoteToolEnvFactory",
    "ToolError",
    "agentic_messages",
    "agentic_rows",
    "check_server_capacity",
    "episode_metrics",
    "full_prompt",
    "plan_stages",
    "prepare_tokenizer",
    "reward_agentic",
]
