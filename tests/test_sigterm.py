"""SIGTERM anywhere in the Job ends it with exit 143 within seconds, not SIGKILL after the grace period.

Real processes, real signals: the pipeline that the Job's command runs is signalled while its
BC SFT stage trains, and `orthojob evaluate` while it evaluates. Each must exit 143 well inside the
Job's grace period and leave its MLflow run KILLED (preempted, not failed); the retried pod then
resumes at the first unfinished stage (tests/test_resume_stages.py). GRPO's own save-then-stop
path is tests/test_grpo.py's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orthojob.ops.exit_codes import ExitCode

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 30.0
"""What the test allows between SIGTERM and exit: a tenth of the Job's 300 s grace period."""


def env_for(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AWS_", "ORTHORL_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}",
        MLFLOW_EXPERIMENT_NAME="sigterm",
        ORTHORL_WORK_DIR=str(tmp_path / "work"),
    )
    return env


def run_status(tmp_path: Path, name: str) -> str | None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sigterm")
    runs = client.search_runs([exp.experiment_id], f"attributes.run_name = '{name}'")
    return runs[0].info.status if runs else None


def terminate_when_running(
    cmd: list[str], tmp_path: Path, stage: str, settle: float = 1.0
) -> tuple[int, float, str]:
    """Start ``cmd``; once the MLflow run ``stage`` is RUNNING (and ``settle`` s later), SIGTERM the
    process (as the kubelet does PID 1); (exit code, seconds from the signal to exit, output)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")  # the store exists before the job opens it
    if client.get_experiment_by_name("sigterm") is None:
        client.create_experiment("sigterm", artifact_location=(tmp_path / "artifacts").as_uri())
    log = tmp_path / f"{stage}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env_for(tmp_path), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240
        while run_status(tmp_path, stage) != "RUNNING":
            assert proc.poll() is None, f"ended before {stage} started: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        time.sleep(settle)
        assert proc.poll() is None, f"{stage} ended before the signal: {log.read_text()[-3000:]}"
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(GRACE_S * 3)
        return code, time.monotonic() - t, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_during_sft_exits_143_at_once(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "orthojob.job",
        "--preset",
        "tiny-cpu",
        "--steps",
        "1",
        "--out",
        str(tmp_path / "o"),
    ]
    code, seconds, out = terminate_when_running(cmd, tmp_path, "bc_sft", settle=2.0)
    print(f"SIGTERM during BC SFT: exit {code} {seconds:.1f} s after the signal")
    assert code == ExitCode.TERMINATED, out[-3000:]
    assert seconds < GRACE_S
    assert run_status(tmp_path, "bc_sft") == "KILLED"
    assert run_status(tmp_path, "pipeline") == "KILLED"
    assert "SIGTERM" in out


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from orthojob.modeling.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", seed=0)


def test_sigterm_during_evaluation_exits_143_at_once(tmp_path, tiny_checkpoint):
    cmd = [sys.executable, "-m", "orthojob.cli", "evaluate", "--checkpoint", str(tiny_checkpoint),
           "--seeds", "400", "--task-id", "task_easy"]  # fmt: skip
    code, seconds, out = terminate_when_running(cmd, tmp_path, "evaluate", settle=3.0)
    print(f"SIGTERM during evaluation: exit {code} {seconds:.1f} s after the signal")
    assert code == ExitCode.TERMINATED, out[-3000:]
    assert seconds < GRACE_S
    assert run_status(tmp_path, "evaluate") == "KILLED"


def test_the_handler_is_what_the_job_installs(capsys):
    from orthojob import job
    from orthojob.ops import preemption

    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert job.main(["--preset", "tiny-cpu", "--out", "/tmp/x", "--dry-run"], env={}) == 0
        assert signal.getsignal(signal.SIGTERM) is preemption._terminate  # the Job's command, at start
        assert preemption.install_termination_handler() is True
        assert signal.getsignal(signal.SIGTERM) is preemption._terminate
        with preemption.PreemptionGuard() as guard:  # GRPO's guard takes over, then gives it back
            assert signal.getsignal(signal.SIGTERM) == guard._handler
        assert signal.getsignal(signal.SIGTERM) is preemption._terminate
    finally:
        signal.signal(signal.SIGTERM, previous)
