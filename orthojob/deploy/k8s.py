"""``orthojob k8s render|submit|logs|status``: the GRPO Job on a cluster, rendered from k8s/ by kustomize.

* :func:`render` runs ``kubectl kustomize`` over a kustomization directory (``--kustomize DIR``;
  default: ``k8s/`` of the working directory, else of the checkout this module lives in), so the
  objects are exactly what ``kubectl apply -k`` would apply: k8s/grpo-job.yaml with every patch,
  replacement and component the kustomization enables (the run parameters, the image of
  k8s/image, the MLflow server, the GPU node selector, Kueue's queue label, pull secrets, ...).
  Then it applies what a kustomization cannot say per submission, :class:`Overrides`: the image
  (wherever the kustomization put the Job's image; also the IMAGE_DIGEST env that MLflow runs are
  tagged with), the ConfigMap's run parameters (steps, task, model, preset, starting checkpoint,
  output base and run name, MLflow tracking URI and experiment), the namespace, the model cache
  (``emptydir``: the component k8s/model-cache/emptydir, added by kustomize in a temporary overlay)
  and a name suffix (the Job and the ConfigMap it reads both get it, so concurrent runs never share
  parameters). Outputs never collide: the Job writes below ``OUTPUT_URI/<job name>-<uid[:8]>``
  (orthojob/job.py), so every submitted Job has its own prefix.
* :func:`submit` creates those objects with the kubernetes client: shared ones (ServiceAccount,
  the model cache's PersistentVolumeClaim, NetworkPolicy, the MLflow server's objects, ...) only
  if missing -- 409 (exists) and 403 (a namespace where ML users may not create them, the normal
  case on multi-tenant clusters: an admin made them) are fine -- then the Job's ConfigMap, the Job,
  and makes the Job the ConfigMap's owner so that ``ttlSecondsAfterFinished`` collects both. Api
  objects can be injected (tests pass ones built on a recording ApiClient: the request bodies are
  the API boundary).
* :func:`follow_logs` streams the newest pod's log; :func:`job_status` reports the Job's final
  condition, the pod's exit code and what it means (the CLI's documented codes), and the MLflow
  run id found in the log.

``render`` needs kubectl (or the kustomize binary) and a kustomization directory, no cluster;
submit/logs/status need a cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

from orthojob.deploy.k8s_manifests import (
    CONTAINER,
    DEFAULT_NAMESPACE,
    JOB_NAME_LABEL,
    LEGACY_JOB_NAME_LABEL,
    MODEL_CACHES,
    K8sError,
    Overrides,
    Rendered,
    kustomization_namespace,
    new_suffix,
    render,
)
from orthojob.ops.exit_codes import ExitCode, fail_fast_codes

# the CLI's documented exit codes (k8s/grpo-job.yaml's podFailurePolicy derives from the same enum)
EXIT_MEANINGS = {int(code): code.meaning for code in ExitCode}
FAIL_FAST_CODES = fail_fast_codes()

# status exit codes of `orthojob k8s status`
STATUS_COMPLETE, STATUS_FAILED, STATUS_RUNNING = 0, 1, 4

# every request to the API server: (connect, read) seconds. The client's default is no timeout at
# all, so an API server that accepts and never answers (a dead VPN, a firewall that drops) held
# `orthojob k8s submit` forever. A followed log stream has none (a training step may be quiet for
# long); the requests before it (the pod list) have found the server answering.
REQUEST_TIMEOUT = (10, 60)

_RUN_ID = re.compile(r"(?:run[_ ]id[\"']?\s*[=:]\s*[\"']?|/runs/)([0-9a-f]{32})\b", re.IGNORECASE)
_RUN_URL = re.compile(r"(https?://\S+?/#/experiments/[^/\s]+/runs/[0-9a-f]{32})")


# ---------------------------------------------------------------------------------------------
# kustomize


# ---------------------------------------------------------------------------------------------
# render: kustomize, then the per-submission overrides


# ---------------------------------------------------------------------------------------------
# cluster side


@dataclass
class Apis:
    core: Any
    batch: Any
    networking: Any
    apps: Any = None
    """AppsV1Api: the Deployments a kustomization may render (the MLflow server, the agentic
    environment server)."""


def load_apis(context: str | None = None) -> Apis:
    """Api objects from the kubeconfig (``--context``), else the in-cluster config."""
    try:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException
    except ImportError as exc:
        raise K8sError("the kubernetes client is not installed: pip install kubernetes") from exc
    try:
        config.load_kube_config(context=context)
    except (OSError, ConfigException) as kube_exc:
        try:
            config.load_incluster_config()
        except ConfigException as exc:
            raise K8sError(
                f"no cluster to talk to: no usable kubeconfig ({kube_exc}) and not running in a pod ({exc}); "
                "set KUBECONFIG or pass --context"
            ) from exc
    return Apis(client.CoreV1Api(), client.BatchV1Api(), client.NetworkingV1Api(), client.AppsV1Api())


def _status_code(exc: BaseException) -> int | None:
    return getattr(exc, "status", None)


@dataclass
class Submitted:
    namespace: str
    job_name: str
    job_uid: str | None
    config_map: str
    created: list[str]
    skipped: list[str] = field(default_factory=list)


def _creators(apis: Apis) -> dict[str, Callable[..., Any] | None]:
    """Kind -> the client call that creates one of the shared objects a kustomization renders."""
    return {
        "ServiceAccount": apis.core.create_namespaced_service_account,
        "PersistentVolumeClaim": apis.core.create_namespaced_persistent_volume_claim,
        "ConfigMap": apis.core.create_namespaced_config_map,
        "Service": apis.core.create_namespaced_service,
        "NetworkPolicy": apis.networking.create_namespaced_network_policy,
        "Deployment": apis.apps.create_namespaced_deployment if apis.apps is not None else None,
    }


def submit(rendered: Rendered, apis: Apis) -> Submitted:
    """Create the rendered objects: shared ones if missing, then the Job's ConfigMap, the Job, the
    owner link."""
    ns = rendered.namespace
    created: list[str] = []
    skipped: list[str] = []
    creators = _creators(apis)
    job_cm = rendered.config_map
    shared = [o for o in rendered.objects if o["kind"] != "Job" and o is not job_cm]
    # every kind checked before the first request: nothing is half-created
    for obj in shared:
        if creators.get(obj["kind"]) is None:
            raise K8sError(
                f"submit does not know how to create a {obj['kind']} ({obj['metadata']['name']}); "
                "apply it with kubectl apply -k, or leave it out of the kustomization"
            )
    for obj in shared:
        kind = obj["kind"]
        create = creators[kind]
        assert create is not None
        try:
            create(namespace=obj["metadata"].get("namespace", ns), body=obj, _request_timeout=REQUEST_TIMEOUT)
            created.append(f"{kind}/{obj['metadata']['name']}")
        except Exception as exc:
            status = _status_code(exc)
            # 409: already exists; 403: not ours to create (multi-tenant namespaces: an admin
            # creates shared objects); either way leave it as it is and go on
            if status not in (403, 409):
                raise
            skipped.append(f"{kind}/{obj['metadata']['name']} ({'exists' if status == 409 else 'forbidden'})")
    cm = rendered.config_map
    apis.core.create_namespaced_config_map(namespace=ns, body=cm, _request_timeout=REQUEST_TIMEOUT)
    created.append(f"ConfigMap/{cm['metadata']['name']}")
    job = apis.batch.create_namespaced_job(namespace=ns, body=rendered.job, _request_timeout=REQUEST_TIMEOUT)
    name = rendered.job["metadata"]["name"]
    created.append(f"Job/{name}")
    uid = getattr(getattr(job, "metadata", None), "uid", None)
    if uid:
        owner = {
            "metadata": {
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": name,
                        "uid": uid,
                        "blockOwnerDeletion": False,
                    }
                ]
            }
        }
        apis.core.patch_namespaced_config_map(
            name=cm["metadata"]["name"], namespace=ns, body=owner, _request_timeout=REQUEST_TIMEOUT
        )
    return Submitted(ns, name, uid, cm["metadata"]["name"], created, skipped)


def _pods_of(apis: Apis, namespace: str, job_name: str) -> list[Any]:
    for label in (JOB_NAME_LABEL, LEGACY_JOB_NAME_LABEL):
        pods = apis.core.list_namespaced_pod(
            namespace=namespace, label_selector=f"{label}={job_name}", _request_timeout=REQUEST_TIMEOUT
        ).items
        if pods:
            return sorted(
                pods, key=lambda p: p.metadata.creation_timestamp or datetime.min.replace(tzinfo=UTC)
            )
    return []


def latest_pod(apis: Apis, namespace: str, job_name: str, wait_s: float = 0.0, poll_s: float = 2.0) -> Any:
    """The newest pod of the Job, waiting up to ``wait_s`` for it to start (not Pending)."""
    deadline = time.monotonic() + wait_s
    while True:
        pods = _pods_of(apis, namespace, job_name)
        if pods and pods[-1].status.phase != "Pending":
            return pods[-1]
        if time.monotonic() >= deadline:
            return pods[-1] if pods else None
        time.sleep(poll_s)


def follow_logs(
    apis: Apis,
    namespace: str,
    job_name: str,
    follow: bool = True,
    wait_s: float = 600.0,
    out: Callable[[str], Any] = print,
) -> str:
    """Stream the newest pod's log (until it ends, with ``follow``); returns the text seen."""
    pod = latest_pod(apis, namespace, job_name, wait_s=wait_s)
    if pod is None:
        raise K8sError(f"no pod of Job {namespace}/{job_name} yet")
    lines: list[str] = []
    for line in _log_lines(apis, namespace, pod.metadata.name, follow):
        lines.append(line)
        out(line)
    return "\n".join(lines)


