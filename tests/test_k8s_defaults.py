"""What `kubectl apply -k k8s/` applies by default, and what its components change (rendered offline
with `kubectl kustomize`; kubernetes-validate and checkov run over the same output in
tests/test_deploy.py): the MLflow server, the scheduling defaults, the immutable run parameters,
the required output prefix, agentic GRPO's stages, and the one place the MLflow backend's image
is named."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
IMAGE = "reg.test/orthorl/train@sha256:" + "ab" * 32


def render(
    tmp_path: Path, enable: tuple[str, ...] = (), disable: tuple[str, ...] = (), folder: str = "."
) -> list[dict]:
    """`kubectl kustomize` of a copy of k8s/ (or of its ``folder``, e.g. multinode) with the image
    set, and components of k8s/kustomization.yaml enabled or disabled as its comments say."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (it renders kustomize offline)")
    work = tmp_path / "k8s"
    shutil.copytree(K8S, work)
    image = work / "image" / "kustomization.yaml"
    component = yaml.safe_load(image.read_text())
    name, digest = IMAGE.split("@")
    component["images"] = [{"name": "", "newName": name, "digest": digest}]
    image.write_text(yaml.safe_dump(component, sort_keys=False))
    text = (work / "kustomization.yaml").read_text()
    for c in enable:
        assert f"  # - {c}\n" in text, c
        text = text.replace(f"  # - {c}\n", f"  - {c}\n")
    for c in disable:
        assert f"  - {c}\n" in text, c
        text = text.replace(f"  - {c}\n", f"  # - {c}\n")
    (work / "kustomization.yaml").write_text(text)
    proc = subprocess.run([kubectl, "kustomize", str(work / folder)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def find(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def test_default_scheduling_and_parameters(tmp_path):
    docs = render(tmp_path)
    job = find(docs, "Job", "orthorl-grpo")
    pod = job["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod, "an operator-only label must not be a default"
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    container = next(c for c in pod["containers"] if c["name"] == "grpo")
    res = container["resources"]
    for key in ("cpu", "memory"):  # Guaranteed QoS
        assert res["requests"][key] == res["limits"][key], key
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "1"
    cm = find(docs, "ConfigMap", "orthorl-grpo-config")
    assert cm["immutable"] is True, "a running Job's retries must not see its flags change"
    assert cm["data"]["OUTPUT_URI"] == "", "no default bucket: a bucket someone else owns is none"
    assert cm["data"]["STAGES"] == ""
    assert "--stages" in container["args"]


def test_the_shipped_defaults_refuse_without_an_output_prefix(tmp_path, capsys):
    """As applied, without OUTPUT_URI: the Job's command exits 2 at once and says what to set."""
    from orthojob import job
    from orthojob.ops.exit_codes import ExitCode

    docs = render(tmp_path)
    cm = find(docs, "ConfigMap", "orthorl-grpo-config")["data"]
    container = find(docs, "Job", "orthorl-grpo")["spec"]["template"]["spec"]["containers"][0]
    argv = [a.replace("$(", "{").replace(")", "}").format(**cm) for a in container["args"]]
    env = {"K8S_JOB_NAME": "orthorl-grpo", "K8S_JOB_UID": "0123456789abcdef"}
    assert job.main(argv, env=env, cli=lambda a: pytest.fail(str(a))) == ExitCode.USAGE
    assert "OUTPUT_URI" in capsys.readouterr().err


def test_gpu_node_selector_is_a_component(tmp_path):
    docs = render(tmp_path, enable=("gpu-node-selector",))
    pod = find(docs, "Job", "orthorl-grpo")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


def test_agentic_component_trains_format_tool_then_grpo(tmp_path, capsys):
    from orthojob import job

    docs = render(tmp_path, enable=("agentic",))
    cm = find(docs, "ConfigMap", "orthorl-grpo-config")["data"]
    assert cm["STAGES"] == "format_sft,tool_sft,grpo"
    container = find(docs, "Job", "orthorl-grpo")["spec"]["template"]["spec"]["containers"][0]
    values = {**cm, "OUTPUT_URI": "s3://bucket/runs"}
    argv = [a.replace("$(", "{").replace(")", "}").format(**values) for a in container["args"]]
    job.main([*argv, "--dry-run"], env={"K8S_JOB_NAME": "j", "K8S_JOB_UID": "u" * 8})
    chain = json.loads(capsys.readouterr().out)["chain"]
    assert "stages=format_sft,tool_sft,grpo" in chain and "grpo.mode=agentic" in chain


def test_mlflow_server_component(tmp_path):
    docs = render(tmp_path)
    server = find(docs, "Deployment", "orthorl-mlflow")
    pod = server["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"].startswith("ghcr.io/mlflow/mlflow:v")
    from importlib.metadata import version

    assert c["image"].split(":v", 1)[1].split("-")[0] == version("mlflow"), "the lock's mlflow"
    assert (
        "--serve-artifacts" in c["args"]
        and "--artifacts-destination=$(MLFLOW_ARTIFACTS_DESTINATION)" in c["args"]
    )
    assert "--backend-store-uri=$(MLFLOW_BACKEND_STORE_URI)" in c["args"]
    # SQLite on the claim by default; the Secret (optional, listed last: it wins) for an external DB
    cm = find(docs, "ConfigMap", "orthorl-mlflow-server")["data"]
    assert cm["MLFLOW_BACKEND_STORE_URI"].startswith("sqlite:////mlflow/db/")
    assert [next(iter(s)) for s in c["envFrom"]] == ["configMapRef", "secretRef"]
    assert c["envFrom"][1]["secretRef"]["optional"] is True
    claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]}
    assert claims["db"] == "orthorl-mlflow-db"
    find(docs, "PersistentVolumeClaim", "orthorl-mlflow-db")
    service = find(docs, "Service", "mlflow")
    # the Job tracks to this Service; it holds no artifact keys of its own (proxied artifacts)
    uri = find(docs, "ConfigMap", "orthorl-grpo-config")["data"]["MLFLOW_TRACKING_URI"]
    assert uri == f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    # without the component: no server, and the tracking URI is the user's to set
    other = render(tmp_path / "without", disable=("mlflow",))
    assert not [d for d in other if d["metadata"]["name"] == "orthorl-mlflow"]


def test_mlflow_backend_names_the_image_once():
    project = yaml.safe_load((ROOT / "mlflow-k8s" / "MLproject").read_text())
    image = project["docker_env"]["image"]
    for name in ("kubernetes_config.json", "kubernetes_config-cpu.json"):
        config = json.loads((K8S / "mlflow-k8s" / name).read_text())
        assert config["repository-uri"] == image.rsplit(":", 1)[0], name  # required by MLflow, must match
        template = yaml.safe_load((ROOT / config["kube-job-template-path"]).read_text())
        assert template["spec"]["template"]["spec"]["containers"][0]["image"] == "", name
    main = project["entry_points"]["main"]
    assert "--use-vllm" not in main["command"] and "default" not in main["parameters"]["out_base"]


def trainjob_tracking_uri(multinode: list[dict]) -> str:
    tj = find(multinode, "TrainJob", "orthorl-grpo-multinode")
    return {e["name"]: e.get("value") for e in tj["spec"]["trainer"]["env"]}["MLFLOW_TRACKING_URI"]


def in_cluster_tracking_uris(docs: list[dict], multinode: list[dict]) -> dict[str, str]:
    """Every in-cluster client of the shipped MLflow server -> the tracking URI it uses."""
    import re

    uris = {"Job": find(docs, "ConfigMap", "orthorl-grpo-config")["data"]["MLFLOW_TRACKING_URI"]}
    uris["TrainJob"] = trainjob_tracking_uri(multinode)
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    kube = re.findall(r"KUBE_MLFLOW_TRACKING_URI=(\S+)", deploy)
    assert kube, "docs/deploy.md names the pods' view of the server"
    uris |= {f"mlflow-k8s pod ({i})": u for i, u in enumerate(sorted(set(kube)))}
    project = re.findall(r"KUBE_MLFLOW_TRACKING_URI=(\S+)", (ROOT / "mlflow-k8s" / "MLproject").read_text())
    uris |= {f"mlflow-k8s/MLproject ({i})": u for i, u in enumerate(sorted(set(project)))}
    return uris


def deployment_server_command(docs: list[dict], port: int, work: Path) -> tuple[list[str], dict[str, str]]:
    """The MLflow Deployment's command and environment as the kubelet runs them, on 127.0.0.1:port
    with its database and artifact store in ``work`` (everything else as shipped; ``mlflow`` found on
    ``PATH`` in this interpreter's folder)."""
    import os
    import re
    import sys

    dep = find(docs, "Deployment", "orthorl-mlflow")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = dict(find(docs, "ConfigMap", c["envFrom"][0]["configMapRef"]["name"])["data"])
    env |= {e["name"]: e["value"] for e in c.get("env", [])}
    env["MLFLOW_BACKEND_STORE_URI"] = f"sqlite:///{work / 'mlflow.db'}"
    env["MLFLOW_ARTIFACTS_DESTINATION"] = str(work / "artifacts")
    env["HOME"] = str(work)
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["command"] + c["args"]]
    argv = [
        "--host=127.0.0.1" if a.startswith("--host=") else f"--port={port}" if a.startswith("--port=") else a
        for a in argv
    ]
    assert argv[:2] == ["sh", "-c"] and "exec mlflow server" in argv[2]
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return argv, env


def test_mlflow_server_answers_every_in_cluster_client(tmp_path):
    """The shipped server, started for real with the Deployment's command and ConfigMap: a request
    with the Host header each in-cluster client sends (the Service's name as that client's URI
    spells it) gets 200; without MLFLOW_SERVER_ALLOWED_HOSTS the same request is refused (403),
    which is what the Job's start-up probe would see (exit 33)."""
    import http.client
    import os
    import subprocess
    import sys
    import urllib.parse

    from tests.services import _stop, _wait_for_port, free_port

    if not (Path(sys.executable).parent / "mlflow").exists():
        pytest.skip("mlflow not installed (the train extra has it)")
    docs = render(tmp_path)
    uris = in_cluster_tracking_uris(docs, render(tmp_path / "multinode", folder="multinode"))
    service = find(docs, "Service", "mlflow")
    port = service["spec"]["ports"][0]["port"]
    for where, uri in uris.items():  # each names the shipped Service
        u = urllib.parse.urlsplit(uri)
        assert u.hostname.split(".")[0] == "mlflow" and u.port == port, (where, uri)
        if "." in u.hostname:
            assert u.hostname.split(".")[1] == service["metadata"]["namespace"], (where, uri)
    hosts = sorted({urllib.parse.urlsplit(u).netloc for u in uris.values()} | {"localhost:5000"})
    assert "mlflow:5000" in hosts and "mlflow.orthorl.svc.cluster.local:5000" in hosts

    def statuses(allowed: bool) -> dict[str, int]:
        work = tmp_path / ("allowed" if allowed else "default")
        work.mkdir()
        server_port = free_port()
        argv, env = deployment_server_command(docs, server_port, work)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")} | env
        # the GenAI job runner (huey workers): no part of the Host check, and a minute of start-up here
        full_env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        if not allowed:
            full_env.pop("MLFLOW_SERVER_ALLOWED_HOSTS")
        log = work / "mlflow.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                    start_new_session=True, cwd=work)  # fmt: skip
        try:
            _wait_for_port(server_port, proc, 120, "mlflow server", log)
            got = {}
            for host in hosts:
                conn = http.client.HTTPConnection("127.0.0.1", server_port, timeout=30)
                conn.request(
                    "GET",
                    "/api/2.0/mlflow/experiments/get-by-name?experiment_name=Default",
                    headers={"Host": host},
                )
                got[host] = conn.getresponse().status
                conn.close()
            return got
        finally:
            _stop(proc)

    assert statuses(allowed=True) == dict.fromkeys(hosts, 200)
    refused = statuses(allowed=False)
    assert refused["localhost:5000"] == 200  # mlflow's default: loopback only
    assert {h: s for h, s in refused.items() if h != "localhost:5000"} == dict.fromkeys(
        [h for h in hosts if h != "localhost:5000"], 403
    )


def test_mlflow_server_refuses_to_start_without_an_artifact_destination(tmp_path):
    """The Deployment's command with the shipped ConfigMap's empty MLFLOW_ARTIFACTS_DESTINATION exits
    64 at once, saying which key to set; with a destination it execs ``mlflow server`` with the
    Deployment's arguments (here a stand-in ``mlflow`` that prints them)."""
    import os
    import subprocess

    docs = render(tmp_path)
    assert find(docs, "ConfigMap", "orthorl-mlflow-server")["data"]["MLFLOW_ARTIFACTS_DESTINATION"] == ""
    argv, env = deployment_server_command(docs, 5000, tmp_path)
    stand_in = tmp_path / "bin"
    stand_in.mkdir()
    (stand_in / "mlflow").write_text('#!/bin/sh\necho "mlflow $*"\n')
    (stand_in / "mlflow").chmod(0o755)
    base = {"PATH": f"{stand_in}{os.pathsep}{os.environ['PATH']}"}

    empty = subprocess.run(argv, env=env | base | {"MLFLOW_ARTIFACTS_DESTINATION": ""},
                           capture_output=True, text=True, timeout=30)  # fmt: skip
    assert empty.returncode == 64
    assert "MLFLOW_ARTIFACTS_DESTINATION is empty" in empty.stderr and "orthorl-mlflow-server" in empty.stderr
    assert empty.stdout == ""

    started = subprocess.run(argv, env=env | base, capture_output=True, text=True, timeout=30)
    assert started.returncode == 0, started.stderr
    assert started.stdout.startswith("mlflow server --host=127.0.0.1 --port=5000")
    assert f"--artifacts-destination={tmp_path / 'artifacts'}" in started.stdout


def test_trainjob_tracks_to_the_shipped_mlflow_server(tmp_path):
    """The TrainJob's MLFLOW_TRACKING_URI is the mlflow component's Service (k8s/mlflow), by its
    cluster name in the TrainJob's namespace; the server admits the TrainJob's pods and its Host."""
    docs = render(tmp_path)
    multinode = render(tmp_path / "multinode", folder="multinode")
    service = find(docs, "Service", "mlflow")
    tj = find(multinode, "TrainJob", "orthorl-grpo-multinode")
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    url = f"http://{name}.{namespace}.svc.cluster.local:{service['spec']['ports'][0]['port']}"
    assert trainjob_tracking_uri(multinode) == url
    assert tj["metadata"]["namespace"] == namespace
    allowed = find(docs, "ConfigMap", "orthorl-mlflow-server")["data"]["MLFLOW_SERVER_ALLOWED_HOSTS"]
    assert url.split("//")[1] in [h.strip() for h in allowed.split(",")]
    # its NetworkPolicy admits every pod of the namespace (the node pods among them)
    policy = find(docs, "NetworkPolicy", "orthorl-mlflow")
    assert policy["spec"]["ingress"][0]["from"] == [{"podSelector": {}}]
    # the multinode kustomization does not deploy a second copy (it would reset the server's
    # artifact store patched in k8s/kustomization.yaml): the server comes from k8s/
    assert not [
        d for d in multinode if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "mlflow"
    ]


def trainjob_job_argv(multinode: list[dict], values: dict[str, str]) -> list[str]:
    """The arguments `python -m orthojob.job` gets in a TrainJob node pod ($(VAR) expanded)."""
    import re

    t = find(multinode, "TrainJob", "orthorl-grpo-multinode")["spec"]["trainer"]
    argv = t["command"] + t["args"]
    argv = argv[argv.index("orthojob.job") + 1 :]
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in argv]


