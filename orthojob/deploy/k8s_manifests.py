"""The GRPO Job's manifests, rendered from ``k8s/`` by kustomize with a run's overrides (image, steps,
task, output prefix, names), checked before anything reaches a cluster.
"""

from __future__ import annotations

import copy
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from server.cases import TASK_IDS

CONTAINER = "grpo"


JOB_NAME_LABEL = "batch.kubernetes.io/job-name"


LEGACY_JOB_NAME_LABEL = "job-name"


KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")


EMPTYDIR_COMPONENT = Path("model-cache") / "emptydir"


DEFAULT_NAMESPACE = "orthorl"
"""The namespace of logs/status when neither -n nor the kustomization names one."""


KUSTOMIZE_TIMEOUT_S = 120


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


# ConfigMap keys that overrides may set (Overrides field -> key)
CONFIG_KEYS = {
    "steps": "STEPS",
    "task_id": "TASK_ID",
    "model": "MODEL",
    "preset": "PRESET",
    "checkpoint_uri": "CHECKPOINT_URI",
    "output_uri": "OUTPUT_URI",
    "run_name": "RUN_NAME",
    "tracking_uri": "MLFLOW_TRACKING_URI",
    "experiment": "MLFLOW_EXPERIMENT_NAME",
}


MODEL_CACHES = ("pvc", "emptydir")
"""Where the Job's /cache lives (``--model-cache``): the manifest's PersistentVolumeClaim, or a
per-pod emptyDir (the kustomize component k8s/model-cache/emptydir)."""


class K8sError(RuntimeError):
    """A manifest, kustomization or override problem; the CLI prints it and exits 2."""


@dataclass
class Overrides:
    image: str | None = None
    steps: int | None = None
    task_id: str | None = None
    model: str | None = None
    preset: str | None = None
    checkpoint_uri: str | None = None
    output_uri: str | None = None
    run_name: str | None = None
    tracking_uri: str | None = None
    experiment: str | None = None
    namespace: str | None = None
    model_cache: str | None = None
    name_suffix: str | None = None


def _pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod spec of a workload object (Job, Deployment, ...), if it has one."""
    spec = obj.get("spec", {}).get("template", {}).get("spec")
    return [spec] if isinstance(spec, dict) else []


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pod.get("initContainers", [])) + list(pod.get("containers", []))


@dataclass
class Rendered:
    """The objects to create, in creation order (the kustomization's order: shared objects, then
    the Job's ConfigMap and the Job)."""

    objects: list[dict[str, Any]] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str) -> dict[str, Any]:
        found = self.of_kind(kind)
        if len(found) != 1:
            raise K8sError(f"expected one {kind} in the manifest, found {len(found)}")
        return found[0]

    @property
    def job(self) -> dict[str, Any]:
        return self.one("Job")

    @property
    def config_map(self) -> dict[str, Any]:
        """The ConfigMap the Job's container reads its parameters from (envFrom)."""
        main = container(self.job)
        names = [s["configMapRef"]["name"] for s in main.get("envFrom", []) if s.get("configMapRef")]
        found = [o for o in self.of_kind("ConfigMap") if o["metadata"]["name"] in names]
        if len(found) != 1:
            raise K8sError(
                f"expected the Job's container {CONTAINER!r} to read one ConfigMap of the manifest "
                f"(envFrom configMapRef), found {len(found)}"
            )
        return found[0]

    @property
    def namespace(self) -> str:
        return self.job["metadata"].get("namespace") or DEFAULT_NAMESPACE

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump_all(self.objects, sort_keys=False)


def container(job: dict[str, Any], name: str = CONTAINER) -> dict[str, Any]:
    for c in job["spec"]["template"]["spec"]["containers"]:
        if c["name"] == name:
            return c
    raise K8sError(f"Job {job['metadata']['name']} has no container {name!r}")


def _check_name(name: str, what: str) -> str:
    # a Job's name becomes a label value on its pods: at most 63 characters
    if len(name) > 63 or not _DNS_LABEL.match(name):
        raise K8sError(f"{what} {name!r} is not a DNS-1123 label (lowercase a-z, 0-9, '-', at most 63)")
    return name


