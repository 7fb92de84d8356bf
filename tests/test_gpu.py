"""Tests that need a CUDA GPU; each skips without one.

GRPO on the GPU: TRL's trainer runs the project's setup in bf16 where the device supports it, the
policy sits on the GPU, the five rewards are finite, and the gate evaluates afterwards. This file
imports only the project, torch, transformers, peft, TRL and datasets (not MLflow's server, not the
test services), so that it runs on a GPU machine that has nothing else installed:

    python -m pytest -q tests/test_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_gpu_training_uses_bf16_where_supported(tiny_model, tmp_path):
    from orthojob.modeling.models import device_info
    from orthojob.rewards.reward_functions import REWARD_FUNCS
    from orthojob.stages import grpo, grpo_config
    from orthojob.stages.grpo import config_from_args

    values = {"preset": "tiny-cpu", "model": str(tiny_model), "steps": 2, "max_completion_length": 32,
              "out": str(tmp_path / "gpu"), "gate_seeds": 2, "skip_sft_gate": True}  # fmt: skip
    config = config_from_args(values)
    info = device_info()
    assert info["cuda"]
    args, _ = grpo_config.build_grpo_args(config, info, 1)
    assert args.bf16 == torch.cuda.is_bf16_supported() and not args.use_cpu

    result = grpo.train_and_gate(config)
    assert result.trainer.state.global_step == 2
    assert next(result.trainer.model.parameters()).device.type == "cuda"
    steps = [row for row in result.trainer.state.log_history if "reward" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        for name in REWARD_FUNCS:
            value = row[f"rewards/{name}/mean"]
            assert value is not None and math.isfinite(value), (name, value)
