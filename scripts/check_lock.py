"""Check (or rewrite) requirements/gpu.lock, the lock file the CUDA image installs from.

    python scripts/check_lock.py            # exit 0: the lock matches pyproject and resolves
    python scripts/check_lock.py --write    # regenerate the lock after changing pyproject

No docker daemon runs in CI, so this is the image's build check: uv resolves the project's
``gpu`` extra (plus its base dependencies) for the image's platform -- Linux x86_64, glibc 2.31+
wheels, CPython 3.12 -- with ``--no-build`` (every package must come as a wheel: the image never
compiles anything) into a temporary file seeded with the committed lock, so versions that still
satisfy pyproject are kept, and compares the resolved pins with the committed ones. It then
checks that every requirement in pyproject (base dependencies and the ``gpu`` extra) is pinned in
the lock at a version its specifier admits, and that every pin carries hashes.

Three checks are about the image's stack rather than pyproject:

* **TRL's vLLM range.** The locked vLLM must lie inside the range the locked TRL declares for its
  ``vllm`` extra (TRL's server mode and colocate mode are only tested there). The range is read
  from TRL's own metadata, as uv sees it: ``uv pip compile`` of exactly ``trl[vllm]==<locked>`` and
  ``vllm==<locked>`` (no other requirement) must resolve; a vLLM outside TRL's range does not.
* **The lock is closed.** Every dependency of every pin is pinned too, with hashes: pip, which
  MLflow's virtualenv manager installs ``python_env.yaml`` with (``-r requirements/gpu.lock``,
  no ``--no-deps``), switches to hash-checking mode at the first hash and then refuses any
  requirement without one. :func:`install_dry_run` runs that install as uv's dry run with
  ``--require-hashes`` for the image's platform. One exception, explicit: the packages of
  :func:`not_installed` (xformers), which a locked package declares but pyproject's
  ``[tool.uv] override-dependencies`` leave out; pip would fetch them, so the lock is installed
  with ``--no-deps`` (Dockerfile, README), ``pip check`` in the image reports just them, and
  MLflow's virtualenv manager, which has no ``--no-deps``, stops at them (docs/deploy.md).
* **Every pin loads beside the locked torch** (:func:`unloadable_pins`): an xformers wheel built
  for another torch or CUDA is refused.

Exit status: 0 in sync; 1 drift (the message says what differs and how to fix it);
2 uv missing or the resolution failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "gpu.lock"
PYPROJECT = ROOT / "pyproject.toml"
EXTRA = "gpu"
PLATFORM = "x86_64-manylinux_2_31"
PYTHON = "3.12"
WRITE_COMMAND = "python scripts/check_lock.py --write"

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._\-]*)(?:\[[^\]]*\])?==([^\s\\;]+)")


def not_installed(pyproject_text: str | None = None) -> dict[str, str]:
    """``{canonical name: the override line}`` of the packages the lock leaves out on purpose.

    They are pyproject's ``[tool.uv] override-dependencies`` entries whose marker is false on every
    platform (``sys_platform == 'never'``): a dependency declared by a locked package that uv drops
    from the resolution. pip does not read uv's overrides, so every pip install of the lock uses
    ``--no-deps`` (the lock holds every other dependency) and ``pip check`` in the image reports
    these, and only these, as missing (scripts/image_check.py)."""
    data = tomllib.loads(PYPROJECT.read_text() if pyproject_text is None else pyproject_text)
    overrides = data.get("tool", {}).get("uv", {}).get("override-dependencies", [])
    left_out = {}
    for line in overrides:
        req = Requirement(line)
        if req.marker is not None and "never" in str(req.marker) and not req.marker.evaluate():
            left_out[canonicalize_name(req.name)] = line
    return left_out


def uv_binary() -> str | None:
    """uv next to this interpreter (the venv's, from the dev extra), else on PATH."""
    here = Path(sys.executable).parent / "uv"
    if here.exists():
        return str(here)
    return shutil.which("uv")


def compile_command(uv: str, output: Path) -> list[str]:
    return [
        uv,
        "pip",
        "compile",
        str(PYPROJECT),
        "--extra",
        EXTRA,
        "--python-platform",
        PLATFORM,
        "--python-version",
        PYTHON,
        "--generate-hashes",
        "--no-build",
        "--custom-compile-command",
        WRITE_COMMAND,
        "--quiet",
        "--output-file",
        str(output),
    ]


def parse_lock(text: str) -> tuple[dict[str, str], list[str]]:
    """``({canonical name: version}, [names pinned without a hash])`` of a uv/pip-compile lock."""
    pins: dict[str, str] = {}
    unhashed: list[str] = []
    current: str | None = None
    hashed = False
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _PIN.match(line)
        if m:
            if current is not None and not hashed:
                unhashed.append(current)
            current = canonicalize_name(m.group(1))
            pins[current] = m.group(2)
            hashed = "--hash=" in line
        elif "--hash=" in line:
            hashed = True
    if current is not None and not hashed:
        unhashed.append(current)
    return pins, unhashed


def project_requirements() -> list[Requirement]:
    data = tomllib.loads(PYPROJECT.read_text())
    project = data["project"]
    extras = project.get("optional-dependencies", {})
    if EXTRA not in extras:
        raise SystemExit(f"pyproject.toml has no [{EXTRA}] optional dependency list")
    return [Requirement(r) for r in [*project.get("dependencies", []), *extras[EXTRA]]]


def requirement_problems(pins: dict[str, str]) -> list[str]:
    problems = []
    for req in project_requirements():
        if req.marker is not None and not req.marker.evaluate(
            {"sys_platform": "linux", "platform_machine": "x86_64", "python_version": PYTHON}
        ):
            continue
        name = canonicalize_name(req.name)
        if name not in pins:
            problems.append(f"{req} (pyproject) is not in the lock")
        elif not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{req} (pyproject) does not admit the locked {name}=={pins[name]}")
    return problems


def diff_pins(old: dict[str, str], new: dict[str, str]) -> list[str]:
    lines = []
    for name in sorted(old.keys() | new.keys()):
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        if a is None:
            lines.append(f"  + {name}=={b} (resolved, not in the lock)")
        elif b is None:
            lines.append(f"  - {name}=={a} (in the lock, no longer resolved)")
        else:
            lines.append(f"  ~ {name}: lock {a}, resolves to {b}")
    return lines


def trl_vllm_problem(uv: str, pins: dict[str, str]) -> str | None:
    """None when the locked vLLM is inside the locked TRL's ``vllm`` extra range, else why not.

    Resolves ``trl[vllm]==X`` with ``vllm==Y`` alone (uv reads TRL's metadata; nothing else
    constrains the pair), for the image's platform, without hashes."""
    trl, vllm = pins.get("trl"), pins.get("vllm")
    if trl is None or vllm is None:
        return None
    with tempfile.TemporaryDirectory(prefix="trl-vllm-") as tmp:
        req = Path(tmp) / "pair.in"
        req.write_text(f"trl[vllm]=={trl}\nvllm=={vllm}\n")
        cmd = [uv, "pip", "compile", str(req), "--python-platform", PLATFORM, "--python-version", PYTHON,
               "--no-build", "--quiet", "--no-header", "--no-annotate", "--output-file", str(Path(tmp) / "o")]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode == 0:
        return None
    why = [line for line in (proc.stderr or proc.stdout).splitlines() if "vllm" in line.lower()]
    return (
        f"the locked vllm=={vllm} is outside the range trl=={trl} declares for its vllm extra"
        + (f" ({why[0].strip()})" if why else "")
        + ": move vllm (pyproject's gpu extra) into TRL's range, or move TRL"
    )


XFORMERS_BUILT_FOR = {"0.0.35": ("2.10", 12)}
"""``{xformers version: (torch major.minor, CUDA major)}`` its Linux x86_64 wheel was built against,
from the wheel's ``xformers/cpp_lib.json`` (0.0.35: ``"torch": "2.10.0+cu128"``, ``"cuda": 1208``;
its ``_C.so`` needs ``libcudart.so.12``). xformers publishes one wheel per release, built for one
torch; beside any other torch its C++/CUDA extension does not load."""


def unloadable_pins(pins: dict[str, str]) -> list[str]:
    """Pins whose wheel cannot load beside the locked torch (and CUDA runtime), with why.

    The CUDA major of the locked torch is that of the locked ``nvidia-cuda-runtime`` wheel (torch's
    CUDA 13 wheels depend on it; the CUDA 12 ones on ``nvidia-cuda-runtime-cu12``)."""
    xformers, torch = pins.get("xformers"), pins.get("torch")
    if xformers is None or torch is None:
        return []
    built = XFORMERS_BUILT_FOR.get(xformers)
    if built is None:
        return [f"xformers=={xformers}: the torch its wheel was built for is not known here; read "
                "xformers/cpp_lib.json in the wheel and add it to XFORMERS_BUILT_FOR"]  # fmt: skip
    torch_minor = ".".join(torch.split("+")[0].split(".")[:2])
    cuda = 13 if "nvidia-cuda-runtime" in pins else 12 if "nvidia-cuda-runtime-cu12" in pins else None
    if torch_minor == built[0] and cuda in (None, built[1]):
        return []
    return [
        f"xformers=={xformers} is built for torch {built[0]} with CUDA {built[1]} and cannot load beside the "
        f"locked torch=={torch}" + (f" (CUDA {cuda})" if cuda else "") + ": pin an xformers built for that "
        "torch, or leave it out (pyproject's [tool.uv] override-dependencies, a never-true marker)"
    ]


UNREACHABLE = ("failed to fetch", "dns error", "connection refused", "could not connect", "timed out",
               "network is unreachable", "error sending request", "failed to download")  # fmt: skip
"""Phrases of a uv error that mean the package index was not reachable (not a lock problem)."""


def install_dry_run(
    uv: str, requirements: Path, python: str = PYTHON, timeout: float = 180, exempt: bool = True
) -> subprocess.CompletedProcess:
    """``uv pip install --dry-run --require-hashes -r REQUIREMENTS`` for Linux x86_64 / CPython
    ``python``, in a throwaway virtual environment, without installing anything: pip's
    hash-checking install of the lock with every declared dependency resolved.

    uv reads no project configuration here (``--no-config``: pip does not read uv's overrides);
    with ``exempt`` the packages of :func:`not_installed` are left out explicitly, which is what the
    ``--no-deps`` installs of the lock (Dockerfile, README) amount to.
    Exit 0: every other requirement, transitive ones included, has a pin with a trusted hash."""
    with tempfile.TemporaryDirectory(prefix="lock-install-") as tmp:
        venv = Path(tmp) / "venv"
        made = subprocess.run([uv, "venv", "--quiet", str(venv)], capture_output=True, text=True, timeout=60)
        if made.returncode != 0:
            return made
        cmd = [uv, "pip", "install", "--dry-run", "--no-config", "--require-hashes", "--only-binary", ":all:",
               "--python-platform", PLATFORM, "--python-version", python, "-r", str(requirements)]  # fmt: skip
        left_out = not_installed() if exempt else {}
        if left_out:
            overrides = Path(tmp) / "not-installed.txt"
            overrides.write_text("".join(f"{line}\n" for line in left_out.values()))
            cmd += ["--override", str(overrides)]
        env = {**os.environ, "VIRTUAL_ENV": str(venv)}
        return subprocess.run(
            cmd, capture_output=True, text=True, cwd=requirements.parent, env=env, timeout=timeout
        )


def unreachable(proc: subprocess.CompletedProcess) -> bool:
    """Whether a failed uv command failed because the package index could not be reached."""
    text = (proc.stderr + proc.stdout).lower()
    return proc.returncode != 0 and any(p in text for p in UNREACHABLE)


def resolve(uv: str, seed: Path | None) -> str:
    """Resolve into a temporary file seeded with ``seed`` (uv keeps its pins where it can)."""
    with tempfile.TemporaryDirectory(prefix="gpu-lock-") as tmp:
        out = Path(tmp) / "gpu.lock"
        if seed is not None and seed.exists():
            shutil.copyfile(seed, out)
        proc = subprocess.run(compile_command(uv, out), capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout + proc.stderr)
            raise SystemExit(
                f"check_lock: uv could not resolve the [{EXTRA}] extra for {PLATFORM}, "
                f"CPython {PYTHON}, wheels only (exit {proc.returncode}); see above"
            )
        # uv writes the output path it was given into the header; keep the header stable
        return out.read_text().replace(str(out), str(LOCK.relative_to(ROOT)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="regenerate requirements/gpu.lock")
    args = parser.parse_args(argv)

    uv = uv_binary()
    if uv is None:
        print("check_lock: uv not found (pip install uv, or the project's dev extra)", file=sys.stderr)
        return 2
    try:
        resolved = resolve(uv, LOCK)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2

    if args.write:
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        LOCK.write_text(resolved)
        print(f"wrote {LOCK.relative_to(ROOT)}")

    if not LOCK.exists():
        print(f"check_lock: {LOCK.relative_to(ROOT)} is missing; run `{WRITE_COMMAND}`", file=sys.stderr)
        return 1
    locked, unhashed = parse_lock(LOCK.read_text())
    fresh, _ = parse_lock(resolved)
    problems = []
    drift = diff_pins(locked, fresh)
    if drift:
        problems.append("the committed lock does not match what pyproject resolves to:\n" + "\n".join(drift))
    problems += requirement_problems(locked)
    problems += unloadable_pins(locked)
    problem = trl_vllm_problem(uv, locked)
    if problem:
        problems.append(problem)
    install = install_dry_run(uv, LOCK)
    if install.returncode != 0 and not unreachable(install):
        why = [line for line in (install.stderr or install.stdout).splitlines() if line.strip()]
        problems.append(
            "the lock does not install in hash-checking mode (what python_env.yaml and the Dockerfile "
            f"do): {why[-1].strip() if why else f'exit {install.returncode}'}"
        )
    if unhashed:
        problems.append("pins without --hash: " + ", ".join(unhashed))
    left_out = not_installed()
    pinned_anyway = sorted(left_out.keys() & locked.keys())
    if pinned_anyway:
        problems.append(
            f"{', '.join(pinned_anyway)}: left out by pyproject's overrides but pinned in the lock"
        )
    if problems:
        print(f"check_lock: {LOCK.relative_to(ROOT)} is out of date:", file=sys.stderr)
        for p in problems:
            print(f"- {p}", file=sys.stderr)
        print(f"fix: `{WRITE_COMMAND}` and commit the lock", file=sys.stderr)
        return 1
    print(
        f"check_lock: {LOCK.relative_to(ROOT)} in sync: {len(locked)} pins, all hashed, "
        f"wheels for {PLATFORM} / CPython {PYTHON}; vllm=={locked.get('vllm')} inside the range of "
        f"trl=={locked.get('trl')}; closed: installs with --require-hashes"
        + (
            f" (left out on purpose: {', '.join(sorted(left_out))}; install with --no-deps)"
            if left_out
            else ""
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