def _log_lines(apis: Apis, namespace: str, pod: str, follow: bool) -> Iterator[str]:
    if follow:
        resp = apis.core.read_namespaced_pod_log(
            name=pod,
            namespace=namespace,
            container=CONTAINER,
            follow=True,
            _preload_content=False,
        )
        buffer = b""
        for chunk in resp.stream(4096) if hasattr(resp, "stream") else resp:
            buffer += chunk if isinstance(chunk, bytes) else str(chunk).encode()
            *complete, buffer = buffer.split(b"\n")
            for raw in complete:
                yield raw.decode("utf-8", "replace")
        if buffer:
            yield buffer.decode("utf-8", "replace")
    else:
        text = apis.core.read_namespaced_pod_log(
            name=pod, namespace=namespace, container=CONTAINER, _request_timeout=REQUEST_TIMEOUT
        )
        yield from (text or "").splitlines()


def find_run_id(log_text: str) -> str | None:
    """The last MLflow run id printed in a log (``run_id=...`` or a ``.../runs/<id>`` link)."""
    found = _RUN_ID.findall(log_text or "")
    return found[-1] if found else None


def find_run_url(log_text: str) -> str | None:
    """The last MLflow UI link to a run in a log (MLflow prints one when a run ends)."""
    found = _RUN_URL.findall(log_text or "")
    return found[-1] if found else None


