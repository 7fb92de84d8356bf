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
* a prefix written by ``orthojob model stage`` (or any :func:`orthojob.ops.storage.upload_dir`) has a
  ``MANIFEST.json``: every file's sha256 is checked against it. A prefix staged with another
  tool (``aws s3 sync``) has none: every object's size is checked against the listing (botocore
  validates the transfer's checksum where the store sends one);
* after a verified download, a stamp beside the folder (``<folder>.orthorl-fetched.json``) records
  the listing (each object's size and ETag) and each local file's size and mtime. The next fetch
  (a retried pod, another rank, the next stage) lists the prefix once and reuses the folder when
  neither side changed, without hashing gigabytes again; anything else downloads again.
* processes fetching into the same cache take turns on a lock file in the cache itself, so pods
  sharing a volume (and the ranks of a node) download once.

Adapters record the *reference*, never the pod-local folder (:func:`record`), in a form other
loaders resolve too:

* ``orthojob model stage`` writes where the weights came from into the manifest (``source``: the
  model hub id and the commit of a hub download or of a hub cache snapshot folder, or the
  ``--hub-id ID[@REVISION]`` a folder was declared a copy of);
* an adapter trained from ``--model s3://...`` names that hub id as ``base_model_name_or_path``
  (and its commit as ``revision``), which MLflow, PEFT (``AutoPeftModelForCausalLM``) and vLLM
  resolve, and keeps the URI and the staged files' digest beside it (:data:`RECORD_URI`,
  :data:`RECORD_DIGEST`): this project's loaders fetch that exact staged copy again, in a fresh pod
  with an empty cache (:func:`resolve`), and refuse a prefix staged again with other files;
* a prefix with no hub id (staged from a plain folder, or by another tool) has nothing portable to
  name: ``base_model_name_or_path`` is the URI, as before (load such an adapter with
  :func:`orthojob.modeling.models.load_for_inference`, or onto the folder ``orthojob model fetch URI`` prints).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from orthojob.ops import storage
from orthojob.ops.storage import MANIFEST, StorageError

log = logging.getLogger(__name__)

CACHE_ENV = "ORTHORL_MODEL_CACHE"
STAMP_SUFFIX = ".orthorl-fetched.json"
REQUIRED_FILE = "config.json"
WEIGHT_SUFFIXES: tuple[str, ...] = (".safetensors", ".bin")
HUB_IGNORE: tuple[str, ...] = ("original/*", "*.pth", "*.pt", "*.onnx", "*.h5", "*.msgpack", "*.gguf")
"""Files of a model hub repository that no stage loads (other frameworks' copies of the weights)."""
SOURCE_KEY = "source"
"""The manifest's key for where staged weights came from: ``{"hub_id": ..., "revision": ...}``."""
RECORD_URI = "orthorl_base_uri"
"""adapter_config.json's key for the ``s3://`` URI of the staged base (beside a hub id)."""
RECORD_DIGEST = "orthorl_base_digest"
"""adapter_config.json's key for the staged base's digest (:func:`staged_digest`)."""
_COMMIT = re.compile(r"[0-9a-f]{40}")


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


