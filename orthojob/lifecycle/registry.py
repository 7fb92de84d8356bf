"""Adapter promotion in the MLflow model registry (aliases, not stages), from MLflow's LoggedModel records.

Every training stage logs its gated checkpoint as an MLflow LoggedModel carrying its gate
(:func:`orthojob.lifecycle.model_logging.log_gated_checkpoint`): the verdict as tag ``orthorl.gate_passed``, the gate's
metrics as ``gate/<name>`` (the headline ``gate/scaled_reward_mean``, ``gate/hard_rule_share``,
``gate/oracle_hard_rule_share``, ``gate/hard_rule_share_over_oracle``), linked to the held-out cases.

``promote(run_id)`` reads the run's gated LoggedModel (``mlflow.search_logged_models`` by
``source_run_id``) and registers it only when its gate passed **and** its held-out hard-rule share is
within the promotion's bound: no more plans breaking a hard rule than the oracle's on the gate's
cases, plus ``max_hard_rule_share_over_oracle`` (default :data:`orthojob.lifecycle.gate_file.HARD_RULE_BOUND`, 0;
checked here even when the gate itself was run with a looser threshold or none). Such a version gets
alias ``candidate``. The champion is picked from the records: ``search_logged_models`` over the
registered versions' LoggedModels, filtered on a passed gate and the hard-rule bound, ordered by the
headline metric (:data:`COMPARISON_METRIC`); the new version becomes ``champion`` when it is the top
record, beating every other registered record (or, for a manual promotion, when ``force`` is given).
A champion registered before these records (its LoggedModel carries no gate) is replaced by the first
version that passes. The version also gets the gate's figures as tags, for the registry's UI.

Nothing is registered for a failed gate, a hard-rule share over the bound, or a record without the
metrics (:attr:`ExitCode.BAD_GATE`), a run without a gate (:attr:`ExitCode.NO_GATE`) or a run whose
gate is on no LoggedModel (:attr:`ExitCode.NO_MODEL`; its gate file, artifact ``gate_passed.json``, is
then read only to say which: missing, unreadable, or there without a model).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from orthojob.core.metrics import (
    ENGINE_TAG,
    EXCESS_METRIC,
    GATE_METRIC_PREFIX,
    GATE_PASSED_TAG,
    GATE_STAGE_TAG,
    HARD_RULE_SHARE,
    SCALED_REWARD_MEAN,
)
from orthojob.lifecycle.gate_file import GATE_FILE, HARD_RULE_BOUND
from orthojob.ops import tracking
from orthojob.ops.exit_codes import ExitCode
from orthojob.ops.job_errors import report_job_error

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "orthorl-planner"
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
    engine = gate["metrics"].get("engine", "off")  # a gate file from before the engine judged raw plans
    return {"passed": passed, "score": values[COMPARISON_METRIC], HARD_RULE_SHARE: values[HARD_RULE_SHARE],
            ORACLE_SHARE: values[ORACLE_SHARE], ENGINE_TAG: str(engine)}  # fmt: skip


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


def run_record(run_id: str) -> tuple[object, dict]:
    """``(LoggedModel, gate)`` of the run's newest gated LoggedModel; ``gate`` as :func:`read_run_gate`
    returns it, from the record's tag and metrics. Raises :class:`PromotionError` (module docstring)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        raise PromotionError(ExitCode.NO_GATE, f"run {run_id} not found ({exc})") from exc
    logged = client.search_logged_models(
        experiment_ids=[run.info.experiment_id],
        filter_string=f"source_run_id = '{run_id}'",
        order_by=[{"field_name": "creation_timestamp", "ascending": False}],
    )
    gated = [m for m in logged if GATE_PASSED_TAG in m.tags]
    if not gated:
        read_run_gate(run_id)  # no gate file (NO_GATE) or an unreadable one (BAD_GATE) says so
        raise PromotionError(
            ExitCode.NO_MODEL,
            f"run {run_id} has a {GATE_FILE} but no LoggedModel carrying it"
            + (" (its logged model has no gate: logged before the gated records; train and gate again)"
               if logged else " (no logged model: the training stage logs it as 'model')"),
        )  # fmt: skip
    record = gated[0]
    metrics = {m.key: m.value for m in record.metrics or []}
    needed = (COMPARISON_METRIC, HARD_RULE_SHARE, ORACLE_SHARE)
    missing = [k for k in needed if GATE_METRIC_PREFIX + k not in metrics]
    if missing:
        raise PromotionError(
            ExitCode.BAD_GATE,
            f"run {run_id}'s gated model {record.model_id} lacks the gate's "
            f"{', '.join(f'metrics.{k}' for k in missing)} (logged as {GATE_METRIC_PREFIX}<name>); re-run "
            "the gate (orthojob gate --checkpoint DIR --stage grpo): a gate written before the headline "
            "metric and the hard-rule bound has neither",
        )
    gate = {
        "passed": record.tags[GATE_PASSED_TAG] == "true",
        "score": metrics[GATE_METRIC_PREFIX + COMPARISON_METRIC],
    }
    gate |= {k: metrics[GATE_METRIC_PREFIX + k] for k in (HARD_RULE_SHARE, ORACLE_SHARE)}
    gate[ENGINE_TAG] = record.tags.get(f"orthorl.{ENGINE_TAG}", "off")  # a model gated before the engine: raw
    return record, gate


