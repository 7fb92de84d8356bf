"""The treatment viewer's pages as MLflow artifacts: of a checkpoint's and the baselines' evaluations, and
of the best and worst completions of a GRPO run (:func:`grpo_viewer_callback`).
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from orthojob.core.parsing import find_plan
from orthojob.eval.engine_view import rollout_views
from orthojob.eval.plan_geometry import PlanView
from orthojob.eval.viewer import (
    BASELINE_PLANS,
    EVALUATION_VIEWER_CASES,
    GRPO_VIEWER_EVERY,
    VIEWER_ARTIFACT_DIR,
    write_viewer,
)
from orthojob.rewards.rollouts import score_texts
from server.cases import Case, CaseKey, generate_case
from server.dental_environment import initial_observation
from server.oracle import oracle_plan

log = logging.getLogger(__name__)


def _active_mlflow():
    """The mlflow module when a run is active in this process (it was imported by the job), else None."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or mlflow.active_run() is None:
        return None
    return mlflow


def log_viewer(
    case: Case, plans: Sequence[tuple[str, dict, str | None] | PlanView], artifact_path: str, file_name: str
) -> Path | None:
    """Write a viewer (:func:`orthojob.eval.viewer.write_viewer` of ``plans``) and log it to the active
    MLflow run under ``artifact_path``; None (nothing written) when no run is active. A failure is logged
    and never stops the caller."""
    mlflow = _active_mlflow()
    if mlflow is None:
        return None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = write_viewer(Path(tmp) / file_name, case, plans)
            mlflow.log_artifact(str(path), artifact_path=artifact_path)
        return Path(artifact_path) / file_name
    except Exception as exc:  # a picture never fails a job
        log.warning("viewer %s/%s not logged: %s", artifact_path, file_name, exc)
        return None


def reference_plans(case: Case) -> list[tuple[str, dict, None]]:
    """The oracle's and uniform SLERP's plans for a case (the references a viewer compares with)."""

    return [
        ("oracle", oracle_plan(initial_observation(case)), None),
        ("uniform_slerp", BASELINE_PLANS["uniform_slerp"], None),
    ]


def log_checkpoint_viewers(episodes, name: str, per_task: int = EVALUATION_VIEWER_CASES) -> list[Path]:
    """Viewers of a checkpoint's evaluation (:class:`orthojob.eval.evaluation.CheckpointEpisodes`): for the
    first ``per_task`` held-out cases of each task, the checkpoint's greedy plan against the oracle's
    and uniform SLERP's, under ``viewers/evaluate/<name>/``. Where the evaluation ran the plans through the
    staging engine and it changed the plan, the plan as written and the plan it executed (both from the
    episode's rollout, :func:`orthojob.eval.engine_view.rollout_views`) are shown beside the references;
    a plan it executed as written is shown once, saying so. A completion without a plan is shown by the
    references only. Nothing when no MLflow run is active."""
    if _active_mlflow() is None:
        return []
    logged = []
    for task_id in dict.fromkeys(episodes.task_ids):
        for i in episodes.select(task_id)[:per_task]:
            case = generate_case(task_id, episodes.seeds[i], episodes.force_decay)
            rollout = episodes.rollouts[i]
            try:
                mine = rollout_views(case, name, rollout, episodes.texts[i]) if rollout.error is None else []
            except Exception as exc:  # a picture never fails a job
                log.warning("viewer of %s on %s seed %d not drawn: %s", name, task_id, case.seed, exc)
                continue
            path = log_viewer(
                case, mine + reference_plans(case), f"{VIEWER_ARTIFACT_DIR}/evaluate/{name}",
                f"{task_id}_seed{case.seed}.html",
            )  # fmt: skip
            if path is not None:
                logged.append(path)
    return logged


