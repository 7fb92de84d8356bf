"""What is a plan: a model's text (or an already-decoded JSON value) read as a treatment plan, or
the reason it is not one. Every face that judges plans reads them here, so they all read a text
the same way: the training rewards (:mod:`orthojob.rewards.rollouts`), the environment's
``score_plan`` / ``score_plans`` (:class:`server.dental_environment.StepwiseDentalEnvironment`),
``POST /plans/score``, the agent tools' ``submit_plan`` (in process, over MCP and over the
WebSocket) and the verifiers taskset (through the rewards and the tools).

**A plan** is the first JSON object of the text that holds ``tooth_groups`` (:data:`PLAN_KEY`)
and has at least one usable tooth group (:func:`server.plans.normalize_plan`: a group that sets
at least one tooth), in which no object repeats a key. Anything else is not a plan, with a reason
that says what to fix: no JSON object, a text cut inside one, no object holding ``tooth_groups``,
a repeated key (JSON keeps only the last value, so ``"tooth_groups"`` twice would silently score
the second list), or no usable group. A face scores a text that is not a plan
:data:`server.reward_scaler.REWARD_MIN` (terminal 0, no rule broken: :func:`not_a_plan_result`)
or refuses it with the reason; a plan scores the same on every face.

**Internal baseline.** :func:`server.treatment.score_plans` (and ``score_plan_specs``), the
internal array API that baselines, gates, the oracle and the rubric call, keeps reading any value
through :func:`server.plans.normalize_plan`, where a value with no usable group (``None``, ``{}``)
is uniform SLERP: that is how the project writes the uniform-SLERP baseline. It is never a public
face: what a client or a model sends goes through :func:`read_plan` first.

**The text scan** (not the span from the first ``{`` to the last ``}``, which breaks on
``{...} and then {...}``):

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
* At most :data:`MAX_CANDIDATES` braces are tried per text, and the decoder reads at most
  :data:`MAX_DECODE_CHARS` characters over all of them (it stops at the first character that cannot
  continue an object, so a brace in prose costs a few), however hostile the text: linear in the cap.
* Repeated keys are looked for in the plan object alone, by decoding its span once more with a
  hook that sees every object's key list (the scan itself runs without one, at C speed).

:func:`find_plan` is the scan's raw answer (the plan object, or the first object when none holds
``tooth_groups``, and how many hold it), which the format checks of
:mod:`orthojob.core.parsing` grade.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from server.plans import PlanSpec, normalize_plan
from server.reward_scaler import REWARD_MIN

MAX_COMPLETION_CHARS: int = 16_384
"""Characters of a text scanned for a plan (a plan takes a few hundred; 512 tokens ~ 2,000);
the rest is ignored."""
MAX_JSON_DEPTH: int = 8
"""Deepest nesting accepted in a plan object (a well-formed plan is 4 deep: object, list, object, list)."""
MAX_CANDIDATES: int = 64
"""Braces tried per text as the start of an object (decoded or not) before giving up."""
MAX_DECODE_CHARS: int = 4 * MAX_COMPLETION_CHARS
"""Characters the JSON decoder may read per text, over every brace it tries (a brace in prose
costs the few characters up to where it fails, the plan its own length): the scan's hard bound."""
PLAN_KEY: str = "tooth_groups"
"""The key that makes a JSON object a plan."""

PLAN_SHAPE: str = (
    '{"strategy": ..., "tooth_groups": [{"teeth": [FDI ids], "fraction": f, "priority": ...}]} '
    "with at least one known tooth and a fraction in [0, 1]"
)
"""The plan format, as the reasons quote it."""
NO_OBJECT: str = f"no JSON object in the text: write the plan as one JSON object {PLAN_SHAPE}"
CUT_OBJECT: str = (
    f"the text ends inside a JSON object (cut off, or a brace or quote left open): send {PLAN_SHAPE}"
)
NO_PLAN_KEY: str = f'no JSON object holds "{PLAN_KEY}": send {PLAN_SHAPE}'
NO_USABLE_GROUP: str = f"no usable tooth group in the plan: send {PLAN_SHAPE}"
TOO_DEEP: str = f"the plan object nests more than {MAX_JSON_DEPTH} levels deep: send {PLAN_SHAPE}"


def repeated_key(key: str) -> str:
    """The reason for a plan in which one object lists ``key`` twice."""
    return (
        f"the plan repeats the key {json.dumps(key[:60])} in one object (JSON keeps only its last "
        "value): write each key once"
    )


def too_long(size: int) -> str:
    """The reason for a plan object longer, as compact JSON text, than any face reads."""
    return (
        f"the plan is {size} characters as JSON text; a plan is read from its first "
        f"{MAX_COMPLETION_CHARS}: send only the plan"
    )


