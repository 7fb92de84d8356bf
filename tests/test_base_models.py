"""Base weights from S3 (issue 13, item 3), against a real SeaweedFS server and the offline tiny model.

* ``orthojob model stage`` puts a base model in S3 with a manifest; :func:`orthojob.base_models.fetch`
  downloads it once into the model cache, verifies it (sha256 against the manifest, or sizes against
  the listing for a prefix staged by another tool), reuses it unchanged, and refuses an empty, wrong,
  unreadable or tampered prefix with exit 30 and a message saying what to do;
* an adapter trained from ``--model s3://...`` records the URI, not the cache folder, as its base;
  ``orthojob sft`` and ``orthojob train`` take ``--model s3://...``, and a fresh process with an
  empty model cache resolves the adapter's base from S3 again (``train --from-checkpoint``, then
  ``evaluate``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from orthojob import base_models, storage
from orthojob.exit_codes import ExitCode
from tests.services import run_process_group

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "orthorl"
BASE = f"s3://{BUCKET}/models/tiny"


@pytest.fixture(scope="module")
def staged(s3, tmp_path_factory) -> Path:
    """A small tiny model (prompts fit: its tokenizer learned them), staged at BASE; its folder."""
    from orthojob.models import build_tiny

    folder = build_tiny(tmp_path_factory.mktemp("tiny") / "tiny", ["task_easy"], hidden_size=32, layers=1,
                        heads=2, kv_heads=1, intermediate=64)  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3.env().items():
            mp.setenv(k, v)
        from orthojob.cli import main

        assert main(["model", "stage", str(folder), BASE]) == 0
    return folder


def test_fetch_verifies_caches_and_refuses_what_is_not_a_model(staged, s3_env, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    got = base_models.fetch(BASE, cache)
    assert got == cache / BUCKET / "models" / "tiny"
    assert (got / "config.json").read_bytes() == (staged / "config.json").read_bytes()
    stamp = json.loads(got.with_name("tiny" + base_models.STAMP_SUFFIX).read_text())
    assert stamp["manifest"] is True and stamp["uri"] == BASE

    # unchanged on both sides: reused without downloading (a retried pod, another rank, the next stage)
    def no_download(*a, **k):
        raise AssertionError("downloaded again")

    with monkeypatch.context() as mp:
        mp.setattr(storage, "download_dir", no_download)
        assert base_models.fetch(BASE + "/", cache) == got

    # the local copy changed: fetched again, and verified
    (got / "config.json").write_text("{}")
    base_models.fetch(BASE, cache)
    assert (got / "config.json").read_bytes() == (staged / "config.json").read_bytes()

    client = storage.s3_client()
    # staged by another tool (no manifest): sizes checked against the listing
    for p in staged.iterdir():
        client.put_object(Bucket=BUCKET, Key=f"models/plain/{p.name}", Body=p.read_bytes())
    plain = base_models.fetch(f"s3://{BUCKET}/models/plain", cache)
    assert sorted(x.name for x in plain.iterdir()) == sorted(x.name for x in staged.iterdir())

    # tampered after staging: the manifest's sha256 refuses it
    client.put_object(Bucket=BUCKET, Key="models/tiny/config.json", Body=b'{"tampered": 1}')
    with pytest.raises(storage.StorageError, match="does not match the manifest"):
        base_models.fetch(BASE, tmp_path / "other-cache")
    client.put_object(
        Bucket=BUCKET, Key="models/tiny/config.json", Body=(staged / "config.json").read_bytes()
    )

    # what is not a model: exit 30 from every command, with the URI and what to do
    client.put_object(Bucket=BUCKET, Key="models/half/tokenizer.json", Body=b"{}")
    from orthojob.cli import main

    cases = {
        f"s3://{BUCKET}/models/nothing": "is empty or does not exist",
        f"s3://{BUCKET}/models/half": "holds no config.json",
    }
    for uri, message in cases.items():
        assert main(["model", "fetch", uri]) == ExitCode.STORAGE == 30
        assert message in capsys.readouterr().err
    assert main(["train", "--model", f"s3://{BUCKET}/models/nothing", "--steps", "1", "--lora-r", "0",
                 "--skip-sft-gate", "--out", str(tmp_path / "grpo")]) == 30  # fmt: skip
    assert "is empty or does not exist" in capsys.readouterr().err
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    assert main(["model", "fetch", BASE]) == ExitCode.STORAGE_DENIED == 32  # bad keys: never retried
    assert "refused the credentials" in capsys.readouterr().err
    with pytest.raises(storage.StorageError, match="does not exist"):
        base_models.resolve(str(tmp_path / "no-such-volume" / "qwen"))


def test_load_policy_records_the_uri_not_the_cache(staged, s3_env, tmp_path, monkeypatch):
    """`train --model s3://...` with LoRA, in process: the PEFT config names the URI."""
    monkeypatch.setenv(base_models.CACHE_ENV, str(tmp_path / "cache"))
    from orthojob import models

    model, _tok = models.load_policy(BASE, lora_r=4)
    assert model.peft_config["default"].base_model_name_or_path == BASE
    model.save_pretrained(tmp_path / "adapter")
    assert models.adapter_base(tmp_path / "adapter") == BASE
    assert base_models.reference(str(staged)) == str(staged.resolve())


def _orthojob(args: list[str], env: dict[str, str], cwd: Path, what: str, ok: tuple[int, ...] = (0,)):
    res = run_process_group([sys.executable, "-m", "orthojob.cli", *args], env, cwd, 600, what)
    assert res.returncode in ok, (
        f"{what} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    )
    return res


def _adapter_base(uri: str) -> str:
    loc = storage.parse_s3_uri(uri)
    body = storage.s3_client().get_object(Bucket=loc.bucket, Key=loc.key("adapter_config.json"))["Body"]
    return json.loads(body.read())["base_model_name_or_path"]


@pytest.mark.slow
def test_adapters_from_an_s3_base_resolve_in_a_fresh_pod(staged, s3_env, tmp_path):
    """sft --model s3:// (pod A) -> train --from-checkpoint that adapter (pod B, empty cache) ->
    evaluate the GRPO adapter (pod C, empty cache). Each pod is a process with its own model cache,
    work folder and MLflow store."""

    def pod(name: str) -> dict[str, str]:
        root = tmp_path / name
        root.mkdir()
        return {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            base_models.CACHE_ENV: str(root / "model-cache"),
            "ORTHORL_WORK_DIR": str(root / "work"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
        }

    sft_uri, grpo_uri = f"s3://{BUCKET}/runs/sft-s3", f"s3://{BUCKET}/runs/grpo-s3"
    a = pod("a")
    out = _orthojob(["sft", "--model", BASE, "--lora-r", "4", "--steps", "2", "--examples", "4",
                     "--batch-size", "2", "--task-id", "task_easy", "--out", sft_uri], a, tmp_path / "a", "sft")  # fmt: skip
    assert "fetching base model" in out.stdout
    assert _adapter_base(sft_uri) == BASE, "the SFT adapter must name the URI, not the pod's cache"

    b = pod("b")  # 2 GRPO steps on a random model: its own gate may fail (exit 3)
    _orthojob(["train", "--model", BASE, "--from-checkpoint", sft_uri, "--skip-sft-gate", "--steps", "2",
               "--lora-r", "4", "--num-generations", "2", "--batch-size", "2", "--max-prompt-length", "1760",
               "--max-completion-length", "16", "--max-seq-length", "2048", "--gate-seeds", "1",
               "--no-gradient-checkpointing", "--out", grpo_uri], b, tmp_path / "b", "train",
              ok=(0, ExitCode.GRPO_GATE_FAILED))  # fmt: skip
    assert (Path(b[base_models.CACHE_ENV]) / BUCKET / "models" / "tiny" / "config.json").is_file()
    assert _adapter_base(grpo_uri) == BASE

    c = pod("c")
    report = tmp_path / "eval.json"
    _orthojob(["evaluate", "--checkpoint", grpo_uri, "--task-id", "task_easy", "--seeds", "1",
               "--max-new-tokens", "8", "--batch-size", "1", "--out", str(report)], c, tmp_path / "c", "evaluate")  # fmt: skip
    assert json.loads(report.read_text())["checkpoint"] == grpo_uri
    assert (Path(c[base_models.CACHE_ENV]) / BUCKET / "models" / "tiny" / "config.json").is_file()