def test_the_shipped_trainjob_refuses_without_a_checkpoint(tmp_path, capsys):
    """As shipped, CHECKPOINT_URI is empty: the TrainJob's `orthojob.job` exits 2 and says to set it,
    instead of running the single-GPU pipeline without its vLLM server (--dry-run included)."""
    from orthojob import job
    from orthojob.ops.exit_codes import ExitCode

    multinode = render(tmp_path, folder="multinode")
    cm = find(multinode, "ConfigMap", "orthorl-multinode-config")["data"]
    assert cm["CHECKPOINT_URI"] == ""
    values = {**cm, "OUTPUT_URI": "s3://bucket/runs"}
    argv = trainjob_job_argv(multinode, values)
    assert "--vllm-server-url" in argv
    env = {"RANK": "0"}
    for extra in ([], ["--dry-run"]):
        code = job.main([*argv, *extra], env=env, cli=lambda a: pytest.fail(str(a)))
        err = capsys.readouterr()
        assert code == ExitCode.USAGE, err
        assert "CHECKPOINT_URI" in err.err and "gated SFT checkpoint" in err.err and "pipeline" not in err.out
    # set, the plan is GRPO on the server with its timeout
    values["CHECKPOINT_URI"] = "s3://bucket/runs/sft-1/bc_sft"
    plan = job.plan(job.build_parser().parse_args(trainjob_job_argv(multinode, values)), env)
    assert (
        plan.chain[0] == "grpo"
        and "--vllm-server-url" in plan.chain
        and "--vllm-server-timeout" in plan.chain
    )


