"""The diagnosis computed from the geometry (server/diagnosis.py, docs/cases.md): on generated cases
it agrees with the generator's labels, disagreeing only in the directions docs/cases.md explains; an
imported case without labels is planned and scored with the computed diagnosis, one with labels keeps
them bit for bit; degenerate input gives a diagnosis, not a crash.

``python -m tests.test_diagnosis`` prints the agreement per level and every disagreement."""

from __future__ import annotations

import copy
import json
from collections import Counter
from functools import cache

import numpy as np
import pytest

from server.case_records import case_of_record, record_of_case
from server.cases import TASK_IDS, TASK_SEVERITY, Case, generate_case
from server.clinical_profiles import PROFILES, SECONDARY_PROFILES, SEVERITIES, STRATEGIES
from server.dental_constants import TOOTH_IDS
from server.diagnosis import Diagnosis, diagnose, diagnose_many
from server.oracle import plan_for_case
from server.plans import UNIFORM_FRACTION
from server.treatment import score_plans

SEEDS = range(1000)
MIN_AGREEMENT = 0.95
EXPLAINED: dict[tuple[str, str], str] = {
    ("class_ii", "crowding"): (
        "the companion crowding's lower incisors blocked out lingually along the Class II's distal lower "
        "shift: a severe Little index, graded above the Class II (distal_first either way)"
    ),
}
"""(generator's profile, computed profile) pairs docs/cases.md explains, and why; no other may occur."""
UNIFORM = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": UNIFORM_FRACTION}]}


@cache
def _level(task_id: str) -> tuple[list[Case], list[Diagnosis]]:
    cases = [generate_case(task_id, seed) for seed in SEEDS]
    return cases, diagnose_many(
        np.stack([c.initial for c in cases]),
        np.stack([c.target for c in cases]),
        np.stack([c.crown_width_mm for c in cases]),
    )


def agreement(task_id: str) -> dict:
    """Shares of seeds whose computed profile, strategy, secondary profile and severity are the
    generator's, and the disagreements by direction (generator's -> computed)."""
    cases, found = _level(task_id)
    n = len(cases)
    return {
        "profile": sum(d.profile == c.profile for c, d in zip(cases, found)) / n,
        "strategy": sum(d.optimal_strategy == c.optimal_strategy for c, d in zip(cases, found)) / n,
        "secondary": sum(d.secondary_profile == c.secondary_profile for c, d in zip(cases, found)) / n,
        "severity": sum(d.severity == TASK_SEVERITY[task_id] for d in found) / n,
        "profiles_missed": Counter(
            (c.profile, d.profile) for c, d in zip(cases, found) if d.profile != c.profile
        ),
        "secondaries_missed": Counter(
            (c.profile, c.secondary_profile, d.secondary_profile)
            for c, d in zip(cases, found)
            if d.secondary_profile != c.secondary_profile
        ),
        "severities_missed": Counter(
            (c.profile, d.severity) for c, d in zip(cases, found) if d.severity != TASK_SEVERITY[task_id]
        ),
    }


def report() -> str:
    lines = [f"seeds {SEEDS.start}..{SEEDS.stop - 1} per level: share agreeing with the generator's labels"]
    for task_id in TASK_IDS:
        a = agreement(task_id)
        lines.append(
            f"{task_id}: profile {a['profile']:.1%}, strategy {a['strategy']:.1%}, "
            f"secondary {a['secondary']:.1%}, severity {a['severity']:.1%}"
        )
        for key, name in (
            ("profiles_missed", "profile"),
            ("secondaries_missed", "secondary"),
            ("severities_missed", "severity"),
        ):
            for what, count in a[key].most_common():
                why = f" ({EXPLAINED[what]})" if what in EXPLAINED else ""
                lines.append(f"  {name}: {' -> '.join(map(str, what))}: {count}{why}")
    return "\n".join(lines)


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_the_computed_diagnosis_agrees_with_the_generators_labels(task_id):
    a = agreement(task_id)
    print(f"\n{task_id}: {a}")
    assert a["profile"] >= MIN_AGREEMENT, a
    assert a["strategy"] >= MIN_AGREEMENT, a
    assert a["secondary"] >= MIN_AGREEMENT, a
    assert set(a["profiles_missed"]) <= set(EXPLAINED), a["profiles_missed"]
    for d in _level(task_id)[1]:
        assert d.profile in PROFILES and d.severity in SEVERITIES and d.optimal_strategy in STRATEGIES
        assert d.secondary_profile is None or d.secondary_profile in SECONDARY_PROFILES[d.profile]
        assert d.treatment_needed


