"""The Gymnasium face of the environment: ``gymnasium.make("OrthoRL/AlignerStaging-v1", ...)``.

A thin adapter over :class:`server.dental_environment.StepwiseDentalEnvironment` (the same episode
store, step and scoring the HTTP/WebSocket server and the TRL tools use): importing this module
registers the id (and the previous ``-v0``, see the class's Version History). Vector envs:
``gymnasium.make_vec("OrthoRL/AlignerStaging-v1", num_envs=N, vectorization_mode="sync")`` (or
``"async"``, one process per env).
"""

from __future__ import annotations

from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from server.cases import HELDOUT_SEED_START, TASK_IDS, TRAIN_SEED_START
from server.clinical_profiles import STRATEGIES
from server.dental_constants import N_STAGES, N_TEETH, POSE_DIM
from server.dental_environment import StepwiseDentalEnvironment
from server.reward_scaler import scale_rewards

ENV_ID = "OrthoRL/AlignerStaging-v1"
PREVIOUS_ENV_IDS = ("OrthoRL/AlignerStaging-v0",)
"""Earlier versions' ids, registered to the current class (the Version History says what changed)."""
REWARD_MODES = ("scaled", "shaped", "environment")
"""The episode reward's forms (:class:`AlignerStagingEnv`, its Rewards section)."""
POSITION_BOUND_MM = 100.0
"""The spaces' bound on a pose's position coordinates (mm): well beyond any case's arch (its teeth
lie within about 40 mm of the origin), so any plan fits; the per-stage limits are far tighter."""


def _pose_box(translation_mm: float) -> spaces.Box:
    low = np.full((N_TEETH, POSE_DIM), -translation_mm)
    low[:, :4] = -1.0
    return spaces.Box(low=low, high=-low, dtype=np.float64)


