"""Build the training image and check it the way a cluster runs it: ``make image-check``.

    python scripts/image_check.py                      # real CUDA base if it can be pulled, else a stand-in
    python scripts/image_check.py --base-image IMAGE   # this base, no pull attempted
    python scripts/image_check.py --standin --clean    # the stand-in base; remove image and stand-in after

Run it when the Dockerfile, requirements/gpu.lock, requirements/pip.lock or pyproject.toml change
(docs/deploy.md, "Checking the image"). It is not part of ``make test``: it needs a docker engine,
about 20 GB of free disk and the package index, and takes about ten minutes.

The base. The Dockerfile's default base (``ARG BASE_IMAGE``, the CUDA runtime on Ubuntu 24.04) is
pulled when a registry answers. Where none does, a **stand-in** is built here: Debian 12 (bookworm)
from ``debootstrap`` (the host's Debian mirror), this machine's CPython 3.12 (pyenv's build, copied
to /opt/python3.12 with /usr/bin/python3.12 pointing at it) and three empty Debian packages named
``python3.12``, ``python3.12-venv`` and ``python3.12-dev`` marked installed, so the Dockerfile's
``apt-get install python3.12 python3.12-venv python3.12-dev gcc libc6-dev`` runs unchanged (gcc and
libc6-dev come from Debian). What the stand-in lacks is printed (:data:`STANDIN_LACKS`).

The checks run the built image offline (``--network none``), with a read-only root filesystem,
tmpfs where the Job mounts volumes (/cache, /work, /tmp, /home/orthorl), as UID 10001 -- the Job's
pod (k8s/grpo-job.yaml):
:data:`CHECKS`. ``pip check`` may report only the packages the lock leaves out on purpose
(``not_installed()`` of scripts/check_lock.py). Exit 0 when every check passes, 1 when one fails, 2
when the image could not be built.

Measured and printed: build time (s), bytes received by this machine's network interfaces during the
build (``/proc/net/dev``; other traffic on the machine counts too), peak disk used on the docker data
filesystem during the build beyond what was used before it (``df`` sampled every 2 s), and the image
size (``docker image inspect``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
JOB_MANIFEST = ROOT / "k8s" / "grpo-job.yaml"
TAG = "orthorl/train:image-check"
STANDIN_TAG = "orthorl/standin-base:bookworm-py3.12"
WORKDIR = Path("/var/tmp/orthorl-image-check")
PYENV_VERSIONS = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"


def python_source() -> Path | None:
    """The CPython 3.12 build the stand-in copies: ``$STANDIN_PYTHON_HOME`` (a prefix holding
    ``bin/python3.12``), else pyenv's newest 3.12.x; None if there is none."""
    if os.environ.get("STANDIN_PYTHON_HOME"):
        return Path(os.environ["STANDIN_PYTHON_HOME"])
    found = sorted(PYENV_VERSIONS.glob("3.12.*"), key=lambda v: [int(x) for x in re.findall(r"\d+", v.name)])
    return found[-1] if found else None


STANDIN_PYTHON = "/opt/python3.12"
USER = "10001:10001"
HOST_CAS = Path("/usr/local/share/ca-certificates")
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DUMMY_PACKAGES = ("python3.12", "python3.12-venv", "python3.12-dev")
# the shared libraries pyenv's CPython 3.12 links (ldd of libpython and lib-dynload, Tk aside)
STANDIN_LIBS = ("libbz2-1.0", "libexpat1", "liblzma5", "libncursesw6", "libreadline8", "libtinfo6",
                "libtirpc3", "zlib1g", "libcom-err2", "libkeyutils1", "libcrypt1", "libsqlite3-0",
                "libnsl2", "libssl3", "libffi8", "libuuid1")  # fmt: skip
