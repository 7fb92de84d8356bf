"""MLflow tracking for the job: one run per stage, nested under the pipeline's run.

* Tracking URI: ``MLFLOW_TRACKING_URI``, else the embedded default ``sqlite:///mlflow.db``
  with artifacts in ``./mlartifacts`` (MLflow's file store is deprecated; the registry
  needs a database store).
* A stage attaches to ``MLFLOW_RUN_ID`` when launched by ``mlflow run`` (or its
  Kubernetes backend) and there is no active run, and consumes the variable (MLflow's
  ``start_run(run_id=...)`` leaves it set, and the next ``start_run(nested=True)`` would
  then reuse the parent instead of making a child); otherwise it is a child of the active
  run (the pipeline's, in the parent's experiment), or a top-level run.
* Fail fast: :func:`configure` probes the server once with MLflow's own HTTP retries
  (``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` / ``_TIMEOUT`` / ``_BACKOFF_*``) sized to a deadline,
  ``ORTHORL_TRACKING_DEADLINE_S`` (default 45 s), and a watchdog that holds the whole probe
  (DNS included) to that deadline; :class:`TrackingError` then becomes exit 31. Before it, with
  ``ORTHORL_TRACKING_WAIT_S`` set (the Job sets it), it waits that long for the server's ``/health``
  (:func:`wait_for_server`: a server still scheduling or starting).
* :func:`probe_artifacts` logs and deletes a tiny artifact through a tracking server, so a server
  that cannot store artifacts stops the job before training (:class:`ArtifactStoreError`, exit 33).
* Params are flattened, truncated to MLflow's limit and scrubbed of secret values
  (S3 keys, MLflow credentials) — secrets never reach params, tags, metrics or logs.
* :class:`MlflowMetricsCallback` forwards the trainer's logs (TRL's
  ``rewards/<name>/mean|std``, ``reward``, ``reward_std``, ``frac_reward_zero_std``,
  completion lengths, ``kl``) per step, with valid names and without profiling spam. It is kept
  instead of transformers' ``MLflowCallback`` (``report_to="mlflow"``), which logs every numeric key
  (TRL's per-call ``profiling/*`` timings, booleans and non-finite values included), and at setup
  logs every ``TrainingArguments`` field and the model config as params and may start (and end) a run
  of its own; here params are the stage run's (flattened, redacted) and only the metrics come per step.
* :func:`log_table_rows` appends rows to an MLflow table of the active run (GRPO's completions).
* A planner is judged in MLflow by one headline metric, the scaled terminal reward, under the names
  of :mod:`orthojob.core.metrics`: ``gate/scaled_reward_mean`` and ``gate/hard_rule_share`` (with
  ``gate/hard_rule_share_over_oracle``, the bound every quality gate checks) in a gate's run, the
  pipeline evaluation's ``scaled_reward_mean/<planner>`` and ``hard_rule_share/<planner>``, the
  learning experiment's ``heldout/scaled_reward``; per GRPO step it is TRL's
  ``rewards/reward_terminal/mean``. The raw [0, 1] score appears only as ``*terminal_raw*``
  (``env/terminal_raw_mean``, ``gate/terminal_raw_mean``), for reference.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
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
DEADLINE_ENV = "ORTHORL_TRACKING_DEADLINE_S"
WAIT_ENV = "ORTHORL_TRACKING_WAIT_S"
"""Seconds the job waits for a tracking server's ``/health`` before its probe (0, the default: no
wait); the Job sets it, since its MLflow server may still be scheduling or starting."""
DEFAULT_DEADLINE_S = 45.0  # + process start-up (imports): exit 31 well inside a minute
PROBE_RETRIES = 3  # MLflow's retries for the start-up probe: 4 attempts, back-off 0, 2, 4 s
_METRIC_NAME = re.compile(r"[^A-Za-z0-9_\-. /:]")
_SKIPPED_METRIC_PREFIXES = ("profiling/", "timing/")


class TrackingError(RuntimeError):
    """MLflow could not be reached or refused a request; the message says what to check."""


_STAGE_RUNS: dict[str, str] = {}
"""The run id of the latest :func:`stage_run` of each stage in this process."""


def last_stage_run(stage: str) -> str | None:
    """The MLflow run id of this process's latest ``stage`` run (e.g. ``grpo``, to promote it), or
    None. Not ``mlflow.last_active_run()``: that returns the *active* run, which under the
    pipeline is the parent ``pipeline`` run, not the stage that just ended."""
    return _STAGE_RUNS.get(stage)


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


def deadline_s() -> float:
    """Seconds the start-up probe may take before the job gives up (``ORTHORL_TRACKING_DEADLINE_S``)."""
    raw = os.environ.get(DEADLINE_ENV, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_DEADLINE_S
    except ValueError as exc:
        raise TrackingError(f"{DEADLINE_ENV}={raw!r} is not a number of seconds") from exc
    if value <= 0:
        raise TrackingError(f"{DEADLINE_ENV} must be > 0, got {raw!r}")
    return value


def probe_http_settings(deadline: float) -> dict[str, str]:
    """MLflow's own HTTP retry settings for the start-up probe, sized so that the worst case
    (every attempt timing out, plus the back-off between attempts) stays inside ``deadline``.

    urllib3 sleeps 0, 2f, 4f ... between attempts (f = back-off factor, plus up to ``jitter``);
    with :data:`PROBE_RETRIES` = 3, f = 1 and jitter 0.5 that is at most 7.5 s, and each of the 4
    attempts gets what is left, at least 1 s. MLflow's defaults (7 retries, factor 2, 120 s
    timeout) take about 4 minutes against a dead server."""
    attempts = PROBE_RETRIES + 1
    backoff = 0 + 2 + 4 + PROBE_RETRIES * 0.5
    timeout = max(1, int((deadline - backoff) / attempts))
    return {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(PROBE_RETRIES),
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
        "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(timeout),
    }


def wait_s() -> float:
    """:data:`WAIT_ENV`'s seconds (0 when unset)."""
    raw = os.environ.get(WAIT_ENV, "")
    try:
        value = float(raw) if raw.strip() else 0.0
    except ValueError as exc:
        raise TrackingError(f"{WAIT_ENV}={raw!r} is not a number of seconds") from exc
    if value < 0:
        raise TrackingError(f"{WAIT_ENV} must be >= 0, got {raw!r}")
    return value


