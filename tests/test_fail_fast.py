"""Fail fast: an unreachable MLflow server exits 31 within the deadline (60 s by default), an
unreachable object store exits 30 after botocore's bounded retries; both as the job's processes
see them (real subprocesses, real sockets), and the MLflow nested-run fix under MLFLOW_RUN_ID."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orthojob.ops import storage, tracking
from orthojob.ops.exit_codes import ExitCode, fail_fast_codes
from tests.services import free_port

ROOT = Path(__file__).resolve().parents[1]


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AWS_", "ORTHORL_"))}
    env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, **extra)
    return env


def run_cli(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 180) -> tuple[int, float, str]:
    t = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )
    return proc.returncode, time.monotonic() - t, proc.stdout + proc.stderr


def test_probe_settings_fit_the_deadline():
    # below ~12 s MLflow's retries alone cannot fit (1 s timeouts + back-off): the watchdog bounds
    # those (test_a_silent_server_is_cut_at_the_configured_deadline)
    for deadline in (15, 30, 60, 300):
        s = tracking.probe_http_settings(deadline)
        attempts = int(s["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]) + 1
        worst = attempts * int(s["MLFLOW_HTTP_REQUEST_TIMEOUT"]) + 2 + 4 + 3 * 0.5
        assert worst <= deadline, (deadline, s)


def test_default_deadline_leaves_room_for_start_up():
    assert tracking.DEFAULT_DEADLINE_S <= 45


def test_dead_mlflow_port_exits_31_within_60_s_by_default(tmp_path):
    """The default deadline, MLflow's own retries, a port where nothing listens: exit 31, < 60 s."""
    uri = f"http://127.0.0.1:{free_port()}"
    code, seconds, out = run_cli(
        ["orthojob.cli", "promote", "--run-id", "0" * 32], job_env(MLFLOW_TRACKING_URI=uri), tmp_path
    )
    print(f"dead MLflow port: exit {code} after {seconds:.1f} s")
    assert code == ExitCode.TRACKING, out[-3000:]
    assert seconds < 60, f"{seconds:.1f} s"
    assert "unreachable" in out and "ORTHORL_TRACKING_DEADLINE_S" in out


def test_the_job_command_exits_31_on_a_dead_mlflow(tmp_path):
    """The Kubernetes Job's own command (python -m orthojob.job): the chain's first tracked stage
    refuses to start; nothing is trained."""
    uri = f"http://127.0.0.1:{free_port()}"
    env = job_env(MLFLOW_TRACKING_URI=uri, ORTHORL_WORK_DIR=str(tmp_path / "work"))
    code, seconds, out = run_cli(
        ["orthojob.job", "--preset", "tiny-cpu", "--steps", "1", "--out", str(tmp_path / "out")],
        env,
        tmp_path,
    )
    print(f"job on a dead MLflow port: exit {code} after {seconds:.1f} s")
    assert code == ExitCode.TRACKING, out[-3000:]
    assert seconds < 60


def test_a_silent_server_is_cut_at_the_configured_deadline(tmp_path):
    """A server that accepts connections and never answers (a hung proxy): the watchdog ends the
    probe at ORTHORL_TRACKING_DEADLINE_S, whatever the per-request timeouts add up to. The probe is
    timed from the server's first accepted connection, so a slow interpreter start on a loaded machine
    does not count against the deadline."""
    accepted: list[float] = []
    held: list[socket.socket] = []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        done = threading.Event()

        def accept() -> None:  # accepted and held open, never read
            while not done.is_set():
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                accepted.append(time.monotonic())
                held.append(conn)

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        env = job_env(MLFLOW_TRACKING_URI=f"http://127.0.0.1:{port}", ORTHORL_TRACKING_DEADLINE_S="6")
        start = time.monotonic()
        code, seconds, out = run_cli(["orthojob.cli", "promote", "--run-id", "0" * 32], env, tmp_path)
        done.set()
        thread.join()
    for conn in held:
        conn.close()
    assert accepted, "the CLI never connected to the server: " + out[-3000:]
    probe = start + seconds - accepted[0]
    print(
        f"silent MLflow server, deadline 6 s: exit {code} after {seconds:.1f} s, {probe:.1f} s after it connected"
    )
    assert code == ExitCode.TRACKING, out[-3000:]
    assert seconds > 5.5, f"{seconds:.1f} s"
    assert probe < 12, f"{probe:.1f} s from the first connection to the exit"
    assert "did not answer within 6 s" in out


def test_a_bad_deadline_is_refused():
    os.environ[tracking.DEADLINE_ENV] = "soon"
    try:
        with pytest.raises(tracking.TrackingError, match="not a number"):
            tracking.deadline_s()
    finally:
        del os.environ[tracking.DEADLINE_ENV]


