"""Base weights from the model hub, S3 or a mounted volume: ``--model`` of every stage.

A base model reference (``--model``, an adapter's ``base_model_name_or_path``) is one of:

* a model hub id (``Qwen/Qwen2.5-3B-Instruct``): transformers downloads it into ``HF_HOME``
  (``HF_TOKEN`` for gated or private models), as before;
* a folder (``/models/qwen2.5-3b``, e.g. on a mounted volume): loaded as it is;
* ``s3://bucket/prefix``: the folder's objects are downloaded once into the model cache
  (:func:`model_cache`, ``ORTHORL_MODEL_CACHE``) and loaded from there (:func:`fetch`).

What :func:`fetch` checks, and how the cache survives retries:

* the prefix must hold objects, among them ``config.json`` and a weight file (an empty,
  missing or unreadable prefix, or one that is no model folder, is a :class:`StorageError`: exit 30,
  with the URI and what to do in the message);
* a prefix written by ``orthojob model stage`` (or any :func:`orthojob.storage.upload_dir`) has a
  ``MANIFEST.json``: every file's sha256 is checked against it. A prefix staged with another
  tool (``aws s3 sync``) has none: every object's size is checked against the listing (botocore
  validates the transfer's checksum where the store sends one);
* after a verified download, a stamp beside the folder (``<folder>.orthorl-fetched.json``) records
  the listing (each object's size and ETag) and each local file's size and mtime. The next fetch
  (a retried pod, another rank, the next stage) lists the prefix once and reuses the folder when
  neither side changed, without hashing gigabytes again; anything else downloads again.
* processes fetching into the same cache take turns on a lock file in the cache itself, so pods
  sharing a volume (and the ranks of a node) download once.

Adapters record the *reference*, not the pod-local folder (:func:`reference`): an adapter trained
from ``--model s3://...`` names that URI as its base, and a fresh pod with an empty cache fetches it
again (:func:`resolve`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orthojob import storage
from orthojob.storage import MANIFEST, StorageError

log = logging.getLogger(__name__)

CACHE_ENV = "ORTHORL_MODEL_CACHE"
STAMP_SUFFIX = ".orthorl-fetched.json"
REQUIRED_FILE = "config.json"
WEIGHT_SUFFIXES: tuple[str, ...] = (".safetensors", ".bin")
HUB_IGNORE: tuple[str, ...] = ("original/*", "*.pth", "*.pt", "*.onnx", "*.h5", "*.msgpack", "*.gguf")
"""Files of a model hub repository that no stage loads (other frameworks' copies of the weights)."""


def model_cache() -> Path:
    """Where ``s3://`` base models are cached: ``ORTHORL_MODEL_CACHE``, else
    ``$XDG_CACHE_HOME/orthorl/models`` (``/cache/orthorl/models`` in the image: the persistent
    volume of k8s/), else ``~/.cache/orthorl/models``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "orthorl" / "models"


def looks_like_path(ref: str) -> bool:
    """Whether ``ref`` names a local folder rather than a hub id (``owner/name`` or ``name``)."""
    return ref.startswith(("/", "./", "../", "~")) or ref in (".", "..") or ref.count("/") > 1


def reference(ref: str) -> str:
    """What an adapter records as its base: an ``s3://`` URI or hub id as given, a local folder as
    an absolute path (a relative one would not resolve from another working directory)."""
    ref = str(ref)
    if storage.is_s3_uri(ref):
        return ref.rstrip("/")
    path = Path(ref).expanduser()
    if path.is_dir():
        return str(path.resolve())
    return ref


def announce(message: str) -> None:
    """Print a fetch message once per launch (rank 0 only)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"[model] {message}", flush=True)