def _record(case: Case, **changes) -> dict:
    record = json.loads(json.dumps(record_of_case(case)))
    for key, value in changes.items():
        if value is None:
            record.pop(key, None)
        else:
            record[key] = value
    return record


def _scores(plans: list[dict], case: Case) -> list[dict]:
    return score_plans(plans, [case] * len(plans))


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_a_record_without_labels_is_diagnosed_from_its_poses(task_id):
    """No labels, empty labels, labels with notes only: the case gets the computed profile and
    strategy, the validator says so, and the oracle's plan and the rewards (the strategy multiplier
    reads the case's profile) are the labelled case's where the diagnoses agree."""
    generated = generate_case(task_id, 0)
    computed = diagnose(generated.initial, generated.target, generated.crown_width_mm)
    assert (computed.profile, computed.secondary_profile) == (generated.profile, generated.secondary_profile)
    for labels in (None, {}, {"notes": "from the clinic's export"}):
        checked = case_of_record(_record(generated, labels=labels))
        assert checked.case is not None and not checked.problems, checked.problems
        assert checked.notes == {"diagnosis_computed": 1}
        assert checked.diagnosis == computed
        case = checked.case
        assert (case.profile, case.secondary_profile, case.optimal_strategy) == (
            computed.profile,
            computed.secondary_profile,
            computed.optimal_strategy,
        )
    plans = [plan_for_case(case), UNIFORM]
    assert plans[0] == plan_for_case(generated) and plans[0]["strategy"] == computed.optimal_strategy
    scores = _scores(plans, case)
    assert scores == _scores(plans, generated)
    assert scores[0]["reward_breakdown"]["strategy_multiplier"] == 1.2


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_given_labels_are_used_as_given_and_round_trip_bit_for_bit(task_id):
    for seed in range(3):
        generated = generate_case(task_id, seed)
        checked = case_of_record(_record(generated))
        case = checked.case
        assert case is not None and checked.diagnosis is None and "diagnosis_computed" not in checked.notes
        for name in ("initial", "target", "crown_width_mm", "crown_depth_mm"):
            assert np.array_equal(getattr(case, name), getattr(generated, name)), name
        assert (case.profile, case.secondary_profile, case.optimal_strategy, case.summary) == (
            generated.profile,
            generated.secondary_profile,
            generated.optimal_strategy,
            generated.summary,
        )
        plans = [UNIFORM, *({**UNIFORM, "strategy": s} for s in STRATEGIES)]
        assert _scores(plans, case) == _scores(plans, generated)


def test_labels_that_disagree_with_the_geometry_are_still_the_labels():
    """A crowding case labelled deep bite is scored as a deep bite; without labels, as crowding."""
    generated = next(c for c in (generate_case("task_medium", s) for s in SEEDS) if c.profile == "crowding")
    labelled = case_of_record(_record(generated, labels={"profile": "deep_bite"})).case
    unlabelled = case_of_record(_record(generated, labels=None)).case
    assert (labelled.profile, unlabelled.profile) == ("deep_bite", "crowding")
    plan = [plan_for_case(generated)]
    assert plan[0]["strategy"] == "expansion_first"
    assert _scores(plan, labelled)[0]["reward_breakdown"]["strategy_multiplier"] == 0.6
    assert _scores(plan, unlabelled)[0]["reward_breakdown"]["strategy_multiplier"] == 1.2


