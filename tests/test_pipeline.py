"""The tiny-cpu pipeline end to end, offline on CPU, through its command line: tiny model -> BC SFT
(stage 2) -> gate -> GRPO -> GRPO gate -> evaluate -> register (``--register``). The chain's
mechanics: SFT, GRPO and the evaluations use fewer steps and seeds than ``make run`` to keep the test to
a few minutes, so the quality thresholds are opened; the gates evaluate, record the executed plans'
figures beside the raw plans' and decide from them. ``make run``'s own verdicts on the whole preset
are measured by running it (README, docs/stages.md)."""

from __future__ import annotations

import json
import math

import pytest

from orthojob.cli import build_parser
from orthojob.cli import main as cli_main
from orthojob.core.prompts import prompt_format_of
from orthojob.lifecycle import gate_file
from orthojob.lifecycle.registry import DEFAULT_MODEL_NAME
from orthojob.ops.exit_codes import ExitCode
from orthojob.stages.grpo import config_from_args
from orthojob.stages.grpo_config import ConfigError, GRPOJobConfig
from orthojob.stages.pipeline import SUMMARY_FILE
from orthojob.stages.presets import PRESETS, Preset, apply_overrides
from orthojob.stages.sft import config_from_args as sft_config_from_args
from orthojob.stages.sft_config import SFTJobConfig
from server.staging_engine import ENGINE_VERSION

SMALL = {
    # a third of make run's SFT; its gate on 4 seeds in each of six cells, opened: a short BC is not
    # make run's planner (the quality bounds' own tests: tests/test_engine_judgement.py,
    # tests/test_tracking_registry.py, tests/test_headline_metric.py)
    "bc_sft.steps": 200,
    "bc_sft_gate.n_seeds": 4,
    "bc_sft_gate.thresholds.min_parse_rate": 0.0,
    "bc_sft_gate.thresholds.min_format_reward": 0.0,
    "bc_sft_gate.thresholds.max_repair_share": None,
    "grpo.steps": 2,
    "grpo.gate_seeds": 2,
    "grpo_gate.thresholds.min_parse_rate": 0.0,
    "grpo_gate.thresholds.min_format_reward": 0.0,
    "grpo_gate.thresholds.max_repair_share": None,
    "evaluate.n_seeds": 6,
    # a threshold the caller asks for: the GRPO stage's one gate file must carry it
    "grpo_gate.thresholds.min_margin_over_slerp": -5.0,
    "grpo_gate.thresholds.max_p_no_better_than_slerp": None,
}


