"""Agentic GRPO: the stepwise environment as tools, through TRL's ``environment_factory``.

TRL 1.16's GRPOTrainer (``environment_factory=DentalToolEnv``) makes one :class:`DentalToolEnv`
per rollout (pooled and reused), calls ``reset(**row)`` with the dataset row (columns ``seed``,
``task_id``, ``force_decay``; ``prompt`` is ignored) and appends the text it returns, the case
(:func:`orthojob.data.prompts.case_description`), to the last user message. Every public method is a
tool: TRL derives its JSON schema from the signature and the Google-style docstring
(``transformers.utils.get_json_schema``), parses the model's ``<tool_call>`` JSON, calls the method
and feeds the returned text back as a ``tool`` message, up to ``max_tool_calling_iterations``
assistant turns.

Tools: :class:`server.agent_tools.StagingTools`' (``inspect_tooth``, ``simulate_stage``,
``check_collisions``, ``commit_stage``, ``rollback_stage``, ``submit_plan``; the stage format and each
tool's contract are documented there), which the environment server also serves as MCP tools
(:mod:`server.serving.mcp_tools`). :class:`DentalToolEnv` adds the episode start (``reset``: the case as
text), the release, and ``submit_plan``'s scoring as the one-shot rewards score a completion
(:func:`orthojob.rewards.rollouts.score_texts`: a plan found in the text). The model never types 28 x 7 poses.

**Reward.** The environment owns it (:attr:`DentalToolEnv.reward`): the scaled terminal reward
(:mod:`server.reward_scaler`, [-2, 8]) of the submitted plan, or of the 24 committed stages;
REWARD_MIN for an episode that did not finish. :func:`reward_agentic` is the TRL reward function
that reads it from the ``environments`` TRL passes, and logs per step (``log_metric``) the tool
metrics of :func:`episode_metrics` (``agentic/*``) and the finished episodes' scoring components.
The environment deliberately has no ``get_reward`` method: TRL would add that as a second reward
column with weight 1, counting the same score twice.

**Traces.** While an MLflow run is active, a few episodes per step (:data:`TRACE_EPISODES_ENV`,
default :data:`DEFAULT_TRACE_EPISODES` per reward call, i.e. per generation batch; 0: none) are
recorded and written by :func:`reward_agentic` as MLflow traces (:func:`flush_traces`): a root span
``episode`` (inputs: the case key; outputs: the result; attributes and trace tags: the reward) with
one span per tool call (inputs: the arguments, outputs: the result text, its start and end times).
An episode not sampled costs one attribute test per tool call.

Non-tool members are private or properties: TRL exposes every public function as a tool.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from orthojob.data.prompts import PLAN_SEMANTICS, case_description, reset_observation
from orthojob.rewards.rollouts import NO_PLAN, score_texts
from server.agent_tools import (
    NO_USABLE_PLAN,
    TOOL_NAMES,
    EpisodeMetrics,
    StagingTools,
    ToolError,
)
from server.cases import HELDOUT_SEED_START, TASK_IDS, generate_case
from server.dental_constants import (
    MAX_ROTATION_DEG,
    MAX_TRANSLATION_MM,
    N_STAGES,
    TOOTH_IDS,
)
from server.dental_environment import MAX_ROLLBACKS, StepwiseDentalEnvironment
from server.errors import InvalidActionError, StageConflictError
from server.plans import normalize_plan

log = logging.getLogger(__name__)

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


TRACE_EPISODES_ENV = "ORTHORL_TRACE_EPISODES"
"""How many agentic episodes per reward call (one generation batch) become MLflow traces."""
DEFAULT_TRACE_EPISODES = 2
TRACE_REWARD_TAG = "orthorl.reward"
"""The trace tag (and root span attribute ``reward``) holding the episode's reward."""


TRACE_WINDOW_S = 60.0
"""The budget also renews after this many seconds without a flush (episodes nobody scores through
:func:`reward_agentic`, e.g. a gate's, never exhaust it)."""


