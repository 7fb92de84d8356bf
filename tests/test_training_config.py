"""The training fields every stage shares (:class:`orthojob.stages.training_config.TrainingConfig`):
declared once, checked once, with each stage's own default where the stages differ."""

from __future__ import annotations

import dataclasses

import pytest

from orthojob.stages.grpo_config import GRPOJobConfig
from orthojob.stages.rsft_config import RSFTConfig
from orthojob.stages.sft_config import FormatSFTConfig, SFTJobConfig, ToolSFTConfig
from orthojob.stages.training_config import ConfigError, TrainingConfig

STAGE_CONFIGS = (GRPOJobConfig, SFTJobConfig, FormatSFTConfig, ToolSFTConfig, RSFTConfig)


@pytest.mark.parametrize("config_cls", STAGE_CONFIGS, ids=lambda c: c.__name__)
def test_every_stage_refuses_a_bad_shared_value_with_the_same_message(config_cls):
    for name, bad, message in (
        ("steps", 0, "--steps must be an integer >= 1, got 0"),
        ("batch_size", True, "--batch-size must be an integer >= 1, got True"),
        ("grad_accum", 0, "--grad-accum must be an integer >= 1, got 0"),
        ("lora_r", -1, "--lora-r must be >= 0"),
        ("heldout_share", 1.5, "--heldout-share must lie in"),
    ):
        with pytest.raises(ConfigError, match=message):
            dataclasses.replace(config_cls(), **{name: bad})


def test_the_values_that_differ_by_stage_are_each_stages_own():
    """The base has no output folder, steps, batch or learning rate of its own; the stages do."""
    with pytest.raises(TypeError, match="out"):
        TrainingConfig()
    shared = {f.name for f in dataclasses.fields(TrainingConfig)}
    assert {"model", "out", "steps", "batch_size", "grad_accum", "lr", "lora_r", "seed"} <= shared
    assert len({c().out for c in STAGE_CONFIGS}) == len(STAGE_CONFIGS)
    assert (GRPOJobConfig().steps, GRPOJobConfig().lr) != (SFTJobConfig().steps, SFTJobConfig().lr)