# First in the file: pytest-xdist queues another file on this worker once two of its tests are
# left, so a long test at the end would hold that file back for its whole run.
def test_tiny_cpu_pipeline_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MLflow's embedded store (./mlflow.db, ./mlartifacts) lands here
    out = tmp_path / "run"
    flags = [f"--set={k}={json.dumps(v)}" for k, v in SMALL.items()]
    rc = cli_main(["pipeline", "--preset", "tiny-cpu", "--out", str(out), "--register", *flags])
    text = capsys.readouterr().out
    summary = json.loads((out / SUMMARY_FILE).read_text())
    stages = summary["stages"]

    preset = PRESETS["tiny-cpu"]
    # the tiny model is built for the preset's prompt format, and every stage's checkpoint keeps it
    expected_format = preset.tiny_arch["prompt_format"]
    assert expected_format == "compact"
    for folder in ("tiny-model", "bc_sft", "grpo"):
        assert prompt_format_of(out / folder) == expected_format, folder

    # BC SFT (stage 2) trains and its gate judges the executed plans beside the raw ones
    assert stages["bc_sft"]["steps"] == SMALL["bc_sft.steps"]
    assert stages["bc_sft"]["final_loss"] < stages["bc_sft"]["first_loss"]
    sft_gate = stages["gate_bc_sft"]
    assert sft_gate["passed"] is True and sft_gate["engine"] == ENGINE_VERSION
    # what ships is safe by construction; the raw plans' figures stand beside it, as measured
    assert sft_gate["hard_rule_share"] == 0.0 and sft_gate["oracle_hard_rule_share"] == 0.0
    assert 0.0 <= sft_gate["raw_hard_rule_share"] == sft_gate["repair_share"] <= 1.0  # each one repaired
    assert sft_gate["checks"]["hard_rule_share_over_oracle"] is True
    assert preset.bc_sft_gate.thresholds.max_repair_share == gate_file.REPAIR_BOUND  # make run's bounds it
    gate_file.check_gate(out / "bc_sft")  # the file GRPO's pre-flight accepted

    # GRPO ran its steps, its rewards are reported as measured, and its own gate was evaluated
    grpo = stages["grpo"]
    assert grpo["exit_code"] in (0, ExitCode.GRPO_GATE_FAILED)
    assert grpo["steps"] == 2 and len(grpo["reward_per_step"]) == 2
    assert all(math.isfinite(r) for r in grpo["reward_per_step"])
    content = gate_file.read_gate(out / "grpo")  # consistent: passed follows from its metrics
    assert content["stage"] == "grpo" and content["metrics"]["n"] == 2 * 6  # 2 seeds in each of six cells
    # written once, by the GRPO stage, with the thresholds the pipeline asked for
    assert content["thresholds"]["min_margin_over_slerp"] == -5.0
    assert "gate grpo:" in text and text.count("gate grpo:") == 1
    assert "hard_rule_share_over_oracle" in content["checks"]  # GRPO's gate keeps the bound
    assert math.isfinite(content["metrics"]["scaled_reward_mean"])
    assert stages["gate_grpo"]["passed"] is content["passed"] is True
    assert summary["exit_code"] == rc == 0
    # every gate passed: GRPO's gated model is registered, alias candidate, with the engine it ships with
    import mlflow

    client = mlflow.MlflowClient()
    version = client.get_model_version_by_alias(DEFAULT_MODEL_NAME, "candidate")
    assert version.run_id == grpo["mlflow_run_id"] and version.tags["staging_engine"] == ENGINE_VERSION
    assert f"{DEFAULT_MODEL_NAME} version {version.version}: candidate" in text

    # the evaluation compares both checkpoints with the baselines on the same held-out seeds
    results = json.loads((out / "evaluation.json").read_text())["results"]["task_easy"]
    assert list(results) == ["grpo", "bc_sft", "oracle", "uniform_slerp", "do_nothing"]
    for name in ("grpo", "bc_sft"):
        m = results[name]["model_metrics"]
        assert m["n"] == 6 and 0 <= m["strategy_accuracy"] <= 1
    assert results["bc_sft"]["model_metrics"]["parse_rate"] >= 0.5
    assert results["grpo"]["model_metrics"]["engine"] == ENGINE_VERSION
    for stage in ("tiny-model", "bc_sft", "gate_bc_sft", "grpo", "gate_grpo", "evaluate"):
        assert stage in text and stages[stage]["seconds"] is not None
    assert f"engine v{ENGINE_VERSION}: executed scaled_reward" in text


def test_presets_hold_a_config_object_per_stage():
    for name, preset in PRESETS.items():
        assert isinstance(preset, Preset) and preset.name == name
        assert isinstance(preset.bc_sft, SFTJobConfig) and isinstance(preset.grpo, GRPOJobConfig)
        # the shared values are the preset's, in every stage
        assert preset.bc_sft.model == preset.grpo.model == preset.model
        assert preset.grpo.task_id == preset.task_id and preset.grpo.preset == name
        assert preset.bc_sft.force_decay == preset.grpo.force_decay == preset.force_decay
    assert PRESETS["tiny-cpu"].bc_sft.lora_r == 0  # LoRA on a random base never learns the format
    assert PRESETS["qwen2.5-3b"].bc_sft.lora_r > 0 and PRESETS["qwen2.5-3b"].grpo.lora_r > 0
    assert apply_overrides(PRESETS["tiny-cpu"], {"grpo.steps": 3}).grpo.steps == 3
    assert PRESETS["tiny-cpu"].grpo.steps != 3  # the preset itself is untouched
    with pytest.raises(KeyError):
        apply_overrides(PRESETS["tiny-cpu"], {"grpo.stepz": 3})
    with pytest.raises(ConfigError):  # the config checks the new value
        apply_overrides(PRESETS["tiny-cpu"], {"grpo.num_generations": 1})


