"""The stepwise aligner-staging environment and its session store.

Contract (Gymnasium-like, keyed by episode):

* ``reset(task_id, seed, force_decay, episode_id, non_compliance) -> observation`` starts an episode
  at stage 0 (the initial configuration).
* ``step(episode_id, poses, strategy=None) -> observation`` wears the next aligner:
  ``poses`` (28 x 7, ``[qw, qx, qy, qz, tx, ty, tz]``, mm) is its shape. Under ideal
  dynamics the teeth reach it; under force decay they lag (:mod:`server.dynamics`); with
  non-compliance (task_hard) a stage may be worn only in part (:mod:`server.compliance`,
  seeded with the case, so a rollback never re-rolls it).
  After stage 24 the episode is done and the observation carries the terminal
  reward and every scoring component (:mod:`server.scoring`).
* Tools: ``inspect_tooth``, ``simulate_step`` (no state change), ``check_collisions``,
  ``commit_stage`` (= step), ``rollback_stage`` (at most 2 per episode; restores the
  previous stage and its violation counters).
* Plans: ``score_plan`` / ``score_plans`` score whole treatment plans
  (:mod:`server.treatment`), vectorised.

Observation (JSON-safe dict): ``episode_id, task_id, seed, force_decay, non_compliance,
current_stage, stages_remaining, initial_config, current_config, target_config,
per_tooth_progress {translation, rotation} (28 shares in [0, 1]), case_summary,
step_reward, reward_breakdown, terminal_reward (None until done), done,
violations {limits, collisions, pdl}``.

Step reward: the stage's gain in accuracy (share of the required movement
achieved) minus 0.05 x the share of teeth over the per-stage limits and 0.05 x
the stage's collision severity. The terminal reward is the episode score.

Sessions live in a thread-safe store bounded by an LRU cap and a TTL; an
unknown, evicted or expired ``episode_id`` raises :class:`UnknownEpisodeError`.
Bad poses raise :class:`InvalidActionError` naming the tooth and field, and leave
the session unchanged.
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain

import numpy as np

from server.cases import TASK_IDS, Case, generate_case
from server.clinical_profiles import STRATEGIES
from server.collisions import COLLISION_TOLERANCE_MM, collision_severity, contact_penetration_mm
from server.dental_constants import (
    ADJACENT_PAIRS,
    CROWN_HEIGHT_MM,
    LIMIT_TOLERANCE,
    MM_PER_DEG,
    N_STAGES,
    N_TEETH,
    PDL_CRITICAL_KPA,
    POSE_DIM,
    ROOT_AREA_MM2,
    TOOTH_CLASS,
    TOOTH_CLASSES,
    TOOTH_IDS,
    TOOTH_INDEX,
)
from server.dynamics import apply_wear, engaged, express_stage
from server.errors import InvalidActionError, StageConflictError, UnknownEpisodeError
from server.quaternion_utils import quaternion_angle, vector_norm
from server.reward_scaler import broken_rules
from server.scoring import StageMeasures, limit_ratio, pdl_stress_kpa, score_episodes
from server.treatment import score_plans

MAX_FORGOTTEN_EPISODES: int = 4096
"""Closed, evicted or expired episode ids remembered (LRU), so a 404 can say which it was."""

MAX_ROLLBACKS: int = 2
POSE_FIELDS: tuple[str, ...] = ("qw", "qx", "qy", "qz", "tx", "ty", "tz")
STEP_PENALTY: float = 0.05
_TOOTH_POSITION = {i: fdi for i, fdi in enumerate(TOOTH_IDS)}


def validate_poses(poses: object) -> np.ndarray:
    """A (28, 7) float array from ``poses``, or InvalidActionError naming what is wrong.

    Accepts a nested list/tuple of numbers or a numeric numpy array. Booleans,
    strings, None, NaN and infinities are refused. Quaternions are normalised; a
    zero quaternion is refused.
    """
    if isinstance(poses, np.ndarray):
        if poses.dtype.kind not in "fiu":
            raise InvalidActionError(f"poses must be numbers, got an array of dtype {poses.dtype}")
        arr = poses.astype(np.float64)
        if arr.shape != (N_TEETH, POSE_DIM):
            raise InvalidActionError(
                f"poses must have shape (28, 7) [teeth x {list(POSE_FIELDS)}], got {arr.shape}"
            )
    elif _all_float_rows(poses):  # the common case (e.g. validated JSON): no per-value checks to name
        # 28 rows of 7 floats: fromiter builds the same array about twice as fast as np.array
        arr = np.fromiter(chain.from_iterable(poses), dtype=np.float64, count=N_TEETH * POSE_DIM)
        arr = arr.reshape(N_TEETH, POSE_DIM)
    else:
        if not isinstance(poses, (list, tuple)) or len(poses) != N_TEETH:
            n = len(poses) if isinstance(poses, (list, tuple)) else type(poses).__name__
            raise InvalidActionError(f"poses must be a list of 28 rows (one per tooth, FDI order), got {n}")
        for i, row in enumerate(poses):
            if not isinstance(row, (list, tuple)) or len(row) != POSE_DIM:
                got = len(row) if isinstance(row, (list, tuple)) else type(row).__name__
                raise InvalidActionError(
                    f"tooth {_TOOTH_POSITION[i]} (row {i}): a pose has 7 numbers {list(POSE_FIELDS)}, got {got}"
                )
            for j, v in enumerate(row):
                if type(v) not in (float, int) and not isinstance(v, (np.floating, np.integer)):
                    raise InvalidActionError(
                        f"tooth {_TOOTH_POSITION[i]} field {POSE_FIELDS[j]}: expected a number, "
                        f"got {type(v).__name__} {v!r:.40}"
                    )
        arr = np.array(poses, dtype=np.float64)
    if not np.maximum.reduce(np.abs(arr), axis=None) <= 1e6:  # also false for NaN
        _raise_out_of_range(arr)
    norms = vector_norm(arr[:, :4])
    if np.minimum.reduce(norms) < 1e-9:
        i = int(np.argmax(norms < 1e-9))
        raise InvalidActionError(f"tooth {_TOOTH_POSITION[i]}: quaternion (qw, qx, qy, qz) has zero norm")
    arr[:, :4] /= norms[:, None]
    return arr


def _all_float_rows(poses: object) -> bool:
    """``poses`` is 28 lists (or tuples) of 7 Python floats (C-level type and length sets)."""
    if type(poses) not in (list, tuple) or len(poses) != N_TEETH:
        return False
    if not set(map(type, poses)) <= {list, tuple} or set(map(len, poses)) != {POSE_DIM}:
        return False
    return set(map(type, chain.from_iterable(poses))) == {float}


def _raise_out_of_range(arr: np.ndarray) -> None:
    """The InvalidActionError for the first non-finite or implausibly large number of ``arr``."""
    finite = np.isfinite(arr)
    if not finite.all():
        i, j = np.argwhere(~finite)[0]
        raise InvalidActionError(
            f"tooth {_TOOTH_POSITION[int(i)]} field {POSE_FIELDS[j]}: {arr[i, j]} is not a finite number"
        )
    i, j = np.argwhere(np.abs(arr) > 1e6)[0]
    raise InvalidActionError(
        f"tooth {_TOOTH_POSITION[int(i)]} field {POSE_FIELDS[j]}: |{arr[i, j]}| > 1e6 mm"
    )


def _check_strategy(strategy: object) -> str | None:
    if strategy is None:
        return None
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise InvalidActionError(
            f"strategy must be one of {', '.join(STRATEGIES)} or null, got {strategy!r:.60}"
        )
    return strategy


PAIR_INCREMENT, PAIR_REMAINING, PAIR_MISMATCH, PAIR_ACHIEVED = range(4)
"""Rows of Session.distances: aligner s vs aligner s-1; achieved s vs target; aligner s vs
achieved s-1 (insertion mismatch); achieved s vs achieved s-1. When the teeth follow the plan
(ideal dynamics, full wear) only the first two are measured (the others equal the increment)."""


def _stack(*arrays: np.ndarray) -> np.ndarray:
    """``np.stack`` of float64 arrays of one shape, without its checks (the stepwise hot path:
    a third of the cost of ``np.stack`` there); the same array."""
    out = np.empty((len(arrays), *arrays[0].shape))
    for i, a in enumerate(arrays):
        out[i] = a
    return out


def _lag_pairs(case: Case) -> tuple[int, int]:
    """The PAIR_* rows holding a stage's (insertion mismatch, achieved increment): their own
    rows when the teeth may lag the plan, else PAIR_INCREMENT (they equal the increment)."""
    return _FOLLOWS_PAIRS if case.follows_plan else _LAG_PAIRS


_LAG_PAIRS: tuple[int, int] = (PAIR_MISMATCH, PAIR_ACHIEVED)
_FOLLOWS_PAIRS: tuple[int, int] = (PAIR_INCREMENT, PAIR_INCREMENT)


@dataclass
class Session:
    """One episode's state; per-stage arrays have 25 rows (stage 0 = initial), rows beyond
    ``stage`` unused, so a rollback is a step back of ``stage``."""

    episode_id: str
    case: Case
    planned: np.ndarray  # (25, 28, 7) aligner shapes
    achieved: np.ndarray  # (25, 28, 7) achieved poses
    stage: int = 0
    strategy: str | None = None
    rollbacks: int = 0
    # (25, 2, 4, 28): [translation mm | rotation deg, PAIR_*, tooth]
    distances: np.ndarray = field(default_factory=lambda: np.zeros((N_STAGES + 1, 2, 4, N_TEETH)))
    penetration: np.ndarray = field(default_factory=lambda: np.zeros((N_STAGES + 1, len(ADJACENT_PAIRS))))
    # (25, 3) running totals of limit violations, colliding contacts and PDL events up to each stage
    violations: np.ndarray = field(default_factory=lambda: np.zeros((N_STAGES + 1, 3), dtype=np.int64))
    step_rewards: np.ndarray = field(default_factory=lambda: np.zeros(N_STAGES + 1))
    accuracy: np.ndarray = field(default_factory=lambda: np.zeros(N_STAGES + 1))
    terminal: dict | None = None
    last_used: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stage_measures(self) -> StageMeasures:
        """The StageMeasures of stages 1..24 as a batch of one (for server.scoring)."""
        d = self.distances[None, 1:]
        mismatch, moved = _lag_pairs(self.case)
        mis = d[:, :, :, mismatch]
        ach = d[:, :, :, moved]
        return StageMeasures(
            inc_t=d[:, :, 0, PAIR_INCREMENT],
            inc_r=d[:, :, 1, PAIR_INCREMENT],
            mis_t=mis[:, :, 0],
            mis_r=mis[:, :, 1],
            achieved_mm=np.hypot(ach[:, :, 0], MM_PER_DEG * ach[:, :, 1]),
            penetration=self.penetration[None, 1:],
        )

    def scratch(self) -> Session:
        """A throw-away copy for simulate_step (per-stage arrays copied)."""
        return replace(
            self,
            planned=self.planned.copy(),
            achieved=self.achieved.copy(),
            distances=self.distances.copy(),
            penetration=self.penetration.copy(),
            violations=self.violations.copy(),
            step_rewards=self.step_rewards.copy(),
            accuracy=self.accuracy.copy(),
            lock=threading.Lock(),
        )


class SessionStore:
    """Thread-safe episode store bounded by an LRU cap and a time-to-live (seconds).

    It also remembers (LRU, at most :data:`MAX_FORGOTTEN_EPISODES`) why the
    last ids it dropped are gone -- closed, evicted or expired -- so that a later call names
    the reason instead of a bare "unknown".
    """

    def __init__(
        self,
        max_sessions: int = 1024,
        ttl_seconds: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        max_forgotten: int = MAX_FORGOTTEN_EPISODES,
    ) -> None:
        if max_sessions < 1 or not ttl_seconds > 0:
            raise ValueError("max_sessions must be >= 1 and ttl_seconds > 0")
        self.max_sessions = max_sessions
        self.ttl_seconds = ttl_seconds
        self.max_forgotten = max_forgotten
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._forgotten: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def put(self, session: Session) -> None:
        with self._lock:
            now = self._clock()
            self._expire(now)
            session.last_used = now
            self._sessions[session.episode_id] = session
            self._sessions.move_to_end(session.episode_id)
            self._forgotten.pop(session.episode_id, None)
            while len(self._sessions) > self.max_sessions:
                self._forget(self._sessions.popitem(last=False)[0], "evicted")

    def get(self, episode_id: object) -> Session:
        if not isinstance(episode_id, str):
            raise UnknownEpisodeError(f"episode_id must be a string, got {type(episode_id).__name__}")
        with self._lock:
            now = self._clock()
            self._expire(now)
            session = self._sessions.get(episode_id)
            if session is None:
                raise self._unknown(episode_id)
            session.last_used = now
            self._sessions.move_to_end(episode_id)
            return session

    def remove(self, episode_id: str) -> bool:
        """Forget an episode now (reason "closed"); True if it was live."""
        with self._lock:
            if self._sessions.pop(episode_id, None) is None:
                return False
            self._forget(episode_id, "closed")
            return True

    def _unknown(self, episode_id: str) -> UnknownEpisodeError:
        reason = self._forgotten.get(episode_id, "unknown")
        shown = f"{episode_id!r:.80}"
        what = {
            "closed": f"episode {shown} was closed (by DELETE, or when its WebSocket session ended)",
            "evicted": (
                f"episode {shown} was evicted: the server keeps at most {self.max_sessions} live episodes "
                "and this one was the least recently used when a new one started"
            ),
            "expired": f"episode {shown} expired: it was not used for {self.ttl_seconds:g} s",
            "unknown": (
                f"unknown episode_id {shown} (sessions expire after {self.ttl_seconds:g} s idle; "
                f"at most {self.max_sessions} are kept)"
            ),
        }[reason]
        return UnknownEpisodeError(f"{what}: call reset() to start an episode", reason)

    def _forget(self, episode_id: str, reason: str) -> None:
        self._forgotten[episode_id] = reason
        self._forgotten.move_to_end(episode_id)
        while len(self._forgotten) > self.max_forgotten:
            self._forgotten.popitem(last=False)

    def _expire(self, now: float) -> None:
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if now - oldest.last_used <= self.ttl_seconds:
                break
            self._forget(self._sessions.popitem(last=False)[0], "expired")


class StepwiseDentalEnvironment:
    """The aligner-staging environment (see the module docstring for the contract)."""

    def __init__(
        self,
        max_sessions: int = 1024,
        ttl_seconds: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sessions = SessionStore(max_sessions, ttl_seconds, clock)

    # --- episode life cycle ---------------------------------------------------

    def reset(
        self,
        task_id: str = "task_easy",
        seed: int | None = None,
        force_decay: bool | None = None,
        episode_id: str | None = None,
        non_compliance: bool | None = None,
    ) -> dict:
        """Start an episode and return its stage-0 observation.

        ``seed=None`` draws one; ``force_decay=None`` and ``non_compliance=None`` mean False
        (non-compliance is a task_hard option, :mod:`server.compliance`); ``episode_id=None``
        makes a uuid4 (a given id replaces any live episode of that id).
        """
        if seed is None:
            seed = int(np.random.default_rng().integers(2**31))
        if force_decay is not None and not isinstance(force_decay, (bool, np.bool_)):
            raise InvalidActionError(f"force_decay must be true, false or null, got {force_decay!r:.40}")
        if non_compliance is not None and not isinstance(non_compliance, (bool, np.bool_)):
            raise InvalidActionError(
                f"non_compliance must be true, false or null, got {non_compliance!r:.40}"
            )
        if episode_id is None:
            episode_id = uuid.uuid4().hex
        elif not isinstance(episode_id, str) or not 0 < len(episode_id) <= 128:
            raise InvalidActionError("episode_id must be a non-empty string of at most 128 characters")
        session = _new_session(
            generate_case(task_id, seed, bool(force_decay), bool(non_compliance)), episode_id
        )
        self.sessions.put(session)
        return self._observation(session, step_reward=0.0, breakdown={})

    def step(
        self,
        episode_id: str,
        poses: object,
        strategy: str | None = None,
        expected_stage: int | None = None,
    ) -> dict:
        """Wear the next aligner (poses 28 x 7); returns the new observation.

        ``expected_stage`` (optional): the stage the episode must be at (the ``current_stage``
        of the observation the step was computed from). Otherwise :class:`StageConflictError`
        and nothing is applied: a retried or reordered step never counts twice.
        """
        session = self.sessions.get(episode_id)
        arr = validate_poses(poses)
        strategy = _check_strategy(strategy)
        with session.lock:
            _check_stage(session, expected_stage, "step")
            return self._advance(session, arr, strategy, commit=True)

    commit_stage = step

    def simulate_step(self, episode_id: str, poses: object, strategy: str | None = None) -> dict:
        """What ``step`` would return, without changing the episode."""
        session = self.sessions.get(episode_id)
        arr = validate_poses(poses)
        strategy = _check_strategy(strategy)
        with session.lock:
            return self._advance(session, arr, strategy, commit=False)

    def rollback_stage(self, episode_id: str, expected_stage: int | None = None) -> dict:
        """Undo the last stage (and its violation counters); at most MAX_ROLLBACKS per episode.
        ``expected_stage`` as for :meth:`step`."""
        session = self.sessions.get(episode_id)
        with session.lock:
            _check_stage(session, expected_stage, "rollback")
            if session.stage == 0:
                raise InvalidActionError("nothing to roll back: the episode is at stage 0")
            if session.rollbacks >= MAX_ROLLBACKS:
                raise InvalidActionError(f"rollback limit reached ({MAX_ROLLBACKS} per episode)")
            session.step_rewards[session.stage] = 0.0
            session.stage -= 1
            session.rollbacks += 1
            session.terminal = None
            return self._observation(session, step_reward=0.0, breakdown=self._running_breakdown(session))

    def close_episode(self, episode_id: str) -> bool:
        """Release an episode's session (e.g. when its client disconnects); True if it was live
        (unknown ids are ignored)."""
        return isinstance(episode_id, str) and self.sessions.remove(episode_id)

    def state(self, episode_id: str) -> dict:
        """The current observation, without changing anything."""
        session = self.sessions.get(episode_id)
        with session.lock:
            breakdown = (
                session.terminal["reward_breakdown"] if session.terminal else self._running_breakdown(session)
            )
            return self._observation(session, float(session.step_rewards[session.stage]), breakdown)

    # --- tools ------------------------------------------------------------------

    def inspect_tooth(self, episode_id: str, tooth_id: int) -> dict:
        """One tooth's poses, remaining movement and clinical data."""
        if isinstance(tooth_id, bool) or tooth_id not in TOOTH_INDEX:
            raise InvalidActionError(f"unknown tooth_id {tooth_id!r:.20}: use an FDI id of {TOOTH_IDS}")
        session = self.sessions.get(episode_id)
        i = TOOTH_INDEX[tooth_id]
        with session.lock:
            current = session.achieved[session.stage, i]
        target = session.case.target[i]
        return {
            "tooth_id": tooth_id,
            "tooth_class": TOOTH_CLASSES[TOOTH_CLASS[i]],
            "current_stage": session.stage,
            "initial_pose": list(session.case.initial_list[i]),
            "current_pose": current.tolist(),
            "target_pose": list(session.case.target_list[i]),
            "translation_remaining_mm": float(vector_norm(target[4:] - current[4:])),
            "rotation_remaining_deg": float(np.degrees(quaternion_angle(target[:4], current[:4]))),
            "crown_width_mm": float(session.case.crown_width_mm[i]),
            "crown_height_mm": float(CROWN_HEIGHT_MM[i]),
            "root_area_mm2": float(ROOT_AREA_MM2[i]),
        }

    def check_collisions(self, episode_id: str, poses: object | None = None) -> dict:
        """Contacts of the current arch, or of ``poses`` if given (no state change)."""
        session = self.sessions.get(episode_id)
        if poses is None:
            with session.lock:
                arr = session.achieved[session.stage].copy()
        else:
            arr = validate_poses(poses)
        pen = contact_penetration_mm(arr, session.case.contacts)
        hits = np.flatnonzero(pen > COLLISION_TOLERANCE_MM)
        return {
            "collision_free": bool(hits.size == 0),
            "severity": float(collision_severity(pen)),
            "pairs": [
                {
                    "teeth": [TOOTH_IDS[ADJACENT_PAIRS[k, 0]], TOOTH_IDS[ADJACENT_PAIRS[k, 1]]],
                    "penetration_mm": float(pen[k]),
                }
                for k in hits
            ],
        }

    # --- plans ------------------------------------------------------------------

    def score_plan(
        self,
        plan: object,
        task_id: str = "task_easy",
        seed: int = 0,
        force_decay: bool = False,
        non_compliance: bool = False,
    ) -> dict:
        """Score one whole treatment plan (a dict, or its JSON text) for a case."""
        return self.score_plans([plan], [(task_id, seed, force_decay, non_compliance)])[0]

    def score_plans(self, plans: Sequence[object], cases: Sequence[tuple]) -> list[dict]:
        """Score many plans, one case ``(task_id, seed, force_decay[, non_compliance])`` each, vectorised."""
        if len(plans) != len(cases):
            raise InvalidActionError(f"got {len(plans)} plans for {len(cases)} cases: send one case per plan")
        decoded = []
        for p in plans:
            if isinstance(p, (str, bytes)):
                try:
                    p = json.loads(p)
                except (ValueError, RecursionError):
                    p = None
            decoded.append(p)
        return score_plans(decoded, cases)

    # --- internals ----------------------------------------------------------------

    def _advance(self, session: Session, poses: np.ndarray, strategy: str | None, commit: bool) -> dict:
        if session.stage >= N_STAGES:
            raise InvalidActionError("the episode is done (24 aligners worn): call reset() for a new one")
        s = session.stage + 1
        case = session.case
        prev_achieved = session.achieved[s - 1]
        # one vectorised pass over this stage's pose pairs (the PAIR_* rows)
        if not case.follows_plan:
            achieved = express_stage(
                poses, session.planned[s - 1], prev_achieved, case.long_axis, case.force_decay
            )
            if case.wear is not None:
                achieved = apply_wear(prev_achieved, achieved, case.wear[s - 1])
            pairs_a = _stack(poses, case.target, poses, achieved)
            pairs_b = _stack(session.planned[s - 1], achieved, prev_achieved, prev_achieved)
        else:  # the teeth sit exactly in the aligner: mismatch = achieved increment = increment
            achieved = poses
            pairs_a = _stack(poses, case.target)
            pairs_b = _stack(session.planned[s - 1], achieved)
        mismatch = _lag_pairs(case)[0]
        dist = _stack(
            vector_norm(pairs_a[..., 4:] - pairs_b[..., 4:]),
            np.degrees(quaternion_angle(pairs_a[..., :4], pairs_b[..., :4])),
        )  # (2, pairs, 28)
        inc = dist[:, PAIR_INCREMENT]
        if not case.follows_plan:  # the aligner engages at most SEAT_FACTOR of its step (server.dynamics)
            dist[:, PAIR_MISMATCH] = engaged(dist[:, PAIR_MISMATCH], inc)
        over_limit = int(np.count_nonzero(limit_ratio(inc[0], inc[1]) > 1.0 + LIMIT_TOLERANCE))
        pdl_events = int(
            np.count_nonzero(pdl_stress_kpa(dist[0, mismatch], dist[1, mismatch]) > PDL_CRITICAL_KPA)
        )
        pen = contact_penetration_mm(achieved, case.contacts)
        colliding = int(np.count_nonzero(pen > COLLISION_TOLERANCE_MM))
        acc_after = _accuracy(dist[:, PAIR_REMAINING], case.need_mm)
        penalty = STEP_PENALTY * (over_limit / N_TEETH + float(collision_severity(pen)))
        reward = acc_after - float(session.accuracy[s - 1]) - penalty

        # commit into the session, or into a scratch copy for simulate_step
        target = session if commit else session.scratch()
        target.planned[s] = poses
        target.achieved[s] = achieved
        target.distances[s, :, : dist.shape[1]] = dist
        target.penetration[s] = pen
        target.violations[s] = target.violations[s - 1] + (over_limit, colliding, pdl_events)
        target.step_rewards[s] = reward
        target.accuracy[s] = acc_after
        target.stage = s
        if strategy is not None:
            target.strategy = strategy
        breakdown = self._running_breakdown(target, accuracy=acc_after)
        if s == N_STAGES:
            target.terminal = self._terminal(target)
            breakdown = target.terminal["reward_breakdown"]
        return self._observation(target, step_reward=reward, breakdown=breakdown)

    @staticmethod
    def _running_breakdown(session: Session, accuracy: float | None = None) -> dict:
        s = session.stage
        return {"accuracy": float(session.accuracy[s] if accuracy is None else accuracy), "stage": float(s)}

    @staticmethod
    def _terminal(session: Session) -> dict:
        """The episode's terminal score, its breakdown, and its scaled reward and broken hard rules
        (:mod:`server.reward_scaler`, as :func:`server.treatment.plan_result`)."""
        case = session.case
        scores = score_episodes(
            initial=case.initial[None],
            target=case.target[None],
            width_mm=case.crown_width_mm[None],
            depth_mm=case.crown_depth_mm[None],
            planned=session.planned[None],
            achieved=session.achieved[None],
            profiles=[case.profile],
            secondary_profiles=[case.secondary_profile],
            strategies=[session.strategy],
            measures=session.stage_measures(),
        )
        diagnostics = {k: float(v[0]) for k, v in scores.diagnostics.items()}
        return {
            "terminal_reward": float(scores.terminal[0]),
            "reward_breakdown": scores.breakdown(0),
            "scaled_reward": diagnostics["scaled_reward"],
            "broken_rules": broken_rules(diagnostics),
        }

    def _observation(self, session: Session, step_reward: float, breakdown: dict) -> dict:
        return observation(session, step_reward, breakdown)