class _TraceBudget:
    """How many more episodes of this batch are recorded: claimed at ``reset`` (only while an MLflow
    run is active), renewed by :func:`flush_traces` or after :data:`TRACE_WINDOW_S` (thread-safe: TRL
    may reset from threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._used = 0
        self._since = time.monotonic()

    def claim(self) -> bool:
        mlflow = sys.modules.get("mlflow")  # only when a stage run imported it
        if mlflow is None or mlflow.active_run() is None:
            return False
        try:
            limit = int(os.environ.get(TRACE_EPISODES_ENV) or DEFAULT_TRACE_EPISODES)
        except ValueError:
            limit = DEFAULT_TRACE_EPISODES
        with self._lock:
            if time.monotonic() - self._since >= TRACE_WINDOW_S:
                self._used, self._since = 0, time.monotonic()
            if self._used >= limit:
                return False
            self._used += 1
            return True

    def renew(self) -> None:
        with self._lock:
            self._used, self._since = 0, time.monotonic()


_BUDGET = _TraceBudget()


def _traced(func: Callable) -> Callable:
    """A tool that, in an episode being recorded, appends ``(name, arguments, result, start, end)``
    (nanoseconds) to it; signature and docstring kept, so TRL derives the same schema."""
    names = list(inspect.signature(func).parameters)[1:]  # after self

    @functools.wraps(func)
    def tool(self: DentalToolEnv, *args, **kwargs) -> str:
        calls = self._trace_calls
        if calls is None:
            return func(self, *args, **kwargs)
        start = time.time_ns()
        out = func(self, *args, **kwargs)
        calls.append((func.__name__, {**dict(zip(names, args)), **kwargs}, out, start, time.time_ns()))
        return out

    return tool


class DentalToolEnv(StagingTools):
    """One agentic episode on the in-process :class:`StepwiseDentalEnvironment` (module docstring);
    the tools are :class:`server.agent_tools.StagingTools`'.

    Usable as TRL's ``environment_factory`` (the class itself is the factory). After an episode:
    :attr:`reward`, :attr:`result`, :attr:`metrics`, :attr:`finished`.
    """

    def __init__(self, env_url: str | None = None) -> None:
        # in process: one episode at a time, a small store and a TTL no generation outlasts;
        # with env_url: the server's episode, over one WebSocket (RemoteStepwise)
        super().__init__(
            StepwiseDentalEnvironment(max_sessions=2, ttl_seconds=1e9)
            if env_url is None
            else RemoteStepwise(env_url)
        )
        self._trace_calls: list[tuple] | None = None  # this episode's tool calls, when recorded
        self._trace_start = 0

    # --- episode (not tools) ---------------------------------------------------------------

    def reset(
        self, seed: int | None = None, task_id: str = "task_easy", force_decay: bool = False, **kwargs
    ) -> str:
        """Start the episode of a dataset row (``seed``, ``task_id``, ``force_decay``; other
        columns ignored) and return the case as text (:func:`orthojob.data.prompts.case_description`).

        A bad row raises ValueError (a dataset error, not the model's)."""
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"column 'seed' must hold integers, got {seed!r:.40}")
        if task_id not in TASK_IDS:
            raise ValueError(f"column 'task_id' must be one of {TASK_IDS}, got {task_id!r:.40}")
        t0 = time.perf_counter()
        if self._episode_id is not None:
            self._env.close_episode(self._episode_id)
        obs = self._env.reset(task_id=task_id, seed=int(seed), force_decay=bool(force_decay))
        case = (
            self._env.sessions.get(obs["episode_id"]).case
            if isinstance(self._env, StepwiseDentalEnvironment)
            else generate_case(
                task_id, int(seed), bool(force_decay)
            )  # the server's case: a pure function of its key
        )
        self._begin(obs, case)
        text = _case_text(obs)
        self._metrics.env_seconds = time.perf_counter() - t0
        self._trace_calls = [] if _BUDGET.claim() else None  # a trace of this episode (module docstring)
        self._trace_start = time.time_ns()
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

    def _score_plan_text(self, plan: str) -> dict:
        """The one-shot rewards' scoring of the plan text (:func:`orthojob.rewards.rollouts.score_texts`: a
        plan found in the text as a completion's is), so a submitted plan scores what
        ``reward_terminal`` gives the same text."""
        (rollout,) = score_texts([plan], [self._key])
        if rollout.error == NO_PLAN:
            raise ToolError(NO_USABLE_PLAN)
        if rollout.error:
            raise ToolError(f"the plan could not be scored: {rollout.error}")
        return {
            "terminal_reward": rollout.terminal_reward,
            "scaled_reward": rollout.scaled_reward,
            "reward_breakdown": dict(rollout.reward_breakdown),
            "broken_rules": list(rollout.broken_rules),
        }