STANDIN_LACKS = (
    "the CUDA 13 runtime and NVIDIA's container setup (no GPU is reachable here anyway: CUDA paths stay unexercised)",
    "Ubuntu 24.04's packages: Debian 12's ca-certificates, gcc 12 and glibc 2.36 instead of Ubuntu's gcc 13 and glibc 2.39",
    "Ubuntu's python3.12 packages: CPython 3.12.1 from pyenv instead, with empty python3.12/-venv/-dev packages marked installed",
)
STANDIN_ADDS = "this machine's extra CA certificates and PIP_CERT, where it has them (a TLS-inspecting proxy)"

IMPORTS = (
    "torch",
    "vllm",
    "unsloth",
    "bitsandbytes",
    "flashinfer",
    "trl",
    "mlflow",
    "orthojob.job",
    "server.app",
)
"""The GPU stack's modules, imported in one process inside the image (plus every package of the
lock's IMPORT_IF_LOCKED that the lock pins)."""
IMPORT_IF_LOCKED = ("xformers",)
UNSLOTH_FALLBACK = re.compile(r"xformers is installed but cannot load|Switching to PyTorch attention", re.I)
"""Unsloth's message when an installed xformers cannot load (it then uses PyTorch attention)."""


@dataclass(frozen=True)
class Check:
    name: str
    argv: tuple[str, ...]  # after `docker run <options> [--entrypoint X] IMAGE`
    entrypoint: str | None = None
    expect_code: int = 0
    expect_text: str = ""


def check_lock_module():
    spec = importlib.util.spec_from_file_location("check_lock", ROOT / "scripts" / "check_lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_script(modules: tuple[str, ...]) -> str:
    return (
        "import importlib, sys\n"
        f"for name in {list(modules)!r}:\n"
        "    importlib.import_module(name)\n"
        "    print('imported', name, flush=True)\n"
        "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)\n"
    )


def checks(locked: set[str]) -> tuple[Check, ...]:
    """The checks, in order: the CLI's help, the GPU stack's imports, ``pip check``, the baselines'
    evaluation, and the Job's refusal to train a GPU preset without CUDA (exit 2)."""
    modules = IMPORTS + tuple(m for m in IMPORT_IF_LOCKED if m in locked)
    return (
        Check("--help", ("--help",), expect_text="usage: orthojob"),
        Check(
            "imports",
            ("-c", import_script(modules)),
            entrypoint="python",
            expect_text=f"imported {modules[-1]}",
        ),
        Check("pip check", ("check",), entrypoint="pip"),
        Check(
            "evaluate --baselines",
            (
                "evaluate",
                "--baselines",
                "--seeds",
                "2",
                "--task-id",
                "task_easy",
                "--out",
                "/work/baselines.json",
            ),
            expect_text="oracle",
        ),
        Check(
            "GPU refusal",
            ("-m", "orthojob.job", "--out", "/work/job"),
            entrypoint="python",
            expect_code=2,
            expect_text="needs a GPU",
        ),
    )


def writable_paths() -> list[str]:
    """The Job container's volume mounts (k8s/grpo-job.yaml), the only writable places under its
    read-only root filesystem; /dev/shm aside (docker gives every container one)."""
    import yaml

    docs = [d for d in yaml.safe_load_all(JOB_MANIFEST.read_text()) if d and d.get("kind") == "Job"]
    (container,) = docs[0]["spec"]["template"]["spec"]["containers"]
    return [m["mountPath"] for m in container.get("volumeMounts", []) if m["mountPath"] != "/dev/shm"]


def run_options() -> list[str]:
    """``docker run`` options: offline, read-only, tmpfs where the pod mounts volumes, UID 10001."""
    opts = ["--rm", "--network", "none", "--read-only", "--user", USER]
    uid, gid = USER.split(":")
    for path in writable_paths():
        # owned by the user, like the pod's emptyDir/PVC with fsGroup (docker ignores tmpfs' mode= here)
        opts += ["--tmpfs", f"{path}:rw,exec,uid={uid},gid={gid}"]
    return opts


def pip_check_ok(code: int, output: str, not_installed: set[str]) -> tuple[bool, str]:
    """``pip check`` passes, or reports only requirements on packages the lock leaves out on purpose."""
    if code == 0:
        return True, ""
    missing = re.compile(r"^\S+ [^ ]+ requires ([A-Za-z0-9._-]+), which is not installed\.$")
    other = []
    for line in output.strip().splitlines():
        m = missing.match(line.strip())
        if not (m and m.group(1).lower() in not_installed):
            other.append(line)
    return (not other and bool(output.strip())), "; ".join(other)


def dockerfile_default_base() -> str:
    m = re.search(r"^ARG BASE_IMAGE=(\S+)", DOCKERFILE.read_text(), re.MULTILINE)
    if m is None:
        raise SystemExit("image_check: the Dockerfile has no `ARG BASE_IMAGE=` default")
    return m.group(1)


def choose_base(requested: str | None, standin: bool, pull) -> tuple[str, bool]:
    """``(base image, is the stand-in)``: ``--standin`` forces the stand-in; an explicit
    ``--base-image`` is used as given; else the Dockerfile's default when ``pull(image)`` succeeds,
    the stand-in when it does not (no registry reachable)."""
    if standin:
        return STANDIN_TAG, True
    if requested:
        return requested, False
    default = dockerfile_default_base()
    return (default, False) if pull(default) else (STANDIN_TAG, True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--base-image", default=os.environ.get("BASE_IMAGE") or None,
                       help="the base to build on (default: $BASE_IMAGE, else the Dockerfile's, else the stand-in)")  # fmt: skip
    which.add_argument(
        "--standin", action="store_true", help="build on the stand-in base without trying a pull"
    )
    p.add_argument(
        "--clean", action="store_true", help="remove the image, the stand-in and its files afterwards"
    )
    p.add_argument("--tag", default=TAG, help=f"the image's tag (default {TAG})")
    p.add_argument(
        "--workdir", type=Path, default=WORKDIR, help=f"stand-in files and logs (default {WORKDIR})"
    )
    return p.parse_args(argv)


# --- docker and the stand-in ------------------------------------------------------------------------


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, text=True, capture_output=True, **kw)


