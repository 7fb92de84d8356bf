"""Loading policies and checkpoints, the offline tiny model, and checkpoint digests.

Which loader (:func:`load_policy`, for training) is decided by one pure function,
:func:`choose_load_policy`, of (CUDA, world size, Unsloth importable, bitsandbytes importable, LoRA
rank of the preset, the ``ORTHORL_LOADER`` flag); docs/deploy.md has its table:

* ``lora_r == 0`` (e.g. the tiny model): **full fine-tuning** of every weight;
* no CUDA: **LoRA** in float32 on the CPU;
* several ranks (DDP or FSDP, ``WORLD_SIZE > 1``): **bf16 LoRA** on ``LOCAL_RANK``'s GPU, never
  4-bit, never Unsloth (Unsloth is not even imported);
* one GPU: **Unsloth** 4-bit when it imports; else (a WARNING naming the fallback) **QLoRA**
  (bitsandbytes 4-bit NF4) when bitsandbytes imports, else LoRA on unquantised weights;
* ``ORTHORL_LOADER=unsloth|qlora|lora`` forces one (refused with the reason where it cannot run).

dtype: bfloat16 only where the GPU supports it (:func:`device_info`), float32 everywhere else (never
bf16 on CPU). A ``checkpoint`` (an SFT output folder) is loaded instead of the base: a LoRA adapter
folder (``adapter_config.json``) is put back on its base model and stays trainable; a full model
folder is loaded as the model. The tokenizer always comes from the checkpoint when there is one.

Base models may be hub ids, folders or ``s3://`` URIs (:mod:`orthojob.modeling.base_models`: fetched once
into the model cache, verified, then loaded from there). A LoRA adapter records the *reference*
it was trained from, never the pod-local folder (:func:`record_base`): for an ``s3://`` base staged
from the model hub, the hub id as its ``base_model_name_or_path`` (what PEFT, MLflow and vLLM
resolve) with the URI and the staged files' digest beside it (``orthorl_base_uri``,
``orthorl_base_digest``). Every loader here resolves the recorded reference again
(:func:`adapter_base`): a fresh pod with an empty cache fetches the staged copy from S3.

:func:`load_for_inference` loads any checkpoint (full model or adapter) for greedy generation.

:func:`checkpoint_digest` is the sha256 the gate files record (:mod:`orthojob.stages.gate`): over the
checkpoint folder's top-level weight files (:data:`WEIGHT_SUFFIXES`) and config/tokenizer files
(:data:`CONFIG_FILES`), sorted by name, each as ``name, size, bytes``. Files a run writes beside the
weights (the gate file, logs, ``training_args.bin``, ``MANIFEST.json``) are not part of it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orthojob.core.prompts import (
    SYSTEM_PROMPT,
    TRAIN_SEED_START,
    check_prompt_format,
    plan_to_completion,
    prompt_cases,
    set_prompt_format,
)
from orthojob.modeling import base_models
from orthojob.modeling.adapters import (
    LORA_TARGETS,
    _localized_adapter,
    _quiet_base_record,
    adapter_config,
    load_adapter,
    lora_config,
    record_base,
)
from orthojob.modeling.base_models import reference
from orthojob.modeling.base_models import resolve as resolve_base
from orthojob.modeling.errors import ModelError
from orthojob.ops.storage import is_s3_uri
from server.oracle import oracle_plan

log = logging.getLogger(__name__)

TINY_MODEL = "tiny"
"""Model name meaning: build the offline tiny Qwen2 model (:mod:`orthojob.modeling.tiny_model`)."""
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


# ---------------------------------------------------------------------------------------------
# Hardware
# ---------------------------------------------------------------------------------------------


def device_info(lora_r: int = 16) -> dict:
    """``{"cuda": bool, "bf16": bool, "unsloth": bool}``: bf16 only on a GPU that has it; ``unsloth``:
    the load policy (:func:`load_policy_here`) takes Unsloth, which is then imported here, before
    transformers and TRL (it patches them). Never imported on CPU or with several ranks."""
    import torch

    cuda = bool(torch.cuda.is_available())
    unsloth = False
    if cuda:
        world_size, _ = distributed_env()
        loader = (os.environ.get(LOADER_ENV) or "auto").strip().lower()
        unsloth = wants_unsloth(cuda, world_size, lora_r, False, loader) and _unsloth() is True
    return {"cuda": cuda, "bf16": bool(cuda and torch.cuda.is_bf16_supported()), "unsloth": unsloth}


_UNSLOTH_PROBE: list[bool | str] = []


def _unsloth() -> bool | str:
    """True when Unsloth imports, else the import error's text (probed once per process)."""
    if not _UNSLOTH_PROBE:
        try:
            import unsloth  # noqa: F401  (imported before transformers/TRL where possible; it patches them)
        except Exception as exc:  # not installed, or no usable GPU
            _UNSLOTH_PROBE.append(f"{type(exc).__name__}: {exc}")
        else:
            _UNSLOTH_PROBE.append(True)
    return _UNSLOTH_PROBE[0]


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
# Load policy
# ---------------------------------------------------------------------------------------------

