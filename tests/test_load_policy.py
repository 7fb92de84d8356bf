"""The load policy: one pure function (orthojob.modeling.models.choose_load_policy), every row of the table in
docs/deploy.md, and load_policy_here wiring it to this process (CUDA, WORLD_SIZE, LOCAL_RANK,
ORTHORL_LOADER). No GPU here: the GPU rows are the decision, tested up to the loader."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from orthojob.modeling import models
from orthojob.modeling.models import LOADER_ENV, LoadPolicy, ModelError, choose_load_policy, wants_unsloth

ROOT = Path(__file__).resolve().parents[1]
IMPORT_ERROR = "ImportError: Unsloth: no NVIDIA GPU"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from orthojob.modeling.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", seed=0)


def pick(**kw) -> LoadPolicy:
    return choose_load_policy(**({"cuda": True, "lora_r": 16} | kw))


def test_one_gpu_takes_unsloth_when_it_imports():
    p = pick(unsloth=True, bitsandbytes=True)
    assert (p.loader, p.device, p.quantized, p.warning) == ("unsloth", "cuda:0", True, None)


def test_one_gpu_without_unsloth_warns_and_names_the_fallback():
    p = pick(unsloth=IMPORT_ERROR, bitsandbytes=True)
    assert (p.loader, p.device) == ("qlora", "cuda:0")
    assert IMPORT_ERROR in p.warning and "falling back to QLoRA" in p.warning and "cuda:0" in p.warning
    p = pick(unsloth=IMPORT_ERROR, bitsandbytes=False)
    assert p.loader == "lora" and not p.quantized and "LoRA on unquantised weights" in p.warning


def test_one_gpu_with_unsloth_not_installed_and_no_bitsandbytes():
    p = pick(unsloth="ModuleNotFoundError: No module named 'unsloth'")
    assert p.loader == "lora" and "bitsandbytes does not import" in p.reason


@pytest.mark.parametrize("world_size", [2, 8, 16])
def test_several_ranks_train_bf16_lora_on_their_own_gpu(world_size):
    for rank in range(min(world_size, 8)):
        # whatever imports: never 4-bit, never Unsloth
        for unsloth in (True, IMPORT_ERROR, None):
            p = pick(world_size=world_size, local_rank=rank, unsloth=unsloth, bitsandbytes=True)
            assert p.loader == "lora" and not p.quantized, p
            assert p.device == f"cuda:{rank}" and p.device_index == rank
    devices = {pick(world_size=8, local_rank=r, bitsandbytes=True).device_index for r in range(8)}
    assert devices == set(range(8))  # no rank but rank 0 maps to GPU 0
    assert not wants_unsloth(True, world_size, 16, False)  # Unsloth is not even imported


def test_cpu_and_full_fine_tuning():
    p = choose_load_policy(cuda=False, lora_r=16, unsloth=True, bitsandbytes=True)
    assert (p.loader, p.device, p.device_index) == ("lora", "cpu", None)
    p = choose_load_policy(cuda=True, world_size=4, local_rank=3, lora_r=0)
    assert (p.loader, p.device) == ("full", "cuda:3")
    assert choose_load_policy(cuda=False, lora_r=0).loader == "full"
    # an adapter checkpoint trains on as LoRA even with lora_r 0
    assert choose_load_policy(cuda=True, lora_r=0, adapter=True, unsloth=True).loader == "unsloth"


def test_an_explicit_flag_overrides():
    assert pick(loader="lora", unsloth=True, bitsandbytes=True).loader == "lora"
    assert pick(loader="qlora", unsloth=True, bitsandbytes=True).loader == "qlora"
    p = pick(loader="qlora", world_size=2, local_rank=1, bitsandbytes=True)
    assert (p.loader, p.device) == ("qlora", "cuda:1")
    assert pick(loader="unsloth", unsloth=True).loader == "unsloth"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"loader": "unsloth", "world_size": 2, "unsloth": True}, "one GPU only"),
        ({"loader": "unsloth", "unsloth": IMPORT_ERROR}, "does not import"),
        ({"loader": "qlora", "bitsandbytes": False}, "bitsandbytes does not import"),
        ({"loader": "qlora", "cuda": False}, "needs a CUDA GPU"),
        ({"loader": "lora", "lora_r": 0}, "needs LoRA"),
        ({"loader": "4bit"}, "is not one of"),
        ({"world_size": 2, "local_rank": 2}, "outside WORLD_SIZE"),
    ],
)
def test_a_flag_that_cannot_run_is_refused_with_the_reason(kw, message):
    with pytest.raises(ModelError, match=message):
        pick(**kw)
    assert LOADER_ENV == "ORTHORL_LOADER"


def test_policy_here_reads_the_launchers_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(models, "_unsloth", lambda: pytest.fail("Unsloth probed with several ranks"))
    p = models.load_policy_here(16)
    import torch

    assert p.loader == "lora" and p.device == ("cuda:3" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv(LOADER_ENV, "QLoRA")
    if not torch.cuda.is_available():
        with pytest.raises(ModelError, match="needs a CUDA GPU"):
            models.load_policy_here(16)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ModelError, match="not integers"):
        models.distributed_env()


def test_failed_unsloth_import_is_a_warning_in_load_policy(monkeypatch, caplog, tiny_model):
    """load_policy logs the policy's warning at WARNING level (the one-GPU row, simulated: the probe
    and CUDA are replaced, the CPU path loads the tiny model)."""
    warned = LoadPolicy(
        "lora", "cpu", "test", warning=f"Unsloth did not import ({IMPORT_ERROR}); falling back"
    )
    monkeypatch.setattr(models, "load_policy_here", lambda *a, **k: warned)
    with caplog.at_level(logging.INFO, logger="orthojob.modeling.models"):
        models.load_policy(str(tiny_model), lora_r=4)
    rows = [r for r in caplog.records if "Unsloth did not import" in r.getMessage()]
    assert rows and rows[0].levelno == logging.WARNING


def test_docs_table_has_every_row():
    text = (ROOT / "docs" / "deploy.md").read_text()
    table = text[text.index("| load policy") :].split("\n\n", 1)[0]
    rows = [r for r in table.splitlines()[2:] if r.startswith("|")]
    cells = [re.split(r"(?<!\\)\|", r)[-2] for r in rows]  # the loader column (escaped pipes kept)
    loaders = {re.findall(r"`(\w+)`", cell)[0] for cell in cells}
    assert loaders == {"unsloth", "qlora", "lora", "full"} and len(rows) == 7
    assert "LOCAL_RANK" in table and LOADER_ENV in table and "WARNING" in table


def test_load_policy_puts_a_rank_on_its_own_gpu(monkeypatch, tiny_model):
    """The wiring of the policy's device (no GPU here): a rank whose policy says cuda:3 (LOCAL_RANK 3
    of a multi-GPU launch) selects GPU 3 and loads with device_map {"": 3}, never GPU 0. The model
    itself loads on CPU (device_map dropped), so the rest of load_policy runs for real."""
    import torch
    from transformers import AutoModelForCausalLM

    policy = LoadPolicy("lora", "cuda:3", "LOCAL_RANK 3 of 4")
    monkeypatch.setattr(models, "load_policy_here", lambda *a, **k: policy)
    selected: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    loads: list[dict] = []
    original = AutoModelForCausalLM.from_pretrained

    def from_pretrained(path, *args, **kwargs):
        loads.append(dict(kwargs))
        kwargs.pop("device_map", None)
        return original(path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    model, _tok = models.load_policy(str(tiny_model), lora_r=4)
    assert selected == [3]
    assert len(loads) == 1 and loads[0]["device_map"] == {"": 3}
    assert "quantization_config" not in loads[0]  # several ranks: bf16 LoRA, never 4-bit
    assert models.count_parameters(model)["trainable"] > 0  # LoRA applied
    # on CPU: neither a device nor a device_map
    monkeypatch.setattr(models, "load_policy_here", lambda *a, **k: LoadPolicy("lora", "cpu", "no CUDA"))
    models.load_policy(str(tiny_model), lora_r=4)
    assert selected == [3] and "device_map" not in loads[1]