def ensure_daemon(workdir: Path) -> None:
    """Start ``dockerd --iptables=false --bridge=none`` when no daemon answers (waits up to 60 s)."""
    if shutil.which("docker") is None:
        raise SystemExit("image_check: no docker client: apt-get install -y docker.io")
    if sh(["docker", "info"]).returncode == 0:
        return
    if shutil.which("dockerd") is None:
        raise SystemExit(
            "image_check: no docker daemon answers and dockerd is missing: apt-get install -y docker.io"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    log = open(workdir / "dockerd.log", "a")  # noqa: SIM115 -- the daemon outlives this function
    subprocess.Popen(
        ["dockerd", "--iptables=false", "--bridge=none"], stdout=log, stderr=log, start_new_session=True
    )
    for _ in range(60):
        time.sleep(1)
        if sh(["docker", "info"]).returncode == 0:
            print(f"image_check: started dockerd (log {workdir / 'dockerd.log'})")
            return
    raise SystemExit(f"image_check: dockerd did not answer within 60 s; see {workdir / 'dockerd.log'}")


def debian_mirror() -> str:
    """The host's Debian mirror (its apt sources), for debootstrap."""
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        if path.is_file():
            for line in path.read_text().splitlines():
                m = re.match(r"^(?:URIs:\s*|deb\s+(?:\[[^\]]*\]\s+)?)(\S+/debian)/?(?:\s|$)", line.strip())
                if m:
                    return m.group(1)
    raise SystemExit(
        "image_check: no Debian mirror in /etc/apt/sources*: the stand-in cannot be bootstrapped"
    )


def dummy_deb(name: str, out: Path) -> Path:
    pkg = out / name
    (pkg / "DEBIAN").mkdir(parents=True, exist_ok=True)
    (pkg / "DEBIAN" / "control").write_text(
        f"Package: {name}\nVersion: 3.12.1-0standin\nArchitecture: all\nMaintainer: image-check <none>\n"
        f"Description: stand-in: CPython 3.12 lives in {STANDIN_PYTHON}\n"
    )
    deb = out / f"{name}.deb"
    proc = sh(["dpkg-deb", "--build", str(pkg), str(deb)])
    if proc.returncode != 0:
        raise SystemExit(f"image_check: dpkg-deb failed for {name}: {proc.stderr}")
    return deb


def build_standin(workdir: Path) -> None:
    """Debian 12 (debootstrap) + this machine's CPython 3.12, imported as :data:`STANDIN_TAG`."""
    if sh(["docker", "image", "inspect", STANDIN_TAG]).returncode == 0:
        print(f"image_check: stand-in base {STANDIN_TAG} exists")
        return
    for tool in ("debootstrap", "dpkg-deb", "chroot"):
        if shutil.which(tool) is None:
            raise SystemExit(f"image_check: {tool} is missing: apt-get install -y debootstrap")
    source = python_source()
    if source is None or not (source / "bin" / "python3.12").exists():
        raise SystemExit(
            f"image_check: no CPython 3.12 to copy into the stand-in (looked at {source or PYENV_VERSIONS}): "
            "`pyenv install 3.12`, or set STANDIN_PYTHON_HOME to a prefix holding bin/python3.12"
        )
    rootfs = workdir / "rootfs"
    if not (rootfs / "etc" / "debian_version").exists():
        partial = workdir / "rootfs.partial"
        shutil.rmtree(partial, ignore_errors=True)
        cmd = ["nice", "-n", "10", "debootstrap", "--variant=minbase", f"--include={','.join(STANDIN_LIBS)}",
               "bookworm", str(partial), debian_mirror()]  # fmt: skip
        print(f"image_check: debootstrap bookworm into {partial}", flush=True)
        with open(workdir / "debootstrap.log", "w") as log:
            if subprocess.run(cmd, stdout=log, stderr=log).returncode != 0:
                raise SystemExit(f"image_check: debootstrap failed; see {workdir / 'debootstrap.log'}")
        partial.rename(rootfs)
    target = rootfs / STANDIN_PYTHON.lstrip("/")
    if not target.exists():
        shutil.copytree(source, target, symlinks=True)
        # pyenv's binary has an absolute RUNPATH to its own prefix: let ld.so find libpython instead
        (rootfs / "etc" / "ld.so.conf.d" / "python3.12.conf").write_text(f"{STANDIN_PYTHON}/lib\n")
        (rootfs / "usr" / "bin" / "python3.12").symlink_to(f"{STANDIN_PYTHON}/bin/python3.12")
        # a venv's Python finds its standard library from the venv's `home` (/usr/bin): Debian's layout
        (rootfs / "usr" / "lib" / "python3.12").symlink_to(f"{STANDIN_PYTHON}/lib/python3.12")
        (rootfs / "usr" / "include" / "python3.12").symlink_to(f"{STANDIN_PYTHON}/include/python3.12")
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            debs = [dummy_deb(name, Path(tmp)) for name in DUMMY_PACKAGES]
            for deb in debs:
                shutil.copy(deb, rootfs / "tmp" / deb.name)
            steps = [["ldconfig"], ["dpkg", "-i", *[f"/tmp/{d.name}" for d in debs]]]
            for step in steps:
                proc = sh(["chroot", str(rootfs), *step])
                if proc.returncode != 0:
                    raise SystemExit(f"image_check: stand-in step {step} failed: {proc.stdout}{proc.stderr}")
            for deb in debs:
                (rootfs / "tmp" / deb.name).unlink()
    modules = "import ssl, sqlite3, ctypes, lzma, bz2, sysconfig; print(sysconfig.get_paths()['include'])"
    probe = sh(["chroot", str(rootfs), "sh", "-c",
                f'python3.12 -m venv /tmp/probe && /tmp/probe/bin/python -c "{modules}"; c=$?; rm -rf /tmp/probe; exit $c'])  # fmt: skip
    if probe.returncode != 0:
        raise SystemExit(f"image_check: the stand-in's python3.12 is incomplete: {probe.stderr}")
    # this machine's extra CAs (a TLS-inspecting egress proxy): the Dockerfile's ca-certificates
    # install adds them to the bundle, and PIP_CERT points the base's pip (certifi's own) at it
    local_cas = sorted(HOST_CAS.glob("*.crt"))
    for ca in local_cas:
        (rootfs / HOST_CAS.relative_to("/")).mkdir(parents=True, exist_ok=True)
        shutil.copy(ca, rootfs / HOST_CAS.relative_to("/") / ca.name)
    changes = [f"ENV PATH={DEFAULT_PATH}", *([f"ENV PIP_CERT={CA_BUNDLE}"] if local_cas else [])]
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    cmd = ["docker", "import", *[a for c in changes for a in ("--change", c)], "-", STANDIN_TAG]
    imported = subprocess.run(cmd, stdin=tar.stdout, capture_output=True, text=True)
    tar.wait()
    if imported.returncode != 0 or tar.returncode != 0:
        raise SystemExit(f"image_check: docker import of the stand-in failed: {imported.stderr}")
    print(f"image_check: built the stand-in base {STANDIN_TAG}", flush=True)


# --- measurements -------------------------------------------------------------------------------------


def received_bytes() -> int:
    """Bytes received by all interfaces but loopback (``/proc/net/dev``)."""
    total = 0
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, data = line.split(":", 1)
        if name.strip() != "lo":
            total += int(data.split()[0])
    return total


def disk_used(path: str) -> int:
    usage = shutil.disk_usage(path)
    return usage.total - usage.free


class DiskPeak(threading.Thread):
    """Samples the disk used on ``path`` every ``every`` seconds until stopped; ``peak`` in bytes."""

    def __init__(self, path: str, every: float = 2.0):
        super().__init__(daemon=True)
        self.path, self.every, self.peak = path, every, disk_used(path)
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.every):
            self.peak = max(self.peak, disk_used(self.path))

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        return max(self.peak, disk_used(self.path))


