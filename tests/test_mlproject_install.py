"""`mlflow run . -P steps=300` installs as written: the environment MLflow builds from python_env.yaml.

MLflow's virtualenv manager (the default for a ``python_env`` project) writes the ``dependencies``
list into ``requirements.<uuid>.txt`` in a symlinked copy of the project and runs
``python -m pip install -r`` on it there. The lock carries hashes, so pip runs in hash-checking mode
and refuses any requirement, transitive ones included, without a pinned, hashed entry. No GPU
machine can be built here; the same resolution is done as uv's dry run with ``--require-hashes`` for
the image's platform (Linux x86_64, CPython of python_env.yaml), which needs the package index. When
the index cannot be reached the tests skip and say so.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "gpu.lock"


def _check_lock():
    spec = importlib.util.spec_from_file_location("check_lock", ROOT / "scripts" / "check_lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_lock = _check_lock()


def uv() -> str:
    found = check_lock.uv_binary()
    if found is None:
        pytest.skip("uv is not installed (the dev extra has it): the install cannot be resolved")
    return found


def mlflow_requirements_file(tmp_path: Path, lock_text: str | None = None) -> Path:
    """What MLflow writes: the dependencies of python_env.yaml, one a line, in a copy of the project
    (its files linked), optionally with another lock in place of requirements/gpu.lock."""
    env = yaml.safe_load((ROOT / "python_env.yaml").read_text())
    project = tmp_path / "project"
    project.mkdir()
    for item in ROOT.iterdir():
        if item.name not in ("requirements", ".git", ".venv"):
            (project / item.name).symlink_to(item)
    (project / "requirements").mkdir()
    for item in (ROOT / "requirements").iterdir():
        (project / "requirements" / item.name).symlink_to(item)
    if lock_text is not None:
        (project / "requirements" / "gpu.lock").unlink()
        (project / "requirements" / "gpu.lock").write_text(lock_text)
    req = project / "requirements.0123456789abcdef.txt"
    req.write_text("\n".join(env["dependencies"]))
    return req


def dry_run(req: Path):
    env = yaml.safe_load((ROOT / "python_env.yaml").read_text())
    proc = check_lock.install_dry_run(uv(), req, python=str(env["python"]), timeout=240)
    if check_lock.unreachable(proc):
        pytest.skip(f"the package index is not reachable from here: {proc.stderr.strip().splitlines()[-1]}")
    return proc


def test_python_env_is_the_lock_for_the_images_python():
    env = yaml.safe_load((ROOT / "python_env.yaml").read_text())
    assert str(env["python"]) == check_lock.PYTHON
    assert env["dependencies"] == ["-r requirements/gpu.lock"]
    project = yaml.safe_load((ROOT / "MLproject").read_text())
    assert project["python_env"] == "python_env.yaml" and "docker_env" not in project
    # the Dockerfile installs the same file the same way: hash-checking, every dependency pinned
    docker = (ROOT / "Dockerfile").read_text()
    assert "--require-hashes" in docker and "--no-deps --require-hashes" not in docker


def test_mlflow_run_installs_the_lock_in_hash_checking_mode(tmp_path):
    """python_env.yaml's install of the lock resolves with what the lock leaves out on purpose
    (xformers; --no-deps in the documented installs) left out: every other requirement has a
    trusted hash."""
    proc = dry_run(mlflow_requirements_file(tmp_path))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "Would install" in proc.stdout + proc.stderr


def test_without_no_deps_pip_stops_only_at_what_the_lock_leaves_out(tmp_path):
    """MLflow's virtualenv manager runs pip without --no-deps: it refuses the lock, and only for
    the packages pyproject's uv overrides leave out (docs/deploy.md says so)."""
    left_out = check_lock.not_installed()
    if not left_out:
        pytest.skip("the lock leaves nothing out")
    env = yaml.safe_load((ROOT / "python_env.yaml").read_text())
    req = mlflow_requirements_file(tmp_path)
    proc = check_lock.install_dry_run(uv(), req, python=str(env["python"]), timeout=240, exempt=False)
    if check_lock.unreachable(proc):
        pytest.skip("the package index is not reachable from here")
    assert proc.returncode != 0
    # uv lists the packages on the same line or, wrapped, on the lines below
    refused = re.search(r"no trusted hash was provided for:(.*)", proc.stderr, re.DOTALL)
    assert refused, proc.stderr[-2000:]
    assert set(re.findall(r"`([^`]+)`", refused.group(1))) == left_out.keys(), refused.group(0)


