"""Checkpoint and artifact storage on local paths or S3 (any S3-compatible store).

``s3://bucket/prefix`` URIs go through boto3 with bounded retries and backoff: botocore's
own ``standard`` retry mode (connection errors, throttling and 5xx, exponential back-off
with jitter, at most ``ORTHORL_S3_MAX_ATTEMPTS`` attempts per request, default 5), and
s3transfer's own retries of interrupted downloads. There is no retry loop of ours on top
(it multiplied botocore's attempts): when botocore gives up, the operation raises
:class:`StorageError` and the job exits 30. Every other path is a local folder. Credentials come from the usual AWS
variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``
for S3-compatible stores) and are never logged.

A folder is uploaded file by file and then its manifest ``MANIFEST.json`` (sha256
and size of every file) is written last: a folder without a manifest is
incomplete and is never used. Downloads check every file's sha256 against the
manifest and fail loudly on a mismatch, so nothing half-uploaded or corrupt is
ever loaded, gated or promoted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from orthojob.ops.progress import progress

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
# botocore's total attempts per request (standard mode); ORTHORL_S3_RETRIES is the older name
RETRY_ATTEMPTS: int = int(
    os.environ.get("ORTHORL_S3_MAX_ATTEMPTS") or os.environ.get("ORTHORL_S3_RETRIES") or 5
)
CONNECT_TIMEOUT_S: float = float(os.environ.get("ORTHORL_S3_CONNECT_TIMEOUT_S", "5"))
READ_TIMEOUT_S: float = float(os.environ.get("ORTHORL_S3_READ_TIMEOUT_S", "60"))
CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)$")
"""A ``checkpoint-N`` folder name (``match`` a name, ``search`` the end of a prefix)."""
T = TypeVar("T")


class StorageError(RuntimeError):
    """A storage operation failed for good (after retries); the message says what to check."""


class StorageAccessError(StorageError):
    """The store answered and refused: bad keys, no permission, or no such bucket. Retrying cannot
    help (exit :attr:`~orthojob.ops.exit_codes.ExitCode.STORAGE_DENIED`, never retried by the Job)."""


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # no leading or trailing slash

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def child(self, name: str) -> S3Location:
        return S3Location(self.bucket, self.key(name))


def is_s3_uri(path: str | os.PathLike) -> bool:
    return str(path).startswith("s3://")


def parse_s3_uri(uri: str) -> S3Location:
    """``s3://bucket/prefix`` -> S3Location; ValueError with the expected form otherwise."""
    m = re.fullmatch(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?", uri)
    if not m:
        raise ValueError(
            f"not an S3 URI: {uri!r}; expected s3://bucket/prefix (bucket: 3-63 lowercase chars)"
        )
    return S3Location(m.group(1), (m.group(2) or "").strip("/"))


def s3_client() -> Any:
    """A boto3 S3 client with bounded retries and timeouts; endpoint from AWS_ENDPOINT_URL.

    Worst case per request against a dead endpoint: RETRY_ATTEMPTS connection attempts of at most
    CONNECT_TIMEOUT_S each, with botocore's back-off (random up to 1, 2, 4, 8 s) between them."""
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"total_max_attempts": RETRY_ATTEMPTS, "mode": "standard"},
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=READ_TIMEOUT_S,
        s3={"addressing_style": "path"},
    )
    # a fresh session reads the credentials now (the default session caches them)
    return boto3.session.Session().client(
        "s3",
        endpoint_url=os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None,
        region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        config=config,
    )


_AUTH_CODES = (
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "NoSuchBucket",
    "NoCredentialsError",
    "Unable to locate credentials",
)


def _is_auth_error(exc: BaseException | None) -> bool:
    """Credential/permission errors, also when wrapped (boto's transfer manager re-raises them)."""
    while exc is not None:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
        if (
            code in _AUTH_CODES
            or code == "403"
            or type(exc).__name__ in _AUTH_CODES
            or any(c in str(exc) for c in _AUTH_CODES)
        ):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _error_code(exc: BaseException | None) -> str:
    while exc is not None:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
        if code:
            return str(code)
        if type(exc).__name__ == "NoCredentialsError":
            return "NoCredentialsError"
        exc = exc.__cause__ or exc.__context__
    return ""