def guaranteed(resources: dict) -> bool:
    """Guaranteed QoS for one container: cpu and memory limits set and equal to the requests."""
    req, lim = resources.get("requests", {}), resources.get("limits", {})
    return all(key in lim and req.get(key, lim[key]) == lim[key] for key in ("cpu", "memory"))


def test_multinode_scheduling_defaults(tmp_path):
    """`kubectl apply -k k8s/multinode/` as shipped: the TrainJob's node pods and the vLLM server are
    Guaranteed (requests = limits, init containers included), claims are chowned only on a root
    mismatch, no operator-only node label, and the run's ConfigMap is immutable."""
    docs = render(tmp_path, folder="multinode")
    tj = find(docs, "TrainJob", "orthorl-grpo-multinode")
    res = tj["spec"]["trainer"]["resourcesPerNode"]
    assert guaranteed(res), res
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"]
    replicated = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    node_pod = replicated[0]["template"]["spec"]["template"]["spec"]
    vllm_pod = find(docs, "Deployment", "orthorl-vllm")["spec"]["template"]["spec"]
    for name, pod in (("TrainJob node", node_pod), ("vLLM", vllm_pod)):
        assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch", name
        assert "nodeSelector" not in pod, name
    for c in vllm_pod["containers"] + vllm_pod.get("initContainers", []):
        assert guaranteed(c["resources"]), (c["name"], c["resources"])
    vllm = next(c for c in vllm_pod["containers"] if c["name"] == "vllm")
    assert vllm["resources"]["requests"]["nvidia.com/gpu"] == vllm["resources"]["limits"]["nvidia.com/gpu"]
    cm = find(docs, "ConfigMap", "orthorl-multinode-config")
    assert cm["immutable"] is True, "a restarted node pod must not see the run's parameters change"


