"""Exceptions of the environment. Messages say what was wrong and what to send instead."""

from __future__ import annotations


class InvalidActionError(ValueError):
    """A request the environment refuses (bad poses, unknown task, finished episode…).

    The session it names is left unchanged.
    """


class UnknownEpisodeError(KeyError):
    """No live session has this episode_id.

    ``reason`` says why: ``"unknown"`` (never created here, or forgotten long ago),
    ``"closed"`` (released by its client), ``"evicted"`` (the least recently used when the
    store was full) or ``"expired"`` (untouched longer than the store's TTL).
    """

    def __init__(self, message: str, reason: str = "unknown"):
        super().__init__(message)
        self.reason = reason

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown episode"


class StageConflictError(RuntimeError):
    """A step sent for another stage than the episode's current one (a duplicated or
    out-of-order request); nothing was applied. ``current_stage`` is the episode's stage."""

    def __init__(self, message: str, current_stage: int):
        super().__init__(message)
        self.current_stage = current_stage


class RequestRejectedError(ValueError):
    """Malformed request parameters (e.g. OpenEnv reset data); answered with 422 / an error reply."""


class NoEpisodeError(RuntimeError):
    """A step or state call in an OpenEnv session that has no episode yet; answered with 409."""
