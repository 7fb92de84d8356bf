"""Episodes: one episode's state (its aligners, achieved poses and running measures) and the store that keeps live ones."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from server.cases import Case
from server.dental_constants import (
    ADJACENT_PAIRS,
    MM_PER_DEG,
    N_STAGES,
    N_TEETH,
    POSE_DIM,
)
from server.errors import UnknownEpisodeError
from server.scoring import StageMeasures, hard_rule_breaches

MAX_FORGOTTEN_EPISODES: int = 4096
"""Closed, evicted or expired episode ids remembered (LRU), so a 404 can say which it was."""


PAIR_INCREMENT, PAIR_REMAINING, PAIR_MISMATCH, PAIR_ACHIEVED = range(4)
"""Rows of Session.distances: aligner s vs aligner s-1; achieved s vs target; aligner s vs
achieved s-1 (insertion mismatch); achieved s vs achieved s-1. When the teeth follow the plan
(ideal dynamics, full wear) only the first two are measured (the others equal the increment)."""


def lag_pairs(case: Case) -> tuple[int, int]:
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

    def stage_measures(self, stages: int = N_STAGES) -> StageMeasures:
        """The StageMeasures of stages 1..``stages`` as a batch of one (for server.scoring)."""
        d = self.distances[None, 1 : stages + 1]
        mismatch, moved = lag_pairs(self.case)
        mis = d[:, :, :, mismatch]
        ach = d[:, :, :, moved]
        return StageMeasures(
            inc_t=d[:, :, 0, PAIR_INCREMENT],
            inc_r=d[:, :, 1, PAIR_INCREMENT],
            mis_t=mis[:, :, 0],
            mis_r=mis[:, :, 1],
            achieved_mm=np.hypot(ach[:, :, 0], MM_PER_DEG * ach[:, :, 1]),
            penetration=self.penetration[None, 1 : stages + 1],
        )

    def running_breach(self) -> float:
        """The hard-rule breach known at the current stage: the per-stage limit, PDL and collision
        breaches (:func:`server.scoring.hard_rule_breaches`, in :mod:`server.reward_scaler`'s units)
        of the aligners worn so far. It never falls as stages are added, and at stage 24 it is the
        part of the episode's breach those rules make (the rest, judged on the whole trajectory,
        only at its end)."""
        if self.stage == 0:
            return 0.0
        return float(sum(v[0] for v in hard_rule_breaches(self.stage_measures(self.stage)).values()))

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


def new_session(case: Case, episode_id: str) -> Session:
    """A session at stage 0 of ``case`` (nothing planned yet)."""
    planned = np.empty((N_STAGES + 1, N_TEETH, POSE_DIM))
    planned[0] = case.initial
    session = Session(episode_id=episode_id, case=case, planned=planned, achieved=planned.copy())
    session.distances[0, :, PAIR_REMAINING] = case.need
    return session
