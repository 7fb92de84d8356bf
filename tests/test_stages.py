"""The training stages as stage commands: format SFT (stage 0), BC SFT (stage 2) and RSFT
(stage 4), each with its CLI, MLflow stage run and gate file; GRPO's pre-flight accepting a format
gate; the pipeline preset choosing the stages; RSFT's keep rule, on real environment scores."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orthojob.cli import build_parser
from orthojob.cli import main as cli_main
from orthojob.core.prompts import plan_to_completion
from orthojob.eval.evaluation import DO_NOTHING_PLAN, UNIFORM_SLERP_PLAN
from orthojob.lifecycle import gate_file
from orthojob.modeling import models
from orthojob.ops.exit_codes import ExitCode
from orthojob.stages import gate, rsft
from orthojob.stages.grpo_config import ConfigError
from orthojob.stages.presets import PIPELINE_STAGES, PRESETS, apply_overrides
from orthojob.stages.rsft import KeepRule, select
from orthojob.stages.rsft_config import RSFT_SAMPLES_FILE, RSFTConfig
from orthojob.stages.sft import SECTIONS, config_from_args, run_sft
from orthojob.stages.sft_config import FormatSFTConfig, SFTJobConfig
from server.dental_constants import TOOTH_IDS
from server.oracle import oracle_plan

# held-out gate runs that any model passes: the tests check the plumbing, not what 2 steps learn
GATE_FLAGS = [
    "--gate-seeds",
    "2",
    "--gate-max-new-tokens",
    "16",
    "--min-parse-rate",
    "0",
    "--min-format-reward",
    "0",
]
TRAIN_FLAGS = ["--lora-r", "0", "--steps", "2", "--batch-size", "2", "--examples", "4"]


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    return models.build_tiny(
        tmp_path_factory.mktemp("tiny") / "base", ["task_easy"], max_position_embeddings=2048
    )


def stage_runs(stage: str) -> list:
    import mlflow

    return mlflow.search_runs(
        search_all_experiments=True, filter_string=f"tags.`orthorl.stage` = '{stage}'", output_format="list"
    )


# --- configs, presets ----------------------------------------------------------------------------


def test_stage_names_and_default_folders_follow_training_order():
    # one list of stage names (gate_file.STAGES), in training order; the pipeline's stages are those names
    assert gate_file.STAGES == ("format_sft", "tool_sft", "bc_sft", "grpo", "rsft")
    assert PIPELINE_STAGES == gate_file.STAGES
    assert set(gate_file.DEFAULT_THRESHOLDS) == set(gate_file.STAGES)
    # the stand-alone commands' default --out: ./checkpoints/<key>
    parser = build_parser()
    outs = {
        command: config_from_args(parser.parse_args([command]), section).out
        for command, section in (("format-sft", "format_sft"), ("tool-sft", "tool_sft"), ("bc-sft", "bc_sft"),
                                 ("rsft", "rsft"))
    }  # fmt: skip
    assert outs == {
        "format-sft": "./checkpoints/format_sft",
        "tool-sft": "./checkpoints/tool_sft",
        "bc-sft": "./checkpoints/bc_sft",
        "rsft": "./checkpoints/rsft",
    }


class _TrainedError(Exception):
    """run_sft was reached (the command did not refuse its output folder)."""


def test_a_default_out_never_overwrites_another_stages_checkpoint(tmp_path, monkeypatch, capsys):
    """./checkpoints/format_sft is format SFT's default folder: format-sft without --out refuses a BC
    checkpoint there (ungated, or with its bc_sft gate file); --out overrides."""
    import orthojob.stages.sft

    def trained(config):
        raise _TrainedError(config.out)

    def command(*argv: str) -> int:
        """The command itself, outside an MLflow stage run (the CLI tests below count those)."""
        args = build_parser().parse_args(list(argv))
        return args.func(args)

    monkeypatch.setattr(orthojob.stages.sft, "run_sft", trained)
    monkeypatch.chdir(tmp_path)
    old_bc = tmp_path / "checkpoints" / "format_sft"
    old_bc.mkdir(parents=True)
    (old_bc / "sft_config.json").write_text(json.dumps({"demos": "oracle"}))  # an earlier bc-sft --no-gate
    assert command("format-sft", "--model", "tiny", "--lora-r", "0") == ExitCode.USAGE
    err = capsys.readouterr().err
    assert "./checkpoints/format_sft" in err and "oracle demonstrations" in err and "--out" in err
    # a bc-sft gate file there names its stage
    (old_bc / "config.json").write_text("{}")
    (old_bc / "model.safetensors").write_bytes(b"weights")
    content = gate_file.write_gate(
        old_bc,
        {"parse_rate": 1.0, "format_reward": 1.0, "hard_rule_share_over_oracle": 0.0, "repair_share": 0.0},
    )
    assert content["stage"] == "bc_sft"
    assert command("format-sft", "--model", "tiny", "--lora-r", "0") == ExitCode.USAGE
    assert "stage bc_sft" in capsys.readouterr().err
    with pytest.raises(_TrainedError, match="checkpoints/format_sft"):  # asked for by name: overwritten
        command("format-sft", "--model", "tiny", "--lora-r", "0", "--out", "./checkpoints/format_sft")
    # a stage's own folder is no other stage's: BC retrains into ./checkpoints/bc_sft over its gate
    shutil.copytree(old_bc, tmp_path / "checkpoints" / "bc_sft")
    with pytest.raises(_TrainedError, match="checkpoints/bc_sft"):
        command("bc-sft", "--model", "tiny", "--lora-r", "0")


def test_stage_configs_flags_and_presets():
    parser = build_parser()
    fmt = config_from_args(
        parser.parse_args(["format-sft", "--preset", "tiny-cpu", "--demo-seed", "3"]), "format_sft"
    )
    assert isinstance(fmt, FormatSFTConfig) and fmt.demos == "format" and fmt.demo_seed == 3
    assert fmt.steps == PRESETS["tiny-cpu"].format_sft.steps
    bc = config_from_args(parser.parse_args(["bc-sft", "--preset", "tiny-cpu"]), "bc_sft")
    assert type(bc) is SFTJobConfig and bc == PRESETS["tiny-cpu"].bc_sft and bc.demos == "oracle"
    r = config_from_args(
        parser.parse_args(["rsft", "--preset", "tiny-cpu", "--samples-per-prompt", "6"]), "rsft"
    )
    assert isinstance(r, RSFTConfig) and r.samples_per_prompt == 6 and r.demos == "rsft"
    assert set(SECTIONS) == {"format_sft", "tool_sft", "bc_sft", "rsft"}
    for name, preset in PRESETS.items():  # the shared values reach the new stages too
        assert preset.format_sft.model == preset.rsft.model == preset.model, name
        assert preset.stages == ("bc_sft", "grpo")  # make run's chain, unchanged
    with pytest.raises(ConfigError):
        RSFTConfig(samples_per_prompt=2, keep_per_prompt=3)
    with pytest.raises(ConfigError):
        FormatSFTConfig(demos="oracle")
    # the stages a pipeline runs: --set stages=..., checked
    tiny = PRESETS["tiny-cpu"]
    assert apply_overrides(tiny, {"stages": "format_sft,grpo"}).stages == ("format_sft", "grpo")
    full_chain = apply_overrides(tiny, {"stages": ["format_sft", "bc_sft", "grpo", "rsft"]})
    assert full_chain.stages == ("format_sft", "bc_sft", "grpo", "rsft")
    for bad in ("grpo", "format_sft,format_sft", "format_sft,dpo", ""):
        with pytest.raises(ConfigError):
            apply_overrides(PRESETS["tiny-cpu"], {"stages": bad})
    assert cli_main(["pipeline", "--show", "--set", "stages=rsft,grpo"]) == ExitCode.USAGE


def test_a_chain_with_tool_use_sft_trains_grpo_in_agentic_mode():
    """Stage 1 in a preset's chain: format -> tool_sft -> agentic GRPO (whose pre-flight accepts the
    tool_sft gate: tests/test_tool_sft.py); tool-use SFT may start the chain; a one-shot GRPO after it
    is refused, whatever order the overrides come in."""
    tiny = PRESETS["tiny-cpu"]
    agentic = {"stages": "format_sft,tool_sft,grpo", "grpo.mode": "agentic"}
    for overrides in (agentic, dict(reversed(agentic.items()))):
        chain = apply_overrides(tiny, overrides)
        assert chain.stages == ("format_sft", "tool_sft", "grpo")
        assert chain.grpo.mode == "agentic" and chain.tool_sft.demos == "tool"
    no_grpo = ("tool_sft", "bc_sft")  # no GRPO: no mode needed
    assert apply_overrides(tiny, {"stages": ",".join(no_grpo)}).stages == no_grpo
    assert tiny.tool_sft.max_length == 8192 and tiny.tool_sft.steps == tiny.bc_sft.steps
    for stages in ("format_sft,tool_sft,grpo", "tool_sft,grpo,rsft"):
        with pytest.raises(ConfigError, match=r"grpo\.mode=agentic"):
            apply_overrides(tiny, {"stages": stages})
    shown = ["pipeline", "--show", "--set", "stages=format_sft,tool_sft,grpo"]
    assert cli_main(shown) == ExitCode.USAGE
    assert cli_main([*shown, "--set", "grpo.mode=agentic"]) == 0
    with pytest.raises(KeyError, match="for the whole preset"):
        apply_overrides(tiny, {"tool_sft.model": "x"})


# --- RSFT's keep rule --------------------------------------------------------------------------------


def candidate_texts(observation: dict) -> list[str]:
    """Six completions for a case: the oracle's plan, uniform SLERP, do-nothing, every tooth in one
    aligner (breaks the per-stage limits), no plan, and the oracle's again (a duplicate)."""
    oracle = plan_to_completion(oracle_plan(observation))
    return [
        plan_to_completion(
            {"strategy": "anterior_first", "tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 1.0}]}
        ),
        plan_to_completion({"strategy": "anterior_first", **UNIFORM_SLERP_PLAN}),
        "I would start with the incisors {not json",
        oracle,
        plan_to_completion({"strategy": "anterior_first", **DO_NOTHING_PLAN}),
        oracle,
    ]


def fake_sampler(config, checkpoint, observations):
    texts = [t for obs in observations for t in candidate_texts(obs)]
    assert len(texts) == config.samples_per_prompt * len(observations)
    return texts


def assert_keep_rule(samples: list[dict], rule: KeepRule) -> None:
    """Per prompt: at most keep_per_prompt distinct kept completions, each a plan that breaks no hard
    rule and beats the threshold, each scoring at least as well as every dropped completion (other
    than a copy of a kept one)."""
    for p in {s["prompt_index"] for s in samples}:
        group = [s for s in samples if s["prompt_index"] == p]
        kept = [s for s in group if s["kept"]]
        dropped = [
            s for s in group if not s["kept"] and s["completion"] not in {k["completion"] for k in kept}
        ]
        assert len(kept) <= rule.keep_per_prompt and len({s["completion"] for s in kept}) == len(kept)
        assert all(s["dropped"] in rsft.DROP_REASONS for s in dropped)
        for s in kept:
            assert s["dropped"] is None and s["error"] is None and not s["broken_rules"]
            assert s["scaled_reward"] > rule.min_reward
            assert all(s["scaled_reward"] >= d["scaled_reward"] for d in dropped)
            if rule.min_margin_over_slerp is not None:
                assert s["scaled_reward"] >= s["slerp_scaled_reward"] + rule.min_margin_over_slerp


def test_rsft_keeps_the_environments_best_safe_sample_per_prompt(monkeypatch):
    monkeypatch.setattr(rsft, "sample_completions", fake_sampler)
    config = RSFTConfig(model="x", prompts=4, samples_per_prompt=6, task_ids=["task_easy", "task_hard"])
    samples = rsft.sample_and_keep(config, "unused")
    assert_keep_rule(samples, KeepRule.of(config))
    by_reason = {s["sample"]: s["dropped"] for s in samples if s["prompt_index"] == 0}
    assert by_reason == {
        0: "hard_rule",
        1: "not_best",
        2: "not_a_plan",
        3: None,
        4: "below_threshold",
        5: "duplicate",
    }
    assert [s["task_id"] for s in samples[::6]] == ["task_easy", "task_hard"] * 2
    counts = rsft.counts(samples)
    assert counts["samples"] == 24 and counts["kept"] == counts["prompts_kept"] == 4
    assert sum(counts[r] for r in rsft.DROP_REASONS) + counts["kept"] == 24
    # two per prompt: the oracle's plan and uniform SLERP (the duplicate never counts twice)
    two = select(samples, KeepRule(keep_per_prompt=2))
    assert_keep_rule(two, KeepRule(keep_per_prompt=2))
    assert sorted(s["sample"] for s in two if s["kept"] and s["prompt_index"] == 0) == [1, 3]
    # a margin over uniform SLERP on the same case that no plan reaches keeps nothing
    strict = KeepRule(min_margin_over_slerp=10.0)
    assert not any(s["kept"] for s in select(samples, strict))
    rows = rsft.training_rows(samples, False)
    assert len(rows) == 4 and all(r["completion"][0]["content"] == candidate_texts_of(r) for r in rows)


def candidate_texts_of(row: dict) -> str:
    from orthojob.core.prompts import reset_observation

    return candidate_texts(reset_observation(row["seed"], row["task_id"], False))[3]


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 3),  # prompt
            st.sampled_from(["a", "b", "c", "d"]),  # completion text
            st.floats(0, 8, allow_nan=False),  # scaled reward of a safe plan (the safe band)
            st.booleans(),  # breaks a hard rule
            st.booleans(),  # not a plan
        ),
        max_size=24,
    ),
    st.integers(1, 3),
    st.floats(-1, 7),
    st.none() | st.floats(-2, 2),
)
def test_keep_rule_invariants(rows, keep, min_reward, margin):
    samples = [
        {"prompt_index": p, "sample": i, "completion": text, "scaled_reward": (-2.0 if bad else -0.5 if broken else r),
         "broken_rules": ["limits"] if broken else [], "error": "no plan" if bad else None, "slerp_scaled_reward": 6.0}
        for i, (p, text, r, broken, bad) in enumerate(rows)
    ]  # fmt: skip
    rule = KeepRule(min_reward, margin, keep)
    assert_keep_rule(select(samples, rule), rule)


