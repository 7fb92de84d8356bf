"""JSON values: the one walk from what the environment and the job produce to plain JSON types.

:func:`json_value` turns nested dicts, lists and tuples of Python, numpy and torch values (scalars
with ``.item()``, arrays and tensors with ``.tolist()``, pydantic models with ``.model_dump()``)
into ``None``/``bool``/``int``/``float``/``str``/``list``/``dict`` with string keys. What it does
with a non-finite number is the caller's policy, the one thing the callers differ in:

* ``non_finite="raise"`` (the server's outputs, :func:`server.serving.serialization.to_jsonable`):
  :class:`NonFiniteOutputError` naming the path of the value, e.g. ``teeth[3].pdl``. A client must
  never read a NaN the environment produced as a JSON ``null``. A value of another type raises too.
* ``non_finite="null"`` (the job's files: gate files, train logs, summaries,
  :func:`orthojob.ops.records.json_value`): ``None``, so the files stay valid JSON (``allow_nan=False``)
  and a missing value reads as missing; a value of another type becomes its ``str``.

Error details echoed to a client are not walked whole: :func:`server.serving.serialization.json_safe`
summarises untrusted input within size bounds.
"""

from __future__ import annotations

import math
from typing import Any, Literal

NonFinite = Literal["raise", "null"]


class NonFiniteOutputError(RuntimeError):
    """The environment produced NaN/inf (or a value JSON cannot hold); ``str`` names its path."""


def json_value(obj: Any, non_finite: NonFinite = "null", path: str = "", keep: tuple[type, ...] = ()) -> Any:
    """A plain-JSON copy of ``obj`` (see the module docstring); ``path`` prefixes error paths;
    values of the ``keep`` types are returned as they are (JSON already encoded, say)."""
    if non_finite not in ("raise", "null"):
        raise ValueError(f"non_finite must be 'raise' or 'null', got {non_finite!r}")
    return _walk(obj, non_finite == "raise", path, keep)


def _walk(obj: Any, strict: bool, path: str, keep: tuple[type, ...] = ()) -> Any:
    if obj is None or isinstance(obj, (bool, str)) or (keep and isinstance(obj, keep)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return float(obj)
        if strict:
            raise NonFiniteOutputError(
                f"the environment produced a non-finite number ({obj}) at {path or 'the top level'}"
            )
        return None
    if isinstance(obj, dict):
        return {str(k): _walk(v, strict, f"{path}.{k}" if path else str(k), keep) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_walk(v, strict, f"{path}[{i}]", keep) for i, v in enumerate(obj)]
    if hasattr(obj, "tolist") and getattr(obj, "ndim", 0) > 0:  # numpy arrays, torch tensors
        return _walk(obj.tolist(), strict, path, keep)
    if hasattr(obj, "item"):  # numpy and torch scalars
        return _walk(obj.item(), strict, path, keep)
    if hasattr(obj, "model_dump"):
        return _walk(obj.model_dump(), strict, path, keep)
    if strict:
        raise NonFiniteOutputError(
            f"the environment produced a non-JSON value of type {type(obj).__name__} at {path or 'the top level'}"
        )
    return str(obj)


__all__ = ["NonFinite", "NonFiniteOutputError", "json_value"]
