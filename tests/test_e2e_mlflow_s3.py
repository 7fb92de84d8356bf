"""End to end against real services on 127.0.0.1: SeaweedFS (S3) and ``mlflow server`` (SQLite backend,
artifacts proxied into ``s3://orthorl/mlflow``).

* the tiny pipeline with ``--out s3://...``: GRPO pulls the gated SFT checkpoint from S3 and pushes its
  result there; read back through MlflowClient and boto3 (params, per-reward metric histories, the
  adapter and gate file in the bucket, the logged model loading back), then ``orthojob promote``;
* resume: ``orthojob grpo --out s3://...`` stopped by SIGTERM after a checkpoint, restarted, continues;
* faults: MLflow down, wrong S3 keys, an S3 outage during upload, missing / unparseable / failed gates;
* secrets (S3 keys, MLflow password) never appear in params, tags, artifacts or output.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("boto3")

from orthojob.ops import storage, tracking  # noqa: E402
from orthojob.ops.exit_codes import ExitCode  # noqa: E402
from orthojob.ops.process_group import PROCESS_GROUP_LEFT  # noqa: E402
from server.staging_engine import ENGINE_VERSION  # noqa: E402
from tests.services import free_port, mlflow_server, run_process_group, seaweedfs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BUCKET = "orthorl"
MLFLOW_PASSWORD = "mlflow-pw-e2e-5c1a9d"
IMAGE_DIGEST = "sha256:0123456789abcdef"
REWARDS = ("reward_terminal", "reward_occlusion", "reward_strategy", "reward_format", "reward_anchorage")
PIPELINE_OVERRIDES = {
    "bc_sft.steps": 30,
    "bc_sft.examples": 60,
    "bc_sft.logging_steps": 10,
    "bc_sft_gate.n_seeds": 4,
    "bc_sft_gate.max_new_tokens": 64,
    "bc_sft_gate.thresholds.min_parse_rate": 0.0,  # a 30-step SFT does not learn the format: let GRPO run
    "bc_sft_gate.thresholds.min_format_reward": 0.0,
    "grpo.steps": 2,
    "grpo.max_completion_length": 48,
    "grpo.gate_seeds": 2,
    "grpo_gate.thresholds.min_parse_rate": 0.0,  # evaluated, opened: 2 steps do not reach it
    "grpo_gate.thresholds.min_format_reward": 0.0,
    "grpo_gate.thresholds.min_margin_over_slerp": -10.0,
    "grpo_gate.thresholds.max_p_no_better_than_slerp": None,
    "grpo.lora_r": 4,  # an adapter: what the registry holds for real models
    "evaluate.n_seeds": 2,
    "evaluate.max_new_tokens": 48,
}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    root = tmp_path_factory.mktemp("services")
    with seaweedfs(root / "s3") as s3:
        extra = {**s3.env(), "MLFLOW_S3_ENDPOINT_URL": s3.endpoint}
        with mlflow_server(root / "mlflow", f"s3://{BUCKET}/mlflow", extra_env=extra) as server:
            yield s3, server


def job_env(s3, server, work: Path) -> dict[str, str]:
    """What a job's pod gets: S3 keys, the tracking server (with a password), a work folder, offline hubs."""
    return {
        **s3.env(),
        "MLFLOW_TRACKING_URI": server.uri,
        "MLFLOW_TRACKING_USERNAME": "e2e-user-b7",
        "MLFLOW_TRACKING_PASSWORD": MLFLOW_PASSWORD,
        "MLFLOW_EXPERIMENT_NAME": "e2e",
        "ORTHORL_WORK_DIR": str(work),
        "IMAGE_DIGEST": IMAGE_DIGEST,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }


@pytest.fixture
def env(services, tmp_path, monkeypatch):
    """The job's environment: S3 keys, the tracking server (with a password), a work folder."""
    s3, server = services
    values = job_env(s3, server, tmp_path / "work")
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    yield {**os.environ}
    while mlflow.active_run():
        mlflow.end_run()


def s3_client(s3):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=s3.endpoint,
        aws_access_key_id=s3.access_key,
        aws_secret_access_key=s3.secret_key,
        region_name="us-east-1",
    )


def keys_under(s3, prefix: str) -> set[str]:
    pages = s3_client(s3).get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"][len(prefix) :] for page in pages for o in page.get("Contents", [])}


