"""Adapter promotion in the MLflow model registry (aliases, not stages).

``promote(run_id)`` reads the run's gate file (artifact ``gate_passed.json``) and registers the run's
logged model (artifact path ``model``) only when the gate passed **and** its held-out hard-rule share
is within the promotion's bound: no more plans breaking a hard rule than the oracle's on the gate's
cases, plus ``max_hard_rule_share_over_oracle`` (default :data:`orthojob.gate.HARD_RULE_BOUND`, 0;
checked here even when the gate itself was run with a looser threshold or none). Such a version gets
alias ``candidate``; ``champion`` too when its headline metric beats the current champion's
(:data:`COMPARISON_METRIC`, the mean scaled terminal reward, recorded as a version tag with the
hard-rule share), or, for a manual promotion, when ``force`` is given.

Nothing is registered for a failed gate, a hard-rule share over the bound, or a gate file without
the metrics (:attr:`ExitCode.BAD_GATE`), a missing gate file (:attr:`ExitCode.NO_GATE`) or a run
without a logged model (:attr:`ExitCode.NO_MODEL`). A champion recorded before the headline metric
(no ``scaled_reward_mean`` tag, only the raw terminal) is replaced by the first version that passes.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from orthojob.exit_codes import ExitCode
from orthojob.gate import GATE_FILE, HARD_RULE_BOUND
from orthojob.metrics import HARD_RULE_SHARE, SCALED_REWARD_MEAN

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "orthorl-planner"
MODEL_ARTIFACT = "model"
COMPARISON_METRIC = SCALED_REWARD_MEAN
"""The gate metric a version is compared by (the headline: the mean scaled terminal reward)."""
ORACLE_SHARE = f"oracle_{HARD_RULE_SHARE}"
"""The gate metric the hard-rule share is bounded against."""


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
    """``{"passed", "score", "hard_rule_share", "oracle_hard_rule_share"}`` of the run's gate file
    (artifact ``gate_passed.json``), validated."""
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
        needed = (COMPARISON_METRIC, HARD_RULE_SHARE, ORACLE_SHARE)
        try:
            gate = json.loads(Path(path).read_text())
            passed = gate["passed"]
            values = {k: float(gate["metrics"][k]) for k in needed}
        except (ValueError, KeyError, TypeError) as exc:
            raise PromotionError(
                ExitCode.BAD_GATE,
                f"run {run_id}'s {GATE_FILE} is unparseable or lacks 'passed' or one of "
                f"{', '.join(f'metrics.{k}' for k in needed)} ({type(exc).__name__}: {exc}); re-run the gate "
                "(orthojob gate --checkpoint DIR --stage grpo): a gate file written before the headline metric "
                "and the hard-rule bound has neither",
            ) from exc
    if not isinstance(passed, bool):
        raise PromotionError(ExitCode.BAD_GATE, f"run {run_id}'s {GATE_FILE}: 'passed' must be true or false")
    return {"passed": passed, "score": values[COMPARISON_METRIC], HARD_RULE_SHARE: values[HARD_RULE_SHARE],
            ORACLE_SHARE: values[ORACLE_SHARE]}  # fmt: skip


def refusal(gate: dict, max_hard_rule_share_over_oracle: float | None = HARD_RULE_BOUND) -> str | None:
    """Why a run with this gate (:func:`read_run_gate`) must not be registered, or None: its gate
    failed, or its hard-rule share exceeds the oracle's by more than the bound (None: not bounded)."""
    if not gate["passed"]:
        return "its gate failed"
    share, oracle = gate[HARD_RULE_SHARE], gate[ORACLE_SHARE]
    if max_hard_rule_share_over_oracle is not None and not share - oracle <= max_hard_rule_share_over_oracle:
        return (
            f"{share:.3f} of its held-out plans break a hard rule, the oracle's {oracle:.3f} on the same cases "
            f"(bound: at most {max_hard_rule_share_over_oracle:+.3f} over the oracle's)"
        )
    return None


def promote(
    run_id: str,
    model_name: str = DEFAULT_MODEL_NAME,
    force: bool = False,
    max_hard_rule_share_over_oracle: float | None = HARD_RULE_BOUND,
) -> Promotion:
    """Register the run's model (alias ``candidate``; ``champion`` per the rules above), or raise
    :class:`PromotionError` and register nothing (:func:`refusal`)."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    gate = read_run_gate(run_id)
    why = refusal(gate, max_hard_rule_share_over_oracle)
    if why is not None:
        raise PromotionError(
            ExitCode.BAD_GATE,
            f"run {run_id} is not registered: {why}. A planner whose gate fails, or that breaks the hard "
            "clinical rules more often than the oracle, is never a candidate; train and gate it again.",
        )
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
    client.set_model_version_tag(model_name, v, HARD_RULE_SHARE, f"{gate[HARD_RULE_SHARE]:.6f}")
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

    if force:
        champion, reason = True, "manual promotion (--force) of a passed gate"
    elif previous is None:
        champion, reason = True, "gate passed; no champion yet"
    elif previous_score == float("-inf"):
        champion, reason = (
            True,
            f"gate passed; champion v{previous} has no {COMPARISON_METRIC} (an older gate)",
        )
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
