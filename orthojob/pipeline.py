"""The whole chain in one command: ``orthojob pipeline --preset tiny-cpu | qwen2.5-3b``.

Stages (each timed, each recorded in ``<out>/pipeline_summary.json``):

1. ``tiny-model`` (only when the preset's model is ``"tiny"``): the offline tiny Qwen2 model, its
   tokenizer trained on the project's prompts (:func:`orthojob.models.build_tiny`); then ``base``
   (``base_eval``): the untrained model's held-out parse rate, format and terminal reward, for
   comparison (no gate file);
2. ``sft0``: format SFT on oracle demonstrations (:func:`orthojob.sft.run_sft`) -> ``<out>/sft0``;
3. ``gate_sft0``: held-out format gate (:mod:`orthojob.gate`) -> ``<out>/sft0/gate_passed.json``;
   a failed gate stops the pipeline (GRPO would refuse it) with exit code 12;
4. ``grpo``: the preset's GRPO config object with ``from_checkpoint=<out>/sft0``, run by
   :func:`orthojob.grpo.run_grpo` (what ``orthojob train`` runs; its pre-flight checks the SFT
   gate) -> ``<out>/grpo``;
5. ``gate_grpo``: GRPO's own gate, the held-out evaluation after training, written once by the GRPO
   stage with the preset's ``grpo_gate`` thresholds -> ``<out>/grpo/gate_passed.json`` (read back here);
6. ``evaluate``: both checkpoints and the baselines on held-out seeds -> ``<out>/evaluation.json``.

Exit code (:class:`orthojob.exit_codes.ExitCode`): 0 when every stage ran and both gates passed;
12 when the SFT gate failed (GRPO is not run); 3 when GRPO trained but its gate failed (the
evaluation still runs and everything is written); otherwise the failing stage's exit code. The
summary reports GRPO's mean reward per step, strategy accuracy and every gate metric as
measured, whether they rise or not.

:data:`orthojob.presets.PRESETS` holds every hyper-parameter, as config objects. ``overrides``
(CLI ``--set section.key=value``, value parsed as JSON) change single values, e.g.
``{"sft.steps": 100, "grpo.steps": 2, "grpo.rewards": ["format"], "grpo.use_vllm": true}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from orthojob import gate, mlops, storage, tracking
from orthojob.evaluation import evaluate_checkpoint, format_table
from orthojob.exit_codes import ExitCode
from orthojob.grpo import run_grpo
from orthojob.grpo_config import TRAIN_LOG_FILE, ConfigError
from orthojob.models import TINY_MODEL, build_tiny
from orthojob.presets import PRESETS, Preset, apply_overrides
from orthojob.records import json_value
from orthojob.sft import run_sft

log = logging.getLogger(__name__)

SUMMARY_FILE = "pipeline_summary.json"
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


def _gate_view(content: dict) -> dict:
    keys = ("parse_rate", "format_reward", "terminal_mean", "uniform_slerp_terminal_mean", "oracle_terminal_mean",
            "margin_over_slerp", "strategy_accuracy", "truncated_rate", "mean_completion_tokens", "eval_seconds")  # fmt: skip
    m = content.get("metrics", {})
    return {"passed": content.get("passed"), "checks": content.get("checks")} | {k: m.get(k) for k in keys}


def _preset(preset: str | Preset, overrides: dict[str, Any] | None) -> Preset:
    return apply_overrides(PRESETS[preset] if isinstance(preset, str) else preset, overrides)


def run_pipeline(preset: str | Preset, out: str | Path, overrides: dict[str, Any] | None = None) -> dict:
    """Run every stage (module docstring) inside the MLflow run ``pipeline`` (each stage a nested run);
    returns the summary (also written to ``<out>/pipeline_summary.json``) with ``exit_code``.

    ``out`` may be ``s3://bucket/prefix``: the stages run in a local work folder
    (:func:`orthojob.mlops.local_work_dir`), the gated SFT checkpoint is published to ``<out>/sft0``
    and GRPO pulls it from there (digests checked) and pushes its result to ``<out>/grpo``."""
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

    out_uri = str(out) if storage.is_s3_uri(out) else None
    if out_uri:
        out = mlops.local_work_dir(out_uri)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    summary: dict[str, Any] = {
        "preset": cfg.name,
        "overrides": overrides or {},
        "config": cfg.to_dict(),
        "stages": {},
    }
    stages = summary["stages"]

    def save() -> None:
        summary["wall_seconds"] = time.perf_counter() - t_start
        (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str))

    def finish(code: int) -> dict:
        summary["exit_code"] = int(code)
        save()
        print(format_summary(summary))
        return summary

    # 1. tiny model
    model = cfg.model
    if model == TINY_MODEL:
        t = time.perf_counter()
        tasks = sorted({cfg.task_id, *cfg.sft.task_ids})
        model = str(build_tiny(out / "tiny-model", tasks, cfg.force_decay, **cfg.tiny_arch))
        stages["tiny-model"] = {"seconds": time.perf_counter() - t, "path": model}
        save()

    def gate_evaluation(path: str, stage: str) -> dict:
        """The held-out gate evaluation with the preset's ``sft_gate`` settings."""
        g = cfg.sft_gate
        return gate.gate_report(
            path, n_seeds=g.n_seeds, task_id=cfg.task_id, force_decay=cfg.force_decay,
            max_new_tokens=g.max_new_tokens, batch_size=g.batch_size, stage=stage, thresholds=g.thresholds,
        )  # fmt: skip

    # 1b. the base model's held-out parse rate and format, before any training (no gate file)
    if cfg.base_eval:
        t = time.perf_counter()
        base = gate_evaluation(model, "base")
        stages["base"] = {"seconds": time.perf_counter() - t, **_gate_view(base)}
        save()

    # 2. SFT stage 0
    sft_dir = out / "sft0"
    t = time.perf_counter()
    sft = dataclasses.replace(cfg.sft, model=model, out=str(sft_dir))
    with tracking.stage_run(
        "sft0", params={"sft": sft.to_dict(), "model": model, "force_decay": cfg.force_decay}
    ):
        sft_summary = run_sft(sft)
        tracking.log_metrics({k: v for k, v in sft_summary.items() if isinstance(v, (int, float))})
    stages["sft0"] = {"seconds": time.perf_counter() - t, **sft_summary}
    save()

    # 3. SFT gate
    t = time.perf_counter()
    with tracking.stage_run("gate_sft0", params={"sft_gate": dataclasses.asdict(cfg.sft_gate)}):
        report = gate_evaluation(str(sft_dir), "sft0")
        content = gate.write_gate(sft_dir, report)
        tracking.log_metrics({f"gate/{k}": v for k, v in content["metrics"].items()})
        mlflow.log_artifact(str(gate.gate_path(sft_dir)))
        mlflow.set_tag("orthorl.gate_passed", str(content["passed"]).lower())
    stages["gate_sft0"] = {"seconds": time.perf_counter() - t, **_gate_view(content)}
    print(gate.format_gate(content))
    if not content["passed"]:
        stages["grpo"] = {"skipped": "the SFT gate failed: GRPO refuses an ungated checkpoint (exit 12)"}
        return finish(ExitCode.GATE_FAILED)

    # 4. GRPO, which writes its own gate file (5) with the preset's GRPO gate thresholds
    grpo_dir = out / "grpo"
    t = time.perf_counter()
    sft_source, grpo_target = str(sft_dir), str(grpo_dir)
    if out_uri:  # GRPO pulls the gated SFT checkpoint from S3 and pushes its result there
        sft_source = storage.publish(sft_dir, f"{out_uri.rstrip('/')}/sft0")
        grpo_target = f"{out_uri.rstrip('/')}/grpo"
    grpo = dataclasses.replace(cfg.grpo, model=model, from_checkpoint=str(sft_source), out=grpo_target)
    before = tracking.last_stage_run("grpo")
    rc = run_grpo(grpo, given=grpo.to_dict(), gate_thresholds=cfg.grpo_gate.thresholds)
    grpo_run = tracking.last_stage_run("grpo")  # the child run: last_active_run() is the pipeline's
    stages["grpo"] = {
        "seconds": time.perf_counter() - t,
        "exit_code": int(rc),
        "mlflow_run_id": grpo_run if grpo_run != before else None,
        "out": grpo_target,
        **_grpo_rewards(grpo_dir / TRAIN_LOG_FILE),
    }
    save()
    if rc not in (0, ExitCode.GRPO_GATE_FAILED) or not gate.gate_path(grpo_dir).is_file():
        stages["grpo"]["error"] = f"orthojob train exited {rc}"
        return finish(rc or ExitCode.FAILURE)

    # 5. GRPO gate: read back, as the GRPO stage wrote (and published and logged) it
    content = gate.read_gate(grpo_dir)
    stages["gate_grpo"] = {"seconds": content["metrics"].get("eval_seconds"), **_gate_view(content)}

    # 6. evaluate both checkpoints and the baselines
    t = time.perf_counter()
    e = cfg.evaluate
    with tracking.stage_run("evaluate", params={"evaluate": dataclasses.asdict(e)}):
        tasks = [cfg.task_id]
        kw = {"n_seeds": e.n_seeds, "force_decay": cfg.force_decay, "max_new_tokens": e.max_new_tokens,
              "batch_size": e.batch_size}  # fmt: skip
        report = evaluate_checkpoint(str(grpo_dir), tasks, baselines=e.baselines, name="grpo", **kw)
        sft_report = evaluate_checkpoint(str(sft_dir), tasks, baselines=False, name="sft0", **kw)
        for task in tasks:
            report[task] = {
                "grpo": report[task].pop("grpo"),
                "sft0": sft_report[task]["sft0"],
                **report[task],
            }
        (out / EVALUATION_FILE).write_text(
            json.dumps({"n_seeds": e.n_seeds, "force_decay": cfg.force_decay, "results": report}, indent=2)
        )
        table = format_table(report, e.n_seeds, cfg.force_decay)
        print(table)
        stages["evaluate"] = {
            "seconds": time.perf_counter() - t,
            "file": str(out / EVALUATION_FILE),
            "terminal_mean": {p: s["terminal_reward"]["mean"] for p, s in report[tasks[0]].items()},
            "model_metrics": {
                p: s["model_metrics"] for p, s in report[tasks[0]].items() if "model_metrics" in s
            },
        }
        tracking.log_metrics(
            {f"terminal_mean/{p}": v for p, v in stages["evaluate"]["terminal_mean"].items()}
        )
        mlflow.log_artifact(str(out / EVALUATION_FILE))
    return finish(0 if content["passed"] else ExitCode.GRPO_GATE_FAILED)


