"""The agentic tools over the environment server (``--env-url``): one OpenEnv session per episode."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np

from server.agent_tools import (
    ToolError,
)
from server.errors import InvalidActionError, StageConflictError


class RemoteStepwise:
    """What :class:`DentalToolEnv` asks of :class:`StepwiseDentalEnvironment`, over the environment
    server (``python -m server.app``): one WebSocket session (:class:`orthojob.agentic.env_client.EnvSession`,
    OpenEnv's client) per environment, reset and commits as OpenEnv's reset/step messages (with
    ``expected_stage``), the other tools as the server's ``tool`` message on the session's own
    episode. A refused action comes back as the same :class:`InvalidActionError` message as in
    process; a lost episode (server restart, idle reaping) as a :class:`ToolError`. A plan given to
    ``submit_plan`` is scored in process (the one-shot rewards' scoring), as without a server."""

    def __init__(self, url: str, message_timeout_s: float = 60.0) -> None:
        # OpenEnv's client takes seconds to import and sets the hub's progress-bar state: only --env-url
        # loads it (tests/test_module_map.py: the CLI imports no openenv)
        from orthojob.agentic.env_client import EnvServerError, EnvSession, EpisodeLostError

        self._server_error, self._lost_error = EnvServerError, EpisodeLostError
        self.url = url
        self.session = EnvSession(url, message_timeout_s=message_timeout_s)

    def _guard(self, call: Callable) -> dict:
        try:
            return call()
        except self._server_error as exc:
            message = str(exc.data.get("message") or exc)
            if exc.code == "STAGE_CONFLICT":
                raise StageConflictError(message, exc.data.get("current_stage")) from None
            raise InvalidActionError(message) from None
        except self._lost_error as exc:
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