def wait_for_server(uri: str, seconds: float, say=print, poll_s: float = 2.0) -> float:
    """Poll ``uri``'s ``/health`` until it answers 200 or ``seconds`` pass; returns the seconds
    waited. Raises :class:`TrackingError` (exit 31, retried by the Job) when it never answers."""
    import time
    import urllib.request

    url = uri.rstrip("/") + "/health"
    start = time.monotonic()
    said = start
    while True:
        try:
            with urllib.request.urlopen(url, timeout=min(5.0, max(seconds, 1.0))) as answer:
                if answer.status == 200:
                    return time.monotonic() - start
                problem = f"HTTP {answer.status}"
        except OSError as exc:  # URLError and HTTPError are OSErrors
            problem = f"{type(exc).__name__}: {exc}"
        now = time.monotonic()
        if now - start >= seconds:
            raise TrackingError(
                f"MLflow at {redact(uri)} did not answer /health within {seconds:.0f} s ({redact(problem)}). "
                f"Is the server scheduled and running (kubectl -n orthorl get pods -l "
                f"app.kubernetes.io/component=mlflow)? {WAIT_ENV} sets the wait."
            )
        if now - said >= 30:
            say(
                f"[job] waiting for MLflow at {redact(uri)}: {now - start:.0f} s of {seconds:.0f} ({redact(problem)})"
            )
            said = now
        time.sleep(min(poll_s, max(0.0, seconds - (now - start))))


