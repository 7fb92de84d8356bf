"""`python -m orthojob.deploy.launch`: the TrainJob's launcher exits with the workers' fail-fast code.

Real launches on CPU (gloo, two workers): torchrun and `accelerate launch` with the TrainJob's own
accelerate config; a rank's exit code in :func:`orthojob.ops.exit_codes.fail_fast_codes` becomes the
launcher's, any other failure stays 1, success 0; SIGTERM to the launcher reaches every worker,
which gets ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds to save before torch's agent kills it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed.run")

from orthojob.deploy import launch
from orthojob.ops.exit_codes import fail_fast_codes
from tests.services import free_port, run_process_group

ROOT = Path(__file__).resolve().parents[1]

WORKER = """
import os, sys, time
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
codes = [int(c) for c in os.environ["WORKER_CODES"].split(",")]
dist.barrier()
if codes[rank]:
    sys.exit(codes[rank])
if any(codes):
    time.sleep(60)  # a rank still working when another fails: the agent stops it
dist.destroy_process_group()
"""

SAVING_WORKER = """
import os, signal, sys, time
import torch.distributed as dist

rank = int(os.environ["RANK"])
out = os.environ["OUT_DIR"]

def on_sigterm(signum, frame):  # the preemption save: it takes SAVE_S seconds
    time.sleep(float(os.environ["SAVE_S"]))
    open(os.path.join(out, f"saved-{rank}"), "w").close()
    os._exit(143)

signal.signal(signal.SIGTERM, on_sigterm)
dist.init_process_group("gloo")
dist.barrier()
open(os.path.join(out, f"ready-{rank}"), "w").close()
time.sleep(60)
"""


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_ELASTIC", "TORCHELASTIC"))}
    return {**base, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **extra}


def torchrun(script: Path) -> list[str]:
    return [
        "torchrun",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "--max_restarts=0",
        "--monitor_interval=0.2",
        str(script),
    ]


def wrapped(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "orthojob.deploy.launch", *argv]


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("launch") / "worker.py"
    path.write_text(WORKER)
    return path


@pytest.mark.parametrize(("codes", "want"), [("0,32", 32), ("1,0", 1), ("0,0", 0)])
def test_torchrun_worker_code_is_the_launchers(worker, codes, want):
    proc = run_process_group(
        wrapped(torchrun(worker)),
        env(WORKER_CODES=codes),
        ROOT,
        timeout=120,
        what="orthojob.deploy.launch torchrun",
    )
    assert proc.returncode == want, proc.stderr[-3000:]
    if want == 32:
        assert "rank 1 exited 32" in proc.stderr
        # what it replaces: torchrun itself turns the worker's 32 into 1
        plain = run_process_group(
            [sys.executable, "-m", "torch.distributed.run", *torchrun(worker)[1:]],
            env(WORKER_CODES=codes),
            ROOT,
            timeout=120,
            what="torchrun",
        )
        assert plain.returncode == 1, plain.stderr[-3000:]


def test_accelerate_launch_with_the_trainjob_config(worker):
    """The TrainJob's command shape (`accelerate launch --config_file=<FSDP config> --num_machines
    ... --main_process_ip ... --num_processes ...`), two CPU processes: a rank's 32 is the exit code."""
    argv = [
        "accelerate",
        "launch",
        f"--config_file={ROOT / 'k8s' / 'config' / 'accelerate_fsdp.yaml'}",
        "--num_machines=1",
        "--machine_rank=0",
        "--main_process_ip=127.0.0.1",
        f"--main_process_port={free_port()}",
        "--num_processes=2",
        "--monitor_interval=0.2",
        str(worker),
    ]
    proc = run_process_group(
        wrapped(argv), env(WORKER_CODES="32,0"), ROOT, timeout=180, what="accelerate launch"
    )
    assert proc.returncode == 32, proc.stderr[-3000:]
    assert "rank 0 exited 32" in proc.stderr


def sigterm_run(tmp_path: Path, shutdown_timeout: str, save_s: float) -> tuple[int, set[str], str]:
    """Launch two saving workers, SIGTERM the launcher alone (as the kubelet does PID 1), and return
    its exit code, the files the workers wrote and its stderr."""
    out = tmp_path / f"out-{shutdown_timeout}"
    out.mkdir()
    script = tmp_path / "saving_worker.py"
    script.write_text(SAVING_WORKER)
    extra = {"OUT_DIR": str(out), "SAVE_S": str(save_s), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": shutdown_timeout}
    proc = subprocess.Popen(wrapped(torchrun(script)), cwd=ROOT, env=env(**extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not {"ready-0", "ready-1"} <= {p.name for p in out.iterdir()}:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, {p.name for p in out.iterdir()}, stderr


def test_sigterm_reaches_every_worker_and_waits_for_its_save(tmp_path):
    code, files, stderr = sigterm_run(tmp_path, shutdown_timeout="30", save_s=3)
    assert code == 143, stderr[-3000:]
    assert {"saved-0", "saved-1"} <= files, stderr[-3000:]


def test_the_shutdown_timeout_cuts_a_longer_save(tmp_path):
    """TORCH_ELASTIC_SHUTDOWN_TIMEOUT is what the installed torch reads: 1 s kills a 4 s save (the
    TrainJob sets it just under its grace period, tests/test_deploy.py)."""
    code, files, stderr = sigterm_run(tmp_path, shutdown_timeout="1", save_s=4)
    assert code == 143, stderr[-3000:]
    assert not {"saved-0", "saved-1"} & files, files


def failure(exitcode: int, timestamp: int):
    """torch's own failure record, with the time it was seen set."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    record = ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file="<N/A>")
    record.timestamp = timestamp
    return record


def test_the_first_fail_fast_failure_wins():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    exc = ChildFailedError("orthojob.job", {0: failure(-15, 7), 5: failure(3, 6), 2: failure(32, 6)})
    assert launch.worker_failures(exc) == [(2, 32), (5, 3), (0, -15)]
    assert launch.exit_code_for(launch.worker_failures(exc)) == 32
    assert launch.exit_code_for([(0, -15), (1, 1)]) == 1  # none fail-fast: the launcher's own 1
    assert launch.exit_code_for([(0, 1), (1, 33)]) == 33  # a later fail-fast one still counts
    assert launch.exit_code_for([]) == 0
    assert launch.worker_failures(RuntimeError("x")) == []
    assert set(fail_fast_codes()) >= {2, 3, 32, 33}


def test_usage_and_the_launchers_it_knows(capsys):
    assert launch.launch(["python", "train.py"]) == 2
    assert "usage" in capsys.readouterr().err
    assert launch.launcher_for(["--", "accelerate", "launch", "-m", "x"])[1] == ["-m", "x"]
    assert launch.launcher_for(["torchrun", "--nproc_per_node=2", "s.py"])[1] == [
        "--nproc_per_node=2",
        "s.py",
    ]
