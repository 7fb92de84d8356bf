"""``orthojob pipeline``'s command line: its flags (:func:`add_pipeline_arguments`) and the command
(:func:`run_pipeline_cli`): the preset with ``--set`` / ``--overrides`` applied, run by
:func:`orthojob.stages.pipeline.run_pipeline`; with ``--register``, a chain whose every gate passed has
GRPO's gated model registered (:func:`orthojob.lifecycle.registry.run_promote`: alias ``candidate``), as the
Kubernetes Job does (:mod:`orthojob.job`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from orthojob.data import case_sets
from orthojob.lifecycle import registry
from orthojob.lifecycle.registry import DEFAULT_MODEL_NAME
from orthojob.ops import storage, work_dirs
from orthojob.ops.exit_codes import ExitCode
from orthojob.stages.flags import ENGINE_CHOICES
from orthojob.stages.grpo_config import ConfigError
from orthojob.stages.pipeline import CASE_SECTIONS, SUMMARY_FILE, run_pipeline
from orthojob.stages.presets import PRESETS, apply_overrides


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
        help="override one preset value (JSON), e.g. --set sft.steps=100 --set grpo.steps=2 "
        "--set stages=format_sft,bc_sft,grpo,rsft (repeatable)",
    )
    parser.add_argument(
        "--overrides",
        dest="overrides_list",
        default="",
        metavar="K=V[,K=V...]",
        help="the same as --set, comma-separated in one value (for MLproject -P overrides=...); '' = none",
    )
    parser.add_argument(
        "--cases",
        default=None,
        help="a case set (.jsonl, .parquet or s3:// URI, docs/cases.md): every training stage (format, tool, bc, "
        "grpo, rsft) trains on its training patients, their gates and the evaluation judge its held-out ones "
        "(= --set SECTION.cases=... for sft, format_sft, tool_sft, grpo and rsft)",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINE_CHOICES,
        default=None,
        help="on: every gate and the evaluation judge the plans the staging engine executes, beside the raw "
        "plans' figures; off: the raw plans (the same as --set engine=...; default: the preset's, on)",
    )
    parser.add_argument(
        "--register",
        action="store_true",
        help="when every gate passed, register GRPO's gated model (alias candidate; champion when it beats the "
        "current one: orthojob promote)",
    )
    parser.add_argument(
        "--model-name", default=DEFAULT_MODEL_NAME, help="--register: the registered model's name"
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
    for key in ("model", "engine"):  # a flag that is also a --set key: both given must agree
        flag = getattr(args, key)
        if flag and overrides.setdefault(key, flag) != flag:
            print(
                f"orthojob pipeline: --{key} {flag} and --set {key}={overrides[key]} disagree",
                file=sys.stderr,
            )
            return ExitCode.USAGE
    for section in CASE_SECTIONS if args.cases else ():
        overrides.setdefault(f"{section}.cases", args.cases)
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
    if args.register and "grpo" not in cfg.stages:
        print(f"orthojob pipeline: --register registers GRPO's model; the chain {list(cfg.stages)} has no grpo",
              file=sys.stderr)  # fmt: skip
        return ExitCode.USAGE
    sets = {(c.cases, c.heldout_share) for c in (getattr(cfg, name) for name in CASE_SECTIONS) if c.cases}
    for source, share in sorted(sets):  # before any model is built: a bad set fails at once, exit 2
        if case_sets.check_case_set(source, share, cfg.force_decay, "pipeline"):
            return ExitCode.USAGE
    summary = run_pipeline(args.preset, args.out, overrides)
    local = work_dirs.local_work_dir(args.out) if storage.is_s3_uri(args.out) else Path(args.out)
    print(f"wrote {local / SUMMARY_FILE} (and the pipeline run's artifact {SUMMARY_FILE})")
    code = int(summary["exit_code"])
    if args.register and code == 0:  # every gate passed: the chain's product joins the registry
        return registry.run_promote(summary["stages"]["grpo"]["mlflow_run_id"], args.model_name, force=False)
    return code


__all__ = ["add_pipeline_arguments", "run_pipeline_cli"]
