"""experiments/learning/rsft_samples.py: what a planner's own samples reach per cell, read from the RSFT samples file."""

from __future__ import annotations

import json

import pytest

from experiments.learning import rsft_samples as rsft_samples_script


def _bench():
    return rsft_samples_script


def _row(prompt, sample, scaled, dropped, rules=(), task="task_hard", force_decay=False, slerp=6.0):
    return {"prompt_index": prompt, "sample": sample, "seed": 60000 + prompt, "task_id": task, "force_decay": force_decay,
            "scaled_reward": scaled, "slerp_scaled_reward": slerp, "dropped": dropped, "broken_rules": list(rules)}  # fmt: skip


ROWS = [
    # prompt 0: one safe sample below SLERP, one broken
    _row(0, 0, 5.0, "below_slerp"),
    _row(0, 1, -0.8, "hard_rule", ["collision"]),
    # prompt 1: nothing safe (best falls back to SLERP's 6.0)
    _row(1, 0, -2.0, "not_a_plan"),
    _row(1, 1, -1.0, "hard_rule", ["collision", "limits"]),
    # prompt 2: a kept sample above SLERP and a duplicate of it (both safe)
    _row(2, 0, 7.0, None),
    _row(2, 1, 7.0, "duplicate"),
    # another cell, listed first (levels in order, ideal before force decay)
    _row(3, 0, 4.0, None, task="task_easy", force_decay=True, slerp=3.0),
]


def test_per_cell_figures_by_hand():
    cells = _bench().per_cell(ROWS)
    assert list(cells) == ["task_easy/force_decay", "task_hard/ideal"]
    hard = cells["task_hard/ideal"]
    assert hard["prompts"] == 3
    assert hard["any_safe"] == pytest.approx(2 / 3) and hard["safe_at_slerp"] == pytest.approx(1 / 3)
    assert hard["slerp"] == pytest.approx(6.0)
    assert hard["safe_mean"] == pytest.approx((5.0 + 7.0 + 7.0) / 3)
    assert hard["best_safe"] == pytest.approx((5.0 + 6.0 + 7.0) / 3)
    assert hard["rules"] == {"collision": 2, "limits": 1}
    assert cells["task_easy/force_decay"]["best_safe"] == pytest.approx(4.0)


def test_main_prints_the_table_and_names_a_missing_file(tmp_path, capsys):
    bench = _bench()
    path = tmp_path / "rsft_samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert bench.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "7 samples" in out and "| task_hard/ideal | 3 | 0.67 | 0.33 | 6.00 | 6.33 | 6.00 |" in out
    with pytest.raises(SystemExit) as exc:
        bench.main([str(tmp_path / "missing.jsonl")])
    assert exc.value.code == 2 and "--rsft-prompts" in capsys.readouterr().err
