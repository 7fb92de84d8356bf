"""One headline metric wherever a planner is judged: the scaled terminal reward (``scaled_reward``),
beside the hard-rule share; the raw [0, 1] score only as the secondary ``terminal_raw``."""

from __future__ import annotations

import re

import numpy as np
import pytest
from scipy import stats

from experiments.learning import experiment as learning
from orthojob.core import metrics
from orthojob.core.prompts import plan_to_completion
from orthojob.eval.evaluation import SUMMARY_KEYS, evaluate_planners, format_table
from orthojob.lifecycle import gate_file, registry
from orthojob.stages import gate, pipeline_summary
from server.dental_constants import N_STAGES, TOOTH_IDS
from server.oracle import oracle_plan

OLD_NAMES = re.compile(r"^(?!.*terminal_raw).*terminal(_mean|_reward|_sd)?$")
"""A metric named for the terminal score that is not the secondary ``terminal_raw``."""


def _rushed(obs: list[dict]) -> list[str]:
    """The oracle's plans with every fraction tripled: most of the movement done sooner, breaking the
    per-stage limits on many cases; on the raw [0, 1] score still above uniform SLERP."""
    out = []
    for o in obs:
        plan = oracle_plan(o)
        groups = [{**g, "fraction": min(1.0, 3 * g["fraction"])} for g in plan["tooth_groups"]]
        out.append(plan_to_completion({**plan, "tooth_groups": groups}))
    return out


def test_every_judgement_uses_the_one_name():
    assert metrics.SCALED_REWARD_MEAN == "scaled_reward_mean" == registry.COMPARISON_METRIC
    assert SUMMARY_KEYS[:3] == ("scaled_reward", "hard_rule_share", "terminal_raw")
    assert learning.METRICS[0] == "scaled_reward"
    assert (
        "scaled_reward_mean" in pipeline_summary.GATE_VIEW and "hard_rule_share" in pipeline_summary.GATE_VIEW
    )
    for stage in gate_file.QUALITY_STAGES:
        assert (
            gate_file.DEFAULT_THRESHOLDS[stage].max_hard_rule_share_over_oracle
            == gate_file.HARD_RULE_BOUND
            == 0.0
        )
    for stage in (gate_file.FORMAT_SFT, gate_file.TOOL_SFT):
        assert gate_file.DEFAULT_THRESHOLDS[stage].max_hard_rule_share_over_oracle is None


def test_the_gate_judges_by_the_scaled_reward_not_the_raw_score():
    """A planner above uniform SLERP on the raw score (what the gate compared before) but below it on
    the scaled reward, breaking hard rules, fails the GRPO gate on both the margin and the bound (its raw
    plans judged: ``--engine off``)."""
    report = gate.gate_report(
        "scripted",
        n_seeds=8,
        stage=gate_file.GRPO,
        policy=_rushed,
        cells=[("task_easy", False)],
        engine=False,
    )
    m = report["metrics"]
    assert m["terminal_raw_mean"] > m["uniform_slerp_terminal_raw_mean"]  # the raw comparison would pass
    assert m["scaled_reward_mean"] < m["uniform_slerp_scaled_reward_mean"] < m["oracle_scaled_reward_mean"]
    assert m["margin_over_slerp"] == pytest.approx(
        m["scaled_reward_mean"] - m["uniform_slerp_scaled_reward_mean"]
    )
    assert m["hard_rule_share"] > m["oracle_hard_rule_share"] == 0.0
    assert report["passed"] is False
    assert report["checks"] == {"parse_rate": True, "format_reward": True, "margin_over_slerp": False,
                                "p_no_better_than_slerp": False, "hard_rule_share_over_oracle": False,
                                "repair_share": True}  # fmt: skip
    assert not [k for k in m if OLD_NAMES.match(k)], sorted(m)
    assert set(m["per_task_scaled_reward_mean"]) == set(m["per_task_hard_rule_share"]) == {"task_easy"}
    text = gate_file.format_gate(report).splitlines()
    assert text[0] == "gate grpo: FAILED"
    assert any(line.startswith("  hard_rule_share_over_oracle") and line.endswith("FAIL") for line in text)
    assert text[-3].strip().startswith("scaled_reward ") and "terminal_raw" in text[-1]
    assert text[-2].strip().startswith("staging engine off")


