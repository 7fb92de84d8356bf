"""Tests of orthojob.modeling.tiny_model: offline tiny Qwen2 model + tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from orthojob.modeling.tiny_model import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    build_tiny_model,
    builtin_corpus,
    main,
    train_tokenizer,
)

PLAN = (
    '{"strategy": "expansion_first", "tooth_groups": [{"teeth": [14, 15, 24, 25], "fraction": 0.08, '
    '"priority": "high"}, {"teeth": [11, 12, 21, 22], "fraction": 0.06, "priority": "medium"}]}'
)
PROMPT = (
    "Case summary:\n  overjet: +4.20 mm\n  overbite: -1.05 mm\n  crowding_upper: +3.10 mm\n"
    "  FDI 11: dist=1.23mm  d=(+0.12,-0.50,+0.03)  prog=0%\n"
    "  FDI 47: dist=0.00mm  d=(-0.00,+0.00,-1.99)  prog=100%\n"
)
ODD = "Ünïcode café e\u0301 — tabs\tand\r\nCRLF  unseen_word_xyz 12345678901234567890"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_saved_files_and_config(tiny_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_dir / name).is_file(), name
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert type(tok).__name__ == "Qwen2Tokenizer"
    assert config["vocab_size"] == len(tok)
    assert 259 < len(tok) <= 512
    assert config["eos_token_id"] == tok.convert_tokens_to_ids(IM_END)
    assert config["pad_token_id"] == tok.convert_tokens_to_ids(ENDOFTEXT)
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids(IM_END) in generation["eos_token_id"]
    assert generation["pad_token_id"] == tok.pad_token_id


def test_special_tokens(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert tok.eos_token == IM_END
    assert tok.pad_token == ENDOFTEXT
    assert tok.bos_token is None
    ids = [tok.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_START, IM_END)]
    assert ids == [0, 1, 2]
    # Each special token encodes as a single id, never split by BPE.
    assert tok.encode(f"{IM_START}user\nhi{IM_END}")[0] == ids[1]
    assert tok.encode(f"{IM_START}user\nhi{IM_END}")[-1] == ids[2]


@pytest.mark.parametrize("text", [PLAN, PROMPT, ODD, PROMPT + PLAN])
def test_token_ids_survive_reload(tiny_dir: Path, text: str) -> None:
    before = train_tokenizer(builtin_corpus())
    after = AutoTokenizer.from_pretrained(tiny_dir)
    ids = before.encode(text)
    assert ids == after.encode(text)
    assert after.decode(ids) == after.backend_tokenizer.normalizer.normalize_str(text)


def test_in_memory_tokenizer_matches_raw_bpe_pipeline(tiny_dir: Path) -> None:
    after = AutoTokenizer.from_pretrained(tiny_dir)
    pre = after.backend_tokenizer.pre_tokenizer.pre_tokenize_str("FDI 11: dist=1.23mm")
    # Qwen's split regex isolates single digits.
    assert [piece for piece, _ in pre][:4] == ["FDI", "Ġ", "1", "1"]
    assert len(after.encode(PLAN)) < len(PLAN.encode()) * 0.7  # merges learned on plan text


def test_chat_template_renders(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert tok.chat_template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "You plan."}, {"role": "user", "content": PROMPT}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"{IM_START}system\nYou plan.{IM_END}\n{IM_START}user\n{PROMPT}{IM_END}\n{IM_START}assistant\n"
    )
    full = tok.apply_chat_template(
        [*messages, {"role": "assistant", "content": PLAN}],
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    masked = [i for i, m in zip(full["input_ids"], full["assistant_masks"], strict=True) if m]
    assert tok.decode(masked) == PLAN + IM_END + "\n"


def test_generate_on_cpu(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.eval()
    enc = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    torch.manual_seed(0)
    out = model.generate(**enc, max_new_tokens=6, do_sample=True, min_new_tokens=6)
    new = out[0, enc["input_ids"].shape[1] :]
    assert new.shape[0] == 6
    assert int(new.max()) < len(tok)
    assert isinstance(tok.decode(new, skip_special_tokens=True), str)


def test_parameter_count_below_2m(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    n = sum(p.numel() for p in model.parameters())
    assert 50_000 < n < 2_000_000


def test_same_seed_same_weights_and_tokenizer(tmp_path: Path, tiny_dir: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    a = AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(again).state_dict()
    c = AutoModelForCausalLM.from_pretrained(other).state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert (tiny_dir / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert (tiny_dir / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_extra_corpus_and_main(tmp_path: Path) -> None:
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text("zygomatic_anchorage " * 50 + "\n", encoding="utf-8")
    assert (
        main(
            [
                "--out",
                str(tmp_path / "cli"),
                "--seed",
                "3",
                "--vocab-size",
                "1024",
                "--corpus",
                str(corpus_file),
            ]
        )
        == 0
    )
    tok = AutoTokenizer.from_pretrained(tmp_path / "cli")
    assert "zygomatic" in tok.get_vocab()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "cli")
    assert model.config.vocab_size == len(tok) > 512


def test_rejects_bad_shapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        build_tiny_model(tmp_path / "bad", hidden_size=64, heads=5)
    with pytest.raises(ValueError):
        build_tiny_model(tmp_path / "bad", vocab_size=100)
