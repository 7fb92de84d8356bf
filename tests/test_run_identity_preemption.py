"""Run identity (a checkpoint records its config's digest; another config refuses to resume it,
exit 14) and preemption (a real SIGTERM on CPU: the step finishes, a checkpoint is saved and synced
to SeaweedFS, the MLflow run ends KILLED on a real mlflow server, exit 143; the retried process
resumes from that checkpoint)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orthojob import run_identity
from orthojob.exit_codes import ExitCode

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
    from orthojob import mlops

    out = tmp_path / "out"
    for step in (2, 4):
        folder = out / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text("{}")
        run_identity.write_identity(folder, CONFIG)
    assert mlops.resume_checkpoint(str(out), tmp_path / "w", CONFIG) == (4, out / "checkpoint-4")
    with pytest.raises(run_identity.RunIdentityError):
        mlops.resume_checkpoint(str(out), tmp_path / "w", {**CONFIG, "steps": 10})
    assert mlops.resume_checkpoint(str(out), tmp_path / "w", {**CONFIG, "steps": 10}, "fresh") is None
    assert mlops.resume_checkpoint(str(out), tmp_path / "w") == (
        4,
        out / "checkpoint-4",
    )  # no config: as before


TRAINER = r"""
import os, sys, time
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from orthojob import mlops, tracking
from orthojob.preemption import PreemptionGuard

out_uri, work, max_steps, configured = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
config = {"model": "linear", "lr": 0.01, "steps": configured, "seed": 0}  # the run's identity
torch.manual_seed(0)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": ((self.lin(x).squeeze(-1) - labels) ** 2).mean()}


data = [{"x": torch.randn(4), "labels": torch.tensor(1.0)} for _ in range(4096)]


class Pace(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        time.sleep(0.05)
        print(f"STEP {state.global_step}", flush=True)


with tracking.stage_run("grpo") as run, PreemptionGuard() as guard:
    print(f"RUN {run.info.run_id}", flush=True)
    resume = mlops.resume_checkpoint(out_uri, __import__("pathlib").Path(work) / "resume", config)
    if resume:
        print(f"RESUMED {resume[0]}", flush=True)
    args = TrainingArguments(
        output_dir=work, max_steps=max_steps, save_steps=10_000, per_device_train_batch_size=8,
        report_to=[], use_cpu=True, logging_steps=10_000, learning_rate=0.01, save_only_model=False,
    )
    callbacks = [Pace(), guard.callback(), mlops.checkpoint_sync_callback(out_uri, config)]
    trainer = Trainer(Model(), args, train_dataset=data, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=str(resume[1]) if resume else None)
    guard.exit_if_requested()
    print(f"DONE {trainer.state.global_step}", flush=True)
"""


@pytest.mark.slow
def test_sigterm_saves_syncs_ends_killed_and_the_retry_resumes(tmp_path):
    from tests.services import mlflow_server, seaweedfs

    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    with (
        seaweedfs(tmp_path / "weed") as s3,
        mlflow_server(tmp_path / "mlflow", (tmp_path / "art").as_uri()) as server,
    ):
        env = {
            **os.environ,
            **s3.env(),
            "MLFLOW_TRACKING_URI": server.uri,
            "MLFLOW_EXPERIMENT_NAME": "preemption",
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "K8S_JOB_NAME": "orthorl-grpo-p",
            "K8S_POD_NAME": "orthorl-grpo-p-pod1",
        }
        env.pop("MLFLOW_RUN_ID", None)
        out = "s3://orthorl/runs/preempt"
        proc = subprocess.Popen(
            [sys.executable, str(script), out, str(tmp_path / "pod1"), "100000", "100000"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
        )  # fmt: skip
        lines: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("STEP 7"):
                break
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
        seconds = time.monotonic() - t
        log = "".join(lines) + rest
        print(f"SIGTERM -> exit {proc.returncode} after {seconds:.1f} s")
        assert proc.returncode == ExitCode.TERMINATED, log[-3000:]
        assert seconds < 60, "must fit well inside terminationGracePeriodSeconds (300 s)"
        run_id = next(x.split()[1] for x in lines if x.startswith("RUN "))
        saved = int(log.split("SIGTERM: checkpoint-")[1].split()[0])
        assert saved >= 7

        from orthojob import storage

        os.environ.update(s3.env())
        try:
            found = storage.latest_checkpoint(out)
            assert found == (saved, f"{out}/checkpoint-{saved}"), found
            local = storage.download_dir(found[1], tmp_path / "check")
            assert json.loads((local / "run_identity.json").read_text())["config_digest"]
        finally:
            for key in s3.env():
                os.environ.pop(key, None)

        from mlflow.tracking import MlflowClient

        run = MlflowClient(server.uri).get_run(run_id)
        assert run.info.status == "KILLED"
        assert run.data.tags["orthorl.terminated"] == "SIGTERM"
        assert run.data.tags["orthorl.saved_step"] == str(saved)

        # the retried pod: same Job, same prefix; resumes from the synced checkpoint
        env["K8S_POD_NAME"] = "orthorl-grpo-p-pod2"
        again = subprocess.run(
            [sys.executable, str(script), out, str(tmp_path / "pod2"), str(saved + 3), "100000"],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
        )  # fmt: skip
        text = again.stdout + again.stderr
        assert again.returncode == 0, text[-3000:]
        assert f"RESUMED {saved}" in text and f"DONE {saved + 3}" in text
        steps = [int(x.split()[1]) for x in again.stdout.splitlines() if x.startswith("STEP ")]
        assert steps[0] == saved + 1, steps

        # a different config refuses that output (exit 14 through RunIdentityError)
        refused = subprocess.run(
            [sys.executable, str(script), out, str(tmp_path / "pod3"), str(saved + 50), "50"],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
        )  # fmt: skip
        assert refused.returncode != 0 and "RunIdentityError" in refused.stderr, refused.stderr[-2000:]
        assert "steps:" in refused.stderr