def orthojob(args: list[str], env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orthojob.cli", *args],
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_by_stage(client, experiment: str, stage: str, parent: str | None = None):
    exp = client.get_experiment_by_name(experiment)
    query = f"tags.`orthorl.stage` = '{stage}'"
    if parent:
        query += f" and tags.`mlflow.parentRunId` = '{parent}'"
    return client.search_runs([exp.experiment_id], query, order_by=["attributes.start_time DESC"])


def assert_no_secrets(texts: list[str], secrets: list[str]) -> None:
    for secret in secrets:
        for text in texts:
            assert secret not in text


# --- the pipeline, end to end ----------------------------------------------------------------


@pytest.fixture(scope="module")
def pipeline_run(services, tmp_path_factory):
    """The pipeline as a user starts it from MLflow: ``mlflow run <project> -e pipeline
    --env-manager local -P out=s3://orthorl/e2e/run1 -P overrides=...``; (result, env, seconds).

    One run covers both MLflow Projects (one parent run, one child run per stage) and the job's
    S3 and tracking-server path. The gates evaluate but are opened: a 30-step SFT and 2 GRPO steps
    do not reach them, and ``mlflow run`` fails on any non-zero exit (tests/test_pipeline.py's chain
    passes its SFT gate on merit)."""
    s3, server = services
    tmp = tmp_path_factory.mktemp("pipeline")
    project = tmp / "project"  # a copy, so the run's relative outputs land in tmp
    project.mkdir()
    for name in ("MLproject", "python_env.yaml", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, project / name)
    for name in ("server", "orthojob", "requirements"):
        shutil.copytree(REPO / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, **job_env(s3, server, tmp / "work")}
    env.pop("MLFLOW_RUN_ID", None)
    bin_dir = str(Path(sys.executable).parent)
    overrides = ",".join(f"{k}={json.dumps(v)}" for k, v in PIPELINE_OVERRIDES.items())
    mlflow_bin = shutil.which("mlflow", path=bin_dir) or shutil.which("mlflow")
    assert mlflow_bin, "the mlflow package is installed but its `mlflow` command is not"
    t = time.perf_counter()
    result = subprocess.run(
        [mlflow_bin, "run", str(project), "-e", "pipeline", "--env-manager", "local", "--experiment-name", "e2e",
         "-P", "preset=tiny-cpu", "-P", f"out=s3://{BUCKET}/e2e/run1", "-P", f"overrides={overrides}"],
        env={**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"},  # `python` = this venv's
        cwd=tmp, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    return result, env, time.perf_counter() - t


def test_pipeline_with_s3_and_mlflow_server(services, pipeline_run, env, tmp_path):
    s3, server = services
    result, env, seconds = pipeline_run
    print(f"pipeline wall time {seconds:.1f} s")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    mlflow.set_tracking_uri(server.uri)
    client = mlflow.tracking.MlflowClient(server.uri)

    # MLflow's project run is the parent (the pipeline attaches to it, no stage takes it over);
    # every stage is one run nested under it
    (parent,) = run_by_stage(client, "e2e", "pipeline")
    assert parent.data.tags["mlflow.project.entryPoint"] == "pipeline"
    assert parent.info.status == "FINISHED" and parent.data.tags["orthorl.exit_code"] == "0"
    family = client.search_runs(
        [parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    children = {r.data.tags["orthorl.stage"]: r for r in family}
    assert len(children) == len(family), "one run per stage"
    assert set(children) == {"bc_sft", "grpo", "evaluate"}  # each SFT stage's gate runs in its run
    assert all(r.info.status == "FINISHED" for r in family)
    projects = [r for r in client.search_runs([parent.info.experiment_id])
                if r.data.tags.get("mlflow.project.entryPoint")]  # fmt: skip
    assert [r.info.run_id for r in projects] == [parent.info.run_id], "no second project run"
    grpo = children["grpo"]
    assert grpo.info.status == "FINISHED"

    # params: CLI arguments, GRPO config, LoRA, environment, git commit, image digest
    p = grpo.data.params
    assert p["cli.from_checkpoint"] == f"s3://{BUCKET}/e2e/run1/bc_sft"
    assert p["cli.out"] == f"s3://{BUCKET}/e2e/run1/grpo"
    assert p["grpo.steps"] == "2" and p["lora.r"] == "4" and p["env.task_id"] == "task_easy"
    assert p["image_digest"] == IMAGE_DIGEST and p["git_commit"]
    assert grpo.data.tags["image_digest"] == IMAGE_DIGEST
    assert children["bc_sft"].data.params["bc_sft.steps"] == "30"

    # per-step metric histories: one point per step for each reward, plus environment diagnostics
    run_id = grpo.info.run_id
    for name in REWARDS:
        for stat in ("mean", "std"):
            history = client.get_metric_history(run_id, f"rewards/{name}/{stat}")
            assert [m.step for m in history] == [1, 2], (name, stat)
    for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                "env/parse_rate", "env/terminal_raw_mean", "env/collision_failure_rate",
                "env/pdl_failure_rate", "env/strategy_accuracy"):  # fmt: skip
        assert [m.step for m in client.get_metric_history(run_id, key)] == [1, 2], key
    assert not any(k.startswith("profiling/") for k in grpo.data.metrics)

    # run artifacts (stored by the server in S3)
    top = {a.path for a in client.list_artifacts(run_id)}
    assert {"gate_passed.json", "completions.jsonl", "completions_sample.json", "resolved_config.json"} <= top
    plots = {a.path for a in client.list_artifacts(run_id, "plots")}
    assert plots == {
        "plots/reward_components.png",
        "plots/tooth_trajectories.png",
        "plots/arch_before_after.png",
    }
    assert keys_under(s3, "mlflow/"), "the server stores artifacts in s3://orthorl/mlflow"

    # the bucket: SFT checkpoint (pulled by GRPO) and GRPO's adapter + gate file, each with a manifest
    sft_keys = keys_under(s3, "e2e/run1/bc_sft/")
    assert {"MANIFEST.json", "gate_passed.json", "config.json"} <= sft_keys
    grpo_keys = keys_under(s3, "e2e/run1/grpo/")
    assert {
        "MANIFEST.json",
        "gate_passed.json",
        "adapter_config.json",
        "adapter_model.safetensors",
    } <= grpo_keys
    assert not any(k.startswith("checkpoint-") for k in grpo_keys)
    downloaded = storage.download_dir(f"s3://{BUCKET}/e2e/run1/grpo", tmp_path / "grpo")  # digests checked
    gate = json.loads((downloaded / "gate_passed.json").read_text())
    assert grpo.data.tags["orthorl.gate_passed"] == str(gate["passed"]).lower()

    # the model loads back with its flavour and records its base model
    (logged,) = [m for m in client.search_logged_models([grpo.info.experiment_id],
                 filter_string=f"source_run_id = '{run_id}'")]  # fmt: skip
    info = mlflow.models.get_model_info(f"models:/{logged.model_id}")
    assert "transformers" in info.flavors and info.metadata["adapter"] == "true"
    assert info.metadata["base_model"]
    components = mlflow.transformers.load_model(f"models:/{logged.model_id}", return_type="components")
    assert components["model"] is not None and components["tokenizer"] is not None

    # every gated checkpoint (BC SFT's, GRPO's) is a LoggedModel of its stage's run with its gate's
    # metrics and verdict, the metrics linked to the held-out cases; the run's inputs name the cases
    # it trained on and was gated on (datasets, linked to the model)
    gated = {}
    for stage in ("bc_sft", "grpo"):
        run = children[stage]
        (model,) = client.search_logged_models(
            [run.info.experiment_id],
            filter_string=f"source_run_id = '{run.info.run_id}' AND tags.`orthorl.gate_stage` = '{stage}'",
        )
        content = json.loads(
            Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="gate_passed.json",
                                                     dst_path=str(tmp_path / stage))).read_text()
        )  # fmt: skip
        metrics = {m.key: m for m in model.metrics}
        assert metrics["gate/scaled_reward_mean"].value == content["metrics"]["scaled_reward_mean"]
        assert model.tags["orthorl.gate_passed"] == str(content["passed"]).lower()
        start, n = content["evaluation"]["seed_start"], content["evaluation"]["n_seeds"]
        heldout = f"heldout-{'+'.join(content['evaluation']['task_ids'])}-{start}-{start + n - 1}"
        assert metrics["gate/hard_rule_share"].dataset_name == heldout
        inputs = {
            {t.key: t.value for t in i.tags}["mlflow.data.context"]: i.dataset
            for i in client.get_run(run.info.run_id).inputs.dataset_inputs
        }
        assert inputs["evaluation"].name == heldout and inputs["evaluation"].digest
        assert inputs["training"].name.startswith(f"{stage}-train-task_easy")
        assert json.loads(inputs["training"].profile)["num_rows"] >= 1
        assert {i.model_id for i in client.get_run(run.info.run_id).inputs.model_inputs} >= {model.model_id}
        gated[stage] = model
    assert gated["grpo"].model_id == logged.model_id

    # promote: a passed gate (no more hard-rule breaks than the oracle's) is registered, candidate and
    # the first champion; a failed one is refused and nothing is registered, even forced
    promoted = orthojob(["promote", "--run-id", run_id, "--model-name", "orthorl-e2e"], env)
    forced = orthojob(["promote", "--run-id", run_id, "--model-name", "orthorl-e2e", "--force"], env)
    if gate["passed"]:
        assert promoted.returncode == 0 and forced.returncode == 0, promoted.stderr + forced.stderr
        version = client.get_model_version_by_alias("orthorl-e2e", "candidate")
        assert version.run_id == run_id or version.tags["run_id"] == run_id
        assert client.get_registered_model("orthorl-e2e").aliases["champion"] == version.version
        # registered from the gated record, which the champion was picked from
        assert version.source == f"models:/{logged.model_id}" and version.tags["model_id"] == logged.model_id
        # what is registered is the planner with the staging engine its gate judged with
        assert version.tags["staging_engine"] == gate["metrics"]["engine"] == ENGINE_VERSION
        assert logged.tags["orthorl.staging_engine"] == ENGINE_VERSION
    else:
        assert promoted.returncode == forced.returncode == ExitCode.BAD_GATE, promoted.stderr
        assert "not registered" in promoted.stderr
        assert client.search_model_versions("name = 'orthorl-e2e'") == []

    # secrets: never in params, tags, artifacts or the job's output
    secrets = [s3.access_key, s3.secret_key, MLFLOW_PASSWORD]
    texts = [result.stdout, result.stderr, promoted.stdout, promoted.stderr]
    for run in [parent, *children.values()]:
        texts.append(json.dumps(run.data.params) + json.dumps(run.data.tags))
        for name in ("gate_passed.json", "resolved_config.json", "completions_sample.json", SUMMARY):
            if name in {a.path for a in client.list_artifacts(run.info.run_id)}:
                path = mlflow.artifacts.download_artifacts(
                    run_id=run.info.run_id, artifact_path=name, dst_path=str(tmp_path / run.info.run_id)
                )
                texts.append(Path(path).read_text())
    assert len(texts) > 8
    assert_no_secrets(texts, secrets)


SUMMARY = "pipeline_summary.json"


# --- resume after SIGTERM ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from orthojob.modeling.models import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny") / "tiny", ["task_easy"], max_position_embeddings=4096)


def train_args(tiny: Path, out: str, steps: int = 2, *extra: str) -> list[str]:
    return ["grpo", "--preset", "tiny-cpu", "--model", str(tiny), "--steps", str(steps),
            "--max-completion-length", "64", "--gate-seeds", "2", "--out", out, *extra]  # fmt: skip


def test_resume_after_sigterm(services, env, tiny, tmp_path):
    s3, server = services
    out = f"s3://{BUCKET}/resume/grpo"
    argv = [sys.executable, "-m", "orthojob.cli",
            *train_args(tiny, out, 8, "--save-steps", "1", "--skip-sft-gate")]  # fmt: skip
    first_env = {**env, "PYTHONPATH": str(REPO), "ORTHORL_WORK_DIR": str(tmp_path / "pod1")}
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(argv, env=first_env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while storage.latest_checkpoint(out) is None:
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    step, _ = storage.latest_checkpoint(out)
    assert 1 <= step < 8
    # the preemption guard saved and synced the step it stopped at (the run ends KILLED: below)
    first_log = (tmp_path / "first.log").read_text()
    assert f"SIGTERM: checkpoint-{step} saved and synced" in first_log, first_log[-3000:]
    assert "MANIFEST.json" not in keys_under(s3, "resume/grpo/")  # no final result from the killed pod

    # a new pod (empty work folder) with the same --out resumes from the latest synced checkpoint
    second = orthojob(train_args(tiny, out, 8, "--save-steps", "1", "--skip-sft-gate"),
                      {**env, "ORTHORL_WORK_DIR": str(tmp_path / "pod2")})  # fmt: skip
    assert second.returncode in (0, 3), second.stdout[-3000:] + second.stderr[-3000:]
    resumed_step = max(s for s, _ in [storage.latest_checkpoint(out)])
    assert resumed_step == 8
    assert (
        f"resuming from checkpoint-{step}" in second.stdout
        or f"resuming from checkpoint-{step}" in second.stderr
    )

    client = mlflow.tracking.MlflowClient(server.uri)
    killed, resumed = sorted(
        [r for r in run_by_stage(client, "e2e", "grpo") if r.data.params.get("cli.out") == out],
        key=lambda r: r.info.start_time,
    )
    assert killed.info.status == "KILLED" and killed.data.tags["orthorl.terminated"] == "SIGTERM"
    assert (
        resumed.info.status == "FINISHED"
        and resumed.data.tags["orthorl.resumed_from"] == f"checkpoint-{step}"
    )
    history = client.get_metric_history(resumed.info.run_id, "rewards/reward_terminal/mean")
    assert [m.step for m in history] == list(range(step + 1, 9))
    train_log = storage.download_dir(out, tmp_path / "result") / "train_log.json"
    assert [r["step"] for r in json.loads(train_log.read_text()) if "reward" in r] == list(range(1, 9))


def test_two_ranks_resume_from_s3_on_every_rank(services, env, tiny, tmp_path):
    """Data parallel (torchrun, 2 ranks): a rerun with the same --out resumes on both ranks from
    the synced checkpoint; one rank downloads it, the other reuses the verified copy."""
    _, server = services
    out = f"s3://{BUCKET}/ddp-resume/grpo"
    pythonpath = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)

    def torchrun(steps: int, pod: str, *extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "orthojob.cli", *train_args(tiny, out, steps, "--save-steps", "1", "--skip-sft-gate", *extra)]  # fmt: skip
        run_env = {**env, "PYTHONPATH": pythonpath, "ORTHORL_WORK_DIR": str(tmp_path / pod),
                   "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1"}  # fmt: skip
        run = run_process_group(cmd, run_env, tmp_path, 400, "2-rank training")
        return subprocess.CompletedProcess(cmd, run.returncode, run.stdout + run.stderr, "")

    def trained(run: subprocess.CompletedProcess) -> bool:
        """Finished: exit 0, or rank 0 exiting 3 because the random tiny model fails the GRPO
        gate (torchrun then exits 1, and SIGTERMs rank 1 if it has not exited yet); and no rank
        still held its process group at exit (one that did was seen to abort in CI)."""
        codes = re.findall(r"exitcode  : (-?\d+)", run.stdout)
        gate_failed = "GRPO gate: FAILED" in run.stdout and str(int(ExitCode.GRPO_GATE_FAILED)) in codes
        ended = PROCESS_GROUP_LEFT not in run.stdout  # orthojob.ops.process_group.end_process_group
        return ended and (
            run.returncode == 0
            or (gate_failed and all(c in (str(int(ExitCode.GRPO_GATE_FAILED)), "-15") for c in codes))
        )

    first = torchrun(2, "pod1")
    assert trained(first), first.stdout[-5000:]
    assert storage.latest_checkpoint(out)[0] == 2
    # a new pod: nothing local, everything from the bucket; 3 steps is another config (the run
    # identity refuses it by default, exit 14), so the rerun says it continues on purpose
    second = torchrun(3, "pod2", "--on-foreign-checkpoint", "continue")
    assert trained(second), second.stdout[-5000:]
    for rank in (0, 1):
        assert f"rank {rank}: resuming from checkpoint-2 of {out}" in second.stdout, second.stdout[-5000:]
    assert storage.latest_checkpoint(out)[0] == 3
    local = tmp_path / "pod2" / BUCKET / "ddp-resume" / "grpo"
    assert sorted(p.name for p in local.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert not list(local.glob("*.partial")) and not list(local.glob("*.lock"))

    client = mlflow.tracking.MlflowClient(server.uri)
    runs = [r for r in run_by_stage(client, "e2e", "grpo") if r.data.params.get("cli.out") == out]
    resumed = max(runs, key=lambda r: r.info.start_time)
    assert resumed.data.tags["orthorl.resumed_from"] == "checkpoint-2"
    history = client.get_metric_history(resumed.info.run_id, "rewards/reward_terminal/mean")
    assert [m.step for m in history] == [3]  # one step on top of the two already done
    state = json.loads((local / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3


# --- faults ----------------------------------------------------------------------------------------


def test_mlflow_down_at_start_is_a_clear_error_and_writes_nothing(services, env, tiny, tmp_path, monkeypatch):
    s3, _ = services
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("ORTHORL_TRACKING_DEADLINE_S", "20")
    t = time.perf_counter()
    res = orthojob(train_args(tiny, f"s3://{BUCKET}/down/grpo", 2, "--skip-sft-gate"), {**os.environ})
    assert res.returncode == 31, res.stderr[-2000:]
    assert "unreachable" in res.stderr and time.perf_counter() - t < 60
    assert keys_under(s3, "down/") == set()
    assert not (tmp_path / "work").exists()


def _gated_checkpoint(tiny: Path, folder: Path, passed: bool) -> Path:
    import shutil

    from orthojob.lifecycle import gate_file

    shutil.copytree(tiny, folder)
    good = {"parse_rate": 1.0, "format_reward": 1.0, "margin_over_slerp": 0.1, "scaled_reward_mean": 7.0,
            "hard_rule_share_over_oracle": 0.0, "repair_share": 0.0}  # fmt: skip
    bad = {"parse_rate": 0.0, "format_reward": 0.0, "margin_over_slerp": -8.0, "scaled_reward_mean": -2.0,
           "hard_rule_share_over_oracle": 0.0}  # fmt: skip
    gate_file.write_gate(folder, good if passed else bad, stage="bc_sft")
    return folder


def test_wrong_s3_keys_are_a_clear_error(services, env, tiny, tmp_path, monkeypatch):
    s3, server = services
    storage.upload_dir(_gated_checkpoint(tiny, tmp_path / "sft", True), f"s3://{BUCKET}/keys/bc_sft")
    wrong = "wrong-secret-key-7e1f0a"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    res = orthojob(train_args(tiny, f"s3://{BUCKET}/keys/grpo", 2, "--from-checkpoint",
                              f"s3://{BUCKET}/keys/bc_sft"), {**os.environ})  # fmt: skip
    assert res.returncode == ExitCode.STORAGE_DENIED, res.stderr[-2000:]  # a refusal: never retried
    assert "refused the credentials" in res.stderr and "AWS_SECRET_ACCESS_KEY" in res.stderr
    assert wrong not in res.stdout + res.stderr
    assert keys_under(s3, "keys/grpo/") == set()
    (run,) = [r for r in run_by_stage(mlflow.tracking.MlflowClient(server.uri), "e2e", "grpo")
              if r.data.params.get("cli.out") == f"s3://{BUCKET}/keys/grpo"]  # fmt: skip
    assert run.info.status == "FAILED" and "StorageAccessError" in run.data.tags["orthorl.error"]


@pytest.mark.parametrize(("case", "code"), [("missing", 10), ("unparseable", 11), ("failed", 12)])
def test_bad_gate_of_an_s3_checkpoint_is_refused(services, env, tiny, tmp_path, case, code):
    s3, _ = services
    folder = _gated_checkpoint(tiny, tmp_path / "sft", case != "failed")
    if case == "missing":
        (folder / "gate_passed.json").unlink()
    elif case == "unparseable":
        (folder / "gate_passed.json").write_text("{not json")
    storage.upload_dir(folder, f"s3://{BUCKET}/gate-{case}/bc_sft")
    res = orthojob(train_args(tiny, f"s3://{BUCKET}/gate-{case}/grpo", 2, "--from-checkpoint",
                              f"s3://{BUCKET}/gate-{case}/bc_sft"), {**os.environ})  # fmt: skip
    assert res.returncode == code, res.stderr[-2000:]
    assert "gate" in res.stderr
    assert keys_under(s3, f"gate-{case}/grpo/") == set()


def test_corrupt_s3_checkpoint_is_refused(services, env, tiny, tmp_path):
    s3, _ = services
    storage.upload_dir(_gated_checkpoint(tiny, tmp_path / "sft", True), f"s3://{BUCKET}/corrupt/bc_sft")
    s3_client(s3).put_object(Bucket=BUCKET, Key="corrupt/bc_sft/config.json", Body=b"{}")
    res = orthojob(train_args(tiny, f"s3://{BUCKET}/corrupt/grpo", 2, "--from-checkpoint",
                              f"s3://{BUCKET}/corrupt/bc_sft"), {**os.environ})  # fmt: skip
    assert res.returncode == 30 and "does not match the manifest" in res.stderr, res.stderr[-2000:]


def test_standalone_stages_read_and_write_s3(services, env, tiny, tmp_path):
    """bc-sft --no-gate --out, gate --checkpoint / --check and evaluate --checkpoint take s3:// URIs."""
    s3, _ = services
    uri = f"s3://{BUCKET}/solo/bc_sft"
    sft = orthojob(["bc-sft", "--no-gate", "--model", str(tiny), "--lora-r", "0", "--steps", "2", "--examples", "8",
                    "--out", uri], env)  # fmt: skip
    assert sft.returncode == 0, sft.stdout[-2000:] + sft.stderr[-2000:]
    published = keys_under(s3, "solo/bc_sft/")
    assert {"MANIFEST.json", "config.json", "model.safetensors", "sft_log.json"} <= published
    assert not any(k.startswith("checkpoint-") for k in published)

    refused = orthojob(["gate", "--check", uri], env)  # no gate file yet
    assert refused.returncode == 10, refused.stderr[-2000:]
    gate = orthojob(["gate", "--checkpoint", uri, "--seeds", "2", "--max-new-tokens", "16",
                     "--min-parse-rate", "0", "--min-format-reward", "0"], env)  # fmt: skip
    assert gate.returncode == 0, gate.stdout[-2000:] + gate.stderr[-2000:]
    manifest = json.loads(
        s3_client(s3).get_object(Bucket=BUCKET, Key="solo/bc_sft/MANIFEST.json")["Body"].read()
    )
    assert "gate_passed.json" in manifest["files"]  # published again, with the gate in the manifest
    fresh = {**env, "ORTHORL_WORK_DIR": str(tmp_path / "other-pod")}  # nothing cached: a download
    checked = orthojob(["gate", "--check", uri], fresh)
    assert checked.returncode == 0 and "passed, digest matches" in checked.stdout, checked.stderr[-2000:]

    report = tmp_path / "eval.json"
    evaluated = orthojob(["evaluate", "--checkpoint", uri, "--task-id", "task_easy", "--seeds", "1",
                          "--max-new-tokens", "16", "--out", str(report)], fresh)  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert json.loads(report.read_text())["checkpoint"] == uri

    s3_client(s3).put_object(Bucket=BUCKET, Key="solo/bc_sft/config.json", Body=b"{}")
    corrupt = orthojob(["gate", "--check", uri], {**env, "ORTHORL_WORK_DIR": str(tmp_path / "third-pod")})
    assert corrupt.returncode == 30 and "does not match the manifest" in corrupt.stderr, corrupt.stderr[
        -2000:
    ]
    missing = orthojob(["evaluate", "--checkpoint", f"s3://{BUCKET}/solo/nothing-here"], env)
    assert missing.returncode == 30 and "has no MANIFEST.json" in missing.stderr, missing.stderr[-2000:]


@pytest.mark.parametrize("stage", ["format_sft", "tool_sft"])
def test_stage_commands_read_and_write_s3(services, env, tiny, tmp_path, monkeypatch, request, stage):
    """The format and tool-use stage commands take s3:// in and out: format-sft (from a local base) and
    tool-sft (its base model an s3:// URI) publish their gated checkpoint with their MLflow run; a
    fresh pod's pre-flight (gate --check, GRPO's) downloads it, digests and gate checked; rsft
    continues the format checkpoint from S3 and publishes its own."""
    from orthojob.cli import main as cli_main
    from orthojob.stages import rsft
    from tests.test_stages import GATE_FLAGS, fake_sampler
    from tests.test_tool_sft import TOOL_GATE_FLAGS

    s3, server = services
    source = f"s3://{BUCKET}/stages/{stage}"
    if stage == "format_sft":
        base = str(tiny)
        argv = ["format-sft", "--batch-size", "2", "--examples", "4", *GATE_FLAGS]
    else:
        base = storage.publish(request.getfixturevalue("tiny_tool_base"), f"s3://{BUCKET}/stages/tiny-tool")
        argv = ["tool-sft", "--batch-size", "1", "--examples", "2", *TOOL_GATE_FLAGS]
    res = orthojob([*argv, "--model", base, "--lora-r", "0", "--steps", "2", "--out", source], env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert {"MANIFEST.json", "gate_passed.json", "model.safetensors", "sft_log.json"} <= keys_under(
        s3, f"stages/{stage}/"
    )
    client = mlflow.tracking.MlflowClient(server.uri)
    (run,) = [r for r in run_by_stage(client, "e2e", stage) if r.data.params.get("cli.out") == source]
    assert run.data.params["cli.model"] == base and run.data.tags["orthorl.gate_passed"] == "true"
    fresh = {**env, "ORTHORL_WORK_DIR": str(tmp_path / "other-pod")}  # nothing cached: a download
    checked = orthojob(["gate", "--check", source], fresh)
    assert checked.returncode == 0 and "passed, digest matches" in checked.stdout, checked.stderr[-2000:]
    if stage == "tool_sft":
        metrics = run.data.metrics
        assert "gate/tool_call_rate" in metrics and 0 < metrics["loss_tokens"] < metrics["tokens"] / 5
        return
    # in process, so that sampling can be replaced by known completions (storage, gates and MLflow real)
    target = f"s3://{BUCKET}/stages/rsft"
    monkeypatch.setattr(rsft, "sample_completions", fake_sampler)
    rc = cli_main(["rsft", "--from-checkpoint", source, "--out", target, "--lora-r", "0", "--steps", "1",
                   "--batch-size", "1", "--prompts", "1", "--samples-per-prompt", "6", *GATE_FLAGS])  # fmt: skip
    assert rc == 0
    published = keys_under(s3, "stages/rsft/")
    assert {"MANIFEST.json", "gate_passed.json", "model.safetensors", "rsft_samples.jsonl"} <= published
    (run,) = [r for r in run_by_stage(client, "e2e", "rsft") if r.data.params.get("cli.out") == target]
    assert run.data.metrics["rsft/kept"] == 1 and run.data.tags["orthorl.gate_passed"] == "true"


class _FlakyClient:
    """An S3 client whose PutObject requests fail (a dropped connection, below botocore's retries)
    ``failures`` times, then work: botocore's own retries absorb a short outage."""

    def __init__(self, real, failures: int):
        from botocore.exceptions import EndpointConnectionError

        self.real, self.failures = real, failures

        def drop(request, **kwargs):
            if self.failures > 0:
                self.failures -= 1
                raise EndpointConnectionError(endpoint_url=request.url)

        real.meta.events.register("before-send.s3.PutObject", drop)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("failures", [3, 10_000])
def test_s3_outage_during_upload(services, env, tiny, tmp_path, monkeypatch, capsys, failures):
    """A short outage is retried and the result is complete; a lasting one fails the job with nothing
    half-made: no manifest (so no reader uses the folder), no gate file in the run, nothing promoted."""
    import argparse

    from orthojob.lifecycle import registry
    from orthojob.stages import grpo

    s3, server = services
    monkeypatch.setattr(storage, "RETRY_ATTEMPTS", 4)  # botocore's total attempts per request
    real = storage.s3_client
    flaky = _FlakyClient(real(), failures)
    monkeypatch.setattr(storage, "s3_client", lambda: flaky)
    out = f"s3://{BUCKET}/outage-{failures}/grpo"
    parser = grpo.add_train_arguments(argparse.ArgumentParser())
    rc = grpo.run_train(parser.parse_args(train_args(tiny, out, 2, "--skip-sft-gate")[1:]))
    err = capsys.readouterr().err
    run = mlflow.last_active_run()
    assert run.data.params["cli.out"] == out
    if failures == 3:
        assert rc in (0, 3), err[-2000:]
        assert "MANIFEST.json" in keys_under(s3, f"outage-{failures}/grpo/")
        storage.download_dir(out, tmp_path / "ok")  # complete and verified
        assert "gate_passed.json" in {
            a.path for a in mlflow.tracking.MlflowClient().list_artifacts(run.info.run_id)
        }
    else:
        assert rc == 30 and "failed after 4 attempts" in err, err[-2000:]
        assert "MANIFEST.json" not in keys_under(s3, f"outage-{failures}/grpo/")
        assert run.info.status == "FAILED"
        with pytest.raises(registry.PromotionError) as refused:
            registry.promote(run.info.run_id, "orthorl-outage")
        assert refused.value.exit_code == ExitCode.NO_GATE
    assert tracking.tracking_uri() == server.uri