def docker_root() -> str:
    proc = sh(["docker", "info", "-f", "{{.DockerRootDir}}"])
    root = proc.stdout.strip() if proc.returncode == 0 else ""
    return root if root and Path(root).exists() else "/"


def build(args: argparse.Namespace, base: str) -> dict:
    commit = sh(["git", "rev-parse", "HEAD"], cwd=ROOT).stdout.strip() or "unknown"
    cmd = ["nice", "-n", "10", "docker", "build", "--network", "host", "--platform", "linux/amd64",
           "--build-arg", f"BASE_IMAGE={base}", "--build-arg", f"GIT_COMMIT={commit}", "-t", args.tag, str(ROOT)]  # fmt: skip
    log_path = args.workdir / "build.log"
    print(f"image_check: DOCKER_BUILDKIT=0 {' '.join(cmd[3:])} (log {log_path})", flush=True)
    disk = DiskPeak(docker_root())
    before_disk, before_rx, start = disk.peak, received_bytes(), time.monotonic()
    disk.start()
    with open(log_path, "w") as log:
        code = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "DOCKER_BUILDKIT": "0"}
        ).returncode
    seconds = time.monotonic() - start
    received = received_bytes() - before_rx
    peak = disk.stop() - before_disk
    size = sh(["docker", "image", "inspect", "-f", "{{.Size}}", args.tag]).stdout.strip() if code == 0 else ""
    return {"code": code, "seconds": seconds, "received": received, "peak_disk": peak,
            "size": int(size) if size.isdigit() else None, "log": log_path}  # fmt: skip


