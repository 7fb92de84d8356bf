"""Sampling a GRPO step's completions without transformers' ``generate`` loop.

A GRPO step samples ``num_generations`` completions of each of a few prompts. transformers'
``generate`` treats the step's batch as unrelated rows: it runs the prompt through the model once per
row (every prompt ``num_generations`` times), keeps one copy of the prompt's keys and values per row
and grows it by concatenation (each decode step copies the whole cache), rebuilds the attention mask
every step, and keeps decoding rows that have ended until the longest one ends. For a small model on
one CPU core those are most of the time (``bench/sampling_speed.py``). :func:`sample_completions` does
the same sampling without them:

* each distinct prompt is run through the model once and its keys and values are kept once
  (:class:`_SharedPrefixLayer`); a decode step's attention reads them once for all of that prompt's
  completions (:func:`_shared_prefix_attention`, the softmax taken jointly over the prompt's and the
  completion's positions);
* a completion's own keys and values go to a buffer allocated once: a decode step writes one position;
* the attention mask is a boolean buffer sliced per step;
* a completion leaves the batch at its end-of-sequence token, so later steps compute only the rows
  still writing.

The sampling itself is transformers' for the settings GRPO uses: logits divided by the temperature, then
top-k, then top-p (nucleus) (:func:`processed_logits`), then one draw a row from the global generator
(by the inverse of the cumulative distribution, where ``generate`` uses ``torch.multinomial``: the
same distribution, other draws); greedy (argmax) when ``do_sample`` is false. :func:`covers` says
which generation settings it samples exactly; the rest (a repetition penalty, min-p, logits
processors) are for ``generate``. The arithmetic is the model's own except the decode step's
attention, which sums in another order than SDPA (float32 rounding: greedy completions match
``generate``'s in ``tests/test_sampling.py``, and so do the token statistics of sampled ones).

Measured by ``bench/sampling_speed.py`` (one core, interleaved with ``generate``, the ratio printed).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

__all__ = ["ATTENTION", "covers", "processed_logits", "sample_completions"]

ATTENTION = "orthorl_shared_prefix"
"""The attention implementation's registered name, set on the model only while it samples."""


class _SharedPrefixLayer(DynamicLayer):
    """One decoder layer's keys and values: the distinct prompts' once, each completion's own after them.

    Shapes: ``prefix_keys``/``prefix_values`` ``[prompts, kv_heads, width, head_dim]`` (left-padded
    prompts, written by the prefill); the completions' buffers ``[rows, kv_heads, max_new_tokens,
    head_dim]``, of which :meth:`update` returns the written views ``[rows, kv_heads, t, head_dim]``.
    """

    def __init__(self, max_new_tokens: int):
        super().__init__()
        self.max_new_tokens = max_new_tokens
        self.width = 0
        self.written = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:  # the prefill: the distinct prompts
            self.device = key_states.device
            self.prefix_keys, self.prefix_values = key_states, value_states
            self.width = key_states.shape[-2]
            self.is_initialized = True
            self.keys, self.values = key_states, value_states
            return key_states, value_states
        if self.written == 0:
            rows, heads, _, dim = key_states.shape
            self._k = key_states.new_empty(rows, heads, self.max_new_tokens, dim)
            self._v = value_states.new_empty(rows, value_states.shape[1], self.max_new_tokens, dim)
        end = self.written + key_states.shape[-2]
        self._k[:, :, self.written : end] = key_states
        self._v[:, :, self.written : end] = value_states
        self.written = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.width + self.written

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.written:
            self._k, self._v = self._k.index_select(0, indices), self._v.index_select(0, indices)
            self.keys, self.values = self._k[:, :, : self.written], self._v[:, :, : self.written]