def not_an_object(value: object) -> str:
    """The reason for a decoded value that is not an object (``None``, a list, a number...)."""
    kind = "null" if value is None else type(value).__name__
    return f"the plan is {kind}, not a JSON object: send {PLAN_SHAPE}"


@dataclass(frozen=True)
class PlanReading:
    """How a text (or a decoded value) reads as a plan.

    Attributes:
        plan: the plan when the text holds one, else None.
        reason: None for a plan, else why it is not one (a sentence saying what to fix).
        found: the object the format checks grade: the plan object (also when it is not a plan:
            no usable group, a repeated key), else the text's first object, else None.
        plan_objects: how many objects of the text hold ``tooth_groups`` (more than one is
            ambiguous: the first is read).
        spec: ``normalize_plan(plan)`` for a plan (None otherwise), so no face normalises twice.
    """

    plan: dict | None
    reason: str | None
    found: dict | None = None
    plan_objects: int = 0
    spec: PlanSpec | None = None

    @property
    def is_plan(self) -> bool:
        return self.reason is None


# --- the scan ----------------------------------------------------------------------------------


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


_NUMBERS = {"parse_constant": _no_value, "parse_float": _finite_float, "parse_int": _float_sized_int}
_DECODER = json.JSONDecoder(**_NUMBERS)
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


class _RepeatedKeyError(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKeyError(key)
            seen.add(key)
    return obj


_KEYED_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys, **_NUMBERS)
_PLAIN_KEYED_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)


class _RepeatedKeys(dict):
    """A decoded object that listed a key more than once (its last value kept, as JSON does):
    :func:`read_plan` refuses a plan holding one."""

    repeated: str = ""


