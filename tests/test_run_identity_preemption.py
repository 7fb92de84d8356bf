"""Run identity: a checkpoint records its config's digest; another config refuses to resume it
(exit 14), unless told to start fresh or to continue.

Preemption through the real job (a real SIGTERM to ``orthojob grpo`` on CPU, the checkpoint saved
and synced to SeaweedFS, the MLflow run ended KILLED on a real mlflow server, exit 143, the retried
pod resuming) is ``tests/test_e2e_mlflow_s3.py::test_resume_after_sigterm``; the CLI's refusal of
another config is ``tests/test_grpo.py::test_a_checkpoint_of_another_config_is_refused_before_any_model_load``."""

from __future__ import annotations

from pathlib import Path

import pytest

from orthojob.ops import run_identity
from orthojob.ops.exit_codes import ExitCode

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"model": "tiny", "lr": 1e-5, "steps": 300, "task_id": "task_easy", "out": "s3://b/run-a", "seed": 0}


def test_digest_ignores_where_and_how_but_not_what():
    d = run_identity.config_digest(CONFIG)
    assert len(d) == 64
    assert run_identity.config_digest({**CONFIG, "out": "s3://elsewhere", "logging_steps": 1}) == d
    for key, value in (("steps", 600), ("task_id", "task_hard"), ("lr", 2e-5), ("model", "other")):
        assert run_identity.config_digest({**CONFIG, key: value}) != d, key


def test_check_resume_policies(tmp_path, monkeypatch):
    monkeypatch.delenv(run_identity.POLICY_ENV, raising=False)
    ckpt = tmp_path / "checkpoint-300"
    ckpt.mkdir()
    assert run_identity.check_resume(ckpt, CONFIG) is True  # legacy: no identity file
    run_identity.write_identity(ckpt, CONFIG)
    assert run_identity.check_resume(ckpt, CONFIG) is True
    other = {**CONFIG, "steps": 600, "task_id": "task_hard"}
    with pytest.raises(run_identity.RunIdentityError) as err:
        run_identity.check_resume(ckpt, other)
    assert err.value.exit_code == ExitCode.RUN_MISMATCH == 14
    assert "steps: 300 -> 600" in str(err.value) and "task_id" in str(err.value)
    assert run_identity.check_resume(ckpt, other, "fresh") is False
    assert run_identity.check_resume(ckpt, other, "continue") is True
    monkeypatch.setenv(run_identity.POLICY_ENV, "fresh")
    assert run_identity.check_resume(ckpt, other) is False
    with pytest.raises(ValueError):
        run_identity.policy("sometimes")


def test_resume_checkpoint_checks_the_identity(tmp_path):
    from orthojob.ops import checkpoints

    out = tmp_path / "out"
    for step in (2, 4):
        folder = out / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text("{}")
        run_identity.write_identity(folder, CONFIG)
    assert checkpoints.resume_checkpoint(str(out), tmp_path / "w", CONFIG) == (4, out / "checkpoint-4")
    with pytest.raises(run_identity.RunIdentityError):
        checkpoints.resume_checkpoint(str(out), tmp_path / "w", {**CONFIG, "steps": 10})
    assert checkpoints.resume_checkpoint(str(out), tmp_path / "w", {**CONFIG, "steps": 10}, "fresh") is None
    assert checkpoints.resume_checkpoint(str(out), tmp_path / "w") == (
        4,
        out / "checkpoint-4",
    )  # no config: as before
