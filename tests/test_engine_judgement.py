"""What ships is the planner with the staging engine, and both are reported: the gates, the evaluation
and the rollouts judge the executed plans beside the raw ones; ``--engine off`` judges the raw plans
as before; a planner the engine must rewrite wholesale fails its gate."""

from __future__ import annotations

import json

import pytest

from orthojob.core.prompts import plan_to_completion
from orthojob.eval.evaluation import evaluate_checkpoint
from orthojob.lifecycle import gate_file
from orthojob.rewards.rollouts import score_texts
from orthojob.stages import gate
from orthojob.stages.pipeline_summary import format_summary
from server.cases import CaseKey, generate_case
from server.dental_constants import TOOTH_IDS
from server.oracle import oracle_plan
from server.staging_engine import ENGINE_VERSION, REPAIRED, UNCHANGED

IDENTITY = "tests:staging-engine-judgement"
SEEDS = 2_000_700


def _oracle_2dp(observations):
    """The oracle's plan with its fractions written at 2 decimals: a planner a little off the knife edge."""
    out = []
    for o in observations:
        plan = oracle_plan(o)
        groups = [{**g, "fraction": round(g["fraction"], 2)} for g in plan["tooth_groups"]]
        out.append(plan_to_completion({**plan, "tooth_groups": groups}))
    return out


