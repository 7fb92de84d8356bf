"""Completion parsing: LLM text -> plan dict, and the five partial format checks. Nothing here raises.

:func:`extract_plan` returns **the plan**: the first top-level JSON object in the completion
that holds ``tooth_groups`` (the plan's defining key); when no object holds it, the
first object (a JSON object that is not a plan: the rollouts give it no credit, but the format
checks can say what it got right). A leading ``{"note": ...}`` therefore does not hide the plan
that follows, and prose that quotes a strategy object is not a plan. :func:`find_plan` also
counts the objects holding ``tooth_groups``: more than one is ambiguous and costs the
``single_plan`` format check. The scan (not the span from the first ``{`` to the last ``}``,
which breaks on ``{...} and then {...}``):

* Only the first :data:`MAX_COMPLETION_CHARS` characters are read (a plan is a few hundred).
* Every ``{`` may start an object: the JSON decoder reads one from there (strings whole, braces and
  escaped quotes inside strings do not count, and the object ends where its braces close). An
  object that decodes is skipped whole, so the objects inside it are not candidates of their own;
  it counts if it is nested at most :data:`MAX_JSON_DEPTH` levels deep (the object itself is
  level 1). Non-finite numbers (``NaN``, ``Infinity``, ``-Infinity``, overflowing literals such as
  ``1e999``, integers of more than 308 digits) are read as ``null``: no value, so a group whose
  fraction is one is invalid on its own, like any other invalid value, and the rest of the plan
  stands.
* A ``{`` from which no object decodes is prose (``use {curly} braces``, ``Use { carefully``, a
  brace before an unterminated quote): the scan goes on at the next ``{`` after it, so such prose
  before the plan does not hide it. (Scanning brackets from a stray ``{`` instead cannot tell where
  its "object" ends: it never closes, or it closes at the plan's last brace and swallows the plan.)
  The exception is an object cut by the end of the text (the decoder runs out of text, or a string
  never terminates): a truncated plan, whose complete inner groups are not objects of their own;
  the scan ends there.
* At most :data:`MAX_CANDIDATES` braces are tried per completion, and the decoder reads at most
  :data:`MAX_DECODE_CHARS` characters over all of them (it stops at the first character that cannot
  continue an object, so a brace in prose costs a few), however hostile the text: linear in the cap.
* Anything else (no object, only unterminated objects, non-string input) gives ``None``.

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
from server.dental_constants import N_STAGES, PRIORITY_START_STAGE, TOOTH_INDEX
from server.plans import MAX_GROUPS, MAX_OVERCORRECTION

MAX_COMPLETION_CHARS: int = 16_384
"""Characters of a completion scanned for a plan (a plan takes a few hundred; 512 tokens ~ 2,000);
the rest is ignored."""
MAX_JSON_DEPTH: int = 8
"""Deepest nesting accepted in a plan object (a well-formed plan is 4 deep: object, list, object, list)."""
MAX_CANDIDATES: int = 64
"""Braces tried per completion as the start of an object (decoded or not) before giving up."""
MAX_DECODE_CHARS: int = 4 * MAX_COMPLETION_CHARS
"""Characters the JSON decoder may read per completion, over every brace it tries (a brace in prose
costs the few characters up to where it fails, the plan its own length): the scan's hard bound."""

FORMAT_CHECKS: tuple[str, ...] = ("parse", "shape", "teeth_ints", "fraction_ok", "strategy_ok", "single_plan")
PLAN_KEY: str = "tooth_groups"
"""The key that makes a JSON object a plan."""


def _no_value(name: str) -> None:
    return None  # NaN, Infinity, -Infinity