# --- the stage commands, end to end on the tiny model -----------------------------------------


def test_format_sft_gate_grpo_preflight_and_rsft_cli(tiny_base, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    fmt = tmp_path / "format_sft"
    # stage 0: format SFT, its format gate, its MLflow stage run
    rc = cli_main(["format-sft", "--model", str(tiny_base), "--out", str(fmt), *TRAIN_FLAGS, *GATE_FLAGS])
    assert rc == 0, capsys.readouterr()
    content = gate_file.read_gate(fmt)
    assert content["stage"] == "format_sft" and content["passed"] is True
    assert set(content["checks"]) == {"parse_rate", "format_reward"}  # the format only
    summary = json.loads((fmt / "sft_log.json").read_text())["summary"]
    assert summary["demos"]["source"] == "format" and summary["examples"] == 4
    (run,) = stage_runs("format_sft")
    assert run.data.tags["orthorl.gate_passed"] == "true" and run.data.tags["orthorl.exit_code"] == "0"
    assert "gate/parse_rate" in run.data.metrics and "demos/hard_rule_share" in run.data.metrics

    # GRPO's pre-flight accepts the format stage's gate
    capsys.readouterr()
    assert cli_main(["grpo", "--from-checkpoint", str(fmt), "--test"]) == 0
    assert "passed (stage format_sft)" in capsys.readouterr().out

    # stage 4: RSFT from the format checkpoint; sampling replaced by known completions, scored for real
    monkeypatch.setattr(rsft, "sample_completions", fake_sampler)
    out = tmp_path / "rsft"
    argv = ["rsft", "--from-checkpoint", str(fmt), "--out", str(out), "--lora-r", "0", "--steps", "2",
            "--batch-size", "2", "--prompts", "2", "--samples-per-prompt", "6", *GATE_FLAGS]  # fmt: skip
    assert cli_main(argv) == 0, capsys.readouterr()
    assert "kept 2 of 12 samples" in capsys.readouterr().out
    assert gate_file.read_gate(out)["stage"] == "rsft"
    samples = [json.loads(line) for line in (out / RSFT_SAMPLES_FILE).read_text().splitlines()]
    assert len(samples) == 12 and sum(s["kept"] for s in samples) == 2
    assert_keep_rule(samples, KeepRule())
    summary = json.loads((out / "sft_log.json").read_text())["summary"]
    assert summary["examples"] == 2 and summary["demos"]["source"] == "rsft" and summary["demos"]["kept"] == 2
    assert models.checkpoint_digest(out) != models.checkpoint_digest(fmt)  # fine-tuned from the checkpoint
    (run,) = stage_runs("rsft")
    assert run.data.metrics["rsft/kept"] == 2 and run.data.metrics["rsft/hard_rule"] == 2
    assert run.data.tags["orthorl.gate_passed"] == "true"

    # an ungated checkpoint is refused before anything is sampled
    assert (
        cli_main(["rsft", "--from-checkpoint", str(tiny_base), "--out", str(tmp_path / "r2")])
        == ExitCode.GATE_MISSING
    )


def test_bc_sft_cli_gates_and_rsft_with_real_sampling_that_keeps_nothing(
    tiny_base, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    bc = tmp_path / "bc"
    # stage 2 with the default gate: two SFT steps do not teach the format, so the gate fails (exit 12)
    rc = cli_main(["bc-sft", "--model", str(tiny_base), "--out", str(bc), *TRAIN_FLAGS, "--gate-seeds", "2",
                   "--gate-max-new-tokens", "16"])  # fmt: skip
    assert rc == ExitCode.GATE_FAILED
    content = gate_file.read_gate(bc)
    assert content["stage"] == "bc_sft" and content["passed"] is False
    demos = json.loads((bc / "sft_log.json").read_text())["summary"]["demos"]
    assert demos["source"] == "oracle" and demos["filtered_hard_rule"] >= 0
    with pytest.raises(gate_file.GateError) as refused:
        gate_file.check_gate(bc)
    assert refused.value.exit_code == ExitCode.GATE_FAILED
    # RSFT on the (passed) gate of the same checkpoint, real sampling: the untrained model writes no
    # plan, nothing is kept, and the stage says what to change (exit 2)
    passing = {
        "parse_rate": 1.0,
        "format_reward": 1.0,
        "hard_rule_share_over_oracle": 0.0,
        "repair_share": 0.0,
    }
    gate_file.write_gate(bc, passing, stage="bc_sft")
    capsys.readouterr()
    argv = ["rsft", "--from-checkpoint", str(bc), "--out", str(tmp_path / "rsft"), "--lora-r", "0",
            "--prompts", "1", "--samples-per-prompt", "2", "--max-new-tokens", "8"]  # fmt: skip
    assert cli_main(argv) == ExitCode.USAGE
    assert "no sampled completion met the keep rule" in capsys.readouterr().err
    samples = [json.loads(line) for line in (tmp_path / "rsft" / RSFT_SAMPLES_FILE).read_text().splitlines()]
    assert len(samples) == 2 and not any(s["kept"] for s in samples)


def test_run_sft_takes_its_rows_from_the_caller(tiny_base, tmp_path):
    rows = [
        {
            "prompt": [{"role": "user", "content": "case"}],
            "completion": [{"role": "assistant", "content": "{}"}],
        }
    ] * 2
    summary = run_sft(
        SFTJobConfig(model=str(tiny_base), out=str(tmp_path / "o"), steps=1, batch_size=2, lora_r=0),
        rows,
        {"source": "test", "n": 2},
    )
    assert summary["examples"] == 2 and summary["demos"] == {"source": "test", "n": 2}


def test_sft_and_its_gate_log_progress_lines_in_a_job(tiny_base, tmp_path, monkeypatch, capfd):
    """Where stderr is no terminal (a Job's log) a real SFT and its gate's generation write whole
    progress lines, steps done of the total with an ETA, never a carriage-return bar."""
    monkeypatch.setenv("ORTHORL_PROGRESS", "log")
    monkeypatch.setenv("ORTHORL_PROGRESS_INTERVAL", "0")  # a line per update
    out = tmp_path / "o"
    run_sft(SFTJobConfig(model=str(tiny_base), out=str(out), steps=3, batch_size=2, examples=4, lora_r=0))
    gate.gate_report(
        str(out),
        n_seeds=3,
        max_new_tokens=8,
        batch_size=1,
        stage=gate_file.BC_SFT,
        cells=[("task_easy", False)],
    )
    lines = capfd.readouterr().err.split("\n")
    sft = [x for x in lines if x.startswith("[sft] step ")]
    assert [x.split(" (")[0] for x in sft] == ["[sft] step 1/3", "[sft] step 2/3", "[sft] step 3/3"]
    assert "ETA" in sft[0] and sft[-1].startswith("[sft] step 3/3 (100%)")
    generate = [x for x in lines if x.startswith("[generate] prompt ")]
    assert [x.split(" (")[0] for x in generate] == [f"[generate] prompt {i}/3" for i in (1, 2, 3)]
    assert "ETA" in generate[0] and ", done" in generate[-1]
    assert not any("\r" in x for x in sft + generate)


def test_pipeline_preset_chooses_the_full_chain(tiny_base, tmp_path, monkeypatch, capsys):
    """format -> BC -> GRPO -> RSFT from one preset: each stage starts from the previous gated
    checkpoint, has its MLflow run and gate file; the evaluation has a row per checkpoint."""
    from orthojob.stages.pipeline import SUMMARY_FILE, run_pipeline

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(rsft, "sample_completions", fake_sampler)
    small = {"steps": 1, "examples": 2, "batch_size": 2}
    gate_small = {
        "n_seeds": 2,
        "max_new_tokens": 16,
        "thresholds.min_parse_rate": 0,
        "thresholds.min_format_reward": 0,
    }
    overrides = {
        "stages": "format_sft,bc_sft,grpo,rsft",
        "model": str(tiny_base),  # built once for this module: the pipeline builds none
        "base_eval": False,
        **{f"{s}.{k}": v for s in ("format_sft", "bc_sft") for k, v in small.items()},
        **{f"{s}_gate.{k}": v for s in ("format_sft", "bc_sft", "rsft") for k, v in gate_small.items()},
        "grpo.steps": 1,
        "grpo.max_completion_length": 16,
        "grpo.gate_seeds": 2,
        "grpo_gate.thresholds": {
            "min_parse_rate": 0,
            "min_format_reward": 0,
            "min_margin_over_slerp": -10,
            "max_p_no_better_than_slerp": None,
        },
        "rsft.prompts": 1,
        "rsft.samples_per_prompt": 6,
        "rsft.steps": 1,
        "rsft.batch_size": 1,
        "evaluate.n_seeds": 1,
        "evaluate.max_new_tokens": 8,
    }
    out = tmp_path / "run"
    summary = run_pipeline("tiny-cpu", out, overrides)
    assert summary["exit_code"] == 0, format(summary["stages"])
    assert summary["chain"] == ["format_sft", "bc_sft", "grpo", "rsft"]
    stages = summary["stages"]
    for name in summary["chain"]:
        assert gate_file.read_gate(out / name)["stage"] == name and stages[f"gate_{name}"]["passed"] is True
    assert (
        stages["format_sft"]["demos"]["source"] == "format"
        and stages["bc_sft"]["demos"]["source"] == "oracle"
    )
    assert stages["grpo"]["from_checkpoint"] == str(out / "bc_sft")
    assert stages["rsft"]["rsft"]["kept"] == 1
    sft_config = json.loads((out / "bc_sft" / "sft_config.json").read_text())
    assert sft_config["from_checkpoint"] == str(out / "format_sft")  # BC continues the format stage
    assert json.loads((out / "rsft" / "sft_config.json").read_text())["from_checkpoint"] == str(out / "grpo")
    results = json.loads((out / "evaluation.json").read_text())["results"]["task_easy"]
    assert list(results)[:4] == ["rsft", "grpo", "bc_sft", "format_sft"]
    assert json.loads((out / SUMMARY_FILE).read_text())["exit_code"] == 0
    runs = {r.data.tags["orthorl.stage"]: r for r in stage_runs_under(summary["mlflow_run_id"])}
    assert set(runs) == {"format_sft", "bc_sft", "grpo", "rsft", "evaluate"}  # a stage's gate in its run
    # every gated checkpoint is a LoggedModel of its stage's run carrying its gate (metrics, verdict),
    # its held-out cases linked to the gate metrics, the cases it trained on among the run's inputs
    import mlflow

    for name in summary["chain"]:
        run = runs[name]
        (model,) = mlflow.search_logged_models(
            experiment_ids=[run.info.experiment_id],
            filter_string=f"source_run_id = '{run.info.run_id}' AND tags.`orthorl.gate_stage` = '{name}'",
            output_format="list",
        )
        content = gate_file.read_gate(out / name)
        metrics = {m.key: m for m in model.metrics}
        assert metrics["gate/scaled_reward_mean"].value == content["metrics"]["scaled_reward_mean"]
        assert model.tags["orthorl.gate_passed"] == "true" == run.data.tags["orthorl.gate_passed"]
        evaluation = content["evaluation"]
        heldout = f"heldout-{'+'.join(evaluation['task_ids'])}-{evaluation['seed_start']}-{evaluation['seed_start'] + 1}"
        assert metrics["gate/scaled_reward_mean"].dataset_name == heldout
        inputs = {
            (i.dataset.name, {t.key: t.value for t in i.tags}["mlflow.data.context"]): i.dataset
            for i in mlflow.get_run(run.info.run_id).inputs.dataset_inputs
        }
        assert (heldout, "evaluation") in inputs
        (trained,) = [d for (n, context), d in inputs.items() if context == "training"]
        assert trained.name.startswith(f"{name}-train-task_easy")
        rows = json.loads(trained.profile)["num_rows"]  # one per case: SFT's examples, GRPO's prompts
        assert rows == stages[name]["examples"] if "examples" in stages[name] else rows >= 1


def stage_runs_under(parent: str) -> list:
    import mlflow

    return mlflow.search_runs(
        search_all_experiments=True,
        filter_string=f"tags.mlflow.parentRunId = '{parent}'",
        output_format="list",
    )


def test_bc_sft_on_a_case_set_trains_on_its_training_patients_and_gates_on_the_heldout(
    tiny_base, tmp_path, monkeypatch
):
    from orthojob.data import case_sets

    monkeypatch.chdir(tmp_path)
    source = tmp_path / "patients.jsonl"
    case_sets.export("task_easy", range(6), False, source)
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    for k, row in enumerate(rows):
        row.pop("task_id"), row.pop("seed")
        row["split"] = "heldout" if k < 2 else "train"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bc = tmp_path / "bc"
    rc = cli_main(["bc-sft", "--model", str(tiny_base), "--out", str(bc), *TRAIN_FLAGS, "--cases", str(source),
                   "--gate-max-new-tokens", "8"])  # fmt: skip
    assert rc == ExitCode.GATE_FAILED  # two steps teach no format
    demos = json.loads((bc / "sft_log.json").read_text())["summary"]["demos"]
    loaded = case_sets.load_case_set(str(source))
    assert demos["source"] == f"oracle on {source}" and demos["split_digest"] == loaded.split.digest
    assert demos["examples"] + demos["filtered_hard_rule"] == 4  # the four training patients, each once
    content = gate_file.read_gate(bc)
    assert content["evaluation"]["task_ids"] == ["imported"] and content["metrics"]["n"] == 2
    assert content["evaluation"]["case_set"]["n_patients"] == 2
    # a case file that is not there: exit 2 before any model loads (the other stages: tests/test_case_set_stages.py)
    assert cli_main(["bc-sft", "--out", str(bc), "--cases", str(tmp_path / "none.jsonl")]) == ExitCode.USAGE
