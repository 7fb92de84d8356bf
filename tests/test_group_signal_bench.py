"""experiments/learning/group_signal.py: how much learning signal GRPO's groups carry, read from completions.jsonl."""

from __future__ import annotations

import json

import pytest

from experiments.learning import group_signal as group_signal_script


def _bench():
    return group_signal_script


def _group(step, seed, task, completions, terminals, advantages):
    return [{"step": step, "seed": seed, "task_id": task, "force_decay": False, "completion": c,
             "rewards": {"reward_terminal": t}, "advantage": a}
            for c, t, a in zip(completions, terminals, advantages, strict=True)]  # fmt: skip


def test_group_signal_counts_silent_groups_broken_samples_and_distinct_plans(tmp_path):
    bench = _bench()
    rows = [
        # step 1, task_hard: four identical plans, no signal
        *_group(1, 7, "task_hard", ["a"] * 4, [6.0] * 4, [0.0] * 4),
        # step 1, task_easy: three distinct plans, one broken
        *_group(1, 8, "task_easy", ["a", "b", "b", "c"], [6.0, -1.0, -1.0, 7.0], [0.3, -0.5, -0.5, 0.7]),
        # step 4, task_hard: a spread, one not a plan
        *_group(4, 9, "task_hard", ["a", "b", "c", "d"], [6.0, 5.0, 7.0, -2.0], [0.2, 0.0, 0.5, -0.7]),
    ]
    out = bench.group_signal(rows, phases=2)
    assert [(r["phase"], r["level"]) for r in out] == [(0, "task_easy"), (0, "task_hard"), (1, "task_hard")]
    assert [r["steps"] for r in out] == [(1, 2), (1, 2), (3, 4)]
    easy, hard_early, hard_late = out
    assert (easy["no_signal"], easy["broken"], easy["distinct"]) == (0.0, 0.5, 3.0)
    assert (hard_early["no_signal"], hard_early["broken"], hard_early["distinct"]) == (1.0, 0.0, 1.0)
    assert (hard_late["no_signal"], hard_late["broken"], hard_late["distinct"]) == (0.0, 0.25, 4.0)
    assert easy["one_group"] == hard_late["one_group"] == 0.0  # "a", "b", ... are not plans

    run = tmp_path / "grpo_bc"
    run.mkdir()
    (run / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bench.group_signal(bench.read_rows(run)) == bench.group_signal(rows)
    assert bench.main([str(run)]) == 0


def test_group_signal_counts_one_group_plans():
    bench = _bench()
    one = '{"strategy": "anterior_first", "tooth_groups": [{"teeth": [11, 21], "fraction": 0.0417}]}'
    two = ('{"strategy": "anterior_first", "tooth_groups": [{"teeth": [11], "fraction": 0.05}, '
           '{"teeth": [21], "fraction": 0.05, "priority": "low"}]}')  # fmt: skip
    rows = _group(
        1, 7, "task_hard", [one, one, two, "not a plan"], [6.0, 6.0, 7.0, -2.0], [0.1, 0.1, 0.5, -0.7]
    )
    (out,) = bench.group_signal(rows)
    assert out["one_group"] == 0.5


def test_group_signal_says_what_is_missing(tmp_path):
    bench = _bench()
    with pytest.raises(ValueError, match="no completions"):
        bench.group_signal([])
    with pytest.raises(FileNotFoundError, match=r"completions\.jsonl"):
        bench.read_rows(tmp_path)


def test_overcorrection_signal_splits_each_cell_by_whether_the_plan_overcorrects(tmp_path, capsys):
    bench = _bench()
    plain = '{"strategy": "anterior_first", "tooth_groups": [{"teeth": [11, 21], "fraction": 0.05}]}'
    zero = '{"strategy": "anterior_first", "tooth_groups": [{"teeth": [11], "fraction": 0.05, "overcorrection": 0}]}'
    over = ('{"strategy": "anterior_first", "tooth_groups": [{"teeth": [11], "fraction": 0.05}, '
            '{"teeth": [21], "fraction": 0.05, "overcorrection": 0.3}]}')  # fmt: skip
    decay = _group(1, 7, "task_hard", [over, over, over, plain], [5.0, 3.0, -2.0, 2.0], [0.8, 0.2, -1.2, 0.2])
    for r in decay:
        r["force_decay"] = True
    ideal = _group(1, 8, "task_hard", [plain, zero, "not a plan"], [7.0, 6.0, -2.0], [0.0] * 3)
    easy = _group(2, 9, "task_easy", [plain, plain], [6.0, 8.0], [0.0] * 2)
    out = bench.overcorrection_signal(decay + ideal + easy)
    assert [(r["level"], r["force_decay"], r["samples"]) for r in out] == [
        ("task_easy", False, 2), ("task_hard", False, 3), ("task_hard", True, 4)
    ]  # fmt: skip
    easy_row, ideal_row, decay_row = out
    assert decay_row["overcorrected"] == 0.75 and decay_row["mixed"] == 1.0
    assert decay_row["with"] == {
        "broken": 1 / 3,
        "safe_mean": 4.0,
        "mixed_advantage": pytest.approx(-0.2 / 3),
    }
    assert decay_row["without"] == {"broken": 0.0, "safe_mean": 2.0, "mixed_advantage": 0.2}
    # an overcorrection of 0 and a completion that is not a plan count as without; no mixed group
    assert ideal_row["overcorrected"] == 0.0 and ideal_row["mixed"] == 0.0
    assert ideal_row["with"] == {"broken": None, "safe_mean": None, "mixed_advantage": None}
    assert ideal_row["without"] == {"broken": 1 / 3, "safe_mean": 6.5, "mixed_advantage": None}
    assert easy_row["without"]["safe_mean"] == 7.0

    run = tmp_path / "grpo_bc"
    run.mkdir()
    (run / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in decay + ideal))
    assert bench.main([str(run), "--overcorrection"]) == 0
    printed = capsys.readouterr().out
    assert (
        "| task_hard | force decay | 4 | 0.75 | 0.33 / 0.00 | 4.00 / 2.00 | 1.00 | -0.07 / 0.20 |" in printed
    )
    assert "| task_hard | ideal | 3 | 0.00 | - / 0.33 | - / 6.50 | 0.00 | - / - |" in printed
    with pytest.raises(ValueError, match="no completions"):
        bench.overcorrection_signal([])