def ranked_records(
    model_ids: list[str], experiment_ids: list[str], max_hard_rule_share_over_oracle: float | None
) -> list:
    """The LoggedModels ``model_ids`` whose gate passed within the hard-rule bound, best first by the
    headline metric (``mlflow.search_logged_models``: the filter and the order are MLflow's)."""
    import mlflow

    if not model_ids:
        return []
    clauses = [f"tags.`{GATE_PASSED_TAG}` = 'true'"]
    if max_hard_rule_share_over_oracle is not None:
        clauses.append(
            f"metrics.`{GATE_METRIC_PREFIX}{EXCESS_METRIC}` <= {max_hard_rule_share_over_oracle!r}"
        )
    ids = ", ".join(f"'{i}'" for i in sorted(set(model_ids)))
    clauses.append(f"model_id IN ({ids})")
    found = mlflow.search_logged_models(
        experiment_ids=sorted(set(experiment_ids)),
        filter_string=" AND ".join(clauses),
        order_by=[{"field_name": f"metrics.{GATE_METRIC_PREFIX}{COMPARISON_METRIC}", "ascending": False}],
        output_format="list",
    )
    return found


def version_model_id(version) -> str | None:
    """The LoggedModel a registered version was made from: its ``model_id``, else its source
    ``models:/<id>``; None for a version registered from a run's artifact path."""
    found = getattr(version, "model_id", None)
    source = str(getattr(version, "source", "") or "")
    if not found and source.startswith("models:/") and "/" not in source[len("models:/") :]:
        found = source[len("models:/") :]
    return found or None


def _score(record) -> float:
    values = [m.value for m in record.metrics or [] if m.key == GATE_METRIC_PREFIX + COMPARISON_METRIC]
    return float(values[0]) if values else float("-inf")


