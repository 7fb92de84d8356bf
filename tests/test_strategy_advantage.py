"""The strategy tokens' centred advantage (orthojob.strategy_advantage) and the trainer hook that
applies it to TRL's token-level advantages."""

from __future__ import annotations

import json
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from orthojob.strategy_advantage import (
    centred_strategy_advantages,
    strategy_spans,
    token_spans_mask,
)

PLAN_GROUPS = [{"teeth": [11, 21], "fraction": 1.0, "priority": 1, "start_stage": 1}]


def _plan(strategy: str | None, last: bool = True) -> str:
    if last:
        return json.dumps({"tooth_groups": PLAN_GROUPS, "strategy": strategy})
    return json.dumps({"strategy": strategy, "tooth_groups": PLAN_GROUPS})


def test_strategy_spans_find_the_name_in_either_key_order_and_only_a_valid_one():
    for last in (True, False):
        text = _plan("distal_first", last)
        strategy, spans = strategy_spans(text)
        assert strategy == "distal_first" and [text[a:b] for a, b in spans] == ["distal_first"]
    assert strategy_spans(_plan("sideways_first")) == (None, [])
    assert strategy_spans(_plan(None)) == (None, [])
    assert strategy_spans("no plan here") == (None, [])


def test_centring_removes_each_strategys_batch_mean_and_keeps_everything_else():
    rng = np.random.default_rng(0)
    strategies = ["anterior_first"] * 5 + ["distal_first"] * 3 + [None] * 2
    a = rng.normal(size=10) + np.array([1.0] * 5 + [-1.0] * 3 + [-2.0] * 2)
    c = centred_strategy_advantages(a, strategies)
    named = a[:8].mean()
    # every strategy's centred mean is the mean over all strategy-naming completions: no marginal left
    assert c[:5].mean() == pytest.approx(named) and c[5:8].mean() == pytest.approx(named)
    # the differences within a strategy, and the non-plans, are untouched
    assert np.allclose(np.diff(c[:5]), np.diff(a[:5])) and np.allclose(np.diff(c[5:8]), np.diff(a[5:8]))
    assert np.array_equal(c[8:], a[8:])
    assert np.array_equal(centred_strategy_advantages(a, [None] * 10), a)
    with pytest.raises(ValueError, match="do not match"):
        centred_strategy_advantages(a, strategies[:3])


def test_a_case_blind_preference_is_cancelled_and_a_case_dependent_one_is_kept():
    """Two cases, two strategies. Case-blind: A beats B on both cases by the same margin -> the
    centred advantages give A and B the same total. Case-dependent: A wins on case 1, B on case 2
    -> A's case-1 samples stay above its case-2 samples, and B's the other way round."""
    strategies = ["A", "B", "A", "B"]  # case 1: samples 0-1, case 2: samples 2-3
    blind = centred_strategy_advantages(np.array([1.0, -1.0, 1.0, -1.0]), strategies)
    assert np.allclose(blind, 0.0)
    dependent = centred_strategy_advantages(np.array([1.0, -1.0, -1.0, 1.0]), strategies)
    assert dependent[0] > dependent[2] and dependent[3] > dependent[1]


def test_token_mask_covers_exactly_the_tokens_that_overlap_the_name():
    pieces = ['{"', "strategy", '":', ' "', "dist", "al_first", '"}']
    text = "".join(pieces)
    _, spans = strategy_spans(text)
    assert token_spans_mask(pieces, spans).tolist() == [False] * 4 + [True, True, False]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from orthojob import models

    path = tmp_path_factory.mktemp("tiny") / "tiny"
    models.build_tiny(path, ["task_easy"], prompt_format="compact", hidden_size=32, layers=1, heads=2,
                      kv_heads=1, intermediate=32)  # fmt: skip
    return AutoTokenizer.from_pretrained(path)


def test_trainer_hook_gives_the_strategy_tokens_the_centred_advantage(tokenizer):
    """RecordingGRPOTrainer._centre_strategy_advantages on a real tokenizer: (B, T) advantages in
    which the tokens spelling the strategy carry the centred value x scale, and every other token
    (padding included) TRL's advantage; the two diagnostics logged."""
    from orthojob.grpo_trainer import RecordingGRPOTrainer

    texts = [
        _plan("anterior_first"),
        _plan("anterior_first"),
        _plan("distal_first", last=False),
        "not a plan",
    ]
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, encoded)) + 2
    ids = torch.full((len(texts), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(texts), width), dtype=torch.long)
    for row, e in enumerate(encoded):
        ids[row, : len(e)] = torch.tensor(e)
        mask[row, : len(e)] = 1
    advantages = torch.tensor([1.5, 0.5, -0.5, -1.5])
    trainer = SimpleNamespace(processing_class=tokenizer, strategy_advantage_scale=2.0,
                              _metrics={"train": defaultdict(list)})  # fmt: skip
    output = {"completion_ids": ids, "completion_mask": mask, "advantages": advantages}
    RecordingGRPOTrainer._centre_strategy_advantages(trainer, output)

    token_adv = output["advantages"]
    assert token_adv.shape == (4, width)
    centred = centred_strategy_advantages(
        advantages.numpy(), ["anterior_first", "anterior_first", "distal_first", None]
    )
    for row, e in enumerate(encoded):
        changed = [i for i in range(width) if not torch.isclose(token_adv[row, i], advantages[row])]
        spelled = tokenizer.decode([e[i] for i in changed]) if changed else ""
        if row < 3:
            assert "_first" in spelled and spelled.strip('" ') in texts[row]
            assert torch.allclose(
                token_adv[row, changed], torch.tensor(2.0 * centred[row], dtype=token_adv.dtype)
            )
        else:
            assert changed == []
    assert trainer._metrics["train"]["strategy_advantage/named"] == [0.75]
    assert trainer._metrics["train"]["strategy_advantage/marginal"][0] == pytest.approx(2 / 3)