def access_fix(exc: BaseException) -> str:
    """What an S3 refusal means and how to fix it, by the error code the store answered with."""
    code = _error_code(exc)
    if code in ("NoSuchBucket", "404"):
        return (
            f"the bucket does not exist ({code}: {exc}). Create it, or set the output URI (the ConfigMap's "
            "OUTPUT_URI, --out-base) to a bucket of yours."
        )
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "NoCredentialsError", "InvalidToken"):
        return (
            f"S3 refused the credentials ({code}: {exc}). Fix AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in "
            "the Secret orthorl-credentials (or the pod's IRSA / Workload Identity role) and the endpoint "
            "(AWS_ENDPOINT_URL)."
        )
    return (
        f"S3 refused access ({code or type(exc).__name__}: {exc}). Give the job's credentials "
        "s3:PutObject, s3:GetObject, s3:DeleteObject and s3:ListBucket on the output prefix, or choose "
        "a prefix they may write (OUTPUT_URI)."
    )


def with_retries(action: str, fn: Callable[[], T]) -> T:
    """Run one storage operation; its failure becomes a :class:`StorageError` saying what to check.

    The name is kept for callers: the retries themselves are botocore's (see :func:`s3_client`),
    so when ``fn`` raises, botocore has already retried it and this does not retry again.
    Credential and permission errors are reported as such (botocore never retries them).
    """
    try:
        return fn()
    except StorageError:
        raise
    except Exception as exc:  # boto raises many types; classify below
        if _is_auth_error(exc):
            raise StorageAccessError(f"{action}: {access_fix(exc)}") from exc
        raise StorageError(
            f"{action}: failed after {RETRY_ATTEMPTS} attempts (botocore standard retries; "
            f"{type(exc).__name__}: {exc}). Check that the S3 endpoint is reachable (AWS_ENDPOINT_URL)."
        ) from exc


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_manifest(folder: Path, skip: Callable[[str], bool] | None = None) -> dict:
    """``{"files": {relative path: {"sha256", "size"}}}`` of every file below ``folder``
    (but manifests, and the relative POSIX paths that ``skip`` returns True for)."""
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel = p.relative_to(folder).as_posix()
            if skip is None or not skip(rel):
                files[rel] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    return {"files": files}


