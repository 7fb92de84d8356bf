"""GRPO from BC on its own: one trial of GRPO's settings from an existing BC checkpoint, with the
experiment's curve and final table, so that trials of one setting (the objective, its repair-cost
scale) start from the same BC and skip its 25 minutes.

Every flag of ``python -m experiments.learning`` applies (:class:`experiments.learning.config.LearnConfig`,
the same generator); ``--from`` names the BC checkpoint (a ``make learn`` run's ``<out>/bc``). The run
(:func:`experiments.learning.experiment._grpo_from`, what ``make learn``'s chain runs after BC) evaluates
the start and every ``--eval-every`` steps on the tuning range, and the start and the trained planner on
the final range, into ``<out>/trial.json`` (``grpo_bc``: ``evaluations``, ``final.start``,
``final.end``, ``training``); it prints the curve and the final rows. Two trials side by side, one core
each, from the BC of a ``make learn`` run::

    OMP_NUM_THREADS=1 python -m experiments.learning.grpo_trial --from runs/learn/bc --repair-cost-scale 0.25 --out runs/trial-0.25 &
    OMP_NUM_THREADS=1 python -m experiments.learning.grpo_trial --from runs/learn/bc --objective raw --out runs/trial-raw &
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from experiments.learning.config import LearnConfig
from experiments.learning.evaluation import heldout_cases
from experiments.learning.experiment import _grpo_from
from orthojob.core.metrics import SCALED_REWARD
from orthojob.stages.flags import add_config_arguments

TRIAL_FILE = "trial.json"


def summary_lines(record: dict) -> list[str]:
    """The curve (tuning range) and the final rows (final range) of a trial's ``grpo_bc`` record:
    executed and raw scaled reward, repair share, hard-rule share, pooled."""

    def row(pooled: dict) -> str:
        mean = pooled[SCALED_REWARD]
        return (
            f"executed {mean['mean']:.2f} [{mean['lo']:.2f}, {mean['hi']:.2f}]  raw "
            f"{pooled['raw_scaled_reward_mean']['mean']:.2f}  repair share {pooled['repair_share']['mean']:.3f}  "
            f"hard rule {pooled['hard_rule']['mean']:.3f}"
        )

    lines = [f"step {e['step']:4d}: {row(e['pooled'])}" for e in record["evaluations"]]
    lines += [f"final {k:5s}: {row(e['pooled'])}" for k, e in record.get("final", {}).items()]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="experiments.learning.grpo_trial", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--from", dest="start", required=True, help="the BC checkpoint GRPO starts from")
    add_config_arguments(parser, LearnConfig)
    args = vars(parser.parse_args(argv))
    start = Path(args.pop("start"))
    if not (start / "config.json").is_file():
        parser.error(f"--from {start}: no checkpoint there (a make learn run's <out>/bc)")
    cfg = LearnConfig(**args)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    record: dict = {"config": dataclasses.asdict(cfg), "from": str(start)}

    def save() -> None:
        (out / TRIAL_FILE).write_text(json.dumps(record, indent=1, default=float))

    t0 = time.perf_counter()
    deadline = time.monotonic() + cfg.time_limit_min * 60
    _grpo_from(cfg, "grpo_bc", start, heldout_cases(cfg.eval_seeds), record, save, deadline)
    record["wall_seconds"] = time.perf_counter() - t0
    save()
    print("\n".join(summary_lines(record["grpo_bc"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
