"""What a stage logs to MLflow: the model (a LoggedModel, base model recorded), its gate, the cases it
trained and was gated on (MLflow datasets), the resolved config, the completions and plots.

Only rank 0 calls any of this.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orthojob.core.metrics import (
    ENGINE_TAG,
    EXCESS_METRIC,
    GATE_METRIC_PREFIX,
    GATE_PASSED_TAG,
    GATE_STAGE_TAG,
    HARD_RULE_SHARE,
)
from orthojob.core.prompts import TRAIN_SEED_START
from orthojob.eval.plots import training_plots
from orthojob.lifecycle.gate_file import GATE_FILE, gate_path
from orthojob.modeling import base_models
from orthojob.modeling.adapters import load_adapter, recorded_base
from orthojob.modeling.models import adapter_base, adapter_base_digest, is_adapter, resolve_base
from orthojob.ops.tracking import log_metrics, redact

log = logging.getLogger(__name__)


COMPLETIONS_SAMPLE = 64


def _pip_requirements(peft_model: bool) -> list[str]:
    from importlib.metadata import version

    reqs = []
    for pkg in ("torch", "transformers", "accelerate", "safetensors", "tokenizers") + (
        ("peft",) if peft_model else ()
    ):
        with contextlib.suppress(Exception):
            reqs.append(f"{pkg}=={version(pkg)}")
    return reqs


def model_metadata(model: Any, base_model: str) -> dict[str, str]:
    """The logged model's metadata: ``adapter`` and ``base_model``, what the adapter records as its
    base (:func:`orthojob.modeling.adapters.record_base`: for an ``s3://`` base staged from the model hub, its hub
    id), with ``base_model_revision``, ``base_model_uri`` and ``base_model_digest`` where known; a full
    model's is ``base_model`` as given."""

    peft_model = hasattr(model, "peft_config")
    recorded = recorded_base(model) or {}
    meta = {
        "base_model": recorded.get("base_model_name_or_path") or base_model,
        "adapter": str(peft_model).lower(),
    }
    for key, name in (
        ("revision", "base_model_revision"),
        (base_models.RECORD_URI, "base_model_uri"),
        (base_models.RECORD_DIGEST, "base_model_digest"),
    ):
        if recorded.get(key):
            meta[name] = recorded[key]
    return meta


def log_model(model: Any, tokenizer: Any, base_model: str) -> Any:
    """Log the trained model (a PEFT adapter or a full model) with MLflow's transformers flavour.
    Its ``peft/adapter_config.json`` records the base as the adapter does; metadata:
    :func:`model_metadata`."""
    import mlflow

    peft_model = hasattr(model, "peft_config")
    return mlflow.transformers.log_model(
        transformers_model={"model": model, "tokenizer": tokenizer},
        name="model",
        task="text-generation",
        pip_requirements=_pip_requirements(peft_model),
        metadata=model_metadata(model, base_model),
    )


def log_training_artifacts(
    out: Path,
    config: dict,
    model: Any,
    tokenizer: Any,
    base_model: str,
    log_history: Sequence[dict],
    task_id: str,
    force_decay: bool,
    completions_file: str,
    training: Mapping[str, Any] | None = None,
) -> None:
    """Everything a training stage leaves in its MLflow run (rank 0, active run); the model, when
    its gate file is there, as a gated LoggedModel (:func:`log_gated_checkpoint`; ``training``: the
    cases it trained on, :func:`training_cases`)."""
    import mlflow

    with tempfile.TemporaryDirectory() as tmp:
        resolved = Path(tmp) / "resolved_config.json"
        resolved.write_text(redact(json.dumps(config, indent=2, default=str)))
        mlflow.log_artifact(str(resolved))
        plot_dir = Path(tmp) / "plots"
        try:
            for png in training_plots(log_history, plot_dir, task_id, TRAIN_SEED_START, force_decay):
                mlflow.log_artifact(str(png), artifact_path="plots")
        except Exception as exc:  # plots are diagnostics: never fail a finished training for them
            log.warning("plots skipped: %s", exc)
    completions = out / completions_file
    if completions.is_file():
        mlflow.log_artifact(str(completions))
        rows = [
            json.loads(line) for line in completions.read_text().splitlines()[:COMPLETIONS_SAMPLE] if line
        ]
        if rows:
            table = {
                "step": [r["step"] for r in rows],
                "seed": [r["seed"] for r in rows],
                "completion": [r["completion"][:2000] for r in rows],
                "reward_total": [sum(v or 0.0 for v in r["rewards"].values()) for r in rows],
                "advantage": [r["advantage"] for r in rows],
            }
            mlflow.log_table(table, artifact_file="completions_sample.json")
    gate = out / GATE_FILE
    if gate.is_file():  # last: a run with a gate file is a finished run
        log_gated_checkpoint(out, json.loads(gate.read_text()), base_model, model, tokenizer, training)
    else:
        log_model(model, tokenizer, base_model)