def test_dead_s3_endpoint_exits_30_after_botocore_retries(tmp_path):
    """An input on S3 with the endpoint down: botocore's standard retries (5 attempts), no retry
    loop on top, then exit 30 with what to check."""
    env = job_env(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}",
        AWS_ACCESS_KEY_ID="test-key-id",
        AWS_SECRET_ACCESS_KEY="test-secret-key",
        AWS_DEFAULT_REGION="us-east-1",
        ORTHORL_WORK_DIR=str(tmp_path / "work"),
    )
    code, seconds, out = run_cli(["orthojob.cli", "gate", "--check", "s3://orthorl/bc_sft"], env, tmp_path)
    print(f"dead S3 endpoint: exit {code} after {seconds:.1f} s")
    assert code == ExitCode.STORAGE, out[-3000:]
    assert seconds < 60
    assert "after 5 attempts" in out and "AWS_ENDPOINT_URL" in out


def _count_sends(client, fail_first: int) -> dict[str, int]:
    """Count the HTTP requests botocore sends; the first ``fail_first`` fail like a dropped connection."""
    from botocore.exceptions import EndpointConnectionError

    seen = {"sent": 0}

    def before_send(request, **kwargs):
        seen["sent"] += 1
        if seen["sent"] <= fail_first:
            raise EndpointConnectionError(endpoint_url=request.url)
        return None

    client.meta.events.register("before-send.s3", before_send)
    return seen


def test_storage_retries_are_botocores_alone(monkeypatch, tmp_path):
    """A lasting outage costs exactly RETRY_ATTEMPTS requests (not attempts x attempts)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k" * 16)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s" * 16)
    monkeypatch.setattr(storage, "RETRY_ATTEMPTS", 3)
    client = storage.s3_client()
    seen = _count_sends(client, fail_first=10_000)
    t = time.monotonic()
    with pytest.raises(storage.StorageError, match="failed after 3 attempts"):
        storage.read_manifest("s3://orthorl/runs/x", client)
    assert seen["sent"] == 3, seen
    assert time.monotonic() - t < 30


def test_storage_transient_outage_recovers(monkeypatch, tmp_path):
    """Two dropped requests, then the real (SeaweedFS) server: botocore retries, the upload completes."""
    from tests.services import seaweedfs

    with seaweedfs(tmp_path / "weed") as s3:
        for k, v in s3.env().items():
            monkeypatch.setenv(k, v)
        client = storage.s3_client()
        seen = _count_sends(client, fail_first=2)
        src = tmp_path / "src"
        src.mkdir()
        (src / "a.txt").write_text("a")
        storage.upload_dir(src, "s3://orthorl/runs/flaky", client=client)
        assert storage.read_manifest("s3://orthorl/runs/flaky") is not None
        assert seen["sent"] >= 4  # 2 dropped + the file + the manifest


def test_stage_runs_under_mlflow_run_id_are_children(tmp_path, monkeypatch):
    """What `mlflow run` does: a parent run in MLFLOW_RUN_ID. The first stage attaches to it and
    the next ones are children (MLflow's start_run(run_id=...) leaves MLFLOW_RUN_ID set: without
    the fix the first child reused the parent, renamed it and ended it early)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    client = MlflowClient(uri)
    exp = client.create_experiment("project-exp", artifact_location=(tmp_path / "a").as_uri())
    parent = client.create_run(exp, run_name="mlflow-run-parent").info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", parent)
    with tracking.stage_run("pipeline") as top:
        assert top.info.run_id == parent
        assert "MLFLOW_RUN_ID" not in os.environ
        with tracking.stage_run("bc_sft") as child:
            assert child.info.run_id != parent
        with tracking.stage_run("evaluate") as child2:
            assert child2.info.run_id not in (parent, child.info.run_id)
        with tracking.stage_run("grpo") as grpo_run:
            pass
        # what the job promotes: the GRPO child, not the parent that last_active_run() returns here
        assert tracking.last_stage_run("grpo") == grpo_run.info.run_id
        assert mlflow.last_active_run().info.run_id == parent
        assert client.get_run(parent).info.status == "RUNNING", "the parent must not end early"
    runs = {r.info.run_id: r for r in client.search_runs([exp])}
    assert len(runs) == 4
    assert runs[parent].info.run_name == "mlflow-run-parent" and runs[parent].info.status == "FINISHED"
    for rid in (child.info.run_id, child2.info.run_id, grpo_run.info.run_id):
        assert runs[rid].data.tags["mlflow.parentRunId"] == parent
        assert runs[rid].info.experiment_id == exp
    assert {runs[r].data.tags["orthorl.stage"] for r in runs} == {"pipeline", "bc_sft", "evaluate", "grpo"}
    while mlflow.active_run():
        mlflow.end_run()