@contextlib.contextmanager
def _env(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables that are not already set by the user; restore afterwards."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _experiment_id(name: str, uri: str) -> str:
    import mlflow

    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if uri.startswith("sqlite:"):  # embedded default: artifacts next to the database
        location = (Path.cwd() / DEFAULT_ARTIFACT_ROOT).resolve().as_uri()
    return mlflow.create_experiment(name, artifact_location=location)


def _bounded(call: Callable[[], Any], deadline: float, name: str) -> tuple[str, Any]:
    """``call()`` in a watchdog thread with MLflow's probe retries (:func:`probe_http_settings`),
    held to ``deadline`` seconds, DNS included: ``("ok", value)``, ``("error", exception)`` or
    ``("timeout", None)`` (the thread is a daemon and is left behind)."""
    outcome: list[tuple[str, Any]] = []

    def run() -> None:
        try:
            outcome.append(("ok", call()))
        except BaseException as exc:
            outcome.append(("error", exc))

    with _env(probe_http_settings(deadline)):
        worker = threading.Thread(target=run, name=name, daemon=True)
        worker.start()
        worker.join(deadline)
    return outcome[0] if outcome else ("timeout", None)


def configure(experiment: str | None = None) -> str:
    """Point MLflow at the tracking server and select the experiment; returns its id.

    One probe (get or create the experiment) with MLflow's own retries, sized by
    :func:`probe_http_settings` to :func:`deadline_s` (explicit ``MLFLOW_HTTP_REQUEST_*``
    variables win); the settings apply to the probe only, so a short blip later in a long
    training run still gets MLflow's longer defaults. There is no retry loop of our own on top
    of MLflow's (that made ~5 x 4 minutes): a watchdog thread bounds the probe, DNS included,
    which urllib3's timeouts do not cover. Raises TrackingError when the deadline passes or the
    server answers with an error.
    """
    import mlflow

    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    name = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
    if not uri.startswith(("http://", "https://")):  # a local store: nothing to wait for
        return _experiment_id(name, uri)
    deadline = deadline_s()
    if wait_s() > 0:
        wait_for_server(uri, wait_s())
    status, value = _bounded(lambda: _experiment_id(name, uri), deadline, "mlflow-probe")
    hint = (
        f"Start the server or fix MLFLOW_TRACKING_URI; unset it to use the embedded sqlite store "
        f"({DEADLINE_ENV} sets the deadline)."
    )
    if status == "timeout":
        raise TrackingError(f"MLflow at {redact(uri)} did not answer within {deadline:.0f} s. {hint}")
    if status == "error":
        exc = value
        raise TrackingError(
            f"MLflow at {redact(uri)} is unreachable or refused the request within {deadline:.0f} s "
            f"({type(exc).__name__}: {redact(str(exc))[:300]}). {hint}"
        ) from exc
    return value


class ArtifactStoreError(TrackingError):
    """The tracking server answers but cannot store an artifact (exit 33: never retried, the message
    says what to fix on the server)."""


ARTIFACT_PROBE_RUN = "orthorl-artifact-probe"
ARTIFACT_PROBE_FILE = "orthorl-artifact-probe.txt"


def probe_artifacts(experiment_id: str) -> str:
    """Log a tiny artifact through the tracking server and delete it, in a run of its own (deleted
    after), within :func:`deadline_s`: what every stage's upload will need. A server that answers but
    cannot store artifacts (an empty ``--artifacts-destination``, no keys or endpoint for its bucket)
    otherwise fails only after a stage has trained. Returns what was checked; raises
    :class:`ArtifactStoreError`. Only for an ``http(s)`` tracking URI (a local store writes files)."""
    import tempfile

    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
    from mlflow.tracking import MlflowClient

    uri = tracking_uri()
    deadline = deadline_s()
    client = MlflowClient()

    def probe() -> str:
        run = client.create_run(
            experiment_id, run_name=ARTIFACT_PROBE_RUN, tags={"orthorl.probe": "artifacts"}
        )
        try:
            with tempfile.TemporaryDirectory() as tmp:
                marker = Path(tmp) / ARTIFACT_PROBE_FILE
                marker.write_text("written by the job's start-up probe, then deleted\n")
                client.log_artifact(run.info.run_id, str(marker))
            listed = [f.path for f in client.list_artifacts(run.info.run_id)]
            if ARTIFACT_PROBE_FILE not in listed:
                raise RuntimeError(f"the uploaded artifact is not listed (found {listed})")
            get_artifact_repository(run.info.artifact_uri).delete_artifacts(ARTIFACT_PROBE_FILE)
            return run.info.artifact_uri
        finally:
            with contextlib.suppress(Exception):
                client.delete_run(run.info.run_id)

    status, value = _bounded(probe, deadline, "mlflow-artifact-probe")
    fix = (
        "The tracking server answers but cannot store artifacts: give it an artifact destination "
        "(MLFLOW_ARTIFACTS_DESTINATION, e.g. s3://BUCKET/mlflow, in the ConfigMap orthorl-mlflow-server) "
        "and the keys and, for an S3-compatible store, MLFLOW_S3_ENDPOINT_URL in the Secret "
        "orthorl-mlflow-server (docs/deploy.md)."
    )
    if status == "ok":
        return f"an artifact logged and deleted through {redact(uri)} ({value})"
    if status == "timeout":
        raise ArtifactStoreError(
            f"MLflow at {redact(uri)}: an artifact upload did not finish within {deadline:.0f} s. {fix}"
        )
    exc = value
    raise ArtifactStoreError(
        f"MLflow at {redact(uri)} refused an artifact upload ({type(exc).__name__}: {redact(str(exc))[:300]}). {fix}"
    ) from exc


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
        # consumed here: start_run(run_id=...) leaves MLFLOW_RUN_ID set (MLflow 3.17), and every
        # later start_run(nested=True) would reuse this run instead of making a child
        os.environ.pop("MLFLOW_RUN_ID", None)
        run = mlflow.start_run(run_id=env_run)
    else:
        if active is not None:  # a child lives in its parent's experiment
            experiment_id = active.info.experiment_id
        with _without("MLFLOW_RUN_ID"):
            run = mlflow.start_run(experiment_id=experiment_id, run_name=stage, nested=active is not None)
    _STAGE_RUNS[stage] = run.info.run_id
    with run:
        k8s = {
            f"k8s.{k[4:].lower()}": v for k in ("K8S_JOB_NAME", "K8S_POD_NAME") if (v := os.environ.get(k))
        }
        mlflow.set_tags(
            {
                "orthorl.stage": stage,
                "git_commit": git_commit(),
                "image_digest": image_digest(run),
                **k8s,
                **(tags or {}),
            }
        )
        if active is None and "k8s.job_name" in k8s:
            close_orphaned_runs(run.info.experiment_id, k8s["k8s.job_name"], run.info.run_id)
        if params:
            log_params(params)
        try:
            yield run
        except BaseException as exc:
            current = mlflow.active_run()
            if current is not None and current.info.run_id == run.info.run_id:  # not ended already
                mlflow.set_tag("orthorl.error", redact(f"{type(exc).__name__}: {exc}")[:500])
                if isinstance(exc, SystemExit) and exc.code == 143:  # SIGTERM: preempted, not failed
                    mlflow.end_run(status="KILLED")
            raise


def image_digest(run: Any = None) -> str:
    """The image this process runs: ``IMAGE_DIGEST`` (set by the manifests), else what MLflow's
    Kubernetes backend recorded on the run it launched (``mlflow.docker.image.uri`` and the pushed
    digest ``mlflow.docker.image.id``), else 'unknown'."""
    value = os.environ.get("IMAGE_DIGEST", "").strip()
    if value:
        return value
    with contextlib.suppress(Exception):
        import mlflow

        tags = mlflow.tracking.MlflowClient().get_run(run.info.run_id).data.tags if run is not None else {}
        uri, digest = tags.get("mlflow.docker.image.uri"), tags.get("mlflow.docker.image.id")
        if uri and digest:
            return f"{uri.split('@')[0]}@{digest}" if digest.startswith("sha256:") else f"{uri} ({digest})"
        if uri or digest:
            return uri or digest
    return "unknown"


def close_orphaned_runs(experiment_id: str, job_name: str, current_run_id: str) -> list[str]:
    """End FAILED the runs an earlier pod of the same Kubernetes Job left RUNNING.

    A pod killed by SIGKILL (out of memory, the grace period exceeded) cannot end its run; its
    retry (same ``K8S_JOB_NAME``) finds those runs by the ``k8s.job_name`` tag and closes them,
    tagged ``orthorl.orphaned``. Returns their ids; never raises (tracking must not fail a job)."""
    closed: list[str] = []
    with contextlib.suppress(Exception):
        from mlflow.tracking import MlflowClient

        client = MlflowClient()
        safe = job_name.replace("'", "")
        runs = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`k8s.job_name` = '{safe}' and attributes.status = 'RUNNING'",
            max_results=100,
        )
        for found in runs:
            if found.info.run_id == current_run_id:
                continue
            client.set_tag(
                found.info.run_id, "orthorl.orphaned", f"closed by {os.environ.get('K8S_POD_NAME', '?')}"
            )
            client.set_terminated(found.info.run_id, status="FAILED")
            closed.append(found.info.run_id)
    if closed:
        log.warning(
            "closed %d run(s) an earlier pod of Job %s left RUNNING: %s", len(closed), job_name, closed
        )
    return closed