def cases_dataset(
    name: str, task_ids: Sequence[str], seeds: Sequence[int], force_decay: bool | Sequence[bool], source: str
) -> Any:
    """An MLflow dataset (``mlflow.data.from_pandas``) of the cases a stage trained or was gated on:
    one row per case (``task_id``, ``seed``, ``force_decay``); ``task_ids`` one per seed, and
    ``force_decay`` one per seed or one for all. Its source
    is code (the cases are generated, :func:`server.cases.generate_case`) described by ``source``;
    its digest is MLflow's of the rows, so the same cases are the same dataset in every run."""
    import mlflow.data
    import pandas as pd
    from mlflow.data.code_dataset_source import CodeDatasetSource

    decay = [bool(d) for d in force_decay] if isinstance(force_decay, Sequence) else bool(force_decay)
    frame = pd.DataFrame({"task_id": list(task_ids), "seed": [int(s) for s in seeds], "force_decay": decay})
    # the cases are generated by code (server.cases.generate_case), from these rows
    origin = CodeDatasetSource({"generator": "server.cases.generate_case", "cases": source})
    return mlflow.data.from_pandas(frame, source=origin, name=name)


def training_cases(rows: Sequence[Mapping[str, Any]], force_decay: bool) -> dict:
    """The cases of a stage's training rows (each with ``task_id`` and ``seed``), columnar, in the
    form :func:`log_gated_checkpoint`'s ``training`` takes: ``{"task_id", "seed", "force_decay"}``."""
    keep = [r for r in rows if r.get("seed") is not None and r.get("task_id") is not None]
    return {
        "task_id": [str(r["task_id"]) for r in keep],
        "seed": [int(r["seed"]) for r in keep],
        "force_decay": bool(force_decay),
    }


def gate_dataset(content: Mapping[str, Any]) -> Any | None:
    """The held-out cases a gate evaluated (its file's ``evaluation``: task ids, ``n_seeds`` seeds
    from ``seed_start``, force decay) as an MLflow dataset ``heldout-<tasks>-<first>-<last>``; None
    when the gate file does not say."""
    ev = content.get("evaluation") or {}
    tasks, n, start = ev.get("task_ids"), ev.get("n_seeds"), ev.get("seed_start")
    if not tasks or not isinstance(n, int) or not isinstance(start, int):
        return None
    seeds = range(start, start + n)
    window = ev.get("window") or {}  # the gate's cells (task, dynamics), where it records them
    cells = [(c["task_id"], bool(c["force_decay"])) for c in window.get("cells", [])]
    cells = cells or [(t, bool(ev.get("force_decay"))) for t in tasks]
    return cases_dataset(
        f"heldout-{'+'.join(tasks)}-{start}-{start + n - 1}",
        [t for t, _ in cells for _ in seeds],
        [s for _ in cells for s in seeds],
        [d for _, d in cells for _ in seeds],
        source=f"heldout tasks={','.join(tasks)} seeds={start}-{start + n - 1}",
    )


def _training_dataset(training: Mapping[str, Any], stage: str) -> Any | None:
    task_ids, seeds = list(training.get("task_id") or []), list(training.get("seed") or [])
    if not seeds or len(task_ids) != len(seeds):
        return None
    tasks = sorted(set(task_ids))
    return cases_dataset(
        f"{stage}-train-{'+'.join(tasks)}-{min(seeds)}-{max(seeds)}",
        task_ids,
        seeds,
        bool(training.get("force_decay")),
        source=f"train stage={stage} tasks={','.join(tasks)} seeds={min(seeds)}-{max(seeds)}",
    )


