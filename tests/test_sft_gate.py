"""BC SFT (stage 2) and gates: TRL's SFTTrainer on the tiny model (full fine-tuning and LoRA), the gate
file (metrics, thresholds, digest over weight and config files, passed computed never assumed),
the pre-flight's refusal exit codes through the real CLI in a subprocess, and `orthojob gate` /
`orthojob evaluate --checkpoint` end to end on a tiny checkpoint."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orthojob.cli import main as cli_main
from orthojob.core.parsing import extract_plan, format_checks
from orthojob.core.prompts import TRAIN_SEED_START, build_messages, plan_to_completion, reset_observation
from orthojob.lifecycle import gate_file
from orthojob.lifecycle.gate_file import (
    GateError,
    GateThresholds,
    check_gate,
    gate_checks,
    read_gate,
    write_gate,
)
from orthojob.modeling import models
from orthojob.ops.exit_codes import ExitCode
from orthojob.stages.gate import window_identity
from orthojob.stages.presets import PRESETS, apply_overrides
from orthojob.stages.sft import SFTJobConfig, demonstrations, run_sft
from server.oracle import oracle_plan
from server.seed_ranges import GATES, gate_window_start

REPO = Path(__file__).resolve().parents[1]
PASSING = {"parse_rate": 1.0, "format_reward": 0.95, "scaled_reward_mean": 6.5, "margin_over_slerp": 0.1,
           "hard_rule_share": 0.0, "oracle_hard_rule_share": 0.0, "hard_rule_share_over_oracle": 0.0,
           "repair_share": 0.1}  # fmt: skip
FAILING = {"parse_rate": 0.2, "format_reward": 0.3, "scaled_reward_mean": -1.1, "margin_over_slerp": -7.5,
           "hard_rule_share": 0.1, "oracle_hard_rule_share": 0.0, "hard_rule_share_over_oracle": 0.1,
           "repair_share": 0.6}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    """The pipeline's tiny model (tokenizer trained on the project's prompts)."""
    return models.build_tiny(
        tmp_path_factory.mktemp("tiny") / "base", ["task_easy"], max_position_embeddings=2048
    )


def fake_checkpoint(folder: Path) -> Path:
    """A checkpoint-shaped folder (weights + config) for gate-file tests that need no model."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "qwen2"}')
    (folder / "model.safetensors").write_bytes(b"\x00weights\x01" * 100)
    (folder / "tokenizer.json").write_text("{}")
    return folder


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "orthojob.cli", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# --- demonstrations and SFTTrainer ------------------------------------------------------------


def test_demonstrations_are_the_oracles_plans_for_training_prompts():
    rows = demonstrations(6, ["task_easy", "task_hard"])
    assert [r["task_id"] for r in rows] == ["task_easy", "task_hard"] * 3
    assert [r["seed"] for r in rows[::2]] == [TRAIN_SEED_START + k for k in range(3)]
    for r in rows:
        obs = reset_observation(r["seed"], r["task_id"], False)
        assert r["prompt"] == build_messages(obs)
        (message,) = r["completion"]
        assert message["role"] == "assistant"
        assert message["content"] == plan_to_completion(oracle_plan(obs))
        assert format_checks(extract_plan(message["content"]))["total"] == 1.0


def test_sft_trainer_full_fine_tuning_on_the_tiny_model(tiny_base, tmp_path):
    out = tmp_path / "bc_sft"
    config = SFTJobConfig(model=str(tiny_base), out=str(out), examples=8, steps=3, batch_size=2, lr=5e-3,
                          lora_r=0, logging_steps=1)  # fmt: skip
    summary = run_sft(config)
    assert summary["steps"] == 3 and summary["examples"] == 8
    assert math.isfinite(summary["first_loss"]) and math.isfinite(summary["final_loss"])
    assert summary["parameters"]["trainable"] == summary["parameters"]["total"] > 100_000
    assert summary["device"] == "cpu" and summary["bf16"] is False
    for name in ("config.json", "model.safetensors", "tokenizer.json", "sft_log.json", "sft_config.json"):
        assert (out / name).is_file(), name
    assert not (out / "training_args.bin").exists()
    history = json.loads((out / "sft_log.json").read_text())["log_history"]
    assert [row["step"] for row in history if "loss" in row] == [1, 2, 3]
    # the trained weights differ from the base and the folder reloads for generation
    assert models.checkpoint_digest(out) != models.checkpoint_digest(tiny_base)
    model, tok = models.load_for_inference(out)
    assert not model.training and next(model.parameters()).device.type == "cpu"
    assert tok.apply_chat_template(build_messages(reset_observation(0, "task_easy", False)), tokenize=False)