def _shared_prefix_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA, except a decode step of :func:`sample_completions` (``shared_prefix`` given, one query):
    there the prompt's keys and values are read once per distinct prompt.

    Shapes: ``query`` ``[rows, heads, 1, head_dim]``; ``key``/``value`` the completions' own
    ``[rows, kv_heads, t, head_dim]``; the step's additive mask ``bias`` ``[rows * share, width + t]``
    (0, or -inf at a prompt's left padding; ``share`` = query heads per key/value head). Returns
    ``[rows, 1, heads, head_dim]`` as SDPA's path does. The work is laid out ``[kv_heads, rows * share,
    ...]`` so that one prompt's rows are one slice: two matrix products a prompt, none a row.
    """

    shared = kwargs.pop("shared_prefix", None)
    if shared is None or query.shape[2] != 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    layers, groups, bias = shared
    layer = layers[module.layer_idx]
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    share = heads // kv_heads
    width = layer.width
    scale = scaling if scaling is not None else dim**-0.5
    # [rows, heads, 1, dim] -> [kv_heads, rows * share, dim] (query head h reads key/value head h // share)
    q = (
        (query.reshape(rows, kv_heads, share, dim) * scale)
        .transpose(0, 1)
        .reshape(kv_heads, rows * share, dim)
    )
    scores = q.new_empty(kv_heads, rows * share, width + key.shape[2])
    for prompt, start, end in groups:
        torch.matmul(
            q[:, start * share : end * share], layer.prefix_keys[prompt].transpose(-1, -2),
            out=scores[:, start * share : end * share, :width],
        )  # fmt: skip
    own = torch.matmul(q.view(kv_heads, rows, share, dim).transpose(0, 1), key.transpose(-1, -2))
    scores[..., width:] = own.transpose(0, 1).reshape(kv_heads, rows * share, -1)
    scores += bias
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs[..., width:].reshape(kv_heads, rows, share, -1).transpose(0, 1), value)
    out = out.transpose(0, 1).reshape(kv_heads, rows * share, dim)
    for prompt, start, end in groups:
        rows_of_prompt = slice(start * share, end * share)
        out[:, rows_of_prompt] += torch.matmul(probs[:, rows_of_prompt, :width], layer.prefix_values[prompt])
    return out.view(kv_heads, rows, share, dim).permute(1, 0, 2, 3).reshape(rows, 1, heads, dim), None


AttentionInterface.register(ATTENTION, _shared_prefix_attention)


@contextmanager
def _attention(model, name: str) -> Iterator[None]:
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def covers(generation_kwargs: dict) -> bool:
    """Whether :func:`sample_completions` samples exactly as ``generate`` would with ``generation_kwargs``
    (TRL's GRPO generation settings): no repetition penalty, no min-p, no setting it does not know."""

    known = {
        "max_new_tokens",
        "do_sample",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "cache_implementation",
    }
    if set(generation_kwargs) - known:
        return False
    if generation_kwargs.get("min_p") not in (None, 0, 0.0):
        return False
    return generation_kwargs.get("repetition_penalty") in (None, 1, 1.0)


def processed_logits(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float
) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` as transformers' samplers leave them: divided by the temperature, then
    top-k, then top-p (nucleus), a dropped token at ``-inf``."""

    if temperature != 1.0:
        logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # as transformers' TopPLogitsWarper: drop the tokens whose ascending cumulative probability
        # is at most 1 - top_p, always keeping the most likely one
        sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - top_p)
        drop_sorted[..., -1:] = False
        logits = logits.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    return logits


def _next_tokens(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int | None, top_p: float):
    """One token a row of ``logits`` ``[rows, vocab]`` (float32): argmax, or a draw from the processed
    distribution (:func:`processed_logits`)."""

    if not do_sample:
        return logits.argmax(dim=-1)
    # inverse-CDF sampling, one uniform draw a row: torch.multinomial draws one exponential per
    # vocabulary entry, about a tenth of a decode step's time for a model this small
    cumulative = torch.softmax(processed_logits(logits, temperature, top_k, top_p), dim=-1).cumsum(dim=-1)
    u = torch.rand(logits.shape[0], 1, device=logits.device) * cumulative[:, -1:]
    return torch.searchsorted(cumulative, u).squeeze(1).clamp(max=logits.shape[-1] - 1)


def _bounds(prompt_of_row: torch.Tensor) -> list[tuple[int, int, int]]:
    """The decode batch's rows by prompt: ``(u, start, end)``, rows ``[start, end)`` continue distinct
    prompt ``u`` (rows stay sorted by prompt, so each prompt's rows are one slice; empty ones left out)."""
    bounds, start = [], 0
    for prompt, n in enumerate(torch.bincount(prompt_of_row).tolist()):
        if n:
            bounds.append((prompt, start, start + n))
            start += n
    return bounds


@torch.no_grad()
def sample_completions(
    model,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
) -> list[list[int]]:
    """One completion per prompt of ``prompt_ids`` (token ids; equal prompts share one prefill).

    Args:
        model: A transformers causal LM whose attention modules take ``layer_idx`` and an attention
            interface (Llama/Qwen2-style decoders), and whose forward takes ``cache``, ``position_ids``,
            a 4-D boolean ``attention_mask`` and ``logits_to_keep``. The mode is left as it is (as
            ``generate`` leaves it); the call runs under ``torch.no_grad``.
        prompt_ids: One token-id list per completion wanted; equal lists are run through the model once.
        max_new_tokens: The most tokens a completion has.
        eos_token_ids: Tokens that end a completion (the token is kept, as ``generate`` keeps it).
        pad_token_id: Pads the distinct prompts on the left for the prefill.
        do_sample, temperature, top_k, top_p: As in ``transformers.GenerationConfig``.

    Returns:
        The completions' token ids, in the order of ``prompt_ids``, each ending at its first
        end-of-sequence token or at ``max_new_tokens``.
    """

    if not prompt_ids:
        return []
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if min(len(p) for p in prompt_ids) == 0:
        raise ValueError("every prompt needs at least one token")
    device = model.device
    distinct: dict[tuple[int, ...], int] = {}
    prompt_of = [distinct.setdefault(tuple(p), len(distinct)) for p in prompt_ids]
    prompts = list(distinct)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device=device)
    seen = torch.zeros((len(prompts), width + max_new_tokens), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long, device=device)
        seen[i, width - len(p) : width] = True
    position = (seen[:, :width].long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
    # a padding position attends to itself too, so no row of the softmax is empty
    prefill_mask = (causal[None, None] & seen[:, None, None, :width]) | torch.eye(width, dtype=torch.bool)

    text_config = model.config.get_text_config()
    share = text_config.num_attention_heads // text_config.num_key_value_heads
    layers = [_SharedPrefixLayer(max_new_tokens) for _ in range(text_config.num_hidden_layers)]
    cache = Cache(layers=layers)
    out = model(
        input_ids=ids, attention_mask=prefill_mask, position_ids=position, cache=cache, logits_to_keep=1
    )

    # the decode batch: rows sorted by prompt (stable), so each prompt's rows are one slice
    order = sorted(range(len(prompt_ids)), key=prompt_of.__getitem__)
    prompt_of_row = torch.tensor([prompt_of[i] for i in order], device=device)
    rows = torch.tensor(order, device=device)
    logits = out.logits[:, -1].float().index_select(0, prompt_of_row)
    seen = seen.index_select(0, prompt_of_row)
    position = position[:, -1].index_select(0, prompt_of_row)
    groups = _bounds(prompt_of_row)

    eos = torch.tensor(list(eos_token_ids), device=device)
    written = torch.full((len(prompt_ids), max_new_tokens), pad_token_id, dtype=torch.long)
    lengths = torch.zeros(len(prompt_ids), dtype=torch.long)
    with _attention(model, ATTENTION):
        for step in range(max_new_tokens):
            tokens = _next_tokens(logits, do_sample, temperature, top_k, top_p)
            written[rows.cpu(), step] = tokens.cpu()
            lengths[rows.cpu()] = step + 1
            going = ~torch.isin(tokens, eos)
            if step == max_new_tokens - 1 or not bool(going.any()):
                break
            if not bool(going.all()):
                keep = going.nonzero().squeeze(1)
                rows, tokens, seen, position = rows[keep], tokens[keep], seen[keep], position[keep]
                prompt_of_row = prompt_of_row[keep]
                groups = _bounds(prompt_of_row)
                cache.batch_select_indices(keep)
            seen[:, width + step] = True
            position = position + 1
            visible = seen[:, : width + step + 1]
            bias = torch.zeros(visible.shape, dtype=logits.dtype, device=device).masked_fill_(
                ~visible, float("-inf")
            )
            bias = bias.repeat_interleave(share, dim=0)
            out = model(
                input_ids=tokens[:, None],
                attention_mask=seen[:, None, None, : width + step + 1],
                position_ids=position[:, None],
                cache=cache,
                logits_to_keep=1,
                shared_prefix=(layers, groups, bias),
            )
            logits = out.logits[:, -1].float()
    return [written[i, : lengths[i]].tolist() for i in range(len(prompt_ids))]