def _everything_at_once(observations):
    """Every tooth in one aligner: each plan breaks the per-stage limits, so the engine rewrites all."""
    return [plan_to_completion({"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 1.0}]})] * len(
        observations
    )


def _gate(policy, engine: bool, n: int = 8) -> dict:
    return gate.gate_report(
        "scripted", n_seeds=n, stage=gate_file.GRPO, policy=policy, identity=IDENTITY, engine=engine
    )


@pytest.fixture(scope="module")
def near_oracle():
    return _gate(_oracle_2dp, True), _gate(_oracle_2dp, False)


def test_the_gate_judges_the_executed_plans_beside_the_raw_ones(near_oracle):
    on, off = near_oracle
    m, raw = on["metrics"], off["metrics"]
    assert on["window"] == off["window"] and m["n"] == raw["n"] == 48
    assert m["engine"] == ENGINE_VERSION and raw["engine"] == "off"
    # the raw plans break rules on some cases; what ships breaks none
    assert raw["hard_rule_share"] > 0 and m["hard_rule_share"] == 0.0
    assert on["guarantee"]["breaks"] == 0 and off["guarantee"]["breaks"] == round(raw["hard_rule_share"] * 48)
    # engine off is exactly the raw judgement the engine-on report puts beside its own
    assert m["raw_hard_rule_share"] == raw["hard_rule_share"]
    assert m["raw_scaled_reward_mean"] == raw["scaled_reward_mean"]
    assert raw["repair_share"] == raw["fallback_share"] == raw["repaired_movement_share"] == 0.0
    # every rule-breaking plan is changed, no safe one is: the repair share is the raw hard-rule share
    assert m["repair_share"] == m["raw_hard_rule_share"]
    assert 0.0 < m["repaired_movement_share"] <= m["repair_share"]
    assert m["scaled_reward_mean"] > raw["scaled_reward_mean"]
    # the verdicts: the raw plans fail the hard-rule bound, the planner with the engine passes
    assert off["checks"]["hard_rule_share_over_oracle"] is False and off["passed"] is False
    assert on["passed"] is True and on["checks"]["repair_share"] is True
    cells = m["per_cell_repair_share"]
    assert set(cells) == set(m["per_cell_raw_hard_rule_share"]) and len(cells) == 6
    assert sum(cells.values()) / 6 == pytest.approx(m["repair_share"])


def test_a_planner_the_engine_must_rewrite_wholesale_fails_its_gate():
    on, off = _gate(_everything_at_once, True, n=2), _gate(_everything_at_once, False, n=2)
    m = on["metrics"]
    assert off["metrics"]["hard_rule_share"] == 1.0 and m["hard_rule_share"] == 0.0
    assert m["repair_share"] == 1.0 and m["raw_hard_rule_share"] == 1.0
    assert on["passed"] is False and on["checks"]["repair_share"] is False
    assert on["thresholds"]["max_repair_share"] == gate_file.REPAIR_BOUND


def test_the_gate_file_and_the_summary_print_both(near_oracle, tmp_path):
    on, off = near_oracle
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')  # checkpoint-shaped
    (tmp_path / "model.safetensors").write_bytes(b"\x00weights\x01" * 100)
    content = gate_file.write_gate(tmp_path, on)
    text = gate_file.format_gate(content)
    assert f"staging engine v{ENGINE_VERSION}" in text and "the raw plans:" in text and "repair_share" in text
    assert "staging engine off" in gate_file.format_gate(gate_file.write_gate(tmp_path, off))
    view = {k: on["metrics"].get(k) for k in ("parse_rate", "format_reward", "strategy_accuracy")}
    summary = {
        "preset": "t",
        "exit_code": 0,
        "chain": ["grpo"],
        "stages": {
            "grpo": {"seconds": 1.0, "exit_code": 0, "steps": 1},
            "gate_grpo": {"seconds": 1.0, "passed": True, **view, **on["metrics"]},
        },
    }
    *_, margin, line = format_summary(summary).splitlines()
    assert f"engine v{ENGINE_VERSION}: executed scaled_reward" in line and "raw plans" in line
    assert margin.strip().startswith("above SLERP on the same cases by") and "95 % lower bound" in margin


def test_rollouts_carry_the_engines_record_and_keep_the_raw_score():
    case = generate_case("task_easy", SEEDS)
    key = CaseKey("task_easy", SEEDS, False)
    texts = [
        plan_to_completion({"tooth_groups": [{"teeth": case.present_ids, "fraction": 1 / 24}]}),
        plan_to_completion({"tooth_groups": [{"teeth": case.present_ids, "fraction": 1.0}]}),
        "no plan here",
    ]
    raw = score_texts(texts, [key] * 3)
    on = score_texts(texts, [key] * 3, engine=True)
    for a, b in zip(raw, on):  # the raw rollout is scored exactly as without the engine
        assert (a.scaled_reward, a.broken_rules, a.reward_breakdown) == (
            b.scaled_reward,
            b.broken_rules,
            b.reward_breakdown,
        )
    safe, breaking, garbage = on
    assert safe.repair["status"] == UNCHANGED and safe.executed is None and safe.shipped is safe
    assert breaking.broken_rules and breaking.repair["status"] == REPAIRED and breaking.changed
    assert not breaking.shipped.broken_rules and breaking.shipped.plan != breaking.plan
    assert breaking.shipped.format == breaking.format  # the completion's format, not the engine's
    assert garbage.repair is None and garbage.shipped is garbage and not garbage.changed


def test_evaluate_reports_the_executed_row_and_the_raw_figures():
    report = evaluate_checkpoint(
        "scripted", ["task_hard"], 4, seed_start=SEEDS, force_decay=True, baselines=False,
        policy=_everything_at_once,
    )  # fmt: skip
    row = report["task_hard"]["checkpoint"]
    mm = row["model_metrics"]
    assert mm["engine"] == ENGINE_VERSION and mm["repair_share"] == 1.0 and mm["raw_hard_rule_share"] == 1.0
    assert row["hard_rule_share"]["mean"] == 0.0 and row["scaled_reward"]["mean"] == mm["scaled_reward_mean"]
    off = evaluate_checkpoint(
        "scripted", ["task_hard"], 4, seed_start=SEEDS, force_decay=True, baselines=False,
        policy=_everything_at_once, engine=False,
    )["task_hard"]["checkpoint"]  # fmt: skip
    assert off["hard_rule_share"]["mean"] == 1.0 and off["model_metrics"]["engine"] == "off"
    assert off["scaled_reward"]["mean"] == mm["raw_scaled_reward_mean"]
    json.dumps(report)  # the report stays JSON


def test_grpo_with_the_engine_in_the_loop_pays_a_repair_less_than_the_safe_plan_written_directly():
    from orthojob.rewards.reward_functions import active_reward_funcs, reward_weights
    from server.staging_engine import execute_plan_dicts

    funcs = active_reward_funcs()
    weights = reward_weights(funcs)
    case = generate_case("task_medium", SEEDS + 1, True)
    breaking = {"tooth_groups": [{"teeth": case.present_ids, "fraction": 1.0}]}
    executed, run = execute_plan_dicts([breaking], [case])
    assert run.records[0].status == REPAIRED
    texts = [plan_to_completion(p) for p in (breaking, executed[0])]
    columns = {"seed": [case.seed] * 2, "task_id": [case.task_id] * 2, "force_decay": [True] * 2}

    def total(engine: bool) -> list[float]:
        cols = {**columns, "engine": [engine] * 2} if engine else columns
        values = [f(texts, **cols) for f in funcs]
        return [sum(w * v[k] for w, v in zip(weights, values)) for k in range(2)]

    raw, in_loop = total(False), total(True)
    assert raw[0] < 0 <= raw[1]  # as written, the rule-breaking plan is below every safe plan
    assert in_loop[1] == raw[1]  # a plan the engine executes as written is paid as without it
    # leaning on the engine pays less than writing its safe plan directly
    assert raw[0] < in_loop[0] < in_loop[1]
    with pytest.raises(ValueError, match="engine"):
        funcs[0](texts, **columns, engine=[True, False])


def test_a_smaller_repair_cost_still_pays_a_repair_less_than_the_safe_plan_written_directly():
    from orthojob.rewards.reward_functions import reward_terminal
    from server.staging_engine import REPAIR_COST_BASE, execute_plan_dicts, repair_cost

    case = generate_case("task_medium", SEEDS + 1, True)
    breaking = {"tooth_groups": [{"teeth": case.present_ids, "fraction": 1.0}]}
    executed, run = execute_plan_dicts([breaking], [case])
    texts = [plan_to_completion(p) for p in (breaking, executed[0])]
    columns = {"seed": [case.seed] * 2, "task_id": [case.task_id] * 2, "force_decay": [True] * 2}
    record = run.records[0]
    assert (
        repair_cost(record, 0.05) == pytest.approx(0.05 * repair_cost(record))
        and repair_cost(record) > REPAIR_COST_BASE
    )
    paid = {}
    for scale in (1.0, 0.25, 0.05):
        paid[scale] = reward_terminal(texts, **columns, engine=[True] * 2, repair_cost_scale=[scale] * 2)
        assert paid[scale][0] < paid[scale][1]  # leaning on the engine never pays, at any positive cost
    assert paid[1.0][0] < paid[0.25][0] < paid[0.05][0] and paid[1.0][1] == paid[0.05][1]
    # a cost of 0 would make leaning on the engine free: refused, by the engine and by the config
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="> 0"):
            reward_terminal(texts, **columns, engine=[True] * 2, repair_cost_scale=[bad] * 2)
        with pytest.raises(ValueError, match="> 0"):
            repair_cost(record, bad)
    with pytest.raises(ValueError, match="repair_cost_scale"):
        reward_terminal(texts, **columns, engine=[True] * 2, repair_cost_scale=[1.0, 0.5])


def test_the_job_config_refuses_a_repair_cost_that_is_not_positive():
    from orthojob.stages.grpo_config import ConfigError, GRPOJobConfig

    for bad in (0, -0.5, float("nan"), True, "0.1"):
        with pytest.raises(ConfigError, match="--repair-cost-scale"):
            GRPOJobConfig(objective="engine", repair_cost_scale=bad)
    assert GRPOJobConfig(objective="engine", repair_cost_scale=0.25).repair_cost_scale == 0.25


def test_the_plan_search_attacks_the_sum_with_the_engine_in_the_loop():
    from experiments.audits.plan_search import objective
    from server.staging_engine import execute_plan_dicts

    case = generate_case("task_easy", SEEDS + 2, True)
    breaking = {"tooth_groups": [{"teeth": case.present_ids, "fraction": 1.0}]}
    executed, _ = execute_plan_dicts([breaking], [case])
    in_loop, written = objective(case, [breaking, executed[0]], target="sum_engine")
    raw, _ = objective(case, [breaking, executed[0]], target="sum")
    assert written[0] < 0 <= written[1]  # the terminal column judges the plans as written
    assert raw[0] < in_loop[0] < in_loop[1] == raw[1]