def test_sft_trainer_lora_saves_an_adapter_that_reloads(tiny_base, tmp_path):
    out = tmp_path / "lora"
    run_sft(SFTJobConfig(model=str(tiny_base), out=str(out), examples=4, steps=2, batch_size=2, lora_r=4))
    assert (out / "adapter_config.json").is_file() and models.is_adapter(out)
    assert models.adapter_base(out) == str(tiny_base)
    model, _ = models.load_for_inference(out)  # merged onto its base
    assert not hasattr(model, "peft_config")
    policy, _ = models.load_policy(
        str(tiny_base), checkpoint=str(out), lora_r=4
    )  # GRPO continues the adapter
    assert models.count_parameters(policy)["trainable"] < models.count_parameters(policy)["total"]


# --- gate file ---------------------------------------------------------------------------------


def test_digest_covers_weights_and_config_only(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "c")
    digest = models.checkpoint_digest(ckpt)
    assert [p.name for p in models.checkpoint_files(ckpt)] == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    for name in ("gate_passed.json", "train_log.json", "training_args.bin", "MANIFEST.json"):
        (ckpt / name).write_text("x")
    assert models.checkpoint_digest(ckpt) == digest
    (ckpt / "config.json").write_text('{"model_type": "qwen2", "x": 1}')
    assert models.checkpoint_digest(ckpt) != digest
    empty = fake_checkpoint(tmp_path / "d")
    (empty / "model.safetensors").unlink()
    with pytest.raises(models.ModelError, match="no weight files"):
        models.checkpoint_digest(empty)


def test_gate_file_contents_and_digest(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "c")
    content = write_gate(ckpt, PASSING, GateThresholds(min_margin_over_slerp=0.0), stage="grpo")
    on_disk = json.loads((ckpt / gate_file.GATE_FILE).read_text())
    assert on_disk == content
    assert content["passed"] is True and content["stage"] == "grpo"
    assert content["metrics"] == PASSING
    assert content["thresholds"] == {"min_parse_rate": 0.9, "min_format_reward": 0.8, "min_margin_over_slerp": 0.0,
                                     "max_p_no_better_than_slerp": None, "min_margin_over_oracle": None, "max_hard_rule_share_over_oracle": None,
                                     "min_strategy_accuracy": None, "min_tool_call_rate": None,
                                     "min_finished_rate": None, "max_repair_share": None}  # fmt: skip
    assert content["checks"] == {"parse_rate": True, "format_reward": True, "margin_over_slerp": True}
    assert content["checkpoint_digest"] == models.checkpoint_digest(ckpt)
    assert content["digest_files"] == ["config.json", "model.safetensors", "tokenizer.json"]
    check_gate(ckpt)  # passes
    assert read_gate(ckpt)["passed"] is True


def test_a_failed_gate_never_says_passed(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "c")
    # a report claiming passed is recomputed from its metrics
    report = {"stage": "bc_sft", "metrics": FAILING, "passed": True, "checks": {"parse_rate": True}}
    content = write_gate(ckpt, report)
    assert content["passed"] is False
    assert content["checks"] == {
        "parse_rate": False,
        "format_reward": False,
        "hard_rule_share_over_oracle": False,
        "repair_share": False,
    }
    # NaN metrics fail, and no thresholds at all is no evidence of passing
    assert write_gate(ckpt, PASSING | {"parse_rate": float("nan")})["passed"] is False
    assert write_gate(ckpt, PASSING, GateThresholds(None, None))["passed"] is False
    with pytest.raises(ValueError):
        write_gate(ckpt, {})


