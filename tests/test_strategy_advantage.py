"""The strategy tokens' centred advantage (orthojob.rewards.strategy_advantage) and the trainer hook that
applies it to TRL's token-level advantages."""

from __future__ import annotations

import json
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from orthojob.rewards.strategy_advantage import (
    INVALID,
    centred_strategy_advantages,
    counterfactual_strategy_advantages,
    strategy_spans,
    token_spans_mask,
    with_strategy,
)
from server.cases import HELDOUT_SEED_START, CaseKey, generate_case
from server.clinical_profiles import STRATEGIES

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
    text = _plan("sideways_first")  # not a strategy: its own arm, centred with the five
    strategy, spans = strategy_spans(text)
    assert strategy == INVALID and [text[a:b] for a, b in spans] == ["sideways_first"]
    assert strategy_spans(_plan(None)) == (None, [])
    assert strategy_spans("no plan here") == (None, [])


def test_centring_removes_each_strategys_batch_mean_and_keeps_everything_else():
    rng = np.random.default_rng(0)
    strategies = ["anterior_first"] * 5 + ["distal_first"] * 3 + [None] * 2
    a = rng.normal(size=10) + np.array([1.0] * 5 + [-1.0] * 3 + [-2.0] * 2)
    c = centred_strategy_advantages(a, strategies)
    # every strategy's centred advantages sum to zero: no marginal push, whatever its sample count
    assert c[:5].sum() == pytest.approx(0.0) and c[5:8].sum() == pytest.approx(0.0)
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


def test_counterfactual_advantage_compares_the_plan_as_written_with_it_under_every_strategy():
    # columns: the five strategies, then the plan as written
    q = np.array(
        [[1.0, 2.0, 3.0, 4.0, 5.0, 5.0], [5.0, 5.0, 5.0, 5.0, 5.0, 5.0], [2.0] * 5 + [1.0], [0.0] * 6]
    )
    chosen = [STRATEGIES[4], STRATEGIES[0], INVALID, None]
    adv = counterfactual_strategy_advantages(q, chosen)
    scale = np.std([5.0, 5.0, 1.0]) + 1e-4
    assert adv[:3] == pytest.approx([(5.0 - 3.0) / scale, 0.0, (1.0 - 2.0) / scale]) and np.isnan(adv[3])
    with pytest.raises(ValueError, match="must be"):
        counterfactual_strategy_advantages(q[:, :5], chosen)
    text = _plan("anterior_first")
    assert with_strategy(text, strategy_spans(text)[1], "distal_first") == _plan("distal_first")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from orthojob.modeling import models

    path = tmp_path_factory.mktemp("tiny") / "tiny"
    models.build_tiny(path, ["task_easy"], prompt_format="compact", hidden_size=32, layers=1, heads=2,
                      kv_heads=1, intermediate=32)  # fmt: skip
    return AutoTokenizer.from_pretrained(path)


def test_trainer_hook_gives_the_strategy_tokens_the_centred_advantage(tokenizer):
    """RecordingGRPOTrainer._centre_strategy_advantages on a real tokenizer: (B, T) advantages in
    which the tokens spelling the strategy carry the centred value x scale, and every other token
    (padding included) TRL's advantage; the two diagnostics logged."""
    from orthojob.stages.grpo_trainer import RecordingGRPOTrainer

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
                              strategy_advantage="centred", _metrics={"train": defaultdict(list)})  # fmt: skip
    output = {"completion_ids": ids, "completion_mask": mask, "advantages": advantages}
    cases = [CaseKey("task_easy", HELDOUT_SEED_START + i, False) for i in range(4)]
    RecordingGRPOTrainer._strategy_token_advantages(trainer, output, cases)

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
    assert trainer._metrics["train"]["strategy_advantage/marginal"][0] == pytest.approx(5 / 6)


