"""Stage 1, tool-use SFT (:mod:`orthojob.stages.tool_sft`): the oracle's tool conversations score
as its one-shot plans do; the loss covers the assistant's turns only; ``orthojob tool-sft`` trains on
them, writes its tool-call gate and MLflow stage run; GRPO's pre-flight accepts that gate; the
pipeline runs the stage from a preset's chain. (``tests/test_e2e_mlflow_s3.py``: s3:// in and out.)"""

from __future__ import annotations

import json
import random
import re

import pytest

from orthojob.agentic.episodes import parse_tool_call
from orthojob.cli import main as cli_main
from orthojob.core.prompts import PROMPT_FORMAT_KEY, TRAIN_SEED_START, plan_to_completion
from orthojob.lifecycle import gate_file
from orthojob.modeling import models
from orthojob.rewards.reward_functions import reward_terminal
from orthojob.rewards.rollouts import DEFAULT_CACHE
from orthojob.stages.presets import PRESETS
from orthojob.stages.tool_sft import (
    DONE_MESSAGE,
    oracle_tool_trace,
    render_rows,
    tool_demonstrations,
)

# a gate any model passes: the tests check the plumbing, not what 2 steps learn
TOOL_GATE_FLAGS = ["--gate-seeds", "1", "--gate-max-new-tokens", "8", "--gate-tool-turns", "2",
                   "--min-tool-call-rate", "0", "--min-finished-rate", "0"]  # fmt: skip


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
    from orthojob.agentic.chat_template import prepare_tokenizer
    from orthojob.modeling.tiny_model import train_tokenizer

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


def labelled_spans(input_ids: list[int], labels: list[int]) -> list[list[int]]:
    """The runs of consecutive tokens the loss is computed on."""
    spans: list[list[int]] = []
    previous = False
    for token, label in zip(input_ids, labels):
        if label != -100:
            if not previous:
                spans.append([])
            spans[-1].append(token)
        previous = label != -100
    return spans


def test_the_loss_covers_exactly_the_assistant_turns(tiny_tool_base, tmp_path):
    """SFTTrainer's prepared examples: the tokens with a label are the assistant's turns (each tool
    call's JSON and the closing turn, with their end-of-turn token), none of the prompt or of the
    tools' results; the training template renders the same text as the checkpoint's template."""
    from trl.chat_template_utils import has_generation_markers, qwen2_5_chat_template

    from orthojob.stages.sft import sft_trainer, token_counts
    from orthojob.stages.sft_config import ToolSFTConfig

    config = ToolSFTConfig(model=str(tiny_tool_base), out=str(tmp_path), steps=1, batch_size=1, lora_r=0)
    model, tokenizer = models.load_policy(config.model, lora_r=0, max_seq_length=config.max_length)
    rows, _ = tool_demonstrations(2, ["task_easy", "task_hard"], seed=1)
    trainer = sft_trainer(config, model, tokenizer, rows, models.device_info())
    tokenizer = trainer.processing_class
    assert trainer.args.assistant_only_loss and has_generation_markers(trainer.chat_template)
    # the tokenizer (and the checkpoint) keep the inference template, whose calls GRPO's agentic mode parses
    assert tokenizer.chat_template == qwen2_5_chat_template
    counts = token_counts(trainer, config.max_length)
    assert counts["examples_at_max_length"] == 0 and 0 < counts["loss_tokens"] < counts["tokens"] / 5
    assert len(trainer.train_dataset) == len(rows)
    for row, example in zip(rows, trainer.train_dataset):
        tools = json.loads(row["tools"])
        messages = row["prompt"] + row["completion"]
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        trained = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=trainer.chat_template)  # fmt: skip
        assert trained == text
        # each assistant turn after its header, up to and with its <|im_end|>\n; the first turn's
        # leading newline ends the prompt (the generation prompt), so it is not trained on
        turns = re.findall(r"<\|im_start\|>assistant(.*?<\|im_end\|>\n)", text, re.DOTALL)
        assert len(turns) == sum(m["role"] == "assistant" for m in row["completion"]) == len(row["calls"]) + 1
        expected = [turns[0].removeprefix("\n"), *turns[1:]]
        spans = [tokenizer.decode(s) for s in labelled_spans(example["input_ids"], example["labels"])]
        assert spans == expected
        assert spans[-1] == f"\n{DONE_MESSAGE}<|im_end|>\n" and '"name": "submit_plan"' in spans[-2]
        results = [m["content"] for m in row["completion"] if m["role"] == "tool"]
        assert results and not any(r in span for r in results for span in spans)
        assert "Case summary" not in "".join(spans)  # the user prompt