@contextlib.contextmanager
def _without(name: str) -> Iterator[None]:
    """The environment variable ``name`` unset for the block, restored afterwards."""
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


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


def log_case_set(source: str, digest: str, split: str, n_cases: int, n_patients: int, context: str) -> bool:
    """Record a case set a run trained or was judged on as an MLflow dataset input
    (``mlflow.log_input``): its source (a path or ``s3://`` URI), the digest of its split, which side
    (``split``: train or heldout) and how many cases and patients, so the Runs table shows which
    patients a model saw. ``context``: ``training`` or ``evaluation``. False when no run is active."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or mlflow.active_run() is None:
        return False
    from mlflow.data.http_dataset_source import HTTPDatasetSource
    from mlflow.data.meta_dataset import MetaDataset

    uri = source if "://" in source else Path(source).resolve().as_uri()
    name = f"{Path(source).name}:{split}"
    dataset = MetaDataset(HTTPDatasetSource(uri), name=name, digest=digest[:36])
    tags = {"split": split, "cases": str(n_cases), "patients": str(n_patients), "split_digest": digest}
    mlflow.log_input(dataset, context=context, tags=tags)
    return True


def log_table_rows(rows: list[dict], artifact_file: str) -> bool:
    """Append ``rows`` (dicts with the same keys) to the active run's MLflow table ``artifact_file``
    (``mlflow.log_table``: one JSON artifact per run, which MLflow extends on every call, shown as
    one table in the run's Artifacts tab and comparable across runs in the experiment's evaluation
    view). Strings are redacted. False, with a warning, when nothing was logged: no active run, or
    MLflow refused (a table never stops training)."""
    mlflow = sys.modules.get("mlflow")  # only when a stage run was opened (the job imported mlflow)
    if not rows or mlflow is None or mlflow.active_run() is None:
        return False
    columns = {k: [redact(v) if isinstance(v, str) else v for v in (r.get(k) for r in rows)] for k in rows[0]}
    try:
        with _env({"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}):  # a download bar per step otherwise
            mlflow.log_table(columns, artifact_file=artifact_file)
    except Exception as exc:
        log.warning("MLflow table %s not logged: %s", artifact_file, redact(str(exc))[:300])
        return False
    return True


def trainer_callback() -> Any:
    """A transformers TrainerCallback that logs every trainer log to the active run (rank 0)."""
    from transformers import TrainerCallback

    class MlflowMetricsCallback(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and state.is_world_process_zero:
                log_metrics(logs, step=state.global_step)

    return MlflowMetricsCallback()
