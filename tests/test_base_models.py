"""Base weights from S3, against a real SeaweedFS server and the offline tiny model.

* ``orthojob model stage`` puts a base model in S3 with a manifest; :func:`orthojob.modeling.base_models.fetch`
  downloads it once into the model cache, verifies it (sha256 against the manifest, or sizes against
  the listing for a prefix staged by another tool), reuses it unchanged, and refuses an empty, wrong,
  unreadable or tampered prefix with exit 30 and a message saying what to do;
* an adapter trained from ``--model s3://...`` never records the cache folder: for a base staged
  from the model hub it names the hub id (and commit) as ``base_model_name_or_path``, which PEFT
  (``PeftConfig``, ``AutoPeftModelForCausalLM``) and MLflow's transformers loader resolve on another
  machine without S3, and keeps the URI and the staged files' digest beside it; a base staged from a
  plain folder is recorded as the URI. ``orthojob bc-sft`` and ``orthojob grpo`` take ``--model
  s3://...``, and a fresh process with an empty model cache resolves the adapter's base from S3 again
  (``train --from-checkpoint``, then ``evaluate``), not from the hub, and refuses a prefix staged
  again with other files.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from orthojob.modeling import base_models
from orthojob.ops import storage
from orthojob.ops.exit_codes import ExitCode
from tests.services import run_process_group

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "orthorl"
BASE = f"s3://{BUCKET}/models/tiny"
HUB_ID = "orthorl-test/tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
HUB_BASE = f"s3://{BUCKET}/models/tiny-from-hub"


@pytest.fixture(scope="module")
def staged(s3, tmp_path_factory) -> Path:
    """A small tiny model (prompts fit: its tokenizer learned them), staged at BASE; its folder."""
    from orthojob.modeling.models import build_tiny

    folder = build_tiny(tmp_path_factory.mktemp("tiny") / "tiny", ["task_easy"], hidden_size=32, layers=1,
                        heads=2, kv_heads=1, intermediate=64)  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3.env().items():
            mp.setenv(k, v)
        from orthojob.cli import main

        assert main(["model", "stage", str(folder), BASE]) == 0
    return folder


@pytest.fixture(scope="module")
def hub_cache(staged, tmp_path_factory) -> Path:
    """A model hub cache (``HF_HUB_CACHE``) holding :func:`staged`'s files as the snapshot of HUB_ID
    at COMMIT, the way ``snapshot_download`` leaves a download: what the hub id resolves to offline."""
    import shutil

    cache = tmp_path_factory.mktemp("hub-cache")
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    shutil.copytree(staged, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


@pytest.fixture(scope="module")
def hub_staged(hub_cache, s3) -> dict:
    """``orthojob model stage HUB_ID HUB_BASE`` (the hub offline, its cache :func:`hub_cache`); the
    manifest."""
    from huggingface_hub import constants

    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3.env().items():
            mp.setenv(k, v)
        mp.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        from orthojob.cli import main

        assert main(["model", "stage", HUB_ID, HUB_BASE]) == 0
        return storage.read_manifest(HUB_BASE)


def _hub_machine(hub_cache: Path, tmp: Path) -> dict[str, str]:
    """The environment of a machine with the model hub (offline, its cache :func:`hub_cache`) and no
    S3 (no keys, no endpoint) and an empty model cache: where the adapter is used outside this project."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MLFLOW_"))}
    return env | {
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_CACHE": str(hub_cache),
        "HF_HOME": str(tmp / "hf-home"),
        base_models.CACHE_ENV: str(tmp / "model-cache"),
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",  # nothing listens: S3 is not reachable from here
    }


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
    assert main(["grpo", "--model", f"s3://{BUCKET}/models/nothing", "--steps", "1", "--lora-r", "0",
                 "--skip-sft-gate", "--out", str(tmp_path / "grpo")]) == 30  # fmt: skip
    assert "is empty or does not exist" in capsys.readouterr().err
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    assert main(["model", "fetch", BASE]) == ExitCode.STORAGE_DENIED == 32  # bad keys: never retried
    assert "refused the credentials" in capsys.readouterr().err
    with pytest.raises(storage.StorageError, match="does not exist"):
        base_models.resolve(str(tmp_path / "no-such-volume" / "qwen"))


