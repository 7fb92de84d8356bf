"""scripts/image_check.py (`make image-check`) without docker: the base it chooses, the checks it runs,
the way it runs them, and how it reads `pip check`. The build itself is run by hand (docs/deploy.md)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


image_check = _load("image_check")


class Pulls:
    """A stand-in for ``docker pull``: records what was asked, answers ``ok``."""

    def __init__(self, ok: bool):
        self.ok, self.asked = ok, []

    def __call__(self, image: str) -> bool:
        self.asked.append(image)
        return self.ok


def test_the_real_base_is_used_when_it_can_be_pulled():
    pull = Pulls(ok=True)
    base, standin = image_check.choose_base(None, False, pull)
    default = re.search(r"^ARG BASE_IMAGE=(\S+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE).group(1)
    assert (base, standin) == (default, False) and pull.asked == [default]


def test_the_standin_is_built_when_no_registry_answers():
    base, standin = image_check.choose_base(None, False, Pulls(ok=False))
    assert (base, standin) == (image_check.STANDIN_TAG, True)


def test_an_explicit_base_or_standin_pulls_nothing():
    pull = Pulls(ok=False)
    assert image_check.choose_base("nvidia/cuda:x@sha256:0", False, pull) == ("nvidia/cuda:x@sha256:0", False)
    assert image_check.choose_base(None, True, pull) == (image_check.STANDIN_TAG, True)
    assert pull.asked == []


def test_arguments(monkeypatch):
    monkeypatch.delenv("BASE_IMAGE", raising=False)
    args = image_check.parse_args([])
    assert (args.base_image, args.standin, args.clean) == (None, False, False)
    monkeypatch.setenv("BASE_IMAGE", "registry.example/cuda@sha256:1")
    assert image_check.parse_args(["--clean"]).base_image == "registry.example/cuda@sha256:1"
    with pytest.raises(SystemExit):
        image_check.parse_args(["--standin", "--base-image", "x"])


def test_the_checks_are_the_five_of_a_cluster_start():
    by_name = {c.name: c for c in image_check.checks({"torch"})}
    assert list(by_name) == ["--help", "imports", "pip check", "evaluate --baselines", "GPU refusal"]
    assert (
        by_name["--help"].argv == ("--help",) and by_name["--help"].entrypoint is None
    )  # the image's entrypoint
    script = by_name["imports"].argv[1]
    for module in (
        "torch",
        "vllm",
        "unsloth",
        "bitsandbytes",
        "flashinfer",
        "trl",
        "mlflow",
        "orthojob.job",
        "server.app",
    ):
        assert repr(module) in script, module
    assert by_name["pip check"].entrypoint == "pip" and by_name["pip check"].argv == ("check",)
    assert by_name["evaluate --baselines"].argv[:2] == ("evaluate", "--baselines")
    refusal = by_name["GPU refusal"]
    assert (
        refusal.argv[:2] == ("-m", "orthojob.job")
        and refusal.expect_code != 0
        and "GPU" in refusal.expect_text
    )


def test_xformers_is_imported_only_when_the_lock_pins_it():
    def script(locked):
        return next(c for c in image_check.checks(locked) if c.name == "imports").argv[1]

    assert "'xformers'" not in script({"torch"})
    assert "'xformers'" in script({"torch", "xformers"})
    assert image_check.UNSLOTH_FALLBACK.search(
        "Unsloth: xformers is installed but cannot load with torch 2.13.0, so PyTorch attention is used instead."
    )


def test_the_checks_run_offline_read_only_as_the_jobs_user():
    opts = image_check.run_options()
    assert opts[opts.index("--network") + 1] == "none" and "--read-only" in opts
    dockerfile_user = re.findall(r"^USER (\S+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)[-1]
    assert opts[opts.index("--user") + 1] == image_check.USER == dockerfile_user
    tmpfs = {opts[i + 1].split(":")[0]: opts[i + 1] for i, o in enumerate(opts) if o == "--tmpfs"}
    assert set(tmpfs) >= {"/tmp", "/cache", "/work", "/home/orthorl"}  # the Job's volume mounts
    uid, gid = image_check.USER.split(":")
    assert all(f"uid={uid}" in spec and f"gid={gid}" in spec for spec in tmpfs.values()), tmpfs  # writable


def test_pip_check_admits_only_the_packages_left_out_of_the_lock():
    left_out = {"xformers"}
    assert image_check.pip_check_ok(0, "No broken requirements found.", left_out)[0]
    only = "unsloth 2026.10.9 requires xformers, which is not installed.\n"
    assert image_check.pip_check_ok(1, only, left_out)[0]
    other = only + "vllm 0.31.0 requires torchaudio, which is not installed.\n"
    ok, why = image_check.pip_check_ok(1, other, left_out)
    assert not ok and "torchaudio" in why
    conflict = "trl 1.15.0 has requirement vllm<=0.31.0, but you have vllm 0.32.0.\n"
    assert not image_check.pip_check_ok(1, conflict, left_out)[0]
    assert not image_check.pip_check_ok(1, "", left_out)[0]  # failed, said nothing


def test_debian_mirror_is_read_from_the_hosts_apt_sources():
    sources = [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]
    if not any(p.is_file() and "/debian" in p.read_text() for p in sources):
        pytest.skip("not a Debian host: the stand-in is bootstrapped only on one")
    assert re.fullmatch(r"https?://\S+/debian", image_check.debian_mirror())


def test_make_image_check_runs_the_script():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    out = subprocess.run(
        ["make", "-n", "image-check"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert re.search(r"python scripts/image_check\.py", out), out
    makefile = (ROOT / "Makefile").read_text()
    assert "image-check" in re.search(r"^\.PHONY:.*$", makefile, re.MULTILINE).group(0)
    test_recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE).group(0)
    assert "image" not in test_recipe  # not part of make test