def test_a_retried_pod_closes_the_run_its_predecessor_left_running(tmp_path, monkeypatch):
    """An OOM-killed pod cannot end its run; the Job's next pod closes it FAILED."""
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "oom")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setenv("K8S_JOB_NAME", "orthorl-grpo-x")
    monkeypatch.setenv("K8S_POD_NAME", "orthorl-grpo-x-aaaaa")
    exp = tracking.configure()
    client = MlflowClient(uri)
    dead = client.create_run(exp, tags={"k8s.job_name": "orthorl-grpo-x"}).info.run_id  # left RUNNING
    other = client.create_run(exp, tags={"k8s.job_name": "another-job"}).info.run_id
    monkeypatch.setenv("K8S_POD_NAME", "orthorl-grpo-x-bbbbb")
    with tracking.stage_run("grpo") as run:
        assert run.data.tags.get("k8s.job_name") in (None, "orthorl-grpo-x")
    assert client.get_run(dead).info.status == "FAILED"
    assert client.get_run(dead).data.tags["orthorl.orphaned"] == "closed by orthorl-grpo-x-bbbbb"
    assert client.get_run(other).info.status == "RUNNING"
    assert client.get_run(run.info.run_id).data.tags["k8s.pod_name"] == "orthorl-grpo-x-bbbbb"
    while mlflow.active_run():
        mlflow.end_run()


# ---------------------------------------------------------------------------------------------
# the Job's start-up probe of its output prefix and of MLflow (orthojob.job.preflight)


def job_cmd(out_base: str) -> list[str]:
    return [
        "orthojob.job",
        "--preset",
        "tiny-cpu",
        "--steps",
        "1",
        "--out-base",
        out_base,
        "--run-name",
        "probe",
    ]


@pytest.fixture(scope="module")
def weed(tmp_path_factory):
    from tests.services import seaweedfs

    with seaweedfs(tmp_path_factory.mktemp("weed-probe")) as s3:
        yield s3


@pytest.mark.parametrize(
    ("keys", "out_base", "says"),
    [
        (
            "wrong",
            "s3://orthorl/runs",
            ["refused the credentials", "AWS_ACCESS_KEY_ID", "orthorl-credentials"],
        ),
        ("right", "s3://no-such-bucket-here/runs", ["bucket does not exist", "OUTPUT_URI"]),
    ],
    ids=["wrong-keys", "missing-bucket"],
)
def test_the_job_refuses_at_once_when_s3_refuses(weed, tmp_path, keys, out_base, says):
    """Real SeaweedFS, keys enforced: wrong keys and a missing bucket end the job before anything is
    built or trained, with exit 32 (never retried by the Job) and the fix in the message."""
    env = job_env(**weed.env(), ORTHORL_WORK_DIR=str(tmp_path / "work"))
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    if keys == "wrong":
        env["AWS_SECRET_ACCESS_KEY"] = "not-the-secret-key"
    code, seconds, out = run_cli(job_cmd(out_base), env, tmp_path, timeout=120)
    print(f"{keys} keys, {out_base}: exit {code} after {seconds:.1f} s")
    assert code == ExitCode.STORAGE_DENIED, out[-3000:]
    assert ExitCode.STORAGE_DENIED in fail_fast_codes()
    for text in says:
        assert text in out, out[-3000:]
    assert "not-the-secret-key" not in out
    assert seconds < 30, f"{seconds:.1f} s: a refusal is not retried"
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").rglob("bc_sft"))
    assert not (tmp_path / "mlflow.db").exists(), "the probe of S3 comes before anything is tracked"


def test_the_probe_writes_reads_and_deletes_its_marker(weed, monkeypatch, tmp_path):
    for k, v in weed.env().items():
        monkeypatch.setenv(k, v)
    assert "write, read and delete work" in storage.probe_output("s3://orthorl/runs/probe-ok")
    client = storage.s3_client()
    left = client.list_objects_v2(Bucket="orthorl", Prefix="runs/probe-ok").get("KeyCount", 0)
    assert left == 0, "the marker is deleted"
    assert "write, read and delete work" in storage.probe_output(str(tmp_path / "local" / "out"))
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o500)
    try:
        if os.geteuid() != 0:  # root writes anywhere
            with pytest.raises(storage.StorageError, match="not writable"):
                storage.probe_output(str(tmp_path / "ro" / "out"))
    finally:
        (tmp_path / "ro").chmod(0o700)


