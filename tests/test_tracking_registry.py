"""Tracking and registry against a real `mlflow server` (SQLite backend, proxied artifacts)."""

from __future__ import annotations

import json

import pytest

mlflow = pytest.importorskip("mlflow")

from orthojob import registry, tracking  # noqa: E402
from orthojob.exit_codes import ExitCode  # noqa: E402
from tests.services import mlflow_server  # noqa: E402

SECRET = "sk-test-0b1e8d2f9a"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    with mlflow_server(root, str(root / "artifacts")) as service:
        yield service


@pytest.fixture
def tracked(server, monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "registry-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.chdir(tmp_path)
    yield server
    while mlflow.active_run():
        mlflow.end_run()


def _logged_run(tmp_path, passed: bool, score: float) -> str:
    """A run holding a small pyfunc model and a gate file (what a training stage leaves)."""

    class Echo(mlflow.pyfunc.PythonModel):
        def predict(self, context, model_input, params=None):
            return model_input

    gate = {"passed": passed, "metrics": {"terminal_mean": score}, "thresholds": {}}
    with tracking.stage_run("grpo", params={"lr": 1e-5, "secret_echo": SECRET}) as run:
        mlflow.pyfunc.log_model(name="model", python_model=Echo(), pip_requirements=["mlflow"])
        folder = tmp_path / run.info.run_id
        folder.mkdir()
        (folder / "gate_passed.json").write_text(json.dumps(gate))
        mlflow.log_artifact(str(folder / "gate_passed.json"))
        return run.info.run_id


def test_promotion_rules(tracked, tmp_path):
    name = "orthorl-test-planner"
    first = registry.promote(_logged_run(tmp_path, True, 5.0), name)
    assert first.candidate and first.champion
    worse = registry.promote(_logged_run(tmp_path, True, 4.0), name)
    assert not worse.champion and "does not beat" in worse.reason
    failed = registry.promote(_logged_run(tmp_path, False, 9.0), name)
    assert not failed.champion and "never promoted" in failed.reason
    forced_fail = registry.promote(_logged_run(tmp_path, False, 9.0), name, force=True)
    assert not forced_fail.champion
    better = registry.promote(_logged_run(tmp_path, True, 6.0), name)
    assert better.champion

    client = mlflow.tracking.MlflowClient()
    assert client.get_model_version_by_alias(name, "champion").version == better.version
    assert client.get_model_version_by_alias(name, "candidate").version == better.version
    tags = client.get_model_version(name, failed.version).tags
    assert tags["gate_passed"] == "false" and float(tags["terminal_mean"]) == 9.0


def test_missing_and_bad_gate_are_refused(tracked, tmp_path):
    with tracking.stage_run("grpo") as run:
        run_id = run.info.run_id
    with pytest.raises(registry.PromotionError) as err:
        registry.promote(run_id, "orthorl-nogate")
    assert err.value.exit_code == ExitCode.NO_GATE
    (tmp_path / "gate_passed.json").write_text("{not json")
    with tracking.stage_run("grpo") as run:
        mlflow.log_artifact(str(tmp_path / "gate_passed.json"))
        bad_id = run.info.run_id
    with pytest.raises(registry.PromotionError) as err:
        registry.promote(bad_id, "orthorl-badgate")
    assert err.value.exit_code == ExitCode.BAD_GATE


def test_params_are_redacted_and_metrics_sanitised(tracked):
    with tracking.stage_run("sft", params={"nested": {"key": SECRET}, "plain": 3}) as run:
        tracking.log_metrics(
            {
                "rewards/reward_terminal/mean": 1.5,
                "profiling/x": 9.0,
                "bad name!": 2.0,
                "nan": float("nan"),
                "flag": True,
            },
            step=1,
        )
        run_id = run.info.run_id
    data = mlflow.tracking.MlflowClient().get_run(run_id).data
    assert data.params["nested.key"] == "***" and data.params["plain"] == "3"
    assert SECRET not in json.dumps(data.params) + json.dumps(data.tags)
    assert data.metrics == {"rewards/reward_terminal/mean": 1.5, "bad name_": 2.0}


def test_unreachable_server_is_a_clear_error(monkeypatch):
    from tests.services import free_port

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with pytest.raises(tracking.TrackingError, match="unreachable"):
        tracking.configure("x")
