"""The embedded default: no MLFLOW_TRACKING_URI -> sqlite:///mlflow.db and ./mlartifacts in the cwd, no
server. A GRPO stage run there logs its metrics, model, gate file and plots, and promote registers it."""

from __future__ import annotations

import argparse
import json

import pytest

mlflow = pytest.importorskip("mlflow")

from orthojob.lifecycle import registry  # noqa: E402
from orthojob.modeling.models import build_tiny  # noqa: E402
from orthojob.ops.exit_codes import ExitCode  # noqa: E402
from orthojob.stages import grpo  # noqa: E402

SECRET = "aws-secret-default-3d9e71"


def test_embedded_default_store(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.chdir(tmp_path)
    tiny = build_tiny(tmp_path / "tiny", ["task_easy"], max_position_embeddings=4096)
    argv = ["--preset", "tiny-cpu", "--model", str(tiny), "--steps", "1", "--max-completion-length", "32",
            "--gate-seeds", "2", "--out", str(tmp_path / "out"), "--skip-sft-gate"]  # fmt: skip
    rc = grpo.run_train(grpo.add_train_arguments(argparse.ArgumentParser()).parse_args(argv))
    assert rc in (0, ExitCode.GRPO_GATE_FAILED)
    assert (tmp_path / "mlflow.db").is_file() and (tmp_path / "mlartifacts").is_dir()
    run = mlflow.last_active_run()
    assert mlflow.get_tracking_uri() == "sqlite:///mlflow.db"
    client = mlflow.tracking.MlflowClient()
    assert [m.step for m in client.get_metric_history(run.info.run_id, "rewards/reward_format/mean")] == [1]
    assert "gate_passed.json" in {a.path for a in client.list_artifacts(run.info.run_id)}
    # the run's LoggedModel carries the gate: its metrics and verdict, found by search_logged_models
    gate_file = json.loads((tmp_path / "out" / "gate_passed.json").read_text())
    verdict = str(gate_file["passed"]).lower()
    found = mlflow.search_logged_models(
        experiment_ids=[run.info.experiment_id],
        filter_string=f"tags.`orthorl.gate_passed` = '{verdict}'",
        output_format="list",
    )
    assert [m.source_run_id for m in found] == [run.info.run_id]
    linked = {m.key: m.value for m in found[0].metrics if m.key.startswith("gate/")}
    numeric = {
        k: v
        for k, v in gate_file["metrics"].items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    assert linked == pytest.approx({f"gate/{k}": v for k, v in numeric.items()})
    # promotion registers only a model whose gate passed; a failed gate registers nothing
    rc = registry.run_promote(run.info.run_id, "orthorl-default", force=False)
    if gate_file["passed"]:
        assert rc == 0
        version = client.get_model_version_by_alias("orthorl-default", "candidate")
        assert version.tags["gate_passed"] == "true"
    else:
        assert rc == ExitCode.BAD_GATE
        assert not client.search_registered_models(filter_string="name = 'orthorl-default'")
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err + json.dumps(run.data.params) + json.dumps(run.data.tags)