for _name in TOOL_NAMES:  # each tool records its calls in an episode being traced
    setattr(DentalToolEnv, _name, _traced(getattr(StagingTools, _name)))


def flush_traces(environments: Sequence[DentalToolEnv], stage: str = "grpo") -> int:
    """Write the recorded episodes of ``environments`` as MLflow traces (module docstring) into the
    active run's experiment and renew the sampling budget; returns the number written. Tracing is a
    diagnostic: a failure is logged, never raised."""
    recorded = [e for e in environments if getattr(e, "_trace_calls", None) is not None]
    _BUDGET.renew()
    if not recorded:
        return 0
    import mlflow
    from mlflow.tracing.constant import TraceMetadataKey

    run = mlflow.active_run()
    where = {"experiment_id": run.info.experiment_id} if run is not None else {}
    linked = {TraceMetadataKey.SOURCE_RUN: run.info.run_id} if run is not None else None
    written = 0
    for env in recorded:
        calls, env._trace_calls = env._trace_calls, None
        key, reward = env._key, env.reward
        root = None
        try:
            root = mlflow.start_span_no_context(
                "episode",
                span_type="AGENT",
                inputs={"task_id": key.task_id, "seed": key.seed, "force_decay": key.force_decay},
                attributes={"reward": reward, "finished": env.finished, "stage": stage},
                tags={
                    TRACE_REWARD_TAG: f"{reward:.6f}",
                    "orthorl.stage": stage,
                    "orthorl.case": f"{key.task_id}/{key.seed}",
                },
                metadata=linked,
                start_time_ns=env._trace_start,
                **where,
            )
            end = env._trace_start
            for name, arguments, result, start, end in calls:
                span = mlflow.start_span_no_context(
                    name, span_type="TOOL", parent_span=root, inputs=arguments, start_time_ns=start
                )
                span.end(outputs=result, end_time_ns=end)
            root.end(
                outputs=env.result or {"finished_by": None, "reward": reward},
                end_time_ns=max(end, time.time_ns()),
            )
            written += 1
        except Exception as exc:
            log.warning("episode trace not written: %s: %s", type(exc).__name__, str(exc)[:200])
            if root is not None:  # never leave a half-built trace open in MLflow's trace manager
                with contextlib.suppress(Exception):
                    root.end(status="ERROR")
    return written


class RemoteStepwise:
    """What :class:`DentalToolEnv` asks of :class:`StepwiseDentalEnvironment`, over the environment
    server (``python -m server.app``): one WebSocket session (:class:`orthojob.agentic.env_client.EnvSession`,
    OpenEnv's client) per environment, reset and commits as OpenEnv's reset/step messages (with
    ``expected_stage``), the other tools as the server's ``tool`` message on the session's own
    episode. A refused action comes back as the same :class:`InvalidActionError` message as in
    process; a lost episode (server restart, idle reaping) as a :class:`ToolError`. A plan given to
    ``submit_plan`` is scored in process (the one-shot rewards' scoring), as without a server."""

    def __init__(self, url: str, message_timeout_s: float = 60.0) -> None:
        from orthojob.agentic.env_client import EnvSession

        self.url = url
        self.session = EnvSession(url, message_timeout_s=message_timeout_s)

    def _guard(self, call: Callable) -> dict:
        from orthojob.agentic.env_client import EnvServerError, EpisodeLostError

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
    below the held-out seeds), as :func:`orthojob.data.prompts.prompt_rows` without the case in the prompt."""
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
    flush_traces(environments)  # the sampled episodes, as MLflow traces
    return [e.reward for e in environments]


def prepare_tokenizer(tokenizer):
    """The tokenizer, with a chat template TRL accepts for tool calling where its own does not.

    A template that cannot render tool calls (the tiny model's ChatML, :mod:`orthojob.modeling.tiny_model`) is
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
