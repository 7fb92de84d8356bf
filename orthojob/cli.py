"""``orthojob`` command line: one subcommand per pipeline stage.

orthojob evaluate --baselines            # oracle, uniform SLERP, do-nothing on held-out seeds
orthojob tiny-model --out DIR            # a tiny offline Qwen2-architecture model + tokenizer
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from orthojob.k8s import add_k8s_arguments
from server.cases import TASK_IDS

EXIT_USAGE = 2


def _tasks(value: str) -> list[str]:
    if value == "all":
        return list(TASK_IDS)
    tasks = value.split(",")
    unknown = [t for t in tasks if t not in TASK_IDS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown task(s) {unknown}: use 'all' or a comma list of {TASK_IDS}"
        )
    return tasks


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def cmd_evaluate(args: argparse.Namespace) -> int:
    from orthojob.evaluation import evaluate_baselines, format_table

    if not args.baselines:
        print("orthojob evaluate: nothing to evaluate; pass --baselines", file=sys.stderr)
        return EXIT_USAGE
    report = evaluate_baselines(args.task_id, args.seeds, force_decay=args.force_decay)
    print(format_table(report, args.seeds, args.force_decay))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps({"n_seeds": args.seeds, "force_decay": args.force_decay, "results": report}, indent=2)
        )
        print(f"wrote {args.out}")
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from orthojob.tiny_model import main as tiny_main

    return tiny_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orthojob", description="OrthoRL training job")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    ev = sub.add_parser("evaluate", help="evaluate baselines (and checkpoints) on held-out seeds")
    ev.add_argument("--baselines", action="store_true", help="oracle, uniform SLERP and do-nothing")
    ev.add_argument("--task-id", type=_tasks, default=list(TASK_IDS), help="'all' or a comma list of tasks")
    ev.add_argument("--seeds", type=_positive, default=200, help="held-out seeds per task (default 200)")
    ev.add_argument("--force-decay", action="store_true", help="pharmacokinetic force-decay dynamics")
    ev.add_argument("--out", help="also write the results as JSON here")
    ev.set_defaults(func=cmd_evaluate)

    tm = sub.add_parser("tiny-model", help="build a tiny Qwen2-architecture model offline", add_help=False)
    tm.add_argument("rest", nargs=argparse.REMAINDER)
    tm.set_defaults(func=cmd_tiny_model)

    add_k8s_arguments(sub)  # k8s render|submit|logs|status (orthojob/k8s.py)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