def test_trainjob_output_prefix_is_per_trainjob(tmp_path):
    """A TrainJob's prefix is OUTPUT_URI/<name>-<JobSet uid[:8]>, from the labels JobSet puts on every
    pod (as the Job's is from its controller-uid): every node and a restarted JobSet (same uid) share
    it, a TrainJob re-created under the same name (new uid) gets another, not its predecessor's
    (which the run identity would refuse, exit 14)."""
    from orthojob import job

    multinode = render(tmp_path, folder="multinode")
    trainer = find(multinode, "TrainJob", "orthorl-grpo-multinode")["spec"]["trainer"]
    env = {e["name"]: e for e in trainer["env"]}
    assert env["K8S_JOB_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['jobset.sigs.k8s.io/jobset-name']"
    )
    assert env["K8S_JOB_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['jobset.sigs.k8s.io/jobset-uid']"
    )
    cm = find(multinode, "ConfigMap", "orthorl-multinode-config")["data"]
    values = {**cm, "OUTPUT_URI": "s3://bucket/runs", "CHECKPOINT_URI": "s3://bucket/runs/sft-1/bc_sft"}
    argv = trainjob_job_argv(multinode, values)
    assert "--run-name" not in argv and "--out" not in argv  # the prefix comes from name and uid
    args = job.build_parser().parse_args(argv)
    name = "orthorl-grpo-multinode"
    first = job.plan(args, {"K8S_JOB_NAME": name, "K8S_JOB_UID": "1f2e3d4c-0000-4000-8000-000000000001"})
    assert first.out == f"s3://bucket/runs/{name}-1f2e3d4c"
    assert first.chain[first.chain.index("--out") + 1] == f"{first.out}/grpo"
    again = job.plan(args, {"K8S_JOB_NAME": name, "K8S_JOB_UID": "1f2e3d4c-0000-4000-8000-000000000001"})
    recreated = job.plan(args, {"K8S_JOB_NAME": name, "K8S_JOB_UID": "9a8b7c6d-0000-4000-8000-000000000002"})
    assert again.out == first.out and recreated.out != first.out