def staged_digest(manifest: Mapping) -> str:
    """``sha256:<hex>`` over a staged prefix's manifest (every file's path, sha256 and size): the same
    files give the same digest, whoever staged them and whenever."""
    files = {rel: [meta["sha256"], meta.get("size")] for rel, meta in manifest["files"].items()}
    canonical = json.dumps(files, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def origin(uri: str, client: Any | None = None) -> dict:
    """What the manifest at ``uri`` says of the staged base: ``{"uri", "hub_id", "revision",
    "digest"}``, each None where it says nothing (a prefix without a manifest, or staged from a folder
    with no hub id)."""
    uri = storage.parse_s3_uri(uri).uri
    manifest = storage.read_manifest(uri, client)
    source = (manifest or {}).get(SOURCE_KEY) or {}
    return {
        "uri": uri,
        "hub_id": source.get("hub_id") or None,
        "revision": (source.get("revision") or None) if source.get("hub_id") else None,
        "digest": staged_digest(manifest) if manifest is not None else None,
    }


def record(ref: str, client: Any | None = None) -> dict:
    """What an adapter trained from base reference ``ref`` records in its adapter_config.json.

    An ``s3://`` URI staged from the model hub: ``base_model_name_or_path`` is its hub id and
    ``revision`` its commit (what PEFT, MLflow and vLLM resolve), :data:`RECORD_URI` the URI and
    :data:`RECORD_DIGEST` the staged files' digest (what :func:`resolve` fetches and checks). An
    ``s3://`` URI with no hub id: ``base_model_name_or_path`` is the URI. Anything else:
    ``base_model_name_or_path`` is :func:`reference`'s."""
    ref = reference(ref)
    if not storage.is_s3_uri(ref):
        return {"base_model_name_or_path": ref}
    found = origin(ref, client)
    out = {"base_model_name_or_path": found["hub_id"] or found["uri"], RECORD_URI: found["uri"]}
    if found["revision"]:
        out["revision"] = found["revision"]
    if found["digest"]:
        out[RECORD_DIGEST] = found["digest"]
    return out


def recorded_reference(config: Mapping) -> tuple[str | None, str | None]:
    """``(reference, digest)`` of the base an adapter config records (:func:`record`): the staged
    copy's URI and digest when there is one, else ``base_model_name_or_path`` and None."""
    uri = config.get(RECORD_URI)
    if isinstance(uri, str) and uri:
        digest = config.get(RECORD_DIGEST)
        return uri, digest if isinstance(digest, str) and digest else None
    base = config.get("base_model_name_or_path")
    return (base if isinstance(base, str) and base else None), None


def announce(message: str) -> None:
    """Print a fetch message once per launch (rank 0 only)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"[model] {message}", flush=True)


def resolve(ref: str, say: Callable[[str], Any] | None = announce, digest: str | None = None) -> str:
    """A loadable name for a base model reference: the cached folder of an ``s3://`` URI (fetched
    if needed; ``digest``: what an adapter recorded of it, checked by :func:`fetch`), a folder as it
    is, a hub id as it is. A path that does not exist is refused (:class:`StorageError`) instead of
    being taken for a hub id."""
    ref = str(ref)
    if storage.is_s3_uri(ref):
        return str(fetch(ref, say=say, digest=digest))
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
    digest: str | None = None,
) -> Path:
    """The local, verified folder of the base model at ``uri`` (module docstring): downloaded into
    ``cache`` (default :func:`model_cache`) unless an earlier fetch left it there unchanged.
    ``digest`` (an adapter's :data:`RECORD_DIGEST`): the prefix must still hold those files."""
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
        if digest is not None:
            _check_digest(uri, digest, manifest)
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


def _check_digest(uri: str, digest: str, manifest: dict | None) -> None:
    found = staged_digest(manifest) if manifest is not None else f"no {MANIFEST}"
    if found != digest:
        raise StorageError(
            f"{uri} no longer holds the base weights the adapter was trained on (it records {digest}; "
            f"the prefix has {found}): it was staged again with other files. Stage the original weights "
            "there again, or load the adapter onto its base yourself."
        )


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


def hub_origin(folder: str | Path) -> dict | None:
    """``{"hub_id", "revision"}`` of a model hub cache snapshot folder
    (``.../models--owner--name/snapshots/<commit>``), None for any other folder."""
    path = Path(folder).expanduser().absolute()
    repo = path.parent.parent.name
    if path.parent.name != "snapshots" or not _COMMIT.fullmatch(path.name) or not repo.startswith("models--"):
        return None
    return {"hub_id": repo[len("models--") :].replace("--", "/"), "revision": path.name}


def parse_hub_id(value: str) -> dict:
    """``ID`` or ``ID@REVISION`` (``orthojob model stage --hub-id``) -> ``{"hub_id", "revision"}``;
    ValueError for what is no model hub id."""
    hub_id, _, revision = value.partition("@")
    if (
        looks_like_path(hub_id)
        or storage.is_s3_uri(hub_id)
        or not re.fullmatch(r"[\w.\-]+(/[\w.\-]+)?", hub_id)
    ):
        raise ValueError(f"--hub-id {value!r}: expected a model hub id, owner/name or owner/name@revision")
    if "--" in hub_id or ".." in hub_id:
        raise ValueError(f"--hub-id {value!r}: a model hub id has no '--' or '..'")
    return {"hub_id": hub_id, "revision": revision or None}


def stage(source: str, uri: str, say: Callable[[str], Any] = print, hub_id: str | None = None) -> dict:
    """Copy a base model (hub id, folder or another staged prefix) to ``uri`` with a manifest (every
    file's sha256, written last); returns the manifest.

    The manifest's ``source`` names the model hub id and commit the weights came from: a hub id's
    download, a hub cache snapshot folder, the ``source`` of a staged prefix, or ``hub_id``
    (``ID[@REVISION]``: what a plain folder is a copy of; ValueError where it contradicts what the
    source says). Adapters trained from ``uri`` record that hub id (:func:`record`)."""
    storage.parse_s3_uri(uri)
    declared = parse_hub_id(hub_id) if hub_id else None
    folder = local_folder(source, say=say)
    if storage.is_s3_uri(source):
        staged = origin(source)
        found = {"hub_id": staged["hub_id"], "revision": staged["revision"]} if staged["hub_id"] else None
    elif Path(source).expanduser().is_dir():
        found = hub_origin(folder)
    else:  # a hub id: its snapshot folder is named by the commit
        found = {"hub_id": source, "revision": (hub_origin(folder) or {}).get("revision")}
    if declared and found:
        revisions = {declared["revision"], found["revision"]} - {None}
        if declared["hub_id"] != found["hub_id"] or len(revisions) > 1:
            known = found["hub_id"] + (f"@{found['revision']}" if found["revision"] else "")
            raise ValueError(f"--hub-id {hub_id}: {source} is a copy of {known}")
        found = {"hub_id": found["hub_id"], "revision": found["revision"] or declared["revision"]}
    return _upload_model(folder, uri, say, found or declared)


def _upload_model(folder: Path, uri: str, say: Callable[[str], Any], source: dict | None = None) -> dict:
    names = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    _check_model_folder(str(folder), names)
    say(f"uploading {folder} to {uri} ({len(names)} files; manifest last)")
    # the hub's cache links a snapshot's files to blobs: upload what they point at
    extra = {SOURCE_KEY: {k: v for k, v in source.items() if v}} if source else None
    return storage.upload_dir(folder.resolve(), uri, skip=lambda rel: rel.startswith(".cache/"), extra=extra)


__all__ = [
    "CACHE_ENV",
    "RECORD_DIGEST",
    "RECORD_URI",
    "SOURCE_KEY",
    "announce",
    "fetch",
    "hub_origin",
    "hub_snapshot",
    "listing",
    "local_folder",
    "looks_like_path",
    "model_cache",
    "origin",
    "parse_hub_id",
    "record",
    "recorded_reference",
    "reference",
    "resolve",
    "stage",
    "staged_digest",
]
