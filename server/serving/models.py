"""Wire types of the HTTP/WebSocket app (pydantic v2).

The constraints live in the types, not in validators that raise ``ValueError``: a
validator's exception object ends up in ``ValidationError.errors()`` (``ctx``) and is not
JSON-serialisable, which turned bad input into HTTP 500s and closed WebSocket sessions
in openenv-core 0.3.0. Here every check is a declarative constraint:

* numbers in actions are *strict* floats (``true`` and ``"1.0"`` are refused, integers
  are accepted), finite (``NaN``, ``Infinity`` and ``1e400`` are refused) and within
  +-1e6 (the environment's bound, so schema-driven fuzzers reach the environment);
* a strategy is one of :data:`server.clinical_profiles.STRATEGIES`, a task one of
  ``task_easy``/``task_medium``/``task_hard``, a seed a strict integer in [0, 2**63);
* a pose has exactly 7 numbers ``[qw, qx, qy, qz, tx, ty, tz]`` and an action exactly
  28 poses, in :data:`server.dental_constants.TOOTH_IDS` order;
* unknown fields are refused.

Outputs use non-strict finite floats: a non-finite number in an observation is a bug of
the environment and is reported as such instead of being serialised as ``null``.
"""

from __future__ import annotations

from itertools import chain
from typing import Annotated, Any, Literal

import numpy as np
from openenv.core.env_server.types import Action, Observation, State
from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.cases import TASK_IDS
from server.clinical_profiles import STRATEGIES
from server.dental_constants import N_STAGES, N_TEETH, POSE_DIM

TaskId = Literal[TASK_IDS]  # type: ignore[valid-type]
"""A task level (:data:`server.cases.TASK_IDS`)."""

MAX_CASE_ID_CHARS: int = 256
MAX_SEED: int = 2**63 - 1
MAX_EPISODE_ID_CHARS: int = 128
MAX_PLAN_TEXT_CHARS: int = 100_000

# --- Inputs -------------------------------------------------------------------------

MAX_ABS_POSE_VALUE: float = 1e6
FiniteNumber = Annotated[
    float, Field(strict=True, allow_inf_nan=False, ge=-MAX_ABS_POSE_VALUE, le=MAX_ABS_POSE_VALUE)
]
"""A finite JSON number within +-1e6 (the environment's bound); booleans and strings are refused."""

Pose = Annotated[
    list[FiniteNumber],
    Field(
        min_length=POSE_DIM,
        max_length=POSE_DIM,
        description="[qw, qx, qy, qz, tx, ty, tz]: unit quaternion (w first), crown centroid in mm",
    ),
]
Poses = Annotated[
    list[Pose],
    Field(
        min_length=N_TEETH,
        max_length=N_TEETH,
        description="28 poses in FDI order 11-17, 21-27, 31-37, 41-47",
    ),
]
Strategy = Literal[STRATEGIES]  # type: ignore[valid-type]
"""A declared staging strategy (:data:`server.clinical_profiles.STRATEGIES`)."""
Seed = Annotated[int, Field(strict=True, ge=0, le=MAX_SEED)]
EpisodeId = Annotated[str, Field(min_length=1, max_length=MAX_EPISODE_ID_CHARS)]
CaseId = Annotated[str, Field(min_length=1, max_length=MAX_CASE_ID_CHARS)]
NonCompliance = Annotated[
    bool,
    Field(
        strict=True,
        description="missed and partial wear, a lost attachment (task_hard only); seeded by the case",
    ),
]
ForceDecay = Annotated[bool, Field(strict=True)]
ExpectedStage = Annotated[
    int,
    Field(
        strict=True,
        ge=0,
        le=N_STAGES,
        description=(
            "the episode's current_stage this request was computed from; if the episode is at another "
            "stage (a duplicated or out-of-order request) it is refused with 409 and not applied"
        ),
    ),
]
"""Whether the force-decay dynamics is on (a JSON boolean)."""


class DentalAction(Action):
    """The poses of the next stage (one aligner), optionally with the declared strategy.

    Used by OpenEnv's ``step`` (WebSocket ``/ws`` and HTTP ``/step``) and by
    ``POST /episodes/{episode_id}/step``. ``expected_stage`` (optional, recommended over HTTP)
    makes a retried or reordered step a 409 instead of a second stage.
    """

    poses: Poses
    strategy: Strategy | None = None
    expected_stage: ExpectedStage | None = None

    def poses_array(self) -> np.ndarray:
        """The poses as a (28, 7) float array, built without ``np.array``'s shape discovery
        (about twice as fast: the hot path). The values ``np.array(self.poses)`` holds."""
        flat = np.fromiter(chain.from_iterable(self.poses), dtype=np.float64, count=N_TEETH * POSE_DIM)
        return flat.reshape(N_TEETH, POSE_DIM)


class PosesRequest(BaseModel):
    """Body of ``POST /episodes/{episode_id}/simulate``."""

    model_config = ConfigDict(extra="forbid")

    poses: Poses


class CollisionsRequest(BaseModel):
    """Body of ``POST /episodes/{episode_id}/collisions``; no poses: the current stage."""

    model_config = ConfigDict(extra="forbid")

    poses: Poses | None = None