def upload_dir(
    local: str | Path,
    uri: str,
    client: Any | None = None,
    skip: Callable[[str], bool] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict:
    """Upload a folder to ``uri`` (files first, manifest last), leaving out the relative paths
    ``skip`` returns True for; returns the manifest. ``extra``: more keys for the manifest (beside
    ``files``, e.g. where staged base weights came from)."""
    local = Path(local)
    loc = parse_s3_uri(uri)
    client = client or s3_client()
    manifest = {**(extra or {}), **build_manifest(local, skip)}
    sizes = {rel: (local / rel).stat().st_size for rel in manifest["files"]}
    with progress(sum(sizes.values()), f"upload {loc.uri}", unit="B") as bar:  # a bar, or log lines
        for rel in manifest["files"]:
            path = local / rel
            with_retries(
                f"upload {rel} to {loc.uri}",
                lambda p=path, r=rel: client.upload_file(str(p), loc.bucket, loc.key(r)),
            )
            bar.update(sizes[rel])
    body = json.dumps(manifest, indent=1).encode()
    with_retries(
        f"write manifest to {loc.uri}",
        lambda: client.put_object(Bucket=loc.bucket, Key=loc.key(MANIFEST), Body=body),
    )
    log.info("uploaded %d files to %s", len(manifest["files"]), loc.uri)
    return manifest


def read_manifest(uri: str, client: Any | None = None) -> dict | None:
    """The manifest of an uploaded folder, or None when the folder is absent or incomplete."""
    loc = parse_s3_uri(uri)
    client = client or s3_client()

    def fetch() -> dict | None:
        try:
            obj = client.get_object(Bucket=loc.bucket, Key=loc.key(MANIFEST))
        except Exception as exc:
            code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
            if code in {"NoSuchKey", "404"}:
                return None
            raise
        return json.loads(obj["Body"].read())

    return with_retries(f"read manifest of {loc.uri}", fetch)


def download_dir(uri: str, local: str | Path, client: Any | None = None) -> Path:
    """Download an uploaded folder and verify every file's sha256 against its manifest.

    Processes downloading into the same folder at once (the ranks of one node) take turns
    on a lock file (see :func:`_folder_lock`), and a folder already there whose files all match the
    manifest is kept as it is: the first process downloads, the others verify and reuse.
    """
    loc = parse_s3_uri(uri)
    client = client or s3_client()
    manifest = read_manifest(uri, client)
    if manifest is None:
        raise StorageError(
            f"{loc.uri} has no {MANIFEST}: nothing was uploaded there, or the upload did not "
            "finish. Check the URI, or re-run the stage that writes it."
        )
    local = Path(local)
    local.parent.mkdir(parents=True, exist_ok=True)
    with _folder_lock(local):
        if _matches_manifest(local, manifest):
            log.info("%s already holds %s (digests match): not downloading again", local, loc.uri)
            return local
        tmp = local.with_name(local.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        total = sum(int(meta.get("size") or 0) for meta in manifest["files"].values())
        with progress(total, f"download {loc.uri}", unit="B") as bar:  # a bar, or log lines
            for rel, meta in manifest["files"].items():
                dest = tmp / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                with_retries(
                    f"download {rel} from {loc.uri}",
                    lambda d=dest, r=rel: client.download_file(loc.bucket, loc.key(r), str(d)),
                )
                digest = sha256_file(dest)
                if digest != meta["sha256"]:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise StorageError(
                        f"{loc.uri}/{rel}: sha256 {digest[:12]}… does not match the manifest's "
                        f"{meta['sha256'][:12]}…; the object is corrupt or was changed after upload"
                    )
                bar.update(int(meta.get("size") or 0))
        shutil.rmtree(local, ignore_errors=True)
        tmp.rename(local)
    log.info("downloaded and verified %d files from %s", len(manifest["files"]), loc.uri)
    return local


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock held while ``folder`` is filled (``filelock``), on a file in the temporary
    directory named by the folder's absolute path (not beside it, where it would be published)."""
    import tempfile

    from filelock import FileLock

    locks = Path(tempfile.gettempdir()) / "orthorl-locks"
    locks.mkdir(exist_ok=True)
    name = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:32]
    with FileLock(str(locks / f"{name}.lock")):
        yield


def _matches_manifest(folder: Path, manifest: dict) -> bool:
    """Whether every file of ``manifest`` is in ``folder`` with its size and sha256."""
    return folder.is_dir() and all(
        (folder / rel).is_file()
        and ("size" not in meta or (folder / rel).stat().st_size == meta["size"])
        and sha256_file(folder / rel) == meta["sha256"]
        for rel, meta in manifest["files"].items()
    )


def latest_checkpoint(uri: str, client: Any | None = None) -> tuple[int, str] | None:
    """``(step, uri)`` of the highest complete ``checkpoint-N`` below ``uri``, or None."""
    loc = parse_s3_uri(uri)
    client = client or s3_client()
    prefix = loc.key("")

    def list_steps() -> list[int]:
        steps = []
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=loc.bucket, Prefix=prefix, Delimiter="/"
        ):
            for cp in page.get("CommonPrefixes", []):
                m = CHECKPOINT_RE.search(cp["Prefix"].rstrip("/"))
                if m:
                    steps.append(int(m.group(1)))
        return steps

    for step in sorted(with_retries(f"list checkpoints in {loc.uri}", list_steps), reverse=True):
        child = loc.child(f"checkpoint-{step}").uri
        if read_manifest(child, client) is not None:
            return step, child
    return None