def _finite_float(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


_FLOAT_MAX_DIGITS = 308


def _float_sized_int(text: str) -> int | None:
    if len(text.lstrip("-")) > _FLOAT_MAX_DIGITS:  # beyond any float: as non-finite as 1e999
        return None
    return int(text)


_DECODER = json.JSONDecoder(parse_constant=_no_value, parse_float=_finite_float, parse_int=_float_sized_int)
_PLAIN_DECODER = json.JSONDecoder()
"""Python's own number parsing, for a text in which no number can be non-finite (see
:data:`_NON_FINITE`): the same values as :data:`_DECODER` without its per-number Python calls."""
_NON_FINITE = re.compile(r"NaN|Infinity|[0-9][eE]|[0-9]{309}")
"""Where a non-finite number can hide: a NaN or Infinity literal, an exponent, or more than 308
digits in a row (overflowing floats and integers beyond any float); texts without it decode the
same with :data:`_PLAIN_DECODER`."""
_CONTAINERS = frozenset((dict, list))
_UNTERMINATED = "Unterminated string"
"""How :class:`json.JSONDecodeError` begins for a string that runs to the end of the text (its
``pos`` is then the string's opening quote, not the end)."""


def _nested_within(value: dict | list, depth: int) -> bool:
    """Whether the decoded JSON container ``value`` nests at most ``depth`` levels (itself is 1)."""
    if depth < 1:
        return False
    children = value.values() if type(value) is dict else value
    if _CONTAINERS.isdisjoint(map(type, children)):
        return True
    return all(_nested_within(c, depth - 1) for c in children if type(c) in _CONTAINERS)


def _objects(text: str):
    """The decodable top-level JSON objects of ``text``, in order (see the module docstring)."""
    text = text[:MAX_COMPLETION_CHARS]
    decoder = _DECODER if _NON_FINITE.search(text) else _PLAIN_DECODER
    pos = 0
    budget = MAX_DECODE_CHARS
    for _ in range(MAX_CANDIDATES):
        start = text.find("{", pos)
        if start < 0 or budget <= 0:
            return
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError as exc:
            if exc.pos >= len(text) or exc.msg.startswith(_UNTERMINATED):
                return  # the object is cut by the end of the text: its inner objects are not plans
            budget -= exc.pos - start
            pos = start + 1  # no object starts at this brace: prose, try the next one
            continue
        except (ValueError, RecursionError):  # nesting beyond Python's recursion limit
            budget -= len(text) - start  # read up to there (at most the rest of the text)
            pos = start + 1
            continue
        budget -= end - start
        if _nested_within(value, MAX_JSON_DEPTH):
            yield value
        pos = end


def find_plan(text: str) -> tuple[dict | None, int]:
    """``(plan, n)``: the plan (see the module docstring) and the number ``n`` of objects holding
    ``tooth_groups``. ``(None, 0)`` when the text holds no JSON object. Never raises."""
    if not isinstance(text, str) or not text:
        return None, 0
    first = plan = None
    count = 0
    for obj in _objects(text):
        if first is None:
            first = obj
        if PLAN_KEY in obj:
            count += 1
            if plan is None:
                plan = obj
    return (plan if plan is not None else first), count


def extract_plan(text: str) -> dict | None:
    """The plan in ``text`` (see the module docstring), or None. Never raises."""
    return find_plan(text)[0]


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
    if type(value) is dict or isinstance(value, Mapping):  # (a plain dict skips the ABC check)
        if "content" in value:
            return _text(value["content"], level + 1)
        if "text" in value:
            return _text(value["text"], level + 1)
        return ""
    if isinstance(value, (list, tuple)):
        items = list(value)
        messages = [m for m in items if type(m) is dict or isinstance(m, Mapping)]
        assistant = [m for m in messages if m.get("role") == "assistant"]
        chosen = assistant or items
        return "".join(_text(m, level + 1) for m in chosen)
    return ""


def _is_tooth(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x in TOOTH_INDEX


def _all_teeth(items: list) -> bool:
    """``all(_is_tooth(t) for t in items)``, at C speed when every item is a plain int."""
    if _INT_ONLY.issuperset(map(type, items)):
        return all(map(TOOTH_INDEX.__contains__, items))
    return all(_is_tooth(t) for t in items)


_INT_ONLY = frozenset((int,))


def _is_stage(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= N_STAGES


def _is_overcorrection(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= MAX_OVERCORRECTION


def _is_fraction(x: object) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return 0 <= x <= 1  # NaN compares False; a huge int compares without overflowing


def format_checks(plan: dict | None, plan_objects: int = 1) -> dict[str, float]:
    """The format checks (each 0.0 or 1.0) and their mean ``total``: the seed's five and one more.

    * ``parse``: the completion held a JSON object.
    * ``shape``: ``tooth_groups`` is a non-empty list of at most MAX_GROUPS objects, each with a
      ``teeth`` list and a ``fraction``, a ``priority`` (if given) among PRIORITY_START_STAGE and
      a ``start_stage`` (if given) an integer from 1 to N_STAGES and an ``overcorrection`` (if
      given) a number in [0, MAX_OVERCORRECTION].
    * ``teeth_ints``: every tooth id is an integer FDI id of the 28 teeth (booleans are not),
      and no tooth is listed twice.
    * ``fraction_ok``: every group's fraction is a finite number in [0, 1] (not a string).
    * ``strategy_ok``: ``strategy`` is one of STRATEGIES.
    * ``single_plan``: exactly one object held ``tooth_groups`` (``plan_objects``, from
      :func:`find_plan`); several are ambiguous (the first is scored).
    """
    out = dict.fromkeys(FORMAT_CHECKS, 0.0)
    if isinstance(plan, dict):
        out["parse"] = 1.0
        strategy = plan.get("strategy")
        out["strategy_ok"] = float(isinstance(strategy, str) and strategy in STRATEGIES)
        out["single_plan"] = float(plan_objects == 1 and PLAN_KEY in plan)
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
                    and ("start_stage" not in g or _is_stage(g["start_stage"]))
                    and ("overcorrection" not in g or _is_overcorrection(g["overcorrection"]))
                    for g in dicts
                )
            )
            out["shape"] = float(shaped)
            teeth = [t for g in dicts if isinstance(g.get("teeth"), list) for t in g["teeth"]]
            teeth_ok = (
                bool(teeth)
                and all(isinstance(g.get("teeth"), list) for g in dicts)
                and _all_teeth(teeth)
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
    "PLAN_KEY",
    "completion_text",
    "extract_plan",
    "find_plan",
    "format_checks",
]