class EpisodeResetRequest(BaseModel):
    """Body of ``POST /episodes``: the case ``(task_id, seed, force_decay, non_compliance)``, or a
    case of the server's case set (``case_id``), or a whole case record (``case``)."""

    model_config = ConfigDict(extra="forbid")

    task_id: TaskId = "task_easy"
    seed: Seed | None = Field(default=None, description="case seed; omitted or null: the server draws one")
    force_decay: ForceDecay = False
    non_compliance: NonCompliance = False
    case_id: CaseId | None = Field(
        default=None,
        description="a case of the case set the server was started with (--cases FILE), instead of task_id and seed",
    )
    case: dict[str, Any] | None = Field(
        default=None,
        description="a whole case record (docs/cases.md, checked, every problem named), instead of task_id and seed",
    )

    @model_validator(mode="after")
    def _one_case(self) -> EpisodeResetRequest:
        if (self.case_id is not None or self.case is not None) and {
            "task_id",
            "seed",
        } & self.model_fields_set:
            raise ValueError("give task_id and seed (a generated case) or case_id / case, not both")
        return self

    def reset_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :meth:`StepwiseDentalEnvironment.reset` (an imported case keeps its
        own dynamics unless ``force_decay`` is given)."""
        if self.case_id is None and self.case is None:
            return {"task_id": self.task_id, "seed": self.seed, "force_decay": self.force_decay,
                    "non_compliance": self.non_compliance}  # fmt: skip
        force_decay = self.force_decay if "force_decay" in self.model_fields_set else None
        return {"case_id": self.case_id, "case": self.case, "force_decay": force_decay,
                "non_compliance": self.non_compliance}  # fmt: skip


class ResetParams(EpisodeResetRequest):
    """Reset parameters accepted over OpenEnv's ``reset`` (WebSocket or HTTP ``/reset``)."""

    episode_id: EpisodeId | None = None


class PlanScoreRequest(BaseModel):
    """Body of ``POST /plans/score``: a whole treatment plan scored as one episode.

    The plan is the plan object, or a text holding it (a model's raw completion), read as every
    face reads a plan (:mod:`server.plan_text`): malformed groups are ignored and counted by the
    format score; a body whose plan is not one (no object holding ``tooth_groups``, no usable
    group, a repeated key) is answered 200 with scaled reward -2 and ``not_a_plan`` the reason.
    """

    model_config = ConfigDict(extra="forbid")

    plan: dict[str, Any] | Annotated[str, Field(max_length=MAX_PLAN_TEXT_CHARS)]
    task_id: TaskId
    seed: Seed
    force_decay: ForceDecay = False
    non_compliance: NonCompliance = False


# --- Outputs ------------------------------------------------------------------------

OutFloat = Annotated[float, Field(allow_inf_nan=False)]
Config = list[list[OutFloat]]


class EpisodeObservation(BaseModel):
    """An observation as returned by the episode routes (the environment's dict)."""

    model_config = ConfigDict(extra="allow")

    episode_id: str
    task_id: str
    seed: int
    force_decay: bool
    non_compliance: bool = False
    current_stage: int
    stages_remaining: int
    initial_config: Config
    current_config: Config
    target_config: Config
    per_tooth_progress: dict[str, list[OutFloat]]
    case_summary: dict[str, Any]
    step_reward: OutFloat
    reward_breakdown: dict[str, OutFloat]
    terminal_reward: OutFloat | None = None
    done: bool
    violations: dict[str, int]


class DentalObservation(Observation, EpisodeObservation):
    """OpenEnv observation: the episode observation plus OpenEnv's ``reward``/``metadata``.

    ``reward`` is the step's reward (``step_reward``) and, on the last stage, the
    terminal reward added to it.
    """

    model_config = ConfigDict(extra="allow", validate_assignment=False, arbitrary_types_allowed=False)

    done: bool = False
    reward: OutFloat | None = None


class DentalState(State):
    """OpenEnv state of one WebSocket session (its current episode)."""

    task_id: str | None = None
    seed: int | None = None
    force_decay: bool | None = None
    non_compliance: bool | None = None
    current_stage: int = 0
    done: bool = False


class TaskInfo(BaseModel):
    task_id: str
    description: str


class TasksResponse(BaseModel):
    tasks: list[TaskInfo]
    n_stages: int
    n_teeth: int
    tooth_ids: list[int]


class CollisionPair(BaseModel):
    model_config = ConfigDict(extra="allow")

    teeth: list[int]
    penetration_mm: OutFloat


class CollisionReport(BaseModel):
    model_config = ConfigDict(extra="allow")

    collision_free: bool
    severity: OutFloat | None = None
    pairs: list[CollisionPair]


class PlanScore(BaseModel):
    """Answer of ``POST /plans/score``: the plan's scores (empty breakdown, terminal 0 and
    scaled -2 for a plan that is not one); ``not_a_plan``: None, or why the plan is not one."""

    model_config = ConfigDict(extra="allow")

    terminal_reward: OutFloat
    scaled_reward: OutFloat
    reward_breakdown: dict[str, OutFloat]
    format: dict[str, Any]
    not_a_plan: str | None = None


class EpisodeClosed(BaseModel):
    """Answer of ``DELETE /episodes/{episode_id}``."""

    episode_id: str
    closed: bool


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body of the app's own routes: ``detail`` names the problem; a 404 adds
    ``reason`` (unknown, closed, evicted, expired), a 409 the episode's ``current_stage``."""

    detail: Any
    reason: str | None = None
    current_stage: int | None = None
