"""How much learning signal GRPO's groups carry, per phase of a run and per task level.

GRPO's advantage is a completion's reward against its group's (``num_generations`` completions of
one prompt). A group whose completions all get the same advantage, zero, teaches nothing: that
happens when the policy samples the same plan, or plans that score alike, for every completion. This
reads a GRPO run's ``completions.jsonl`` (``<out>/grpo_bc`` or ``<out>/grpo_stage0`` of
``python -m experiments.learning``; each row has ``step``, ``seed``, ``task_id``, ``force_decay``,
``completion``, ``rewards`` and ``advantage``) and prints, per third of the run's steps and per level:

- the groups (prompts);
- the share of groups with no signal (every advantage within 1e-6 of zero);
- the share of samples scoring below 0 on ``reward_terminal`` (a broken plan or not a plan);
- the mean number of distinct completions per group;
- the share of samples whose plan is a single tooth group (how uniform staging, one group of every
  tooth at one fraction, shows; a completion that is not a plan counts as not one group).

A policy converging on one plan per case shows as a rising no-signal share and falling distinct
completions; the sampling temperature trades these against broken samples. A policy giving up staged
plans shows as a rising one-group share.

``--overcorrection`` prints, instead, per cell (level x dynamics) the samples that plan an
overcorrection (any group's ``overcorrection`` above 0) beside those that do not: their share, the
share of each that scores below 0, the mean ``reward_terminal`` of each one's samples scoring
0 or more, the share of groups holding both kinds ("mixed": only there can GRPO's advantage compare
them), and the mean advantage of each kind within those groups. Under force decay an overcorrection
can pay (teeth express only part of each aligner) or break a rule (the overshoot collides); this
shows which the policy's own samples do.

``--room`` splits, per force-decay cell, the overcorrecting samples by whether every tooth's
overcorrection is within its room (:func:`server.staging.overcorrection_room`, what the ``room``
prompt shows): their share and the share of each scoring below 0. Where the room tells the broken
samples from the safe ones, a policy that reads it can stop overcorrecting into a collision.

    python experiments/learning/group_signal.py runs/learn/grpo_bc [runs/learn/grpo_stage0 ...] [--overcorrection | --room]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from orthojob.core.parsing import extract_plan
from orthojob.stages.grpo_config import COMPLETIONS_FILE
from server.cases import TASK_IDS, generate_case
from server.plans import normalize_plan, overcorrects

PHASES = 3
"""The run's steps are split into this many equal phases."""
ZERO = 1e-6
"""An advantage within this of zero is no signal."""
LEVEL_ORDER = {t: i for i, t in enumerate(TASK_IDS)}
"""Rows are printed in this order of the task levels (an unknown level last)."""


