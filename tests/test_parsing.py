"""Tests of orthojob.core.parsing: the first balanced JSON object, caps, hostile input, format checks."""

from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orthojob.core.parsing import (
    FORMAT_CHECKS,
    MAX_CANDIDATES,
    MAX_COMPLETION_CHARS,
    MAX_DECODE_CHARS,
    MAX_JSON_DEPTH,
    PLAN_KEY,
    completion_text,
    extract_plan,
    find_plan,
    format_checks,
)
from server import plan_text
from server.clinical_profiles import STRATEGIES
from server.dental_constants import TOOTH_IDS
from server.plans import MAX_GROUPS, normalize_plan

PLAN = {
    "strategy": "expansion_first",
    "tooth_groups": [
        {"teeth": [14, 15, 24, 25], "fraction": 0.08, "priority": "high"},
        {"teeth": [11, 12, 21, 22], "fraction": 0.06, "priority": "medium"},
    ],
}
PARSE_BOUND_S = 0.5
"""Time bound for parsing one completion, however hostile (the scan is capped)."""


def _all_finite(value: object) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_all_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_all_finite(v) for v in value)
    return True


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def _timed_extract(text: object) -> dict | None:
    """``extract_plan(text)``, its fastest of three runs within :data:`PARSE_BOUND_S` (a parse is about
    2 ms alone; the fastest run keeps a busy machine's scheduling out of the bound, an uncapped scan
    is slow every time)."""
    seconds = []
    for _ in range(3):
        t = time.perf_counter()
        out = extract_plan(text)
        seconds.append(time.perf_counter() - t)
        if seconds[-1] < PARSE_BOUND_S:
            break
    assert min(seconds) < PARSE_BOUND_S, seconds
    return out


# --- examples -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (json.dumps(PLAN), PLAN),
        ("Here is the plan:\n```json\n" + json.dumps(PLAN, indent=2) + "\n```\nDone.", PLAN),
        (
            '{"a": 1} and then {"b": 2}',
            {"a": 1},
        ),  # no plan: the first object (not the span from the first { to the last })
        ('{"note": "draft"} ' + json.dumps(PLAN), PLAN),  # the plan is the object holding tooth_groups
        ('{"tooth_groups": [1]} {"tooth_groups": [2]}', {"tooth_groups": [1]}),  # several: the first
        ('{"s": "}{"} {"b": 2}', {"s": "}{"}),  # braces inside strings do not count
        ('{"s": "a\\"}b", "t": 1}', {"s": 'a"}b', "t": 1}),  # escaped quotes inside strings
        ('{"s": "\\\\"} tail}', {"s": "\\"}),  # an escaped backslash ends the string
        ('{not json} {"ok": true}', {"ok": True}),  # a brace from which nothing decodes is prose
        ('{"a": {"b": [1, {"c": 2}]}}', {"a": {"b": [1, {"c": 2}]}}),
        ('[1, 2] {"a": 1}', {"a": 1}),  # a top-level array is not an object
        ("{}", {}),
        ('{"a": 1', None),  # never closes
        ('{"a": "unterminated}', None),
        ("no braces at all", None),
        ("", None),
        ("}{", None),
        ('{"strategy": "x",}', None),  # trailing comma: invalid JSON
    ],
)
def test_extract_plan_examples(text: str, expected: dict | None) -> None:
    assert extract_plan(text) == expected


def test_braces_inside_strings_do_not_end_the_object() -> None:
    plan = {"strategy": "anterior_first", "note": 'use { and } and \\" freely', "tooth_groups": []}
    assert extract_plan("x " + json.dumps(plan) + " }}}") == plan


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999", "-1e400", "1" * 400])
def test_non_finite_numbers_read_as_null(literal: str) -> None:
    """A non-finite number is no value: its group is invalid alone, the rest of the plan stands."""
    text = (
        '{"tooth_groups": [{"teeth": [11], "fraction": ' + literal + '}, {"teeth": [12], "fraction": 0.1}]}'
    )
    assert json.loads(text) is not None  # Python's json accepts all of these
    plan = extract_plan(text)
    assert plan == {"tooth_groups": [{"teeth": [11], "fraction": None}, {"teeth": [12], "fraction": 0.1}]}
    assert _all_finite(plan)
    spec = normalize_plan(plan)
    assert spec.format.invalid_fractions == 1 and spec.format.usable_groups == 1