def _uniform_slerp_as_a_plan(obs: list[dict]) -> list[str]:
    """Every tooth in one group at 1/24 of its movement per aligner: uniform SLERP written as a plan."""
    group = {"teeth": [int(t) for t in TOOTH_IDS], "fraction": 1 / N_STAGES}
    return [plan_to_completion({"tooth_groups": [group]}) for _ in obs]


def test_paired_margin_matches_the_one_sided_t_test_and_ties_never_win():
    rng = np.random.default_rng(0)
    base = rng.normal(4.5, 1.0, 40)
    mine = base + rng.normal(0.3, 1.0, 40)
    got = gate.paired_margin(mine, base)
    expected = stats.ttest_rel(mine, base, alternative="greater")
    assert got["p"] == pytest.approx(expected.pvalue)
    assert got["lower"] == pytest.approx(expected.confidence_interval(0.95).low)
    assert gate.paired_margin(base, base) == {"lower": 0.0, "p": 1.0}  # a tie on every case
    assert gate.paired_margin(base + 1e-12, base)["p"] == 1.0  # floating-point noise is a tie
    assert gate.paired_margin(base + 0.5, base) == {"lower": pytest.approx(0.5), "p": 0.0}  # no spread
    assert gate.paired_margin(base - 0.5, base)["p"] == 1.0
    assert gate.paired_margin([5.0], [4.0])["p"] == 1.0  # one case concludes nothing


def test_uniform_slerp_written_as_a_plan_fails_the_grpo_gate_and_the_oracle_passes():
    """A plan that scores exactly as uniform SLERP on every case has margin 0: the GRPO gate asks for
    a margin beyond the cases' noise, so copying the baseline does not pass it, with the staging engine
    or without."""
    cells = [("task_easy", False), ("task_hard", True)]
    for engine in (True, False):
        report = gate.gate_report("scripted", n_seeds=4, stage=gate_file.GRPO, policy=_uniform_slerp_as_a_plan,
                                  cells=cells, engine=engine)  # fmt: skip
        m = report["metrics"]
        assert m["margin_over_slerp"] == pytest.approx(0.0, abs=1e-9)
        assert m["p_no_better_than_slerp"] == 1.0 and m["repair_share"] == 0.0
        assert report["passed"] is False
        failed = {k for k, ok in report["checks"].items() if not ok}
        # the mean margin is 0 up to floating-point noise, which either side of 0 decides its own check
        assert "p_no_better_than_slerp" in failed and failed <= {
            "p_no_better_than_slerp",
            "margin_over_slerp",
        }
    oracle = gate.gate_report("scripted", n_seeds=4, stage=gate_file.GRPO, cells=cells,
                              policy=lambda obs: [plan_to_completion(oracle_plan(o)) for o in obs])  # fmt: skip
    assert oracle["passed"] is True
    assert oracle["metrics"]["p_no_better_than_slerp"] < gate_file.SLERP_P_BOUND
    assert oracle["metrics"]["margin_over_slerp_lower"] > 0


def test_orthojob_evaluate_leads_with_the_scaled_reward():
    report = evaluate_planners({"oracle": oracle_plan}, ["task_easy"], n_seeds=3)
    row = report["task_easy"]["oracle"]
    assert list(row)[:3] == ["scaled_reward", "hard_rule_share", "terminal_raw"]
    assert not [k for k in row if OLD_NAMES.match(k)]
    assert 7.0 < row["scaled_reward"]["mean"] <= 8.0 and 0.0 < row["terminal_raw"]["mean"] <= 1.0
    title, header = format_table(report, 3).splitlines()[:2]
    assert header.split()[2:5] == ["scaled_reward", "hard_rules", "terminal_raw"]
    assert metrics.BANDS in title  # the scale's bands, from server.reward_scaler's constants