def group_signal(rows: list[dict], phases: int = PHASES) -> list[dict]:
    """One dict per (phase, level) present in ``rows`` (rows of ``completions.jsonl``), in phase then
    level order: ``phase`` (0-based), ``steps`` (first, last), ``level``, ``groups``, ``no_signal``,
    ``broken``, ``distinct`` and ``one_group`` as the module docstring lists them."""
    if not rows:
        raise ValueError("no completions: is this a GRPO run's completions.jsonl?")
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["step"], r["seed"], r["task_id"], bool(r["force_decay"]))].append(r)
    last = max(r["step"] for r in rows)
    width = -(-last // phases)
    cells: dict[tuple[int, str], list[list[dict]]] = defaultdict(list)
    for (step, _seed, task_id, _fd), group in groups.items():
        cells[((step - 1) // width, task_id)].append(group)
    out = []
    for (phase, level), gs in sorted(cells.items(), key=lambda kv: (kv[0][0], LEVEL_ORDER.get(kv[0][1], 99))):
        terminal = [r["rewards"]["reward_terminal"] for g in gs for r in g]
        out.append({
            "phase": phase,
            "steps": (phase * width + 1, min(last, (phase + 1) * width)),
            "level": level,
            "groups": len(gs),
            "no_signal": float(np.mean([all(abs(r["advantage"]) <= ZERO for r in g) for g in gs])),
            "broken": float(np.mean(np.asarray(terminal) < 0.0)),
            "distinct": float(np.mean([len({r["completion"] for r in g}) for g in gs])),
            "one_group": float(np.mean([_groups(r["completion"]) == 1 for g in gs for r in g])),
        })  # fmt: skip
    return out


def overcorrection_signal(rows: list[dict]) -> list[dict]:
    """One dict per cell present in ``rows`` (rows of ``completions.jsonl``), in level then dynamics
    order: ``level``, ``force_decay``, ``samples``, ``overcorrected`` (share of samples whose plan
    overcorrects a group), ``mixed`` (share of the cell's groups, one prompt at one step, holding both
    a sample that overcorrects and one that does not) and, for ``"with"`` and ``"without"`` an
    overcorrection, ``broken`` (share scoring below 0; None when there is no such sample),
    ``safe_mean`` (mean ``reward_terminal`` of those scoring 0 or more; None when there is none) and
    ``mixed_advantage`` (their mean advantage within the mixed groups; None when there is none). A
    completion that is not a plan counts as without."""
    if not rows:
        raise ValueError("no completions: is this a GRPO run's completions.jsonl?")
    groups: dict[tuple, list[tuple[bool, float, float]]] = defaultdict(list)
    for r in rows:
        groups[(r["task_id"], bool(r["force_decay"]), r["step"], r["seed"])].append(
            (_overcorrects(r["completion"]), float(r["rewards"]["reward_terminal"]), float(r["advantage"]))
        )
    cells: dict[tuple[str, bool], list[list[tuple[bool, float, float]]]] = defaultdict(list)
    for (level, fd, _step, _seed), group in groups.items():
        cells[(level, fd)].append(group)
    out = []
    for (level, fd), gs in sorted(cells.items(), key=lambda kv: (LEVEL_ORDER.get(kv[0][0], 99), kv[0][1])):
        samples = [s for g in gs for s in g]
        mixed = [g for g in gs if len({o for o, _, _ in g}) == 2]
        row = {"level": level, "force_decay": fd, "samples": len(samples),
               "overcorrected": float(np.mean([o for o, _, _ in samples])),
               "mixed": len(mixed) / len(gs)}  # fmt: skip
        for name, flag in (("with", True), ("without", False)):
            terminal = np.asarray([t for o, t, _ in samples if o == flag])
            safe = terminal[terminal >= 0.0]
            advantage = [a for g in mixed for o, _, a in g if o == flag]
            row[name] = {
                "broken": float(np.mean(terminal < 0.0)) if terminal.size else None,
                "safe_mean": float(safe.mean()) if safe.size else None,
                "mixed_advantage": float(np.mean(advantage)) if advantage else None,
            }
        out.append(row)
    return out


def room_signal(rows: list[dict]) -> list[dict]:
    """One dict per force-decay cell present in ``rows``, in level order: ``level``, ``overcorrecting``
    (samples whose plan overcorrects a tooth) and, for ``"within"`` and ``"beyond"`` (every
    overcorrected tooth within its room, or some tooth beyond it), ``share`` of the overcorrecting
    samples and ``broken`` (share of them scoring below 0; None when there is none)."""
    if not rows:
        raise ValueError("no completions: is this a GRPO run's completions.jsonl?")
    rooms: dict[tuple[str, int], np.ndarray] = {}
    cells: dict[str, list[tuple[bool, bool]]] = defaultdict(list)
    for r in rows:
        if not r["force_decay"]:
            continue
        oc = normalize_plan(extract_plan(r["completion"])).overcorrections()
        if not oc.any():
            continue
        key = (r["task_id"], int(r["seed"]))
        if key not in rooms:
            rooms[key] = generate_case(key[0], key[1], True).overcorrection_room
        within = bool(np.all(oc <= rooms[key] + 1e-9))
        cells[r["task_id"]].append((within, float(r["rewards"]["reward_terminal"]) < 0.0))
    out = []
    for level, samples in sorted(cells.items(), key=lambda kv: LEVEL_ORDER.get(kv[0], 99)):
        row: dict = {"level": level, "overcorrecting": len(samples)}
        for name, flag in (("within", True), ("beyond", False)):
            broken = [b for w, b in samples if w == flag]
            row[name] = {
                "share": len(broken) / len(samples),
                "broken": float(np.mean(broken)) if broken else None,
            }
        out.append(row)
    return out


def _overcorrects(completion: str) -> bool:
    """Whether the completion's plan overcorrects any tooth as the simulator reads it
    (:func:`server.plans.normalize_plan`: False when not a plan, an out-of-range value ignored)."""
    return overcorrects(extract_plan(completion))


def _groups(completion: str) -> int | None:
    """How many tooth groups the completion's plan lists, None when it is not a plan."""
    plan = extract_plan(completion)
    groups = plan.get("tooth_groups") if isinstance(plan, dict) else None
    return len(groups) if isinstance(groups, list) else None


def read_rows(run: Path) -> list[dict]:
    """The rows of ``run/completions.jsonl`` (``run`` may also name the file itself)."""
    path = run / COMPLETIONS_FILE if run.is_dir() else run
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: give a GRPO run's output folder or its {COMPLETIONS_FILE}"
        )
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="GRPO output folders (or completions.jsonl files)")
    parser.add_argument(
        "--phases", type=int, default=PHASES, help="split each run's steps into this many phases"
    )
    parser.add_argument(
        "--overcorrection",
        action="store_true",
        help="per cell, the samples that plan an overcorrection against those that do not",
    )
    parser.add_argument(
        "--room",
        action="store_true",
        help="per force-decay cell, the overcorrecting samples within every tooth's room against those beyond",
    )
    args = parser.parse_args(argv)
    for run in args.runs:
        print(f"\n{run}")
        if args.room:
            print("| level | overcorrecting samples | within room | broken within / beyond |")
            print("|---|---|---|---|")
            for r in room_signal(read_rows(run)):
                print(f"| {r['level']} | {r['overcorrecting']} | {r['within']['share']:.2f} "
                      f"| {_fmt(r['within']['broken'])} / {_fmt(r['beyond']['broken'])} |")  # fmt: skip
            continue
        if args.overcorrection:
            print(
                "| level | dynamics | samples | overcorrected | broken with / without | safe mean with / without "
                "| mixed groups | advantage in them, with / without |"
            )
            print("|---|---|---|---|---|---|---|---|")
            for r in overcorrection_signal(read_rows(run)):
                w, wo = r["with"], r["without"]
                print(f"| {r['level']} | {'force decay' if r['force_decay'] else 'ideal'} | {r['samples']} "
                      f"| {r['overcorrected']:.2f} | {_fmt(w['broken'])} / {_fmt(wo['broken'])} "
                      f"| {_fmt(w['safe_mean'])} / {_fmt(wo['safe_mean'])} | {r['mixed']:.2f} "
                      f"| {_fmt(w['mixed_advantage'])} / {_fmt(wo['mixed_advantage'])} |")  # fmt: skip
            continue
        print("| steps | level | groups | no signal | broken samples | distinct per group | one group |")
        print("|---|---|---|---|---|---|---|")
        for r in group_signal(read_rows(run), args.phases):
            first, last = r["steps"]
            print(f"| {first}-{last} | {r['level']} | {r['groups']} | {r['no_signal']:.2f} | {r['broken']:.2f} "
                  f"| {r['distinct']:.1f} | {r['one_group']:.2f} |")  # fmt: skip
    return 0


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