def _new_session(case: Case, episode_id: str) -> Session:
    """A session at stage 0 of ``case`` (nothing planned yet)."""
    planned = np.empty((N_STAGES + 1, N_TEETH, POSE_DIM))
    planned[0] = case.initial
    session = Session(episode_id=episode_id, case=case, planned=planned, achieved=planned.copy())
    session.distances[0, :, PAIR_REMAINING] = case.need
    return session


def initial_observation(case: Case, episode_id: str = "") -> dict:
    """The stage-0 observation of a case: what :meth:`StepwiseDentalEnvironment.reset` returns,
    computed without an environment or a session store (a pure function of the case)."""
    return observation(_new_session(case, episode_id), step_reward=0.0, breakdown={})


def observation(session: Session, step_reward: float, breakdown: dict) -> dict:
    """The observation of a session at its current stage (the environment contract's fields)."""
    s = session.stage
    current = session.achieved[s]
    case = session.case
    # (2, 28) shares of the translation and rotation done; teeth with nothing to do count as done
    remaining = session.distances[s, :, PAIR_REMAINING]
    progress = np.maximum(1.0 - remaining * case.inv_need, 0.0).round(4).tolist()  # <= 1 by construction
    limits, collisions, pdl = session.violations[s].tolist()
    done = s >= N_STAGES
    terminal = session.terminal["terminal_reward"] if (done and session.terminal) else None
    for v in breakdown.values():
        if not math.isfinite(v):  # a non-finite score is a bug: never serialise it as null
            raise RuntimeError(f"non-finite score in {breakdown}")
    return {
        "episode_id": session.episode_id,
        "task_id": case.task_id,
        "seed": case.seed,
        "force_decay": case.force_decay,
        "non_compliance": case.non_compliance,
        "current_stage": s,
        "stages_remaining": N_STAGES - s,
        "initial_config": list(map(list.copy, case.initial_list)),
        "current_config": current.tolist(),
        "target_config": list(map(list.copy, case.target_list)),
        "per_tooth_progress": {
            "translation": progress[0],
            "rotation": progress[1],
        },
        "case_summary": dict(case.summary),
        "step_reward": float(step_reward),
        "reward_breakdown": dict(breakdown),
        "terminal_reward": terminal,
        "done": done,
        "violations": {
            "limits": limits,
            "collisions": collisions,
            "pdl": pdl,
        },
    }


def _check_stage(session: Session, expected_stage: int | None, what: str) -> None:
    """StageConflictError unless the session is at ``expected_stage`` (None: no check)."""
    if expected_stage is None or expected_stage == session.stage:
        return
    raise StageConflictError(
        f"episode {session.episode_id!r:.80} is at stage {session.stage}, not {expected_stage} "
        f"(expected_stage): this {what} was duplicated or arrived out of order and was not applied; "
        f"send the next {what} with expected_stage={session.stage}",
        session.stage,
    )


def _accuracy(remaining: np.ndarray, need_mm: float) -> float:
    """Share of the required movement achieved (as server.scoring's accuracy), from the
    (2, 28) translation (mm) and rotation (deg) still to do and the summed need (mm-equivalent)."""
    err = float(np.add.reduce(np.hypot(remaining[0], MM_PER_DEG * remaining[1])))
    return min(max(1.0 - err / max(need_mm, 1e-9), 0.0), 1.0)


__all__ = ["MAX_ROLLBACKS", "TASK_IDS", "SessionStore", "StepwiseDentalEnvironment", "validate_poses"]
