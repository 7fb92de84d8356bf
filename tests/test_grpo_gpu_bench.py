"""bench/grpo_gpu.py's code path on CPU (``--cpu-smoke``, a tiny model): every run of the GPU recipe
(transformers' generate and the shared-prefix sampler) trains its steps and reports its figures."""

from __future__ import annotations

import json

import pytest

from tests.bench_scripts import load_bench


def test_the_gpu_recipe_runs_both_samplers_on_a_tiny_model(tmp_path, capsys):
    bench = load_bench("grpo_gpu")
    argv = ["--cpu-smoke", "--steps", "2", "--batch-sizes", "4", "--num-generations", "4",
            "--max-completion-length", "16", "--work", str(tmp_path), "--timeout", "300"]  # fmt: skip
    assert bench.main(argv) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["run"] for r in results] == ["transformers", "shared-prefix"]
    for r in results:
        assert r["steps"] == 2 and r["completions_per_step"] == 4
        assert r["gen_tokens"] > 0 and r["gen_tokens_per_s"] > 0 and r["step_s"] > 0
        # built by the job's own RecordingGRPOTrainer.from_config, it recorded every completion as a run does
        recorded = (tmp_path / f"out-{r['run']}" / "completions.jsonl").read_text().splitlines()
        assert len(recorded) == 2 * 4


def test_mfu_is_model_flops_over_the_devices_peak():
    bench = load_bench("grpo_gpu")
    step = {"steps": 3, "step_s": 10.0, "params": 3e9, "gen_tokens": 2 * 8 * 256, "completions_per_step": 8,
            "prompt_tokens": 1744}  # fmt: skip
    # per step: 2 N x 2,048 generated tokens + 8 N x 8 x (1,744 + 256) sequence tokens
    flops = 2 * 3e9 * 2048 + 8 * 3e9 * 8 * 2000
    assert bench.mfu(step, "NVIDIA H200") == pytest.approx(flops / (10.0 * 989e12))
    assert bench.mfu(step, "cpu") is None
    assert bench.mfu({**step, "step_s": None}, "NVIDIA H100 80GB HBM3") is None
