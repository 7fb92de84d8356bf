"""The JSON the job writes (gate files, train logs, completion records, summaries).

:func:`json_value` is the one JSON walk (:mod:`server.json_values`) with the job's policy: every
non-finite number becomes ``null``, so the files stay valid JSON (``allow_nan=False``) and a missing
value reads as missing. The server's outputs take the same walk, strict: a non-finite number is
refused there, naming its path.
"""

from __future__ import annotations

from typing import Any

from server import json_values


def json_value(obj: Any) -> Any:
    """A JSON-ready copy of ``obj``: non-finite floats -> None, scalars with ``.item()`` (numpy,
    torch) -> Python numbers, arrays with ``.tolist()`` -> lists, dict keys -> str, other objects
    -> their ``str``."""
    return json_values.json_value(obj, "null")


__all__ = ["json_value"]
