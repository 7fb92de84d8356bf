"""orthojob.ops.storage against a real SeaweedFS S3 server with enforced keys."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from orthojob.ops import storage


def _folder(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    (root / "config.json").write_text(json.dumps({"a": 1}))
    (root / "sub").mkdir(exist_ok=True)
    (root / "sub" / "x.txt").write_text("hello")
    return root


def test_round_trip_verifies_digests(s3_env, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("ORTHORL_PROGRESS", "log")  # as in a Job: one line per interval, no bar
    monkeypatch.setenv("ORTHORL_PROGRESS_INTERVAL", "0")
    src = _folder(tmp_path / "src")
    manifest = storage.upload_dir(src, "s3://orthorl/runs/a")
    assert set(manifest["files"]) == {"adapter_model.safetensors", "config.json", "sub/x.txt"}
    out = storage.download_dir("s3://orthorl/runs/a", tmp_path / "dst")
    for rel in manifest["files"]:
        assert (out / rel).read_bytes() == (src / rel).read_bytes()
    # the download's progress: bytes done of the total, one whole line per update
    total = sum(meta["size"] for meta in manifest["files"].values())
    lines = [x for x in capfd.readouterr().err.split("\n") if x.startswith("[download s3://orthorl/runs/a]")]
    assert len(lines) == 3 and "\r" not in "".join(lines)
    assert lines[-1].startswith(
        f"[download s3://orthorl/runs/a] {total / 1e6:.1f}/{total / 1e6:.1f} MB (100%)"
    )


def test_corrupt_object_is_refused(s3_env, tmp_path):
    src = _folder(tmp_path / "src")
    storage.upload_dir(src, "s3://orthorl/runs/corrupt")
    client = storage.s3_client()
    client.put_object(Bucket="orthorl", Key="runs/corrupt/config.json", Body=b'{"tampered": true}')
    with pytest.raises(storage.StorageError, match="does not match the manifest"):
        storage.download_dir("s3://orthorl/runs/corrupt", tmp_path / "dst")
    assert not (tmp_path / "dst").exists(), "a failed download must leave nothing half-made"


def test_incomplete_upload_is_not_used(s3_env, tmp_path):
    client = storage.s3_client()
    client.put_object(Bucket="orthorl", Key="runs/partial/config.json", Body=b"{}")
    with pytest.raises(storage.StorageError, match=r"no MANIFEST\.json"):
        storage.download_dir("s3://orthorl/runs/partial", tmp_path / "dst")


def test_latest_checkpoint_skips_incomplete(s3_env, tmp_path):
    for step in (2, 4):
        storage.upload_dir(_folder(tmp_path / f"c{step}"), f"s3://orthorl/ck/run1/checkpoint-{step}")
    storage.s3_client().put_object(Bucket="orthorl", Key="ck/run1/checkpoint-6/config.json", Body=b"{}")
    assert storage.latest_checkpoint("s3://orthorl/ck/run1") == (4, "s3://orthorl/ck/run1/checkpoint-4")
    assert storage.latest_checkpoint("s3://orthorl/ck/none") is None


def test_wrong_keys_fail_fast_with_a_clear_message(s3, monkeypatch, tmp_path):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(storage.StorageError, match="refused the credentials") as err:
        storage.upload_dir(_folder(tmp_path / "src"), "s3://orthorl/runs/denied")
    assert "not-the-secret" not in str(err.value)


def test_outage_is_retried_then_reported(s3, monkeypatch, tmp_path):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    from tests.services import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setattr(storage, "RETRY_ATTEMPTS", 3)
    with pytest.raises(storage.StorageError, match="failed after 3 attempts"):
        storage.upload_dir(_folder(tmp_path / "src"), "s3://orthorl/runs/outage")


def test_transient_failure_recovers(s3_env, tmp_path):
    """A dropped connection is retried by botocore itself (standard mode), not by a loop of ours."""
    from botocore.exceptions import EndpointConnectionError

    calls = {"n": 0}
    client = storage.s3_client()

    def drop_first(request, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise EndpointConnectionError(endpoint_url=request.url)

    client.meta.events.register("before-send.s3", drop_first)
    storage.upload_dir(_folder(tmp_path / "src"), "s3://orthorl/runs/flaky", client=client)
    assert storage.read_manifest("s3://orthorl/runs/flaky") is not None
    assert calls["n"] >= 5  # the dropped request, its retry, two more files and the manifest


@pytest.mark.parametrize("uri", ["s3://", "s3://A", "http://x/y", "s3://ab"])
def test_bad_uris(uri):
    with pytest.raises(ValueError, match="expected s3://bucket/prefix"):
        storage.parse_s3_uri(uri)
