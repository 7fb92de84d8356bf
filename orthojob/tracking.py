"""MLflow tracking for the job: one run per stage, nested under the pipeline's run.

* Tracking URI: ``MLFLOW_TRACKING_URI``, else the embedded default ``sqlite:///mlflow.db``
  with artifacts in ``./mlartifacts`` (MLflow's file store is deprecated; the registry
  needs a database store).
* A stage attaches to ``MLFLOW_RUN_ID`` when launched by ``mlflow run`` (or its
  Kubernetes backend) and there is no active run; otherwise it is a child of the
  active run (the pipeline's), or a top-level run.
* Params are flattened, truncated to MLflow's limit and scrubbed of secret values
  (S3 keys, MLflow credentials) — secrets never reach params, tags, metrics or logs.
* :class:`MlflowMetricsCallback` forwards the trainer's logs (TRL's
  ``rewards/<name>/mean|std``, ``reward``, ``reward_std``, ``frac_reward_zero_std``,
  completion lengths, ``kl``) per step, with valid names and without profiling spam.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
DEFAULT_ARTIFACT_ROOT = "mlartifacts"
DEFAULT_EXPERIMENT = "orthorl"
SECRET_ENV_VARS: tuple[str, ...] = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "HF_TOKEN",
)
PARAM_VALUE_LIMIT = 6000
CONNECT_ATTEMPTS = int(os.environ.get("ORTHORL_MLFLOW_RETRIES", "5"))
_METRIC_NAME = re.compile(r"[^A-Za-z0-9_\-. /:]")
_SKIPPED_METRIC_PREFIXES = ("profiling/", "timing/")


class TrackingError(RuntimeError):
    """MLflow could not be reached or refused a request; the message says what to check."""


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def secret_values() -> list[str]:
    """Values of the secret environment variables that are set (8+ characters: shorter values
    would blank ordinary words, and real keys and tokens are longer)."""
    return [v for k in SECRET_ENV_VARS if (v := os.environ.get(k)) and len(v) >= 8]


def redact(text: str) -> str:
    """``text`` with every secret value replaced by ``***``."""
    for secret in secret_values():
        text = text.replace(secret, "***")
    return text


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mapping -> ``{"a.b": "value"}`` strings, truncated and redacted."""
    out: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
            continue
        text = redact(str(value))
        out[name] = text if len(text) <= PARAM_VALUE_LIMIT else text[: PARAM_VALUE_LIMIT - 3] + "..."
    return out


def metric_name(name: str) -> str:
    """A name MLflow accepts (alphanumerics, ``_ - . / : space``)."""
    return _METRIC_NAME.sub("_", name)


def git_commit() -> str:
    """The checkout's commit (``GIT_COMMIT`` in images without .git), or 'unknown'."""
    return os.environ.get("GIT_COMMIT") or _git_head()


@functools.cache
def _git_head() -> str:
    """``git rev-parse HEAD`` of this checkout, or 'unknown' (once per process)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def configure(experiment: str | None = None) -> str:
    """Point MLflow at the tracking server (bounded retries) and select the experiment.

    Returns the experiment id. Raises TrackingError when the server stays unreachable.
    """
    import mlflow

    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    name = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
    delay = 0.5
    for attempt in range(1, CONNECT_ATTEMPTS + 1):
        try:
            exp = mlflow.get_experiment_by_name(name)
            if exp is None:
                location = None
                if uri.startswith("sqlite:"):  # embedded default: artifacts next to the database
                    location = (Path.cwd() / DEFAULT_ARTIFACT_ROOT).resolve().as_uri()
                return mlflow.create_experiment(name, artifact_location=location)
            return exp.experiment_id
        except Exception as exc:
            if attempt == CONNECT_ATTEMPTS:
                raise TrackingError(
                    f"MLflow at {redact(uri)} is unreachable after {attempt} attempts ({type(exc).__name__}). "
                    "Start the server or fix MLFLOW_TRACKING_URI; unset it to use the embedded sqlite store."
                ) from exc
            log.warning(
                "MLflow not reachable (attempt %d/%d); retrying in %.1f s", attempt, CONNECT_ATTEMPTS, delay
            )
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


@contextlib.contextmanager
def stage_run(
    stage: str,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, str] | None = None,
    experiment: str | None = None,
) -> Iterator[Any]:
    """An MLflow run for one pipeline stage (see module docstring for how it attaches)."""
    import mlflow

    experiment_id = configure(experiment)
    active = mlflow.active_run()
    env_run = os.environ.get("MLFLOW_RUN_ID")
    if active is None and env_run:
        run = mlflow.start_run(run_id=env_run)
    else:
        run = mlflow.start_run(experiment_id=experiment_id, run_name=stage, nested=active is not None)
    with run:
        mlflow.set_tags(
            {
                "orthorl.stage": stage,
                "git_commit": git_commit(),
                "image_digest": os.environ.get("IMAGE_DIGEST", "unknown"),
                **(tags or {}),
            }
        )
        if params:
            log_params(params)
        try:
            yield run
        except BaseException as exc:
            mlflow.set_tag("orthorl.error", redact(f"{type(exc).__name__}: {exc}")[:500])
            raise


def log_params(params: Mapping[str, Any]) -> None:
    """Log flattened, redacted params (keys already logged with the same value are fine)."""
    import mlflow

    flat = flatten(params)
    items = list(flat.items())
    for i in range(0, len(items), 100):
        mlflow.log_params(dict(items[i : i + 100]))


def log_metrics(metrics: Mapping[str, Any], step: int | None = None) -> None:
    """Log finite numeric metrics with valid names; skip profiling keys and non-numbers."""
    import mlflow

    clean = {}
    for key, value in metrics.items():
        if key.startswith(_SKIPPED_METRIC_PREFIXES) or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            clean[metric_name(key)] = float(value)
    if clean:
        mlflow.log_metrics(clean, step=step)


def trainer_callback() -> Any:
    """A transformers TrainerCallback that logs every trainer log to the active run (rank 0)."""
    from transformers import TrainerCallback

    class MlflowMetricsCallback(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and state.is_world_process_zero:
                log_metrics(logs, step=state.global_step)

    return MlflowMetricsCallback()