def load_checkpoint(folder: str | Path) -> tuple[Any, Any]:
    """(model, tokenizer) of a saved checkpoint as it is logged: a LoRA adapter stays a PEFT model on
    its base (not merged), a full model loads as itself; on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not is_adapter(folder):
        return AutoModelForCausalLM.from_pretrained(folder), tokenizer
    base = AutoModelForCausalLM.from_pretrained(
        resolve_base(adapter_base(folder), digest=adapter_base_digest(folder))
    )
    return load_adapter(base, folder), tokenizer


def log_gated_checkpoint(
    folder: str | Path,
    content: Mapping[str, Any],
    base_model: str,
    model: Any = None,
    tokenizer: Any = None,
    training: Mapping[str, Any] | None = None,
) -> str | None:
    """Log a gated checkpoint into the active run as an MLflow LoggedModel carrying its gate; returns
    its model id. Every training stage (format, tool-use and BC SFT, GRPO, RSFT) ends here.

    The model (``model``/``tokenizer``, else loaded from ``folder`` by :func:`load_checkpoint`) is
    logged by :func:`log_model`; the cases it was gated on (:func:`gate_dataset`, context
    ``evaluation``) and, with ``training`` (:func:`training_cases`), those it trained on (context
    ``training``) are logged as run inputs linked to the model; then :func:`record_gate` puts the
    gate on the run and on the model."""
    import mlflow
    from mlflow.entities import LoggedModelInput

    if model is None or tokenizer is None:
        model, tokenizer = load_checkpoint(folder)
    model_info = log_model(model, tokenizer, base_model)
    model_id = getattr(model_info, "model_id", None)
    linked = LoggedModelInput(model_id) if model_id else None
    stage = str(content.get("stage") or "stage")
    train = _training_dataset(training, stage) if training else None
    if train is not None:
        mlflow.log_input(train, context="training", model=linked)
    evaluation = gate_dataset(content)
    if evaluation is not None:
        mlflow.log_input(evaluation, context="evaluation", model=linked)
    record_gate(model_id, content, folder, dataset=evaluation)
    return model_id


def record_gate(
    model_id: str | None, content: Mapping[str, Any], folder: str | Path | None = None, dataset: Any = None
) -> None:
    """Put a gate on the active run and on its LoggedModel ``model_id``: the run gets the gate file
    (from ``folder``), the metrics ``gate/<name>`` and the tag ``orthorl.gate_passed``; the LoggedModel
    gets the numeric metrics (``gate/<name>``, linked to ``dataset``, the held-out cases) and the tags
    ``orthorl.gate_passed``, ``orthorl.gate_stage`` and ``orthorl.staging_engine`` (the engine's version
    the gate judged with, or ``off``; the run gets it too), so ``mlflow.search_logged_models`` finds gated
    checkpoints by them (what :mod:`orthojob.lifecycle.registry` promotes from). A model without an id (no
    LoggedModel) gets nothing."""
    import mlflow

    passed = str(bool(content.get("passed"))).lower()
    values = dict(content.get("metrics") or {})
    share, oracle = values.get(HARD_RULE_SHARE), values.get(f"oracle_{HARD_RULE_SHARE}")
    if EXCESS_METRIC not in values and isinstance(share, (int, float)) and isinstance(oracle, (int, float)):
        values[EXCESS_METRIC] = share - oracle  # a gate file written before the gate computed it
    log_metrics({f"{GATE_METRIC_PREFIX}{k}": v for k, v in values.items()})
    if folder is not None and gate_path(folder).is_file():
        mlflow.log_artifact(str(gate_path(folder)))
    mlflow.set_tag(GATE_PASSED_TAG, passed)
    if values.get("engine"):  # what the gate judged: the plans the staging engine executes, or raw ones
        mlflow.set_tag(f"orthorl.{ENGINE_TAG}", str(values["engine"]))
    if model_id is None:
        return
    metrics = {
        f"{GATE_METRIC_PREFIX}{k}": float(v)
        for k, v in values.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
    if metrics:
        mlflow.log_metrics(metrics, model_id=model_id, dataset=dataset)
    tags = {GATE_PASSED_TAG: passed}
    if content.get("stage"):
        tags[GATE_STAGE_TAG] = str(content["stage"])
    if values.get("engine"):
        tags[f"orthorl.{ENGINE_TAG}"] = str(values["engine"])
    mlflow.set_logged_model_tags(model_id, tags)
