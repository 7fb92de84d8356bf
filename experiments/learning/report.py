"""The learning experiment's verdict and report: the targets it is judged by (each with its value and a
pass/fail), the tables of ``learning.md`` and the curve plot.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from orthojob.core.metrics import BANDS, SCALED_REWARD
from orthojob.core.prompts import CELLS
from orthojob.rewards.canaries import CANARIES, METRICS, episode_record, episode_values, rollout_record  # noqa: F401 (re-exported)
from server.cases import TASK_IDS, CaseKey

RUNS: tuple[str, ...] = ("grpo_stage0", "grpo_bc")
"""The experiment's two GRPO runs: from the format-only stage 0, and from BC."""


def cell_name(case: CaseKey) -> str:
    """``"<task level>/<ideal|force_decay>"``: the cell a case belongs to."""
    return f"{case.task_id}/{'force_decay' if case.force_decay else 'ideal'}"


CELL_NAMES: tuple[str, ...] = tuple(cell_name(CaseKey(t, 0, fd)) for t, fd in CELLS)

DEGENERATE_MAX = 0.1
"""Largest degenerate-plan share a final planner may have on any cell."""


GAP_CLOSED_MIN = 0.6
"""Share of the pooled gap from uniform SLERP to the oracle the final planner (its executed plans) must close."""

TABLES: tuple[str, ...] = ("final", "tuning")
"""The report's two tables (:func:`planners`): the final range's and the curves' (tuning range)."""


def mean_ci(values: Sequence[float], strata: Sequence[str] | None = None) -> dict:
    """Mean and 95 % t-interval of values (NaN and None dropped).

    With ``strata`` (one label per value: the held-out cell of each case), the interval is the
    stratified one (Cochran, *Sampling Techniques*, ch. 5): the evaluation draws a fixed number of cases
    from each cell, so the difference between the cells' means (a force-decay case scores lower for
    every planner) is part of the design, not sampling noise. The mean is the same; the variance is
    ``sum_h w_h^2 s_h^2 / n_h`` with ``w_h = n_h / n``, on ``n - H`` degrees of freedom (a stratum with one
    value adds no variance). Without strata, the plain interval counts the spread between the cells as
    noise and is wider."""
    from scipy import stats

    labels = list(strata) if strata is not None else [None] * len(values)
    if len(labels) != len(values):
        raise ValueError(f"{len(values)} values but {len(labels)} strata labels")
    kept = [(v, s) for v, s in zip(values, labels) if v is not None and math.isfinite(v)]
    x = np.asarray([v for v, _ in kept], dtype=float)
    if len(x) == 0:
        return {"mean": None, "lo": None, "hi": None, "n": 0}
    mean = float(x.mean())
    if len(x) < 2:
        return {"mean": mean, "lo": mean, "hi": mean, "n": 1}
    groups: dict = {}
    for v, s in kept:
        groups.setdefault(s, []).append(v)
    n = len(x)
    var = sum((len(g) / n) ** 2 * np.var(g, ddof=1) / len(g) for g in groups.values() if len(g) > 1)
    df = max(n - len(groups), 1)
    half = float(stats.t.ppf(0.975, df) * math.sqrt(var))
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n}


def planners(report: dict, table: str = "final") -> dict[str, dict]:
    """The evaluated planners by name: ``stage0`` and ``bc`` (their GRPO runs' starts), each GRPO run's
    trained planner, and the references; with RSFT between BC and GRPO, ``bc`` is BC's own evaluation and
    ``rsft`` GRPO's start. ``table``: ``"final"``, on the final range (each run's ``final`` start and end,
    ``final_references``: the table the targets judge); ``"tuning"``, the curves' first and last
    evaluations and the references on the tuning range. A planner whose run is missing is left out."""
    if table not in TABLES:
        raise ValueError(f"table must be one of {', '.join(TABLES)}, got {table!r}")
    final = table == "final"
    rows: dict[str, dict] = {}
    for run, start in (("grpo_stage0", "stage0"), ("grpo_bc", "bc")):
        record = report.get("runs", {}).get(run, {})
        if final:
            ends = record.get("final") or {}
            rows |= {name: ends[k] for name, k in ((start, "start"), (run, "end")) if ends.get(k)}
            continue
        evals = record.get("evaluations") or []
        if evals:
            rows[start] = evals[0]
            if len(evals) > 1:
                rows[run] = evals[-1]
    bc_alone = (report.get("bc") or {}).get("final_evaluation" if final else "evaluation")
    if bc_alone is not None:  # RSFT between BC and GRPO: GRPO's start is RSFT's checkpoint
        if "bc" in rows:
            rows["rsft"] = rows["bc"]
        rows["bc"] = bc_alone
    return {**rows, **report.get("final_references" if final else "references", {})}


