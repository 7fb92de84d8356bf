"""The job's exit codes: one enum, with a meaning and a retry policy per code.

Every place that names an exit code derives it from :class:`ExitCode`: the CLI's return
values and epilogs, the Kubernetes Job's ``podFailurePolicy`` (``k8s/grpo-job.yaml``;
``tests`` compare the YAML to :func:`fail_fast_codes`), ``orthojob k8s status`` and the
exit-code table in ``docs/deploy.md``.

Retry policy, as the Job applies it:

* ``retry``: a transient failure; the Job retries up to ``backoffLimit`` and the retried pod
  resumes from the newest checkpoint in storage.
* ``fail``: retrying cannot change the outcome (a usage error, a gate verdict, a refusal); the
  Job fails at once (``podFailurePolicy`` ``FailJob``).

A pod stopped from outside (preemption, eviction, drain) carries the ``DisruptionTarget``
condition, on which the Job retries without spending ``backoffLimit``, whatever its exit code.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Process exit codes of ``orthojob`` (and of the container's entry point)."""

    OK = 0
    FAILURE = 1
    USAGE = 2
    GRPO_GATE_FAILED = 3
    GATE_MISSING = 10
    GATE_UNREADABLE = 11
    GATE_FAILED = 12
    GATE_DIGEST_MISMATCH = 13
    RUN_MISMATCH = 14
    NO_GATE = 20
    BAD_GATE = 21
    NO_MODEL = 22
    STORAGE = 30
    TRACKING = 31
    STORAGE_DENIED = 32
    TRACKING_DENIED = 33
    KILLED = 137
    TERMINATED = 143

    @property
    def meaning(self) -> str:
        return _MEANINGS[self][0]

    @property
    def retry(self) -> str:
        """``retry`` or ``fail`` (see the module docstring)."""
        return _MEANINGS[self][1]


_MEANINGS: dict[ExitCode, tuple[str, str]] = {
    ExitCode.OK: ("success", "fail"),
    ExitCode.FAILURE: ("unexpected failure (smoke test failed, crash)", "retry"),
    ExitCode.USAGE: ("usage or configuration error", "fail"),
    ExitCode.GRPO_GATE_FAILED: ("training finished; its GRPO quality gate failed", "fail"),
    ExitCode.GATE_MISSING: ("the starting checkpoint has no gate file", "fail"),
    ExitCode.GATE_UNREADABLE: ("the starting checkpoint's gate file is unreadable", "fail"),
    ExitCode.GATE_FAILED: ("a stage's gate (or the starting checkpoint's) failed", "fail"),
    ExitCode.GATE_DIGEST_MISMATCH: ("the gate was written for other weights", "fail"),
    ExitCode.RUN_MISMATCH: ("the output holds a checkpoint of another config (run identity)", "fail"),
    ExitCode.NO_GATE: ("promotion refused: no gate file", "fail"),
    ExitCode.BAD_GATE: ("promotion refused: gate failed or unreadable", "fail"),
    ExitCode.NO_MODEL: ("promotion refused: no logged model for the run", "fail"),
    ExitCode.STORAGE: ("object storage unreachable after bounded retries", "retry"),
    ExitCode.TRACKING: ("MLflow tracking server unreachable after bounded retries", "retry"),
    ExitCode.STORAGE_DENIED: (
        "object storage refused the job (bad keys, no permission on the output prefix, no such bucket)",
        "fail",
    ),
    ExitCode.TRACKING_DENIED: (
        "MLflow refused the job (bad credentials, no permission, MLFLOW_RUN_ID not on this server, "
        "or a server that cannot store artifacts)",
        "fail",
    ),
    ExitCode.KILLED: ("killed (out of memory, or evicted)", "retry"),
    ExitCode.TERMINATED: ("terminated by SIGTERM (preemption, drain, deletion)", "retry"),
}


def fail_fast_codes() -> tuple[int, ...]:
    """Non-zero codes the Job must not retry, ascending (``podFailurePolicy`` ``FailJob``)."""
    return tuple(int(c) for c in ExitCode if c != ExitCode.OK and c.retry == "fail")


def describe(code: int) -> str:
    """A one-line meaning for any exit code, documented or not."""
    try:
        return ExitCode(code).meaning
    except ValueError:
        return f"undocumented exit code {code}"


def epilog(*codes: ExitCode) -> str:
    """``exit codes: 0 success; 2 usage …`` for a CLI epilog."""
    return "exit codes: " + "; ".join(f"{int(c)} {c.meaning}" for c in codes)
