"""JSON on the wire, in one place: observations out (fast, and never a silent ``null``),
WebSocket messages in (every malformed frame named, never echoed), and error details.

* :func:`encode_json` -- bytes of an output (orjson, about 25 times faster than ``json.dumps``
  on a 14 kB observation). A NaN/inf anywhere raises :class:`NonFiniteOutputError` naming
  its path: orjson would write ``null``.
* :func:`observation_payload` -- OpenEnv's ``{"observation", "reward", "done"}`` from the
  environment's observation dict (``reward`` = ``step_reward`` plus, on the last stage,
  ``terminal_reward``).
* :class:`ObservationEncoder` -- :func:`encode_json` of observations (bare, or as OpenEnv's
  WebSocket frame), with a case's constant fields (``initial_config``, ``target_config``,
  ``case_summary``: two thirds of a step's bytes) encoded once per case instead of every
  step. The bytes are those :func:`encode_json` writes.
* :func:`decode_json_body` -- an HTTP request body (orjson first; the standard parser names
  the error).
* :func:`decode_message` -- a WebSocket frame to a ``{"type", "data"}`` dict, or
  :class:`MessageError` with an OpenEnv error code and a message that says what to send.
* :func:`error_frame` -- an OpenEnv error reply, its message cut to
  :data:`server.serving.settings.MAX_ERROR_CHARS`: the input is never echoed, beyond a short excerpt
  (at most 40 characters) of one offending value in a validation message.
* :func:`describe_validation_errors`, :func:`json_safe` -- readable, JSON-safe pydantic errors.

Outputs that orjson does not take directly go through the one JSON walk,
:func:`server.json_values.json_value`, strict (a NaN is refused, naming its path);
:func:`json_safe` is not a walk of outputs but a size-bounded summary of untrusted input.
"""

from __future__ import annotations

import json
import math
import re
from itertools import chain
from typing import Any

import numpy as np
import orjson

from server.dental_constants import N_TEETH, TOOTH_IDS
from server.json_values import json_value
from server.plan_text import PLAN_KEY, decode_marking_repeats
from server.pose_validation import POSE_FIELDS
from server.serving.settings import ENV_VARIABLES, MAX_ERROR_CHARS

_MAX_REPORTED_ERRORS = 10
_MAX_INPUT_REPR = 200
_MAX_EXCERPT = 40

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")

MESSAGE_TYPES = ("reset", "step", "state", "close", "tool", "mcp")
"""The WebSocket message types this server answers: OpenEnv's four, ``tool`` (the environment's
tools on the session's own episode, :meth:`server.serving.adapter.DentalOpenEnvAdapter.tool_dict`) and OpenEnv's
``mcp`` (a JSON-RPC request to the agentic MCP tools on that episode, :mod:`server.serving.mcp_tools`)."""


