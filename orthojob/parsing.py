"""Completion parsing: LLM text -> plan dict, and the five partial format checks. Nothing here raises.

:func:`extract_plan` returns the **first balanced JSON object** in a completion (not the span
from the first ``{`` to the last ``}``, which breaks on ``{...} and then {...}``):

* Only the first :data:`MAX_COMPLETION_CHARS` characters are read (a plan is a few hundred).
* Outside an object, text is prose: the scan looks for the next ``{``. Inside one, JSON
  strings are skipped whole (braces and escaped quotes inside strings do not count) and
  ``{``/``[`` open a level, ``}``/``]`` close one; the object ends when its level closes.
* A balanced candidate is decoded with :func:`json.loads`; it wins if it is a JSON object
  nested at most :data:`MAX_JSON_DEPTH` levels deep (the object itself is level 1) with only
  finite numbers (``NaN``, ``Infinity``, ``-Infinity``, overflowing literals such as
  ``1e999`` and integers of more than 308 digits are rejected; Python's json accepts them). A candidate that fails is skipped
  whole and the scan goes on after it, for at most :data:`MAX_CANDIDATES` candidates.
* Anything else (no object, unterminated object, non-string input) gives ``None``.

:func:`format_checks` scores a parsed plan with the seed's five partial checks, each 0 or 1,
following the plan semantics of :mod:`server.plans` (booleans are not tooth ids, strings are
not fractions), and ``total`` = their mean.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping

from server.clinical_profiles import STRATEGIES
from server.dental_constants import PRIORITY_START_STAGE, TOOTH_INDEX
from server.plans import MAX_GROUPS

MAX_COMPLETION_CHARS: int = 16_384
"""Characters of a completion scanned for a plan (a plan takes a few hundred; 512 tokens ~ 2,000);
the rest is ignored."""
MAX_JSON_DEPTH: int = 8
"""Deepest nesting accepted in a plan object (a well-formed plan is 4 deep: object, list, object, list)."""
MAX_CANDIDATES: int = 64
"""Balanced candidates tried per completion before giving up."""

FORMAT_CHECKS: tuple[str, ...] = ("parse", "shape", "teeth_ints", "fraction_ok", "strategy_ok")

# Inside an object: a whole JSON string (unrolled loop, no backtracking blow-up), a lone quote
# (an unterminated string: nothing after it can close the object), or a bracket.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|"|[{}\[\]]', re.DOTALL)


class _RejectedError(ValueError):
    """A candidate holds a non-finite number."""


def _reject_constant(name: str) -> float:
    raise _RejectedError(f"non-finite literal {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _RejectedError(f"number {text[:20]} overflows")
    return value


_FLOAT_MAX_DIGITS = 308


def _float_sized_int(text: str) -> int:
    if len(text.lstrip("-")) > _FLOAT_MAX_DIGITS:  # beyond any float: as non-finite as 1e999
        raise _RejectedError(f"integer of {len(text)} digits")
    return int(text)


_DECODER = json.JSONDecoder(
    parse_constant=_reject_constant, parse_float=_finite_float, parse_int=_float_sized_int
)


def _decode(candidate: str) -> dict | None:
    try:
        value, end = _DECODER.raw_decode(candidate)
    except (ValueError, RecursionError):  # JSONDecodeError, _RejectedError, int digit limit, deep input
        return None
    if end != len(candidate) or not isinstance(value, dict):
        return None
    return value


def extract_plan(text: str) -> dict | None:
    """The first balanced JSON object in ``text`` (see the module docstring), or None. Never raises."""
    if not isinstance(text, str) or not text:
        return None
    text = text[:MAX_COMPLETION_CHARS]
    pos = 0
    for _ in range(MAX_CANDIDATES):
        start = text.find("{", pos)
        if start < 0:
            return None
        depth = 0
        deepest = 0
        end = -1
        for match in _TOKEN.finditer(text, start):
            token = match.group()
            ch = token[0]
            if ch == '"':
                if len(token) == 1:  # unterminated string: no candidate can close
                    return None
                continue
            if ch in "{[":
                depth += 1
                deepest = max(deepest, depth)
            else:
                depth -= 1
                if depth == 0:
                    end = match.end()
                    break
        if end < 0:  # the object never closes
            return None
        if deepest <= MAX_JSON_DEPTH:
            plan = _decode(text[start:end])
            if plan is not None:
                return plan
        pos = end
    return None


def completion_text(completion: object) -> str:
    """The text of one TRL completion. Never raises; anything unrecognised gives ``""``.

    Accepts a plain string, a conversational completion (a list of messages
    ``[{"role": "assistant", "content": ...}]``: the assistant messages' contents joined,
    or every message's when none is marked assistant), one message dict, content given as
    a list of parts (``[{"type": "text", "text": ...}]``), or UTF-8 bytes.
    """
    try:
        return _text(completion, 0)
    except Exception:  # hostile objects (odd __str__, broken mappings): never fail a reward
        return ""


def _text(value: object, level: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value[: 4 * MAX_COMPLETION_CHARS]).decode("utf-8", errors="replace")
    if level > 3:
        return ""
    if isinstance(value, Mapping):
        if "content" in value:
            return _text(value["content"], level + 1)
        if "text" in value:
            return _text(value["text"], level + 1)
        return ""
    if isinstance(value, (list, tuple)):
        items = list(value)
        messages = [m for m in items if isinstance(m, Mapping)]
        assistant = [m for m in messages if m.get("role") == "assistant"]
        chosen = assistant or items
        return "".join(_text(m, level + 1) for m in chosen)
    return ""


def _is_tooth(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x in TOOTH_INDEX


def _is_fraction(x: object) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return 0 <= x <= 1  # NaN compares False; a huge int compares without overflowing


def format_checks(plan: dict | None) -> dict[str, float]:
    """The seed's five partial format checks (each 0.0 or 1.0) and their mean ``total``.

    * ``parse``: the completion held a JSON object.
    * ``shape``: ``tooth_groups`` is a non-empty list of at most MAX_GROUPS objects, each with a
      ``teeth`` list and a ``fraction``, and a ``priority`` (if given) among PRIORITY_START_STAGE.
    * ``teeth_ints``: every tooth id is an integer FDI id of the 28 teeth (booleans are not),
      and no tooth is listed twice.
    * ``fraction_ok``: every group's fraction is a finite number in [0, 1] (not a string).
    * ``strategy_ok``: ``strategy`` is one of STRATEGIES.
    """
    out = dict.fromkeys(FORMAT_CHECKS, 0.0)
    if isinstance(plan, dict):
        out["parse"] = 1.0
        strategy = plan.get("strategy")
        out["strategy_ok"] = float(isinstance(strategy, str) and strategy in STRATEGIES)
        groups = plan.get("tooth_groups")
        if isinstance(groups, list) and groups:
            dicts = [g for g in groups if isinstance(g, dict)]
            all_dicts = len(dicts) == len(groups)
            shaped = (
                all_dicts
                and len(groups) <= MAX_GROUPS
                and all(
                    isinstance(g.get("teeth"), list)
                    and "fraction" in g
                    and (
                        "priority" not in g
                        or (isinstance(g["priority"], str) and g["priority"] in PRIORITY_START_STAGE)
                    )
                    for g in dicts
                )
            )
            out["shape"] = float(shaped)
            teeth = [t for g in dicts if isinstance(g.get("teeth"), list) for t in g["teeth"]]
            teeth_ok = (
                bool(teeth)
                and all(isinstance(g.get("teeth"), list) for g in dicts)
                and all(_is_tooth(t) for t in teeth)
                and len(set(teeth)) == len(teeth)
            )
            out["teeth_ints"] = float(all_dicts and teeth_ok)
            out["fraction_ok"] = float(all_dicts and all(_is_fraction(g.get("fraction")) for g in dicts))
    out["total"] = sum(out[k] for k in FORMAT_CHECKS) / len(FORMAT_CHECKS)
    return out


__all__ = [
    "FORMAT_CHECKS",
    "MAX_CANDIDATES",
    "MAX_COMPLETION_CHARS",
    "MAX_JSON_DEPTH",
    "completion_text",
    "extract_plan",
    "format_checks",
]