@settings(max_examples=60, deadline=None)
@given(
    parse=st.floats(0, 1),
    fmt=st.floats(0, 1),
    margin=st.floats(-1, 1),
    over=st.floats(-1, 1),
    limits=st.tuples(
        st.floats(0, 1) | st.none(),
        st.floats(0, 1) | st.none(),
        st.floats(-1, 1) | st.none(),
        st.floats(0, 1) | st.none(),
    ),
)
def test_passed_is_exactly_every_threshold_met(tmp_path_factory, parse, fmt, margin, over, limits):
    """min_* thresholds are met from above, the hard-rule bound (max_*) from below."""
    metrics = {"parse_rate": parse, "format_reward": fmt, "margin_over_slerp": margin,
               "hard_rule_share_over_oracle": over}  # fmt: skip
    names = (
        "min_parse_rate",
        "min_format_reward",
        "min_margin_over_slerp",
        "max_hard_rule_share_over_oracle",
    )
    thresholds = GateThresholds(**dict(zip(names, limits)))
    expected = [v >= lim for v, lim in zip((parse, fmt, margin), limits[:3]) if lim is not None]
    expected += [over <= limits[3]] if limits[3] is not None else []
    checks = gate_checks(metrics, thresholds)
    assert list(checks.values()) == expected
    ckpt = fake_checkpoint(tmp_path_factory.mktemp("c"))
    assert write_gate(ckpt, metrics, thresholds)["passed"] is (bool(expected) and all(expected))


def test_check_gate_refusals_in_process(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "c")
    with pytest.raises(GateError) as e:
        check_gate(ckpt)
    assert e.value.exit_code == ExitCode.GATE_MISSING == 10
    with pytest.raises(GateError) as e:
        check_gate(tmp_path / "nowhere")
    assert e.value.exit_code == 10 and "does not exist" in e.value.message
    write_gate(ckpt, FAILING)
    with pytest.raises(GateError) as e:
        check_gate(ckpt)
    assert e.value.exit_code == ExitCode.GATE_FAILED == 12 and "parse_rate=0.200" in e.value.message
    write_gate(ckpt, PASSING)
    (ckpt / "model.safetensors").write_bytes(b"retrained")
    with pytest.raises(GateError) as e:
        check_gate(ckpt)
    assert e.value.exit_code == ExitCode.GATE_DIGEST_MISMATCH == 13


def _prepare(tmp_path: Path, case: str) -> Path:
    """A checkpoint whose gate triggers one refusal (or none)."""
    ckpt = fake_checkpoint(tmp_path / case)
    if case == "unparseable":
        (ckpt / gate_file.GATE_FILE).write_text('{"passed": tru')
    elif case == "edited":  # a failed gate whose "passed" was flipped by hand
        content = write_gate(ckpt, FAILING)
        (ckpt / gate_file.GATE_FILE).write_text(json.dumps(content | {"passed": True}))
    elif case == "failed":
        write_gate(ckpt, FAILING)
    elif case == "changed":
        write_gate(ckpt, PASSING)
        (ckpt / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 9}')
    elif case == "passed":
        write_gate(ckpt, PASSING)
    return ckpt


@pytest.mark.parametrize(
    ("case", "code", "hint"),
    [
        ("missing", 10, "orthojob gate --checkpoint"),
        ("unparseable", 11, "orthojob gate --checkpoint"),
        ("edited", 11, "edited"),
        ("failed", 12, "orthojob bc-sft"),
        ("changed", 13, "orthojob gate --checkpoint"),
    ],
)
def test_grpo_preflight_refusal_exit_codes_via_cli(tmp_path, case, code, hint):
    ckpt = _prepare(tmp_path, case)
    proc = run_cli("grpo", "--from-checkpoint", str(ckpt), "--test")
    assert proc.returncode == code, proc.stderr
    assert hint in proc.stderr and str(ckpt) in proc.stderr
    assert "TEST OK" not in proc.stdout  # refused before anything ran
    check = run_cli("gate", "--check", str(ckpt))
    assert check.returncode == code and hint in check.stderr