class AlignerStagingEnv(gym.Env):
    """Clear-aligner staging of one case: 24 aligners, each the next stage's poses of 28 teeth.

    ## Description

    A case (:func:`server.cases.generate_case`) has each tooth's initial and target pose. Each
    step wears the next aligner: its shape (the action) is where the teeth should be after the
    stage. Under ideal dynamics the teeth reach it; with ``force_decay`` they lag; in
    ``task_hard`` a stage may be worn in part. After the 24th aligner the episode terminates and
    is scored (:mod:`server.scoring`). The same episode as the server's ``/ws`` and
    ``POST /episodes``: this class only translates its observation dict to arrays.

    ## Action Space

    ``Box(-b, b, (28, 7), float64)``: one row per tooth in FDI order (11-17, 21-27, 31-37,
    41-47), ``[qw, qx, qy, qz, tx, ty, tz]``: the orientation quaternion (bounds [-1, 1];
    normalised by the environment, a zero quaternion is refused) and the position in mm (bounds
    +-100 mm, :data:`POSITION_BOUND_MM`).

    ## Observation Space

    ``Dict`` of float64 arrays:

    * ``current_config`` (28, 7): the achieved poses now (stage 0: the initial poses), rows as the
      action's, with its bounds.
    * ``target_config`` (28, 7): the target poses.
    * ``initial_config`` (28, 7): the initial poses.
    * ``progress`` (2, 28) in [0, 1]: each tooth's share of its translation (row 0) and rotation
      (row 1) achieved.
    * ``stage`` (1,) in [0, 24]: aligners worn so far.

    ## Rewards

    ``reward_mode`` chooses; in the first two the undiscounted return is exactly the episode's
    ``scaled_reward`` (:mod:`server.reward_scaler`, [-2, 8]), the terminal reward an LLM planner is
    trained and judged on, and the ordering principle holds for every discount gamma in (0, 1]:
    every plan breaking a hard rule has a discounted return below 0, what doing nothing returns,
    and every safe plan returns gamma^23 x its ``scaled_reward`` (>= 0), so safe plans keep the
    terminal reward's order (the oracle's plan and uniform SLERP included):

    * ``"scaled"`` (default): 0 on each step, the ``scaled_reward`` on the 24th. Discounted, every
      plan's return is gamma^23 x its ``scaled_reward``: the same order for any gamma.
    * ``"shaped"``: dense. Potential-based shaping (Ng, Harada and Russell, ICML 1999) for the
      discount ``gamma`` with the running accuracy as the potential Phi (0 at stage 0 and, as the
      episode's end, after the 24th aligner): each step pays ``gamma * Phi(s') - Phi(s)``, which
      sums to 0 over an episode under that discount, so it moves no return. On top, a hard-rule
      breach is charged at the step it happens: the per-stage limit, PDL and collision breaches of
      the aligners worn so far (:meth:`server.episodes.Session.running_breach`) as the step's fall
      in ``scale(b)``, the scaled reward a plan with that breach gets (0 with none, at most -0.25
      with any); the 24th pays the ``scaled_reward`` less what was charged (<= 0 when a rule is
      broken; the rules judged on the whole trajectory -- crowns one apart, aligner shapes,
      the bite, overshoot -- are charged there). Every term of a rule-breaker's return is <= 0 and
      one is <= -0.25 x gamma^t, so its discounted return is below 0 for any gamma in (0, 1]. Set
      ``gamma`` to your learner's discount: under another one the shaping terms no longer cancel.
    * ``"environment"``: the server's own per-step signal, ``step_reward`` (gain in accuracy minus
      0.05 x the share of teeth over the per-stage limits and 0.05 x the collision severity), and
      on the 24th the raw ``terminal_reward`` in [0, 1], as an OpenEnv or HTTP client sees them.
      It guarantees no ordering, discounted or not (a rule-breaker that reaches the target early
      out-earns doing nothing): use it to compare with those clients, not to train.

    ``info`` carries ``reward_breakdown``, ``violations``, ``step_reward`` and ``terminal_reward``
    (the environment's), and ``scaled_reward`` and ``broken_rules`` (the hard rules the plan
    breaks) when done.

    ## Starting State

    Stage 0 of a case: ``reset(seed=s)`` draws the case seed from the seeded generator among the
    training seeds; ``reset(options={"case_seed": k})`` picks case ``k``. ``options["strategy"]``
    (one of :data:`server.clinical_profiles.STRATEGIES`) is declared with every step.

    ## Episode End

    Terminated after the 24th aligner. Never truncated (wrap with ``TimeLimit`` to cut shorter).

    ## Arguments

    ``task_id`` (``task_easy``, ``task_medium``, ``task_hard``), ``force_decay`` (bool),
    ``non_compliance`` (bool; the task's default when None), ``reward_mode`` (above), ``gamma``
    (float in (0, 1], default 1.0: the discount the ``"shaped"`` potential is built for; the other
    modes ignore it).

    ## Version History

    Versions of the env id (:data:`ENV_ID`; the earlier ones in :data:`PREVIOUS_ENV_IDS`), as
    CHANGELOG.md records them:

    * v1, ``OrthoRL/AlignerStaging-v1``: ``"shaped"`` is potential-based for the discount ``gamma``
      (a new argument) and charges a hard-rule breach at the step it happens, so the ordering
      principle holds under discounting
      (v0 paid the undiscounted accuracy gain and charged every breach at the 24th step: under
      gamma = 0.95 every tooth moved in the first aligner returned more than doing nothing). The
      stepwise path is judged as a path: premolar and molar cusps driven into their antagonists
      break ``occlusal_collision`` at any stage, and smoothness pays a tooth only for the share of
      its path that is net movement (:func:`server.scoring.path_efficiency`), so a tooth that
      jiggles or goes out and back is not paid for it. ``OrthoRL/AlignerStaging-v0`` still makes
      an env, this version's (v0's rewards are not kept: they broke the ordering).
    * v0, ``OrthoRL/AlignerStaging-v0``: the first id. Its episode reward was first the environment's
      step rewards plus the raw terminal score (today's ``"environment"``), under which moving everything
      in one aligner out-earned doing nothing; then the scaled reward, with ``reward_mode``
      (``"scaled"``, the default, ``"shaped"`` paying the accuracy gained each stage, ``"environment"``)
      and ``scaled_reward`` and ``broken_rules`` in ``info``.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(
        self,
        task_id: str = "task_easy",
        force_decay: bool = False,
        non_compliance: bool | None = None,
        reward_mode: str = "scaled",
        gamma: float = 1.0,
    ):
        if task_id not in TASK_IDS:
            raise ValueError(f"task_id must be one of {', '.join(TASK_IDS)}, got {task_id!r}")
        if reward_mode not in REWARD_MODES:
            raise ValueError(f"reward_mode must be one of {', '.join(REWARD_MODES)}, got {reward_mode!r}")
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be a discount in (0, 1], got {gamma!r}")
        self.reward_mode = reward_mode
        self.gamma = float(gamma)
        self._potential = self._charged = 0.0
        self.task_id, self.force_decay = task_id, bool(force_decay)
        self.non_compliance = non_compliance
        self._store = StepwiseDentalEnvironment(max_sessions=2, ttl_seconds=1e9)
        self._episode_id: str | None = None
        self._strategy: str | None = None
        config = _pose_box(POSITION_BOUND_MM)
        self.action_space = _pose_box(POSITION_BOUND_MM)
        self.observation_space = spaces.Dict(
            {
                "current_config": config,
                "target_config": config,
                "initial_config": config,
                "progress": spaces.Box(0.0, 1.0, (2, N_TEETH), np.float64),
                "stage": spaces.Box(0.0, float(N_STAGES), (1,), np.float64),
            }
        )

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        super().reset(seed=seed)
        options = dict(options or {})
        unknown = set(options) - {"case_seed", "strategy"}
        if unknown:
            raise ValueError(f"unknown reset options {sorted(unknown)}: use case_seed, strategy")
        strategy = options.get("strategy")
        if strategy is not None and strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        case_seed = options.get("case_seed")
        if case_seed is None:
            case_seed = int(self.np_random.integers(TRAIN_SEED_START, HELDOUT_SEED_START))
        if self._episode_id is not None:
            self._store.close_episode(self._episode_id)
        kwargs = {} if self.non_compliance is None else {"non_compliance": bool(self.non_compliance)}
        obs = self._store.reset(
            task_id=self.task_id, seed=int(case_seed), force_decay=self.force_decay, **kwargs
        )
        self._episode_id, self._strategy = obs["episode_id"], strategy
        self._potential = self._charged = 0.0
        return self._arrays(obs), self._info(obs)

    def step(self, action: np.ndarray) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        if self._episode_id is None:
            raise RuntimeError("call reset() before step()")
        obs = self._store.step(self._episode_id, np.asarray(action), strategy=self._strategy)
        info = self._info(obs)
        done = bool(obs["done"])
        if done:
            terminal = self._store.sessions.get(self._episode_id).terminal
            info["scaled_reward"] = float(terminal["scaled_reward"])
            info["broken_rules"] = list(terminal["broken_rules"])
        if self.reward_mode == "environment":
            reward = float(obs["step_reward"])
            if done:
                reward += float(obs["terminal_reward"])
        elif self.reward_mode == "shaped":
            reward = self._shaped_reward(obs, info, done)
        else:
            reward = info["scaled_reward"] if done else 0.0
        return self._arrays(obs), reward, done, False, info

    def _shaped_reward(self, obs: dict[str, Any], info: dict[str, Any], done: bool) -> float:
        """One step's ``"shaped"`` reward (the class docstring's Rewards): the potential's
        discounted change, the step's breach charge and, on the 24th, the terminal remainder."""
        potential = 0.0 if done else float(obs["reward_breakdown"]["accuracy"])
        shaping = self.gamma * potential - self._potential
        breach = self._store.sessions.get(self._episode_id).running_breach()
        charged = float(scale_rewards(np.zeros(1), np.array([breach]))[0])  # 0 with no breach
        reward = shaping + (charged - self._charged)
        self._potential, self._charged = potential, charged
        if done:
            remainder = info["scaled_reward"] - charged
            reward += min(remainder, 0.0) if info["broken_rules"] else remainder
        return reward

    def close(self) -> None:
        if self._episode_id is not None:
            self._store.close_episode(self._episode_id)
            self._episode_id = None

    @property
    def episode_id(self) -> str | None:
        """The store's id of the current episode."""
        return self._episode_id

    @property
    def store(self) -> StepwiseDentalEnvironment:
        """The episode store behind this env (its ``score_plan`` scores whole plans)."""
        return self._store

    def _arrays(self, obs: dict[str, Any]) -> dict[str, np.ndarray]:
        progress = obs["per_tooth_progress"]
        return {
            "current_config": np.asarray(obs["current_config"], dtype=np.float64),
            "target_config": np.asarray(obs["target_config"], dtype=np.float64),
            "initial_config": np.asarray(obs["initial_config"], dtype=np.float64),
            "progress": np.clip(
                np.array([progress["translation"], progress["rotation"]], dtype=np.float64), 0, 1
            ),
            "stage": np.array([float(obs["current_stage"])]),
        }

    @staticmethod
    def _info(obs: dict[str, Any]) -> dict[str, Any]:
        return {
            "case_seed": int(obs["seed"]),
            "reward_breakdown": dict(obs["reward_breakdown"]),
            "violations": dict(obs["violations"]),
            "step_reward": float(obs["step_reward"]),
            "terminal_reward": obs.get("terminal_reward"),
        }


for _env_id in (ENV_ID, *PREVIOUS_ENV_IDS):
    if _env_id not in gym.registry:
        gym.register(id=_env_id, entry_point="server.gym_env:AlignerStagingEnv")

__all__ = ["ENV_ID", "PREVIOUS_ENV_IDS", "REWARD_MODES", "AlignerStagingEnv"]