@dataclass
class JobStatus:
    name: str
    namespace: str
    state: str  # Complete | Failed | Running | Pending
    reason: str | None = None
    message: str | None = None
    succeeded: int = 0
    failed: int = 0
    active: int = 0
    pod: str | None = None
    exit_code: int | None = None
    run_id: str | None = None
    run_url: str | None = None
    tracking_uri: str | None = None

    @property
    def exit_meaning(self) -> str | None:
        if self.exit_code is None:
            return None
        return EXIT_MEANINGS.get(self.exit_code, "failure")

    def summary(self) -> str:
        parts = [f"Job {self.namespace}/{self.name}: {self.state}"]
        if self.reason:
            parts.append(f"reason {self.reason}" + (f" ({self.message})" if self.message else ""))
        parts.append(f"pods succeeded {self.succeeded}, failed {self.failed}, active {self.active}")
        if self.pod:
            parts.append(f"latest pod {self.pod}")
        if self.exit_code is not None:
            parts.append(f"exit code {self.exit_code}: {self.exit_meaning}")
        if self.run_id:
            where = self.run_url or (f"tracking server {self.tracking_uri}" if self.tracking_uri else None)
            parts.append(f"MLflow run {self.run_id}" + (f" ({where})" if where else ""))
        else:
            parts.append("MLflow run: not found in the pod's log")
        return "\n".join(parts)