def test_pipeline_presets_set_rewards_weights_and_vllm_mode():
    cfg = apply_overrides(
        PRESETS["qwen2.5-3b"],
        {"grpo.rewards": ["format", "terminal"], "grpo.reward_weights.format": 2.0, "grpo.vllm_mode": "server",
         "grpo.use_vllm": True, "force_decay": True, "grpo_gate.thresholds.min_parse_rate": 0.5},
    )  # fmt: skip
    assert cfg.grpo.rewards == ["format", "terminal"] and cfg.grpo.weights == [2.0, 1.0]
    assert cfg.grpo.use_vllm and cfg.grpo.vllm_mode == "server"
    assert cfg.grpo.force_decay and cfg.bc_sft.force_decay  # a shared value reaches every stage
    assert cfg.grpo_gate.thresholds.min_parse_rate == 0.5
    assert cfg.grpo_gate.thresholds.min_margin_over_slerp == 0.0  # the others kept


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_means_the_same_run_under_grpo_bc_sft_and_pipeline(name):
    """``orthojob grpo --preset P`` and ``orthojob pipeline --preset P`` train GRPO with the same
    config; the pipeline only points it at its SFT checkpoint and its output folder."""
    parser = build_parser()
    train = config_from_args(parser.parse_args(["grpo", "--preset", name]))
    pipeline = PRESETS[name].grpo  # what the pipeline runs, before from_checkpoint/out/model path
    assert train == pipeline
    sft = sft_config_from_args(parser.parse_args(["bc-sft", "--preset", name]))
    assert sft == PRESETS[name].bc_sft


def test_tiny_cpu_grpo_is_the_make_run_recipe():
    """The values ``make run`` has always used, in the one table ``grpo --preset tiny-cpu`` reads too."""
    g = PRESETS["tiny-cpu"].grpo
    assert (g.steps, g.max_prompt_length, g.max_completion_length, g.gate_seeds) == (20, 1760, 512, 16)


def test_pipeline_cli_show_and_bad_override(capsys):
    assert cli_main(["pipeline", "--show", "--set", "grpo.steps=5"]) == 0
    assert json.loads(capsys.readouterr().out)["grpo"]["steps"] == 5
    assert cli_main(["pipeline", "--show", "--set", "nope.x=1"]) == 2
    capsys.readouterr()
    # --model, as bc-sft and grpo have it (docs/deploy.md, step 3b): the base of every stage
    assert cli_main(["pipeline", "--show", "--model", "s3://b/models/tiny"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["model"] == shown["bc_sft"]["model"] == shown["grpo"]["model"] == "s3://b/models/tiny"
    assert cli_main(["pipeline", "--show", "--model", "a/b", "--set", "model=c/d"]) == 2


def test_pipeline_cases_sets_every_training_stage_on_the_case_set(capsys):
    """`--cases` is every training stage's case set (each stage's own flag; their tests train on one:
    tests/test_stages.py, tests/test_case_set_stages.py)."""
    assert cli_main(["pipeline", "--show", "--cases", "s3://b/patients.jsonl"]) == 0
    shown = json.loads(capsys.readouterr().out)
    for section in ("format_sft", "tool_sft", "bc_sft", "grpo", "rsft"):
        assert shown[section]["cases"] == "s3://b/patients.jsonl", section
    assert cli_main(["pipeline", "--show", "--cases", "a.jsonl", "--set", "grpo.heldout_share=0.3"]) == 0
    assert json.loads(capsys.readouterr().out)["grpo"]["heldout_share"] == 0.3