def log_baseline_viewers(
    task_ids: Sequence[str],
    seed_start: int,
    force_decay: bool = False,
    non_compliance: bool = False,
    per_task: int = EVALUATION_VIEWER_CASES,
) -> list[Path]:
    """Viewers of a baseline evaluation: oracle against uniform SLERP on the first ``per_task``
    held-out cases of each task, under ``viewers/evaluate/baselines/``. Nothing without an MLflow run."""
    if _active_mlflow() is None:
        return []
    logged = []
    for task_id in task_ids:
        for seed in range(seed_start, seed_start + per_task):
            case = generate_case(task_id, seed, force_decay, non_compliance and task_id == "task_hard")
            path = log_viewer(
                case, reference_plans(case), f"{VIEWER_ARTIFACT_DIR}/evaluate/baselines",
                f"{task_id}_seed{seed}.html",
            )  # fmt: skip
            if path is not None:
                logged.append(path)
    return logged


def best_and_worst(records: Sequence[dict]) -> tuple[int, int] | None:
    """Indices of the best and the worst scored completion among GRPO's ``completions.jsonl``
    records (``completion``, ``task_id``, ``seed``, ``force_decay``), by the scaled reward the
    environment gives them (:func:`orthojob.rewards.rollouts.score_texts`, the rewards' own rollouts);
    completions holding no plan are not candidates. None when none holds one."""

    rolls = score_texts([r["completion"] for r in records], [CaseKey.of_row(r) for r in records])
    scored = [i for i, r in enumerate(rolls) if r.error is None]
    if not scored:
        return None
    key = [rolls[i].scaled_reward for i in scored]
    return scored[int(np.argmax(key))], scored[int(np.argmin(key))]


def new_records(path: Path, offset: int) -> tuple[list[dict], int]:
    """The JSON lines of ``path`` from byte ``offset`` on (whole lines only) and the new offset."""
    if not path.is_file():
        return [], offset
    with open(path, "rb") as fh:
        fh.seek(offset)
        chunk = fh.read()
    end = chunk.rfind(b"\n") + 1
    lines = chunk[:end].decode("utf-8", errors="replace").splitlines()
    return [json.loads(line) for line in lines if line.strip()], offset + end


def log_grpo_viewers(records: Sequence[dict], step: int) -> list[Path]:
    """The best and the worst completion of a GRPO step's records, each against the oracle on its
    case, under ``viewers/grpo/`` (``step_000010_best.html``); nothing without an MLflow run."""
    if _active_mlflow() is None or not records:
        return []
    picked = best_and_worst(records)
    if picked is None:
        log.info("GRPO step %d: no completion holds a plan; no viewer", step)
        return []
    logged = []
    for label, i in zip(("best", "worst"), picked):
        r = records[i]
        case = generate_case(r["task_id"], int(r["seed"]), bool(r.get("force_decay", False)))
        plan = find_plan(r["completion"])[0]
        oracle = reference_plans(case)[0]
        path = log_viewer(
            case, [(f"step {step} {label}", plan, r["completion"]), oracle],
            f"{VIEWER_ARTIFACT_DIR}/grpo", f"step_{step:06d}_{label}.html",
        )  # fmt: skip
        if path is not None:
            logged.append(path)
    return logged


def grpo_viewer_callback(completions_path: str | Path, every: int = GRPO_VIEWER_EVERY):
    """A TrainerCallback (rank 0) that every ``every`` optimizer steps, and at the end of training,
    logs the viewers of the best and the worst completion generated since its last look (the new
    records of GRPO's ``completions.jsonl``) to the active MLflow run."""
    from transformers import TrainerCallback

    path = Path(completions_path)

    class GrpoViewers(TrainerCallback):
        def __init__(self):
            self.offset = 0
            self.logged: list[Path] = []

        def _look(self, step: int) -> None:
            records, self.offset = new_records(path, self.offset)
            if records:  # the latest generation batch among the new records
                last = max(int(r.get("step", 0)) for r in records)
                self.logged += log_grpo_viewers([r for r in records if int(r.get("step", 0)) == last], step)

        def on_step_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero and every > 0 and state.global_step % every == 0:
                self._look(state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero and every > 0 and state.global_step % every != 0:
                self._look(state.global_step)

    return GrpoViewers()