LOADER_ENV = "ORTHORL_LOADER"
"""Environment variable overriding the automatic choice: one of :data:`LOADERS`."""
LOADERS: tuple[str, ...] = ("auto", "unsloth", "qlora", "lora")
"""``auto`` (the table in docs/deploy.md), or one loader forced: ``unsloth`` (Unsloth 4-bit + LoRA,
one GPU), ``qlora`` (bitsandbytes 4-bit NF4 + LoRA, on ``LOCAL_RANK``'s GPU), ``lora`` (LoRA on
unquantised weights: bf16 where the GPU has it, else float32)."""


@dataclass(frozen=True)
class LoadPolicy:
    """How :func:`load_policy` loads the model: the outcome of :func:`choose_load_policy`.

    ``loader``: ``unsloth``, ``qlora``, ``lora`` or ``full`` (full fine-tuning, ``lora_r == 0``);
    ``device``: ``cpu`` or ``cuda:<LOCAL_RANK>``; ``reason``: why, in one line;
    ``warning``: a fallback the user should know about (logged as a WARNING), else None."""

    loader: str
    device: str
    reason: str
    warning: str | None = None

    @property
    def quantized(self) -> bool:
        return self.loader in ("unsloth", "qlora")

    @property
    def device_index(self) -> int | None:
        """The CUDA device index (``LOCAL_RANK``), None on CPU."""
        return int(self.device.split(":", 1)[1]) if self.device.startswith("cuda:") else None


def wants_unsloth(cuda: bool, world_size: int, lora_r: int, adapter: bool, loader: str = "auto") -> bool:
    """Whether :func:`choose_load_policy` would take Unsloth if it imports: only then is it probed
    (importing Unsloth patches transformers and TRL, which a multi-rank job must not get)."""
    if loader == "unsloth":
        return True
    return loader == "auto" and cuda and world_size == 1 and (lora_r > 0 or adapter)


