"""GRPO stage: flags and presets, validation before any model load, --test, --analyze, and
integration runs in which TRL's GRPOTrainer itself calls the five project rewards (tiny model,
CPU): one process for 2 steps, and 2 processes (torchrun, gloo) for 2 steps with identical
weights on both ranks afterwards."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import pytest

from orthojob.core.prompts import plan_to_completion, reset_observation
from orthojob.eval.analysis import analyze, plan_metrics
from orthojob.modeling.models import device_info
from orthojob.ops.exit_codes import ExitCode
from orthojob.rewards.reward_functions import REWARD_FUNCS
from orthojob.stages import grpo, grpo_config, grpo_trainer
from orthojob.stages.grpo import add_train_arguments, config_from_args, run_train
from orthojob.stages.grpo_config import ConfigError, GRPOJobConfig, validate
from orthojob.stages.presets import PRESETS
from tests.services import run_process_group

REPO = Path(__file__).resolve().parents[1]
FIVE = tuple(REWARD_FUNCS)


def parse(argv: list[str]) -> argparse.Namespace:
    return add_train_arguments(argparse.ArgumentParser()).parse_args(argv)


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything tries to load a model."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(grpo_trainer.models, "load_policy", refuse)
    monkeypatch.setattr(grpo_trainer, "train", refuse)


# --- flags, presets, validation -------------------------------------------------------------


def test_level_weights_flag_reaches_the_config_and_is_checked():
    config = config_from_args(
        parse(["--mixed-cells", "--level-weight", "task_hard=2", "--level-weight", "task_easy=0"])
    )
    assert config.level_weights == {"task_hard": 2.0, "task_easy": 0.0}
    with pytest.raises(ConfigError, match="add --mixed-cells"):
        config_from_args(parse(["--level-weight", "task_hard=2"]))
    with pytest.raises(ConfigError, match="unknown task level 'hard'"):
        config_from_args(parse(["--mixed-cells", "--level-weight", "hard=2"]))


def test_train_flags_and_preset_overrides():
    args = parse(["--preset", "tiny-cpu", "--steps", "3", "--force-decay", "--reward-weight", "format=2"])
    config = config_from_args(args)
    assert config.steps == 3  # explicit flag beats the preset
    assert config.model == PRESETS["tiny-cpu"].model and config.lora_r == 0  # from the preset
    assert config.force_decay and config.reward_weights == {"format": 2.0}
    assert config_from_args(parse([])) == GRPOJobConfig()
    qwen = config_from_args(parse(["--preset", "qwen2.5-3b"]))
    assert qwen.lora_r == 16 and qwen.num_generations == 8
    flags = ["--model", "m", "--steps", "1", "--num-generations", "2", "--batch-size", "2", "--lr", "1e-5",
                  "--lora-r", "8", "--max-prompt-length", "10", "--max-completion-length", "10",
                  "--max-seq-length", "20", "--out", "o", "--task-id", "task_hard", "--force-decay", "--use-vllm",
                  "--from-checkpoint", "c", "--skip-sft-gate", "--test", "--analyze"]  # fmt: skip
    config = config_from_args(parse(flags))
    assert (config.model, config.steps, config.lora_r, config.task_id) == ("m", 1, 8, "task_hard")
    assert config.use_vllm and config.skip_sft_gate and config.test and config.analyze
    for preset in PRESETS:
        validate(config_from_args({"preset": preset}), n_processes=1, cuda=False)


def test_unsplittable_batch_is_refused_before_any_model_load(no_model_load, capsys):
    rc = run_train(parse(["--batch-size", "2", "--num-generations", "4", "--skip-sft-gate"]))
    err = capsys.readouterr().err
    assert rc == ExitCode.USAGE
    assert "--batch-size (2)" in err and "--num-generations (4)" in err and "--grad-accum" in err


def test_divisibility_counts_grad_accum_and_processes():
    config = GRPOJobConfig(batch_size=2, num_generations=4, grad_accum=2)
    validate(config, n_processes=1, cuda=False)  # 2 x 2 = 4
    validate(GRPOJobConfig(batch_size=2, num_generations=4), n_processes=2, cuda=False)  # 2 x 2 procs
    with pytest.raises(ConfigError, match="processes \\(3\\)"):
        validate(GRPOJobConfig(batch_size=2, num_generations=4), n_processes=3, cuda=False)
    with pytest.raises(ConfigError, match="--num-generations must be >= 2"):
        validate(GRPOJobConfig(batch_size=4, num_generations=1), n_processes=1, cuda=False)


def test_other_bad_configs_are_named():
    with pytest.raises(ConfigError, match="--max-seq-length"):
        validate(
            GRPOJobConfig(max_prompt_length=2000, max_completion_length=512, max_seq_length=2048), 1, False
        )
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        validate(GRPOJobConfig(use_vllm=True), 1, cuda=False)
    with pytest.raises(ConfigError, match="reward"):
        validate(GRPOJobConfig(reward_weights={"nonsense": 1.0}), 1, False)
    with pytest.raises(ConfigError, match="reward"):
        validate(GRPOJobConfig(rewards=["format"], reward_weights={"terminal": 1.0}), 1, False)
    with pytest.raises(ConfigError, match="--strategy-advantage must be one of sequence, centred"):
        GRPOJobConfig(strategy_advantage="per-token")
    with pytest.raises(ConfigError, match="--strategy-advantage-scale"):
        GRPOJobConfig(strategy_advantage="centred", strategy_advantage_scale=0.0)
    with pytest.raises(ConfigError, match="--mode oneshot"):
        GRPOJobConfig(strategy_advantage="centred", mode="agentic")


def test_cpu_training_arguments_have_no_bf16(tmp_path):
    config = config_from_args({"preset": "tiny-cpu", "out": str(tmp_path)})
    args, funcs = grpo_config.build_grpo_args(config, {"cuda": False, "bf16": False}, 1)
    assert not args.bf16 and not args.fp16 and args.use_cpu
    assert [f.__name__ for f in funcs] == list(FIVE) and args.reward_weights == [1.0] * 5
    assert args.report_to in ("none", [], ["none"]) and args.logging_steps == 1 and not args.use_vllm
    info = device_info()
    assert info["bf16"] is False or info["cuda"]  # bf16 only where a GPU has it


# --- --test and the SFT gate pre-flight ------------------------------------------------------


def test_smoke_runs_every_reward_on_real_plans_without_a_model(no_model_load, capsys):
    rc = run_train(parse(["--test", "--skip-sft-gate", "--task-id", "task_medium"]))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "TEST OK" in out and "oracle@" in out and "garbage@" in out
    for name in FIVE:
        assert name in out
    assert "active reward funcs" in out


def test_missing_sft_gate_refuses_to_start(no_model_load, tmp_path, capsys):
    from orthojob.lifecycle.gate_file import GateError, check_gate

    with pytest.raises(GateError) as info:
        check_gate(str(tmp_path))
    rc = run_train(parse(["--test", "--from-checkpoint", str(tmp_path)]))
    assert rc == info.value.exit_code != 0
    assert capsys.readouterr().err.strip()


def test_sft_gate_preflight_passes_and_fails_on_the_gate_file(no_model_load, tiny_model, tmp_path, capsys):
    import shutil

    from orthojob.lifecycle.gate_file import write_gate

    checkpoint = tmp_path / "bc_sft"
    shutil.copytree(tiny_model, checkpoint)
    good = {
        "parse_rate": 1.0,
        "format_reward": 1.0,
        "hard_rule_share_over_oracle": 0.0,
        "repair_share": 0.0,
    }  # an evaluation's metrics
    write_gate(checkpoint, good, stage="bc_sft")
    assert run_train(parse(["--test", "--from-checkpoint", str(checkpoint)])) == 0
    assert "SFT gate of" in capsys.readouterr().out
    write_gate(checkpoint, {"parse_rate": 0.1, "format_reward": 0.2}, stage="bc_sft")
    assert run_train(parse(["--test", "--from-checkpoint", str(checkpoint)])) == ExitCode.GATE_FAILED
    assert "failed its bc_sft gate" in capsys.readouterr().err
    # a gate file of a stage that is not one ("stage": "sft0") is refused, naming the stages
    content = write_gate(checkpoint, good)
    (checkpoint / "gate_passed.json").write_text(json.dumps(content | {"stage": "sft0"}))
    assert run_train(parse(["--test", "--from-checkpoint", str(checkpoint)])) == ExitCode.GATE_UNREADABLE
    assert "'sft0' is not a stage" in capsys.readouterr().err
    write_gate(checkpoint, good)
    # --skip-sft-gate bypasses the pre-flight (with a warning)
    assert run_train(parse(["--test", "--from-checkpoint", str(checkpoint), "--skip-sft-gate"])) == 0
    assert "WARNING" in capsys.readouterr().out


# --- --analyze --------------------------------------------------------------------------------


def _record(step: int, seed: int, plan: dict | str, decay: bool = False) -> dict:
    text = plan if isinstance(plan, str) else plan_to_completion(plan)
    return {"step": step, "seed": seed, "task_id": "task_medium", "force_decay": decay, "completion": text,
            "rewards": {"reward_format": 1.0 if step > 5 else 0.5}, "advantage": 0.0}  # fmt: skip


def test_analyze_reports_the_four_metrics_early_vs_late(tmp_path, capsys):
    from server.oracle import oracle_plan

    fast_front = {"strategy": "anterior_first", "tooth_groups": [
        {"teeth": [11, 12, 13, 21, 22, 23, 31, 32, 33, 41, 42, 43], "fraction": 0.5, "priority": "high"},
        {"teeth": [16, 17, 26, 27, 36, 37, 46, 47], "fraction": 0.1, "priority": "low"}]}  # fmt: skip
    records = []
    for step in range(1, 11):
        for seed in (0, 1):
            plan = (
                fast_front
                if step <= 5
                else oracle_plan(reset_observation(seed, "task_medium", step % 2 == 0))
            )
            records.append(_record(step, seed, plan, decay=step % 2 == 0))
        records.append(_record(step, 0, "no plan here"))
    path = tmp_path / "completions.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")

    result = analyze(path)
    early, late = result["early"], result["late"]
    assert early["steps"] == [1, 2] and late["steps"] == [9, 10]
    assert (early["completions"], early["parsed"]) == (6, 4)
    assert early["molar_start_stage"] == 13.0  # all eight molars in the low-priority group
    assert early["staging_correlation"] == pytest.approx(1.0)
    assert early["max_stage_delta_mm"] > late["max_stage_delta_mm"]  # fraction 0.5 vs the oracle
    for window in (early, late):
        for metric in (
            "staging_correlation",
            "max_stage_delta_mm",
            "molar_start_stage",
            "anterior_recovery_speed",
        ):
            assert math.isfinite(window[metric]), metric
    table = capsys.readouterr().out
    assert "anterior_recovery_speed" in table and "mean reward_format" in table

    capsys.readouterr()
    assert run_train(parse(["--analyze", "--out", str(tmp_path)])) == 0
    assert "staging_correlation" in capsys.readouterr().out
    assert run_train(parse(["--analyze", "--out", str(tmp_path / "nowhere")])) == ExitCode.USAGE


def test_analysis_metric_definitions_on_a_known_plan():
    # Anteriors at fraction 0.5 close in 2 stages (speed 1/2); the rest follow uniform SLERP and are
    # within 5 % of their target at stage 23 (speed 1/23): ratio 11.5 without force decay.
    plan = {"strategy": "anterior_first", "tooth_groups": [
        {"teeth": [11, 12, 13, 21, 22, 23, 31, 32, 33, 41, 42, 43], "fraction": 0.5, "priority": "high"},
        {"teeth": [16, 17], "fraction": 0.0, "priority": "medium"},
        {"teeth": [26, 27], "fraction": 0.2, "priority": "low"}]}  # fmt: skip
    (m,) = plan_metrics([plan], [("task_hard", 3, False)])
    assert m["molar_start_stage"] == pytest.approx((2 * 25 + 2 * 13 + 4 * 1) / 8)
    assert 0.0 < m["staging_correlation"] < 1.0  # fraction 0 leaves the medium group unmoved: after low
    assert m["max_stage_delta_mm"] > 0.25
    # 16/17 never move and 26/27 move faster than SLERP, so compare with a plan without them
    (u,) = plan_metrics([{"tooth_groups": plan["tooth_groups"][:1]}], [("task_hard", 3, False)])
    assert u["anterior_recovery_speed"] == pytest.approx(11.5, rel=1e-6)
    assert math.isnan(u["staging_correlation"])  # a single priority level: undefined


# --- TRL integration ---------------------------------------------------------------------------


def _tiny_config(model: Path, out: Path, **overrides) -> GRPOJobConfig:
    values = {"preset": "tiny-cpu", "model": str(model), "steps": 2, "max_completion_length": 32,
              "out": str(out), "gate_seeds": 2, "skip_sft_gate": True} | overrides  # fmt: skip
    return config_from_args(values)


def test_grpo_trainer_calls_the_five_rewards(tiny_model, tmp_path):
    config = _tiny_config(tiny_model, tmp_path / "grpo")
    validate(config)
    result = grpo.train_and_gate(config)

    steps = [row for row in result.trainer.state.log_history if "reward" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        for name in FIVE:
            for stat in ("mean", "std"):
                value = row[f"rewards/{name}/{stat}"]
                assert value is not None and math.isfinite(value), (name, stat, value)
        assert math.isfinite(row["loss"]) and math.isfinite(row["reward"])

    out = Path(config.out)
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 2 * config.batch_size and {r["step"] for r in records} == {1, 2}
    # The logged rewards are what the project's functions give for the logged completions and cases.
    columns = {k: [r[k] for r in records] for k in ("seed", "task_id", "force_decay")}
    for name, func in REWARD_FUNCS.items():
        expected = func([r["completion"] for r in records], **columns)
        assert [r["rewards"][name] for r in records] == pytest.approx(expected), name
    assert json.loads((out / "train_log.json").read_text())[0]["step"] == 1
    assert (out / "config.json").exists() or (out / "adapter_config.json").exists()
    # The GRPO gate: written by the held-out evaluation of the saved checkpoint, passed computed.
    from orthojob.lifecycle.gate_file import GATE_FILE, gate_checks

    gate = json.loads((out / GATE_FILE).read_text())
    assert gate["stage"] == "grpo" and gate["evaluation"]["n_seeds"] == config.gate_seeds
    assert (
        gate["passed"]
        is result.gate_passed
        is (all(gate_checks(gate["metrics"], gate["thresholds"]).values()))
    )
    assert "margin_over_slerp" in gate["checks"]


def test_group_std_is_the_mean_within_group_std():
    nan = math.nan
    assert grpo_trainer.group_std([0.0, 2.0, 5.0, 5.0], 2) == pytest.approx(math.sqrt(2) / 2)
    assert grpo_trainer.group_std([1.0, nan, 3.0, 5.0], 2) == pytest.approx(math.sqrt(2))  # NaN-aware
    assert math.isnan(grpo_trainer.group_std([nan, 1.0, nan, 2.0], 2))  # no group with two values


TRL_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "completions/mean_length",
            "completions/clipped_ratio", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
            "loss", "grad_norm", "learning_rate")  # fmt: skip
"""What TRL 1.16's GRPOTrainer logs per step (``kl`` only with beta > 0) and the stage run must receive."""