def test_find_plan_counts_plan_objects() -> None:
    one = json.dumps(PLAN)
    assert find_plan(one) == (PLAN, 1)
    assert find_plan('{"strategy": "distal_first"} ' + one + " " + one) == (PLAN, 2)
    assert find_plan('{"strategy": "distal_first"}') == ({"strategy": "distal_first"}, 0)
    assert find_plan("no json") == (None, 0)
    assert format_checks(*find_plan(one + one))["single_plan"] == 0.0
    assert format_checks(*find_plan(one))["single_plan"] == 1.0


def test_depth_cap() -> None:
    def nested(depth: int) -> str:  # an object `depth` levels deep
        return '{"a": ' * depth + "1" + "}" * depth

    assert _depth(extract_plan(nested(MAX_JSON_DEPTH))) == MAX_JSON_DEPTH
    assert extract_plan(nested(MAX_JSON_DEPTH + 1)) is None
    assert extract_plan(nested(MAX_JSON_DEPTH + 1) + ' {"b": 2}') == {"b": 2}
    mixed = '{"a": ' + "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH + "}"
    assert extract_plan(mixed) is None


@pytest.mark.parametrize("depth", [10_000, 100_000])
def test_ten_thousand_deep_nesting(depth: int) -> None:
    assert _timed_extract("{" * depth) is None
    assert _timed_extract("[" * depth + "]" * depth) is None
    assert _timed_extract('{"a":' * depth + "1" + "}" * depth) is None
    assert _timed_extract("{" * depth + "}" * depth) is None


def test_size_cap() -> None:
    plan_text = json.dumps(PLAN)
    # found when it lies within the cap, even after a long preamble
    pre = "x" * (MAX_COMPLETION_CHARS - len(plan_text))
    assert extract_plan(pre + plan_text) == PLAN
    # not found when it crosses the cap
    assert extract_plan(pre + "xx" + plan_text) is None
    # a 1 MB completion is cut, not scanned whole
    assert _timed_extract(plan_text + "y" * 1_000_000) == PLAN
    assert _timed_extract("y" * 1_000_000 + plan_text) is None
    assert _timed_extract("{" + " " * 1_000_000 + "}") is None
    assert _timed_extract('{"a": "' + "z" * 1_000_000 + '"}') is None


def test_many_candidates_are_bounded() -> None:
    assert _timed_extract("{x}" * 300_000) is None
    assert _timed_extract('{"a": 1e999}' * 100_000) == {"a": None}
    assert _timed_extract('"' * 1_000_000) is None
    assert _timed_extract("{" + '\\"' * 500_000) is None


@pytest.mark.parametrize("value", [None, 12, 1.5, b'{"a": 1}', ["{}"], {"a": 1}, object()])
def test_non_string_input_gives_none(value: object) -> None:
    assert extract_plan(value) is None


def test_unicode_and_surrogates() -> None:
    assert extract_plan('Plan ✓ → {"strategy": "ñ😀", "x": "\\ud800"}') == {"strategy": "ñ😀", "x": "\ud800"}
    assert extract_plan("\ud800{\udfff}") is None
    assert extract_plan('\x00{"a": 1}\x00') == {"a": 1}


# --- prose with stray braces and quotes before the plan -------------------------------------

PLAN_TEXT = json.dumps(PLAN)


@pytest.mark.parametrize(
    "prose",
    [
        "Use { carefully. Plan: ",
        "Use {curly} braces. Plan: ",
        'Use { "carefully. Plan: ',  # a brace, then an unterminated quote
        'He said "hi. Use { and then "quote it. Plan: ',
        'Note {a "b" and "c. Plan: ',
        "{{ ",
        "{ {{ }}} { Plan:\n",
        '{"a": 1, oops ',  # an object broken before the plan
        '{"note": "draft", ',  # ... and one the plan would have continued: ", {" is no key
        'Use {"quote\n and a newline. ',  # a JSON string cannot hold a raw newline
        'Use {\\ or {" or {: before ',
    ],
)
def test_plan_found_after_prose_with_stray_braces(prose: str) -> None:
    assert find_plan(prose + PLAN_TEXT + " Done.") == (PLAN, 1)
    assert find_plan(prose + "```json\n" + json.dumps(PLAN, indent=2) + "\n```") == (PLAN, 1)