class MessageError(ValueError):
    """A WebSocket frame that is not a usable message; ``code`` is OpenEnv's error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


# --- Outputs ------------------------------------------------------------------------


def encode_json(obj: Any) -> bytes:
    """UTF-8 JSON of an environment output (plain types, numpy arrays and scalars).

    Raises :class:`NonFiniteOutputError` naming the path of the first NaN/inf.

    orjson writes NaN and infinities as ``null``. So when the text has no more ``null`` than
    the ``None`` values found in the object's top level and its dicts (a lower bound of all its
    ``None``), there was no NaN/inf: one scan of the bytes instead of a walk of every number.
    Otherwise (a ``None`` deeper down, ``null`` inside a string, or a NaN) every number is checked.
    """
    try:
        text = orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:  # a type orjson does not take (e.g. a non-contiguous array): the full walk
        return orjson.dumps(_to_jsonable_at(obj, ""))
    nulls = text.count(b"null")
    if nulls and nulls != _shallow_nones(obj) and not _finite(obj):
        _to_jsonable_at(obj, "")  # raises, naming the path
    return text


def _shallow_nones(obj: Any, depth: int = 0) -> int:
    """``None`` values of ``obj`` itself and of its dicts' values, three dicts deep (lists are
    not entered): at most the number of its ``None``."""
    if obj is None:
        return 1
    if type(obj) is not dict or depth > 2:
        return 0
    return sum(_shallow_nones(v, depth + 1) for v in obj.values() if v is None or type(v) is dict)


_ROW_TYPES = frozenset((list, tuple))


def _finite(obj: Any) -> bool:
    """No NaN/inf in ``obj``; one C-level ``sum`` per list of numbers instead of a call per value.
    Other types pass (orjson or the full walk decides)."""
    t = type(obj)
    if t is float:
        return obj - obj == 0.0  # false for NaN and +-inf
    if t is dict:
        return all(_finite(v) for v in obj.values())
    if t is list or t is tuple:
        try:
            total = sum(obj, 0.0)
        except TypeError:  # not a list of numbers: perhaps a list of lists of numbers (a 28 x 7 config)
            try:
                rows_only = set(map(type, obj)) <= _ROW_TYPES
                total = sum(chain.from_iterable(obj), 0.0) if rows_only else math.nan
            except TypeError:
                total = math.nan
        if total - total == 0.0:
            return True
        # a non-number, a NaN/inf, or finite numbers whose sum overflows: each element
        return all(_finite(v) for v in obj)
    if t is np.ndarray:
        return obj.dtype.kind not in "fc" or bool(np.isfinite(obj).all())
    if isinstance(obj, np.floating):
        return bool(np.isfinite(obj))
    return True


def observation_payload(obs: dict[str, Any]) -> dict[str, Any]:
    """OpenEnv's observation payload ``{"observation", "reward", "done"}`` (the form of its
    ``serialize_observation``: ``done`` moves out of the observation)."""
    observation = dict(obs)
    done = bool(observation.pop("done", False))
    reward = float(observation.get("step_reward", 0.0))
    if done and observation.get("terminal_reward") is not None:
        reward += float(observation["terminal_reward"])
    return {"observation": observation, "reward": reward, "done": done}


CONSTANT_FIELDS = ("initial_config", "target_config", "case_summary")
"""Observation fields that depend on the case only (its start, goal and summary)."""

CASE_FIELDS = ("task_id", "seed", "force_decay", "non_compliance")
"""Observation fields naming the case: :func:`server.cases.generate_case` of them (a pure function,
cached; the behaviour digest pins it) is the case the constant fields come from."""


class ObservationEncoder:
    """JSON of observations, each case's constant fields encoded once.

    Every observation repeats its case's ``initial_config``, ``target_config`` (28 x 7 each)
    and ``case_summary``: two thirds of a step's bytes, and most of the work of encoding it.
    Those fields are a function of the case, which the observation names (``task_id``,
    ``seed``, ``force_decay``, ``non_compliance``: :data:`CASE_FIELDS`). This keeps the JSON
    of the constant fields of the ``max_cases`` cases last encoded (least recently used dropped
    first; about 8 kB each) and splices it in (``orjson.Fragment``) for every observation of
    the same case: the bytes are those :func:`encode_json` writes for that observation (tested
    over whole episodes of every task), non-finite numbers refused the same way (a constant
    field that is not finite is never cached). One encoder serves all sessions and routes of
    an app (a GRPO group's generations share their case).

    It relies on what :mod:`server.cases` states: a case is a pure function of its key, and its
    cached lists are never modified (they are copied before being handed out). An observation
    without the four case fields, or with a constant field of another shape, is encoded in full.
    """

    def __init__(self, max_cases: int = 256):
        self.max_cases = max(int(max_cases), 1)
        self._cache: dict[tuple[Any, ...], dict[str, orjson.Fragment]] = {}

    def encode(self, obs: dict[str, Any]) -> bytes:
        """:func:`encode_json` of an observation dict."""
        return encode_json(self._spliced(obs))

    def frame(self, obs: dict[str, Any]) -> str:
        """OpenEnv's WebSocket reply ``{"type": "observation", "data": {"observation", "reward",
        "done"}}`` of an observation dict, as text."""
        return encode_json({"type": "observation", "data": observation_payload(self._spliced(obs))}).decode()

    def __len__(self) -> int:
        return len(self._cache)

    def _spliced(self, obs: dict[str, Any]) -> dict[str, Any]:
        try:
            key = tuple(obs[name] for name in CASE_FIELDS)
            fragments = self._cache.pop(key, None)
        except (KeyError, TypeError):  # no case named, or an unhashable value
            return obs
        if fragments is None:
            fragments = self._fragments(obs)
            while len(self._cache) >= self.max_cases:
                del self._cache[next(iter(self._cache))]
        self._cache[key] = fragments  # the most recently used last
        return {**obs, **fragments}

    @staticmethod
    def _fragments(obs: dict[str, Any]) -> dict[str, orjson.Fragment]:
        fragments = {}
        for name in CONSTANT_FIELDS:
            value = obs.get(name)
            if _plain_constant(value) and _finite(value):  # else encoded with the rest, every time
                fragments[name] = orjson.Fragment(orjson.dumps(value))
        return fragments


def _plain_constant(value: Any) -> bool:
    """A list of lists of floats, or a flat dict of strings, ints and floats (the shapes of the
    constant fields): cached. Anything else is encoded with the rest of the observation."""
    t = type(value)
    if t is list:
        return all(type(row) is list and all(type(v) is float for v in row) for row in value)
    if t is dict:
        return all(type(k) is str and type(v) in (str, int, float) for k, v in value.items())
    return False


# --- WebSocket messages in ----------------------------------------------------------


def decode_message(frame: str | bytes | None, max_bytes: int, binary: bool = False) -> dict[str, Any]:
    """The ``{"type", "data"}`` message of one WebSocket frame.

    Raises :class:`MessageError` (code and reason) for a binary frame, a frame over
    ``max_bytes``, text that is not JSON (NaN/Infinity are let through here so that the
    validation of the step names the tooth and field), JSON nested too deep, and JSON that
    is not a message object. The reason never quotes the frame.
    """
    shape = 'a JSON object {"type": "reset" | "step" | "state" | "close" | "tool" | "mcp", "data": {...}}'
    if binary or frame is None:
        raise MessageError("INVALID_JSON", f"binary frames are not accepted: send {shape} as a text frame")
    size, bound = len(frame), ""
    if isinstance(frame, str):
        if size > max_bytes:  # characters: a lower bound of the UTF-8 size (exact for ASCII)
            bound = "at least "
        elif 4 * size > max_bytes:  # near the limit: the exact size
            size = len(frame.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise MessageError(
            "MESSAGE_TOO_LARGE",
            f"message of {bound}{size} bytes exceeds the limit of {max_bytes} bytes (a step is about "
            f"5 kB; the server sets the limit with {ENV_VARIABLES['max_message_bytes']})",
        )
    try:
        message = decode_request(frame)
    except ValueError:
        try:  # for the error's place in the text
            message = json.loads(frame)
        except RecursionError:
            raise MessageError("INVALID_JSON", f"message is nested too deeply: send {shape}") from None
        except ValueError as exc:
            raise MessageError(
                "INVALID_JSON", f"message is not valid JSON ({_json_error(exc)}): send {shape}"
            ) from None
    if not isinstance(message, dict):
        raise MessageError("INVALID_JSON", f"message is {_kind(message)}: send {shape}")
    kind = message.get("type")
    if kind not in MESSAGE_TYPES:
        got = "a string" if isinstance(kind, str) else _kind(kind)
        raise MessageError(
            "UNKNOWN_TYPE", f"unknown message type ({got}): use one of {', '.join(MESSAGE_TYPES)}"
        )
    data = message.get("data", {})
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise MessageError(
            "VALIDATION_ERROR", f"message data is {_kind(data)}: send a JSON object (or omit it)"
        )
    extra = set(message) - {"type", "data"}
    if extra:
        raise MessageError(
            "VALIDATION_ERROR",
            f'{len(extra)} unknown message field(s) besides "type" and "data": send only those two',
        )
    return {"type": kind, "data": data}


_PLAN_KEY_BYTES = PLAN_KEY.encode()


def decode_request(body: bytes | str) -> Any:
    """A WebSocket message or MCP request: orjson, else the standard parser (which takes
    NaN/Infinity); a body that holds a plan (``"tooth_groups"``) is decoded by
    :func:`server.plan_text.decode_marking_repeats`, so that a plan sent as an object with a repeated
    key is refused as on every other face (orjson, like ``json.loads``, keeps the last value silently).
    Raises ``ValueError`` for a body that is not JSON (``RecursionError`` is reported as one)."""
    holds_plan = (_PLAN_KEY_BYTES if isinstance(body, (bytes, bytearray)) else PLAN_KEY) in body
    try:
        if holds_plan:
            return decode_marking_repeats(body)
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            return json.loads(body)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def decode_json_body(body: bytes) -> Any:
    """An HTTP JSON body: orjson, else the standard parser, which takes NaN/Infinity (refused,
    with their place, by the validation) and raises ``json.JSONDecodeError`` with the position
    of a syntax error (deep nesting included)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        try:
            return json.loads(body)
        except RecursionError:
            raise json.JSONDecodeError("nested too deeply", "", 0) from None


