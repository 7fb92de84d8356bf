"""The learning experiment's tools for choosing GRPO's objective: the within-group signal an objective
gives a plan's speed (``experiments.learning.objective_signal``), and a GRPO trial from an existing BC
checkpoint (``experiments.learning.grpo_trial``)."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.learning import grpo_trial
from experiments.learning.objective_signal import mean_fraction, within_group_correlation


def test_the_signal_says_which_way_an_objective_pushes_a_groups_speed():
    speed = np.array([0.02, 0.04, 0.06, 0.08, 0.03, 0.05, 0.07, 0.09])
    groups = [np.arange(4), np.arange(4, 8)]
    faster_pays = 10 * speed + np.array([0.0, 0.01, -0.01, 0.0, 0.0, 0.0, 0.01, 0.0])
    assert within_group_correlation(faster_pays, speed, groups) > 0.9
    assert within_group_correlation(-faster_pays, speed, groups) < -0.9
    # a shift between groups is not a signal within them
    shifted = faster_pays + np.repeat([0.0, 100.0], 4)
    assert within_group_correlation(shifted, speed, groups) == pytest.approx(
        within_group_correlation(faster_pays, speed, groups)
    )
    flat = np.ones(8)  # no spread: no signal, not a number pretending to be one
    assert np.isnan(within_group_correlation(flat, speed, groups))
    assert mean_fraction({"tooth_groups": [{"fraction": 0.1}, {"fraction": 0.3}]}) == pytest.approx(0.2)
    assert np.isnan(mean_fraction(None)) and np.isnan(mean_fraction({"strategy": "x"}))


def test_a_trial_refuses_a_start_that_is_not_a_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        grpo_trial.main(["--from", str(tmp_path / "nothing"), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and "no checkpoint there" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_trials_summary_reads_the_curve_and_the_final_rows():
    def pooled(x):
        cell = {"mean": x, "lo": x - 0.1, "hi": x + 0.1}
        return {"pooled": {"scaled_reward": cell, "raw_scaled_reward_mean": {"mean": x - 1},
                           "repair_share": {"mean": 0.2}, "hard_rule": {"mean": 0.0}}}  # fmt: skip

    record = {"evaluations": [{"step": 0, **pooled(5.0)}, {"step": 30, **pooled(5.5)}],
              "final": {"start": pooled(5.1), "end": pooled(5.6)}}  # fmt: skip
    lines = grpo_trial.summary_lines(record)
    assert lines[1].startswith("step   30: executed 5.50 [5.40, 5.60]  raw 4.50  repair share 0.200")
    assert lines[-1].startswith("final end  : executed 5.60")
