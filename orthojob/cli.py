"""``orthojob`` command line: one subcommand per pipeline stage.

orthojob pipeline --preset tiny-cpu      # tiny-model -> the preset's stages (default: bc_sft, grpo), each gated -> evaluate
orthojob format-sft --out DIR            # stage 0: format SFT on demonstrations without clinical choice, + format gate
orthojob tool-sft --out DIR              # stage 1: tool-use SFT on the oracle's tool conversations, + tool-call gate
orthojob bc-sft --out DIR [--no-gate]    # stage 2: BC SFT on the oracle's safe plans, + gate (stage bc_sft)
orthojob grpo --from-checkpoint DIR      # stage 3: GRPO (refuses without a passed, matching gate of an earlier stage)
orthojob rsft --from-checkpoint DIR --out DIR   # stage 4: rejection fine-tuning (best of k samples), + gate
orthojob gate --checkpoint DIR           # held-out gate evaluation -> DIR/gate_passed.json
orthojob gate --check DIR                # only the pre-flight check (exit 10-13 on refusal)
orthojob evaluate --checkpoint DIR [--baselines]   # a checkpoint and/or the baselines on held-out seeds
orthojob evaluate --baselines            # oracle, uniform SLERP, do-nothing on held-out seeds
orthojob view --seed N --plan oracle --plan checkpoint:DIR --out view.html   # the treatment viewer
orthojob tiny-model --out DIR            # a tiny offline Qwen2-architecture model + tokenizer
orthojob model stage SRC s3://b/p        # copy base weights (hub id, folder, 'tiny') to S3 with a manifest
orthojob model fetch REF [--link PATH]   # fetch a base model into the cache (an init container's step)

The stage commands are generated from :data:`orthojob.stages.stage_table.STAGE_TABLE` (a stage's command is
its key with ``-`` for ``_``); ``orthojob train`` (now ``grpo``) and ``orthojob sft`` (now ``bc-sft
--no-gate``) still run, with a deprecation message, for one more release.

Every DIR may be an ``s3://bucket/prefix`` URI: inputs are downloaded and verified against their
manifest, outputs (--out of every stage, a gated s3:// checkpoint) are published with a new manifest. A
storage failure exits 30. ``--model`` of every stage takes a hub id, a folder or an ``s3://`` URI
(:mod:`orthojob.modeling.base_models`: fetched once into the model cache, verified; an adapter records the
URI as its base).

Gate refusals (orthojob grpo's pre-flight, orthojob gate --check) exit with: 10 gate file missing,
11 gate file unreadable or inconsistent, 12 gate says failed, 13 checkpoint changed since its gate
(digest mismatch). orthojob gate, format-sft, bc-sft and rsft exit 12 too when the checkpoint they
evaluated fails its gate; orthojob grpo and pipeline exit 3 when GRPO's own gate fails; rsft exits 2
when no sample met its keep rule. Every code: orthojob/ops/exit_codes.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from orthojob.data import case_sets
from orthojob.data.case_sets import add_cases_arguments
from orthojob.deploy.k8s import add_k8s_arguments
from orthojob.eval import viewer, viewer_logging
from orthojob.eval.evaluation import (
    evaluate_baselines,
    evaluate_checkpoint,
    format_table,
    generate_completions,
)
from orthojob.lifecycle import gate_file, registry
from orthojob.lifecycle.registry import DEFAULT_MODEL_NAME
from orthojob.modeling import base_models
from orthojob.modeling.models import build_tiny, load_for_inference, tiny_corpus
from orthojob.ops import job_errors, progress, storage, tracking, work_dirs
from orthojob.ops.exit_codes import ExitCode, epilog
from orthojob.ops.preemption import install_termination_handler
from orthojob.stages import gate
from orthojob.stages.flags import (
    add_config_arguments,
    add_engine_argument,
    engine_on,
    finite_float,
    given_values,
    positive_int,
    task_list,
)
from orthojob.stages.grpo import add_train_arguments, run_train
from orthojob.stages.pipeline_cli import add_pipeline_arguments, run_pipeline_cli
from orthojob.stages.rsft import add_rsft_arguments, run_rsft_cli
from orthojob.stages.sft import add_sft_arguments, run_sft_stage_cli
from orthojob.stages.stage_table import COMMANDS, OLD_COMMANDS, Stage, deprecated
from server.cases import HELDOUT_SEED_START, TASK_IDS, generate_case
from server.errors import InvalidActionError

TRACKED_STAGES: dict[str, str] = {
    **{command: s.key for command, s in COMMANDS.items() if s.trainer != "grpo"},
    "gate": "gate",
    "evaluate": "evaluate",
}
"""Stand-alone stage commands that get an MLflow run of their own (grpo opens its own; the
pipeline nests these stages under its parent run)."""


def cmd_evaluate(args: argparse.Namespace) -> int:
    if not args.baselines and not args.checkpoint:
        print(
            "orthojob evaluate: nothing to evaluate; pass --checkpoint DIR and/or --baselines",
            file=sys.stderr,
        )
        return ExitCode.USAGE
    if args.non_compliance and (args.checkpoint or args.task_id != ["task_hard"]):
        print(
            "orthojob evaluate: --non-compliance is for --baselines on --task-id task_hard only",
            file=sys.stderr,
        )
        return ExitCode.USAGE
    keys, cases = None, None
    if args.cases:
        if args.non_compliance:
            print(
                "orthojob evaluate: --non-compliance is for generated task_hard cases, not --cases",
                file=sys.stderr,
            )
            return ExitCode.USAGE
        held = case_sets.heldout_case_keys(args, "evaluate")
        if isinstance(held, int):
            return held
        keys, cases = held
    if args.checkpoint:
        checkpoint = _input_folder(args.checkpoint, "evaluate")
        if checkpoint is None:
            return ExitCode.USAGE
        report = evaluate_checkpoint(
            str(checkpoint),
            args.task_id,
            args.seeds,
            force_decay=args.force_decay,
            baselines=args.baselines,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            keys=keys,
            engine=engine_on(args.engine),
        )
    else:
        report = evaluate_baselines(
            args.task_id,
            args.seeds,
            force_decay=args.force_decay,
            non_compliance=args.non_compliance,
            keys=keys,
        )
        if keys is None:
            viewer_logging.log_baseline_viewers(
                args.task_id, HELDOUT_SEED_START, args.force_decay, args.non_compliance
            )
    n_shown = len(keys) if keys is not None else args.seeds
    print(format_table(report, n_shown, args.force_decay, args.non_compliance, args.cases))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {
                    "checkpoint": args.checkpoint,
                    "n_seeds": args.seeds,
                    "force_decay": args.force_decay,
                    "non_compliance": args.non_compliance,
                    "cases": cases,
                    "results": report,
                },
                indent=2,
            )
        )
        print(f"wrote {args.out}")
    return 0


def stage_command(stage: Stage, old: str | None = None) -> Callable[[argparse.Namespace], int]:
    """The command of ``stage`` (its table row's trainer); ``old``: a deprecated name of it, which
    says so on stderr first."""

    def run(args: argparse.Namespace) -> int:
        if old is not None:
            deprecated("command", old, OLD_COMMANDS[old])
        if stage.trainer == "grpo":
            return run_train(
                argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in _NOT_FLAGS})
            )
        if stage.trainer == "rsft":
            return run_rsft_cli(args)
        return run_sft_stage_cli(args, stage.key, old or stage.command)

    return run


_NOT_FLAGS = ("func", "command", "verbose")


def _add_stage_parser(sub: argparse._SubParsersAction, stage: Stage, old: str | None = None) -> None:
    """One stage command (or a deprecated name of it): its flags, generated from its config class."""
    name, help_ = old or stage.command, f"stage {stage.number}: {stage.summary}"
    if old is not None:
        help_ = f"deprecated: use orthojob {OLD_COMMANDS[old]}"
    parser = sub.add_parser(name, help=help_, epilog=epilog(*stage.exit_codes))
    if stage.trainer == "grpo":
        add_train_arguments(parser)
    elif stage.trainer == "rsft":
        add_rsft_arguments(parser)
    else:
        add_sft_arguments(parser, stage.key, with_gate=True)
        parser.add_argument(
            "--no-gate", action="store_true", help="train without the gate (orthojob gate writes it later)"
        )
        parser.set_defaults(no_gate=old is not None)
    parser.set_defaults(func=stage_command(stage, old))


def cmd_gate(args: argparse.Namespace) -> int:
    if args.check:
        try:
            checked = _input_folder(args.check, "gate --check", must_exist=False)
            gate_file.check_gate(checked)
        except gate_file.GateError as exc:
            print(f"orthojob gate --check: {exc.message}", file=sys.stderr)
            return exc.exit_code
        print(f"gate of {args.check}: passed, digest matches")
        return 0
    if not args.checkpoint:
        print(
            "orthojob gate: pass --checkpoint DIR (evaluate and write its gate) or --check DIR",
            file=sys.stderr,
        )
        return ExitCode.USAGE
    checkpoint = _input_folder(args.checkpoint, "gate")
    if checkpoint is None:
        return ExitCode.USAGE
    limits = gate_file.thresholds_for(args.stage).replace(**given_values(args, gate_file.GateThresholds))
    keys, cases = None, None
    if args.cases:
        held = case_sets.heldout_case_keys(args, "gate")
        if isinstance(held, int):
            return held
        keys, cases = held
    report = gate.gate_report(
        str(checkpoint),
        n_seeds=args.seeds,
        task_id=args.task_id,
        force_decay=args.force_decay,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        stage=args.stage,
        thresholds=limits,
        max_tool_turns=args.tool_turns,
        keys=keys,
        case_set=cases,
        engine=engine_on(args.engine),
    )
    content = gate_file.write_gate(str(checkpoint), report)
    print(gate_file.format_gate(content))
    print(f"wrote {gate_file.gate_path(checkpoint)}")
    if storage.is_s3_uri(args.checkpoint):  # the gate file lives with the checkpoint: publish both again
        storage.publish(checkpoint, args.checkpoint)
        print(f"published {args.checkpoint} with its gate file")
    return 0 if content["passed"] else ExitCode.GATE_FAILED


def _input_folder(path_or_uri: str, command: str, must_exist: bool = True) -> Path | None:
    """A stage's input folder (an ``s3://`` URI is downloaded and verified); None, with the
    reason printed, when a local folder does not exist and ``must_exist``."""
    if storage.is_s3_uri(path_or_uri):
        return work_dirs.local_input(path_or_uri, lambda m: print(f"[{command.split()[0]}] {m}"))
    if must_exist and not Path(path_or_uri).is_dir():
        print(f"orthojob {command}: checkpoint folder {path_or_uri} does not exist", file=sys.stderr)
        return None
    return Path(path_or_uri)


def cmd_pipeline(args: argparse.Namespace) -> int:
    return run_pipeline_cli(args)


def cmd_tiny_model(args: argparse.Namespace) -> int:
    """orthojob/modeling/tiny_model.py's CLI; unless ``--builtin-corpus`` is given, its tokenizer also learns the
    project's prompts and oracle plans (vocab 1024, as the pipeline's tiny model): a prompt is then
    ~1,450 tokens instead of ~2,200 (over the default 2,048-token context)."""
    from orthojob.modeling.tiny_model import main as tiny_main  # imports torch: only for this command

    rest = list(args.rest)
    if "--builtin-corpus" in rest or any(a in ("-h", "--help") for a in rest):
        return tiny_main([a for a in rest if a != "--builtin-corpus"])
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(tiny_corpus(list(TASK_IDS), force_decay=True)), encoding="utf-8")
        extra = ["--corpus", str(corpus)]
        if not any(a.startswith("--vocab-size") for a in rest):
            extra += ["--vocab-size", "1024"]
        return tiny_main(rest + extra)


def cmd_model(args: argparse.Namespace) -> int:
    """``orthojob model stage SRC URI`` / ``orthojob model fetch REF [--link PATH]``."""
    say = base_models.announce
    if args.model_command == "stage":
        if not storage.is_s3_uri(args.uri):
            print(f"orthojob model stage: {args.uri!r} is not an s3:// URI", file=sys.stderr)
            return ExitCode.USAGE
        try:
            if args.hub_id:
                base_models.parse_hub_id(args.hub_id)
            if args.source == "tiny":  # the offline tiny model, as the pipeline builds it
                with tempfile.TemporaryDirectory() as tmp:
                    folder = build_tiny(Path(tmp) / "tiny", list(TASK_IDS), force_decay=True)
                    manifest = base_models.stage(str(folder), args.uri, say, hub_id=args.hub_id)
            else:
                manifest = base_models.stage(args.source, args.uri, say, hub_id=args.hub_id)
        except ValueError as exc:
            print(f"orthojob model stage: {exc}", file=sys.stderr)
            return ExitCode.USAGE
        hub = manifest.get(base_models.SOURCE_KEY) or {}
        recorded = (
            f"adapters record {hub['hub_id']}" + (f"@{hub['revision']}" if hub.get("revision") else "")
            if hub.get("hub_id")
            else "no hub id (a folder: --hub-id ID[@REVISION] names what it is a copy of): adapters record the URI"
        )
        print(f"staged {len(manifest['files'])} files at {args.uri}: use --model {args.uri} ({recorded})")
        return 0
    folder = base_models.local_folder(args.ref, say=say)
    if args.link:
        link = Path(args.link)
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp_link = link.with_name(link.name + ".new")
        tmp_link.unlink(missing_ok=True)
        tmp_link.symlink_to(folder.resolve(), target_is_directory=True)
        tmp_link.replace(link)  # atomic: a reader sees the old target or the new one
        print(f"{link} -> {folder.resolve()}")
    else:
        print(folder)
    return 0


MAX_VIEWED_PLANS: int = 4
"""Plans one viewer page shows side by side."""
DEFAULT_VIEWED_PLANS: tuple[str, ...] = ("oracle", "uniform_slerp")


def cmd_view(args: argparse.Namespace) -> int:
    """``orthojob view``: the treatment viewer of a case and up to MAX_VIEWED_PLANS plans (one HTML file)."""
    sources = args.plan or list(DEFAULT_VIEWED_PLANS)
    if len(sources) > MAX_VIEWED_PLANS:
        print(
            f"orthojob view: at most {MAX_VIEWED_PLANS} --plan per page, got {len(sources)}", file=sys.stderr
        )
        return ExitCode.USAGE
    try:
        case = generate_case(args.task_id, args.seed, args.force_decay, args.non_compliance)
        plans = [viewer.resolve_plan(source, case, _greedy(args.max_new_tokens)) for source in sources]
    except (viewer.PlanSourceError, InvalidActionError) as exc:
        print(f"orthojob view: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    path = viewer.write_viewer(args.out, case, plans, engine=engine_on(args.engine))
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB): {' vs '.join(name for name, _, _ in plans)}")
    return 0


def _greedy(max_new_tokens: int):
    """``complete(folder, observation)`` for ``orthojob view``'s checkpoint sources: the evaluation's
    greedy completion (its prompt, its decoding) of the checkpoint in ``folder``."""

    def complete(folder: str, observation: dict) -> str:
        model, tokenizer = load_for_inference(folder)
        return generate_completions(model, tokenizer, [observation], max_new_tokens)[0][0]

    return complete


def cmd_promote(args: argparse.Namespace) -> int:
    return registry.run_promote(
        args.run_id,
        args.model_name,
        args.force,
        max_hard_rule_share_over_oracle=args.max_hard_rule_share_over_oracle,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orthojob", description="OrthoRL training job")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    ev = sub.add_parser("evaluate", help="evaluate baselines (and checkpoints) on held-out seeds")
    ev.add_argument(
        "--checkpoint", help="a checkpoint folder or s3:// URI (full model or LoRA adapter) to evaluate"
    )
    ev.add_argument("--baselines", action="store_true", help="oracle, uniform SLERP and do-nothing")
    ev.add_argument(
        "--max-new-tokens", type=positive_int, default=512, help="completion budget (default 512)"
    )
    ev.add_argument(
        "--batch-size", type=positive_int, default=16, help="prompts per generate call (default 16)"
    )
    ev.add_argument(
        "--task-id", type=task_list, default=list(TASK_IDS), help="'all' or a comma list of tasks"
    )
    ev.add_argument("--seeds", type=positive_int, default=200, help="held-out seeds per task (default 200)")
    ev.add_argument("--force-decay", action="store_true", help="pharmacokinetic force-decay dynamics")
    ev.add_argument(
        "--non-compliance",
        action="store_true",
        help="task_hard's seeded missed/partial wear and lost attachment (baselines only)",
    )
    case_sets.add_case_set_arguments(ev, "judge")
    add_engine_argument(ev)
    ev.add_argument("--out", help="also write the results as JSON here")
    ev.set_defaults(func=cmd_evaluate)

    refusals = "; ".join(f"{int(code)} {code.meaning}" for code in gate_file.PREFLIGHT_REFUSALS)
    for command, stage in COMMANDS.items():
        _add_stage_parser(sub, stage, command if command in OLD_COMMANDS else None)

    ga = sub.add_parser(
        "gate",
        help="evaluate a checkpoint on held-out seeds and write its gate_passed.json",
        epilog=f"exit codes: 0 passed; {int(ExitCode.GATE_FAILED)} evaluated and failed; with --check: {refusals}",
    )
    ga.add_argument(
        "--checkpoint",
        help="checkpoint folder or s3:// URI to evaluate (an s3:// one is published again with its gate)",
    )
    ga.add_argument(
        "--check", metavar="DIR", help="only check DIR's (or an s3:// URI's) gate file (GRPO's pre-flight)"
    )
    ga.add_argument(
        "--stage",
        default=gate_file.BC_SFT,
        choices=gate_file.STAGES,
        help=f"{gate_file.FORMAT_SFT} (format gate), {gate_file.BC_SFT} (BC, default) or {gate_file.RSFT} (quality gates: format "
        f"and the hard-rule bound), {gate_file.TOOL_SFT} (tool-call gate), or {gate_file.GRPO} (quality gate, also the mean "
        f"scaled reward against uniform SLERP's)",
    )
    ga.add_argument("--task-id", default="task_easy", help="format/tool gates: task, comma list or 'all'")
    ga.add_argument(
        "--seeds", type=positive_int, default=50,
        help="seeds per cell of the run's window (a quality gate's cells: every level under both dynamics; default 50)",
    )  # fmt: skip
    ga.add_argument("--force-decay", action="store_true")
    ga.add_argument("--max-new-tokens", type=positive_int, default=512, help="(default 512)")
    ga.add_argument("--batch-size", type=positive_int, default=16, help="(default 16)")
    ga.add_argument(
        "--tool-turns", type=positive_int, default=4, help="tool_sft: turns per episode (default 4)"
    )
    case_sets.add_case_set_arguments(ga, "gate")
    add_engine_argument(ga)
    add_config_arguments(
        ga.add_argument_group(
            "thresholds (default: the stage's, orthojob/lifecycle/gate_file.py DEFAULT_THRESHOLDS)"
        ),
        gate_file.GateThresholds,
    )
    ga.set_defaults(func=cmd_gate)

    pl = sub.add_parser(
        "pipeline", help="tiny-model -> the preset's stages (default bc_sft, grpo), each gated -> evaluate"
    )
    add_pipeline_arguments(pl)
    pl.set_defaults(func=cmd_pipeline)

    pr = sub.add_parser(
        "promote",
        help="register a training run's model if its gate passed and its hard-rule share is within the bound: alias "
        "candidate; champion if its mean scaled reward beats the champion's",
        epilog=epilog(ExitCode.OK, ExitCode.NO_GATE, ExitCode.BAD_GATE, ExitCode.NO_MODEL, ExitCode.TRACKING),
    )
    pr.add_argument("--run-id", required=True, help="the MLflow run of the training stage")
    pr.add_argument("--model-name", default=DEFAULT_MODEL_NAME, help=f"(default {DEFAULT_MODEL_NAME})")
    pr.add_argument(
        "--force",
        action="store_true",
        help="manual promotion to champion (a failed gate is never registered)",
    )
    pr.add_argument(
        "--max-hard-rule-share-over-oracle",
        type=finite_float,
        default=gate_file.HARD_RULE_BOUND,
        help="register only a run whose held-out share of plans breaking a hard rule exceeds the oracle's on the "
        f"gate's cases by at most this (default {gate_file.HARD_RULE_BOUND:g}: no worse than the oracle)",
    )
    pr.set_defaults(func=cmd_promote)

    vw = sub.add_parser(
        "view",
        help="the treatment viewer: one self-contained HTML page of a case and its plans (3-D, staging, rewards)",
        epilog=epilog(ExitCode.OK, ExitCode.USAGE),
    )
    vw.add_argument("--task-id", default="task_easy", choices=TASK_IDS, help="(default task_easy)")
    vw.add_argument(
        "--seed",
        type=int,
        default=HELDOUT_SEED_START,
        help=f"case seed (default {HELDOUT_SEED_START}, held out)",
    )
    vw.add_argument(
        "--force-decay", action="store_true", help="force-decay dynamics (the teeth lag the aligners)"
    )
    vw.add_argument(
        "--non-compliance", action="store_true", help="task_hard's seeded missed and partial wear"
    )
    vw.add_argument(
        "--plan",
        action="append",
        metavar="SOURCE",
        help=f"a plan to show (repeat for side by side, at most {MAX_VIEWED_PLANS}): {viewer.PLAN_SOURCES_HELP}; "
        f"default: {' and '.join(DEFAULT_VIEWED_PLANS)}",
    )
    vw.add_argument("--max-new-tokens", type=positive_int, default=512, help="checkpoint: completion budget")
    add_engine_argument(vw)
    vw.add_argument("--out", default="view.html", help="the HTML file to write (default view.html)")
    vw.set_defaults(func=cmd_view)

    tm = sub.add_parser("tiny-model", help="build a tiny Qwen2-architecture model offline", add_help=False)
    tm.add_argument("rest", nargs=argparse.REMAINDER)
    tm.set_defaults(func=cmd_tiny_model)

    mo = sub.add_parser(
        "model",
        help="base weights: stage them in S3, or fetch them into the model cache",
        epilog=epilog(ExitCode.OK, ExitCode.USAGE, ExitCode.STORAGE),
    )
    msub = mo.add_subparsers(dest="model_command", required=True)
    ms = msub.add_parser("stage", help="copy a base model to s3://bucket/prefix with a manifest (sha256s)")
    ms.add_argument("source", help="model hub id (HF_TOKEN for gated ones), a folder, or 'tiny'")
    ms.add_argument("uri", help="s3://bucket/prefix; then pass it as --model to every stage")
    ms.add_argument(
        "--hub-id",
        metavar="ID[@REVISION]",
        help="the model hub id (and commit) a folder is a copy of: adapters trained from the URI name it "
        "as their base (a hub id or hub cache folder records its own)",
    )
    mf = msub.add_parser("fetch", help="fetch a base model into the cache and print (or link) its folder")
    mf.add_argument(
        "ref", help="s3://bucket/prefix (into ORTHORL_MODEL_CACHE), a hub id (into HF_HOME), a folder"
    )
    mf.add_argument("--link", help="also point this symlink at the folder (e.g. what vllm serve loads)")
    mo.set_defaults(func=cmd_model)

    add_cases_arguments(sub)  # cases validate|export (orthojob/data/case_sets.py)

    add_k8s_arguments(sub)  # k8s render|submit|logs|status (orthojob/deploy/k8s.py)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    install_termination_handler()  # SIGTERM outside GRPO's guard: exit 143 at once (orthojob.ops.preemption)
    progress.quiet_library_bars()  # in a Job's log, no other library's carriage-return bars
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        if args.command != "tiny-model":
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        # argparse leaves leading options (--out DIR) out of a REMAINDER positional
        args.rest = unknown + list(args.rest)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    stage = TRACKED_STAGES.get(args.command)
    try:
        if stage is None or getattr(args, "check", None):
            return int(args.func(args) or 0)
        return _tracked(stage, args)
    except (storage.StorageError, tracking.TrackingError) as exc:
        return job_errors.report_job_error(args.command, exc)


def _tracked(stage: str, args: argparse.Namespace) -> int:
    """Run a stage command inside its MLflow run (attached to MLFLOW_RUN_ID under `mlflow run`)."""
    params = {k: v for k, v in vars(args).items() if k != "verbose" and not callable(v)}
    try:
        with tracking.stage_run(stage, params={"cli": params}):
            import mlflow  # heavy: imported once a tracked stage runs (stage_run imported it already)

            code = int(args.func(args) or 0)
            mlflow.set_tag("orthorl.exit_code", str(code))
            return code
    except tracking.TrackingError as exc:
        return job_errors.report_job_error(args.command, exc)


if __name__ == "__main__":
    sys.exit(main())
