"""bench/grpo_gpu.py's code path on CPU (``--cpu-smoke``, a tiny model): every run of the GPU recipe
(transformers' generate and the shared-prefix sampler) trains its steps and reports its figures."""

from __future__ import annotations

import json

from tests.bench_scripts import load_bench


def test_the_gpu_recipe_runs_both_samplers_on_a_tiny_model(tmp_path, capsys):
    bench = load_bench("grpo_gpu")
    argv = ["--cpu-smoke", "--steps", "2", "--batch-size", "4", "--num-generations", "4",
            "--max-completion-length", "16", "--work", str(tmp_path), "--timeout", "300"]  # fmt: skip
    assert bench.main(argv) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["run"] for r in results] == ["transformers", "shared-prefix"]
    for r in results:
        assert r["steps"] == 2 and r["completions_per_step"] == 4
        assert r["gen_tokens"] > 0 and r["gen_tokens_per_s"] > 0 and r["step_s"] > 0
