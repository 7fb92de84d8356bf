"""The whole chain in one command: ``orthojob pipeline --preset tiny-cpu | qwen2.5-3b``.

Stages (each timed, each recorded in ``<out>/pipeline_summary.json``):

1. ``tiny-model`` (only when the preset's model is ``"tiny"``): the offline tiny Qwen2 model, its
   tokenizer trained on the project's prompts (:func:`orthojob.modeling.models.build_tiny`; with ``tool`` in
   the chain also on tool conversations, with 8192 positions,
   :func:`orthojob.stages.tool_sft.build_tiny_tool_model`); then ``base``
   (``base_eval``): the untrained model's held-out parse rate, format and scaled reward, for
   comparison (no gate file);
2. the preset's training ``stages`` (:data:`orthojob.stages.presets.PIPELINE_STAGES`), in order, each
   starting from the previous one's gated checkpoint, each in ``<out>/<name>`` with its gate file and
   its own MLflow stage run, which holds the training, the gate (summary entry ``gate_<name>``) and
   the gated checkpoint as an MLflow LoggedModel with its gate metrics, verdict and datasets
   (:func:`orthojob.lifecycle.model_logging.log_gated_checkpoint`, what promotion searches):

   * ``format`` -> ``format_sft``: stage 0, format SFT on demonstrations that carry no clinical
     choice (:func:`orthojob.stages.sft.run_sft`), then ``gate_format_sft`` (format only);
   * ``tool`` -> ``tool_sft``: stage 1, tool-use SFT on the oracle's tool conversations (the loss on
     the assistant's turns), then ``gate_tool_sft`` (greedy agentic episodes: tool calls, finished);
   * ``bc`` -> ``bc_sft``: stage 2, BC SFT on the oracle's safe plans, then ``gate_bc_sft``;
   * ``grpo`` -> ``grpo``: stage 3, the preset's GRPO config object with ``from_checkpoint`` = the
     previous stage, run by :func:`orthojob.stages.grpo.run_grpo` (what ``orthojob grpo`` runs; its
     pre-flight accepts the gate of any earlier stage), which writes its own gate (``gate_grpo``)
     with the preset's ``grpo_gate`` thresholds;
   * ``rsft`` -> ``rsft``: stage 4, rejection fine-tuning of the previous checkpoint
     (:func:`orthojob.stages.rsft.run_rsft`), then ``gate_rsft``.

   The default (both presets): ``bc, grpo``, the chain ``make run`` has always run;
3. ``evaluate``: every trained checkpoint (newest first) and the baselines on held-out seeds ->
   ``<out>/evaluation.json``.

Resume: a run given the same ``out`` again (a retried pod, or a Job re-applied with the same run
name) starts at the first unfinished stage. A training stage whose checkpoint is already published
under ``out`` with a *passed* gate whose digest still matches, and whose ``run_identity.json`` is
this config's (:mod:`orthojob.ops.run_identity`; another config is exit 14), is not trained again: it is
downloaded (digests checked) and recorded ``resumed_from`` in the summary, its earlier entries
carried over from the summary published beside it (``<out>/pipeline_summary.json``). GRPO is
finished when its output carries its gate file; otherwise ``run_grpo`` resumes its newest
``checkpoint-N``. The tiny model is rebuilt (seconds, deterministic), the evaluation runs again.

A failed gate stops the chain: the later training stages are skipped (each would refuse the
checkpoint), recorded as such. The evaluation runs when at least one stage passed its gate.

Exit code (:class:`orthojob.ops.exit_codes.ExitCode`): 0 when every stage ran and every gate passed;
12 when an SFT stage's gate (format, tool-use, BC, RSFT) failed; 3 when GRPO trained but its gate failed; 2
when RSFT kept no sample; otherwise the failing stage's exit code (GRPO refusing or crashing stops
the pipeline at once). The summary reports GRPO's mean reward per step, strategy accuracy, RSFT's
kept counts and every gate metric as measured, whether they rise or not. Every planner is judged
there by the headline metric, the mean scaled terminal reward (``scaled_reward_mean``, bands in
:mod:`server.reward_scaler`), beside its hard-rule share (:mod:`orthojob.core.metrics`); the evaluation's
are MLflow metrics ``scaled_reward_mean/<planner>`` and ``hard_rule_share/<planner>``.

:data:`orthojob.stages.presets.PRESETS` holds every hyper-parameter, as config objects. ``overrides``
(CLI ``--set section.key=value``, value parsed as JSON) change single values, e.g.
``{"bc_sft.steps": 100, "grpo.steps": 2, "grpo.rewards": ["format"], "grpo.use_vllm": true,
"stages": "format_sft,grpo"}``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from orthojob.core.metrics import HARD_RULE_SHARE, SCALED_REWARD, SCALED_REWARD_MEAN
from orthojob.data import case_sets
from orthojob.eval.evaluation import evaluate_checkpoint, format_table
from orthojob.lifecycle import gate_file
from orthojob.lifecycle.gate_file import BC_SFT, FORMAT_SFT, GRPO, RSFT, TOOL_SFT
from orthojob.modeling.models import TINY_MODEL, build_tiny
from orthojob.ops import run_identity, storage, tracking, work_dirs
from orthojob.ops.exit_codes import ExitCode
from orthojob.ops.records import json_value
from orthojob.stages import gate
from orthojob.stages.flags import engine_on
from orthojob.stages.gate import GateSettings
from orthojob.stages.grpo import run_grpo
from orthojob.stages.grpo_config import TRAIN_LOG_FILE
from orthojob.stages.pipeline_summary import format_summary, gate_view
from orthojob.stages.presets import FIRST_STAGES, PRESETS, Preset, apply_overrides
from orthojob.stages.rsft import RSFTError, log_rsft, run_rsft
from orthojob.stages.sft import TRAINING_CASES, log_stage, run_sft
from orthojob.stages.stage_table import SFT_SECTIONS, STAGE_TABLE
from orthojob.stages.tool_sft import build_tiny_tool_model

log = logging.getLogger(__name__)

SUMMARY_FILE = "pipeline_summary.json"
CASE_SECTIONS: tuple[str, ...] = (BC_SFT, FORMAT_SFT, TOOL_SFT, GRPO, RSFT)
"""The preset sections whose ``cases`` ``--cases`` sets: every training stage's."""
EVALUATION_FILE = "evaluation.json"


