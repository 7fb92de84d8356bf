"""A storage or tracking failure as the job's exit code: refused (never retried, the message says what
to fix) or unreachable (retried).
"""

from __future__ import annotations

import sys

from orthojob.ops import storage
from orthojob.ops.exit_codes import ExitCode
from orthojob.ops.tracking import ArtifactStoreError, TrackingError, redact

TRACKING_REFUSALS = ("UNAUTHENTICATED", "PERMISSION_DENIED", "error code 401", "error code 403")
"""How an MLflow refusal reads (error codes of MlflowException, or the HTTP status in its text)."""


def tracking_refused(exc: BaseException | None) -> bool:
    """Whether a tracking failure is the server refusing the job (credentials, permission)."""
    while exc is not None:
        code = str(getattr(exc, "error_code", ""))
        if code in TRACKING_REFUSALS or any(r in str(exc) for r in TRACKING_REFUSALS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def job_error_code(exc: BaseException) -> int:
    """The exit code of a storage or tracking failure: refused (32, 33: never retried, the message
    says what to fix) or unreachable (30, 31: retried)."""

    if isinstance(exc, ArtifactStoreError):
        return ExitCode.TRACKING_DENIED
    if isinstance(exc, TrackingError):
        return ExitCode.TRACKING_DENIED if tracking_refused(exc) else ExitCode.TRACKING
    return ExitCode.STORAGE_DENIED if isinstance(exc, storage.StorageAccessError) else ExitCode.STORAGE


def report_job_error(command: str, exc: BaseException) -> int:
    """Print a storage or tracking failure as ``orthojob <command>: <message>`` (secrets redacted)
    on stderr; returns its exit code (:func:`job_error_code`)."""

    code = job_error_code(exc)
    print(f"orthojob {command}: {redact(str(exc))} (exit {int(code)})", file=sys.stderr)
    return code
