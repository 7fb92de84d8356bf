"""The multi-node TrainJob's launcher: ``accelerate launch`` (or ``torchrun``) whose exit code is the
workers' fail-fast code.

    python -m orthojob.deploy.launch accelerate launch --config_file=... --module orthojob.job ...
    python -m orthojob.deploy.launch torchrun --nproc_per_node=8 ... script.py ...

torch's elastic agent (under ``accelerate launch`` too) turns any failed worker into its own exit
code 1, so a rank that exits 32 (storage refused) or 3 (GRPO's gate failed) would look like a crash
to the TrainingRuntime's ``podFailurePolicy`` and be retried. This module runs the launcher in
process and reads the worker exit codes from the agent's failure records
(``ChildFailedError.failures``: global rank -> ``ProcessFailure``, with its ``exitcode`` and
``timestamp``): the first failure, by time then rank, whose code is in
:func:`orthojob.ops.exit_codes.fail_fast_codes` becomes this process's exit code; any other failure
exits with the launcher's own code (1). Success is 0.

Signals: the launcher runs in this process (the container's PID 1), so SIGTERM reaches the elastic
agent's own handler, which sends SIGTERM to every worker and waits up to
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (default 30; the TrainJob sets it below its grace
period) for their preemption saves before SIGKILL; the exit code is then 128 + the signal (143).
Before the agent starts its workers (rendezvous), SIGTERM exits 143 at once (a PID 1 without a
handler would ignore it until SIGKILL).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from orthojob.ops.exit_codes import ExitCode, describe, fail_fast_codes

LAUNCHER_FAILED = int(ExitCode.FAILURE)
"""What torchrun and ``accelerate launch`` exit with when a worker failed."""


def worker_failures(exc: BaseException) -> list[tuple[int, int]]:
    """``(global rank, exit code)`` of each failed worker in ``exc`` (a torch elastic
    ``ChildFailedError``), first failure first (by timestamp, then rank); [] for another error."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return []
    ordered = sorted(failures.items(), key=lambda kv: (getattr(kv[1], "timestamp", 0), kv[0]))
    return [(int(rank), int(getattr(f, "exitcode", LAUNCHER_FAILED))) for rank, f in ordered]


def exit_code_for(failures: Iterable[tuple[int, int]], codes: Iterable[int] | None = None) -> int:
    """The first failure's code that is fail-fast; else the launcher's own (1); 0 without failures."""
    failures = list(failures)
    fail_fast = set(fail_fast_codes() if codes is None else codes)
    for _rank, code in failures:
        if code in fail_fast:
            return code
    return LAUNCHER_FAILED if failures else 0


def _run_accelerate(args: list[str]) -> Any:
    from accelerate.commands.launch import launch_command, launch_command_parser

    return launch_command(launch_command_parser().parse_args(args))


def _run_torchrun(args: list[str]) -> Any:
    from torch.distributed import run as distrib_run

    return distrib_run.run(distrib_run.parse_args(args))


def launcher_for(argv: Sequence[str]) -> tuple[Callable[[list[str]], Any], list[str]]:
    """The in-process launcher named by ``argv`` (``accelerate launch ...`` or ``torchrun ...``,
    a leading ``--`` allowed) and its arguments."""
    argv = list(argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if argv[:2] == ["accelerate", "launch"]:
        return _run_accelerate, argv[2:]
    if argv[:1] == ["torchrun"] or argv[:3] == ["python", "-m", "torch.distributed.run"]:
        return _run_torchrun, argv[1:] if argv[0] == "torchrun" else argv[3:]
    raise ValueError(
        "usage: python -m orthojob.deploy.launch accelerate launch ARGS... | torchrun ARGS... "
        f"(got {' '.join(argv) or 'nothing'})"
    )


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def launch(argv: Sequence[str], say: Callable[[str], object] | None = None) -> int:
    """Run the launcher ``argv`` names; the exit code (module docstring)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        run, args = launcher_for(argv)
    except ValueError as exc:
        say(f"orthojob launch: {exc}")
        return int(ExitCode.USAGE)
    previous = signal.signal(signal.SIGTERM, _terminated)  # until the agent installs its own
    try:
        run(args)
    except ChildFailedError as exc:
        failures = worker_failures(exc)
        code = exit_code_for(failures)
        listed = ", ".join(f"rank {r} exited {c} ({describe(c)})" for r, c in failures)
        say(f"orthojob launch: {listed}; exit {code}")
        return code
    except SignalException as exc:
        say(f"orthojob launch: {exc.sigval.name}: the workers were stopped")
        return 128 + int(exc.sigval)
    except subprocess.CalledProcessError as exc:  # accelerate's single-process launcher
        return int(exc.returncode) if exc.returncode > 0 else 128 - int(exc.returncode)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else LAUNCHER_FAILED)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return launch(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
