"""A retried pod resumes at the first unfinished stage, from the gated checkpoints already in S3.

The first attempt is a real `orthojob pipeline` process writing to a real S3 (SeaweedFS); it is
SIGKILLed (what an OOM kill or a lost node does) as soon as BC SFT's checkpoint and gate are
published, while its GRPO waits. The second attempt is a fresh pod: an empty work folder, the same output prefix (the
same run name). BC is not trained again (its trainer is replaced by a failure), GRPO runs from the
published BC checkpoint. A third attempt trains nothing. Another config under the same run name is
refused with exit 14. The tiny model and small settings keep it to a few tens of seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from orthojob.ops import storage
from orthojob.ops.exit_codes import ExitCode
from orthojob.stages import pipeline

ROOT = Path(__file__).resolve().parents[1]
RUN = "s3://orthorl/runs/resume-test"
FAST = {
    "base_eval": False,
    "bc_sft.examples": 16,
    "bc_sft.steps": 4,
    "bc_sft_gate.n_seeds": 2,
    "bc_sft_gate.max_new_tokens": 48,
    "bc_sft_gate.thresholds.min_parse_rate": 0.0,
    "bc_sft_gate.thresholds.min_format_reward": 0.0,
    "grpo.steps": 1,
    "grpo.num_generations": 2,
    "grpo.batch_size": 2,
    "grpo.gate_seeds": 2,
    "grpo.max_completion_length": 48,
    "grpo_gate.thresholds.min_parse_rate": 0.0,
    "grpo_gate.thresholds.min_format_reward": 0.0,
    "grpo_gate.thresholds.min_margin_over_slerp": -100.0,
    "grpo_gate.thresholds.max_p_no_better_than_slerp": None,
    "evaluate.n_seeds": 1,
    "evaluate.max_new_tokens": 48,
    "evaluate.baselines": False,
}


def set_args(overrides: dict) -> list[str]:
    return [a for k, v in overrides.items() for a in ("--set", f"{k}={json.dumps(v)}")]


# The first pod's GRPO waits instead of training, so that the kill always lands before GRPO publishes:
# with one step GRPO can finish within the poll below. Only that pod loads this (its own PYTHONPATH).
HOLD_GRPO = """import time
import orthojob.stages.grpo as grpo

def _held(*args, **kwargs):
    time.sleep(600)
    raise SystemExit(1)

grpo.run_grpo = _held
"""


def first_attempt_killed_after_bc_gate(s3, tmp_path: Path) -> float:
    """Run the pipeline in its own process (its GRPO held); SIGKILL it once bc_sft (checkpoint + gate)
    is in S3."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_RUN_ID", "AWS_"))}
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "sitecustomize.py").write_text(HOLD_GRPO)
    env.update(s3.env(), PYTHONPATH=f"{hold}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1",
               ORTHORL_WORK_DIR=str(tmp_path / "pod1"))  # fmt: skip
    cmd = [sys.executable, "-m", "orthojob.cli", "pipeline", "--preset", "tiny-cpu", "--out", RUN]
    log = tmp_path / "pod1.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            cmd + set_args(FAST),
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
            start_new_session=True,
        )
    t = time.monotonic()
    try:
        while storage.read_manifest(f"{RUN}/bc_sft") is None:
            assert proc.poll() is None, (
                f"the first attempt ended (exit {proc.returncode}): {log.read_text()[-3000:]}"
            )
            assert time.monotonic() - t < 180, log.read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    assert storage.read_manifest(f"{RUN}/grpo") is None, "killed before GRPO finished"
    return time.monotonic() - t


def test_a_retried_pod_resumes_after_bc_and_never_trains_it_again(s3_env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seconds = first_attempt_killed_after_bc_gate(s3_env, tmp_path)
    print(f"first attempt killed {seconds:.1f} s after start, once bc_sft was published")
    published = storage.read_manifest(f"{RUN}/bc_sft")
    assert {"gate_passed.json", "run_identity.json"} <= set(published["files"])
    assert storage.read_manifest(f"{RUN}/tiny-model") is not None, "the chain's base is kept with the run"

    def no_training(*args, **kwargs):
        raise AssertionError("a finished stage was trained again")

    # the second pod: fresh work folder, same output prefix
    monkeypatch.setenv("ORTHORL_WORK_DIR", str(tmp_path / "pod2"))
    monkeypatch.setattr(pipeline, "run_sft", no_training)
    t = time.monotonic()
    summary = pipeline.run_pipeline("tiny-cpu", RUN, FAST)
    print(f"second attempt: {time.monotonic() - t:.1f} s, exit {summary['exit_code']}")
    stages = summary["stages"]
    assert stages["bc_sft"]["resumed_from"] == f"{RUN}/bc_sft"
    assert stages["tiny-model"]["reused"] is True
    assert stages["bc_sft"]["steps"] == 4, "the first attempt's record is carried over"
    assert stages["gate_bc_sft"]["resumed"] is True and stages["gate_bc_sft"]["passed"] is True
    assert "resumed_from" not in stages["grpo"] and stages["grpo"]["steps"] == 1
    assert stages["grpo"]["from_checkpoint"] == f"{RUN}/bc_sft"
    assert summary["exit_code"] in (0, ExitCode.GRPO_GATE_FAILED) and "evaluate" in stages
    assert storage.read_manifest(f"{RUN}/grpo") is not None

    # a third pod: everything is finished; only the evaluation runs again
    monkeypatch.setenv("ORTHORL_WORK_DIR", str(tmp_path / "pod3"))
    monkeypatch.setattr(pipeline, "run_grpo", no_training)
    t = time.monotonic()
    again = pipeline.run_pipeline("tiny-cpu", RUN, FAST)
    print(f"third attempt: {time.monotonic() - t:.1f} s")
    assert again["stages"]["grpo"]["resumed_from"] == f"{RUN}/grpo"
    assert again["exit_code"] == summary["exit_code"]

    # another config under the same run name: refused, never trained over
    monkeypatch.setenv("ORTHORL_WORK_DIR", str(tmp_path / "pod4"))
    other = pipeline.run_pipeline("tiny-cpu", RUN, {**FAST, "bc_sft.steps": 5})
    assert other["exit_code"] == ExitCode.RUN_MISMATCH
    assert (
        "sft" not in other["stages"].get("grpo", {}) and "steps: 4 -> 5" in other["stages"]["bc_sft"]["error"]
    )