def test_grpo_preflight_accepts_a_passed_matching_gate_via_cli(tmp_path):
    ckpt = _prepare(tmp_path, "passed")
    proc = run_cli("grpo", "--from-checkpoint", str(ckpt), "--test")
    assert proc.returncode == 0, proc.stderr
    assert "SFT gate" in proc.stdout and "passed" in proc.stdout and "TEST OK" in proc.stdout
    assert run_cli("gate", "--check", str(ckpt)).returncode == 0


def test_a_gate_file_of_an_unknown_stage_is_refused_naming_the_stages(tmp_path):
    """A gate file whose stage is not one of gate_file.STAGES (here "sft0") is unreadable (exit 11), in the
    reader, the pre-flight and the CLI, and the error lists the stages (bc_sft among them)."""
    ckpt = fake_checkpoint(tmp_path / "old")
    content = write_gate(ckpt, PASSING)
    (ckpt / gate_file.GATE_FILE).write_text(json.dumps(content | {"stage": "sft0"}, indent=2))
    for check in (read_gate, check_gate):
        with pytest.raises(GateError) as e:
            check(ckpt)
        assert e.value.exit_code == ExitCode.GATE_UNREADABLE
        assert "'sft0' is not a stage" in e.value.message and "bc_sft" in e.value.message
    proc = run_cli("grpo", "--from-checkpoint", str(ckpt), "--test")
    assert proc.returncode == ExitCode.GATE_UNREADABLE and "bc_sft" in proc.stderr
    with pytest.raises(ValueError, match="unknown gate stage 'sft0'"):
        write_gate(ckpt, PASSING, stage="sft0")


def test_gate_stage_takes_the_stage_names_only(tmp_path, capsys):
    from orthojob.cli import build_parser

    assert build_parser().parse_args(["gate", "--check", str(tmp_path)]).stage == "bc_sft"
    assert build_parser().parse_args(["gate", "--stage", "grpo", "--check", str(tmp_path)]).stage == "grpo"
    for name in ("sft0", "sft1"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["gate", "--stage", name, "--check", str(tmp_path)])
        assert e.value.code == 2 and "bc_sft" in capsys.readouterr().err


def test_gate_cli_evaluates_and_records_a_failing_untrained_model(tiny_base, tmp_path, capsys):
    import shutil

    ckpt = Path(shutil.copytree(tiny_base, tmp_path / "untrained"))
    rc = cli_main(["gate", "--checkpoint", str(ckpt), "--seeds", "3", "--max-new-tokens", "24"])
    assert rc == ExitCode.GATE_FAILED
    content = json.loads((ckpt / gate_file.GATE_FILE).read_text())
    assert content["passed"] is False and content["stage"] == "bc_sft"
    m = content["metrics"]
    assert m["n"] == 3 * 6  # 3 seeds in each level under both dynamics
    assert m["parse_rate"] == 0.0 and m["scaled_reward_mean"] == -2.0  # no plan: the floor
    assert m["terminal_raw_mean"] == 0.0 and m["hard_rule_share"] == 0.0  # no plan breaks no rule
    # a random model rarely stops: most of its replies run to the token cap (which ones depends on
    # the vocabulary the tiny tokenizer was built on)
    assert m["truncated_rate"] >= 0.6 and 12 <= m["mean_completion_tokens"] <= 24
    assert 0 < m["uniform_slerp_scaled_reward_mean"] < m["oracle_scaled_reward_mean"] <= 8
    assert m["margin_over_slerp"] == pytest.approx(-2.0 - m["uniform_slerp_scaled_reward_mean"])
    assert 0 < m["uniform_slerp_terminal_raw_mean"] < m["oracle_terminal_raw_mean"] <= 1  # kept, secondary
    evaluation = content["evaluation"]  # the window drawn for this checkpoint, in the gates' range
    window = evaluation["window"]
    assert evaluation["n_seeds"] == 3 and window["n_cases"] == 3 * 6 and window["start"] in GATES
    assert evaluation["seed_start"] == window["start"] == gate_window_start(window_identity(ckpt), 3)
    assert "FAILED" in capsys.readouterr().out
    with pytest.raises(GateError) as e:
        check_gate(ckpt)
    assert e.value.exit_code == 12