def test_load_policy_records_the_uri_not_the_cache(staged, s3_env, tmp_path, monkeypatch):
    """`train --model s3://...` with LoRA, in process, a base staged from a plain folder (no hub id):
    the adapter names the URI (nothing portable is known) with the staged files' digest, never the
    pod-local cache folder."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(base_models.CACHE_ENV, str(cache))
    from orthojob.modeling import models

    assert "source" not in storage.read_manifest(BASE)
    model, _tok = models.load_policy(BASE, lora_r=4)
    assert model.peft_config["default"].base_model_name_or_path == BASE
    model.save_pretrained(tmp_path / "adapter")
    text = (tmp_path / "adapter" / "adapter_config.json").read_text()
    cfg = json.loads(text)
    assert cfg["base_model_name_or_path"] == cfg[base_models.RECORD_URI] == BASE
    assert cfg[base_models.RECORD_DIGEST] == base_models.staged_digest(storage.read_manifest(BASE))
    assert cfg["revision"] is None
    assert str(cache) not in text and "orthorl-fetched" not in text
    assert models.adapter_base(tmp_path / "adapter") == BASE
    assert base_models.reference(str(staged)) == str(staged.resolve())


def test_stage_records_where_the_weights_came_from(staged, hub_cache, hub_staged, s3_env, tmp_path, capsys):
    """The manifest's ``source``: a hub id's commit (the snapshot folder's name), a hub cache folder's
    own hub id, a plain folder's ``--hub-id``; a ``--hub-id`` that contradicts the folder is refused."""
    from orthojob.cli import main

    assert hub_staged["source"] == {"hub_id": HUB_ID, "revision": COMMIT}
    assert set(hub_staged["files"]) == {p.name for p in staged.iterdir()}
    snapshot = hub_cache / "models--orthorl-test--tiny" / "snapshots" / COMMIT
    assert base_models.hub_origin(snapshot) == {"hub_id": HUB_ID, "revision": COMMIT}
    assert base_models.hub_origin(staged) is None

    uri = f"s3://{BUCKET}/models/declared"
    assert main(["model", "stage", str(staged), uri, "--hub-id", f"{HUB_ID}@{COMMIT}"]) == 0
    assert f"adapters record {HUB_ID}@{COMMIT}" in capsys.readouterr().out
    assert base_models.origin(uri) == {
        "uri": uri,
        "hub_id": HUB_ID,
        "revision": COMMIT,
        "digest": base_models.staged_digest(hub_staged),  # the same files: the same digest
    }
    assert (
        main(["model", "stage", str(snapshot), f"s3://{BUCKET}/models/other", "--hub-id", "other/model"]) == 2
    )
    assert f"is a copy of {HUB_ID}@{COMMIT}" in capsys.readouterr().err
    assert main(["model", "stage", str(staged), f"s3://{BUCKET}/models/other", "--hub-id", "./folder"]) == 2
    assert storage.read_manifest(f"s3://{BUCKET}/models/other") is None
    # another staged prefix passes its source on
    assert base_models.stage(HUB_BASE, f"s3://{BUCKET}/models/copy", say=lambda m: None)["source"] == {
        "hub_id": HUB_ID,
        "revision": COMMIT,
    }


def test_an_adapter_from_a_hub_staged_base_resolves_everywhere(
    hub_cache, hub_staged, s3_env, tmp_path, monkeypatch
):
    """LoRA on ``--model s3://...`` staged from the model hub: adapter_config.json names the hub id
    and its commit (kept when the folder is loaded again to be logged), which PEFT (``PeftConfig``, ``AutoPeftModelForCausalLM``) resolves on a machine
    without S3 (the same outputs as this project's loader, which fetches the staged copy from S3);
    the MLflow model's ``peft/`` folder and metadata name it too, and MLflow's loader loads it there;
    this project's loader refuses a prefix staged again with other files."""
    import torch

    from orthojob.lifecycle import model_logging
    from orthojob.modeling import adapters, models
    from orthojob.ops import tracking

    monkeypatch.setenv(base_models.CACHE_ENV, str(tmp_path / "cache"))
    model, tok = models.load_policy(HUB_BASE, lora_r=4)
    torch.manual_seed(0)
    with torch.no_grad():  # a LoRA that changes the outputs (B starts at zero)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    tok.save_pretrained(adapter)
    text = (adapter / "adapter_config.json").read_text()
    cfg = json.loads(text)
    assert cfg["base_model_name_or_path"] == HUB_ID and cfg["revision"] == COMMIT
    assert cfg[base_models.RECORD_URI] == HUB_BASE
    assert cfg[base_models.RECORD_DIGEST] == base_models.staged_digest(hub_staged)
    assert str(tmp_path / "cache") not in text
    assert models.adapter_base(adapter) == HUB_BASE

    # reloaded from the folder as the SFT stages log their checkpoints (PEFT drops the keys it does
    # not know): the record is kept, and saved again the same
    reloaded, _ = model_logging.load_checkpoint(adapter)
    assert adapters.recorded_base(reloaded) == {k: cfg[k] for k in adapters.recorded_base(model)}
    reloaded.save_pretrained(tmp_path / "again")
    again = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    assert {k: again.get(k) for k in adapters.recorded_base(model)} == adapters.recorded_base(model)

    # logged with MLflow's transformers flavour (the sqlite store, artifacts beside it)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    with tracking.stage_run("grpo", experiment="hub-staged-base"):
        info = model_logging.log_model(model, tok, HUB_BASE)
    assert info.metadata["base_model"] == HUB_ID and info.metadata["base_model_revision"] == COMMIT
    assert info.metadata["base_model_uri"] == HUB_BASE and info.metadata["adapter"] == "true"
    assert info.metadata["base_model_digest"] == cfg[base_models.RECORD_DIGEST]

    # this project's loader, a fresh model cache: the staged copy from S3 (the hub is not there)
    monkeypatch.setenv(base_models.CACHE_ENV, str(tmp_path / "cache2"))
    ids = tok("Tooth 11 moves", return_tensors="pt")["input_ids"]
    ours, _ = models.load_for_inference(adapter, device="cpu")
    with torch.no_grad():
        expected = ours(ids).logits[0, -1].tolist()
    assert (tmp_path / "cache2" / BUCKET / "models" / "tiny-from-hub" / "config.json").is_file()

    # another machine: the model hub (offline cache), no S3, no model cache
    script = f"""
import json, warnings, torch, mlflow
from peft import AutoPeftModelForCausalLM, PeftConfig
ids = torch.tensor({ids.tolist()})
cfg = PeftConfig.from_pretrained({str(adapter)!r})
peft = AutoPeftModelForCausalLM.from_pretrained({str(adapter)!r}).eval()
logged = mlflow.transformers.load_model({f"models:/{info.model_id}"!r}, return_type="components")["model"].eval()
peft_dir = mlflow.artifacts.download_artifacts({f"models:/{info.model_id}"!r}) + "/peft/adapter_config.json"
with torch.no_grad():
    print(json.dumps({{"base": cfg.base_model_name_or_path, "revision": cfg.revision,
                      "peft": peft(ids).logits[0, -1].tolist(), "mlflow": logged(ids).logits[0, -1].tolist(),
                      "mlflow_base": json.load(open(peft_dir))["base_model_name_or_path"]}}))
"""
    env = _hub_machine(hub_cache, tmp_path / "machine") | {
        "MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"]
    }
    res = run_process_group(
        [sys.executable, "-c", script], env, tmp_path, 300, "PEFT and MLflow load the adapter"
    )
    assert res.returncode == 0, res.stderr[-5000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["base"] == got["mlflow_base"] == HUB_ID and got["revision"] == COMMIT
    assert got["peft"] == pytest.approx(expected, abs=1e-4)
    assert len(got["mlflow"]) == len(expected)  # loads (its base: MLflow's own copy in the artifact)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(
        hub_cache / "models--orthorl-test--tiny" / "snapshots" / COMMIT
    )
    with torch.no_grad():
        assert plain(ids).logits[0, -1].tolist() != pytest.approx(expected, abs=1e-4), (
            "the LoRA changes nothing"
        )
    assert not (tmp_path / "machine" / "model-cache").exists(), "PEFT and MLflow must not need S3"

    # the prefix staged again with other files: the adapter's base is gone, and this loader says so
    (adapter / "adapter_config.json").write_text(
        json.dumps(cfg | {base_models.RECORD_DIGEST: "sha256:" + "0" * 64}, indent=2)
    )
    monkeypatch.setenv(base_models.CACHE_ENV, str(tmp_path / "cache3"))
    with pytest.raises(storage.StorageError, match="no longer holds the base weights"):
        models.load_for_inference(adapter, device="cpu")
    with pytest.raises(storage.StorageError, match="no longer holds the base weights"):
        base_models.fetch(HUB_BASE, tmp_path / "cache4", digest="sha256:" + "1" * 64)
    # the digest names the files, not where they are: BASE holds the same ones
    assert base_models.fetch(BASE, tmp_path / "cache4", digest=cfg[base_models.RECORD_DIGEST]).is_dir()