def test_room_signal_splits_overcorrecting_samples_by_every_tooths_room(tmp_path, capsys):
    from server.cases import generate_case
    from server.dental_constants import TOOTH_IDS
    from server.staging import overcorrection_room

    bench = _bench()
    case = generate_case("task_hard", 7, True)
    room = overcorrection_room(
        case.initial, case.target, case.crown_width_mm, case.crown_depth_mm, case.absent
    )
    i = next(k for k in range(28) if 0.1 <= room[k] <= 0.9)  # a tooth whose room is limited

    def plan(oc: float) -> str:
        return json.dumps({"strategy": "anterior_first", "tooth_groups": [
            {"teeth": [int(TOOTH_IDS[i])], "fraction": 0.05, "overcorrection": round(oc, 2)}]})  # fmt: skip

    at, above = plan(room[i]), plan(room[i] + 0.05)
    plain = '{"strategy": "anterior_first", "tooth_groups": [{"teeth": [11], "fraction": 0.05}]}'
    decay = _group(
        1, 7, "task_hard", [at, at, above, above, above, plain], [5.0, -2.0, -2.0, -2.0, 1.0, 3.0], [0.0] * 6
    )
    for r in decay:
        r["force_decay"] = True
    ideal = _group(1, 7, "task_hard", [above], [-2.0], [0.0])  # ideal dynamics: not counted
    (out,) = bench.room_signal(decay + ideal)
    assert out["level"] == "task_hard" and out["overcorrecting"] == 5
    assert out["within"] == {"share": 0.4, "broken": 0.5}
    assert out["beyond"] == {"share": 0.6, "broken": pytest.approx(2 / 3)}
    run = tmp_path / "grpo_bc"
    run.mkdir()
    (run / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in decay))
    assert bench.main([str(run), "--room"]) == 0
    assert "| task_hard | 5 | 0.40 | 0.50 / 0.67 |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no completions"):
        bench.room_signal([])