def choose_load_policy(
    *,
    cuda: bool,
    world_size: int = 1,
    local_rank: int = 0,
    unsloth: bool | str | None = None,
    bitsandbytes: bool = False,
    lora_r: int = 16,
    adapter: bool = False,
    loader: str = "auto",
) -> LoadPolicy:
    """The load policy for one process (the table in docs/deploy.md). Pure: no import, no I/O.

    Args:
        cuda: a CUDA GPU is visible.
        world_size: processes in the job (``WORLD_SIZE``; > 1 = DDP or FSDP).
        local_rank: this process's rank on its node (``LOCAL_RANK``): its GPU.
        unsloth: True when Unsloth imports, the import error's text when it does not, None when
            it was not probed (:func:`wants_unsloth` said it could not be used).
        bitsandbytes: bitsandbytes imports (QLoRA possible).
        lora_r: the preset's LoRA rank; 0 = full fine-tuning.
        adapter: the starting checkpoint is a LoRA adapter (it is trained on as LoRA).
        loader: :data:`LOADERS`; anything but ``auto`` is the explicit flag (``ORTHORL_LOADER``).

    Raises:
        ModelError: an explicit loader that cannot run here (the message says why and what to set).
    """
    if loader not in LOADERS:
        raise ModelError(f"{LOADER_ENV}={loader!r} is not one of {', '.join(LOADERS)}")
    if world_size < 1 or not 0 <= local_rank < max(world_size, 1):
        raise ModelError(f"LOCAL_RANK {local_rank} is outside WORLD_SIZE {world_size}")
    device = f"cuda:{local_rank}" if cuda else "cpu"
    lora = lora_r > 0 or adapter
    ranks = f"{world_size} ranks" if world_size > 1 else "one process"
    if loader != "auto":
        if not lora:
            raise ModelError(f"{LOADER_ENV}={loader} needs LoRA, but lora_r is 0 (full fine-tuning)")
        if loader in ("unsloth", "qlora") and not cuda:
            raise ModelError(
                f"{LOADER_ENV}={loader} needs a CUDA GPU; none is visible (unset it, or use lora)"
            )
        if loader == "unsloth":
            if world_size > 1:
                raise ModelError(
                    f"{LOADER_ENV}=unsloth runs on one GPU only, this job has {world_size} ranks "
                    f"(unset it: several ranks train bf16 LoRA)"
                )
            if unsloth is not True:
                raise ModelError(f"{LOADER_ENV}=unsloth, but Unsloth does not import: {unsloth}")
        if loader == "qlora" and not bitsandbytes:
            raise ModelError(
                f"{LOADER_ENV}=qlora, but bitsandbytes does not import (pip install bitsandbytes)"
            )
        return LoadPolicy(loader, device, f"{LOADER_ENV}={loader} (explicit), {ranks}")
    if not lora:
        return LoadPolicy("full", device, "lora_r is 0: full fine-tuning of every weight")
    if not cuda:
        return LoadPolicy("lora", device, "no CUDA GPU: LoRA in float32 on the CPU")
    if world_size > 1:
        return LoadPolicy(
            "lora",
            device,
            f"{world_size} ranks (DDP or FSDP): bf16 LoRA on LOCAL_RANK {local_rank}'s GPU; 4-bit and "
            "Unsloth weights cannot be sharded or replicated across ranks",
        )
    if unsloth is True:
        return LoadPolicy("unsloth", device, "one GPU and Unsloth imports: Unsloth 4-bit + LoRA")
    fallback = "QLoRA (bitsandbytes 4-bit)" if bitsandbytes else "LoRA on unquantised weights"
    warning = None
    if isinstance(unsloth, str):
        warning = f"Unsloth did not import ({unsloth}); falling back to {fallback} on {device}"
    return LoadPolicy(
        "qlora" if bitsandbytes else "lora",
        device,
        f"one GPU without Unsloth: {fallback}" + ("" if bitsandbytes else " (bitsandbytes does not import)"),
        warning,
    )