def _terminated_exit_code(pod: Any) -> int | None:
    for cs in getattr(pod.status, "container_statuses", None) or []:
        if cs.name == CONTAINER and cs.state is not None and cs.state.terminated is not None:
            return cs.state.terminated.exit_code
    return None


def _tracking_uri(apis: Apis, namespace: str, job: Any) -> str | None:
    try:
        c = next(c for c in job.spec.template.spec.containers if c.name == CONTAINER)
        for src in c.env_from or []:
            if src.config_map_ref is not None:
                cm = apis.core.read_namespaced_config_map(
                    name=src.config_map_ref.name, namespace=namespace, _request_timeout=REQUEST_TIMEOUT
                )
                return (cm.data or {}).get("MLFLOW_TRACKING_URI")
    except Exception:
        return None
    return None


def job_status(apis: Apis, namespace: str, job_name: str, log_tail: int = 5000) -> JobStatus:
    """The Job's state, its latest pod's exit code, and the MLflow run id from that pod's log."""
    job = apis.batch.read_namespaced_job_status(
        name=job_name, namespace=namespace, _request_timeout=REQUEST_TIMEOUT
    )
    st = job.status
    status = JobStatus(
        job_name,
        namespace,
        "Pending",
        succeeded=st.succeeded or 0,
        failed=st.failed or 0,
        active=st.active or 0,
    )
    for cond in st.conditions or []:
        if cond.status == "True" and cond.type in ("Complete", "Failed"):
            status.state, status.reason, status.message = cond.type, cond.reason, cond.message
    if status.state == "Pending" and (status.active or status.failed or st.start_time is not None):
        status.state = "Running"
    pod = latest_pod(apis, namespace, job_name)
    if pod is not None:
        status.pod = pod.metadata.name
        status.exit_code = _terminated_exit_code(pod)
        with contextlib.suppress(Exception):  # no log yet (pod pending) or already garbage-collected
            text = apis.core.read_namespaced_pod_log(
                name=pod.metadata.name,
                namespace=namespace,
                container=CONTAINER,
                tail_lines=log_tail,
                _request_timeout=REQUEST_TIMEOUT,
            )
            status.run_id, status.run_url = find_run_id(text), find_run_url(text)
    status.tracking_uri = _tracking_uri(apis, namespace, job)
    return status


def wait_for_job(
    apis: Apis, namespace: str, job_name: str, timeout_s: float, poll_s: float = 10.0
) -> JobStatus:
    deadline = time.monotonic() + timeout_s
    while True:
        status = job_status(apis, namespace, job_name)
        if status.state in ("Complete", "Failed") or time.monotonic() >= deadline:
            return status
        time.sleep(poll_s)


def status_exit_code(status: JobStatus) -> int:
    return {"Complete": STATUS_COMPLETE, "Failed": STATUS_FAILED}.get(status.state, STATUS_RUNNING)


