"""Format SFT (stage 0), tool-use SFT (stage 1) and RSFT (stage 4) on a case set (docs/cases.md): each
trains on the training patients' cases only, each row naming its case, the summary recording the
split's digest, the gate judging the held-out patients; a set that cannot be used stops the stage
command with exit 2, the problem named, before any model loads; the pipeline's ``--cases`` reaches
every training stage."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from orthojob.cli import main as cli_main
from orthojob.core.prompts import build_messages, plan_to_completion
from orthojob.data import case_sets
from orthojob.eval.evaluation import UNIFORM_SLERP_PLAN
from orthojob.lifecycle import gate_file
from orthojob.modeling import models
from orthojob.ops.exit_codes import ExitCode
from orthojob.stages import rsft
from orthojob.stages.rsft_config import RSFT_SAMPLES_FILE, RSFTConfig
from orthojob.stages.sft import demonstration_rows
from orthojob.stages.sft_config import FormatSFTConfig, ToolSFTConfig
from server.cases import generate_case
from server.dental_environment import initial_observation
from server.oracle import oracle_plan

TRAIN_FLAGS = ["--lora-r", "0", "--steps", "2", "--batch-size", "2"]
GATE_FLAGS = ["--gate-max-new-tokens", "8", "--min-parse-rate", "0", "--min-format-reward", "0"]
TOOL_GATE_FLAGS = ["--gate-max-new-tokens", "8", "--gate-tool-turns", "1", "--min-tool-call-rate", "0",
                   "--min-finished-rate", "0"]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def own_tracking_store(tmp_path_factory):
    """This module's stage runs in a tracking store of its own, so that another module's search for
    the one run of a stage (e.g. ``tool_sft``) in the session's store does not find these."""
    import mlflow

    from orthojob.ops import tracking

    root = tmp_path_factory.mktemp("mlflow-case-set-stages")
    cwd = os.getcwd()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        os.chdir(root)  # the embedded store puts the experiment's artifacts next to the database
        try:
            tracking.configure()
        finally:
            os.chdir(cwd)
        yield
    mlflow.set_tracking_uri(tracking.tracking_uri())


