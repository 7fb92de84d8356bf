"""Stage 1, tool-use SFT (issue 15, :mod:`orthojob.tool_sft`): the oracle's tool conversations score
as its one-shot plans do; ``orthojob tool-sft`` trains on them, writes its tool-call gate and MLflow
stage run; GRPO's pre-flight accepts that gate."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from orthojob import gate
from orthojob.cli import main as cli_main
from orthojob.prompts import TRAIN_SEED_START, plan_to_completion
from orthojob.rewards import reward_terminal
from orthojob.rollouts import DEFAULT_CACHE
from orthojob.tool_sft import (
    DONE_MESSAGE,
    build_tiny_tool_model,
    oracle_tool_trace,
    parse_tool_call,
    render_rows,
    tool_demonstrations,
)


@pytest.mark.parametrize(
    "task_id, force_decay, seed",
    [("task_easy", False, 0), ("task_medium", False, 5), ("task_hard", False, 2), ("task_hard", True, 7)],
)
def test_tool_traces_score_as_the_oracle_plans(task_id, force_decay, seed):
    row = oracle_tool_trace(TRAIN_SEED_START + seed, task_id, force_decay, random.Random(seed))
    DEFAULT_CACHE.clear()
    (expected,) = reward_terminal(
        [plan_to_completion(row["plan"])], seed=[row["seed"]], task_id=[task_id], force_decay=[force_decay]
    )
    assert row["reward"] == expected
    assert row["calls"][-2:] == ["check_collisions", "submit_plan"] and row["calls"][0] == "inspect_tooth"
    roles = [m["role"] for m in row["completion"]]
    assert roles == ["assistant", "tool"] * len(row["calls"]) + ["assistant"]
    assert row["completion"][-1]["content"] == DONE_MESSAGE
    submitted = json.loads(row["completion"][-2]["content"])
    assert submitted["finished"] and submitted["scaled_reward"] == pytest.approx(expected, abs=1e-4)
    assert "Case summary" in row["prompt"][-1]["content"]  # the agentic prompt, case appended


def test_demonstrations_render_as_parseable_tool_calls():
    from orthojob.agentic import prepare_tokenizer
    from orthojob.tiny_model import train_tokenizer

    rows, info = tool_demonstrations(3, ["task_easy", "task_hard"], seed=1)
    assert info["examples"] == 3 and info["source"] == "tool" and info["reward_mean"] > 0
    assert [r["task_id"] for r in rows] == ["task_easy", "task_hard", "task_easy"]
    (text,) = render_rows(rows[:1], prepare_tokenizer(train_tokenizer(["x y"])))
    assert '"name": "submit_plan"' in text["prompt"]  # the tools' schemas in the system message
    turns = text["completion"].split("<|im_start|>assistant\n")
    calls = [parse_tool_call(t) for t in [turns[0], *turns[1:]]]
    assert [c[0] for c in calls if c] == rows[0]["calls"] and calls[-1] is None
    assert calls[-2][1]["plan"] == plan_to_completion(rows[0]["plan"])  # the arguments as given, no nulls
    assert "null" not in text["completion"].split("</tool_call>")[0]


@pytest.fixture(scope="module")
def tiny_tool_base(tmp_path_factory) -> Path:
    return build_tiny_tool_model(tmp_path_factory.mktemp("tiny-tool") / "base", ["task_easy"])


def test_tool_sft_cli_gate_mlflow_and_grpo_preflight(tiny_tool_base, tmp_path, monkeypatch, capsys):
    import mlflow

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "tool_sft"
    argv = ["tool-sft", "--model", str(tiny_tool_base), "--out", str(out), "--lora-r", "0", "--steps", "2",
            "--batch-size", "1", "--examples", "2", "--gate-seeds", "1", "--gate-max-new-tokens", "8",
            "--gate-tool-turns", "2", "--min-tool-call-rate", "0", "--min-finished-rate", "0"]  # fmt: skip
    assert cli_main(argv) == 0, capsys.readouterr()
    content = gate.read_gate(out)
    assert content["stage"] == "tool_sft" and content["passed"] is True
    assert set(content["checks"]) == {"tool_call_rate", "finished_rate"}
    assert {"valid_call_rate", "reward_mean", "turns_mean"} <= set(content["metrics"])
    summary = json.loads((out / "sft_log.json").read_text())["summary"]
    assert summary["demos"]["source"] == "tool" and summary["examples"] == 2 and summary["steps"] == 2
    assert (
        "<tool_call>" in (out / "tokenizer_config.json").read_text()
        or (out / "chat_template.jinja").is_file()
    )
    (run,) = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`orthorl.stage` = 'tool_sft'",
                                output_format="list")  # fmt: skip
    assert run.data.tags["orthorl.gate_passed"] == "true" and "gate/tool_call_rate" in run.data.metrics
    # GRPO's pre-flight accepts the tool-use stage's gate
    capsys.readouterr()
    assert cli_main(["train", "--from-checkpoint", str(out), "--test"]) == 0
    assert "passed (stage tool_sft)" in capsys.readouterr().out
    # with the default thresholds two steps do not teach tool calls: the gate fails (exit 12)
    rc = cli_main(["gate", "--checkpoint", str(out), "--stage", "tool_sft", "--seeds", "1", "--max-new-tokens", "8",
                   "--tool-turns", "1"])  # fmt: skip
    assert rc == 12 and gate.read_gate(out)["passed"] is False