# ---------------------------------------------------------------------------------------------
# CLI


def _add_render_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kustomize",
        metavar="DIR",
        help="the kustomization to render with `kubectl kustomize` (default: ./k8s, else the "
        "checkout's k8s/): its patches and components apply, then the flags below",
    )
    p.add_argument("--image", help="image reference, REPO@sha256:DIGEST (required: the manifest has none)")
    p.add_argument("--steps", type=int, help="GRPO steps (ConfigMap STEPS)")
    p.add_argument("--task-id", help="task (ConfigMap TASK_ID)")
    p.add_argument(
        "--model", help="base model: hub id, s3://bucket/prefix or a folder on a volume (ConfigMap MODEL)"
    )
    p.add_argument("--preset", help="training preset (ConfigMap PRESET)")
    p.add_argument(
        "--from-checkpoint",
        dest="checkpoint_uri",
        help="a gated SFT checkpoint: GRPO from it (CHECKPOINT_URI; default '' = the whole chain)",
    )
    p.add_argument(
        "--out",
        dest="output_uri",
        help="output base (OUTPUT_URI); each Job writes below it, in <job name>-<uid[:8]>",
    )
    p.add_argument("--run-name", help="continue this named run: OUTPUT_URI/RUN_NAME (RUN_NAME)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI as seen from the cluster")
    p.add_argument("--experiment", help="MLflow experiment name")
    p.add_argument("--namespace", help="namespace of every object (default: the kustomization's)")
    p.add_argument(
        "--model-cache",
        choices=MODEL_CACHES,
        help="/cache on the shared PersistentVolumeClaim orthorl-model-cache (pvc, the shipped "
        "default, reused by retries and later Jobs) or a per-pod emptyDir (adds the component "
        "model-cache/emptydir); default: what the kustomization says",
    )


def _overrides(args: argparse.Namespace, suffix: str | None) -> Overrides:
    """Overrides from the render flags (their argparse dests are the field names) and ``suffix``."""
    values = {f.name: getattr(args, f.name) for f in fields(Overrides) if f.name != "name_suffix"}
    return Overrides(**values, name_suffix=suffix)


def cmd_render(args: argparse.Namespace) -> int:
    def body() -> int:
        sys.stdout.write(render(_overrides(args, args.name_suffix), args.kustomize).to_yaml())
        return 0

    return _guarded("render", body)


def _guarded(name: str, fn: Callable[[], int]) -> int:
    """Run a cluster-side command: manifest/override/config problems and an API server that cannot
    be reached exit 2, API errors (the server answered: 403, 404, ...) exit 1."""
    try:
        return fn()
    except K8sError as exc:
        print(f"orthojob k8s {name}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        status = _status_code(exc)
        if status is None and _is_connection_error(exc):
            print(
                f"orthojob k8s {name}: cannot reach the Kubernetes API server ({_reason(exc)}); "
                "check the kubeconfig's cluster and context (KUBECONFIG, --context) and the network "
                "path to it (VPN, firewall)",
                file=sys.stderr,
            )
            return 2
        if status is None:
            raise
        reason = getattr(exc, "reason", "")
        body = getattr(exc, "body", "") or ""
        print(f"orthojob k8s {name}: Kubernetes API error {status} {reason} {body}".rstrip(), file=sys.stderr)
        return 1


def _is_connection_error(exc: BaseException) -> bool:
    """urllib3's connection, DNS and timeout errors (what the kubernetes client raises when no API
    server answers), and the OS errors beneath them."""
    try:
        from urllib3.exceptions import HTTPError
    except ImportError:  # pragma: no cover - the kubernetes client depends on urllib3
        return isinstance(exc, OSError)
    return isinstance(exc, (HTTPError, OSError))


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)  # MaxRetryError: the underlying error
    return f"{type(exc).__name__}: {reason or exc}"[:500]