def _orthojob(args: list[str], env: dict[str, str], cwd: Path, what: str, ok: tuple[int, ...] = (0,)):
    res = run_process_group([sys.executable, "-m", "orthojob.cli", *args], env, cwd, 600, what)
    assert res.returncode in ok, (
        f"{what} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    )
    return res


def _adapter_base(uri: str) -> tuple[str, str, str]:
    """(base_model_name_or_path, orthorl_base_uri, revision) of the adapter published at ``uri``."""
    loc = storage.parse_s3_uri(uri)
    body = storage.s3_client().get_object(Bucket=loc.bucket, Key=loc.key("adapter_config.json"))["Body"]
    cfg = json.loads(body.read())
    return cfg["base_model_name_or_path"], cfg.get(base_models.RECORD_URI), cfg.get("revision")


@pytest.mark.slow
def test_adapters_from_an_s3_base_resolve_in_a_fresh_pod(hub_staged, s3_env, tmp_path):
    """sft --model s3:// (pod A; the base staged from the model hub) -> train --from-checkpoint that
    adapter (pod B, empty cache) -> evaluate the GRPO adapter (pod C, empty cache). Each pod is a
    process with its own model cache, work folder and MLflow store, and an empty hub cache: the
    adapters name the hub id, and every pod fetches the staged copy from S3."""

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
            "HF_HOME": str(root / "hf-home"),
            "HF_HUB_CACHE": str(root / "hf-home" / "hub"),
            "ORTHORL_WORK_DIR": str(root / "work"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
        }

    sft_uri, grpo_uri = f"s3://{BUCKET}/runs/sft-s3", f"s3://{BUCKET}/runs/grpo-s3"
    a = pod("a")
    out = _orthojob(["bc-sft", "--no-gate", "--model", HUB_BASE, "--lora-r", "4", "--steps", "2", "--examples", "4",
                     "--batch-size", "2", "--task-id", "task_easy", "--out", sft_uri], a, tmp_path / "a", "sft")  # fmt: skip
    assert "fetching base model" in out.stdout
    assert _adapter_base(sft_uri) == (HUB_ID, HUB_BASE, COMMIT), "the hub id and the URI, not the pod's cache"

    b = pod("b")  # 2 GRPO steps on a random model: its own gate may fail (exit 3)
    _orthojob(["grpo", "--model", HUB_BASE, "--from-checkpoint", sft_uri, "--skip-sft-gate", "--steps", "2",
               "--lora-r", "4", "--num-generations", "2", "--batch-size", "2", "--max-prompt-length", "1760",
               "--max-completion-length", "16", "--max-seq-length", "2048", "--gate-seeds", "1",
               "--no-gradient-checkpointing", "--out", grpo_uri], b, tmp_path / "b", "grpo",
              ok=(0, ExitCode.GRPO_GATE_FAILED))  # fmt: skip
    assert (Path(b[base_models.CACHE_ENV]) / BUCKET / "models" / "tiny-from-hub" / "config.json").is_file()
    assert _adapter_base(grpo_uri) == (HUB_ID, HUB_BASE, COMMIT)

    c = pod("c")
    report = tmp_path / "eval.json"
    _orthojob(["evaluate", "--checkpoint", grpo_uri, "--task-id", "task_easy", "--seeds", "1",
               "--max-new-tokens", "8", "--batch-size", "1", "--out", str(report)], c, tmp_path / "c", "evaluate")  # fmt: skip
    assert json.loads(report.read_text())["checkpoint"] == grpo_uri
    assert (Path(c[base_models.CACHE_ENV]) / BUCKET / "models" / "tiny-from-hub" / "config.json").is_file()