def resolve(ref: str, say: Callable[[str], Any] | None = announce) -> str:
    """A loadable name for a base model reference: the cached folder of an ``s3://`` URI (fetched
    if needed), a folder as it is, a hub id as it is. A path that does not exist is refused
    (:class:`StorageError`) instead of being taken for a hub id."""
    ref = str(ref)
    if storage.is_s3_uri(ref):
        return str(fetch(ref, say=say))
    if looks_like_path(ref) and not Path(ref).expanduser().is_dir():
        raise StorageError(
            f"base model folder {ref} does not exist or is not a folder: check the path (is the "
            "volume mounted?), or pass a model hub id or an s3:// URI"
        )
    return ref


def _lock(cache: Path, dest: Path):
    from filelock import FileLock

    locks = cache / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(str(dest.resolve()).encode()).hexdigest()[:32]
    return FileLock(str(locks / f"{name}.lock"))


def listing(uri: str, client: Any | None = None) -> dict[str, dict]:
    """``{relative path: {"size", "etag"}}`` of every object below ``uri`` (the manifest excluded)."""
    loc = storage.parse_s3_uri(uri)
    client = client or storage.s3_client()
    prefix = loc.key("")

    def list_all() -> dict[str, dict]:
        found = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix) :]
                if rel and not rel.endswith("/") and rel != MANIFEST:
                    found[rel] = {"size": int(obj["Size"]), "etag": str(obj.get("ETag", "")).strip('"')}
        return found

    return storage.with_retries(f"list the base model at {loc.uri}", list_all)


def _stamp_path(dest: Path) -> Path:
    return dest.with_name(dest.name + STAMP_SUFFIX)


def _local_state(dest: Path, files: dict) -> dict[str, list[int]] | None:
    state = {}
    for rel in files:
        path = dest / rel
        if not path.is_file():
            return None
        st = path.stat()
        state[rel] = [st.st_size, st.st_mtime_ns]
    return state


def _stamp_matches(dest: Path, uri: str, objects: dict) -> bool:
    try:
        stamp = json.loads(_stamp_path(dest).read_text())
    except (OSError, ValueError):
        return False
    return (
        stamp.get("uri") == uri
        and stamp.get("objects") == objects
        and stamp.get("files") == _local_state(dest, objects)
    )


def _download_listed(uri: str, dest: Path, objects: dict, client: Any) -> None:
    """A prefix without a manifest: every listed object, its size checked; all or nothing."""
    import shutil

    loc = storage.parse_s3_uri(uri)
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    for rel, meta in objects.items():
        target = tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        storage.with_retries(
            f"download {rel} from {loc.uri}",
            lambda t=target, r=rel: client.download_file(loc.bucket, loc.key(r), str(t)),
        )
        size = target.stat().st_size
        if size != meta["size"]:
            shutil.rmtree(tmp, ignore_errors=True)
            raise StorageError(
                f"{loc.uri}/{rel}: downloaded {size} bytes, the listing says {meta['size']}; the "
                "object changed during the download or the transfer was cut. Retry."
            )
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def _check_model_folder(uri: str, names: set[str]) -> None:
    top = {n for n in names if "/" not in n}
    if REQUIRED_FILE not in top:
        raise StorageError(
            f"{uri} holds no {REQUIRED_FILE} at its top level ({len(names)} objects): it is not a "
            "transformers model folder. Point --model at the folder that holds config.json and the "
            "weights (stage one with: orthojob model stage MODEL s3://bucket/prefix)."
        )
    if not any(n.endswith(WEIGHT_SUFFIXES) for n in top):
        raise StorageError(
            f"{uri} holds {REQUIRED_FILE} but no weight files ({', '.join(WEIGHT_SUFFIXES)}) at its top "
            "level: the upload is incomplete or the prefix is wrong."
        )