def run_check(tag: str, check: Check, not_installed: set[str]) -> tuple[bool, str]:
    cmd = ["docker", "run", *run_options()]
    if check.entrypoint:
        cmd += ["--entrypoint", check.entrypoint]
    proc = sh([*cmd, tag, *check.argv], timeout=900)
    out = proc.stdout + proc.stderr
    if check.name == "pip check":
        ok, why = pip_check_ok(proc.returncode, out, not_installed)
        return ok, (f"exit {proc.returncode}" + (f": {why}" if why else "") +
                    (f" (only {', '.join(sorted(not_installed))}, left out of the lock)" if proc.returncode and ok else ""))  # fmt: skip
    ok = proc.returncode == check.expect_code and check.expect_text in out
    why = f"exit {proc.returncode} (expected {check.expect_code})"
    if check.name == "imports":
        fallback = UNSLOTH_FALLBACK.search(out)
        ok = ok and fallback is None
        versions = [line for line in out.splitlines() if line.startswith("torch ")]
        why += f", {versions[0] if versions else 'no torch version printed'}"
        why += ", Unsloth's xformers fallback printed" if fallback else ", no xformers fallback message"
    if not ok:
        why += "\n    " + "\n    ".join(out.strip().splitlines()[-15:])
    return ok, why


def pulled(image: str, timeout: float = 900) -> bool:
    """Whether ``docker pull IMAGE`` succeeds (no registry: it fails within seconds)."""
    try:
        return sh(["docker", "pull", image], timeout=timeout).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def gb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 1e9:.1f} GB ({n} bytes)"


