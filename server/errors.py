"""Exceptions of the environment. Messages say what was wrong and what to send instead."""

from __future__ import annotations


class InvalidActionError(ValueError):
    """A request the environment refuses (bad poses, unknown task, finished episode…).

    The session it names is left unchanged.
    """


class UnknownEpisodeError(KeyError):
    """No live session has this episode_id (never created, evicted by the LRU cap, or expired)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown episode"
