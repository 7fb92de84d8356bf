"""Stage-0 format demonstrations and the learning experiment's metrics (no model is trained here)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from orthojob.format_demos import format_demonstrations, random_format_plan
from orthojob.learning import METRICS, _ci, episode_values, heldout_cases, reference_rows
from orthojob.parsing import find_plan
from orthojob.rewards import reward_format, reward_terminal
from server.cases import HELDOUT_SEED_START, TRAIN_SEED_START, generate_case
from server.clinical_profiles import STRATEGIES


@pytest.fixture(scope="module")
def demos() -> list[dict]:
    return format_demonstrations(60, ["task_easy", "task_medium"], seed=3)


def test_demos_parse_and_are_executable(demos):
    texts = [d["completion"][0]["content"] for d in demos]
    cols = {
        "seed": [d["seed"] for d in demos],
        "task_id": [d["task_id"] for d in demos],
        "force_decay": [d["force_decay"] for d in demos],
    }
    for text, demo in zip(texts, demos):
        plan, n = find_plan(text)
        assert n == 1 and plan == json.loads(text)
        assert plan["strategy"] in STRATEGIES
        assert demo["seed"] >= TRAIN_SEED_START and demo["seed"] < HELDOUT_SEED_START
    # every format check passes and every treated tooth stays within the limits and reaches its target
    assert reward_format(texts, **cols) == pytest.approx([1.0] * len(texts))
    assert all(r > -2.0 for r in reward_terminal(texts, **cols))


def test_demo_strategy_is_uniform_and_ignores_the_case():
    import random

    rng = random.Random(0)
    case = generate_case("task_easy", 0, False)
    counts = Counter(random_format_plan(case, rng)["strategy"] for _ in range(2500))
    assert set(counts) == set(STRATEGIES)
    expected = 2500 / len(STRATEGIES)
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < 18.5  # chi-square, 4 degrees of freedom, p = 0.001


def test_demos_are_deterministic(demos):
    again = format_demonstrations(60, ["task_easy", "task_medium"], seed=3)
    assert [d["completion"] for d in again] == [d["completion"] for d in demos]


def test_ci_and_episode_metrics():
    ci = _ci([1.0, 2.0, 3.0, float("nan")])
    assert ci["n"] == 3 and ci["mean"] == pytest.approx(2.0) and ci["lo"] < 2.0 < ci["hi"]
    case = generate_case("task_easy", HELDOUT_SEED_START, False)
    failed = episode_values(None, case, case.optimal_strategy)
    assert failed["terminal"] == -2.0 and failed["parse"] == 0.0
    assert set(failed) == set(METRICS)


def test_reference_rows_oracle_beats_slerp():
    refs = reference_rows(heldout_cases("task_easy", 6))
    assert refs["oracle"]["terminal"]["mean"] > refs["uniform_slerp"]["terminal"]["mean"]
    assert refs["oracle"]["strategy_accuracy"]["mean"] == 1.0
    assert refs["uniform_slerp"]["strategy_accuracy"]["mean"] == 0.0
