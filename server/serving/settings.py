"""Settings of the environment server: every limit and timeout, its default, and the
environment variable that sets it, in one place.

``ServerSettings.from_env()`` reads the ``ORTHORL_*`` variables (an unset or empty
variable keeps the default); a bad value raises :class:`SettingsError` naming the
variable and what it accepts. ``server.app.create_app`` takes a ``ServerSettings``;
``python -m server.app`` flags override the variables.

| setting | variable | default | meaning |
| --- | --- | --- | --- |
| ``host`` | ``ORTHORL_HOST`` | 127.0.0.1 | address ``python -m server.app`` binds |
| ``port`` | ``ORTHORL_PORT`` | 8000 | its port |
| ``max_sessions`` | ``ORTHORL_MAX_SESSIONS`` | 256 | concurrent WebSocket sessions (4 GRPO batches of 64) |
| ``max_episodes`` | ``ORTHORL_MAX_EPISODES`` | 1024 | live episodes kept (LRU cap over HTTP and WebSocket) |
| ``episode_ttl_s`` | ``ORTHORL_EPISODE_TTL_S`` | 3600 s | an episode untouched this long expires |
| ``max_message_bytes`` | ``ORTHORL_MAX_MESSAGE_BYTES`` | 1,000,000 B | largest HTTP body and WebSocket frame |
| ``ws_idle_timeout_s`` | ``ORTHORL_WS_IDLE_TIMEOUT_S`` | 300 s | a WebSocket with no message from its client this long (idle, frozen or gone) is closed and its slot freed |
| ``ws_ping_interval_s`` | ``ORTHORL_WS_PING_INTERVAL_S`` | 20 s | protocol pings (``python -m server.app``; uvicorn's ``--ws-ping-interval`` otherwise) |
| ``ws_ping_timeout_s`` | ``ORTHORL_WS_PING_TIMEOUT_S`` | 20 s | a connection that does not answer a ping this long is dropped |

``ORTHORL_MAX_BODY_BYTES`` (the earlier name of ``ORTHORL_MAX_MESSAGE_BYTES``) is still read
when the new name is unset.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

CAPACITY_REFUSAL_WAIT_S: float = 5.0
"""A refused WebSocket (server at capacity) is kept open at most this long for the client to
send its first message and read the refusal; then it is closed (code 1013, try again later)."""

MAX_PENDING_REFUSALS: int = 64
"""Refused connections waiting to be read at once; beyond this they are closed at once."""

MAX_ERROR_CHARS: int = 2000
"""An error reply's message is cut to this many characters; replies never echo the input."""

REAPER_PERIOD_S: float = 1.0
"""How often idle WebSocket sessions are looked for (at most; less when the timeout is shorter)."""

WORKERS_VARIABLE = "WEB_CONCURRENCY"
"""uvicorn's (and gunicorn's) environment default for the number of worker processes."""


class SettingsError(ValueError):
    """A bad ``ORTHORL_*`` value or argument; the message names it and what it accepts."""


@dataclass(frozen=True)
class ServerSettings:
    """Limits and timeouts of the server (units in the names: ``_s`` seconds, ``_bytes`` bytes)."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_sessions: int = 256
    max_episodes: int = 1024
    episode_ttl_s: float = 3600.0
    max_message_bytes: int = 1_000_000
    ws_idle_timeout_s: float = 300.0
    ws_ping_interval_s: float = 20.0
    ws_ping_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_episodes", "max_message_bytes", "port"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SettingsError(
                    f"{name} ({ENV_VARIABLES[name]}) must be a positive integer, got {value!r}"
                )
        for name in ("episode_ttl_s", "ws_idle_timeout_s", "ws_ping_interval_s", "ws_ping_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise SettingsError(
                    f"{name} ({ENV_VARIABLES[name]}) must be a positive number of seconds, got {value!r}"
                )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> ServerSettings:
        """Defaults, then the ``ORTHORL_*`` variables of ``environ`` (``os.environ``), then the
        ``overrides`` that are not None."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name, variable in ENV_VARIABLES.items():
            raw = environ.get(variable)
            if raw in (None, "") and name == "max_message_bytes":
                variable, raw = "ORTHORL_MAX_BODY_BYTES", environ.get("ORTHORL_MAX_BODY_BYTES")
            if raw in (None, ""):
                continue
            kind = fields[name].type
            try:
                values[name] = raw if kind == "str" else (int(raw) if kind == "int" else float(raw))
            except ValueError:
                what = "an integer" if kind == "int" else "a number of seconds"
                raise SettingsError(f"{variable} must be {what}, got {raw!r:.40}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - set(fields)
        if unknown:
            raise SettingsError(f"unknown server settings {sorted(unknown)}: known are {sorted(fields)}")
        return cls(**values)  # type: ignore[arg-type]


ENV_VARIABLES: dict[str, str] = {
    "host": "ORTHORL_HOST",
    "port": "ORTHORL_PORT",
    "max_sessions": "ORTHORL_MAX_SESSIONS",
    "max_episodes": "ORTHORL_MAX_EPISODES",
    "episode_ttl_s": "ORTHORL_EPISODE_TTL_S",
    "max_message_bytes": "ORTHORL_MAX_MESSAGE_BYTES",
    "ws_idle_timeout_s": "ORTHORL_WS_IDLE_TIMEOUT_S",
    "ws_ping_interval_s": "ORTHORL_WS_PING_INTERVAL_S",
    "ws_ping_timeout_s": "ORTHORL_WS_PING_TIMEOUT_S",
}
"""The environment variable of each setting."""