def clean(args: argparse.Namespace, standin: bool) -> None:
    sh(["docker", "image", "rm", "-f", args.tag])
    if standin:
        sh(["docker", "image", "rm", "-f", STANDIN_TAG])
        shutil.rmtree(args.workdir / "rootfs", ignore_errors=True)
    sh(["docker", "image", "prune", "-f"])
    print(
        f"image_check: removed {args.tag}" + (f", {STANDIN_TAG} and its root filesystem" if standin else "")
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    ensure_daemon(args.workdir)
    base, standin = choose_base(args.base_image, args.standin, pulled)
    if standin:
        why_standin = "--standin" if args.standin else f"{dockerfile_default_base()} could not be pulled"
        build_standin(args.workdir)
    lock = check_lock_module()
    locked = set(lock.parse_lock(lock.LOCK.read_text())[0])
    not_installed = set(lock.not_installed())
    result = build(args, base)
    lines = [
        "",
        "== image-check summary ==",
        f"base image: {base}" + (f" (stand-in: {why_standin})" if standin else ""),
    ]
    if standin:
        lines += [f"  the stand-in lacks: {item}" for item in STANDIN_LACKS]
        lines.append(f"  the stand-in adds: {STANDIN_ADDS}")
    lines += [
        f"build: exit {result['code']} in {result['seconds']:.0f} s (log {result['log']})",
        f"downloaded during the build: {gb(result['received'])} (all interfaces but lo)",
        f"peak disk used by the build: {gb(result['peak_disk'])} (on {docker_root()})",
        f"image size: {gb(result['size'])}",
    ]
    failed = result["code"] != 0
    if failed:
        tail = result["log"].read_text().splitlines()[-20:]
        lines += ["build failed; last lines:", *("    " + t for t in tail)]
    else:
        lines.append(f"checks (docker run {' '.join(run_options())} {args.tag}):")
        for check in checks(locked):
            ok, why = run_check(args.tag, check, not_installed)
            failed |= not ok
            lines.append(f"  [{'PASS' if ok else 'FAIL'}] {check.name}: {why}")
    lines.append(f"result: {'FAIL' if failed else 'PASS'}")
    print("\n".join(lines), flush=True)
    if args.clean:
        clean(args, standin)
    return 2 if result["code"] != 0 else int(failed)


if __name__ == "__main__":
    sys.exit(main())