def test_a_run_id_from_another_tracking_store_is_refused(tmp_path, monkeypatch, capsys):
    """`mlflow run --backend kubernetes` with the workstation on another store: the pod's
    MLFLOW_RUN_ID is not on its server; the job ends with 33 and says how to fix it."""
    from orthojob import job

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    p = job.plan(job.build_parser().parse_args(["--preset", "tiny-cpu", "--out", str(tmp_path / "o")]), {})
    assert job.preflight(p, {"MLFLOW_RUN_ID": "f" * 32}) == ExitCode.TRACKING_DENIED
    err = capsys.readouterr().err
    assert "KUBE_MLFLOW_TRACKING_URI" in err and "f" * 32 in err
    assert job.preflight(p, {}) == 0


def test_the_output_prefix_is_required(capsys):
    from orthojob import job

    code = job.main(["--preset", "tiny-cpu"], env={}, cli=lambda argv: pytest.fail(str(argv)))
    assert code == ExitCode.USAGE
    assert "output prefix is required" in capsys.readouterr().err


def test_a_tracking_server_that_cannot_store_artifacts_stops_the_job_before_training(
    tmp_path, monkeypatch, capsys
):
    """A real `mlflow server` with an empty artifact destination answers /health and the experiment
    probe, and fails every upload: the preflight's artifact probe ends the job with 33 (never retried)
    within its deadline, saying what to set; a server that stores artifacts passes, and the probe
    leaves no artifact and only a deleted run behind."""
    import time

    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    from orthojob import job
    from orthojob.ops import tracking
    from tests.services import mlflow_server

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(tracking.DEADLINE_ENV, "20")
    p = job.plan(job.build_parser().parse_args(["--preset", "tiny-cpu", "--out", str(tmp_path / "o")]), {})
    with mlflow_server(tmp_path / "empty", artifacts_destination="") as server:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
        t0 = time.monotonic()
        assert job.preflight(p, {}) == ExitCode.TRACKING_DENIED
        seconds = time.monotonic() - t0
    err = capsys.readouterr().err
    assert "cannot store artifacts" in err and "MLFLOW_ARTIFACTS_DESTINATION" in err, err
    assert seconds < 60, f"{seconds:.1f} s"
    assert ExitCode.TRACKING_DENIED in fail_fast_codes()

    store = tmp_path / "artifacts"
    with mlflow_server(tmp_path / "ok", artifacts_destination=str(store)) as server:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
        assert job.preflight(p, {}) == 0
        out = capsys.readouterr().out
        assert "an artifact logged and deleted" in out, out
        client = MlflowClient(server.uri)
        experiment = client.get_experiment_by_name(tracking.DEFAULT_EXPERIMENT)
        probes = client.search_runs([experiment.experiment_id], run_view_type=ViewType.ALL)
        assert [(r.info.run_name, r.info.lifecycle_stage) for r in probes] == [
            (tracking.ARTIFACT_PROBE_RUN, "deleted")
        ]
    assert not list(store.rglob(tracking.ARTIFACT_PROBE_FILE)), "the probe's artifact is deleted"


def test_the_job_waits_a_bounded_time_for_a_tracking_server_that_is_still_starting(tmp_path, monkeypatch):
    """wait_for_server polls /health: a server that comes up after the job started is waited for; one
    that never does ends the wait at its bound with TrackingError (exit 31, retried), saying where to
    look; configure() waits only when ORTHORL_TRACKING_WAIT_S is set, which the Job's ConfigMap does."""
    import http.server
    import threading
    import time

    import yaml

    from orthojob.ops import tracking
    from orthojob.ops.job_errors import job_error_code
    from tests.services import free_port

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    starts = threading.Timer(1.5, server.serve_forever)
    starts.start()
    try:
        waited = tracking.wait_for_server(uri, 20, say=lambda _: None, poll_s=0.2)
    finally:
        server.shutdown()
        starts.cancel()
        server.server_close()
    assert 1.0 < waited < 10

    t0 = time.monotonic()
    with pytest.raises(tracking.TrackingError, match="did not answer /health within 2 s") as refused:
        tracking.wait_for_server(f"http://127.0.0.1:{free_port()}", 2, say=lambda _: None, poll_s=0.2)
    assert time.monotonic() - t0 < 10
    assert job_error_code(refused.value) == ExitCode.TRACKING
    assert "ORTHORL_TRACKING_WAIT_S" in str(refused.value)

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv(tracking.WAIT_ENV, "1")
    with pytest.raises(tracking.TrackingError, match="did not answer /health within 1 s"):
        tracking.configure()
    monkeypatch.setenv(tracking.WAIT_ENV, "-1")
    with pytest.raises(tracking.TrackingError, match="must be >= 0"):
        tracking.configure()

    root = Path(__file__).resolve().parents[1]
    docs = list(yaml.safe_load_all((root / "k8s" / "grpo-job.yaml").read_text()))
    config = next(d for d in docs if d and d["kind"] == "ConfigMap")["data"]
    assert float(config[tracking.WAIT_ENV]) > float(config[tracking.DEADLINE_ENV])