def table_of(*reports: dict) -> str:
    """``"final"`` where every report holds the final table (a run's ``final`` evaluations), else
    ``"tuning"`` (a report written before the final range, or of checkpoints evaluated on the tuning range)."""
    has_final = all(any(r.get("final") for r in rep.get("runs", {}).values()) for rep in reports)
    return "final" if has_final else "tuning"


def _mean(row: dict, where: str, key: str | None = None, metric: str = SCALED_REWARD) -> dict:
    part = row[where] if key is None else row[where][key]
    return part[metric]


def targets(report: dict) -> list[dict]:
    """The experiment's targets, each ``{"name", "claim", "value", "passed"}`` (``passed`` False when
    a planner it needs is missing). The final planner is GRPO from BC, its plans executed by the staging
    engine. Every comparison reads the final table (:func:`planners`: the executed plans' scaled reward
    and canaries on the final range; the references as they are); ``<run>_stable`` and
    ``grpo_bc_repair_share_falls`` read the curves. "CIs apart": the lower 95 % bound of one above the
    upper bound of the other; "no worse": not CIs apart the other way."""
    p = planners(report)
    out: list[dict] = []

    def add(name: str, claim: str, needs: Sequence[str], judge: Callable[[], tuple[object, bool]]) -> None:
        missing = [n for n in needs if n not in p]
        if missing:
            out.append(
                {"name": name, "claim": claim, "value": f"missing: {', '.join(missing)}", "passed": False}
            )
            return
        value, passed = judge()
        out.append({"name": name, "claim": claim, "value": value, "passed": bool(passed)})

    def apart(a: dict, b: dict) -> bool:  # a above b, CIs apart
        return a["lo"] is not None and b["hi"] is not None and a["lo"] > b["hi"]

    def fmt(ci: dict) -> str:
        return "-" if ci["mean"] is None else f"{ci['mean']:.2f} [{ci['lo']:.2f}, {ci['hi']:.2f}]"

    levels = sorted({c.split("/")[0] for c in p.get("oracle", {}).get("cells", {})}, key=list(TASK_IDS).index)

    add("grpo_bc_beats_bc", "GRPO after BC beats BC on the pooled mean, CIs apart", ("grpo_bc", "bc"),
        lambda: (f"{fmt(_mean(p['grpo_bc'], 'pooled'))} vs {fmt(_mean(p['bc'], 'pooled'))}",
                 apart(_mean(p["grpo_bc"], "pooled"), _mean(p["bc"], "pooled"))))  # fmt: skip
    add("grpo_bc_no_worse_per_level", "GRPO after BC is no worse than BC on any level (CIs not apart below)",
        ("grpo_bc", "bc"),
        lambda: ({lv: f"{_mean(p['grpo_bc'], 'levels', lv)['mean']:.2f} vs {_mean(p['bc'], 'levels', lv)['mean']:.2f}"
                  for lv in levels},
                 all(not apart(_mean(p["bc"], "levels", lv), _mean(p["grpo_bc"], "levels", lv)) for lv in levels)))  # fmt: skip
    add("final_beats_slerp_per_level", "the final planner beats uniform SLERP on every level, CIs apart",
        ("grpo_bc", "uniform_slerp"),
        lambda: ({lv: f"{fmt(_mean(p['grpo_bc'], 'levels', lv))} vs {fmt(_mean(p['uniform_slerp'], 'levels', lv))}"
                  for lv in levels},
                 all(apart(_mean(p["grpo_bc"], "levels", lv), _mean(p["uniform_slerp"], "levels", lv)) for lv in levels)))  # fmt: skip

    def gap() -> tuple[object, bool]:
        final, slerp, oracle = (_mean(p[n], "pooled")["mean"] for n in ("grpo_bc", "uniform_slerp", "oracle"))
        closed = (final - slerp) / (oracle - slerp) if oracle != slerp else float("nan")
        return round(closed, 3), closed >= GAP_CLOSED_MIN

    add("final_closes_the_gap", f"the final planner closes >= {GAP_CLOSED_MIN:.0%} of the pooled gap "
        "from uniform SLERP to the oracle", ("grpo_bc", "uniform_slerp", "oracle"), gap)  # fmt: skip
    add("grpo_stage0_beats_slerp_easy", "GRPO from stage 0 (no oracle data) beats uniform SLERP on task_easy, "
        "CIs apart", ("grpo_stage0", "uniform_slerp"),
        lambda: (f"{fmt(_mean(p['grpo_stage0'], 'levels', 'task_easy'))} vs "
                 f"{fmt(_mean(p['uniform_slerp'], 'levels', 'task_easy'))}",
                 apart(_mean(p["grpo_stage0"], "levels", "task_easy"), _mean(p["uniform_slerp"], "levels", "task_easy"))))  # fmt: skip
    for run in RUNS:

        def canaries(run=run) -> tuple[object, bool]:
            cells = p[run]["cells"]
            hard = {c: cells[c]["hard_rule"]["mean"] for c in cells}
            degenerate = {c: cells[c]["degenerate"]["mean"] for c in cells}
            ok = all((h or 0.0) == 0.0 for h in hard.values()) and all(
                (d or 0.0) <= DEGENERATE_MAX for d in degenerate.values()
            )
            return {"hard_rule_max": max((h or 0.0) for h in hard.values()),
                    "degenerate_max": max((d or 0.0) for d in degenerate.values())}, ok  # fmt: skip

        add(f"{run}_canaries", f"{run} at its last step: no hard rule broken and a degenerate share <= "
            f"{DEGENERATE_MAX} on every cell", (run,), canaries)  # fmt: skip

        def stable(run=run) -> tuple[object, bool]:
            evals = report["runs"][run]["evaluations"]
            start, last_step = evals[0], evals[-1]["step"]
            floor = start["pooled"][SCALED_REWARD]["mean"]
            late = {e["step"]: e["pooled"][SCALED_REWARD]["mean"] for e in evals if e["step"] > last_step / 3}
            shown = {step: round(mean, 3) for step, mean in late.items()}  # judged unrounded
            return {"start": round(floor, 3), "after_first_third": shown}, bool(late) and min(
                late.values()
            ) >= floor

        add(f"{run}_stable", f"{run}: no evaluation after the first third of training falls below its start's "
            "pooled mean", (run,), stable)  # fmt: skip

    def repair_falls() -> tuple[object, bool]:
        curve = {
            e["step"]: e["pooled"].get("repair_share", {}).get("mean")
            for e in report["runs"]["grpo_bc"]["evaluations"]
        }
        shares = list(curve.values())
        known = len(shares) > 1 and None not in shares
        return {step: None if v is None else round(v, 3) for step, v in curve.items()}, known and shares[-1] < shares[0]  # fmt: skip

    add("grpo_bc_repair_share_falls", "GRPO from BC: the raw plans' pooled repair share at its last evaluation is "
        "below its start's (the engine changes fewer of its plans)", ("grpo_bc",), repair_falls)  # fmt: skip
    return out