def test_objects_inside_a_decoded_object_are_not_candidates() -> None:
    assert find_plan('{"wrapper": ' + PLAN_TEXT + "}") == ({"wrapper": PLAN}, 0)


def test_a_truncated_plan_hides_nothing_and_yields_no_fragment() -> None:
    """A plan cut by the end of the text (a completion at its token limit) is no object, and its
    complete inner groups are not objects of their own."""
    for cut in (len(PLAN_TEXT) - 1, PLAN_TEXT.index('"priority": "medium"') + 5, 60):
        assert find_plan("Use { carefully. " + PLAN_TEXT[:cut]) == (None, 0)


def test_stray_braces_count_against_the_candidate_cap() -> None:
    assert find_plan("{ " * (MAX_CANDIDATES - 1) + PLAN_TEXT) == (PLAN, 1)
    assert find_plan("{ " * MAX_CANDIDATES + PLAN_TEXT) == (None, 0)


def _hostile_16k(unit: str) -> str:
    """``unit`` repeated to the scan's cap, the last characters ``x `` (a failure mid-text)."""
    return (unit * (MAX_COMPLETION_CHARS // len(unit) + 1))[: MAX_COMPLETION_CHARS - 2] + "x "


HOSTILE_16K = {
    "braces": _hostile_16k("{ "),
    "nested arrays failing late": _hostile_16k('{"a": [' + "0, " * 60),
    "nested, non-finite numbers": _hostile_16k('{"a": [' + "1e1, " * 45),
    "flat objects failing late": _hostile_16k('{"a": [' + "1e1, " * 60 + '0], "b": x} '),
    "deep objects": _hostile_16k('{"a":'),
    "deep objects failing": _hostile_16k('{"a":' * 40 + " x "),
    "strings": _hostile_16k('{"' + "a" * 240 + '" x '),
    "quotes and braces": _hostile_16k('{"{"'),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_16K))
def test_hostile_16k_text_is_read_in_linear_time(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder reads at most MAX_DECODE_CHARS characters, however the braces fail, and a
    hostile completion at the cap parses well within the time bound."""
    text = HOSTILE_16K[name]
    assert len(text) == MAX_COMPLETION_CHARS
    read = []

    class Counting:
        def __init__(self, decoder: json.JSONDecoder) -> None:
            self.decoder = decoder

        def raw_decode(self, s: str, idx: int = 0):
            try:
                value, end = self.decoder.raw_decode(s, idx)
            except json.JSONDecodeError as exc:
                read.append(exc.pos - idx)
                raise
            except RecursionError:
                read.append(len(s) - idx)
                raise
            read.append(end - idx)
            return value, end

    monkeypatch.setattr(plan_text, "_DECODER", Counting(plan_text._DECODER))
    monkeypatch.setattr(plan_text, "_PLAIN_DECODER", Counting(plan_text._PLAIN_DECODER))
    assert _timed_extract(text) is None
    assert len(read) <= MAX_CANDIDATES
    assert sum(read) <= MAX_DECODE_CHARS + MAX_COMPLETION_CHARS  # the last decode may overrun the budget
    monkeypatch.undo()
    t = time.perf_counter()
    for _ in range(10):
        extract_plan(text)
    assert (time.perf_counter() - t) / 10 < 0.05  # ~1-9 ms here


# --- properties -----------------------------------------------------------------------

_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**20), 10**20),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
_json_values = st.recursive(
    _json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
_prose = st.text(alphabet=st.characters(blacklist_characters="{"), max_size=60)


@settings(max_examples=300, deadline=None)
@given(
    obj=st.dictionaries(st.text(max_size=8), _json_values, max_size=5),
    before=_prose,
    after=st.text(max_size=60),
    indent=st.sampled_from([None, 2]),
)
def test_finds_any_embedded_object(obj: dict, before: str, after: str, indent: int | None) -> None:
    """Any finite JSON object, with prose around it, is found exactly (when within the depth cap)."""
    text = before + json.dumps(obj, indent=indent) + after
    found = extract_plan(text)
    if _depth(obj) <= MAX_JSON_DEPTH:
        assert found == obj
    else:
        assert found is None or found != obj


@settings(max_examples=300, deadline=None)
@given(prose=st.text(alphabet='{}[]":, ab1\n', max_size=60))
def test_plan_found_after_any_short_prose(prose: str) -> None:
    """Prose of braces, brackets, quotes and punctuation before the plan (fewer braces than the
    candidate cap) never hides it, unless the prose itself opens an object that decodes around it."""
    plan, n = find_plan(prose + PLAN_TEXT + " Done.")
    assert plan == PLAN or (plan is not None and PLAN_KEY not in plan and n == 0)


_hostile_fragments = st.sampled_from(
    [
        "{",
        "}",
        "[",
        "]",
        '"',
        "\\",
        ":",
        ",",
        "NaN",
        "Infinity",
        "-Infinity",
        "1e999",
        "true",
        "null",
        '"teeth"',
        '"fraction"',
        '"tooth_groups"',
        "0.5",
        '"0.5"',
        "11",
        "😀",
        "\ud800",
        "\x00",
        "\n",
    ]
)
_hostile_text = st.one_of(
    st.text(max_size=200),
    st.lists(_hostile_fragments, max_size=200).map("".join),
    st.tuples(_hostile_fragments, st.integers(1, 200_000)).map(lambda t: t[0] * t[1]),
    st.builds(
        lambda d, s: "{" * d + s + "}" * d, st.integers(0, 20_000), st.sampled_from(["", "1", '"a"', "NaN"])
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_hostile_text)
def test_extract_plan_never_raises(text: str) -> None:
    plan = _timed_extract(text)
    assert plan is None or isinstance(plan, dict)
    if plan is not None:
        assert _all_finite(plan)
        assert _depth(plan) <= MAX_JSON_DEPTH


# --- completion_text ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("plain", "plain"),
        ([{"role": "assistant", "content": "conv"}], "conv"),
        ({"role": "assistant", "content": "one"}, "one"),
        ([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], "a"),
        (
            [
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "p1"}, {"type": "text", "text": "p2"}],
                }
            ],
            "p1p2",
        ),
        (b"bytes \xff", "bytes \ufffd"),
        (None, ""),
        (42, ""),
        ([], ""),
        ([{"role": "assistant"}], ""),
        ([[[[[["deep"]]]]]], ""),
        ({"content": None}, ""),
    ],
)
def test_completion_text(completion: object, expected: str) -> None:
    assert completion_text(completion) == expected


def test_completion_text_survives_hostile_objects() -> None:
    class Evil(dict):
        def get(self, *a):
            raise RuntimeError("boom")

    assert completion_text([Evil(role="assistant", content="x")]) == ""


# --- format checks ------------------------------------------------------------------------


def _variant(**group_changes: object) -> dict:
    g = dict(PLAN["tooth_groups"][0], **group_changes)
    return {"strategy": PLAN["strategy"], "tooth_groups": [g, PLAN["tooth_groups"][1]]}


def test_format_checks_of_a_valid_plan() -> None:
    assert format_checks(PLAN) == dict.fromkeys((*FORMAT_CHECKS, "total"), 1.0)


def test_format_checks_of_nothing() -> None:
    assert format_checks(None) == dict.fromkeys((*FORMAT_CHECKS, "total"), 0.0)
    assert format_checks({}) == {
        **dict.fromkeys(FORMAT_CHECKS, 0.0),
        "parse": 1.0,
        "total": 1 / len(FORMAT_CHECKS),
    }


@pytest.mark.parametrize(
    ("plan", "failed"),
    [
        ({"strategy": "nonsense", "tooth_groups": PLAN["tooth_groups"]}, "strategy_ok"),
        ({"strategy": ["anterior_first"], "tooth_groups": PLAN["tooth_groups"]}, "strategy_ok"),
        (_variant(teeth=[True, 15]), "teeth_ints"),  # booleans are not teeth
        (_variant(teeth=[14, 14]), "teeth_ints"),  # duplicate
        (_variant(teeth=[11, 15]), "teeth_ints"),  # 11 is also in the second group
        (_variant(teeth=[18, 15]), "teeth_ints"),  # third molars are not in the 28
        (_variant(teeth=[14.0, 15]), "teeth_ints"),
        (_variant(teeth=["14", 15]), "teeth_ints"),
        (_variant(fraction="0.08"), "fraction_ok"),  # strings are not fractions
        (_variant(fraction=1.5), "fraction_ok"),
        (_variant(fraction=-0.1), "fraction_ok"),
        (_variant(fraction=True), "fraction_ok"),
        (_variant(fraction=None), "fraction_ok"),
        (_variant(fraction=float("nan")), "fraction_ok"),
        (_variant(fraction=10**400), "fraction_ok"),
        (_variant(priority="urgent"), "shape"),
        (_variant(start_stage=0), "shape"),
        (_variant(start_stage=3.5), "shape"),
        ({"strategy": PLAN["strategy"], "tooth_groups": []}, "shape"),
    ],
)
def test_each_format_check_fails_alone(plan: dict, failed: str) -> None:
    checks = format_checks(plan)
    assert checks[failed] == 0.0
    assert checks["total"] < 1.0
    if failed in ("strategy_ok", "teeth_ints", "fraction_ok"):
        assert all(checks[k] == 1.0 for k in FORMAT_CHECKS if k != failed)


def test_format_shape_bounds_the_group_count() -> None:
    groups = [{"teeth": [], "fraction": 0.1}] * (MAX_GROUPS + 1)
    assert format_checks({"strategy": STRATEGIES[0], "tooth_groups": groups})["shape"] == 0.0


_plans = st.fixed_dictionaries(
    {},
    optional={
        "strategy": st.one_of(st.sampled_from(STRATEGIES), _json_scalars),
        "tooth_groups": st.one_of(
            _json_values,
            st.lists(
                st.one_of(
                    _json_values,
                    st.fixed_dictionaries(
                        {},
                        optional={
                            "teeth": st.one_of(
                                st.lists(st.one_of(st.sampled_from(TOOTH_IDS), _json_scalars), max_size=30),
                                _json_scalars,
                            ),
                            "fraction": st.one_of(
                                st.floats(), st.integers(), st.text(max_size=5), st.booleans(), st.none()
                            ),
                            "priority": st.one_of(st.sampled_from(["high", "medium", "low"]), _json_scalars),
                        },
                    ),
                ),
                max_size=8,
            ),
        ),
    },
)


@settings(max_examples=300, deadline=None)
@given(plan=st.one_of(_plans, _json_values))
def test_format_checks_never_raise(plan: object) -> None:
    checks = format_checks(plan)
    assert set(checks) == {*FORMAT_CHECKS, "total"}
    assert all(v in (0.0, 1.0) for k, v in checks.items() if k != "total")
    assert checks["total"] == pytest.approx(sum(checks[k] for k in FORMAT_CHECKS) / len(FORMAT_CHECKS))
    assert 0.0 <= checks["total"] <= 1.0


def test_the_scan_is_the_servers_reader() -> None:
    """One reader: the job's parsing re-exports :mod:`server.plan_text`'s scan, and what it finds
    is a plan exactly when the reader says so."""
    assert find_plan is plan_text.find_plan and MAX_COMPLETION_CHARS == plan_text.MAX_COMPLETION_CHARS
    repeated = '{"tooth_groups": [{"teeth": [11], "fraction": 0.04}], "tooth_groups": []}'
    assert find_plan(repeated) == ({"tooth_groups": []}, 1)  # the scan keeps JSON's last value
    reading = plan_text.read_plan_text(repeated)
    assert not reading.is_plan and '"tooth_groups"' in reading.reason
    assert plan_text.read_plan_text(PLAN_TEXT).plan == PLAN
