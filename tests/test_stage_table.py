"""The one table of stages (:data:`orthojob.stages.stage_table.STAGE_TABLE`): every name of a stage is
derived from its key (the CLI's commands, the preset and gate sections, the pipeline's stage values, the
default folders), and each old name still works one release, saying on stderr what replaces it."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from orthojob import cli
from orthojob.cli import build_parser
from orthojob.cli import main as cli_main
from orthojob.lifecycle import gate_file
from orthojob.stages import presets
from orthojob.stages.presets import PRESETS, Preset, apply_overrides
from orthojob.stages.stage_table import OLD_COMMANDS, OLD_PIPELINE_NAMES, OLD_SECTIONS, STAGE_TABLE

DEPRECATED = "is deprecated, use"


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_the_table_holds_every_stage_by_its_gate_file_name_in_training_order():
    assert tuple(STAGE_TABLE) == gate_file.STAGES
    assert [s.number for s in STAGE_TABLE.values()] == list(range(len(gate_file.STAGES)))
    assert [s.command for s in STAGE_TABLE.values()] == ["format-sft", "tool-sft", "bc-sft", "grpo", "rsft"]


def test_the_clis_stage_commands_are_the_tables():
    commands = _commands(build_parser())
    listed = [c for c in commands if c in {s.command for s in STAGE_TABLE.values()} | set(OLD_COMMANDS)]
    assert listed == [s.command for s in STAGE_TABLE.values()] + list(OLD_COMMANDS)
    help_text = build_parser().format_help()
    for stage in STAGE_TABLE.values():
        assert f"stage {stage.number}: {stage.summary}" in " ".join(help_text.split())
        epilog = commands[stage.command].epilog or ""
        assert all(f"{int(code)} " in epilog for code in stage.exit_codes), stage.key


def test_preset_and_gate_sections_are_the_tables():
    fields = {f.name for f in dataclasses.fields(Preset)}
    for stage in STAGE_TABLE.values():
        assert stage.section in fields and stage.gate_section in fields, stage.key
        for preset in PRESETS.values():
            assert type(getattr(preset, stage.section)) is stage.config, (preset.name, stage.key)
    assert not fields & set(OLD_SECTIONS)


def test_pipeline_stage_values_and_default_folders_are_the_tables():
    assert tuple(STAGE_TABLE) == presets.PIPELINE_STAGES
    assert tuple(k for k, s in STAGE_TABLE.items() if s.first) == presets.FIRST_STAGES
    assert set(presets.DEFAULT_STAGES) <= set(STAGE_TABLE)
    for stage in STAGE_TABLE.values():
        out = next(f.default for f in dataclasses.fields(stage.config) if f.name == "out")
        assert out == stage.out == f"./checkpoints/{stage.key}", stage.key
    for preset in PRESETS.values():  # the pipeline's stage folders and summary use the keys too
        assert set(preset.stages) <= set(STAGE_TABLE)


@pytest.mark.parametrize("old", sorted(OLD_PIPELINE_NAMES))
def test_an_old_pipeline_stage_name_still_works_with_a_deprecation_message(old, capsys):
    new = OLD_PIPELINE_NAMES[old]
    chain = ",".join(dict.fromkeys([old, "bc" if old != "bc" else "format"]))
    stages = apply_overrides(PRESETS["tiny-cpu"], {"stages": chain}).stages
    assert stages[0] == new and set(stages) <= set(STAGE_TABLE)
    err = capsys.readouterr().err
    assert f"stage name '{old}' {DEPRECATED} '{new}'" in err


@pytest.mark.parametrize("old", sorted(OLD_SECTIONS))
def test_an_old_preset_section_still_works_with_a_deprecation_message(old, capsys):
    new = OLD_SECTIONS[old]
    key = "steps" if not old.endswith("_gate") else "n_seeds"
    assert cli_main(["pipeline", "--show", "--set", f"{old}.{key}=7"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)[new][key] == 7
    assert f"preset section '{old}' {DEPRECATED} '{new}'" in err


def test_the_old_train_command_runs_grpo_with_a_deprecation_message(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(cli, "run_train", lambda args: ran.append(vars(args)) or 0)
    assert cli_main(["train", "--preset", "tiny-cpu", "--steps", "3"]) == 0
    assert cli_main(["grpo", "--preset", "tiny-cpu", "--steps", "3"]) == 0
    assert ran[0] == ran[1] and ran[0]["steps"] == 3  # the same flags reach the same function
    err = capsys.readouterr().err
    assert err.count(DEPRECATED) == 1 and f"command 'train' {DEPRECATED} 'grpo'" in err


def test_the_old_sft_command_runs_bc_sft_without_its_gate_with_a_deprecation_message(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(
        cli, "run_sft_stage_cli", lambda args, key, command: ran.append((key, args.no_gate)) or 0
    )
    parser = build_parser()
    for argv in (
        ["sft", "--steps", "2"],
        ["bc-sft", "--no-gate", "--steps", "2"],
        ["bc-sft", "--steps", "2"],
    ):
        args = parser.parse_args(argv)
        assert args.func(args) == 0
    assert ran == [(gate_file.BC_SFT, True), (gate_file.BC_SFT, True), (gate_file.BC_SFT, False)]
    err = capsys.readouterr().err
    assert err.count(DEPRECATED) == 1 and f"command 'sft' {DEPRECATED} 'bc-sft --no-gate'" in err


@pytest.mark.parametrize("key", ["bc_sft", "grpo", "rsft"])
def test_every_stage_resumes_the_same_way_passed_or_failed(key, tiny_model, tmp_path, capsys):
    """The pipeline's resume (:meth:`orthojob.stages.pipeline._Chain.finished`) is one decision for every
    stage, GRPO included: an intact gate file with this config's run identity is kept, passed or failed
    (the chain then ends with that gate's exit code); a changed checkpoint is trained again; another
    config's output is refused with exit 14."""
    import shutil

    from orthojob.ops import run_identity
    from orthojob.ops.exit_codes import ExitCode
    from orthojob.stages.pipeline import _Chain, _Outcome, _RefusedError

    chain = _Chain(PRESETS["tiny-cpu"], tmp_path / "run", None)
    stage = STAGE_TABLE[key]
    previous = None if key == "bc_sft" else _Outcome("bc_sft", chain.out / "bc_sft", True)
    folder = chain.out / key
    _, identity = chain.stage_config(stage, folder, previous)
    assert chain.finished(stage, folder, identity) is None  # nothing there yet: train it
    shutil.copytree(tiny_model, folder)
    metrics = {"parse_rate": 0.0, "format_reward": 0.0, "hard_rule_share_over_oracle": 0.0}
    gate_file.write_gate(folder, metrics, stage=key)  # a failed gate
    run_identity.write_identity(folder, identity)
    content = chain.finished(stage, folder, identity)
    assert content is not None and content["passed"] is False
    assert chain.stages[key]["resumed_from"] == str(folder) and chain.stages[f"gate_{key}"]["resumed"] is True
    assert stage.gate_failed_code == (ExitCode.GRPO_GATE_FAILED if key == "grpo" else ExitCode.GATE_FAILED)
    # the outcome the loop gets: the gate's exit code, without training
    calls = []
    chain.train_sft = chain.train_grpo = chain.train_rsft = lambda *a: calls.append(a)
    outcome = chain.run_stage(stage, previous)
    assert (outcome.passed, outcome.code, calls) == (False, stage.gate_failed_code, [])
    # a checkpoint changed since its gate: trained again
    (folder / "config.json").write_text((folder / "config.json").read_text() + " ")
    assert chain.finished(stage, folder, identity) is None
    assert "is not reused" in capsys.readouterr().out
    # another config under the same run: refused, never trained over
    gate_file.write_gate(folder, metrics, stage=key)
    other = {**identity, "gate": {"changed": True}}
    with pytest.raises(_RefusedError) as refused:
        chain.finished(stage, folder, other)
    assert refused.value.code == ExitCode.RUN_MISMATCH and "error" in chain.stages[key]