def promote(
    run_id: str,
    model_name: str = DEFAULT_MODEL_NAME,
    force: bool = False,
    max_hard_rule_share_over_oracle: float | None = HARD_RULE_BOUND,
) -> Promotion:
    """Register the run's gated LoggedModel (alias ``candidate``; ``champion`` per the rules above), or
    raise :class:`PromotionError` and register nothing (:func:`refusal`)."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    record, gate = run_record(run_id)
    why = refusal(gate, max_hard_rule_share_over_oracle)
    if why is not None:
        raise PromotionError(
            ExitCode.BAD_GATE,
            f"run {run_id} is not registered: {why}. A planner whose gate fails, or that breaks the hard "
            "clinical rules more often than the oracle, is never a candidate; train and gate it again.",
        )
    run = client.get_run(run_id)
    try:
        version = mlflow.register_model(f"models:/{record.model_id}", model_name)
    except MlflowException as exc:
        raise PromotionError(
            ExitCode.NO_MODEL, f"run {run_id}'s model {record.model_id} could not be registered ({exc})"
        ) from exc
    v = version.version
    for key, value in {
        "gate_passed": str(gate["passed"]).lower(),
        COMPARISON_METRIC: f"{gate['score']:.6f}",
        HARD_RULE_SHARE: f"{gate[HARD_RULE_SHARE]:.6f}",
        "run_id": run_id,
        "model_id": record.model_id,
        "stage": record.tags.get(GATE_STAGE_TAG) or run.data.tags.get("orthorl.stage", "unknown"),
        ENGINE_TAG: gate[ENGINE_TAG],
    }.items():
        client.set_model_version_tag(model_name, v, key, value)
    client.set_registered_model_alias(model_name, "candidate", v)

    # the champion, from the records: the registered versions' LoggedModels, searched and ranked
    versions = client.search_model_versions(f"name = '{model_name}'")
    version_of: dict[str, int] = {}
    for mv in versions:
        if model_id := version_model_id(mv):
            version_of[model_id] = max(version_of.get(model_id, 0), int(mv.version))
    experiments = {record.experiment_id}
    for model_id in version_of:
        with contextlib.suppress(MlflowException):
            experiments.add(client.get_logged_model(model_id).experiment_id)
    ranked = ranked_records(list(version_of), list(experiments), max_hard_rule_share_over_oracle)
    others = [m for m in ranked if m.model_id != record.model_id]
    best = others[0] if others else None

    previous, previous_score, champ_model = None, None, None
    try:
        champ = client.get_model_version_by_alias(model_name, "champion")
        previous, champ_model = champ.version, version_model_id(champ)
        scored = [m for m in ranked if m.model_id == champ_model]
        previous_score = _score(scored[0]) if scored else float("-inf")
    except MlflowException:
        pass

    if force:
        champion, reason = True, "manual promotion (--force) of a passed gate"
    elif best is None:
        if previous is None:
            reason = "gate passed; no champion yet"
        elif champ_model == record.model_id:
            reason = f"gate passed; the champion v{previous} holds this model already"
        else:
            reason = (
                f"gate passed; champion v{previous} has no gate record within the bound (an older model) "
                "and no other registered model has"
            )
        champion = True
    elif gate["score"] > _score(best):
        champion, reason = (
            True,
            (
                f"gate passed and {gate['score']:.4f} beats v{version_of[best.model_id]} ({_score(best):.4f}), "
                f"the best registered record"
            ),
        )
    else:
        champion, reason = (
            False,
            (
                f"gate passed but {gate['score']:.4f} does not beat v{version_of[best.model_id]} "
                f"({_score(best):.4f}), the best registered record"
            ),
        )
    if champion:
        client.set_registered_model_alias(model_name, "champion", v)
    client.set_model_version_tag(model_name, v, "promotion", reason)
    log.info("%s v%s: candidate; %s", model_name, v, reason)
    return Promotion(model_name, v, True, champion, reason, gate["score"], previous, previous_score)


def run_promote(run_id: str, model_name: str, force: bool, **bounds) -> int:
    """``orthojob promote``: register the run's model (aliases per :mod:`orthojob.lifecycle.registry`; ``bounds``:
    :func:`orthojob.lifecycle.registry.promote`'s, e.g. ``max_hard_rule_share_over_oracle``); exit code."""
    try:
        tracking.configure()
        result = promote(run_id, model_name, force=force, **bounds)
    except tracking.TrackingError as exc:
        return report_job_error("promote", exc)
    except PromotionError as exc:
        print(f"orthojob promote: {tracking.redact(str(exc))}", file=sys.stderr)
        return exc.exit_code
    aliases = "candidate" + (", champion" if result.champion else "")
    print(f"{result.model_name} version {result.version}: {aliases} ({result.reason})")
    return 0
