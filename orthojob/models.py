"""Loading policies and checkpoints, the offline tiny model, and checkpoint digests.

Which loader (:func:`load_policy`, for training):

* **Unsloth** ``FastLanguageModel`` in 4-bit, when ``unsloth`` imports *and* a CUDA GPU is present
  (and LoRA is asked for: ``lora_r > 0``);
* else **transformers + PEFT LoRA** (``lora_r > 0``): QLoRA (bitsandbytes 4-bit NF4) only on a CUDA
  GPU with bitsandbytes installed, plain LoRA otherwise (always on CPU);
* else (``lora_r == 0``, e.g. the tiny model) **full fine-tuning** of every weight.

dtype: bfloat16 only where the GPU supports it (:func:`device_info`), float32 everywhere else (never
bf16 on CPU). A ``checkpoint`` (an SFT output folder) is loaded instead of the base: a LoRA adapter
folder (``adapter_config.json``) is put back on its base model and stays trainable; a full model
folder is loaded as the model. The tokenizer always comes from the checkpoint when there is one.

Base models may be hub ids, folders or ``s3://`` URIs (:mod:`orthojob.base_models`: fetched once
into the model cache, verified, then loaded from there). A LoRA adapter records the *reference*
it was trained from (the ``s3://`` URI, not the pod-local folder) as its ``base_model_name_or_path``
(:func:`record_base`), and every loader here resolves that reference again: a fresh pod with an
empty cache fetches the base from S3.

:func:`load_for_inference` loads any checkpoint (full model or adapter) for greedy generation.

:func:`checkpoint_digest` is the sha256 the gate files record (:mod:`orthojob.gate`): over the
checkpoint folder's top-level weight files (:data:`WEIGHT_SUFFIXES`) and config/tokenizer files
(:data:`CONFIG_FILES`), sorted by name, each as ``name, size, bytes``. Files a run writes beside the
weights (the gate file, logs, ``training_args.bin``, ``MANIFEST.json``) are not part of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orthojob.base_models import reference
from orthojob.base_models import resolve as resolve_base
from orthojob.storage import is_s3_uri

log = logging.getLogger(__name__)

TINY_MODEL = "tiny"
"""Model name meaning: build the offline tiny Qwen2 model (:mod:`orthojob.tiny_model`)."""
LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHT_SUFFIXES: tuple[str, ...] = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_FILES: frozenset[str] = frozenset(
    {
        "config.json",
        "generation_config.json",
        "adapter_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
    }
)
NOT_WEIGHTS: frozenset[str] = frozenset(
    {"training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth"}
)
"""Files with a weight suffix that are not weights (Trainer state); never part of the digest."""


class ModelError(RuntimeError):
    """A checkpoint or model that cannot be loaded or digested; the message says what is wrong."""


# ---------------------------------------------------------------------------------------------
# Hardware
# ---------------------------------------------------------------------------------------------


def device_info() -> dict:
    """``{"cuda": bool, "bf16": bool, "unsloth": bool}``: bf16 only on a GPU that has it."""
    import torch

    cuda = bool(torch.cuda.is_available())
    return {
        "cuda": cuda,
        "bf16": bool(cuda and torch.cuda.is_bf16_supported()),
        "unsloth": cuda and _unsloth(),
    }


def _unsloth() -> bool:
    try:
        import unsloth  # noqa: F401  (imported before transformers/TRL where possible; it patches them)
    except Exception as exc:  # not installed, or no usable GPU
        log.info("Unsloth not available: %s", exc)
        return False
    return True


def _bitsandbytes() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except Exception:
        return False
    return True


def _dtype(devices: dict):
    import torch

    return torch.bfloat16 if devices["bf16"] else torch.float32


# ---------------------------------------------------------------------------------------------
# Checkpoint folders
# ---------------------------------------------------------------------------------------------


def is_adapter(path: str | Path) -> bool:
    """Whether ``path`` is a PEFT adapter folder (``adapter_config.json``), not a full model."""
    return (Path(path) / "adapter_config.json").is_file()


def adapter_base(path: str | Path) -> str:
    """The base model an adapter folder was trained on (``base_model_name_or_path``)."""
    try:
        cfg = json.loads((Path(path) / "adapter_config.json").read_text())
        base = cfg["base_model_name_or_path"]
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"{path}/adapter_config.json is unreadable or names no base model: {exc}") from None
    if not isinstance(base, str) or not base:
        raise ModelError(f"{path}/adapter_config.json names no base model (base_model_name_or_path)")
    return base


def checkpoint_files(path: str | Path) -> list[Path]:
    """The files :func:`checkpoint_digest` covers, sorted by name (top level of the folder only)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelError(f"checkpoint folder {folder} does not exist")
    files = sorted(
        (
            p
            for p in folder.iterdir()
            if p.is_file()
            and p.name not in NOT_WEIGHTS
            and (p.name in CONFIG_FILES or p.name.endswith(WEIGHT_SUFFIXES))
        ),
        key=lambda p: p.name,
    )
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in files):
        raise ModelError(
            f"checkpoint folder {folder} holds no weight files ({', '.join(WEIGHT_SUFFIXES)}): "
            "is this the output folder of orthojob sft / train?"
        )
    return files


