"""orthojob.modeling.sampling: the shared-prefix sampler samples what transformers' generate samples."""

from __future__ import annotations

import collections

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from orthojob.modeling import sampling
from tests.bench_scripts import load_bench


@pytest.fixture(scope="module")
def model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


def _prompts(vocab: int, lengths=(7, 19, 12, 30), repeats: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    distinct = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    return [p for p in distinct for _ in range(repeats)]


def _generate(model, prompt_ids, eos, max_new_tokens, **settings) -> list[list[int]]:
    """transformers' generate as TRL's GRPO calls it (bench/sampling_speed.py's, pad token 0)."""
    return load_bench("sampling_speed").generate_like_trl(
        model, prompt_ids, eos, max_new_tokens, 0, **settings
    )


def _sample(model, prompt_ids, eos, max_new_tokens, **settings) -> list[list[int]]:
    return sampling.sample_completions(
        model, prompt_ids, max_new_tokens=max_new_tokens, eos_token_ids=eos, pad_token_id=0, **settings
    )


def test_greedy_completions_are_generates_rows_leaving_at_different_steps(model):
    prompts = _prompts(model.config.vocab_size)
    free = _generate(model, prompts, [1], 24, do_sample=False)
    # end a completion at a token greedy decoding writes mid-way in one row, so rows end apart
    eos = [free[0][5], free[-1][9]]
    expected = _generate(model, prompts, eos, 24, do_sample=False)
    assert len({len(c) for c in expected}) > 1, "the test needs rows that end at different steps"
    assert _sample(model, prompts, eos, 24, do_sample=False) == expected
    # and one prompt alone, as a batch of its own
    assert _sample(model, prompts[:1], eos, 24, do_sample=False) == expected[:1]


def test_processed_logits_are_transformers_warpers():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    for temperature, top_k, top_p in [(1.0, None, 1.0), (0.7, 5, 1.0), (1.3, None, 0.8), (0.9, 10, 0.5)]:
        want = TemperatureLogitsWarper(temperature)(None, logits.clone()) if temperature != 1.0 else logits
        if top_k:
            want = TopKLogitsWarper(top_k)(None, want)
        if top_p < 1.0:
            want = TopPLogitsWarper(top_p)(None, want)
        got = sampling.processed_logits(logits, temperature, top_k, top_p)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        assert torch.allclose(got[~torch.isinf(got)], want[~torch.isinf(want)])


def test_draws_follow_the_processed_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0, 0.5]]).repeat(20_000, 1)
    torch.manual_seed(0)
    draws = sampling._next_tokens(logits, True, 0.8, 4, 0.95)
    probs = torch.softmax(sampling.processed_logits(logits[:1], 0.8, 4, 0.95), -1)[0]
    freq = torch.bincount(draws, minlength=6).double() / len(draws)
    assert freq[probs == 0].sum() == 0  # never a token top-k or top-p dropped
    assert (freq - probs.double()).abs().max() < 0.01  # 20,000 draws: a standard error under 0.004


def _histogram(completions) -> collections.Counter:
    return collections.Counter(t for c in completions for t in c)


def _total_variation(a: collections.Counter, b: collections.Counter) -> float:
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[t] / na - b[t] / nb) for t in set(a) | set(b))


SCALE = 100.0


@pytest.fixture(scope="module")
def peaked(tiny_model):
    """The tiny model with its final norm scaled up: next-token distributions far from uniform, so a
    token histogram of a few thousand tokens tells one temperature from another."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(SCALE)
    return model


def test_sampled_token_statistics_match_generate_over_fixed_seeds(peaked):
    """Token histograms of 256 completions a seed, 6 seeds a sampler: the shared-prefix sampler's are
    on average no further from generate's than generate's are from each other (seed noise), while a
    change of temperature shows several times that distance."""
    prompts = _prompts(peaked.config.vocab_size, lengths=(9, 21), repeats=128)
    settings = {"do_sample": True, "temperature": 0.5, "top_k": 0, "top_p": 1.0}
    seeds = range(6)
    runs: dict[str, list[collections.Counter]] = {}
    for name, sample, temperature in [
        ("generate", _generate, 0.5),
        ("shared-prefix", _sample, 0.5),
        ("hotter", _generate, 1.0),
    ]:
        runs[name] = []
        for seed in seeds:
            torch.manual_seed(seed)
            runs[name].append(
                _histogram(sample(peaked, prompts, [7], 16, **{**settings, "temperature": temperature}))
            )

    def mean_distance(a: str, b: str) -> float:
        pairs = [(i, j) for i in seeds for j in seeds if (i < j if a == b else True)]
        return sum(_total_variation(runs[a][i], runs[b][j]) for i, j in pairs) / len(pairs)

    noise = mean_distance("generate", "generate")
    assert mean_distance("generate", "hotter") > 3 * noise
    assert mean_distance("generate", "shared-prefix") < 1.1 * noise


def test_sampling_is_deterministic_under_a_seed(model):
    prompts = _prompts(model.config.vocab_size)
    draws = []
    for _ in range(2):
        torch.manual_seed(3)
        draws.append(_sample(model, prompts, [7], 12, do_sample=True, temperature=1.0))
    assert draws[0] == draws[1]


def test_covers_only_the_settings_it_samples_exactly():
    trl_defaults = {
        "max_new_tokens": 64,
        "do_sample": True,
        "pad_token_id": 0,
        "bos_token_id": None,
        "eos_token_id": [1],
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": None,
        "repetition_penalty": 1.0,
        "cache_implementation": None,
    }
    assert sampling.covers(trl_defaults)
    assert not sampling.covers({**trl_defaults, "repetition_penalty": 1.1})
    assert not sampling.covers({**trl_defaults, "min_p": 0.05})
    assert not sampling.covers({**trl_defaults, "no_repeat_ngram_size": 3})


def test_bad_calls_are_refused(model):
    with pytest.raises(ValueError, match="max_new_tokens"):
        _sample(model, [[5, 6]], [1], 0)
    with pytest.raises(ValueError, match="at least one token"):
        _sample(model, [[5, 6], []], [1], 4)
    assert _sample(model, [], [1], 4) == []
    assert model.config._attn_implementation == "sdpa"  # the sampler's attention is set only while it runs