def _json_error(exc: ValueError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at line {exc.lineno} column {exc.colno}"
    return "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else type(exc).__name__


def _kind(value: Any) -> str:
    """What a JSON value is, without quoting it: ``an array``, ``null``, ``a number``..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__


def error_frame(code: str, message: str, **extra: int | str) -> str:
    """OpenEnv's error reply ``{"type": "error", "data": {"message", "code", ...}}``, bounded."""
    if len(message) > MAX_ERROR_CHARS:
        message = message[: MAX_ERROR_CHARS - 14] + "...(truncated)"
    return orjson.dumps({"type": "error", "data": {"message": message, "code": code, **extra}}).decode()


# --- Error details ------------------------------------------------------------------


def json_safe(obj: Any, depth: int = 0) -> Any:
    """A JSON-serialisable copy of an error detail: non-finite floats become the strings
    ``"NaN"``/``"Infinity"``/``"-Infinity"``, other objects their ``str``, long inputs a
    truncated repr."""
    if depth > 8:
        return short_repr(obj)
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj if not isinstance(obj, str) or len(obj) <= 4 * _MAX_INPUT_REPR else short_repr(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {str(k): json_safe(v, depth + 1) for k, v in list(obj.items())[:64]}
    if isinstance(obj, (list, tuple)):
        if len(obj) > 16:
            return short_repr(obj)
        return [json_safe(v, depth + 1) for v in obj]
    if isinstance(obj, bytes):
        return short_repr(obj.decode("utf-8", errors="replace"))
    return short_repr(obj)


def short_repr(obj: Any) -> str:
    """``repr`` (or the string itself) cut to 200 characters."""
    text = obj if isinstance(obj, str) else repr(obj)
    return text if len(text) <= _MAX_INPUT_REPR else text[:_MAX_INPUT_REPR] + "...(truncated)"


def _format_loc(loc: tuple[Any, ...] | list[Any]) -> str:
    """``('body', 'poses', 3, 4)`` -> ``poses[3][4] (tooth 14, tz)``."""
    parts: list[str] = []
    tooth_note = ""
    items = [p for p in loc if p not in ("body",)]
    for i, part in enumerate(items):
        if isinstance(part, int):
            parts.append(f"[{part}]")
        else:
            parts.append(("." if parts else "") + str(part))
        if part == "poses" and i + 1 < len(items) and isinstance(items[i + 1], int):
            k = items[i + 1]
            if 0 <= k < N_TEETH:
                tooth_note = f"tooth {TOOTH_IDS[k]}"
                if i + 2 < len(items) and isinstance(items[i + 2], int) and 0 <= items[i + 2] < 7:
                    tooth_note += f", {POSE_FIELDS[items[i + 2]]}"
    text = "".join(parts) or "body"
    return f"{text} ({tooth_note})" if tooth_note else text


def describe_validation_errors(errors: list[dict[str, Any]]) -> str:
    """One readable line per error (the first few), e.g.
    ``poses[3][4] (tooth 14, tz): Input should be a finite number (got NaN)``."""
    lines = []
    for err in errors[:_MAX_REPORTED_ERRORS]:
        where = _format_loc(_safe_loc(err))
        msg = err.get("msg", "invalid")
        kind = err.get("type")
        if kind == "json_invalid":
            loc = err.get("loc", ())
            pos = f" at position {loc[-1]}" if loc and isinstance(loc[-1], int) else ""
            reason = (err.get("ctx") or {}).get("error", "")
            lines.append(f"body is not valid JSON{pos}" + (f": {reason}" if reason else ""))
            continue
        if tuple(err.get("loc", ())) == ("body",) and kind == "missing":
            msg = "a JSON object body is required"
        got = f" (got {_shown(err['input'])})" if "input" in err and kind != "missing" else ""
        lines.append(f"{where}: {msg}{got}")
    more = len(errors) - _MAX_REPORTED_ERRORS
    if more > 0:
        lines.append(f"... and {more} more error(s)")
    return "; ".join(lines)


def safe_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first few pydantic errors as JSON (type, loc, msg, ctx), without their input."""
    return [
        {**{k: json_safe(v) for k, v in err.items() if k in ("type", "msg", "ctx")}, "loc": _safe_loc(err)}
        for err in errors[:_MAX_REPORTED_ERRORS]
    ]


def _safe_loc(err: dict[str, Any]) -> list[Any]:
    """An error's location without the client's own text: an unknown field keeps its name only
    when that is a short identifier."""
    loc = list(err.get("loc", ()))
    unknown = err.get("type") == "extra_forbidden" and loc and isinstance(loc[-1], str)
    if unknown and not _IDENTIFIER.fullmatch(loc[-1]):
        loc[-1] = "<unknown field>"
    return [p if not isinstance(p, str) else p[:_MAX_EXCERPT] for p in loc]


def _shown(raw: Any) -> str:
    """What an offending input was, without quoting its text: a number or literal as written
    (``NaN``, ``1e400``, ``true``, ``null``), anything else by kind and size."""
    if isinstance(raw, float) and not math.isfinite(raw):
        return str(json_safe(raw))  # NaN / Infinity / -Infinity, as written in the JSON text
    if raw is None or isinstance(raw, (bool, int, float)):
        return json.dumps(raw)[:24]
    if isinstance(raw, str):
        return f"a string of {len(raw)} characters"
    if isinstance(raw, (list, tuple)):
        return f"an array of {len(raw)} items"
    return "an object" if isinstance(raw, dict) else type(raw).__name__


def to_jsonable(obj: Any, path: str = "") -> Any:
    """Plain JSON types from an environment output (numpy scalars/arrays included).

    Raises :class:`NonFiniteOutputError` naming the path of the first NaN/inf.
    """
    try:
        return _plain(obj)
    except _RefusedValueError:  # another type or a non-finite value: the full walk, naming any bad path
        return _to_jsonable_at(obj, path)


class _RefusedValueError(Exception):
    """_plain met a value it does not take as it is."""


def _plain(obj: Any) -> Any:
    """to_jsonable's fast walk over the plain types observations are made of (no paths)."""
    t = type(obj)
    if t is float:
        if obj - obj == 0.0:  # false for NaN and +-inf
            return obj
        raise _RefusedValueError
    if t is str or t is int or t is bool or obj is None:
        return obj
    if t is dict:
        return {str(k): _plain(v) for k, v in obj.items()}
    if t is list or t is tuple:
        return [_plain(v) for v in obj]
    if t is np.ndarray and (obj.dtype.kind in "biu" or (obj.dtype.kind == "f" and np.isfinite(obj).all())):
        return obj.tolist()
    raise _RefusedValueError  # anything else (numpy scalars, subclasses, NaN): the path-naming walk


def _to_jsonable_at(obj: Any, path: str) -> Any:
    """to_jsonable that tracks the path of each value, for the error message: the one JSON walk
    (:func:`server.json_values.json_value`), strict, JSON already encoded kept as it is."""
    return json_value(obj, "raise", path, keep=(orjson.Fragment,))