def checkpoint_digest(path: str | Path) -> str:
    """sha256 over the checkpoint's weight and config files (see the module docstring)."""
    h = hashlib.sha256()
    for file in checkpoint_files(path):
        h.update(file.name.encode())
        h.update(b"\0")
        h.update(str(file.stat().st_size).encode())
        h.update(b"\0")
        with file.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# The tiny model
# ---------------------------------------------------------------------------------------------


def tiny_corpus(task_ids: Sequence[str], force_decay: bool = False, n_per_task: int = 30) -> list[str]:
    """Tokenizer corpus for the tiny model: real prompts and oracle plans of *training* seeds.

    With it the BPE learns the prompt's wording (a 1k vocabulary cuts a prompt from ~2,200 to
    ~1,450 tokens); held-out seeds are never used.
    """
    from orthojob.prompts import SYSTEM_PROMPT, TRAIN_SEED_START, plan_to_completion, prompt_cases
    from server.oracle import oracle_plan

    corpus = [SYSTEM_PROMPT]
    for task_id in task_ids:
        for decay in sorted({False, bool(force_decay)}):
            for row, obs in prompt_cases(n_per_task, TRAIN_SEED_START, task_id, decay):
                corpus.append(row["prompt"][-1]["content"])
                corpus.append(plan_to_completion(oracle_plan(obs)))
    return corpus


def build_tiny(
    out_dir: str | Path,
    task_ids: Sequence[str],
    force_decay: bool = False,
    prompt_format: str = "full",
    corpus: Sequence[str] | None = None,
    **arch: Any,
) -> Path:
    """Build the offline tiny Qwen2 model with a tokenizer trained on the project's prompts.

    ``arch``: :func:`orthojob.tiny_model.build_tiny_model` keywords (``hidden_size``, ``layers``,
    ``vocab_size``, ``max_position_embeddings``, ``seed``, ...). ``prompt_format``: the prompt format
    the model is trained and evaluated with (:data:`orthojob.prompts.PROMPT_FORMATS`, recorded in its
    ``config.json``). ``corpus``: the tokenizer's training texts (default :func:`tiny_corpus`).
    """
    from orthojob.prompts import check_prompt_format, set_prompt_format
    from orthojob.tiny_model import build_tiny_model

    check_prompt_format(prompt_format)
    arch = {"vocab_size": 1024, **arch}
    corpus = tiny_corpus(task_ids, force_decay) if corpus is None else corpus
    path = build_tiny_model(out_dir, corpus=corpus, **arch)
    if prompt_format != "full":
        set_prompt_format(path, prompt_format)
    return path