def test_mlflow_run_gets_the_completion_table_and_the_grpo_diagnostics(tiny_model, tmp_path, monkeypatch):
    """A 2-step GRPO run in an MLflow run (sqlite store): TRL's metric keys, each reward's within-group
    std and the reward time share are metrics of the run, and the table completions.json holds one row
    per recorded completion (2 groups of 2 per step, capped to 3 rows: the first whole group), with
    TRL's group-normalised advantages and the canaries."""
    import numpy as np
    from mlflow.tracking import MlflowClient

    from orthojob.ops import tracking
    from orthojob.rewards.canaries import CANARIES

    monkeypatch.chdir(tmp_path)  # the sqlite store keeps the experiment's artifacts beside the database
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    config = _tiny_config(
        tiny_model, tmp_path / "grpo", num_generations=2, beta=0.04, completions_table_rows=3, lr=1e-3
    )
    validate(config)
    with tracking.stage_run("grpo", experiment="grpo-diagnostics") as run:
        result = grpo_trainer.train(config)
    assert result.trainer.state.global_step == 2 and 0 < result.reward_seconds < sum(result.step_times)

    client = MlflowClient()
    names = [f"rewards/{n}/{stat}" for n in FIVE for stat in ("mean", "std", "group_std")]
    for key in (*TRL_KEYS, *names, "reward_time_share", "env/parse_rate"):
        history = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in history] == [1, 2], key
        assert all(math.isfinite(m.value) for m in history), key
    for m in client.get_metric_history(run.info.run_id, "reward_time_share"):
        assert 0.0 < m.value < 1.0

    table = client.load_table(run.info.experiment_id, "completions.json", run_ids=[run.info.run_id])
    records = [json.loads(line) for line in (Path(config.out) / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 4
    columns = {"step", "group", "task_id", "seed", "force_decay", "completion", *FIVE, "reward", "advantage",
               "scaled_reward", "strategy_accuracy", "parse", *CANARIES, "strategy", "broken_rules",
               "degenerate_form"}  # fmt: skip
    assert columns <= set(table.columns)
    assert len(table) == 2 * 2 and sorted(table["step"]) == [1, 1, 2, 2] and set(table["group"]) == {0}
    for step in (1, 2):
        rows = table[table["step"] == step]
        first_group = [r for r in records if r["step"] == step][:2]
        assert list(rows["completion"]) == [r["completion"] for r in first_group]
        assert list(rows["seed"]) == [r["seed"] for r in first_group] and len(set(rows["seed"])) == 1
        for name in FIVE:
            assert list(rows[name]) == pytest.approx([r["rewards"][name] for r in first_group])
        # TRL's advantage (scale_rewards "group"): (reward - group mean) / (group std + 1e-4), summing to 0
        total = np.asarray(rows["reward"], dtype=float)
        expected = (total - total.mean()) / (total.std(ddof=1) + 1e-4)
        assert np.asarray(rows["advantage"], dtype=float) == pytest.approx(expected, abs=1e-3)
        assert abs(float(rows["advantage"].sum())) < 1e-3
        assert set(rows["parse"]) <= {0.0, 1.0}


def test_learning_grpo_runs_through_the_job_trainer(tiny_model, tmp_path):
    """experiments.learning.experiment's GRPO stage: the job's trainer, the evaluation callback every step, the reward
    time share, prompts of every cell and a constant learning rate."""
    from experiments.learning import evaluation as learning_eval
    from experiments.learning import experiment as learning

    cfg = learning.LearnConfig(out=str(tmp_path), steps=2, stage0_steps=2, num_generations=2, prompts_per_step=1, num_prompts=2,
                               max_completion_length=24, eval_every=1, eval_seeds=1, lr=1e-3)  # fmt: skip
    evals, saves = [], []
    cases = learning_eval.heldout_cases(1, [("task_easy", False)])
    report = learning.run_grpo(cfg, tiny_model, cases, evals, lambda: saves.append(1))
    assert report["steps_done"] == 2 and [e["step"] for e in evals] == [1, 2] and len(saves) == 2
    assert 0 < report["reward_share_of_step"] < 1 and report["grpo_seconds"] > 0
    rows = [r for r in report["log_history"] if "reward" in r]
    assert [r["learning_rate"] for r in rows] == [cfg.lr, cfg.lr]
    assert all(0 < r["reward_time_share"] < 1 for r in rows)
    # the experiment's centred strategy advantage ran (token-level advantages through TRL's loss)
    assert cfg.strategy_advantage == "counterfactual" and all(
        0 <= r["strategy_advantage/named"] <= 1 for r in rows
    )
    records = [
        json.loads(x) for x in (tmp_path / "grpo_stage0" / "completions.jsonl").read_text().splitlines()
    ]
    assert {r["seed"] for r in records} <= {learning.GRPO_PROMPT_SEED_START + i for i in range(2)}
    # the prompts take turns over the cells: the first two are task_easy, ideal then force decay
    assert {(r["task_id"], r["force_decay"]) for r in records} <= {("task_easy", False), ("task_easy", True)}


def test_ddp_two_processes(tiny_model, tmp_path):
    import shutil

    shutil.copytree(tiny_model, tmp_path / "tiny")
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath, TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tests" / "ddp_grpo_worker.py"), str(tmp_path)]  # fmt: skip
    run = run_process_group(cmd, env, REPO, 240, "2-process GRPO")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in reports] == [0, 1]
    for r in reports:
        assert r["world_size"] == 2 and r["accelerate_processes"] == 2 and r["global_step"] == 2
        assert "MULTI_CPU" in r["distributed_type"]
        assert r["process_group_threads"] == []  # ended before exit (process_group.end_process_group)
    assert reports[0]["digest"] == reports[1]["digest"]
    assert reports[0]["digest"] != reports[0]["initial_digest"]  # the weights did move
    assert reports[0]["reward_names"][:5] == list(FIVE)
    # Rank 0 recorded the gathered batch of both ranks: 2 prompt groups per step.
    records = [json.loads(x) for x in (tmp_path / "out" / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 8
    for step in (1, 2):
        assert len({r["seed"] for r in records if r["step"] == step}) == 2
    assert not (tmp_path / "out" / "completions.jsonl.1").exists()


def test_a_checkpoint_of_another_config_is_refused_before_any_model_load(
    no_model_load, tmp_path, monkeypatch, capsys
):
    """Run identity: --out holding a checkpoint of another config exits 14 naming what differs;
    --on-foreign-checkpoint fresh trains from the start instead (here: reaches the trainer)."""
    from orthojob.ops.exit_codes import ExitCode
    from orthojob.ops.run_identity import write_identity

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    argv = ["--preset", "tiny-cpu", "--skip-sft-gate", "--out", str(out)]
    checkpoint = out / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    write_identity(checkpoint, dataclasses.replace(config_from_args(parse(argv)), steps=300).to_dict())

    assert run_train(parse(argv)) == ExitCode.RUN_MISMATCH
    assert "steps" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="a model was loaded"):
        run_train(parse([*argv, "--on-foreign-checkpoint", "fresh"]))


def _case_set(path: Path, n: int, heldout: int) -> Path:
    """``n`` task_easy cases as an imported set (no generated keys), the first ``heldout`` held out."""
    from orthojob.data import case_sets

    case_sets.export("task_easy", range(n), False, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for k, row in enumerate(rows):
        row.pop("task_id"), row.pop("seed")
        row["split"] = "heldout" if k < heldout else "train"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_grpo_trains_on_a_case_sets_training_patients_and_gates_on_its_heldout_ones(tiny_model, tmp_path):
    from orthojob.data import case_sets

    source = _case_set(tmp_path / "patients.jsonl", 6, 2)
    config = _tiny_config(tiny_model, tmp_path / "grpo", cases=str(source))
    validate(config)
    grpo.train_and_gate(config)
    loaded = case_sets.load_case_set(str(source))
    train_seeds = {k.seed for k in loaded.train}
    records = [
        json.loads(line) for line in (tmp_path / "grpo" / "completions.jsonl").read_text().splitlines()
    ]
    assert records and {r["task_id"] for r in records} == {"imported"}
    assert {r["seed"] for r in records} <= train_seeds  # no held-out patient is trained on
    assert {k.seed for k in loaded.heldout}.isdisjoint(train_seeds)
    rows = loaded.rows("train")
    assert [r["case_id"] for r in rows] == [loaded.validation.case_ids[k] for k in loaded.split.train]
    from orthojob.lifecycle.gate_file import GATE_FILE

    gate = json.loads((tmp_path / "grpo" / GATE_FILE).read_text())
    assert gate["evaluation"]["task_ids"] == ["imported"] and gate["metrics"]["n"] == 2
    assert gate["evaluation"]["case_set"]["split_digest"] == loaded.split.digest


def test_a_bad_case_set_is_refused_before_any_model_load(no_model_load, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "orthorl-case/1", "case_id": "a"}\n')
    assert run_train(parse(["--test", "--skip-sft-gate", "--cases", str(bad)])) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert "--cases" in err and "patient_id must be a non-empty string" in err
    assert run_train(parse(["--skip-sft-gate", "--cases", str(bad), "--mode", "agentic"])) == ExitCode.USAGE
    assert "--mode oneshot" in capsys.readouterr().err


@pytest.mark.parametrize("sampler", ["shared-prefix", "generate"])
def test_grpo_samples_with_the_configured_sampler(tiny_model, tmp_path, monkeypatch, sampler):
    from orthojob.modeling import sampling

    calls = []
    real = sampling.sample_completions

    def counted(model, prompt_ids, **kwargs):
        calls.append(len(prompt_ids))
        return real(model, prompt_ids, **kwargs)

    monkeypatch.setattr(sampling, "sample_completions", counted)
    config = _tiny_config(tiny_model, tmp_path / "grpo", steps=1, sampler=sampler)
    result = grpo_trainer.train(config)
    assert calls == ([config.batch_size] if sampler == "shared-prefix" else [])
    records = [json.loads(line) for line in (Path(config.out) / "completions.jsonl").read_text().splitlines()]
    assert len(records) == config.batch_size
    assert [row["step"] for row in result.trainer.state.log_history if "reward" in row] == [1]