def _grpo_rewards(train_log: Path) -> dict:
    """GRPO's reward per step (TRL's ``reward`` = weighted sum) and each reward's mean, as logged."""
    if not train_log.is_file():
        return {}
    rows = [r for r in json.loads(train_log.read_text()) if "reward" in r]
    if not rows:
        return {}
    rewards = [r["reward"] for r in rows]
    per_func = sorted(
        {
            k[len("rewards/") : -len("/mean")]
            for r in rows
            for k in r
            if k.endswith("/mean") and k.startswith("rewards/")
        }
    )
    half = max(1, len(rewards) // 2)
    return {
        "steps": len(rows),
        "reward_per_step": rewards,
        "reward_mean": sum(rewards) / len(rewards),
        "reward_first_half_mean": sum(rewards[:half]) / half,
        "reward_second_half_mean": sum(rewards[half:]) / max(1, len(rewards) - half),
        "per_reward_first_last": {
            name: [rows[0].get(f"rewards/{name}/mean"), rows[-1].get(f"rewards/{name}/mean")]
            for name in per_func
        },
        "step_time_mean": sum(r.get("step_time", 0.0) for r in rows) / len(rows),
    }


def _entry(result: dict) -> dict:
    """A training stage's summary entry: its result without the list of cases it trained on (logged
    with its model in MLflow)."""
    return {k: v for k, v in result.items() if k != TRAINING_CASES}


def _preset(preset: str | Preset, overrides: dict[str, Any] | None) -> Preset:
    return apply_overrides(PRESETS[preset] if isinstance(preset, str) else preset, overrides)


def run_pipeline(preset: str | Preset, out: str | Path, overrides: dict[str, Any] | None = None) -> dict:
    """Run every stage (module docstring) inside the MLflow run ``pipeline`` (each stage a nested run);
    returns the summary (also written to ``<out>/pipeline_summary.json``) with ``exit_code``.

    ``out`` may be ``s3://bucket/prefix``: the stages run in a local work folder
    (:func:`orthojob.ops.work_dirs.local_work_dir`), each SFT stage's checkpoint is published with its gate
    file to ``<out>/<name>`` (``<out>/bc_sft`` for BC), GRPO pulls the previous one from there (digests
    checked) and pushes its result to ``<out>/grpo``."""
    import mlflow  # heavy: imported when a pipeline runs, not when the CLI parses its flags

    cfg = _preset(preset, overrides)
    if cfg.model == TINY_MODEL:  # a local model: never wait on the (unreachable) model hub
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    params = {"preset": cfg.name, "out": str(out), "overrides": overrides or {}}
    with tracking.stage_run("pipeline", params=params) as run:
        summary = _run_pipeline(cfg, out, overrides)
        summary["mlflow_run_id"] = run.info.run_id
        mlflow.log_dict(json_value(json.loads(json.dumps(summary, default=str))), SUMMARY_FILE)
        mlflow.set_tag("orthorl.exit_code", str(summary["exit_code"]))
    return summary


def _run_pipeline(cfg: Preset, out: str | Path, overrides: dict[str, Any] | None = None) -> dict:
    import mlflow  # heavy: see run_pipeline

    out_uri = str(out).rstrip("/") if storage.is_s3_uri(out) else None
    if out_uri:
        out = work_dirs.local_work_dir(out_uri)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    summary: dict[str, Any] = {
        "preset": cfg.name,
        "overrides": overrides or {},
        "config": cfg.to_dict(),
        "chain": list(cfg.stages),
        "stages": {},
    }
    stages = summary["stages"]
    earlier = _earlier_stages(out_uri, out)  # what an earlier attempt at this run recorded

    def save() -> None:
        summary["wall_seconds"] = time.perf_counter() - t_start
        text = json.dumps(summary, indent=2, default=str)
        (out / SUMMARY_FILE).write_text(text)
        if out_uri:  # beside the published stages: a retried pod carries over what they recorded
            storage.write_text(f"{out_uri}/{SUMMARY_FILE}", text)

    def finish(code: int) -> dict:
        summary["exit_code"] = int(code)
        save()
        print(format_summary(summary))
        return summary

    def publish(name: str, folder: Path) -> str:
        """A stage's checkpoint where the next stage reads it: ``<out>/<name>`` (published to S3)."""
        if not out_uri:
            return str(folder)
        return storage.publish(folder, f"{out_uri}/{name}")

    # 1. tiny model
    model = cfg.model
    sections = {key: getattr(cfg, key) for key in SFT_SECTIONS}
    if model == TINY_MODEL:
        t = time.perf_counter()
        tasks = sorted({cfg.task_id, *(t for s in cfg.stages if s in sections for t in sections[s].task_ids)})
        build = build_tiny_tool_model if TOOL_SFT in cfg.stages else build_tiny
        recipe = {"builder": build.__name__, "tasks": tasks, "force_decay": cfg.force_decay, **cfg.tiny_arch}
        folder = out / "tiny-model"
        where = f"{out_uri}/tiny-model" if out_uri else str(folder)
        if out_uri and storage.read_manifest(where) is not None:  # an earlier attempt's: same bytes
            storage.download_dir(where, folder)
        recorded = run_identity.read_identity(folder) if (folder / "config.json").is_file() else None
        reused = recorded is not None and recorded["config_digest"] == run_identity.config_digest(recipe)
        if not reused:
            build(folder, tasks, cfg.force_decay, **cfg.tiny_arch)
            run_identity.write_identity(folder, recipe)
            publish("tiny-model", folder)  # the chain's base, kept with the run for a retried pod
        model = str(folder)
        stages["tiny-model"] = {"seconds": time.perf_counter() - t, "path": model, "reused": reused}
        save()

    # 1b. the base model's held-out parse rate and format, before any training (no gate file)
    if cfg.base_eval:
        t = time.perf_counter()
        g = cfg.bc_sft_gate
        base = gate.gate_report(
            model, n_seeds=g.n_seeds, task_id=cfg.task_id, force_decay=cfg.force_decay,
            max_new_tokens=g.max_new_tokens, batch_size=g.batch_size, stage="base", thresholds=g.thresholds,
            engine=engine_on(g.engine),
        )  # fmt: skip
        stages["base"] = {"seconds": time.perf_counter() - t, **gate_view(base)}
        save()

    def finished(name: str, folder: Path, identity: dict) -> dict | None:
        """The gate of ``name`` when an earlier attempt trained, gated (passed) and published it
        under ``out`` with this config: then it is not trained again (module docstring)."""
        where = f"{out_uri}/{name}" if out_uri else str(folder)
        if out_uri:
            if storage.read_manifest(where) is None:
                return None
            storage.download_dir(where, folder)  # digests checked against its manifest
        elif not gate_file.gate_path(folder).is_file():
            return None
        try:
            content = gate_file.check_gate(folder, accept=None)
        except gate_file.GateError as exc:
            print(f"[pipeline] {name} at {where} is not reused ({exc.message[:200]}): training it again")
            return None
        if run_identity.read_identity(folder) is None:  # not written by a run that records its config
            print(f"[pipeline] {name} at {where} records no run identity: training it again")
            return None
        try:
            if not run_identity.check_resume(folder, identity, where=where):  # policy fresh
                return None
        except run_identity.RunIdentityError as exc:  # another config wrote it: exit 14, never retried
            print(f"orthojob pipeline: {exc}", file=sys.stderr)
            stages[name] = {"seconds": 0.0, "error": str(exc), "exit_code": int(exc.exit_code)}
            raise _RefusedError(int(exc.exit_code)) from exc
        print(f"[pipeline] {name}: already trained and gated at {where} (resumed, not trained again)")
        stages[name] = {"seconds": 0.0, **earlier.get(name, {}), "resumed_from": where}
        gate_entry = earlier.get(f"gate_{name}") or {"seconds": 0.0, **gate_view(content)}
        stages[f"gate_{name}"] = {**gate_entry, "resumed": True}
        save()
        return content

    def gate_stage(
        name: str, folder: Path, settings: GateSettings, params_key: str, result: dict, config: Any
    ) -> bool:
        """Evaluate a SFT stage's checkpoint and write its gate file, in the stage's run (active), where
        the checkpoint becomes a gated LoggedModel (:func:`orthojob.stages.sft.log_stage`); publish both.
        A stage ``config`` with a case set is gated on its held-out patients."""
        t = time.perf_counter()
        tracking.log_params({params_key: dataclasses.asdict(settings)})
        content = gate.run_gate(folder, name, settings, cfg.task_id, cfg.force_decay, config)
        stages[f"gate_{name}"] = {"seconds": time.perf_counter() - t, **gate_view(content)}
        log_stage(result, content, folder)
        print(gate_file.format_gate(content))
        publish(name, folder)
        save()
        return bool(content["passed"])

    def sft_stage(step: str, previous: Path | None) -> bool:
        """Stage 0 (format), 1 (tool-use) or 2 (BC): train, then gate."""
        name = key = step
        gate_key = STAGE_TABLE[step].gate_section
        settings = getattr(cfg, gate_key)
        folder = out / name
        t = time.perf_counter()
        config = dataclasses.replace(
            sections[step], model=model, out=str(folder), from_checkpoint=str(previous) if previous else None
        )
        identity = stage_identity(config, settings, previous)
        done = finished(name, folder, identity)
        if done is not None:
            return bool(done["passed"])
        with tracking.stage_run(
            name, params={key: config.to_dict(), "model": model, "force_decay": cfg.force_decay}
        ):
            result = run_sft(config)
            run_identity.write_identity(folder, identity)  # published with the checkpoint and its gate
            stages[name] = {"seconds": time.perf_counter() - t, **_entry(result)}
            save()
            return gate_stage(name, folder, settings, gate_key, result, config)

    def stage_identity(config: Any, settings: GateSettings, previous: Path | None) -> dict:
        """What makes a stage's checkpoint this run's: its config with the preset's model reference
        (not the pod-local tiny-model folder), the stage it starts from by name, and its gate."""
        ident = dataclasses.replace(
            config, model=cfg.model, from_checkpoint=previous.name if previous else None
        )
        return {**ident.to_dict(), "gate": dataclasses.asdict(settings)}

    def grpo_stage(previous: tuple[str, Path]) -> tuple[bool, int]:
        """Stage 3, which writes its own gate file: (gate passed, exit code of run_grpo)."""
        grpo_dir = out / "grpo"
        t = time.perf_counter()
        source = f"{out_uri}/{previous[0]}" if out_uri else str(previous[1])  # published by its gate stage
        target = f"{out_uri}/grpo" if out_uri else str(grpo_dir)
        grpo = dataclasses.replace(cfg.grpo, model=model, from_checkpoint=source, out=target)
        identity = {
            **dataclasses.replace(grpo, model=cfg.model, from_checkpoint=previous[0], out="grpo").to_dict(),
            "gate": cfg.grpo_gate.thresholds.to_dict(),
        }
        if out_uri and storage.read_manifest(target) is not None:  # published: trained and gated
            storage.download_dir(target, grpo_dir)
        if (
            gate_file.gate_path(grpo_dir).is_file()
            and run_identity.read_identity(grpo_dir) is not None
            and run_identity.check_resume(grpo_dir, identity, where=target)
        ):
            content = gate_file.read_gate(grpo_dir)
            print(f"[pipeline] grpo: already trained and gated at {target} (resumed, not trained again)")
            code = ExitCode.OK if content["passed"] else ExitCode.GRPO_GATE_FAILED
            stages["grpo"] = {"seconds": 0.0, "exit_code": int(code), **earlier.get("grpo", {})}
            stages["grpo"]["resumed_from"] = target
            stages["gate_grpo"] = {"seconds": None, **gate_view(content), "resumed": True}
            save()
            return bool(content["passed"]), int(code)
        grpo_dir.mkdir(parents=True, exist_ok=True)
        run_identity.write_identity(grpo_dir, identity)  # published with GRPO's output and its gate
        before = tracking.last_stage_run("grpo")
        rc = run_grpo(grpo, given=grpo.to_dict(), gate_thresholds=cfg.grpo_gate.thresholds)
        grpo_run = tracking.last_stage_run("grpo")  # the child run: last_active_run() is the pipeline's
        stages["grpo"] = {
            "seconds": time.perf_counter() - t,
            "exit_code": int(rc),
            "mlflow_run_id": grpo_run if grpo_run != before else None,
            "out": target,
            "from_checkpoint": source,
            **_grpo_rewards(grpo_dir / TRAIN_LOG_FILE),
        }
        save()
        if rc not in (0, ExitCode.GRPO_GATE_FAILED) or not gate_file.gate_path(grpo_dir).is_file():
            stages["grpo"]["error"] = f"orthojob grpo exited {rc}"
            return False, int(rc or ExitCode.FAILURE)
        content = gate_file.read_gate(grpo_dir)  # as the GRPO stage wrote (and published and logged) it
        stages["gate_grpo"] = {"seconds": content["metrics"].get("eval_seconds"), **gate_view(content)}
        return bool(content["passed"]), int(rc)

    def rsft_stage(previous: Path) -> tuple[bool, int]:
        """Stage 4: sample, keep, fine-tune, then gate. (gate passed, 0) or (False, exit code)."""
        folder = out / "rsft"
        t = time.perf_counter()
        config = dataclasses.replace(cfg.rsft, model=model, out=str(folder), from_checkpoint=str(previous))
        identity = stage_identity(config, cfg.rsft_gate, previous)
        done = finished("rsft", folder, identity)
        if done is not None:
            return bool(done["passed"]), 0
        with tracking.stage_run(
            "rsft", params={"rsft": config.to_dict(), "model": model, "force_decay": cfg.force_decay}
        ):
            try:
                result = run_rsft(config)
            except (RSFTError, gate_file.GateError) as exc:
                stages["rsft"] = {
                    "seconds": time.perf_counter() - t,
                    "error": exc.message,
                    "exit_code": exc.exit_code,
                }
                mlflow.set_tag("orthorl.refused", exc.message[:250])
                save()
                return False, int(exc.exit_code)
            log_rsft(result, folder)
            run_identity.write_identity(folder, identity)
            stages["rsft"] = {"seconds": time.perf_counter() - t, **_entry(result)}
            save()
            return gate_stage("rsft", folder, cfg.rsft_gate, "rsft_gate", result, config), 0

    # 2. the training stages, each from the previous gated checkpoint
    trained: list[tuple[str, Path, bool]] = []  # (name, folder, gate passed)
    code = 0
    try:  # a stage refusing what an earlier attempt left (another config) ends the chain at once
        for step in cfg.stages:
            name = step
            if code:
                stages[name] = {
                    "skipped": f"an earlier gate or stage failed (exit {code}): {name} refuses its checkpoint"
                }
                continue
            previous = trained[-1] if trained else None
            if step in FIRST_STAGES:
                passed = sft_stage(step, previous[1] if previous else None)
                trained.append((name, out / name, passed))
                code = 0 if passed else ExitCode.GATE_FAILED
            elif step == "grpo":
                passed, rc = grpo_stage((previous[0], previous[1]))
                if rc not in (0, ExitCode.GRPO_GATE_FAILED):
                    return finish(rc)
                trained.append((name, out / name, passed))
                code = 0 if passed else ExitCode.GRPO_GATE_FAILED
            else:
                passed, rc = rsft_stage(previous[1])
                if rc == 0:
                    trained.append((name, out / name, passed))
                code = rc or (0 if passed else ExitCode.GATE_FAILED)
    except _RefusedError as refused:
        return finish(refused.code)
    if not any(passed for _, _, passed in trained):
        return finish(code)

    # 3. evaluate every trained checkpoint (newest first) and the baselines
    t = time.perf_counter()
    e = cfg.evaluate
    with tracking.stage_run("evaluate", params={"evaluate": dataclasses.asdict(e)}):
        tasks = [cfg.task_id]
        kw = {"n_seeds": e.n_seeds, "force_decay": cfg.force_decay, "max_new_tokens": e.max_new_tokens,
              "batch_size": e.batch_size, "engine": engine_on(e.engine)}  # fmt: skip
        newest_first = [(name, folder) for name, folder, _ in reversed(trained)]
        on_set = [c for c in (cfg.grpo, cfg.bc_sft, cfg.rsft, cfg.format_sft, cfg.tool_sft) if c.cases]
        cases = on_set[0].cases if on_set else None
        if cases:  # the set's held-out patients, as the gates judged them
            kw["keys"], _ = case_sets.heldout_cases(cases, on_set[0].heldout_share, cfg.force_decay)
            tasks = list(dict.fromkeys(k.task_id for k in kw["keys"]))
        first_name, first_folder = newest_first[0]
        report = evaluate_checkpoint(str(first_folder), tasks, baselines=e.baselines, name=first_name, **kw)
        rows = {task: {first_name: report[task].pop(first_name)} for task in tasks}
        for name, folder in newest_first[1:]:
            other = evaluate_checkpoint(str(folder), tasks, baselines=False, name=name, **kw)
            for task in tasks:
                rows[task][name] = other[task][name]
        for task in tasks:
            rows[task].update(report[task])  # the baselines after the checkpoints
        report = rows
        (out / EVALUATION_FILE).write_text(
            json.dumps({"n_seeds": e.n_seeds, "force_decay": cfg.force_decay, "results": report}, indent=2)
        )
        table = format_table(report, len(kw["keys"]) if cases else e.n_seeds, cfg.force_decay, source=cases)
        print(table)
        stages["evaluate"] = {
            "seconds": time.perf_counter() - t,
            "file": str(out / EVALUATION_FILE),
            SCALED_REWARD_MEAN: {p: s[SCALED_REWARD]["mean"] for p, s in report[tasks[0]].items()},
            HARD_RULE_SHARE: {p: s[HARD_RULE_SHARE]["mean"] for p, s in report[tasks[0]].items()},
            "model_metrics": {
                p: s["model_metrics"] for p, s in report[tasks[0]].items() if "model_metrics" in s
            },
        }
        tracking.log_metrics(
            {
                f"{key}/{p}": v
                for key in (SCALED_REWARD_MEAN, HARD_RULE_SHARE)
                for p, v in stages["evaluate"][key].items()
            }
        )
        mlflow.log_artifact(str(out / EVALUATION_FILE))
    return finish(code)


class _RefusedError(Exception):
    """A stage found what it cannot resume (another config's checkpoint); ``code`` is the exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _earlier_stages(out_uri: str | None, out: Path) -> dict:
    """The ``stages`` an earlier attempt at this output recorded (its published summary), or {}."""
    text = storage.read_text(f"{out_uri}/{SUMMARY_FILE}") if out_uri else None
    if text is None and (out / SUMMARY_FILE).is_file():
        text = (out / SUMMARY_FILE).read_text()
    try:
        return dict(json.loads(text).get("stages") or {}) if text else {}
    except (ValueError, AttributeError):
        return {}


__all__ = ["format_summary", "run_pipeline"]
