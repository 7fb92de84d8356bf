"""Test-wide settings: offline hub, and MLflow's embedded default store in a temporary folder
(so that a stage run by a test never writes mlflow.db / mlartifacts into the checkout)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_mlflow(tmp_path_factory):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if os.environ.get("MLFLOW_TRACKING_URI"):
        yield
        return
    root = tmp_path_factory.mktemp("mlflow-default")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"
    os.environ["ORTHORL_WORK_DIR"] = str(root / "work")
    try:
        from orthojob import tracking

        cwd = os.getcwd()
        os.chdir(root)  # the embedded store puts the experiment's artifacts next to the database
        try:
            tracking.configure()
        finally:
            os.chdir(cwd)
    except ImportError:  # mlflow not installed: the tests that need it skip themselves
        pass
    try:
        yield
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        os.environ.pop("ORTHORL_WORK_DIR", None)
