"""Build a tiny, randomly initialised Qwen2-architecture chat model fully offline.

The model is meant for tests, smoke runs and CPU probes of the GRPO/SFT pipeline: it has the same
architecture, tokenizer class and chat format as a real Qwen2 chat model, but about 0.14M parameters with the
defaults and a byte-level BPE vocabulary of at most ``vocab_size`` (512) tokens trained on a built-in corpus of treatment-plan
JSON and prompt text. Nothing is downloaded.

Tokenizer compatibility: ``AutoTokenizer`` loads ``Qwen2Tokenizer`` for this directory, and
``Qwen2Tokenizer`` always installs Qwen's split regex, NFC normalisation and a byte-level
pre-tokenizer/decoder. The BPE here is trained with exactly that pipeline, and the saved tokenizer is
built through ``Qwen2Tokenizer`` itself, so token ids are identical before saving and after reloading.

Example::

    from orthojob.modeling.tiny_model import build_tiny_model

    path = build_tiny_model("/tmp/tiny-qwen2", seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.tokenization_qwen2 import (
    PRETOKENIZE_REGEX,
    Qwen2Tokenizer,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CHAT_TEMPLATE",
    "ENDOFTEXT",
    "IM_END",
    "IM_START",
    "SPECIAL_TOKENS",
    "STRATEGY_NAMES",
    "build_tiny_model",
    "builtin_corpus",
    "main",
    "train_tokenizer",
]

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
"""Special tokens; they get ids 0, 1, 2 in this order."""

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endgeneration %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
"""Qwen-style ChatML template (no default system prompt). The assistant turn, including its
``<|im_end|>``, is wrapped in ``{% generation %}`` markers so SFT ``assistant_only_loss`` works."""

STRATEGY_NAMES: tuple[str, ...] = (
    "expansion_first",
    "distalization_first",
    "ipr_first",
    "anterior_first",
    "posterior_first",
    "leveling_first",
    "intrusion_first",
    "simultaneous",
    "staged",
)
"""Strategy names seen by the tokenizer trainer (unknown names still encode, byte-level)."""

_FDI_IDS: tuple[int, ...] = (*range(11, 18), *range(21, 28), *range(31, 38), *range(41, 48))
_PRIORITIES: tuple[str, ...] = ("high", "medium", "low")
_TASK_IDS: tuple[str, ...] = ("task_easy", "task_medium", "task_hard")
_WORDS: tuple[str, ...] = (
    "You are an orthodontic treatment planner for clear aligner therapy.",
    "Plan the staging of tooth movements over 24 aligner stages.",
    "Respond with a single JSON object with the keys strategy and tooth_groups.",
    "Each group lists FDI tooth ids, the fraction of the remaining movement per stage, and a priority.",
    "Priority high starts at stage 1, medium at stage 7, low at stage 13.",
    "Case summary:",
    "Teeth (distance to target, displacement dx dy dz, progress):",
    "upper lower left right arch anterior posterior incisor canine premolar molar",
    "translation rotation torque tip intrusion extrusion expansion distalization",
    "collision collisions violations reward stage stages remaining current target initial",
    "Angle class I II III molar relation midline shift spacing curve of Spee Bolton",
    "force decay interproximal reduction attachment",
)
_SUMMARY_KEYS: tuple[str, ...] = (
    "overjet",
    "overbite",
    "crowding_upper",
    "crowding_lower",
    "spacing_upper",
    "spacing_lower",
    "midline_shift",
    "molar_class",
    "curve_of_spee",
    "max_translation",
    "max_rotation",
)


def _plan_text(rng: random.Random) -> str:
    """One random plan as compact JSON, in the format the policy must produce."""
    teeth = list(_FDI_IDS)
    rng.shuffle(teeth)
    groups = []
    start = 0
    for _ in range(rng.randint(1, 4)):
        size = rng.randint(1, 6)
        groups.append(
            {
                "teeth": sorted(teeth[start : start + size]),
                "fraction": round(rng.uniform(0.01, 0.2), 2),
                "priority": rng.choice(_PRIORITIES),
            }
        )
        start += size
    plan = {"strategy": rng.choice(STRATEGY_NAMES), "tooth_groups": groups}
    return json.dumps(plan) if rng.random() < 0.8 else json.dumps(plan, indent=2)


def _prompt_text(rng: random.Random) -> str:
    """One random prompt-like text: header, case summary and per-tooth lines."""
    lines = [rng.choice(_WORDS[:5]), f"Task: {rng.choice(_TASK_IDS)}  seed={rng.randint(0, 9999)}"]
    lines.append("Case summary:")
    for key in rng.sample(_SUMMARY_KEYS, k=rng.randint(3, len(_SUMMARY_KEYS))):
        lines.append(f"  {key}: {rng.uniform(-6.0, 6.0):+.2f} mm")
    lines.append(f"Stage {rng.randint(0, 24)} of 24, stages_remaining={rng.randint(0, 24)}")
    lines.append(_WORDS[6])
    for fdi in rng.sample(_FDI_IDS, k=rng.randint(4, 10)):
        d = ",".join(f"{rng.uniform(-2.5, 2.5):+.2f}" for _ in range(3))
        lines.append(
            f"  FDI {fdi}: dist={rng.uniform(0.0, 5.5):.2f}mm  d=({d})  "
            f"rot={rng.uniform(0.0, 40.0):.1f}deg  prog={rng.randint(0, 100)}%"
        )
    lines.append(rng.choice(_WORDS[5:]))
    return "\n".join(lines)


def builtin_corpus(n_docs: int = 400, seed: int = 1234) -> list[str]:
    """Deterministic training corpus for the tokenizer: plan JSON, prompt text and vocabulary lines.

    The corpus does not depend on the model seed, so every tiny model shares one tokenizer.
    """
    rng = random.Random(seed)
    docs: list[str] = list(_WORDS)
    docs.append(" ".join(STRATEGY_NAMES + _PRIORITIES + _TASK_IDS + _SUMMARY_KEYS))
    docs.append(" ".join(str(fdi) for fdi in _FDI_IDS) + " 0123456789 +-.,:;=%()[]{}\"'")
    for _ in range(n_docs):
        docs.append(_plan_text(rng))
        docs.append(_prompt_text(rng))
        msgs = [{"role": "user", "content": docs[-1]}, {"role": "assistant", "content": docs[-2]}]
        docs.append("".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in msgs))
    return docs


def _qwen2_pipeline_tokenizer() -> Tokenizer:
    """An empty BPE ``Tokenizer`` with exactly the normaliser/pre-tokenizer/decoder of ``Qwen2Tokenizer``."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(
    texts: Iterable[str], *, vocab_size: int = 512, model_max_length: int = 2048
) -> Qwen2Tokenizer:
    """Train a byte-level BPE on ``texts`` and wrap it as a ``Qwen2Tokenizer`` with the chat template.

    ``vocab_size`` is an upper bound (special tokens and the 256-byte alphabet included); a small corpus
    may run out of merges first. eos is ``<|im_end|>`` (end of a chat turn), pad/unk ``<|endoftext|>``.
    """
    min_size = len(SPECIAL_TOKENS) + 256
    if vocab_size < min_size:
        raise ValueError(
            f"vocab_size must be at least {min_size} (specials + byte alphabet), got {vocab_size}"
        )
    raw = _qwen2_pipeline_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(texts, trainer)
    state = json.loads(raw.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["model"]["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=ENDOFTEXT,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    probe = _plan_text(random.Random(0)) + "\n" + _prompt_text(random.Random(0))
    if raw.encode(probe).ids != tokenizer.encode(probe):
        raise RuntimeError("Qwen2Tokenizer pipeline diverged from the trained BPE pipeline")
    return tokenizer


def build_tiny_model(
    out_dir: str | Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    corpus: Iterable[str] | None = None,
) -> Path:
    """Build and save a random Qwen2 causal LM plus a trained BPE tokenizer into ``out_dir``.

    Args:
        out_dir: Target directory (created if missing; existing files are overwritten).
        vocab_size: Upper bound on the tokenizer vocabulary (specials and 256 bytes included). The model's
            ``vocab_size`` equals the trained tokenizer's length, which may be smaller.
        hidden_size: Model width; must be divisible by ``heads``.
        layers: Number of decoder layers.
        heads: Attention heads; must be divisible by ``kv_heads``.
        kv_heads: Key/value heads (grouped-query attention).
        intermediate: MLP width.
        max_position_embeddings: Context length (also the tokenizer's ``model_max_length``).
        seed: Seed of the weight initialisation; the tokenizer does not depend on it.
        corpus: Extra texts (e.g. real prompts and plans) added to the built-in tokenizer corpus.

    Returns:
        The directory, loadable with ``AutoTokenizer.from_pretrained`` and
        ``AutoModelForCausalLM.from_pretrained``.
    """
    if hidden_size % heads or heads % kv_heads:
        raise ValueError(
            f"need hidden_size % heads == 0 and heads % kv_heads == 0, got {hidden_size}/{heads}/{kv_heads}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    texts = builtin_corpus()
    if corpus is not None:
        texts.extend(corpus)
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size, model_max_length=max_position_embeddings)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=im_end_id,
        pad_token_id=pad_id,
        use_cache=True,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=None,
        eos_token_id=[im_end_id, pad_id],
        pad_token_id=pad_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("saved tiny Qwen2 model (%d params, vocab %d) to %s", n_params, len(tokenizer), out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: ``orthojob tiny-model --out DIR [--seed N] [--vocab-size N] [--corpus FILE ...]``.

    Each ``--corpus`` file is read as UTF-8 and added, line by line, to the tokenizer corpus.
    """
    parser = argparse.ArgumentParser(
        prog="orthojob tiny-model", description="Build a tiny random Qwen2 chat model and tokenizer offline."
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--max-position-embeddings", type=int, default=2048)
    parser.add_argument(
        "--corpus", action="append", default=[], help="extra text file for the tokenizer corpus"
    )
    args = parser.parse_args(argv)
    extra: list[str] = []
    for name in args.corpus:
        extra.extend(line for line in Path(name).read_text(encoding="utf-8").splitlines() if line.strip())
    path = build_tiny_model(
        args.out,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        max_position_embeddings=args.max_position_embeddings,
        seed=args.seed,
        corpus=extra or None,
    )
    logger.info("tiny model written to %s", path)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(main())
