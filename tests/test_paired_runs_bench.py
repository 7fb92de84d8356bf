"""experiments/learning/paired_runs.py: two learning runs' planners compared on the same held-out cases."""

from __future__ import annotations

import json

import pytest

from experiments.learning import paired_runs as paired_runs_script


def _bench():
    return paired_runs_script


def _report(bc: dict, grpo_bc: dict) -> dict:
    """A learning.json with GRPO from BC's start (BC) and last step, per-case scores per cell."""
    return {
        "runs": {"grpo_bc": {"evaluations": [{"step": 0, "per_case": bc}, {"step": 9, "per_case": grpo_bc}]}}
    }


def test_paired_runs_subtracts_case_by_case_per_level_and_pooled(tmp_path, capsys) -> None:
    bench = _bench()
    a = _report({"task_easy/ideal": [5.0, 6.0], "task_hard/ideal": [1.0, 3.0]},
                {"task_easy/ideal": [7.0, 7.0], "task_hard/ideal": [2.0, 2.0]})  # fmt: skip
    b = _report({"task_easy/ideal": [4.0, 5.0], "task_hard/ideal": [1.0, 3.0]},
                {"task_easy/ideal": [7.0, 8.0], "task_hard/ideal": [2.0, 4.0]})  # fmt: skip
    rows = {r["planner"]: r for r in bench.paired_runs(a, b)}
    assert set(rows) == {"bc", "grpo_bc"}  # no GRPO from stage 0 in either run
    assert rows["bc"]["levels"]["task_easy"]["mean"] == pytest.approx(1.0)
    assert rows["bc"]["levels"]["task_hard"]["mean"] == pytest.approx(0.0)
    assert rows["bc"]["pooled"]["mean"] == pytest.approx(0.5)
    assert rows["grpo_bc"]["levels"]["task_easy"]["mean"] == pytest.approx(-0.5)
    assert rows["grpo_bc"]["levels"]["task_hard"]["mean"] == pytest.approx(-1.0)
    assert rows["grpo_bc"]["pooled"]["n"] == 4
    for name, report in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "learning.json").write_text(json.dumps(report))
    assert bench.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "| BC (stage 2) | +1.00" in out and "| GRPO from BC (final) | -0.50" in out


def test_paired_runs_refuses_runs_on_different_cases() -> None:
    bench = _bench()
    a = _report({"task_easy/ideal": [5.0, 6.0]}, {"task_easy/ideal": [5.0, 6.0]})
    b = _report({"task_easy/ideal": [5.0, 6.0, 7.0]}, {"task_easy/ideal": [5.0, 6.0, 7.0]})
    with pytest.raises(ValueError, match="different cases in task_easy/ideal"):
        bench.paired_runs(a, b)
