"""Test-wide settings: offline hub, MLflow's embedded default store in a temporary folder
(so that a stage run by a test never writes mlflow.db / mlartifacts into the checkout), and the tiny
model that the GRPO tests train (a module can define its own `tiny_model` instead)."""

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
    os.environ.setdefault("ORTHORL_MODEL_CACHE", str(root / "model-cache"))  # s3:// base models
    try:
        from orthojob.ops import tracking

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
        os.environ.pop("ORTHORL_MODEL_CACHE", None)


@pytest.fixture(autouse=True)
def _tracking_uri_restored():
    """Every test leaves MLflow's tracking URI as it found it: ``mlflow.set_tracking_uri`` also writes
    ``MLFLOW_TRACKING_URI`` into the environment, so a test that points MLflow at its own server
    would otherwise send every later test of its worker to that server after it has stopped."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if os.environ.get("MLFLOW_TRACKING_URI") == before:
        return
    try:
        import mlflow
    except ImportError:
        mlflow = None
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    elif mlflow is not None:
        mlflow.set_tracking_uri(before)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A real SeaweedFS S3 endpoint for one test module (tests/services.py)."""
    from tests.services import seaweedfs

    with seaweedfs(tmp_path_factory.mktemp("weed")) as service:
        yield service


@pytest.fixture(scope="module")
def tiny_tool_base(tmp_path_factory):
    """The offline tiny model of stage 1 (:func:`orthojob.stages.tool_sft.build_tiny_tool_model`): its
    tokenizer knows the tool conversations, 8192 positions. ~20 s to build, once per test module."""
    from orthojob.stages.tool_sft import build_tiny_tool_model

    return build_tiny_tool_model(tmp_path_factory.mktemp("tiny-tool") / "base", ["task_easy"])


@pytest.fixture
def s3_env(s3, monkeypatch):
    """:func:`s3`'s keys and endpoint in the environment, as a pod gets them."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    return s3


LONGEST_FIRST = (
    "test_pipeline.py",
    "test_e2e_mlflow_s3.py",
    "test_deploy.py",
    "test_oracle_safety.py",
    "test_base_models.py",
)
"""Files whose tests take longest (the tiny-cpu pipeline's SFT steps above all). ``make test`` runs
the suite on both cores (pytest-xdist, one file per worker at a time, in collection order: the
Makefile passes ``--no-loadscope-reorder``, without which xdist reorders files by their number of
tests and the pipeline's one long test started last, leaving one core idle for ~15 min), so they
start first and the short files fill the other core around them."""


def pytest_collection_modifyitems(session, config, items):
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept otherwise


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The tiny Qwen2 model, its tokenizer also trained on real prompts (shorter prompts)."""
    from orthojob.core.prompts import TRAIN_SEED_START, prompt_rows
    from orthojob.modeling.tiny_model import build_tiny_model

    rows = prompt_rows(4, TRAIN_SEED_START, "task_easy", False) + prompt_rows(2, 0, "task_hard", True)
    corpus = [m["content"] for r in rows for m in r["prompt"]]
    path = tmp_path_factory.mktemp("tiny") / "tiny"
    return build_tiny_model(path, vocab_size=1024, max_position_embeddings=4096, corpus=corpus)