def _validate(ov: Overrides) -> None:
    if ov.steps is not None and (isinstance(ov.steps, bool) or int(ov.steps) != ov.steps or ov.steps < 1):
        raise K8sError(f"steps must be a positive integer, got {ov.steps!r}")
    if ov.task_id is not None and ov.task_id not in TASK_IDS:
        raise K8sError(f"unknown task {ov.task_id!r}: one of {', '.join(TASK_IDS)}")
    if ov.image is not None and (not ov.image.strip() or any(ch.isspace() for ch in ov.image)):
        raise K8sError(f"image must be a non-empty reference without spaces, got {ov.image!r}")
    if ov.output_uri is not None and not ov.output_uri.strip():
        raise K8sError("output_uri must not be empty")
    if ov.run_name:
        _check_name(ov.run_name, "run name")
    if ov.namespace is not None:
        _check_name(ov.namespace, "namespace")
    if ov.name_suffix is not None:
        _check_name(ov.name_suffix, "name suffix")
    if ov.model_cache is not None and ov.model_cache not in MODEL_CACHES:
        raise K8sError(f"model cache must be one of {', '.join(MODEL_CACHES)}, got {ov.model_cache!r}")


def default_kustomize_dir() -> Path:
    """``k8s/`` of the working directory, else of the checkout this module is in (an editable or
    source install); the first that holds a kustomization. Neither: ``./k8s`` (render says what to do)."""
    candidates = [Path.cwd() / "k8s", Path(__file__).resolve().parents[2] / "k8s"]
    for folder in candidates:
        if any((folder / name).is_file() for name in KUSTOMIZATION_FILES):
            return folder
    return candidates[0]


def _kustomization_file(folder: Path) -> Path:
    if not folder.is_dir():
        raise K8sError(
            f"no kustomization directory {folder}: run from the repository root (its k8s/ folder is the "
            "default) or pass --kustomize DIR, a folder with a kustomization.yaml"
        )
    for name in KUSTOMIZATION_FILES:
        if (folder / name).is_file():
            return folder / name
    raise K8sError(
        f"{folder} has no kustomization.yaml: pass --kustomize DIR, a folder with one (the repository's k8s/)"
    )


def _kustomize_command(folder: Path) -> list[str]:
    kubectl = os.environ.get("ORTHORL_KUBECTL") or shutil.which("kubectl")
    if kubectl:
        return [kubectl, "kustomize", str(folder)]
    standalone = shutil.which("kustomize")
    if standalone:
        return [standalone, "build", str(folder)]
    raise K8sError(
        "kubectl is not installed (or not on PATH): `orthojob k8s render|submit` renders the "
        "kustomization with `kubectl kustomize`, offline; install kubectl (1.27 or later) or the "
        "kustomize binary, or set ORTHORL_KUBECTL to kubectl's path"
    )


