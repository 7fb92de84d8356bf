"""The whole chain in one command: ``orthojob pipeline --preset tiny-cpu | qwen2.5-3b``.

Stages (each timed, each recorded in ``<out>/pipeline_summary.json``):

1. ``tiny-model`` (only when the preset's model is ``"tiny"``): the offline tiny Qwen2 model, its
   tokenizer trained on the project's prompts (:func:`orthojob.modeling.models.build_tiny`; with ``tool_sft``
   in the chain also on tool conversations, with 8192 positions,
   :func:`orthojob.stages.tool_sft.build_tiny_tool_model`); then ``base``
   (``base_eval``): the untrained model's held-out parse rate, format and scaled reward, for
   comparison (no gate file);
2. the preset's training ``stages``, in order: one loop over :data:`orthojob.stages.stage_table.STAGE_TABLE`
   (:meth:`_Chain.run_stage`), each stage starting from the previous one's gated checkpoint, in
   ``<out>/<key>`` with its gate file and its own MLflow stage run ``<key>``, which holds the training,
   the gate (summary entry ``gate_<key>``, thresholds from the preset's ``<key>_gate`` section) and the
   gated checkpoint as an MLflow LoggedModel with its gate metrics, verdict and datasets
   (:func:`orthojob.lifecycle.model_logging.log_gated_checkpoint`, what promotion searches). The stage's
   ``trainer`` picks how it trains:

   * ``sft`` (``format_sft``, ``tool_sft``, ``bc_sft``: stages 0-2): TRL's SFTTrainer
     (:func:`orthojob.stages.sft.run_sft`), then the gate (:func:`orthojob.stages.gate.run_gate`);
   * ``grpo`` (stage 3): the GRPO job, what ``orthojob grpo`` runs (:func:`orthojob.stages.grpo.run_grpo`;
     its pre-flight accepts the gate of any earlier stage), which gates its saved checkpoint with the same
     gate module before it publishes it (the TrainJob runs that job alone on a cluster);
   * ``rsft`` (stage 4): rejection fine-tuning (:func:`orthojob.stages.rsft.run_rsft`), then the gate.

   The default (both presets): ``bc_sft, grpo``, the chain ``make run`` has always run;
3. ``evaluate``: every trained checkpoint (newest first) and the baselines on held-out seeds ->
   ``<out>/evaluation.json``.

Resume, the same for every stage (:meth:`_Chain.finished`): a run given the same ``out`` again (a
retried pod, or a Job re-applied with the same run name) starts at the first unfinished stage. A
training stage whose checkpoint is already published under ``out`` with its gate file, whose digest
still matches, and whose ``run_identity.json`` is this config's (:mod:`orthojob.ops.run_identity`;
another config is exit 14), is not trained again: it is downloaded (digests checked) and recorded
``resumed_from`` in the summary, its earlier entries carried over from the summary published beside
it (``<out>/pipeline_summary.json``). A gate that failed is kept as it is (this config would be
judged the same again): the chain stops there with that gate's exit code. An unfinished GRPO
resumes its newest ``checkpoint-N`` (:func:`orthojob.stages.grpo.run_grpo`). The tiny model is
reused when its recipe is recorded, the evaluation runs again.

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
from orthojob.stages.grpo import run_grpo
from orthojob.stages.grpo_config import TRAIN_LOG_FILE
from orthojob.stages.pipeline_summary import format_summary, gate_view
from orthojob.stages.presets import PRESETS, Preset, apply_overrides
from orthojob.stages.rsft import RSFTError, log_rsft, run_rsft
from orthojob.stages.sft import TRAINING_CASES, log_stage, run_sft
from orthojob.stages.stage_table import SFT_SECTIONS, STAGE_TABLE, Stage
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


@dataclasses.dataclass
class _Outcome:
    """What a training stage left: its folder, whether its gate passed, and the exit code it ends the
    chain with (0 while the chain goes on; ``fatal``: stop at once, without the evaluation)."""

    key: str
    folder: Path
    passed: bool
    code: int = 0
    trained: bool = True
    """False where the stage left no checkpoint (RSFT keeping no sample)."""
    fatal: bool = False


def _run_pipeline(cfg: Preset, out: str | Path, overrides: dict[str, Any] | None = None) -> dict:
    chain = _Chain(cfg, out, overrides)
    chain.base_model()
    trained: list[_Outcome] = []
    code = 0
    try:  # a stage refusing what an earlier attempt left (another config) ends the chain at once
        for key in cfg.stages:
            if code:
                chain.stages[key] = {
                    "skipped": f"an earlier gate or stage failed (exit {code}): {key} refuses its checkpoint"
                }
                continue
            outcome = chain.run_stage(STAGE_TABLE[key], trained[-1] if trained else None)
            if outcome.fatal:
                return chain.finish(outcome.code)
            if outcome.trained:
                trained.append(outcome)
            code = outcome.code
    except _RefusedError as refused:
        return chain.finish(refused.code)
    if any(o.passed for o in trained):
        chain.evaluate(trained)
    return chain.finish(code)


class _Chain:
    """One pipeline run's state (its summary, output and model) and its steps: the base model, each
    training stage (:meth:`run_stage`: resumed or trained, then gated), the evaluation."""

    def __init__(self, cfg: Preset, out: str | Path, overrides: dict[str, Any] | None) -> None:
        self.cfg = cfg
        self.out_uri = str(out).rstrip("/") if storage.is_s3_uri(out) else None
        self.out = Path(work_dirs.local_work_dir(self.out_uri) if self.out_uri else out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.t_start = time.perf_counter()
        self.summary: dict[str, Any] = {
            "preset": cfg.name,
            "overrides": overrides or {},
            "config": cfg.to_dict(),
            "chain": list(cfg.stages),
            "stages": {},
        }
        self.stages: dict[str, Any] = self.summary["stages"]
        self.earlier = _earlier_stages(self.out_uri, self.out)  # what an earlier attempt at this run recorded
        self.model = cfg.model

    # --- the run's record --------------------------------------------------------------------

    def save(self) -> None:
        self.summary["wall_seconds"] = time.perf_counter() - self.t_start
        text = json.dumps(self.summary, indent=2, default=str)
        (self.out / SUMMARY_FILE).write_text(text)
        if self.out_uri:  # beside the published stages: a retried pod carries over what they recorded
            storage.write_text(f"{self.out_uri}/{SUMMARY_FILE}", text)

    def finish(self, code: int) -> dict:
        self.summary["exit_code"] = int(code)
        self.save()
        print(format_summary(self.summary))
        return self.summary

    def where(self, name: str) -> str:
        """Where stage ``name``'s result lives: ``<out>/<name>`` (an ``s3://`` URI or the local folder)."""
        return f"{self.out_uri}/{name}" if self.out_uri else str(self.out / name)

    def publish(self, name: str, folder: Path) -> str:
        """A stage's checkpoint where the next stage reads it: ``<out>/<name>`` (published to S3)."""
        if not self.out_uri:
            return str(folder)
        return storage.publish(folder, f"{self.out_uri}/{name}")

    # --- 1. the base model ---------------------------------------------------------------------

    def base_model(self) -> None:
        """The tiny model when the preset names it (rebuilt, or reused when its recipe is recorded), then
        the base model's held-out figures (``base_eval``)."""
        cfg = self.cfg
        sections = {key: getattr(cfg, key) for key in SFT_SECTIONS}
        if cfg.model == TINY_MODEL:
            t = time.perf_counter()
            tasks = sorted(
                {cfg.task_id, *(t for s in cfg.stages if s in sections for t in sections[s].task_ids)}
            )
            build = build_tiny_tool_model if TOOL_SFT in cfg.stages else build_tiny
            recipe = {
                "builder": build.__name__,
                "tasks": tasks,
                "force_decay": cfg.force_decay,
                **cfg.tiny_arch,
            }
            folder = self.out / "tiny-model"
            where = self.where("tiny-model")
            if self.out_uri and storage.read_manifest(where) is not None:  # an earlier attempt's: same bytes
                storage.download_dir(where, folder)
            recorded = run_identity.read_identity(folder) if (folder / "config.json").is_file() else None
            reused = recorded is not None and recorded["config_digest"] == run_identity.config_digest(recipe)
            if not reused:
                build(folder, tasks, cfg.force_decay, **cfg.tiny_arch)
                run_identity.write_identity(folder, recipe)
                self.publish("tiny-model", folder)  # the chain's base, kept with the run for a retried pod
            self.model = str(folder)
            self.stages["tiny-model"] = {
                "seconds": time.perf_counter() - t,
                "path": self.model,
                "reused": reused,
            }
            self.save()
        if cfg.base_eval:  # the untrained model's parse rate and format, for comparison (no gate file)
            t = time.perf_counter()
            g = cfg.bc_sft_gate
            base = gate.gate_report(
                self.model, n_seeds=g.n_seeds, task_id=cfg.task_id, force_decay=cfg.force_decay,
                max_new_tokens=g.max_new_tokens, batch_size=g.batch_size, stage="base", thresholds=g.thresholds,
                engine=engine_on(g.engine),
            )  # fmt: skip
            self.stages["base"] = {"seconds": time.perf_counter() - t, **gate_view(base)}
            self.save()

    # --- 2. a training stage -------------------------------------------------------------------

    def run_stage(self, stage: Stage, previous: _Outcome | None) -> _Outcome:
        """``stage`` from ``previous``'s gated checkpoint (None: from the base model): resumed where an
        earlier attempt at this run trained and gated it with this config (:meth:`finished`), else
        trained and gated by its trainer's step."""
        folder = self.out / stage.key
        train = {"sft": self.train_sft, "grpo": self.train_grpo, "rsft": self.train_rsft}[stage.trainer]
        config, identity = self.stage_config(stage, folder, previous)
        content = self.finished(stage, folder, identity)
        if content is not None:
            passed = bool(content["passed"])
            return _Outcome(stage.key, folder, passed, 0 if passed else stage.gate_failed_code)
        return train(stage, folder, config, identity, previous)

    def stage_config(self, stage: Stage, folder: Path, previous: _Outcome | None) -> tuple[Any, dict]:
        """The stage's config for this run (the preset's section, this run's model, output and start),
        and its identity: what makes a checkpoint this run's (its config with the preset's model
        reference, not the pod-local tiny-model folder, the stage it starts from by name, its gate)."""
        section = getattr(self.cfg, stage.section)
        if stage.trainer == "grpo":  # GRPO reads and writes ``<out>/<key>`` itself (S3 in and out)
            source = self.where(previous.key) if previous else None
            config = dataclasses.replace(
                section, model=self.model, from_checkpoint=source, out=self.where(stage.key)
            )
            ident = dataclasses.replace(config, model=self.cfg.model, out=stage.key)
        else:
            start = str(previous.folder) if previous else None
            config = dataclasses.replace(section, model=self.model, out=str(folder), from_checkpoint=start)
            ident = dataclasses.replace(config, model=self.cfg.model)
        ident = dataclasses.replace(ident, from_checkpoint=previous.key if previous else None)
        settings = getattr(self.cfg, stage.gate_section)
        gate_identity = (
            settings.thresholds.to_dict() if stage.trainer == "grpo" else dataclasses.asdict(settings)
        )
        return config, {**ident.to_dict(), "gate": gate_identity}

    def finished(self, stage: Stage, folder: Path, identity: dict) -> dict | None:
        """The gate of ``stage`` when an earlier attempt trained, gated and published it under ``out``
        with this config (its gate file intact, passed or failed: this config would be judged the same
        again): then it is not trained again (module docstring)."""
        name, where = stage.key, self.where(stage.key)
        if self.out_uri:
            if storage.read_manifest(where) is None:
                return None
            storage.download_dir(where, folder)  # digests checked against its manifest
        elif not gate_file.gate_path(folder).is_file():
            return None
        try:
            content = gate_file.check_gate(folder, accept=None, passed_only=False)
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
            self.stages[name] = {"seconds": 0.0, "error": str(exc), "exit_code": int(exc.exit_code)}
            raise _RefusedError(int(exc.exit_code)) from exc
        print(f"[pipeline] {name}: already trained and gated at {where} (resumed, not trained again)")
        self.stages[name] = {"seconds": 0.0, **self.earlier.get(name, {}), "resumed_from": where}
        gate_entry = self.earlier.get(f"gate_{name}") or {"seconds": 0.0, **gate_view(content)}
        self.stages[f"gate_{name}"] = {**gate_entry, "resumed": True}
        self.save()
        return content

    def gate(self, stage: Stage, folder: Path, result: dict, config: Any) -> _Outcome:
        """Evaluate a stage's checkpoint and write its gate file, in the stage's run (active), where the
        checkpoint becomes a gated LoggedModel (:func:`orthojob.stages.sft.log_stage`); publish both.
        A stage ``config`` with a case set is gated on its held-out patients."""
        t = time.perf_counter()
        settings = getattr(self.cfg, stage.gate_section)
        tracking.log_params({stage.gate_section: dataclasses.asdict(settings)})
        content = gate.run_gate(folder, stage.key, settings, self.cfg.task_id, self.cfg.force_decay, config)
        self.stages[f"gate_{stage.key}"] = {"seconds": time.perf_counter() - t, **gate_view(content)}
        log_stage(result, content, folder)
        print(gate_file.format_gate(content))
        self.publish(stage.key, folder)
        self.save()
        passed = bool(content["passed"])
        return _Outcome(stage.key, folder, passed, 0 if passed else stage.gate_failed_code)

    def stage_params(self, stage: Stage, config: Any) -> dict:
        return {stage.section: config.to_dict(), "model": self.model, "force_decay": self.cfg.force_decay}

    def train_sft(self, stage: Stage, folder: Path, config: Any, identity: dict, previous) -> _Outcome:
        """Stage 0 (format), 1 (tool-use) or 2 (BC): TRL's SFTTrainer, then the gate."""
        t = time.perf_counter()
        with tracking.stage_run(stage.key, params=self.stage_params(stage, config)):
            result = run_sft(config)
            run_identity.write_identity(folder, identity)  # published with the checkpoint and its gate
            self.stages[stage.key] = {"seconds": time.perf_counter() - t, **_entry(result)}
            self.save()
            return self.gate(stage, folder, result, config)

    def train_rsft(self, stage: Stage, folder: Path, config: Any, identity: dict, previous) -> _Outcome:
        """Stage 4: sample, keep, fine-tune, then the gate; RSFT keeping no sample ends the chain."""
        t = time.perf_counter()
        with tracking.stage_run(stage.key, params=self.stage_params(stage, config)):
            try:
                result = run_rsft(config)
            except (RSFTError, gate_file.GateError) as exc:
                self.stages[stage.key] = {
                    "seconds": time.perf_counter() - t,
                    "error": exc.message,
                    "exit_code": exc.exit_code,
                }
                import mlflow  # imported by the stage run already

                mlflow.set_tag("orthorl.refused", exc.message[:250])
                self.save()
                return _Outcome(stage.key, folder, False, int(exc.exit_code), trained=False)
            log_rsft(result, folder)
            run_identity.write_identity(folder, identity)
            self.stages[stage.key] = {"seconds": time.perf_counter() - t, **_entry(result)}
            self.save()
            return self.gate(stage, folder, result, config)

    def train_grpo(self, stage: Stage, folder: Path, config: Any, identity: dict, previous) -> _Outcome:
        """Stage 3: the GRPO job (:func:`orthojob.stages.grpo.run_grpo`, what ``orthojob grpo`` runs),
        which gates its checkpoint itself with the preset's gate thresholds, in its own stage run, before
        it publishes it: the TrainJob runs that job alone on a cluster, so the gate is part of it. A
        refusal or crash stops the chain at once."""
        t = time.perf_counter()
        folder.mkdir(parents=True, exist_ok=True)
        run_identity.write_identity(folder, identity)  # published with GRPO's output and its gate
        before = tracking.last_stage_run(stage.key)
        thresholds = getattr(self.cfg, stage.gate_section).thresholds
        rc = run_grpo(config, given=config.to_dict(), gate_thresholds=thresholds)
        grpo_run = tracking.last_stage_run(stage.key)  # the child run: last_active_run() is the pipeline's
        self.stages[stage.key] = {
            "seconds": time.perf_counter() - t,
            "exit_code": int(rc),
            "mlflow_run_id": grpo_run if grpo_run != before else None,
            "out": config.out,
            "from_checkpoint": config.from_checkpoint,
            **_grpo_rewards(folder / TRAIN_LOG_FILE),
        }
        self.save()
        if rc not in (0, stage.gate_failed_code) or not gate_file.gate_path(folder).is_file():
            self.stages[stage.key]["error"] = f"orthojob {stage.command} exited {rc}"
            return _Outcome(stage.key, folder, False, int(rc or ExitCode.FAILURE), fatal=True)
        content = gate_file.read_gate(folder)  # as the GRPO job wrote (and published and logged) it
        self.stages[f"gate_{stage.key}"] = {
            "seconds": content["metrics"].get("eval_seconds"),
            **gate_view(content),
        }
        passed = bool(content["passed"])
        return _Outcome(stage.key, folder, passed, 0 if passed else stage.gate_failed_code)

    # --- 3. the evaluation ---------------------------------------------------------------------

    def evaluate(self, trained: list[_Outcome]) -> None:
        """Every trained checkpoint (newest first) and the baselines on held-out seeds (or the case set's
        held-out patients, as the gates judged them) -> ``<out>/evaluation.json``."""
        import mlflow  # heavy: see run_pipeline

        cfg, t = self.cfg, time.perf_counter()
        e = cfg.evaluate
        with tracking.stage_run("evaluate", params={"evaluate": dataclasses.asdict(e)}):
            tasks = [cfg.task_id]
            kw = {"n_seeds": e.n_seeds, "force_decay": cfg.force_decay, "max_new_tokens": e.max_new_tokens,
                  "batch_size": e.batch_size, "engine": engine_on(e.engine)}  # fmt: skip
            newest_first = [(o.key, o.folder) for o in reversed(trained)]
            on_set = [c for c in (cfg.grpo, cfg.bc_sft, cfg.rsft, cfg.format_sft, cfg.tool_sft) if c.cases]
            cases = on_set[0].cases if on_set else None
            if cases:
                kw["keys"], _ = case_sets.heldout_cases(cases, on_set[0].heldout_share, cfg.force_decay)
                tasks = list(dict.fromkeys(k.task_id for k in kw["keys"]))
            first_name, first_folder = newest_first[0]
            report = evaluate_checkpoint(
                str(first_folder), tasks, baselines=e.baselines, name=first_name, **kw
            )
            rows = {task: {first_name: report[task].pop(first_name)} for task in tasks}
            for name, folder in newest_first[1:]:
                other = evaluate_checkpoint(str(folder), tasks, baselines=False, name=name, **kw)
                for task in tasks:
                    rows[task][name] = other[task][name]
            for task in tasks:
                rows[task].update(report[task])  # the baselines after the checkpoints
            report = rows
            path = self.out / EVALUATION_FILE
            path.write_text(
                json.dumps(
                    {"n_seeds": e.n_seeds, "force_decay": cfg.force_decay, "results": report}, indent=2
                )
            )
            print(
                format_table(report, len(kw["keys"]) if cases else e.n_seeds, cfg.force_decay, source=cases)
            )
            first = report[tasks[0]]
            self.stages["evaluate"] = {
                "seconds": time.perf_counter() - t,
                "file": str(path),
                SCALED_REWARD_MEAN: {p: s[SCALED_REWARD]["mean"] for p, s in first.items()},
                HARD_RULE_SHARE: {p: s[HARD_RULE_SHARE]["mean"] for p, s in first.items()},
                "model_metrics": {p: s["model_metrics"] for p, s in first.items() if "model_metrics" in s},
            }
            tracking.log_metrics(
                {
                    f"{key}/{p}": v
                    for key in (SCALED_REWARD_MEAN, HARD_RULE_SHARE)
                    for p, v in self.stages["evaluate"][key].items()
                }
            )
            mlflow.log_artifact(str(path))


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
