"""The JSON the job writes (gate files, train logs, completion records, summaries): one walker.

:func:`json_value` turns what training and evaluation produce (floats, numpy and torch scalars,
numpy arrays, nested dicts, lists and tuples) into plain JSON values, with every non-finite number
as ``null``: the files stay valid JSON (``allow_nan=False``) and a missing value reads as missing.
The HTTP layer has its own strict walker (:func:`server.serialization.to_jsonable`), which refuses
a non-finite number instead of hiding it.
"""

from __future__ import annotations

import math
from typing import Any


def json_value(obj: Any) -> Any:
    """A JSON-ready copy of ``obj``: non-finite floats -> None, scalars with ``.item()`` (numpy,
    torch) -> Python numbers, arrays with ``.tolist()`` -> lists, dict keys -> str."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_value(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_value(v) for v in obj]
    if hasattr(obj, "tolist") and getattr(obj, "ndim", 0) > 0:
        return json_value(obj.tolist())
    if hasattr(obj, "item"):
        return json_value(obj.item())
    return obj


__all__ = ["json_value"]