def test_tool_sft_cli_gate_mlflow_and_grpo_preflight(tiny_tool_base, tmp_path, monkeypatch, capsys):
    import mlflow

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "tool_sft"
    argv = ["tool-sft", "--model", str(tiny_tool_base), "--out", str(out), "--lora-r", "0", "--steps", "2",
            "--batch-size", "1", "--examples", "2", *TOOL_GATE_FLAGS]  # fmt: skip
    assert cli_main(argv) == 0, capsys.readouterr()
    content = gate_file.read_gate(out)
    assert content["stage"] == "tool_sft" and content["passed"] is True
    assert set(content["checks"]) == {"tool_call_rate", "finished_rate"}
    assert {"valid_call_rate", "reward_mean", "turns_mean"} <= set(content["metrics"])
    summary = json.loads((out / "sft_log.json").read_text())["summary"]
    assert summary["demos"]["source"] == "tool" and summary["examples"] == 2 and summary["steps"] == 2
    # trained on the assistant's turns only, nothing cut by max_length
    assert summary["assistant_only_loss"] is True and summary["examples_at_max_length"] == 0
    assert 0 < summary["loss_tokens"] < summary["tokens"] / 5
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    saved = AutoTokenizer.from_pretrained(out)
    assert saved.chat_template == qwen2_5_chat_template  # the inference template, not the training variant
    (run,) = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`orthorl.stage` = 'tool_sft'",
                                output_format="list")  # fmt: skip
    assert run.data.tags["orthorl.gate_passed"] == "true" and "gate/tool_call_rate" in run.data.metrics
    # GRPO's pre-flight accepts the tool-use stage's gate
    capsys.readouterr()
    assert cli_main(["grpo", "--from-checkpoint", str(out), "--test"]) == 0
    assert "passed (stage tool_sft)" in capsys.readouterr().out
    # with the default thresholds two steps do not teach tool calls: the gate fails (exit 12)
    rc = cli_main(["gate", "--checkpoint", str(out), "--stage", "tool_sft", "--seeds", "1", "--max-new-tokens", "8",
                   "--tool-turns", "1"])  # fmt: skip
    assert rc == 12 and gate_file.read_gate(out)["passed"] is False


def test_pipeline_runs_tool_use_sft_from_a_presets_chain(tmp_path, monkeypatch, capsys):
    """``stages=tool_sft``: the pipeline builds the tiny model with a tokenizer that knows the tool
    conversations, trains stage 1 on the assistant's turns, gates it (MLflow runs, gate file); GRPO's
    agentic pre-flight accepts the checkpoint. (GRPO's agentic training: tests/test_agentic.py.)"""
    from orthojob.stages.pipeline import run_pipeline

    monkeypatch.chdir(tmp_path)
    overrides = {
        "stages": "tool_sft",
        "base_eval": False,
        **{f"tool_sft.{k}": v for k, v in {"steps": 1, "examples": 2, "batch_size": 1}.items()},
        **{f"tool_sft_gate.{k}": v for k, v in {"n_seeds": 1, "max_new_tokens": 8, "tool_turns": 1}.items()},
        "tool_sft_gate.thresholds.min_tool_call_rate": 0,
        "tool_sft_gate.thresholds.min_finished_rate": 0,
        "evaluate.n_seeds": 1,
        "evaluate.max_new_tokens": 8,
        "evaluate.baselines": False,
    }
    out = tmp_path / "run"
    summary = run_pipeline("tiny-cpu", out, overrides)
    assert summary["exit_code"] == 0, format(summary["stages"])
    assert summary["chain"] == ["tool_sft"]
    stages = summary["stages"]
    tiny = json.loads((out / "tiny-model" / "config.json").read_text())
    assert stages["tiny-model"]["path"] == str(out / "tiny-model") and tiny["max_position_embeddings"] == 8192
    assert tiny[PROMPT_FORMAT_KEY] == PRESETS["tiny-cpu"].tiny_arch["prompt_format"]  # the preset's, recorded
    tool = stages["tool_sft"]
    assert tool["demos"]["source"] == "tool" and tool["assistant_only_loss"] is True
    assert tool["examples_at_max_length"] == 0 and 0 < tool["loss_tokens"] < tool["tokens"]
    content = gate_file.read_gate(out / "tool_sft")
    assert content["stage"] == "tool_sft" and stages["gate_tool_sft"]["passed"] is True
    assert stages["gate_tool_sft"]["tool_call_rate"] == content["metrics"]["tool_call_rate"]
    assert "gate_tool_sft" in capsys.readouterr().out  # the summary table's line
    capsys.readouterr()
    rc = cli_main(["grpo", "--from-checkpoint", str(out / "tool_sft"), "--mode", "agentic", "--test"])
    assert rc == 0 and "passed (stage tool_sft)" in capsys.readouterr().out
