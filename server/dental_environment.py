"""The stepwise aligner-staging environment.

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
  (:mod:`server.treatment`), vectorised, each read by :mod:`server.plan_text` (a value that is
  not a plan scores -2).

Observation (JSON-safe dict): ``episode_id, task_id, seed, force_decay, non_compliance,
current_stage, stages_remaining, initial_config, current_config, target_config,
per_tooth_progress {translation, rotation} (28 shares in [0, 1]), case_summary,
step_reward, reward_breakdown, terminal_reward (None until done), done,
violations {limits, collisions, pdl}``.

Step reward: the stage's gain in accuracy (share of the required movement
achieved) minus 0.05 x the share of teeth over the per-stage limits and 0.05 x
the stage's collision severity. The terminal reward is the episode score.

Sessions live in a thread-safe store bounded by an LRU cap and a TTL (:mod:`server.episodes`); an
unknown, evicted or expired ``episode_id`` raises :class:`UnknownEpisodeError`.
Bad poses raise :class:`InvalidActionError` naming the tooth and field (:mod:`server.pose_validation`),
and leave the session unchanged.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np

from server.absent_teeth import mask_contacts
from server.case_records import case_digest, case_of_record
from server.cases import IMPORTED_TASK, TASK_IDS, Case, CaseKey, generate_case
from server.collisions import COLLISION_TOLERANCE_MM, collision_severity, contact_penetration_mm
from server.dental_constants import (
    ADJACENT_PAIRS,
    CROWN_HEIGHT_MM,
    LIMIT_TOLERANCE,
    MM_PER_DEG,
    N_STAGES,
    N_TEETH,
    PDL_CRITICAL_KPA,
    ROOT_AREA_MM2,
    TOOTH_CLASS,
    TOOTH_CLASSES,
    TOOTH_IDS,
    TOOTH_INDEX,
)
from server.dynamics import apply_wear, engaged, express_stage
from server.episodes import (
    PAIR_INCREMENT,
    PAIR_MISMATCH,
    PAIR_REMAINING,
    Session,
    SessionStore,
    lag_pairs,
    new_session,
)
from server.errors import InvalidActionError, StageConflictError
from server.plan_text import not_a_plan_result, read_plan
from server.pose_validation import check_strategy, validate_poses
from server.quaternion_utils import quaternion_angle, vector_norm
from server.reward_scaler import broken_rules
from server.scoring import limit_ratio, pdl_stress_kpa, score_episodes
from server.treatment import score_plan_specs

MAX_ROLLBACKS: int = 2
MAX_REPORTED_PROBLEMS: int = 20
"""Problems of a refused inline case named in the error (the rest counted)."""
STEP_PENALTY: float = 0.05


def _stack(*arrays: np.ndarray) -> np.ndarray:
    """``np.stack`` of float64 arrays of one shape, without its checks (the stepwise hot path:
    a third of the cost of ``np.stack`` there); the same array."""
    out = np.empty((len(arrays), *arrays[0].shape))
    for i, a in enumerate(arrays):
        out[i] = a
    return out


class StepwiseDentalEnvironment:
    """The aligner-staging environment (see the module docstring for the contract)."""

    def __init__(
        self,
        max_sessions: int = 1024,
        ttl_seconds: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        case_set: Mapping[str, CaseKey] | None = None,
    ) -> None:
        self.sessions = SessionStore(max_sessions, ttl_seconds, clock)
        self.case_set: Mapping[str, CaseKey] = {} if case_set is None else case_set
        """Case id -> key of the cases a ``reset(case_id=...)`` may name (a case file loaded at start)."""

    # --- episode life cycle ---------------------------------------------------

    def reset(
        self,
        task_id: str = "task_easy",
        seed: int | None = None,
        force_decay: bool | None = None,
        episode_id: str | None = None,
        non_compliance: bool | None = None,
        case_id: str | None = None,
        case: dict | None = None,
    ) -> dict:
        """Start an episode and return its stage-0 observation.

        ``seed=None`` draws one; ``force_decay=None`` and ``non_compliance=None`` mean False
        (non-compliance is a task_hard option, :mod:`server.compliance`); ``episode_id=None``
        makes a uuid4 (a given id replaces any live episode of that id). ``case_id`` names a case of
        :attr:`case_set` instead of ``task_id`` and ``seed``; ``case`` is a whole case record
        (:mod:`server.case_records`), checked first, every problem named in the error.
        ``force_decay=None`` then keeps the case's own dynamics.
        """
        if force_decay is not None and not isinstance(force_decay, (bool, np.bool_)):
            raise InvalidActionError(f"force_decay must be true, false or null, got {force_decay!r:.40}")
        if non_compliance is not None and not isinstance(non_compliance, (bool, np.bool_)):
            raise InvalidActionError(
                f"non_compliance must be true, false or null, got {non_compliance!r:.40}"
            )
        if case_id is not None or case is not None:
            return self._reset_case(case_id, case, force_decay, episode_id, non_compliance)
        if seed is None:
            seed = int(np.random.default_rng().integers(2**31))
        episode_id = _episode_id(episode_id)
        session = new_session(
            generate_case(task_id, seed, bool(force_decay), bool(non_compliance)), episode_id
        )
        self.sessions.put(session)
        return self._observation(session, step_reward=0.0, breakdown={})

    def _reset_case(self, case_id, record, force_decay, episode_id, non_compliance) -> dict:
        if case_id is not None and record is not None:
            raise InvalidActionError(
                "give case_id (a case of the server's case set) or case (a record), not both"
            )
        if non_compliance:
            raise InvalidActionError(
                "non_compliance is an option of generated task_hard cases, not of imported ones"
            )
        if case_id is not None:
            key = self.case_set.get(case_id) if isinstance(case_id, str) else None
            if key is None:
                loaded = (
                    f"{len(self.case_set)} cases"
                    if self.case_set
                    else "no case set (start it with --cases FILE)"
                )
                raise InvalidActionError(f"unknown case_id {case_id!r:.80}: the server holds {loaded}")
            case = generate_case(
                key.task_id, key.seed, key.force_decay if force_decay is None else bool(force_decay)
            )
        else:
            checked = case_of_record(record)
            if checked.case is None:
                shown = "; ".join(str(p) for p in checked.problems[:MAX_REPORTED_PROBLEMS])
                more = len(checked.problems) - MAX_REPORTED_PROBLEMS
                raise InvalidActionError(
                    f"the case record is refused: {shown}{f' (and {more} more)' if more > 0 else ''}"
                )
            # not registered: the session holds the case, and a client's cases never accumulate here
            case = replace(checked.case, task_id=IMPORTED_TASK, seed=int(case_digest(checked.case)[:15], 16))
            if force_decay is not None:
                case = replace(case, force_decay=bool(force_decay))
        session = new_session(case, _episode_id(episode_id))
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
        strategy = check_strategy(strategy)
        with session.lock:
            _check_stage(session, expected_stage, "step")
            return self._advance(session, arr, strategy, commit=True)

    commit_stage = step

    def simulate_step(self, episode_id: str, poses: object, strategy: str | None = None) -> dict:
        """What ``step`` would return, without changing the episode."""
        session = self.sessions.get(episode_id)
        arr = validate_poses(poses)
        strategy = check_strategy(strategy)
        with session.lock:
            return self._advance(session, arr, strategy, commit=False)

    def rollback_stage(self, episode_id: str, expected_stage: int | None = None) -> dict:
        """Undo the last stage (and its violation counters); at most MAX_ROLLBACKS per episode, and
        none once the episode is done. ``expected_stage`` as for :meth:`step`."""
        session = self.sessions.get(episode_id)
        with session.lock:
            _check_stage(session, expected_stage, "rollback")
            if session.stage == 0:
                raise InvalidActionError("nothing to roll back: the episode is at stage 0")
            if session.stage >= N_STAGES:
                # the terminal reward has been paid and the breaches seen: undoing aligner 24 would
                # let an episode be scored again, or its last breach be undone once known
                raise InvalidActionError(
                    "the episode is done (24 aligners worn): its terminal reward is final; call reset() for a new one"
                )
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
        if session.case.absent is not None and session.case.absent[i]:
            raise InvalidActionError(
                f"tooth {tooth_id} is absent in this patient: it has no movement to inspect"
            )
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
        pen = mask_contacts(contact_penetration_mm(arr, session.case.contacts), session.case.absent)
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
        """Score one whole treatment plan (the plan object, or a text holding it) for a case; see
        :meth:`score_plans`."""
        return self.score_plans([plan], [(task_id, seed, force_decay, non_compliance)])[0]

    def score_plans(self, plans: Sequence[object], cases: Sequence[tuple]) -> list[dict]:
        """Score many plans, one case ``(task_id, seed, force_decay[, non_compliance])`` each, vectorised.

        Each plan is read by :func:`server.plan_text.read_plan` (a text as the training rewards read
        a completion; a dict as the plan object itself). One that is not a plan (``None``, ``{}``,
        prose, no usable tooth group, a repeated key) scores :func:`server.plan_text.not_a_plan_result`:
        scaled reward -2, terminal 0, ``not_a_plan`` the reason (None in a plan's result).
        Raises InvalidActionError for an unknown task or a bad seed."""
        if len(plans) != len(cases):
            raise InvalidActionError(f"got {len(plans)} plans for {len(cases)} cases: send one case per plan")
        resolved = [c if isinstance(c, Case) else generate_case(*c) for c in cases]
        readings = [read_plan(p) for p in plans]
        todo = [i for i, r in enumerate(readings) if r.is_plan]
        scored = score_plan_specs([readings[i].spec for i in todo], [resolved[i] for i in todo])
        out = [not_a_plan_result(r) if not r.is_plan else None for r in readings]
        for i, result in zip(todo, scored):
            out[i] = {**result, "not_a_plan": None}
        return out

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
                poses,
                session.planned[s - 1],
                prev_achieved,
                case.long_axis,
                case.force_decay,
                earlier=session.planned[:s],
            )
            if case.wear is not None:
                achieved = apply_wear(prev_achieved, achieved, case.wear[s - 1])
            pairs_a = _stack(poses, case.target, poses, achieved)
            pairs_b = _stack(session.planned[s - 1], achieved, prev_achieved, prev_achieved)
        else:  # the teeth sit exactly in the aligner: mismatch = achieved increment = increment
            achieved = poses
            pairs_a = _stack(poses, case.target)
            pairs_b = _stack(session.planned[s - 1], achieved)
        mismatch = lag_pairs(case)[0]
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
        pen = mask_contacts(contact_penetration_mm(achieved, case.contacts), case.absent)
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
            absent=None if case.absent is None else case.absent[None],
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


def initial_observation(case: Case, episode_id: str = "") -> dict:
    """The stage-0 observation of a case: what :meth:`StepwiseDentalEnvironment.reset` returns,
    computed without an environment or a session store (a pure function of the case)."""
    return observation(new_session(case, episode_id), step_reward=0.0, breakdown={})


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


def _episode_id(episode_id: object) -> str:
    """A client's episode id, checked, or a new uuid4 for None."""
    if episode_id is None:
        return uuid.uuid4().hex
    if not isinstance(episode_id, str) or not 0 < len(episode_id) <= 128:
        raise InvalidActionError("episode_id must be a non-empty string of at most 128 characters")
    return episode_id


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


__all__ = ["MAX_ROLLBACKS", "TASK_IDS", "StepwiseDentalEnvironment"]