def _fmt(x: Any, spec: str = ".3f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def format_summary(summary: dict) -> str:
    """The pipeline's table: one row per stage with its wall time and key numbers."""
    s = summary["stages"]
    lines = [f"Pipeline {summary['preset']}: {_fmt(summary.get('wall_seconds'), '.0f')} s, exit {summary.get('exit_code')}",
             f"{'stage':<12}{'seconds':>9}  result", "-" * 100]  # fmt: skip
    if "tiny-model" in s:
        lines.append(
            f"{'tiny-model':<12}{_fmt(s['tiny-model']['seconds'], '9.1f')}  {s['tiny-model']['path']}"
        )
    if "base" in s:
        x = s["base"]
        lines.append(
            f"{'base':<12}{_fmt(x['seconds'], '9.1f')}  before training: parse {_fmt(x['parse_rate'])}, format "
            f"{_fmt(x['format_reward'])}, terminal {_fmt(x['terminal_mean'])}"
        )
    if "sft0" in s:
        x = s["sft0"]
        lines.append(
            f"{'sft0':<12}{_fmt(x['seconds'], '9.1f')}  {x['steps']} steps, {x['examples']} demos, loss "
            f"{_fmt(x['first_loss'])} -> {_fmt(x['final_loss'])}, token acc {_fmt(x['final_token_accuracy'])}, "
            f"{x['parameters']['trainable']:,} trainable params"
        )
    for key in ("gate_sft0", "gate_grpo"):
        if key in s:
            x = s[key]
            lines.append(
                f"{key:<12}{_fmt(x['seconds'], '9.1f')}  {'PASSED' if x['passed'] else 'FAILED'}: parse "
                f"{_fmt(x['parse_rate'])}, format {_fmt(x['format_reward'])}, terminal {_fmt(x['terminal_mean'])} "
                f"(SLERP {_fmt(x['uniform_slerp_terminal_mean'])}, oracle {_fmt(x['oracle_terminal_mean'])}), "
                f"strategy acc {_fmt(x['strategy_accuracy'])}"
            )
        if key == "gate_sft0" and "grpo" in s:
            x = s["grpo"]
            if "skipped" in x:
                lines.append(f"{'grpo':<12}{'':>9}  skipped: {x['skipped']}")
            else:
                lines.append(
                    f"{'grpo':<12}{_fmt(x['seconds'], '9.1f')}  exit {x['exit_code']}, {x.get('steps', 0)} steps, "
                    f"reward mean {_fmt(x.get('reward_mean'))} (first half {_fmt(x.get('reward_first_half_mean'))}, "
                    f"second half {_fmt(x.get('reward_second_half_mean'))}), {_fmt(x.get('step_time_mean'), '.2f')} s/step"
                )
    if "evaluate" in s:
        x = s["evaluate"]
        terms = ", ".join(f"{p} {_fmt(v)}" for p, v in x["terminal_mean"].items())
        lines.append(f"{'evaluate':<12}{_fmt(x['seconds'], '9.1f')}  terminal: {terms}")
    return "\n".join(lines)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _assignment(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected SECTION.KEY=VALUE (e.g. sft.steps=100), got {text!r}")
    return key.strip(), _value(value.strip())


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny-cpu", help="(default tiny-cpu)")
    parser.add_argument("--out", default="./runs/pipeline", help="output folder (default ./runs/pipeline)")
    parser.add_argument(
        "--model",
        default=None,
        help="base model of every stage: hub id, folder or s3:// URI (the same as --set model=...; "
        "default: the preset's)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        type=_assignment,
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one preset value (JSON), e.g. --set sft.steps=100 --set grpo.steps=2 (repeatable)",
    )
    parser.add_argument(
        "--overrides",
        dest="overrides_list",
        default="",
        metavar="K=V[,K=V...]",
        help="the same as --set, comma-separated in one value (for MLproject -P overrides=...); '' = none",
    )
    parser.add_argument("--show", action="store_true", help="print the preset (after --set) as JSON and exit")
    return parser


def run_pipeline_cli(args: argparse.Namespace) -> int:
    try:
        listed = [_assignment(item) for item in args.overrides_list.split(",") if item.strip()]
    except argparse.ArgumentTypeError as exc:
        print(f"orthojob pipeline: --overrides: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    overrides = dict(args.overrides) | dict(listed)
    if args.model:
        if overrides.get("model", args.model) != args.model:
            print(
                f"orthojob pipeline: --model {args.model} and --set model={overrides['model']} disagree",
                file=sys.stderr,
            )
            return ExitCode.USAGE
        overrides["model"] = args.model
    try:
        cfg = apply_overrides(PRESETS[args.preset], overrides)
    except KeyError as exc:
        print(f"orthojob pipeline: {exc.args[0]}", file=sys.stderr)
        return ExitCode.USAGE
    except (ConfigError, TypeError, ValueError) as exc:
        print(f"orthojob pipeline: --set: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    if args.show:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    summary = run_pipeline(args.preset, args.out, overrides)
    local = mlops.local_work_dir(args.out) if storage.is_s3_uri(args.out) else Path(args.out)
    print(f"wrote {local / SUMMARY_FILE} (and the pipeline run's artifact {SUMMARY_FILE})")
    return int(summary["exit_code"])


__all__ = [
    "add_pipeline_arguments",
    "format_summary",
    "run_pipeline",
    "run_pipeline_cli",
]
