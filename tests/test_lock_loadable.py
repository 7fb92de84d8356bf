"""requirements/gpu.lock pins nothing that cannot load beside the locked torch, and the packages it
leaves out on purpose (pyproject's never-true uv overrides) are left out consistently: not pinned,
installed with --no-deps, the only ones `pip check` in the image may report. No network."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _check_lock():
    spec = importlib.util.spec_from_file_location("check_lock", ROOT / "scripts" / "check_lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_lock = _check_lock()
HASH = "    --hash=sha256:" + "0" * 64


def lock_text(**pins: str) -> str:
    """A uv-style lock: one hashed pin per keyword (``_`` for ``-`` in names)."""
    return "".join(
        f"{name.replace('_', '-')}=={version} \\\n{HASH}\n    # via x\n" for name, version in pins.items()
    )


def problems(**pins: str) -> list[str]:
    return check_lock.unloadable_pins(check_lock.parse_lock(lock_text(**pins))[0])


def test_xformers_built_for_another_torch_is_refused():
    found = problems(torch="2.13.0", nvidia_cuda_runtime="13.0.96", xformers="0.0.35", unsloth="2026.10.9")
    assert len(found) == 1 and "xformers==0.0.35" in found[0] and "torch==2.13.0" in found[0]


def test_xformers_built_for_the_locked_torch_but_another_cuda_is_refused():
    found = problems(torch="2.10.0", nvidia_cuda_runtime="13.0.96", xformers="0.0.35")
    assert len(found) == 1 and "CUDA 13" in found[0]


def test_xformers_matching_the_locked_torch_and_cuda_passes():
    assert problems(torch="2.10.0", nvidia_cuda_runtime_cu12="12.8.90", xformers="0.0.35") == []


def test_an_xformers_of_unknown_build_must_be_looked_at():
    found = problems(torch="2.13.0", xformers="0.0.99")
    assert len(found) == 1 and "cpp_lib.json" in found[0]


def test_a_lock_without_xformers_passes():
    assert problems(torch="2.13.0", nvidia_cuda_runtime="13.0.96", unsloth="2026.10.9") == []


def test_the_committed_lock_loads_beside_its_torch():
    pins, unhashed = check_lock.parse_lock(check_lock.LOCK.read_text())
    assert "torch" in pins and not unhashed
    assert check_lock.unloadable_pins(pins) == []
    assert not check_lock.not_installed().keys() & pins.keys()


def test_only_never_true_overrides_count_as_left_out():
    pyproject = """
[project]
name = "x"
[tool.uv]
override-dependencies = ["xformers; sys_platform == 'never'", "numpy<3; sys_platform == 'linux'", "rich>=13"]
"""
    assert check_lock.not_installed(pyproject) == {"xformers": "xformers; sys_platform == 'never'"}
    assert check_lock.not_installed('[project]\nname = "x"\n') == {}


def test_every_pip_install_of_the_lock_skips_what_it_leaves_out():
    """pip does not read uv's overrides: with a package left out, pip would fetch it (and refuse it
    in hash-checking mode), so the Dockerfile's and the README's installs of the lock use --no-deps."""
    left_out = check_lock.not_installed()
    for path in ("Dockerfile", "README.md"):
        text = (ROOT / path).read_text().replace("\\\n", " ")
        installs = re.findall(r"pip install [^\n&]*gpu\.lock", text)
        assert installs, path
        for line in installs:
            assert ("--no-deps" in line) == bool(left_out), (path, line)
