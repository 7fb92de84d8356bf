"""LoRA adapters: their config, the base model each records (so a fresh process can load its base
again, from the hub, a folder or S3), and loading one onto its base.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from orthojob.modeling import base_models
from orthojob.modeling.errors import ModelError

LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapter_config(path: str | Path) -> dict:
    try:
        cfg = json.loads((Path(path) / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}/adapter_config.json is unreadable or names no base model: {exc}") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{path}/adapter_config.json is no JSON object")
    return cfg


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


class _SaveWithBaseRecord:
    """A PEFT config's ``save_pretrained`` that also writes this project's keys (the staged base's
    URI and digest) into the adapter_config.json it wrote. PEFT's config classes only save their
    own fields; this travels with the config into every save (``checkpoint-N``, the final adapter,
    the MLflow model's ``peft/`` folder)."""

    def __init__(self, config, keys: Mapping[str, str]):
        self.config = config
        self.keys = dict(keys)

    def __call__(self, save_directory: str, **kwargs: Any) -> None:
        type(self.config).save_pretrained(self.config, save_directory, **kwargs)
        path = Path(save_directory) / "adapter_config.json"
        data = json.loads(path.read_text()) | self.keys
        path.write_text(json.dumps(data, indent=2, sort_keys=True))


def record_base(model, base_ref: str) -> None:
    """Make every PEFT adapter config of ``model`` record ``base_ref`` (an ``s3://`` URI, hub id or
    absolute folder: :func:`orthojob.modeling.base_models.reference`) as
    :func:`orthojob.modeling.base_models.record` says: an ``s3://`` base staged from the model hub as its hub
    id and commit (``base_model_name_or_path``, ``revision``) with the URI and digest beside them,
    so that every adapter saved from it (final and ``checkpoint-N``) resolves in another pod and in
    PEFT, MLflow and vLLM. No-op for a full model."""
    if getattr(model, "peft_config", None):
        _apply_base_record(model, base_models.record(base_ref))


def _apply_base_record(model, recorded: Mapping[str, Any]) -> None:
    """Set a base record (:func:`orthojob.modeling.base_models.record`'s keys) on every adapter config of a
    PEFT model, the keys PEFT does not know written by its saves."""
    keys = {k: recorded[k] for k in (base_models.RECORD_URI, base_models.RECORD_DIGEST) if recorded.get(k)}
    for cfg in (getattr(model, "peft_config", None) or {}).values():
        cfg.base_model_name_or_path = recorded["base_model_name_or_path"]
        cfg.revision = recorded.get("revision")
        vars(cfg).pop("save_pretrained", None)
        if keys:
            vars(cfg)["save_pretrained"] = _SaveWithBaseRecord(cfg, keys)


def load_adapter(base, path: str | Path):
    """The PEFT model of a saved adapter folder on ``base`` (a loaded model), not merged, keeping the
    base record its adapter_config.json holds (PEFT drops the keys it does not know), so that saving
    or logging it again records the same base."""
    from peft import PeftModel

    with _quiet_base_record():
        model = PeftModel.from_pretrained(base, str(path))
    _apply_base_record(model, adapter_config(path))
    return model


def recorded_base(model) -> dict | None:
    """What ``model``'s adapter records of its base (:func:`record_base`): ``base_model_name_or_path``
    and, where known, ``revision``, ``orthorl_base_uri``, ``orthorl_base_digest``; None for a full
    model."""
    configs = list((getattr(model, "peft_config", None) or {}).values())
    if not configs:
        return None
    cfg = configs[0]
    out = {"base_model_name_or_path": cfg.base_model_name_or_path}
    if getattr(cfg, "revision", None):
        out["revision"] = cfg.revision
    saver = vars(cfg).get("save_pretrained")
    if isinstance(saver, _SaveWithBaseRecord):
        out |= saver.keys
    return out


@contextlib.contextmanager
def _quiet_base_record() -> Iterator[None]:
    """PEFT warns of adapter_config.json keys that are not its own; this project's
    (``orthorl_base_*``) are expected, any other stays a warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"Unexpected keyword arguments \['orthorl_base_\w+'(, 'orthorl_base_\w+')*\]"
        )
        yield


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
    cfg["revision"] = None  # a hub commit, meaningless for the local folder
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return str(folder)
