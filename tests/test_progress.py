"""Progress of the long stages: a bar on a terminal, one line per interval in a Job's log."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path
from types import SimpleNamespace

import pytest

from orthojob.ops import progress

REPO = Path(__file__).resolve().parents[1]


def test_the_mode_follows_the_terminal_unless_told():
    assert progress.progress_mode(True, {}) == "bar"
    assert progress.progress_mode(False, {}) == "log"
    assert progress.progress_mode(True, {"ORTHORL_PROGRESS": "log"}) == "log"
    assert progress.progress_mode(False, {"ORTHORL_PROGRESS": " Bar "}) == "bar"
    assert progress.progress_mode(False, {"ORTHORL_PROGRESS": "off"}) == "off"
    with pytest.raises(ValueError, match="use one of bar, log, off"):
        progress.progress_mode(True, {"ORTHORL_PROGRESS": "fancy"})
    assert progress.log_interval({}) == progress.LOG_INTERVAL_S
    assert progress.log_interval({"ORTHORL_PROGRESS_INTERVAL": "5"}) == 5.0
    with pytest.raises(ValueError, match="seconds >= 0"):
        progress.log_interval({"ORTHORL_PROGRESS_INTERVAL": "-1"})


def test_log_lines_come_once_per_interval_with_the_first_and_the_last():
    now = [0.0]
    lines: list[str] = []
    bar = progress.Progress(100, "sft", mode="log", interval=30.0, emit=lines.append, clock=lambda: now[0])
    for _ in range(100):
        now[0] += 1.0  # one step a second
        bar.update(1, {"loss": 0.5})
    assert len(lines) == 5  # at 1 s (the first), 31, 61, 91 s and the last (100 s)
    assert lines[0] == "[sft] step 1/100 (1%), 1 s elapsed, ETA 99 s, loss 0.5"
    assert lines[1].startswith("[sft] step 31/100 (31%), 31 s elapsed, ETA 69 s")
    assert lines[-1] == "[sft] step 100/100 (100%), 100 s elapsed, done, loss 0.5"
    assert not any("\r" in line for line in lines)
    assert progress.log_due(10.0, None, 30.0, 1, 5) and not progress.log_due(10.0, 0.0, 30.0, 2, 5)
    assert progress.log_due(10.0, 9.0, 30.0, 5, 5) and progress.log_due(40.0, 10.0, 30.0, 2, 5)
    assert progress.format_line("upload s3://b/m", 5_000_000, 10_000_000, 4.0, unit="B").startswith(
        "[upload s3://b/m] 5.0/10.0 MB (50%), 4 s elapsed, ETA 4 s"
    )
    silent = progress.Progress(3, "x", mode="off", emit=lines.append)
    silent.update(3)
    assert len(lines) == 5


def test_the_trainer_callback_logs_steps_of_the_total_with_the_loss():
    pytest.importorskip("transformers")
    lines: list[str] = []
    callback = progress.log_progress_callback("grpo", interval=0.0, emit=lines.append)
    state = SimpleNamespace(max_steps=4, global_step=0)
    callback.on_train_begin(None, state, None)
    for step in range(1, 5):
        state.global_step = step
        callback.on_log(None, state, None, logs={"loss": 0.1 * step, "reward": 0.5, "epoch": 1.0})
        callback.on_step_end(None, state, None)
    assert [line.split(",")[0] for line in lines] == [f"[grpo] step {s}/4 ({25 * s}%)" for s in range(1, 5)]
    assert lines[1].endswith("loss 0.2, reward 0.5") and "ETA" in lines[1] and "epoch" not in lines[1]


_CHILD = """
import time
from orthojob.ops.progress import progress
with progress(5, "generate", unit="prompt") as bar:
    for _ in range(5):
        time.sleep(0.01)
        bar.update(1)
"""


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORTHORL_PROGRESS")}
    return {**env, "PYTHONPATH": str(REPO)}


def test_a_pipe_gets_lines_and_a_terminal_gets_a_bar():
    piped = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=_child_env(),
                           cwd=REPO, timeout=60, check=True)  # fmt: skip
    assert "\r" not in piped.stderr
    assert piped.stderr.splitlines()[0].startswith("[generate] prompt 1/5 (20%)")
    assert piped.stderr.splitlines()[-1].startswith("[generate] prompt 5/5 (100%)")
    # a terminal: tqdm's bar, redrawn in place, with the count of the total
    _, text = _on_a_terminal([sys.executable, "-c", _CHILD], REPO)
    assert "\r" in text and "5/5" in text and "generate" in text and "<" in text  # the ETA
    assert "[generate]" not in text


_LIBRARY_BARS = """
import sys
from orthojob import cli
try:
    cli.main(["--help"])
except SystemExit:
    pass
import datasets, transformers
print(transformers.utils.logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled())
"""


@pytest.mark.parametrize(("mode", "enabled"), [("", "False False"), ("bar", "True True")])
def test_the_cli_turns_the_libraries_own_bars_off_in_a_jobs_log(mode, enabled):
    """transformers' weight-loading and datasets' map bars redraw with carriage returns; where stderr
    is a pipe (a Job's log) the CLI turns them off before either library loads, and where the user
    asks for bars it leaves them on."""
    env = {k: v for k, v in _child_env().items() if k not in progress.LIBRARY_BAR_SWITCHES}
    env["ORTHORL_PROGRESS"] = mode
    out = subprocess.run([sys.executable, "-c", _LIBRARY_BARS], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=120, check=True)  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == enabled


def _on_a_terminal(argv: list[str], cwd: Path) -> tuple[int, str]:
    """``argv`` run on a pseudo-terminal 120 columns wide; its exit code and everything it wrote."""
    env = {k: v for k, v in _child_env().items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{cwd / 'mlflow.db'}"
    pid, fd = pty.fork()
    if pid == 0:
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
        os.chdir(cwd)
        os.execve(argv[0], argv, env)
    out = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


@pytest.mark.parametrize(
    ("command", "steps"),
    [
        (["bc-sft", "--preset", "tiny-cpu", "--steps", "3", "--examples", "8"], 3),
        (["grpo", "--preset", "tiny-cpu", "--steps", "2", "--skip-sft-gate", "--max-completion-length", "32",
          "--gate-seeds", "2"], 2),
    ],
    ids=["sft", "grpo"],
)  # fmt: skip
def test_sft_grpo_and_their_gates_draw_bars_with_an_eta_on_a_terminal(tmp_path, command, steps):
    """The stage commands on a pseudo-terminal: the trainer's bar over its steps (redrawn in place,
    with the time left) and the gate's evaluation bar over its prompts; no log-mode lines there."""
    orthojob = str(Path(sys.executable).parent / "orthojob")
    code, text = _on_a_terminal([orthojob, *command, "--out", str(tmp_path / "out")], tmp_path)
    assert code in (0, 3, 12), text[-3000:]  # passed, or a gate failed (a few steps learn nothing)
    frames = [f for line in text.split("\n") for f in line.split("\r")]
    assert any(f"| {steps}/{steps} [" in f and "<" in f for f in frames), text[-3000:]
    assert any(f.startswith("generate:") and "prompt" in f and "<" in f for f in frames), text[-3000:]
    assert "[sft] step" not in text and "[grpo] step" not in text and "[generate] prompt" not in text
