"""The tiny-cpu pipeline end to end, offline on CPU: tiny model -> SFT stage 0 -> gate -> GRPO ->
GRPO gate -> evaluate. SFT runs exactly as the preset (it must lift the tiny model's greedy parse
rate from 0 to >= 0.9); GRPO and the evaluations use fewer steps and seeds to keep the test to a few
minutes. GRPO's rewards and the gates' metrics are checked for being reported, not for rising."""

from __future__ import annotations

import json
import math

import pytest

from orthojob import gate
from orthojob.cli import main as cli_main
from orthojob.exit_codes import ExitCode
from orthojob.pipeline import PRESETS, SUMMARY_FILE, apply_overrides, grpo_argv, run_pipeline

SMALL = {"sft_gate.n_seeds": 20, "grpo.steps": 2, "grpo.gate_seeds": 8, "evaluate.n_seeds": 6}


def test_presets_hold_every_hyper_parameter():
    for name, preset in PRESETS.items():
        assert set(preset) >= {"model", "task_id", "sft", "sft_gate", "grpo", "grpo_gate", "evaluate"}, name
        argv = grpo_argv(preset, "m", "sft", "out")
        for flag in ("--steps", "--lr", "--lora-r", "--num-generations", "--max-completion-length", "--seed"):
            assert flag in argv
    assert PRESETS["tiny-cpu"]["sft"]["lora_r"] == 0  # LoRA on a random base never learns the format
    assert PRESETS["qwen2.5-3b"]["sft"]["lora_r"] > 0 and PRESETS["qwen2.5-3b"]["grpo"]["lora_r"] > 0
    assert apply_overrides(PRESETS["tiny-cpu"], {"grpo.steps": 3})["grpo"]["steps"] == 3
    assert PRESETS["tiny-cpu"]["grpo"]["steps"] != 3  # the preset itself is untouched
    with pytest.raises(KeyError):
        apply_overrides(PRESETS["tiny-cpu"], {"grpo.stepz": 3})


def test_pipeline_cli_show_and_bad_override(capsys):
    assert cli_main(["pipeline", "--show", "--set", "grpo.steps=5"]) == 0
    assert json.loads(capsys.readouterr().out)["grpo"]["steps"] == 5
    assert cli_main(["pipeline", "--show", "--set", "nope.x=1"]) == 2


def test_tiny_cpu_pipeline_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MLflow's embedded artifact store (./mlartifacts) lands here
    out = tmp_path / "run"
    summary = run_pipeline("tiny-cpu", out, SMALL)
    text = capsys.readouterr().out
    stages = summary["stages"]
    assert json.loads((out / SUMMARY_FILE).read_text())["exit_code"] == summary["exit_code"]

    # SFT stage 0 lifts the greedy parse rate of the random tiny model to >= 0.9
    assert stages["sft0"]["steps"] == PRESETS["tiny-cpu"]["sft"]["steps"]
    assert stages["sft0"]["final_loss"] < stages["sft0"]["first_loss"]
    sft_gate = stages["gate_sft0"]
    assert sft_gate["parse_rate"] >= 0.9, sft_gate
    assert sft_gate["passed"] is True
    gate.check_gate(out / "sft0")  # the file GRPO's pre-flight accepted

    # GRPO ran its steps, its rewards are reported as measured, and its own gate was evaluated
    grpo = stages["grpo"]
    assert grpo["exit_code"] in (0, ExitCode.GRPO_GATE_FAILED)
    assert grpo["steps"] == 2 and len(grpo["reward_per_step"]) == 2
    assert all(math.isfinite(r) for r in grpo["reward_per_step"])
    content = gate.read_gate(out / "grpo")  # consistent: passed follows from its metrics
    assert content["stage"] == "grpo" and content["metrics"]["n"] == 8
    assert stages["gate_grpo"]["passed"] is content["passed"]
    assert summary["exit_code"] == (0 if content["passed"] else ExitCode.GRPO_GATE_FAILED)

    # the evaluation compares both checkpoints with the baselines on the same held-out seeds
    results = json.loads((out / "evaluation.json").read_text())["results"]["task_easy"]
    assert list(results) == ["grpo", "sft0", "oracle", "uniform_slerp", "do_nothing"]
    for name in ("grpo", "sft0"):
        m = results[name]["model_metrics"]
        assert m["n"] == 6 and 0 <= m["strategy_accuracy"] <= 1
    assert results["sft0"]["model_metrics"]["parse_rate"] >= 0.5
    for stage in ("tiny-model", "sft0", "gate_sft0", "grpo", "gate_grpo", "evaluate"):
        assert stage in text and stages[stage]["seconds"] is not None
