"""Completion parsing: LLM text -> plan dict, and the five partial format checks. Nothing here raises.

What a plan is, and the scan that finds it in a text, are :mod:`server.plan_text`'s (every face
of the environment reads plans there); this module re-exports its scan and adds the job's side:

* :func:`extract_plan` returns the object the scan found: the first top-level JSON object holding
  ``tooth_groups`` (the plan's defining key), else the first object (a JSON object that is not a
  plan: the rollouts give it no credit, but the format checks can say what it got right), else
  None. :func:`find_plan` also counts the objects holding ``tooth_groups``: more than one is
  ambiguous and costs the ``single_plan`` format check. Whether that object *is* a plan (a usable
  group, no repeated key) is :func:`server.plan_text.read_plan_text`'s answer, which the rollouts
  score by.
* :func:`completion_text`: the text of a TRL completion (string, messages, parts, bytes).
* :func:`format_checks` scores a parsed plan with five partial checks (those the project's original
  specification defines), each 0 or 1, following the plan semantics of :mod:`server.plans` (booleans are not tooth ids, strings are
  not fractions), and ``total`` = their mean.
"""

from __future__ import annotations

from collections.abc import Mapping

from server.clinical_profiles import STRATEGIES
from server.dental_constants import N_STAGES, PRIORITY_START_STAGE, TOOTH_INDEX
from server.plan_text import (
    MAX_CANDIDATES,
    MAX_COMPLETION_CHARS,
    MAX_DECODE_CHARS,
    MAX_JSON_DEPTH,
    PLAN_KEY,
    PlanReading,
    find_plan,
    read_plan_text,
)
from server.plans import MAX_GROUPS, MAX_OVERCORRECTION

FORMAT_CHECKS: tuple[str, ...] = ("parse", "shape", "teeth_ints", "fraction_ok", "strategy_ok", "single_plan")


def extract_plan(text: str) -> dict | None:
    """The object :func:`find_plan` found in ``text`` (see the module docstring), or None. Never raises."""
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
    """The format checks (each 0.0 or 1.0) and their mean ``total``: the five of the project's original
    specification and one more.

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
    "MAX_DECODE_CHARS",
    "MAX_JSON_DEPTH",
    "PLAN_KEY",
    "PlanReading",
    "completion_text",
    "extract_plan",
    "find_plan",
    "format_checks",
    "read_plan_text",
]