def test_a_secondary_profile_without_a_profile_is_refused():
    record = _record(generate_case("task_hard", 0), labels={"secondary_profile": "deep_bite"})
    checked = case_of_record(record)
    assert checked.case is None and checked.diagnosis is None
    assert [p.message for p in checked.problems] == [
        "labels.secondary_profile without labels.profile: give both, or neither and the diagnosis is "
        "computed from the poses"
    ]


def test_no_correction_needs_no_treatment():
    """initial == target (an arch imported as its own setup): nothing to treat, a mild irregularity
    staged anterior-first, every measure and grade 0; imported, it validates and is diagnosed so."""
    for task_id in TASK_IDS:
        case = generate_case(task_id, 1)
        d = diagnose(case.target, case.target, case.crown_width_mm)
        assert (d.profile, d.secondary_profile, d.severity, d.optimal_strategy, d.treatment_needed) == (
            "mild_irregularity",
            None,
            "mild",
            "anterior_first",
            False,
        )
        assert (
            set(d.grades) == {0.0} and d.molar_relation_mm == d.lower_irregularity_mm == d.rotation_deg == 0.0
        )
        checked = case_of_record(_record(case, initial=case.target.tolist(), labels=None))
        assert checked.case is not None and checked.diagnosis == d, checked.problems
        assert checked.case.profile == "mild_irregularity"


def test_degenerate_and_hostile_input():
    case = generate_case("task_hard", 2)
    # the setup undone (target -> initial): a Class II "caused", a Class III corrected: no crash, no Class II
    class_ii = next(c for c in (generate_case("task_medium", s) for s in SEEDS) if c.profile == "class_ii")
    backwards = diagnose(class_ii.target, class_ii.initial, class_ii.crown_width_mm)
    assert backwards.profile != "class_ii" and backwards.molar_relation_mm < 0
    # the patient frame moved: the same diagnosis (every measure is relative)
    shift = np.zeros(7)
    shift[4:] = (3.0, -5.0, 2.0)
    moved = diagnose(case.initial + shift, case.target + shift, case.crown_width_mm)
    d = diagnose(case.initial, case.target, case.crown_width_mm)
    assert (moved.profile, moved.secondary_profile, moved.severity) == (
        d.profile,
        d.secondary_profile,
        d.severity,
    )
    assert np.allclose(moved.grades, d.grades, atol=2e-3)
    # one at a time and in a batch: the same
    cases = [generate_case(t, s) for t in TASK_IDS for s in range(3)]
    stacked = (np.stack([getattr(c, k) for c in cases]) for k in ("initial", "target", "crown_width_mm"))
    assert diagnose_many(*stacked) == [diagnose(c.initial, c.target, c.crown_width_mm) for c in cases]
    # non-finite values and wrong shapes are refused (the validator refuses them before)
    bad = case.initial.copy()
    bad[3, 5] = np.nan
    for args in (
        (bad, case.target, case.crown_width_mm),
        (case.initial, case.target, np.full(28, np.inf)),
        (case.initial[:27], case.target[:27], case.crown_width_mm),
        (case.initial, case.target[:, :4], case.crown_width_mm),
        (case.initial, case.target, case.crown_width_mm[:5]),
    ):
        with pytest.raises(ValueError):
            diagnose(*args)
    record = _record(case, labels=None)
    record["initial"][3][5] = float("nan")
    checked = case_of_record(record)
    assert checked.case is None and checked.diagnosis is None and "non-finite" in checked.problems[0].message
    # labels of the wrong type stay a problem, not a reason to diagnose
    assert case_of_record(_record(case, labels=[])).case is None
    with pytest.raises(AttributeError):
        d.profile = "crowding"  # type: ignore[misc]
    assert copy.deepcopy(d) == d


if __name__ == "__main__":
    print(report())