def _mark_repeats(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    marked = _RepeatedKeys(obj)
    try:
        _unique_keys(pairs)
    except _RepeatedKeyError as exc:
        marked.repeated = exc.key
    return marked


def decode_marking_repeats(text: str | bytes) -> object:
    """``json.loads(text)`` in which every object that repeats a key is marked, so that
    :func:`read_plan` refuses a plan decoded from it (for an API that receives a plan as an object
    inside a JSON body: the body's own parser keeps the last value silently). Raises ``ValueError``
    (and ``RecursionError``) as ``json.loads`` does."""
    return json.loads(text, object_pairs_hook=_mark_repeats)


def _first_repeat(value: object, depth: int = MAX_JSON_DEPTH + 1) -> str | None:
    """The repeated key of the first marked object in a decoded value (None if none), looked for
    down to ``depth`` levels (deeper nesting is refused anyway)."""
    if depth < 1:
        return None
    if isinstance(value, _RepeatedKeys):
        return value.repeated
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for child in children:
        if isinstance(child, (dict, list)):
            key = _first_repeat(child, depth - 1)
            if key is not None:
                return key
    return None


def _nested_within(value: dict | list, depth: int) -> bool:
    """Whether the decoded JSON container ``value`` nests at most ``depth`` levels (itself is 1)."""
    if depth < 1:
        return False
    children = value.values() if type(value) is dict else value
    if _CONTAINERS.isdisjoint(map(type, children)):
        return True
    return all(_nested_within(c, depth - 1) for c in children if type(c) in _CONTAINERS)


@dataclass
class _Scan:
    """The scan's findings: the plan object and its span, the first object, the count."""

    plan: dict | None = None
    span: tuple[int, int] = (0, 0)
    first: dict | None = None
    plan_objects: int = 0
    cut: bool = False
    non_finite: bool = False
    text: str = ""


def _scan(text: str) -> _Scan:
    """The decodable top-level JSON objects of ``text`` (see the module docstring)."""
    text = text[:MAX_COMPLETION_CHARS]
    out = _Scan(text=text, non_finite=_NON_FINITE.search(text) is not None)
    decoder = _DECODER if out.non_finite else _PLAIN_DECODER
    pos = 0
    budget = MAX_DECODE_CHARS
    for _ in range(MAX_CANDIDATES):
        start = text.find("{", pos)
        if start < 0 or budget <= 0:
            break
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError as exc:
            if exc.pos >= len(text) or exc.msg.startswith(_UNTERMINATED):
                out.cut = True  # the object is cut by the end of the text: its inner objects are not plans
                break
            budget -= exc.pos - start
            pos = start + 1  # no object starts at this brace: prose, try the next one
            continue
        except (ValueError, RecursionError):  # nesting beyond Python's recursion limit
            budget -= len(text) - start  # read up to there (at most the rest of the text)
            pos = start + 1
            continue
        budget -= end - start
        pos = end
        if not _nested_within(value, MAX_JSON_DEPTH):
            continue
        if out.first is None:
            out.first = value
        if PLAN_KEY in value:
            out.plan_objects += 1
            if out.plan is None:
                out.plan, out.span = value, (start, end)
    return out


def find_plan(text: str) -> tuple[dict | None, int]:
    """``(plan, n)``: the first object holding ``tooth_groups`` (else the first object; see the
    module docstring) and the number ``n`` of objects holding it. ``(None, 0)`` when the text
    holds no JSON object. The raw scan: whether that object is a plan is :func:`read_plan_text`'s
    answer. Never raises."""
    if not isinstance(text, str) or not text:
        return None, 0
    scan = _scan(text)
    return (scan.plan if scan.plan is not None else scan.first), scan.plan_objects


def _repeated_key(scan: _Scan) -> str | None:
    """The first key repeated in one object of the plan's span, or None."""
    decoder = _KEYED_DECODER if scan.non_finite else _PLAIN_KEYED_DECODER
    try:
        decoder.raw_decode(scan.text, scan.span[0])
    except _RepeatedKeyError as exc:
        return exc.key
    return None


# --- readings ----------------------------------------------------------------------------------


def _judge(plan: dict, plan_objects: int) -> PlanReading:
    """The reading of an object holding ``tooth_groups`` with no repeated key."""
    spec = normalize_plan(plan)
    if spec.format.usable_groups == 0:
        return PlanReading(None, NO_USABLE_GROUP, plan, plan_objects)
    return PlanReading(plan, None, plan, plan_objects, spec)


def read_plan_text(text: str) -> PlanReading:
    """The reading of a text (a model's completion, a tool argument, a request body's string).
    A non-string reads as a text with no object. Never raises."""
    if not isinstance(text, str) or not text:
        return PlanReading(None, NO_OBJECT)
    scan = _scan(text)
    if scan.plan is None:
        reason = CUT_OBJECT if scan.cut else NO_PLAN_KEY if scan.first is not None else NO_OBJECT
        return PlanReading(None, reason, scan.first, 0)
    key = _repeated_key(scan)
    if key is not None:
        return PlanReading(None, repeated_key(key), scan.plan, scan.plan_objects)
    return _judge(scan.plan, scan.plan_objects)


def read_plan(value: object) -> PlanReading:
    """The reading of what an API was sent as a plan: a text (``str``, or UTF-8 ``bytes``) is read
    by :func:`read_plan_text`; a decoded JSON value must be the plan object itself (a dict holding
    ``tooth_groups``, at most :data:`MAX_JSON_DEPTH` deep and :data:`MAX_COMPLETION_CHARS` long as
    compact JSON text, the bound of a text; an object that repeated a key is seen only when decoded by
    :func:`decode_marking_repeats`). Never raises."""
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value[: 4 * MAX_COMPLETION_CHARS]).decode("utf-8", errors="replace")
    if isinstance(value, str):
        return read_plan_text(value)
    if not isinstance(value, dict):
        return PlanReading(None, not_an_object(value))
    try:  # the same bound as a text's: what a text face would not read, no face reads
        size = len(json.dumps(value, allow_nan=True, separators=(",", ":")))
    except (TypeError, ValueError, RecursionError):
        return PlanReading(None, f"the plan is not JSON-serialisable: send {PLAN_SHAPE}")
    if size > MAX_COMPLETION_CHARS:
        return PlanReading(None, too_long(size))
    key = _first_repeat(value)
    if key is not None:
        return PlanReading(None, repeated_key(key), value, int(PLAN_KEY in value))
    try:
        nested = _nested_within(value, MAX_JSON_DEPTH)
    except RecursionError:
        nested = False
    if not nested:
        return PlanReading(None, TOO_DEEP)
    if PLAN_KEY not in value:
        return PlanReading(None, NO_PLAN_KEY, value, 0)
    return _judge(value, 1)


def not_a_plan_result(reading: PlanReading) -> dict:
    """The score of a value that is not a plan, with the keys of a scored plan's result
    (:func:`server.treatment.plan_result`): scaled reward :data:`server.reward_scaler.REWARD_MIN`,
    terminal 0, no rule broken (nothing was planned), empty breakdown and diagnostics, and
    ``not_a_plan`` the reason (None in a plan's result)."""
    fmt = normalize_plan(reading.found).format
    return {
        "terminal_reward": 0.0,
        "scaled_reward": REWARD_MIN,
        "broken_rules": [],
        "reward_breakdown": {},
        "diagnostics": {},
        "strategy": None,
        "format": {**vars(fmt), "validity": 0.0},
        "start_stage": [],
        "not_a_plan": reading.reason,
    }


__all__ = [
    "MAX_CANDIDATES",
    "MAX_COMPLETION_CHARS",
    "MAX_DECODE_CHARS",
    "MAX_JSON_DEPTH",
    "PLAN_KEY",
    "PlanReading",
    "decode_marking_repeats",
    "find_plan",
    "not_a_plan_result",
    "read_plan",
    "read_plan_text",
]