def kustomize(folder: str | Path, components: tuple[Path, ...] = ()) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize FOLDER`` renders; ``components`` (folders) are added on top
    in a temporary overlay, as if the kustomization listed them."""
    import yaml

    folder = Path(folder).resolve()
    _kustomization_file(folder)
    with tempfile.TemporaryDirectory(prefix="orthojob-kustomize-") as tmp:
        target = folder
        if components:
            for comp in components:
                _kustomization_file(comp)
            overlay = {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                # kustomize refuses absolute paths here; relative ones may leave the overlay's root
                "resources": [os.path.relpath(folder, tmp)],
                "components": [os.path.relpath(Path(c).resolve(), tmp) for c in components],
            }
            (Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump(overlay, sort_keys=False))
            target = Path(tmp)
        cmd = _kustomize_command(target)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=KUSTOMIZE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise K8sError(f"could not run {' '.join(cmd[:2])}: {exc}") from exc
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().replace(tmp, "<overlay>")[-2000:]
        raise K8sError(f"`{Path(cmd[0]).name} {cmd[1]} {folder}` failed; fix the kustomization: {detail}")
    try:
        docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    except yaml.YAMLError as exc:
        raise K8sError(f"the kustomize output of {folder} is not YAML: {exc}") from exc
    if not all(isinstance(d, dict) and "kind" in d and "metadata" in d for d in docs):
        raise K8sError(f"the kustomize output of {folder} holds something that is not a Kubernetes object")
    return docs


def kustomization_namespace(folder: str | Path | None = None) -> str | None:
    """The ``namespace:`` a kustomization sets (read from its file: no kubectl needed), if any."""
    import yaml

    try:
        path = _kustomization_file(Path(folder) if folder else default_kustomize_dir())
        data = yaml.safe_load(path.read_text())
    except (K8sError, OSError, yaml.YAMLError):
        return None
    ns = data.get("namespace") if isinstance(data, dict) else None
    return ns if isinstance(ns, str) and ns else None


def _rename_config_map_refs(pod: dict[str, Any], old: str, new: str) -> None:
    for c in _containers(pod):
        for source in c.get("envFrom", []):
            ref = source.get("configMapRef")
            if ref and ref.get("name") == old:
                ref["name"] = new
        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).get("configMapKeyRef")
            if ref and ref.get("name") == old:
                ref["name"] = new
    for volume in pod.get("volumes", []):
        ref = volume.get("configMap")
        if ref and ref.get("name") == old:
            ref["name"] = new


def _set_image(objects: list[dict[str, Any]], main: dict[str, Any], image: str) -> None:
    """The training image wherever the kustomization put the Job's (k8s/image sets one image for
    the Job, its init containers and the agentic environment server), and the IMAGE_DIGEST that
    followed it; other images (the MLflow server's) stay."""
    old = main.get("image") or ""
    for obj in objects:
        for pod in _pod_specs(obj):
            for c in _containers(pod):
                if c is main or (c.get("image") or "") == old:
                    c["image"] = image
                    for env in c.get("env", []):
                        if env.get("name") == "IMAGE_DIGEST" and (env.get("value") or "") == old:
                            env["value"] = image


def apply_overrides(objects: list[dict[str, Any]], overrides: Overrides | None = None) -> Rendered:
    """``objects`` (a kustomize output; not changed) with ``overrides`` applied."""
    ov = overrides or Overrides()
    _validate(ov)
    rendered = Rendered(copy.deepcopy(objects))
    job, cm = rendered.job, rendered.config_map
    pod = job["spec"]["template"]["spec"]
    main = container(job)

    if ov.model_cache == "pvc":
        cache = next((v for v in pod.get("volumes", []) if v.get("name") == "cache"), {})
        if "persistentVolumeClaim" not in cache:
            raise K8sError(
                "--model-cache pvc, but the kustomization makes /cache something else (the component "
                "model-cache/emptydir?): remove that component or pass --model-cache emptydir"
            )

    if ov.namespace:
        for obj in rendered.objects:
            obj["metadata"]["namespace"] = ov.namespace

    if ov.name_suffix:
        old_cm = cm["metadata"]["name"]
        cm["metadata"]["name"] = _check_name(f"{old_cm}-{ov.name_suffix}", "ConfigMap name")
        job["metadata"]["name"] = _check_name(f"{job['metadata']['name']}-{ov.name_suffix}", "Job name")
        _rename_config_map_refs(pod, old_cm, cm["metadata"]["name"])

    data = cm.setdefault("data", {})
    for attr, key in CONFIG_KEYS.items():
        value = getattr(ov, attr)
        if value is not None:
            data[key] = str(value)

    if ov.image:
        _set_image(rendered.objects, main, ov.image)
    if not str(main.get("image") or "").strip():
        raise K8sError(
            "no image: the manifest's is empty on purpose (a placeholder must never be deployed); "
            "pass --image REPO@sha256:DIGEST, the reference `docker push` printed, or set it once in "
            "k8s/image/kustomization.yaml"
        )
    # the env var MLflow runs are tagged with always names the image actually deployed
    for env in main.setdefault("env", []):
        if env["name"] == "IMAGE_DIGEST":
            env["value"] = main["image"]
            break
    else:
        main["env"].append({"name": "IMAGE_DIGEST", "value": main["image"]})
    return rendered


def render(overrides: Overrides | None = None, kustomize_dir: str | Path | None = None) -> Rendered:
    """``kubectl kustomize`` of ``kustomize_dir`` (default: :func:`default_kustomize_dir`) with
    ``overrides`` applied; ``--model-cache emptydir`` adds the component model-cache/emptydir of
    that folder. Nothing on disk is changed."""
    ov = overrides or Overrides()
    _validate(ov)  # before kubectl runs: a bad flag is refused at once
    folder = Path(kustomize_dir) if kustomize_dir else default_kustomize_dir()
    components: tuple[Path, ...] = ()
    if ov.model_cache == "emptydir":
        component = folder / EMPTYDIR_COMPONENT
        if not component.is_dir():
            raise K8sError(
                f"--model-cache emptydir adds the kustomize component {EMPTYDIR_COMPONENT}/ of the "
                f"kustomization directory, and {component} does not exist"
            )
        components = (component,)
    return apply_overrides(kustomize(folder, components), ov)


def new_suffix() -> str:
    """A short, sortable, unique Job name suffix: MMDDHHMMSS-xxxx (UTC)."""
    return f"{datetime.now(UTC):%m%d%H%M%S}-{secrets.token_hex(2)}"
