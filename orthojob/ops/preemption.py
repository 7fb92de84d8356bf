"""Preemption: on SIGTERM, finish the current step, save and sync a checkpoint, end the MLflow run
KILLED, exit 143.

Kubernetes sends SIGTERM, waits ``terminationGracePeriodSeconds`` (the Job's: 300 s), then
SIGKILLs. Raising ``SystemExit(143)`` from the signal handler (what the job did before) stopped
the process mid-step and lost every step since the last periodic save (up to ``save_steps - 1``).
Instead:

* :class:`PreemptionGuard` (a context manager) installs a SIGTERM handler that only records the
  request (async-signal-safe: no I/O, no MLflow call from the handler);
* its :meth:`callback` (a ``TrainerCallback``) sees the request at the next step end and sets
  ``control.should_save`` and ``control.should_training_stop``: the Trainer saves
  ``checkpoint-<step>``, every ``on_save`` callback runs (``checkpoints.checkpoint_sync_callback``
  uploads it, manifest last), and ``trainer.train()`` returns;
* :meth:`exit_if_requested` (after ``train()`` returns) tags the run, ends it ``KILLED`` and
  raises ``SystemExit(143)``: the Job's policy retries 143 and the new pod resumes from the
  checkpoint just synced.

Everywhere else in the Job (SFT stages, gates, evaluation, downloads, the start-up probe),
:func:`install_termination_handler` (installed by ``python -m orthojob.job`` and the ``orthojob``
CLI at start) turns SIGTERM into ``SystemExit(143)`` raised in the main thread at once: the stage
stops within seconds instead of waiting out the grace period (a PID 1 process without a handler
ignores SIGTERM, and the kubelet SIGKILLs it after ``terminationGracePeriodSeconds``). Unwinding
closes the MLflow runs ``KILLED`` (``tracking.stage_run``); what those stages can save is already
saved: each publishes its checkpoint with its gate when it ends, so the retried pod resumes at the
first unfinished stage (``orthojob.stages.pipeline``). An SFT stage or an evaluation cut midway is run
again; GRPO, the long stage, keeps its step-level checkpoints as above. While a
:class:`PreemptionGuard` is active it handles SIGTERM instead, and restores this handler after.

A step that outlasts the grace period is still cut by SIGKILL (exit 137, also retried; the run is
then closed FAILED by the next pod, see ``tracking.close_orphaned_runs``).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from typing import Any

from orthojob.ops.exit_codes import ExitCode

log = logging.getLogger(__name__)

TERMINATED_TAG = "orthorl.terminated"


def _terminate(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: unwinding must not be cut again
    print(
        f"SIGTERM: stopping now (no checkpoint is cut midway; finished stages are published); "
        f"exiting {int(ExitCode.TERMINATED)}",
        flush=True,
    )
    raise SystemExit(int(ExitCode.TERMINATED))


def install_termination_handler() -> bool:
    """SIGTERM -> ``SystemExit(143)`` in the main thread (module docstring). Returns whether it was
    installed (only the main thread can install a handler; elsewhere this does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _terminate)
    return True


class PreemptionGuard:
    """Record SIGTERM; let the trainer save and stop at the next step end (module docstring)."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.signals = signals
        self.requested_at: float | None = None
        self.saved_step: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def _handler(self, signum, frame) -> None:
        if self.requested_at is None:
            self.requested_at = time.monotonic()

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def callback(self) -> Any:
        """The TrainerCallback that turns a recorded SIGTERM into save-and-stop."""
        from transformers import TrainerCallback

        guard = self

        class SaveOnPreemption(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if guard.requested:
                    control.should_save = True
                    control.should_training_stop = True
                return control

            def on_save(self, args, state, control, **kwargs):
                if guard.requested:
                    guard.saved_step = state.global_step
                    log.warning("SIGTERM: saved checkpoint-%d, stopping", state.global_step)

        return SaveOnPreemption()

    def exit_if_requested(self) -> None:
        """After ``trainer.train()`` returned: when SIGTERM came, end the MLflow run KILLED and
        raise ``SystemExit(143)``; otherwise do nothing."""
        if not self.requested:
            return
        waited = time.monotonic() - (self.requested_at or time.monotonic())
        with contextlib.suppress(Exception):
            import mlflow

            if mlflow.active_run() is not None:
                mlflow.set_tags(
                    {
                        TERMINATED_TAG: "SIGTERM",
                        "orthorl.saved_step": str(self.saved_step),
                        "orthorl.seconds_to_save": f"{waited:.1f}",
                    }
                )
                while mlflow.active_run() is not None:
                    mlflow.end_run(status="KILLED")
        print(
            f"SIGTERM: checkpoint-{self.saved_step} saved and synced {waited:.1f} s after the signal; "
            f"exiting {int(ExitCode.TERMINATED)}",
            flush=True,
        )
        raise SystemExit(int(ExitCode.TERMINATED))