def patients_file(path: Path, split: dict[str, str] | None = None) -> Path:
    """Six imported task_easy cases (no generated key) of three patients, two cases each: patient
    ``p0`` held out and ``p1``, ``p2`` for training unless ``split`` (patient -> side) says otherwise."""
    sides = {"p0": "heldout", "p1": "train", "p2": "train", **(split or {})}
    case_sets.export("task_easy", range(6), False, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for k, row in enumerate(rows):
        row.pop("task_id"), row.pop("seed")
        row["patient_id"] = f"p{k // 2}"
        row["split"] = sides[row["patient_id"]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def source(tmp_path) -> Path:
    return patients_file(tmp_path / "patients.jsonl")


def sides(source: Path) -> tuple[case_sets.LoadedCaseSet, dict, set[str]]:
    """The loaded set, its training cases' keys by case id, and its held-out case ids."""
    loaded = case_sets.load_case_set(str(source))
    return loaded, dict(zip(loaded.case_ids("train"), loaded.train)), set(loaded.case_ids("heldout"))


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    return models.build_tiny(
        tmp_path_factory.mktemp("tiny") / "base", ["task_easy"], max_position_embeddings=2048
    )


def case_set_inputs(stage: str) -> dict[str, dict]:
    """The case-set dataset inputs of a stage's last MLflow run: name -> tags."""
    import mlflow

    from orthojob.ops import tracking

    run = mlflow.get_run(tracking.last_stage_run(stage))
    inputs = {d.dataset.name: {t.key: t.value for t in d.tags} for d in run.inputs.dataset_inputs}
    return {name: tags for name, tags in inputs.items() if "split_digest" in tags}


def oracle_and_slerp(config, checkpoint, observations):
    """RSFT's sampler replaced: per prompt the oracle's plan (kept: safe, above doing nothing) and
    uniform SLERP."""
    assert config.samples_per_prompt == 2
    slerp = plan_to_completion({"strategy": "anterior_first", **UNIFORM_SLERP_PLAN})
    return [t for obs in observations for t in (plan_to_completion(oracle_plan(obs)), slerp)]


# --- the stages' data: the training patients' cases only ------------------------------------------


def test_format_demonstrations_are_the_training_patients_cases_in_turn(source):
    loaded, train, heldout = sides(source)
    assert len(train) == 4 and len(heldout) == 2
    config = FormatSFTConfig(cases=str(source), examples=6, demo_seed=3)
    rows, info = demonstration_rows(config)
    # the four training cases in file order, then again (other random plans), none held out
    assert [r["case_id"] for r in rows] == [*train, *list(train)[:2]]
    assert not heldout & {r["case_id"] for r in rows}
    for row in rows:
        key = train[row["case_id"]]
        assert (row["task_id"], row["seed"]) == (key.task_id, key.seed) and key.task_id == "imported"
        assert row["prompt"] == build_messages(initial_observation(generate_case(*key)))
    assert rows[0]["plan"] != rows[4]["plan"]  # the same case, another random plan
    assert info["source"] == "format" and info["examples"] == 6 and info["executable_mean"] == 1.0
    assert info["split_digest"] == loaded.split.digest and info["cases"] == str(source)
    again, _ = demonstration_rows(config)
    assert again == rows  # deterministic: the split by patient and the demo seed
    safe, safe_info = demonstration_rows(replace(config, safe_demos=True))
    assert [r["case_id"] for r in safe] == [r["case_id"] for r in rows] and safe_info[
        "hard_rule_share"
    ] == 0.0


def test_tool_demonstrations_are_the_oracles_episodes_on_the_training_patients(source):
    loaded, train, heldout = sides(source)
    rows, info = demonstration_rows(ToolSFTConfig(cases=str(source), examples=10))
    assert info["examples"] + info["filtered_hard_rule"] == 4  # each training case once, at most --examples
    assert [r["case_id"] for r in rows] == [c for c in train if c in {r["case_id"] for r in rows}]
    assert not heldout & {r["case_id"] for r in rows}
    for row in rows:
        key = train[row["case_id"]]
        assert (row["task_id"], row["seed"]) == (key.task_id, key.seed)
        assert row["calls"][-2:] == ["check_collisions", "submit_plan"] and row["reward"] > 0
        assert row["plan"] == oracle_plan(initial_observation(generate_case(*key)))
        assert "Case summary" in row["prompt"][-1]["content"]
    assert info["split_digest"] == loaded.split.digest
    short, _ = demonstration_rows(ToolSFTConfig(cases=str(source), examples=2))
    assert [r["case_id"] for r in short] == [r["case_id"] for r in rows[:2]]


def test_demonstrations_on_patients_without_some_teeth_never_name_them(tmp_path):
    path = patients_file(tmp_path / "gaps.jsonl")
    records = []
    for record in map(json.loads, path.read_text().splitlines()):  # 15 and 25 extracted
        keep = [i for i, t in enumerate(record["teeth"]) if t not in (15, 25)]
        for name in ("teeth", "initial", "target", "crown_width_mm", "crown_depth_mm"):
            record[name] = [record[name][i] for i in keep]
        records.append({**record, "absent": [15, 25]})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    fmt, _ = demonstration_rows(FormatSFTConfig(cases=str(path), examples=8))
    tool, _ = demonstration_rows(ToolSFTConfig(cases=str(path), examples=4))
    assert fmt and tool
    named = {t for r in fmt + tool for g in r["plan"]["tooth_groups"] for t in g["teeth"]}
    inspected = {c["tool_calls"][0]["function"]["arguments"].get("tooth_id") for r in tool for c in r["completion"]
                 if c.get("tool_calls")}  # fmt: skip
    assert not {15, 25} & (named | inspected)


def test_rsft_samples_the_training_patients_cases(source, monkeypatch):
    monkeypatch.setattr(rsft, "sample_completions", oracle_and_slerp)
    _, train, heldout = sides(source)
    samples = rsft.sample_and_keep(
        RSFTConfig(model="x", cases=str(source), prompts=3, samples_per_prompt=2), "unused"
    )
    assert [s["case_id"] for s in samples[::2]] == list(train)[:3]  # each once, at most --prompts
    assert all(s["task_id"] == "imported" and s["seed"] == train[s["case_id"]].seed for s in samples)
    everything = rsft.sample_and_keep(
        RSFTConfig(model="x", cases=str(source), samples_per_prompt=2), "unused"
    )
    assert {s["case_id"] for s in everything} == set(train)  # 256 prompts asked: the four there are
    assert not heldout & {s["case_id"] for s in everything}
    rows = rsft.training_rows(everything, False)
    assert rows and {r["case_id"] for r in rows} <= set(train)
    for row in rows:
        assert row["prompt"] == build_messages(initial_observation(generate_case(*train[row["case_id"]])))


# --- the stage commands -------------------------------------------------------------------------------


def test_format_sft_trains_on_the_training_patients_and_gates_on_the_heldout(tiny_base, source, tmp_path):
    loaded, _, _ = sides(source)
    out = tmp_path / "format"
    argv = ["format-sft", "--model", str(tiny_base), "--out", str(out), *TRAIN_FLAGS, "--examples", "4",
            "--cases", str(source), *GATE_FLAGS]  # fmt: skip
    assert cli_main(argv) == 0
    demos = json.loads((out / "sft_log.json").read_text())["summary"]["demos"]
    assert demos["split_digest"] == loaded.split.digest and demos["examples"] == 4
    evaluation = gate_file.read_gate(out)["evaluation"]
    assert evaluation["task_ids"] == ["imported"] and evaluation["case_set"]["split"] == "heldout"
    assert evaluation["case_set"]["split_digest"] == loaded.split.digest
    assert evaluation["case_set"]["n_cases"] == 2 and evaluation["case_set"]["n_patients"] == 1
    inputs = case_set_inputs("format_sft")  # the run's datasets: the training side, the gate's held-out side
    assert set(inputs) == {"patients.jsonl:train", "patients.jsonl:heldout"}
    assert inputs["patients.jsonl:train"]["mlflow.data.context"] == "training"
    assert (
        inputs["patients.jsonl:train"]["cases"] == "4" and inputs["patients.jsonl:train"]["patients"] == "2"
    )
    assert {tags["split_digest"] for tags in inputs.values()} == {loaded.split.digest}


def test_tool_sft_trains_on_the_training_patients_and_gates_on_the_heldout(tiny_tool_base, source, tmp_path):
    """Stage 1's tiny tokenizer is trained on generated cases' conversations; an imported case's
    conversation is the same vocabulary (numbers, FDI ids, the tools' text): byte-level BPE encodes it
    without an unknown token and decodes it back exactly."""
    from transformers import AutoTokenizer

    from orthojob.agentic.chat_template import prepare_tokenizer
    from orthojob.stages.tool_sft import render_rows

    loaded, _, _ = sides(source)
    rows, _ = demonstration_rows(ToolSFTConfig(cases=str(source), examples=1))
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(tiny_tool_base))
    (text,) = render_rows(rows, tokenizer)
    ids = tokenizer(text["prompt"] + text["completion"], add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text["prompt"] + text["completion"] and len(ids) < 8192

    out = tmp_path / "tool"
    argv = ["tool-sft", "--model", str(tiny_tool_base), "--out", str(out), "--lora-r", "0", "--steps", "1",
            "--batch-size", "1", "--examples", "2", "--cases", str(source), *TOOL_GATE_FLAGS]  # fmt: skip
    assert cli_main(argv) == 0
    summary = json.loads((out / "sft_log.json").read_text())["summary"]
    assert summary["demos"]["split_digest"] == loaded.split.digest and summary["examples"] == 2
    assert summary["examples_at_max_length"] == 0
    content = gate_file.read_gate(out)
    assert content["stage"] == "tool_sft" and content["metrics"]["n"] == 2
    assert content["evaluation"]["task_ids"] == ["imported"]
    assert content["evaluation"]["case_set"]["split_digest"] == loaded.split.digest


def test_rsft_fine_tunes_on_the_training_patients_and_gates_on_the_heldout(
    tiny_base, source, tmp_path, monkeypatch
):
    monkeypatch.setattr(rsft, "sample_completions", oracle_and_slerp)
    loaded, train, heldout = sides(source)
    out = tmp_path / "rsft"
    argv = ["rsft", "--from-checkpoint", str(tiny_base), "--skip-gate-check", "--out", str(out), *TRAIN_FLAGS,
            "--samples-per-prompt", "2", "--cases", str(source), *GATE_FLAGS]  # fmt: skip
    assert cli_main(argv) == 0
    samples = [json.loads(line) for line in (out / RSFT_SAMPLES_FILE).read_text().splitlines()]
    assert {s["case_id"] for s in samples} == set(train) and not heldout & {s["case_id"] for s in samples}
    summary = json.loads((out / "sft_log.json").read_text())["summary"]
    assert summary["demos"]["split_digest"] == loaded.split.digest and summary["demos"]["prompts"] == 4
    case_set = gate_file.read_gate(out)["evaluation"]["case_set"]
    assert case_set["split_digest"] == loaded.split.digest and case_set["n_cases"] == 2
    inputs = case_set_inputs("rsft")
    assert inputs["patients.jsonl:train"]["split_digest"] == loaded.split.digest
    assert inputs["patients.jsonl:train"]["mlflow.data.context"] == "training"


@pytest.mark.parametrize(
    "command", [["format-sft"], ["tool-sft"], ["bc-sft"], ["rsft", "--from-checkpoint", "ckpt"], ["pipeline"]]
)
def test_a_case_set_that_cannot_be_used_stops_the_stage_before_any_model(
    command, tmp_path, monkeypatch, capsys
):
    def never(*args, **kwargs):
        raise AssertionError("a model was loaded or a stage run although the case set is unusable")

    for target in ("orthojob.modeling.models.load_policy", "orthojob.modeling.models.build_tiny",
                   "orthojob.stages.sft.run_sft", "orthojob.stages.rsft.run_rsft",
                   "orthojob.stages.pipeline_cli.run_pipeline"):  # fmt: skip
        monkeypatch.setattr(target, never)
    flags = ["--out", str(tmp_path / "out")] + (["--lora-r", "0"] if command[0] != "pipeline" else [])
    good = patients_file(tmp_path / "good.jsonl")
    record = json.loads(good.read_text().splitlines()[0])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**record, "teeth": record["teeth"][1:]}) + "\n")
    no_heldout = patients_file(tmp_path / "no_heldout.jsonl", {"p0": "train"})
    no_train = patients_file(tmp_path / "no_train.jsonl", {"p1": "heldout", "p2": "heldout"})
    for path, said in ((bad, "tooth 11"), (tmp_path / "none.jsonl", "no case file"),
                       (no_heldout, "holds out no patient"), (no_train, "leaves no training patient")):  # fmt: skip
        assert cli_main([*command, *flags, "--cases", str(path)]) == ExitCode.USAGE, path
        err = capsys.readouterr().err
        assert f"--cases {path}" in err and said in err, err
    if command[0] != "pipeline":  # a share outside [0, 1]: the config refuses it
        assert cli_main([*command, *flags, "--cases", str(good), "--heldout-share", "1.5"]) == ExitCode.USAGE
        assert "--heldout-share must lie in [0, 1]" in capsys.readouterr().err


def test_a_stages_own_set_wins_over_the_pipelines_cases(capsys):
    """``--cases`` sets every training stage's ``cases`` (tests/test_pipeline.py) unless ``--set`` gave one."""
    argv = [
        "pipeline",
        "--show",
        "--cases",
        "a.jsonl",
        "--set",
        "rsft.cases=null",
        "--set",
        "format_sft.heldout_share=0.3",
    ]
    assert cli_main(argv) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (
        shown["rsft"]["cases"] is None
        and shown["tool_sft"]["cases"] == shown["format_sft"]["cases"] == "a.jsonl"
    )
    assert shown["format_sft"]["heldout_share"] == 0.3