def materialize(path_or_uri: str, cache_dir: str | Path) -> Path:
    """A local folder for ``path_or_uri``: itself if local, else a verified download into cache_dir."""
    if not is_s3_uri(path_or_uri):
        p = Path(path_or_uri)
        if not p.exists():
            raise StorageError(f"{p} does not exist: pass an existing folder or an s3:// URI")
        return p
    return download_dir(path_or_uri, local_mirror(cache_dir, path_or_uri))


PROBE_NAME = ".orthorl-probe"


def probe_output(path_or_uri: str) -> str:
    """Write, read back and delete a marker below the output prefix (what the job does at start).

    Returns a one-line description. A local folder: created if missing; an unwritable one raises
    :class:`StorageError` naming it. ``s3://``: a refusal (bad keys, no permission, no such bucket)
    raises :class:`StorageAccessError` saying what to fix; an endpoint that stays unreachable
    raises :class:`StorageError` after botocore's retries."""
    import uuid

    token = uuid.uuid4().hex
    if not is_s3_uri(path_or_uri):
        folder = Path(path_or_uri)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            marker = folder / f"{PROBE_NAME}-{token}"
            marker.write_text(token)
            ok = marker.read_text() == token
            marker.unlink()
        except OSError as exc:
            raise StorageError(
                f"the output folder {folder} is not writable ({exc}): choose another --out"
            ) from exc
        if not ok:
            raise StorageError(f"the output folder {folder} did not return what was written to it")
        return f"{folder}: write, read and delete work"
    loc = parse_s3_uri(path_or_uri)
    key = loc.key(f"{PROBE_NAME}-{token}")
    client = s3_client()

    def probe() -> None:
        try:  # a listing first: some stores (SeaweedFS) create a missing bucket on PutObject, and a
            # HEAD's bare 403 cannot tell bad keys from a missing permission (a listing's error body can)
            client.list_objects_v2(Bucket=loc.bucket, Prefix=key, MaxKeys=1)
        except Exception as exc:
            if _error_code(exc) in ("404", "NoSuchBucket"):
                raise StorageAccessError(f"probing {loc.uri}: {access_fix(exc)}") from exc
            raise
        client.put_object(Bucket=loc.bucket, Key=key, Body=token.encode())
        body = client.get_object(Bucket=loc.bucket, Key=key)["Body"].read().decode()
        client.delete_object(Bucket=loc.bucket, Key=key)
        if body != token:
            raise StorageError(f"s3://{loc.bucket}/{key} returned other bytes than were written to it")

    with_retries(f"probing the output prefix {loc.uri} (write, read, delete a marker)", probe)
    return f"{loc.uri}: write, read and delete work"


def write_text(uri: str, text: str) -> None:
    """One small object (e.g. a summary) at ``s3://bucket/key``."""
    loc = parse_s3_uri(uri)
    client = s3_client()
    with_retries(
        f"writing {uri}", lambda: client.put_object(Bucket=loc.bucket, Key=loc.prefix, Body=text.encode())
    )


def read_text(uri: str) -> str | None:
    """The object at ``s3://bucket/key`` as text, None when there is none."""
    loc = parse_s3_uri(uri)
    client = s3_client()

    def get() -> str | None:
        try:
            return client.get_object(Bucket=loc.bucket, Key=loc.prefix)["Body"].read().decode()
        except client.exceptions.NoSuchKey:
            return None

    return with_retries(f"reading {uri}", get)


def local_mirror(root: str | Path, uri: str) -> Path:
    """The folder below ``root`` that stands for ``s3://bucket/prefix``: ``root/bucket/prefix``
    (``root/bucket/_root`` for a whole bucket)."""
    loc = parse_s3_uri(uri)
    return Path(root) / loc.bucket / (loc.prefix or "_root")


def publish(local: str | Path, path_or_uri: str) -> str:
    """Copy a finished local folder to its destination (S3 upload, or a local copy); returns it."""
    local = Path(local)
    if is_s3_uri(path_or_uri):
        upload_dir(local, path_or_uri)
    elif Path(path_or_uri).resolve() != local.resolve():
        shutil.copytree(local, path_or_uri, dirs_exist_ok=True)
    return path_or_uri
