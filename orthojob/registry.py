"""Adapter promotion in the MLflow model registry (aliases, not stages).

``promote(run_id)`` registers the run's logged model (artifact path ``model``) as a
new version of ``model_name`` and sets alias ``candidate`` on it. It sets
``champion`` only when the run's gate passed **and** its evaluation beats the current
champion's (the comparison metric is recorded as version tags), or — for a manual
promotion — when ``force`` is given and the gate passed. A failed gate is never
made champion; a missing or unparseable gate file is an error and nothing is
registered.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from orthojob.exit_codes import ExitCode
from orthojob.gate import GATE_FILE

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "orthorl-planner"
MODEL_ARTIFACT = "model"
COMPARISON_METRIC = "terminal_mean"


class PromotionError(RuntimeError):
    """Promotion refused; ``exit_code`` is the CLI's exit status."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Promotion:
    model_name: str
    version: str
    candidate: bool
    champion: bool
    reason: str
    score: float
    previous_champion: str | None
    previous_score: float | None


def read_run_gate(run_id: str) -> dict:
    """``{"passed", "score"}`` of the run's gate file (artifact ``gate_passed.json``), validated."""
    import mlflow

    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=GATE_FILE, dst_path=tmp)
        except Exception as exc:
            raise PromotionError(
                ExitCode.NO_GATE,
                f"run {run_id} has no {GATE_FILE} artifact: run the gate "
                "(orthojob gate) for this checkpoint before promoting",
            ) from exc
        try:
            gate = json.loads(Path(path).read_text())
            passed = gate["passed"]
            score = float(gate["metrics"][COMPARISON_METRIC])
        except (ValueError, KeyError, TypeError) as exc:
            raise PromotionError(
                ExitCode.BAD_GATE,
                f"run {run_id}'s {GATE_FILE} is unparseable or lacks "
                f"'passed'/'metrics.{COMPARISON_METRIC}' ({exc}); re-run the gate",
            ) from exc
    if not isinstance(passed, bool):
        raise PromotionError(ExitCode.BAD_GATE, f"run {run_id}'s {GATE_FILE}: 'passed' must be true or false")
    return {"passed": passed, "score": score}


def promote(run_id: str, model_name: str = DEFAULT_MODEL_NAME, force: bool = False) -> Promotion:
    """Register the run's model; alias ``candidate``; ``champion`` per the rules above."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    gate = read_run_gate(run_id)
    run = client.get_run(run_id)
    logged = client.search_logged_models(
        experiment_ids=[run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'"
    )
    named = [m for m in logged if m.name == MODEL_ARTIFACT] or list(logged)
    model_uri = f"models:/{named[0].model_id}" if named else f"runs:/{run_id}/{MODEL_ARTIFACT}"
    try:
        version = mlflow.register_model(model_uri, model_name)
    except MlflowException as exc:
        raise PromotionError(
            ExitCode.NO_MODEL,
            f"run {run_id} has no logged model to register ({exc}); "
            "the training stage logs it as artifact 'model'",
        ) from exc
    v = version.version
    client.set_model_version_tag(model_name, v, "gate_passed", str(gate["passed"]).lower())
    client.set_model_version_tag(model_name, v, COMPARISON_METRIC, f"{gate['score']:.6f}")
    client.set_model_version_tag(model_name, v, "run_id", run_id)
    client.set_model_version_tag(model_name, v, "stage", run.data.tags.get("orthorl.stage", "unknown"))
    client.set_registered_model_alias(model_name, "candidate", v)

    previous, previous_score = None, None
    try:
        champ = client.get_model_version_by_alias(model_name, "champion")
        previous = champ.version
        previous_score = float(champ.tags.get(COMPARISON_METRIC, "-inf"))
    except MlflowException:
        pass

    if not gate["passed"]:
        champion, reason = False, "gate failed: never promoted"
    elif force:
        champion, reason = True, "manual promotion (--force) of a passed gate"
    elif previous is None:
        champion, reason = True, "gate passed; no champion yet"
    elif gate["score"] > previous_score:
        champion, reason = (
            True,
            f"gate passed and {gate['score']:.4f} beats champion v{previous} ({previous_score:.4f})",
        )
    else:
        champion, reason = (
            False,
            f"gate passed but {gate['score']:.4f} does not beat champion v{previous} ({previous_score:.4f})",
        )
    if champion:
        client.set_registered_model_alias(model_name, "champion", v)
    client.set_model_version_tag(model_name, v, "promotion", reason)
    log.info("%s v%s: candidate; %s", model_name, v, reason)
    return Promotion(model_name, v, True, champion, reason, gate["score"], previous, previous_score)