PAIRED_COMPARISONS: tuple[tuple[str, str], ...] = (
    ("grpo_bc", "bc"),
    ("grpo_bc", "uniform_slerp"),
    ("grpo_stage0", "stage0"),
    ("grpo_stage0", "uniform_slerp"),
    ("bc", "uniform_slerp"),
    ("rsft", "bc"),
    ("grpo_bc", "rsft"),
)
"""The (planner, against) pairs :func:`paired_differences` compares case by case."""


def _stratified(pairs: Sequence[tuple[float, str]]) -> dict:
    """:func:`mean_ci` of ``(value, stratum)`` pairs."""
    return mean_ci([v for v, _ in pairs], [s for _, s in pairs])


def paired_per_case(xs: dict[str, Sequence[float]], ys: dict[str, Sequence[float]], what: str) -> dict:
    """The per-case differences ``xs - ys`` of two per-cell score lists (``{"level/dynamics": [scaled
    reward per case]}``, the same cases in the same order) as ``{"levels": {level: ci}, "pooled": ci}``,
    each :func:`mean_ci` stratified by cell. A ValueError naming ``what`` and the cell when a cell's
    case counts differ (the two were not evaluated on the same cases)."""
    diffs: dict[str, list[tuple[float, str]]] = {}
    for cell, x in xs.items():
        y = ys.get(cell, [])
        if len(y) != len(x):
            raise ValueError(f"{what} were evaluated on different cases in {cell}: {len(x)} vs {len(y)}")
        diffs.setdefault(cell.split("/")[0], []).extend((a - b, cell) for a, b in zip(x, y))
    pooled = [d for ds in diffs.values() for d in ds]
    return {"levels": {lv: _stratified(ds) for lv, ds in diffs.items()}, "pooled": _stratified(pooled)}