def test_evaluate_checkpoint_cli_table_and_json(tiny_base, tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = cli_main(["evaluate", "--checkpoint", str(tiny_base), "--baselines", "--task-id", "task_easy",
                   "--seeds", "2", "--max-new-tokens", "16", "--out", str(out)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "checkpoint" in text and "uniform_slerp" in text and "parse_rate 0.000" in text
    report = json.loads(out.read_text())
    assert report["checkpoint"] == str(tiny_base)
    rows = report["results"]["task_easy"]
    assert set(rows) == {"checkpoint", "oracle", "uniform_slerp", "do_nothing"}
    assert rows["checkpoint"]["scaled_reward"]["mean"] == -2.0  # no plan: a failed episode
    assert rows["checkpoint"]["terminal_raw"]["mean"] == 0.0
    assert rows["checkpoint"]["model_metrics"]["parse_rate"] == 0.0
    assert rows["oracle"]["scaled_reward"]["mean"] > rows["uniform_slerp"]["scaled_reward"]["mean"]
    assert "scaled_reward" in text.splitlines()[1] and "terminal_raw" in text.splitlines()[1]
    assert cli_main(["evaluate"]) == 2


def test_gate_cli_judges_a_case_sets_heldout_patients(tiny_base, tmp_path, capsys):
    """`orthojob gate --cases` judges the held-out patients of an imported set, not generated seeds, and
    the gate file records which set and split (its digest) the verdict is of."""
    import shutil

    from orthojob.data import case_sets

    source = tmp_path / "patients.jsonl"
    case_sets.export("task_medium", range(5), False, source)
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    for k, row in enumerate(rows):  # imported: no generated key; two patients held out
        row.pop("task_id"), row.pop("seed")
        row["split"] = "heldout" if k < 2 else "train"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ckpt = Path(shutil.copytree(tiny_base, tmp_path / "untrained"))
    rc = cli_main(["gate", "--checkpoint", str(ckpt), "--cases", str(source), "--max-new-tokens", "8"])
    assert rc == ExitCode.GATE_FAILED
    content = json.loads((ckpt / gate_file.GATE_FILE).read_text())
    assert content["metrics"]["n"] == 2 and content["evaluation"]["task_ids"] == ["imported"]
    case_set = content["evaluation"]["case_set"]
    assert case_set["n_cases"] == 2 and case_set["source"] == str(source)
    split = case_sets.split_by_patient(case_sets.validate(str(source)))
    assert case_set["split_digest"] == split.digest
    assert "heldout 2 cases of 2 patients" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["None", "0.5", True, [0.5]])
def test_a_threshold_that_is_not_a_number_is_refused_before_any_stage_trains(value):
    """Every way a threshold arrives goes through the dataclass: a preset override, a replace, a
    gate file's thresholds. A string (e.g. ``None`` where JSON's ``null`` was meant) is refused there,
    naming the threshold, not by the gate comparing it after training."""
    with pytest.raises(ValueError, match="threshold min_parse_rate must be a number or null"):
        GateThresholds(min_parse_rate=value)
    with pytest.raises(ValueError, match="must be a number or null"):
        GateThresholds().replace(min_parse_rate=value)
    with pytest.raises(ValueError, match="must be a number or null"):
        apply_overrides(PRESETS["tiny-cpu"], {"grpo_gate.thresholds.min_parse_rate": value})
    assert apply_overrides(PRESETS["tiny-cpu"], {"grpo_gate.thresholds.min_parse_rate": None})