def ensure_tiny(out_dir: str | Path, task_ids: Sequence[str], force_decay: bool = False, **arch: Any) -> Path:
    """``out_dir`` holding the tiny model: :func:`build_tiny` unless ``out_dir/config.json`` exists."""
    path = Path(out_dir)
    if not (path / "config.json").is_file():
        build_tiny(path, task_ids, force_decay, **arch)
    return path


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def lora_config(lora_r: int, lora_alpha: int | None = None, dropout: float = 0.0):
    """PEFT LoRA on every attention and MLP projection (the Unsloth Qwen2.5 GRPO recipe)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora_r,
        lora_alpha=lora_alpha or 2 * lora_r,
        lora_dropout=dropout,
        target_modules=list(LORA_TARGETS),
        task_type="CAUSAL_LM",
    )


def record_base(model, base_ref: str) -> None:
    """Make every PEFT adapter config of ``model`` name ``base_ref`` (an ``s3://`` URI, hub id or
    absolute folder: :func:`orthojob.base_models.reference`) as its base, so that every adapter
    saved from it (final and ``checkpoint-N``) resolves in another pod. No-op for a full model."""
    for cfg in (getattr(model, "peft_config", None) or {}).values():
        cfg.base_model_name_or_path = base_ref


def _localized_adapter(checkpoint: str, local_base: str) -> str:
    """A copy of an adapter folder whose config names ``local_base`` (links to its other files):
    for loaders that read the base from the adapter config themselves (Unsloth)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="orthorl-adapter-"))
    for item in Path(checkpoint).iterdir():
        if item.name != "adapter_config.json":
            (folder / item.name).symlink_to(item.resolve())
    cfg = json.loads((Path(checkpoint) / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = local_base
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return str(folder)


def _load_unsloth(
    model_path: str,
    checkpoint: str | None,
    lora_r: int,
    lora_alpha: int | None,
    max_seq_length: int,
    use_vllm: bool,
):
    from unsloth import FastLanguageModel

    adapter = bool(checkpoint and is_adapter(checkpoint))
    base_ref = adapter_base(checkpoint) if adapter else reference(checkpoint or model_path)
    local_base = resolve_base(base_ref)
    source = checkpoint or local_base
    if adapter and local_base != base_ref:  # Unsloth reads the adapter's base itself: name the local copy
        source = _localized_adapter(checkpoint, local_base)
    model, tok = FastLanguageModel.from_pretrained(
        model_name=source,
        max_seq_length=max_seq_length,
        load_in_4bit=True,
        fast_inference=use_vllm,
    )
    if not adapter:  # an adapter checkpoint comes back with its LoRA
        model = FastLanguageModel.get_peft_model(
            model,
            r=lora_r,
            lora_alpha=lora_alpha or 2 * lora_r,
            lora_dropout=0.0,
            target_modules=list(LORA_TARGETS),
            use_gradient_checkpointing="unsloth",
        )
    record_base(model, base_ref)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def load_policy(
    model_path: str,
    checkpoint: str | None = None,
    lora_r: int = 16,
    max_seq_length: int = 2048,
    use_vllm: bool = False,
    lora_alpha: int | None = None,
):
    """(model, tokenizer) ready to train; see the module docstring for which loader is used.

    Args:
        model_path: hub id, folder or ``s3://`` URI of the base model (:mod:`orthojob.base_models`).
        checkpoint: an earlier stage's output folder to start from (adapter or full model).
        lora_r: LoRA rank; 0 = full fine-tuning.
        max_seq_length: prompt + completion budget (Unsloth sizes its kernels with it).
        use_vllm: Unsloth's fast_inference (vLLM colocated), GPU only.
        lora_alpha: LoRA alpha (default 2 x rank).
    """
    devices = device_info()  # imports Unsloth (on a GPU) before transformers
    from transformers import AutoModelForCausalLM

    if lora_r > 0 and devices["unsloth"]:
        log.info("loading %s with Unsloth (4-bit, LoRA r=%d)", checkpoint or model_path, lora_r)
        return _load_unsloth(model_path, checkpoint, lora_r, lora_alpha, max_seq_length, use_vllm)

    dtype = _dtype(devices)
    adapter = bool(checkpoint and is_adapter(checkpoint))
    base_ref = adapter_base(checkpoint) if adapter else reference(checkpoint or model_path)
    base = resolve_base(base_ref)  # an s3:// base: fetched once into the model cache
    tok = _tokenizer(checkpoint or base)
    qlora = bool(lora_r > 0 or adapter) and devices["cuda"] and _bitsandbytes()
    kwargs: dict[str, Any] = {"dtype": dtype}
    if qlora:
        import torch
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16 if devices["bf16"] else torch.float16,
        )
        kwargs["device_map"] = {"": 0}
    model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
    if qlora:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    if (adapter or lora_r > 0) and not qlora:
        model.enable_input_require_grads()  # LoRA under gradient checkpointing needs grads at the inputs
    if adapter:
        from peft import PeftModel

        log.info("continuing LoRA adapter %s on %s", checkpoint, base)
        model = PeftModel.from_pretrained(model, checkpoint, is_trainable=True)
    elif lora_r > 0:
        from peft import get_peft_model

        log.info("LoRA r=%d on %s (%s)", lora_r, base, "QLoRA 4-bit" if qlora else str(dtype))
        model = get_peft_model(model, lora_config(lora_r, lora_alpha))
    else:
        log.info("full fine-tuning of %s (%s)", base, dtype)
    record_base(model, base_ref)  # adapters name the reference, never the cache folder
    return model, tok


def load_for_inference(path: str | Path, device: str | None = None):
    """(model, tokenizer) of any checkpoint folder (full model, or LoRA adapter merged onto its base),
    in eval mode on ``device`` (default: the GPU if there is one, else the CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = str(path)
    if is_s3_uri(path):  # a base model in S3 (the pipeline's evaluation of the untrained base)
        path = resolve_base(path)
    if not Path(path).is_dir() and (path.startswith((".", "/", "~")) or path.count("/") != 1):
        raise ModelError(f"checkpoint folder {path} does not exist (and it is no hub id owner/name)")
    devices = device_info()
    device = device or ("cuda" if devices["cuda"] else "cpu")
    dtype = _dtype(devices) if device.startswith("cuda") else torch.float32
    tok = _tokenizer(path)
    if is_adapter(path):
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(resolve_base(adapter_base(path)), dtype=dtype)
        model = PeftModel.from_pretrained(base, path).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.to(device)
    model.eval()
    return model, tok


def count_parameters(model) -> dict:
    """``{"total": n, "trainable": n}``."""
    params = list(model.parameters())
    return {
        "total": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
    }


__all__ = [
    "CONFIG_FILES",
    "LORA_TARGETS",
    "NOT_WEIGHTS",
    "TINY_MODEL",
    "WEIGHT_SUFFIXES",
    "ModelError",
    "adapter_base",
    "build_tiny",
    "checkpoint_digest",
    "checkpoint_files",
    "count_parameters",
    "device_info",
    "ensure_tiny",
    "is_adapter",
    "load_for_inference",
    "load_policy",
    "lora_config",
    "record_base",
    "tiny_corpus",
]