def test_a_lock_missing_a_declared_dependency_fails_the_install(tmp_path):
    """The check can fail: without the torchaudio pin (which vLLM declares), pip in hash-checking
    mode has no trusted hash for it, which is how the install stopped before the lock was closed."""
    text = LOCK.read_text()
    lines, skip = [], False
    for line in text.splitlines():
        if line.startswith("torchaudio=="):
            skip = True
            continue
        if skip and line.startswith((" ", "\t")):
            continue
        skip = False
        lines.append(line)
    assert len(lines) < len(text.splitlines()), (
        "the lock pins no torchaudio: pick another declared dependency"
    )
    proc = dry_run(mlflow_requirements_file(tmp_path, "\n".join(lines) + "\n"))
    assert proc.returncode != 0
    assert "torchaudio" in proc.stderr and "hash" in proc.stderr.lower(), proc.stderr[-2000:]


def test_mlflow_run_starts_as_the_readme_writes_it(tmp_path):
    """The README's `mlflow run` lines name ``--env-manager local`` after installing the lock (the
    default manager, virtualenv, needs pyenv to build Python; uv finds the project's uv.lock, the
    environment server's, and syncs that instead of python_env.yaml), and that path starts: ``mlflow
    run . -e env --env-manager local`` runs the project's environment check in this interpreter."""
    import os
    import re
    import subprocess
    import sys

    readme = (ROOT / "README.md").read_text()
    documented = re.findall(r"^\S*mlflow run \. .*$", readme, re.MULTILINE)
    assert documented and all("--env-manager local" in line for line in documented), documented
    assert re.search(r"pip install --no-deps --require-hashes -r requirements/gpu\.lock", readme)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    mlflow = str(Path(sys.executable).parent / "mlflow")
    proc = subprocess.run([mlflow, "run", str(ROOT), "-e", "env", "--env-manager", "local"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"python {sys.version.split()[0]}" in proc.stdout and "mlflow " in proc.stdout, out[-3000:]
    assert "succeeded" in proc.stderr  # MLflow's own "Run (ID '...') succeeded."


def test_the_workstation_install_pulls_no_training_stack(tmp_path):
    """`pip install -e '.[cluster]'` (docs/deploy.md, the workstation) resolves for Linux x86_64
    without torch, CUDA or the rest of the training stack, and has the Kubernetes client that
    `orthojob k8s submit|status|logs` import."""
    import subprocess

    assert "pip install -e '.[cluster]'" in (ROOT / "docs" / "deploy.md").read_text()
    proc = subprocess.run(
        [uv(), "pip", "compile", str(ROOT / "pyproject.toml"), "--extra", "cluster", "--python-platform",
         check_lock.PLATFORM, "--python-version", check_lock.PYTHON, "--no-header", "--quiet"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    if check_lock.unreachable(proc):
        pytest.skip(f"the package index is not reachable from here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {line.split("==")[0].strip().lower() for line in proc.stdout.splitlines() if "==" in line}
    assert {"kubernetes", "pyyaml", "numpy"} <= names
    heavy = {
        n
        for n in names
        if n in {"torch", "transformers", "trl", "vllm", "mlflow", "triton"} or n.startswith("nvidia-")
    }
    assert not heavy, sorted(heavy)