def distributed_env(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(WORLD_SIZE, LOCAL_RANK)`` as torchrun / accelerate set them; (1, 0) outside a launcher."""
    env = os.environ if env is None else env
    try:
        return max(1, int(env.get("WORLD_SIZE") or 1)), int(env.get("LOCAL_RANK") or 0)
    except ValueError as exc:
        raise ModelError(f"WORLD_SIZE / LOCAL_RANK are not integers: {exc}") from None


def load_policy_here(lora_r: int, adapter: bool = False, loader: str | None = None) -> LoadPolicy:
    """:func:`choose_load_policy` for this process: probes CUDA, bitsandbytes and (only where it
    could be used) Unsloth, reads ``WORLD_SIZE``, ``LOCAL_RANK`` and ``ORTHORL_LOADER``."""
    import torch

    cuda = bool(torch.cuda.is_available())
    world_size, local_rank = distributed_env()
    loader = (loader or os.environ.get(LOADER_ENV) or "auto").strip().lower()
    unsloth = _unsloth() if wants_unsloth(cuda, world_size, lora_r, adapter, loader) else None
    return choose_load_policy(
        cuda=cuda, world_size=world_size, local_rank=local_rank, unsloth=unsloth,
        bitsandbytes=cuda and _bitsandbytes(), lora_r=lora_r, adapter=adapter, loader=loader,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Checkpoint folders
# ---------------------------------------------------------------------------------------------


def is_adapter(path: str | Path) -> bool:
    """Whether ``path`` is a PEFT adapter folder (``adapter_config.json``), not a full model."""
    return (Path(path) / "adapter_config.json").is_file()


def adapter_base(path: str | Path) -> str:
    """The base model reference an adapter folder was trained on: the staged copy's ``s3://`` URI
    (``orthorl_base_uri``) when it records one, else ``base_model_name_or_path``."""
    base, _digest = base_models.recorded_reference(adapter_config(path))
    if base is None:
        raise ModelError(f"{path}/adapter_config.json names no base model (base_model_name_or_path)")
    return base


def adapter_base_digest(path: str | Path) -> str | None:
    """The digest of the staged base an adapter records (``orthorl_base_digest``), None if none."""
    return base_models.recorded_reference(adapter_config(path))[1]


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
            "is this the output folder of orthojob bc-sft / grpo?"
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

    ``arch``: :func:`orthojob.modeling.tiny_model.build_tiny_model` keywords (``hidden_size``, ``layers``,
    ``vocab_size``, ``max_position_embeddings``, ``seed``, ...). ``prompt_format``: the prompt format
    the model is trained and evaluated with (:data:`orthojob.core.prompts.PROMPT_FORMATS`, recorded in its
    ``config.json``). ``corpus``: the tokenizer's training texts (default :func:`tiny_corpus`).
    """
    from orthojob.modeling.tiny_model import build_tiny_model  # torch at import: orthojob --help stays light

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
    local_base = resolve_base(base_ref, digest=adapter_base_digest(checkpoint) if adapter else None)
    source = checkpoint or local_base
    if adapter and local_base != adapter_config(checkpoint).get("base_model_name_or_path"):
        source = _localized_adapter(checkpoint, local_base)  # Unsloth reads the base itself: the local copy
    with _quiet_base_record():
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
    loader: str | None = None,
):
    """(model, tokenizer) ready to train; :func:`choose_load_policy` picks the loader.

    Args:
        model_path: hub id, folder or ``s3://`` URI of the base model (:mod:`orthojob.modeling.base_models`).
        checkpoint: an earlier stage's output folder to start from (adapter or full model).
        lora_r: LoRA rank; 0 = full fine-tuning.
        max_seq_length: prompt + completion budget (Unsloth sizes its kernels with it).
        use_vllm: Unsloth's fast_inference (vLLM colocated), GPU only.
        lora_alpha: LoRA alpha (default 2 x rank).
        loader: :data:`LOADERS` (default ``ORTHORL_LOADER``, else ``auto``).
    """
    adapter = bool(checkpoint and is_adapter(checkpoint))
    policy = load_policy_here(lora_r, adapter, loader)  # imports Unsloth (only if used) first
    if policy.warning:
        log.warning(policy.warning)
    log.info("load policy: %s on %s (%s)", policy.loader, policy.device, policy.reason)
    devices = device_info(lora_r)
    from transformers import AutoModelForCausalLM

    if policy.loader == "unsloth":
        log.info("loading %s with Unsloth (4-bit, LoRA r=%d)", checkpoint or model_path, lora_r)
        return _load_unsloth(model_path, checkpoint, lora_r, lora_alpha, max_seq_length, use_vllm)

    dtype = _dtype(devices)
    base_ref = adapter_base(checkpoint) if adapter else reference(checkpoint or model_path)
    digest = adapter_base_digest(checkpoint) if adapter else None
    base = resolve_base(base_ref, digest=digest)  # an s3:// base: fetched once into the model cache
    tok = _tokenizer(checkpoint or base)
    qlora = policy.loader == "qlora"
    kwargs: dict[str, Any] = {"dtype": dtype}
    if policy.device_index is not None:
        import torch

        torch.cuda.set_device(policy.device_index)
        kwargs["device_map"] = {"": policy.device_index}  # this rank's GPU, never every rank on GPU 0
    if qlora:
        import torch
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16 if devices["bf16"] else torch.float16,
        )
    model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
    if qlora:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    if (adapter or lora_r > 0) and not qlora:
        model.enable_input_require_grads()  # LoRA under gradient checkpointing needs grads at the inputs
    if adapter:
        from peft import PeftModel

        log.info("continuing LoRA adapter %s on %s", checkpoint, base)
        with _quiet_base_record():
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
        local_base = resolve_base(adapter_base(path), digest=adapter_base_digest(path))
        base = AutoModelForCausalLM.from_pretrained(local_base, dtype=dtype)
        model = load_adapter(base, path).merge_and_unload()
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