def fetch(
    uri: str,
    cache: str | Path | None = None,
    client: Any | None = None,
    say: Callable[[str], Any] | None = None,
) -> Path:
    """The local, verified folder of the base model at ``uri`` (module docstring): downloaded into
    ``cache`` (default :func:`model_cache`) unless an earlier fetch left it there unchanged."""
    uri = storage.parse_s3_uri(uri).uri  # normalised: no trailing slash
    cache = Path(cache) if cache is not None else model_cache()
    dest = storage.local_mirror(cache, uri)
    dest.parent.mkdir(parents=True, exist_ok=True)
    client = client or storage.s3_client()
    with _lock(cache, dest):
        objects = listing(uri, client)
        if not objects:
            raise StorageError(
                f"{uri} is empty or does not exist (no objects below it): stage the base model first "
                "(orthojob model stage MODEL_OR_FOLDER s3://bucket/prefix, or aws s3 sync), or fix --model"
            )
        _check_model_folder(uri, set(objects))
        manifest = storage.read_manifest(uri, client)
        if manifest is not None:  # staged by orthojob: exactly its files, each sha256-checked
            missing = sorted(set(manifest["files"]) - set(objects))
            if missing:
                raise StorageError(
                    f"{uri}: its {MANIFEST} lists files that are not there ({', '.join(missing[:5])}): "
                    "the prefix was changed after staging; stage the model again"
                )
            objects = {rel: objects[rel] for rel in manifest["files"]}
        if _stamp_matches(dest, uri, objects):
            log.info("base model %s: cached in %s (unchanged)", uri, dest)
            return dest
        if say:
            total = sum(m["size"] for m in objects.values())
            check = "sha256 against its manifest" if manifest else "sizes against the listing"
            say(
                f"fetching base model {uri} ({len(objects)} files, {total / 1e9:.2f} GB; {check}) into {dest}"
            )
        _stamp_path(dest).unlink(missing_ok=True)
        if manifest is not None:
            storage.download_dir(uri, dest, client)
        else:
            _download_listed(uri, dest, objects, client)
        state = _local_state(dest, objects)
        _stamp_path(dest).write_text(
            json.dumps({"uri": uri, "objects": objects, "files": state, "manifest": manifest is not None})
        )
    log.info("base model %s: fetched into %s", uri, dest)
    return dest


def hub_snapshot(repo_id: str) -> Path:
    """A model hub repository in the hub's own cache (``HF_HOME``; ``HF_TOKEN`` if set), without
    other frameworks' copies of the weights (:data:`HUB_IGNORE`)."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, ignore_patterns=list(HUB_IGNORE)))


def local_folder(ref: str, say: Callable[[str], Any] | None = None) -> Path:
    """A local folder holding ``ref``'s weights: fetched from S3, downloaded from the hub, or the
    folder itself (what ``orthojob model fetch`` and ``stage`` work on)."""
    if storage.is_s3_uri(ref):
        return fetch(ref, say=say)
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    if looks_like_path(ref):
        resolve(ref)  # raises: a path that does not exist
    if say:
        say(f"downloading {ref} from the model hub into {os.environ.get('HF_HOME') or 'the hub cache'}")
    return hub_snapshot(ref)


def stage(source: str, uri: str, say: Callable[[str], Any] = print) -> dict:
    """Copy a base model (hub id or folder) to ``uri`` with a manifest (every file's sha256,
    written last); returns the manifest."""
    storage.parse_s3_uri(uri)
    return _upload_model(local_folder(source, say=say), uri, say)


def _upload_model(folder: Path, uri: str, say: Callable[[str], Any]) -> dict:
    names = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    _check_model_folder(str(folder), names)
    say(f"uploading {folder} to {uri} ({len(names)} files; manifest last)")
    # the hub's cache links a snapshot's files to blobs: upload what they point at
    return storage.upload_dir(folder.resolve(), uri, skip=lambda rel: rel.startswith(".cache/"))


__all__ = [
    "CACHE_ENV",
    "announce",
    "fetch",
    "hub_snapshot",
    "listing",
    "local_folder",
    "looks_like_path",
    "model_cache",
    "reference",
    "resolve",
    "stage",
]