def cmd_submit(args: argparse.Namespace, apis: Apis | None = None) -> int:
    return _guarded("submit", lambda: _submit(args, apis))


def _submit(args: argparse.Namespace, apis: Apis | None) -> int:
    suffix = args.name_suffix if args.name_suffix is not None else new_suffix()
    rendered = render(_overrides(args, suffix or None), args.kustomize)
    apis = apis or load_apis(args.context)
    done = submit(rendered, apis)
    print(f"submitted Job {done.namespace}/{done.job_name} (created: {', '.join(done.created)})")
    if done.skipped:
        print(f"left as they are: {', '.join(done.skipped)}")
    if not args.follow:
        print(f"follow with: orthojob k8s logs {done.job_name} -n {done.namespace}")
        return 0
    follow_logs(apis, done.namespace, done.job_name)
    status = wait_for_job(apis, done.namespace, done.job_name, timeout_s=args.timeout)
    print(status.summary())
    return status_exit_code(status)


def _namespace(args: argparse.Namespace) -> str:
    """-n, else the kustomization's namespace (read from its file), else orthorl."""
    if args.namespace:
        return args.namespace
    return kustomization_namespace(getattr(args, "kustomize", None)) or DEFAULT_NAMESPACE


def cmd_logs(args: argparse.Namespace, apis: Apis | None = None) -> int:
    def body() -> int:
        follow_logs(apis or load_apis(args.context), _namespace(args), args.job, follow=not args.no_follow)
        return 0

    return _guarded("logs", body)


def cmd_status(args: argparse.Namespace, apis: Apis | None = None) -> int:
    return _guarded("status", lambda: _status(args, apis))


def _status(args: argparse.Namespace, apis: Apis | None) -> int:
    apis = apis or load_apis(args.context)
    ns = _namespace(args)
    if args.wait:
        status = wait_for_job(apis, ns, args.job, timeout_s=args.timeout)
    else:
        status = job_status(apis, ns, args.job)
    print(status.summary())
    return status_exit_code(status)


def add_k8s_arguments(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``k8s render|submit|logs|status`` to the CLI's subparsers."""
    k8s = subparsers.add_parser("k8s", help="render/submit the GRPO Job on Kubernetes, follow it, report it")
    sub = k8s.add_subparsers(dest="k8s_command", required=True)

    r = sub.add_parser("render", help="print the Job's objects with overrides applied (YAML)")
    _add_render_arguments(r)
    r.add_argument("--name-suffix", help="append -SUFFIX to the Job and ConfigMap names")
    r.set_defaults(func=cmd_render)

    s = sub.add_parser("submit", help="create the Job (unique name) and, with --follow, watch it")
    _add_render_arguments(s)
    s.add_argument("--name-suffix", help="append -SUFFIX (default: a timestamp; '' for none)")
    s.add_argument("--context", help="kubeconfig context (default: current, else in-cluster)")
    s.add_argument("--follow", action="store_true", help="stream the pod's log, then report the final status")
    s.add_argument("--timeout", type=float, default=86400.0, help="seconds to wait with --follow")
    s.set_defaults(func=cmd_submit)

    for name, helptext, fn in (
        ("logs", "stream the newest pod's log", cmd_logs),
        ("status", "the Job's final status, exit code and MLflow run", cmd_status),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("job", help="Job name (as printed by submit)")
        p.add_argument("-n", "--namespace", help="namespace (default: the kustomization's, else orthorl)")
        p.add_argument("--kustomize", metavar="DIR", help="the kustomization whose namespace is the default")
        p.add_argument("--context", help="kubeconfig context")
        if name == "logs":
            p.add_argument("--no-follow", action="store_true", help="print the log so far and exit")
        else:
            p.add_argument("--wait", action="store_true", help="wait until the Job completes or fails")
            p.add_argument("--timeout", type=float, default=86400.0, help="seconds to wait with --wait")
        p.set_defaults(func=fn)
    return k8s