def test_counterfactual_hook_scores_the_plan_under_the_five_strategies_with_the_real_rewards(tokenizer):
    """counterfactual on real cases: the strategy tokens of a plan naming its case's optimal strategy
    get a positive advantage, of a plan naming a wrong one a negative advantage, each the same plan's
    weighted reward under its strategy less the mean over the five (the project's reward functions)."""
    from orthojob.rewards.reward_functions import active_reward_funcs
    from orthojob.stages.grpo_trainer import RecordingGRPOTrainer
    from server.clinical_profiles import strategy_multiplier_class
    from server.treatment import score_plans

    cases, texts = [], []
    for seed in range(HELDOUT_SEED_START, HELDOUT_SEED_START + 200):
        case = generate_case("task_easy", seed, False)
        wrong = next(s for s in STRATEGIES if strategy_multiplier_class(case.profile, s) == "wrong")
        if score_plans([json.loads(_plan(case.optimal_strategy))], [case])[0]["broken_rules"]:
            continue  # a plan breaking a hard rule earns no strategy credit whatever it names
        for strategy in (case.optimal_strategy, wrong):
            cases.append(CaseKey("task_easy", seed, False))
            texts.append(_plan(strategy))
        if len(cases) == 6:
            break
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, encoded))
    ids = torch.full((len(texts), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(texts), width), dtype=torch.long)
    for row, e in enumerate(encoded):
        ids[row, : len(e)], mask[row, : len(e)] = torch.tensor(e), 1
    funcs = active_reward_funcs()
    trainer = SimpleNamespace(processing_class=tokenizer, strategy_advantage_scale=1.0, reward_funcs=funcs,
                              reward_weights=torch.ones(len(funcs)), strategy_advantage="counterfactual",
                              _metrics={"train": defaultdict(list)})  # fmt: skip
    trainer._weighted_reward = lambda t, c: RecordingGRPOTrainer._weighted_reward(trainer, t, c)
    advantages = torch.zeros(len(texts))
    output = {"completion_ids": ids, "completion_mask": mask, "advantages": advantages}
    RecordingGRPOTrainer._strategy_token_advantages(trainer, output, cases)
    token_adv = output["advantages"]

    # the same plans re-scored here under each strategy: q (6, 5), COMA's advantage, then centred
    def total(text, c):
        return sum(
            float(f([text], seed=[c.seed], task_id=[c.task_id], force_decay=[c.force_decay])[0])
            for f in funcs
        )

    q = np.array([[total(with_strategy(t, strategy_spans(t)[1], s), c) for s in STRATEGIES] + [total(t, c)]
                  for t, c in zip(texts, cases)])  # fmt: skip
    chosen = [strategy_spans(t)[0] for t in texts]
    coma = counterfactual_strategy_advantages(q, chosen)
    assert all(coma[0::2] > 0) and all(coma[1::2] < 0), (
        coma
    )  # the optimal strategy beats the mean, a wrong one not
    expected = centred_strategy_advantages(coma, chosen)
    for row in range(len(texts)):  # TRL's advantages are 0 here: only strategy tokens can differ
        changed = token_adv[row][token_adv[row] != 0]
        assert torch.allclose(changed, torch.full_like(changed, float(expected[row])), atol=1e-5)
        assert (len(changed) > 0) == (abs(expected[row]) > 1e-6)
    assert sum(abs(expected) > 1e-6) >= 2  # a strategy named for two cases: centring keeps their difference
    assert trainer._metrics["train"]["strategy_advantage/gap"][0] > 0


def test_strategy_lr_scale_speeds_up_only_the_strategy_rows_of_the_output_layer(tmp_path):
    """RecordingGRPOTrainer.create_optimizer with strategy_lr_scale 10: every trainable parameter
    is in one group; after an Adam step on the same gradient everywhere, the output layer's rows of
    the strategy tokens moved 10x as far as with scale 1, every other row (and every other
    parameter) as far."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    from orthojob.modeling import models
    from orthojob.rewards.strategy_advantage import strategy_token_ids
    from orthojob.stages.grpo_trainer import RecordingGRPOTrainer

    path = models.build_tiny(tmp_path / "tiny", ["task_easy"], prompt_format="compact", hidden_size=32, layers=1,
                             heads=2, kv_heads=1, intermediate=32)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = strategy_token_ids(tokenizer)
    assert rows and all(tokenizer.decode([r]) in "".join(STRATEGIES) for r in rows)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), learning_rate=1e-3, report_to=[], use_cpu=True)

    def one_step(scale: float) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(path)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        if scale == 1.0:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        else:
            fake = SimpleNamespace(strategy_lr_scale=scale, optimizer=None, model=model, args=args,
                                   processing_class=tokenizer,
                                   get_optimizer_cls_and_kwargs=Trainer.get_optimizer_cls_and_kwargs)  # fmt: skip
            fake.get_decay_parameter_names = lambda m: Trainer.get_decay_parameter_names(fake, m)
            optimizer = RecordingGRPOTrainer.create_optimizer(fake)
            ids = sorted(id(p) for g in optimizer.param_groups for p in g["params"])
            assert ids == sorted(id(p) for p in model.parameters() if p.requires_grad)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        return {n: p.detach() - start[n] for n, p in model.named_parameters()}

    base, fast = one_step(1.0), one_step(10.0)
    head = "lm_head.weight"
    others = [r for r in range(base[head].shape[0]) if r not in rows]
    assert torch.allclose(fast[head][rows], 10 * base[head][rows], rtol=1e-4)
    assert torch.allclose(fast[head][others], base[head][others], rtol=1e-4, atol=1e-9)
    for name in base:
        if name != head:
            assert torch.allclose(fast[name], base[name], rtol=1e-4, atol=1e-9), name