def kubernetes_backend_walk() -> list[str]:
    """The shell lines of docs/deploy.md's walk through MLflow's Kubernetes backend."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    blocks = text.split("```bash\n")[1:]
    (block,) = [
        b.split("```", 1)[0]
        for b in blocks
        if "mlflow run mlflow-k8s --backend kubernetes" in b.split("```", 1)[0]
        and "kubectl apply" in b.split("```", 1)[0]
    ]
    return [line for line in block.splitlines() if line.strip()]


def test_kubernetes_backend_walk_applies_what_it_uses(tmp_path):
    """Every object the walk port-forwards to or waits for is among what it applied before (label
    selections of `kubectl apply -k k8s/ -l ...`, rendered here), and it pulls the image
    mlflow-k8s/MLproject names (the one place), evaluated by the shell, not a copy of the name."""
    import re

    docs = render(tmp_path)
    walk = kubernetes_backend_walk()
    applied: list[dict] = []
    for line in walk:
        if m := re.match(r"kubectl apply -k k8s/ -l app\.kubernetes\.io/component=(\S+)", line):
            chosen = [
                d for d in docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == m[1]
            ]
            assert chosen, line
            applied += chosen
        for kind, ref in (
            ("Service", r"port-forward svc/(\S+)"),
            ("Deployment", r"rollout status deploy/(\S+)"),
        ):
            if m := re.search(ref, line):
                names = [d["metadata"]["name"] for d in applied if d["kind"] == kind]
                assert m[1] in names, f"{line!r}: {kind} {m[1]} not applied before (applied: {names})"
    assert any("port-forward svc/mlflow" in line for line in walk)
    image = yaml.safe_load((ROOT / "mlflow-k8s" / "MLproject").read_text())["docker_env"]["image"]
    assert image not in (ROOT / "docs" / "deploy.md").read_text(), "the docs copy the image name"
    (pull,) = [line for line in walk if line.startswith("docker pull ")]
    command = pull.split("#", 1)[0].replace("docker pull", "echo", 1)
    proc = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == image