def paired_differences(report: dict, table: str = "final") -> list[dict]:
    """Each :data:`PAIRED_COMPARISONS` pair on the same cases of ``table`` (the final range unless told:
    :func:`planners`): the mean and
    95 % interval of the per-case difference in scaled reward (planner minus the other), per level and pooled
    (:func:`paired_per_case`), as ``{"planner", "against", "levels": {level: ci}, "pooled": ci}``.
    Pairing removes what the cases share (a force-decay case scores lower for every planner), so these
    intervals are narrower than the targets' unpaired "CIs apart"; they are reported beside the
    targets, which judge as the claims are written. Pairs without per-case scores (older reports) are
    left out."""

    p = planners(report, table)
    return [
        {"planner": a, "against": b, **paired_per_case(p[a]["per_case"], p[b]["per_case"], f"{a} and {b}")}
        for a, b in PAIRED_COMPARISONS
        if "per_case" in p.get(a, {}) and "per_case" in p.get(b, {})
    ]


def paired_table(rows: Sequence[dict]) -> str:
    """:func:`paired_differences` as a markdown table (mean difference [95 % CI] per level and pooled)."""
    if not rows:
        return ""
    levels = list(rows[0]["levels"])
    lines = [f"Paired differences in {SCALED_REWARD} (executed plans) on the same cases, mean [95 % CI]:", "",
             "| planner | against | " + " | ".join([*levels, "pooled"]) + " |", "|---" * (len(levels) + 3) + "|"]  # fmt: skip
    for r in rows:
        cells = [_cell(r["levels"][lv]) for lv in levels] + [_cell(r["pooled"])]
        lines.append(
            f"| {PLANNER_LABELS[r['planner']]} | {PLANNER_LABELS[r['against']]} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


PLANNER_LABELS: dict[str, str] = {
    "stage0": "stage 0 (format SFT)",
    "grpo_stage0": "GRPO from stage 0",
    "bc": "BC (stage 2)",
    "rsft": "RSFT from BC (stage 4)",
    "grpo_bc": "GRPO from BC (final)",
    "oracle": "oracle",
    "uniform_slerp": "uniform SLERP",
    "do_nothing": "do nothing",
}


def _cell(ci: dict, digits: int = 2) -> str:
    if ci["mean"] is None:
        return "-"
    if ci["n"] > 1 and round(ci["hi"] - ci["lo"], digits) > 0:
        return f"{ci['mean']:.{digits}f} [{ci['lo']:.{digits}f}, {ci['hi']:.{digits}f}]"
    return f"{ci['mean']:.{digits}f}"


TABLE_TITLES: dict[str, str] = {
    "final": "the final range (no default chosen on it)",
    "tuning": "the tuning range (the curves' first and last evaluations)",
}

ENGINE_COLUMNS: tuple[tuple[str, str], ...] = (
    (SCALED_REWARD, "executed " + SCALED_REWARD),
    ("raw_scaled_reward_mean", "raw " + SCALED_REWARD),
    ("hard_rule", "executed hard rule"),
    ("raw_hard_rule_share", "raw hard rule"),
    ("repair_share", "repair share"),
    ("fallback_share", "fallback share"),
    ("repaired_movement_share", "repaired movement"),
)
"""The executed-vs-raw table's columns (pooled): metric, heading."""


def engine_table(report: dict, table: str = "final") -> str:
    """Each planner's executed plans beside its raw plans, pooled (mean [95 % CI]): what the staging
    engine changed. The references are scored as they are (no engine): their repair figures read "-"."""
    p = planners(report, table)
    names = [n for n in PLANNER_LABELS if n in p]
    lines = [f"Executed (what ships) and raw plans on {TABLE_TITLES[table]}, pooled, mean [95 % CI]:", "",
             "| planner | " + " | ".join(h for _, h in ENGINE_COLUMNS) + " |", "|---" * (len(ENGINE_COLUMNS) + 1) + "|"]  # fmt: skip
    for n in names:
        pooled = p[n]["pooled"]
        lines.append(f"| {PLANNER_LABELS[n]} | " + " | ".join(_cell(pooled[m]) if m in pooled else "-" for m, _ in ENGINE_COLUMNS) + " |")  # fmt: skip
    return "\n".join(lines)


def markdown_tables(report: dict, table: str = "final") -> str:
    """The executed plans' scaled reward of every planner per cell, per level and pooled, the raw plans'
    beside them pooled (:func:`engine_table`); the canaries per cell (executed plans); on ``table``'s
    cases (:func:`planners`)."""
    p = planners(report, table)
    names = [n for n in PLANNER_LABELS if n in p]
    cells = list(p["oracle"]["cells"]) if "oracle" in p else []
    levels = list(p["oracle"]["levels"]) if "oracle" in p else []
    lines = [f"Executed plans' {SCALED_REWARD} ({BANDS}) on {TABLE_TITLES[table]}, mean [95 % CI]:", "",
             "| planner | " + " | ".join([*cells, *levels, "pooled"]) + " |", "|---" * (len(cells) + len(levels) + 2) + "|"]  # fmt: skip
    for n in names:
        row = [_cell(p[n]["cells"][c][SCALED_REWARD]) for c in cells]
        row += [_cell(p[n]["levels"][lv][SCALED_REWARD]) for lv in levels]
        lines.append(
            f"| {PLANNER_LABELS[n]} | " + " | ".join([*row, _cell(p[n]["pooled"][SCALED_REWARD])]) + " |"
        )
    lines += ["", "Canaries per cell (means; none is a reward): " + ", ".join(CANARIES[:-1]) + ", degenerate (by form)", "",
              "| planner | cell | strategy acc. | parse | " + " | ".join(CANARIES) + " |", "|---" * (len(CANARIES) + 4) + "|"]  # fmt: skip
    for n in names:
        for c in cells:
            s = p[n]["cells"][c]
            forms = p[n].get("degenerate_forms", {}).get(c, {})
            vals = [_cell(s[m]) for m in CANARIES[:-1]]
            degenerate = _cell(s["degenerate"]) + (
                f" ({', '.join(f'{k} {v}' for k, v in forms.items())})" if forms else ""
            )
            lines.append(f"| {PLANNER_LABELS[n]} | {c} | {_cell(s['strategy_accuracy'])} | {_cell(s['parse'])} | "
                         + " | ".join([*vals, degenerate]) + " |")  # fmt: skip
    return "\n".join(lines) + "\n\n" + engine_table(report, table)


def curve_table(report: dict) -> str:
    """Each GRPO run's pooled evaluations by step (tuning range): the executed plans' scaled reward,
    strategy accuracy and degenerate share, the raw plans' scaled reward and hard-rule share, and the
    repair share."""
    missing = {"mean": None}
    lines = ["| run | step | pooled " + SCALED_REWARD + " | raw " + SCALED_REWARD + " | strategy acc. | raw hard rule | repair share | degenerate | tokens |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for run in RUNS:
        for e in report.get("runs", {}).get(run, {}).get("evaluations", []):
            q = e["pooled"]
            raw = [
                _cell(q.get(m, missing))
                for m in ("raw_scaled_reward_mean", "raw_hard_rule_share", "repair_share")
            ]
            lines.append(f"| {run} | {e['step']} | {_cell(q[SCALED_REWARD])} | {raw[0]} | {_cell(q['strategy_accuracy'])} | "
                         f"{raw[1]} | {raw[2]} | {_cell(q['degenerate'])} | {e['mean_tokens']:.0f} |")  # fmt: skip
    return "\n".join(lines)


def targets_table(rows: Sequence[dict]) -> str:
    lines = ["| target | passed | value |", "|---|---|---|"]
    lines += [
        f"| {r['claim']} | {'PASS' if r['passed'] else 'FAIL'} | {json.dumps(r['value'])} |" for r in rows
    ]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """The pooled scaled reward of both GRPO runs by step, with 95 % CIs, beside the references."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in RUNS:
        evals = report.get("runs", {}).get(run, {}).get("evaluations", [])
        if not evals:
            continue
        steps = [e["step"] for e in evals]
        mean, lo, hi = ([e["pooled"][SCALED_REWARD][k] for e in evals] for k in ("mean", "lo", "hi"))
        ax.plot(steps, mean, "o-", label=PLANNER_LABELS[run])
        ax.fill_between(steps, lo, hi, alpha=0.2)
    for name, style in (("oracle", "--"), ("uniform_slerp", ":"), ("do_nothing", "-.")):
        if name in report.get("references", {}):
            ax.axhline(
                report["references"][name]["pooled"][SCALED_REWARD]["mean"], ls=style, color="k", label=name
            )
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(f"pooled {SCALED_REWARD}")
    ax.legend(fontsize=7)
    ax.set_title(f"held-out, {report['config']['eval_seeds']} seeds x {len(CELL_NAMES)} cells, 95 % CI")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
