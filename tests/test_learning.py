"""Stage-0 format demonstrations, the learning experiment's metrics and targets, and its code path on a
1-layer model."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import Field, fields, replace

import numpy as np
import pytest

from experiments.learning.config import LearnConfig
from experiments.learning.evaluation import (
    ENGINE_METRICS,
    final_cases,
    heldout_cases,
    mean_ci,
    reference_rows,
    strategy_counterfactuals,
)
from experiments.learning.report import CELL_NAMES
from orthojob.core.parsing import find_plan
from orthojob.data.format_demos import (
    demo_stats,
    format_demonstrations,
    random_format_plan,
    redraw_unsafe,
    sequenced_format_plan,
)
from orthojob.rewards.canaries import METRICS, episode_values
from orthojob.rewards.reward_functions import reward_format, reward_terminal
from orthojob.rewards.rollouts import DEFAULT_CACHE
from server.cases import HELDOUT_SEED_START, TASK_IDS, TRAIN_SEED_START, generate_case
from server.clinical_profiles import STRATEGIES
from server.seed_ranges import FINAL, TUNING
from server.staging_engine import ENGINE_VERSION
from server.treatment import score_plans


def _key(row: dict) -> tuple:
    return row["task_id"], row["seed"], row["force_decay"]


@pytest.fixture(scope="module")
def demos() -> list[dict]:
    return format_demonstrations(60, ["task_easy", "task_medium"], seed=3)


def test_demos_parse_and_are_executable(demos):
    texts = [d["completion"][0]["content"] for d in demos]
    cols = {
        "seed": [d["seed"] for d in demos],
        "task_id": [d["task_id"] for d in demos],
        "force_decay": [d["force_decay"] for d in demos],
    }
    for text, demo in zip(texts, demos):
        plan, n = find_plan(text)
        assert n == 1 and plan == json.loads(text)
        assert plan["strategy"] in STRATEGIES
        assert demo["seed"] >= TRAIN_SEED_START and demo["seed"] < HELDOUT_SEED_START
    # every format check passes and every treated tooth stays within the limits and reaches its target,
    # unless the random staging breaks a hard rule (then reward_format is 0, as every auxiliary reward)
    broken = [
        bool(r.broken_rules)
        for r in DEFAULT_CACHE.get_many(texts, cols["seed"], cols["task_id"], cols["force_decay"])
    ]
    assert sum(broken) < len(texts) / 2
    assert reward_format(texts, **cols) == pytest.approx([0.0 if b else 1.0 for b in broken])
    assert all(r > -2.0 for r in reward_terminal(texts, **cols))


def test_demo_strategy_is_uniform_and_ignores_the_case():
    import random

    rng = random.Random(0)
    case = generate_case("task_easy", 0, False)
    counts = Counter(random_format_plan(case, rng)["strategy"] for _ in range(2500))
    assert set(counts) == set(STRATEGIES)
    expected = 2500 / len(STRATEGIES)
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < 18.5  # chi-square, 4 degrees of freedom, p = 0.001


def test_demos_are_deterministic(demos):
    again = format_demonstrations(60, ["task_easy", "task_medium"], seed=3)
    assert [d["completion"] for d in again] == [d["completion"] for d in demos]


def test_safe_demos_redraw_only_the_plans_that_break_a_hard_rule():
    """``safe`` keeps every prompt and every safe plan, and replaces each unsafe plan by a safe random one;
    the strategies stay spread over all five (the redraw checks safety, nothing clinical)."""
    args = (40, ["task_hard"], False)
    raw = format_demonstrations(*args, seed=5, prompt_format="terse")
    safe = format_demonstrations(*args, seed=5, prompt_format="terse", safe=True)
    raw_stats, safe_stats = demo_stats(raw), demo_stats(safe)
    assert raw_stats["hard_rule_share"] > 0.2  # task_hard's random staging collides often
    assert safe_stats["hard_rule_share"] == 0.0
    assert [r["prompt"] for r in safe] == [r["prompt"] for r in raw]
    unsafe = {
        i
        for i, res in enumerate(score_plans([r["plan"] for r in raw], [_key(r) for r in raw]))
        if res["broken_rules"]
    }
    for i, (a, b) in enumerate(zip(raw, safe)):
        assert (a["plan"] == b["plan"]) == (i not in unsafe)
        assert find_plan(b["completion"][0]["content"])[0] == b["plan"]
    assert sum(count > 0 for count in safe_stats["strategy_counts"].values()) >= 4


def test_redraw_unsafe_gives_up_after_its_draws_and_leaves_its_input():
    import random

    rows = format_demonstrations(12, ["task_hard"], seed=5)
    before = [dict(r) for r in rows]
    once = redraw_unsafe(rows, random.Random(0), draws=1)  # one draw: scored, never redrawn
    assert rows == before and [r["plan"] for r in once] == [r["plan"] for r in rows]
    assert (
        demo_stats(redraw_unsafe(rows, random.Random(0)))["hard_rule_share"]
        < demo_stats(rows)["hard_rule_share"]
    )


def _multipliers_and_order(rows: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each row's earned strategy multiplier, sequence concordance, executable score, and whether it
    names its case's optimal strategy."""
    results = score_plans([r["plan"] for r in rows], [_key(r) for r in rows])
    optimal = [generate_case(*_key(r)).optimal_strategy == r["plan"]["strategy"] for r in rows]
    return (
        np.array([x["reward_breakdown"]["strategy_multiplier"] for x in results]),
        np.array([x["diagnostics"]["sequence_concordance"] for x in results]),
        np.array([x["reward_breakdown"]["executable"] for x in results]),
        np.array(optimal),
    )


def test_sequenced_demos_move_the_teeth_in_the_order_of_the_strategy_they_name():
    """A sequenced demo's staging follows its own strategy's sequence, so where it names the case's
    optimal strategy it earns the optimal multiplier (1.2); a random staging with the same strategy
    almost never does on task_medium and task_hard, whose sequences take several levels."""
    args = (80, ["task_medium", "task_hard"])
    seq = format_demonstrations(*args, seed=2, staging="sequenced")
    rnd = format_demonstrations(*args, seed=2)
    s_mult, s_rho, s_exec, s_opt = _multipliers_and_order(seq)
    r_mult, r_rho, _, r_opt = _multipliers_and_order(rnd)
    assert s_exec.min() == 1.0  # every treated tooth within the limits and at its target
    assert s_rho.min() > 0.3 and np.median(s_rho) > 0.7 and np.median(r_rho) < 0.3
    assert s_opt.sum() >= 8 and r_opt.sum() >= 8
    assert (s_mult[s_opt] == 1.2).mean() >= 0.8 and (r_mult[r_opt] == 1.2).mean() <= 0.2
    for row in seq:  # the groups start in order, each at an explicit aligner
        starts = [g["start_stage"] for g in row["plan"]["tooth_groups"]]
        assert starts == sorted(starts) and starts[0] == 1
        assert find_plan(row["completion"][0]["content"])[0] == row["plan"]


def test_sequenced_demo_strategy_is_uniform_and_ignores_the_case():
    import random

    rng = random.Random(1)
    case = generate_case("task_hard", 0, False)
    counts = Counter(sequenced_format_plan(case, rng)["strategy"] for _ in range(2500))
    expected = 2500 / len(STRATEGIES)
    assert set(counts) == set(STRATEGIES)
    assert sum((c - expected) ** 2 / expected for c in counts.values()) < 18.5


def test_safe_sequenced_demos_and_an_unknown_staging():
    raw = format_demonstrations(30, ["task_hard"], seed=4, staging="sequenced")
    safe = format_demonstrations(30, ["task_hard"], seed=4, staging="sequenced", safe=True)
    assert demo_stats(safe)["hard_rule_share"] < demo_stats(raw)["hard_rule_share"]
    assert all(len({g["start_stage"] for g in r["plan"]["tooth_groups"]}) >= 1 for r in safe)
    with pytest.raises(ValueError, match="random, sequenced"):
        format_demonstrations(2, ["task_easy"], staging="ordered")


def test_ci_and_episode_metrics():
    ci = mean_ci([1.0, 2.0, 3.0, float("nan")])
    assert ci["n"] == 3 and ci["mean"] == pytest.approx(2.0) and ci["lo"] < 2.0 < ci["hi"]
    case = generate_case("task_easy", HELDOUT_SEED_START, False)
    failed = episode_values(None, case, case.optimal_strategy)
    assert failed["scaled_reward"] == -2.0 and failed["parse"] == 0.0
    assert set(failed) == set(METRICS)


def test_stratified_interval_leaves_out_the_spread_between_cells():
    """A level's cases come from fixed cells: two cells scoring 6.4 and 2.7 on every case have a
    stratified interval of zero width around 4.55, where the plain interval counts the cells' difference
    as noise; one stratum gives the plain interval; labels must match the values."""
    values = [6.4] * 32 + [2.7] * 32
    cells = ["task_easy/ideal"] * 32 + ["task_easy/force_decay"] * 32
    plain, strat = mean_ci(values), mean_ci(values, cells)
    assert strat["mean"] == pytest.approx(plain["mean"]) == pytest.approx(4.55)
    assert strat["hi"] - strat["lo"] == pytest.approx(0.0) and plain["hi"] - plain["lo"] > 0.9
    rng = np.random.default_rng(1)
    noisy = [v + rng.normal(0, 0.5) for v in values]
    half = mean_ci(noisy, cells)["hi"] - mean_ci(noisy, cells)["mean"]
    assert 0.08 < half < 0.2  # about 1.98 * 0.5 / sqrt(64) = 0.12
    one = mean_ci(noisy[:32], ["a"] * 32)
    assert one == pytest.approx(mean_ci(noisy[:32]))
    with pytest.raises(ValueError, match="strata labels"):
        mean_ci(values, cells[:3])


def test_safety_counterfactuals_say_what_the_rule_breaks_cost():
    """A plan that breaks a hard rule (every tooth overcorrected 40 % under ideal dynamics: the aligner
    shapes collide) is scored as written, checked (uniform SLERP in its place), without its
    overcorrection (uniform SLERP's staging here) and by the first safe sampled plan; a safe plan is
    the same every way; a completion that is not a plan is the minimum and counts as broken."""
    from experiments.learning.evaluation import safety_counterfactuals, uniform_strategy_signal
    from orthojob.eval.evaluation import UNIFORM_SLERP_PLAN
    from server.treatment import score_plans

    keys = [k for k in heldout_cases(2) if not k.force_decay][:2]
    over = {"tooth_groups": [{**UNIFORM_SLERP_PLAN["tooth_groups"][0], "overcorrection": 0.4}]}
    slerp = [r["scaled_reward"] for r in score_plans([UNIFORM_SLERP_PLAN] * 2, keys)]
    rows = safety_counterfactuals(
        [over, UNIFORM_SLERP_PLAN], keys, samples=[[None, over, UNIFORM_SLERP_PLAN], []]
    )
    broken, safe = rows
    assert broken["broken"] and broken["as_written"] < 0
    assert broken["checked"] == pytest.approx(slerp[0]) == pytest.approx(broken["no_overcorrection"])
    assert broken["first_safe_sample"] == pytest.approx(slerp[0])
    assert safe["broken"] == [] and safe["as_written"] == safe["checked"] == pytest.approx(slerp[1])
    assert safe["first_safe_sample"] == pytest.approx(slerp[1])  # no samples: the fallback
    assert safety_counterfactuals([over], keys[:1])[0]["first_safe_sample"] is None
    (none,) = safety_counterfactuals([None], keys[:1])
    assert (
        none["broken"] == ["not_a_plan"]
        and none["as_written"] == -2.0
        and none["checked"] == pytest.approx(slerp[0])
    )

    signal = uniform_strategy_signal(keys)
    assert set(signal) == {*STRATEGIES, "case_aware_best"}
    best = np.asarray(signal["case_aware_best"]["scaled"])
    assert all((best >= np.asarray(signal[s]["scaled"]) - 1e-12).all() for s in STRATEGIES)
    assert all(c in ("optimal", "neutral", "wrong") for s in STRATEGIES for c in signal[s]["class"])


def test_reference_rows_per_cell_level_and_pooled():
    cases = heldout_cases(3)
    assert len(cases) == 3 * len(CELL_NAMES) and all(c.seed >= HELDOUT_SEED_START for c in cases)
    refs = reference_rows(cases)
    assert set(refs) == {"oracle", "uniform_slerp", "do_nothing"}
    for row in refs.values():
        assert list(row["cells"]) == list(CELL_NAMES)
        assert set(row["levels"]) == {"task_easy", "task_medium", "task_hard"}
        assert row["pooled"]["scaled_reward"]["n"] == len(cases)
        assert all(row["cells"][c]["scaled_reward"]["n"] == 3 for c in CELL_NAMES)
    pooled = {name: row["pooled"] for name, row in refs.items()}
    assert pooled["oracle"]["scaled_reward"]["mean"] > pooled["uniform_slerp"]["scaled_reward"]["mean"]
    assert pooled["oracle"]["strategy_accuracy"]["mean"] == 1.0
    assert pooled["uniform_slerp"]["strategy_accuracy"]["mean"] == 0.0
    assert pooled["do_nothing"]["scaled_reward"]["mean"] == pytest.approx(0.0, abs=1e-9)
    # scored as they are, without the engine: the raw figures are the scored ones, the repair ones missing
    for row in pooled.values():
        assert row["raw_scaled_reward_mean"] == row["scaled_reward"]
        assert row["raw_hard_rule_share"] == row["hard_rule"]
        assert row["repair_share"]["mean"] is None and row["repair_share"]["n"] == 0
    assert refs["oracle"]["seeds"]["task_hard/ideal"] == [
        c.seed for c in cases if c.task_id == "task_hard" and not c.force_decay
    ]
    # doing nothing is a degenerate plan on every treated case, counted by form
    assert refs["do_nothing"]["degenerate_forms"] == {c: {"nothing": 3} for c in CELL_NAMES}


def test_strategy_counterfactuals_tell_the_strategy_from_the_staging():
    """The same staging scored as written, without a strategy and with the optimal one named: a wrong
    strategy costs its multiplier (0.6 of neutral's), naming none is uniform SLERP's neutral 1.0, and a
    completion that is not a plan scores the minimum every way."""
    from orthojob.eval.evaluation import UNIFORM_SLERP_PLAN
    from server.clinical_profiles import strategy_multiplier_class

    keys = heldout_cases(2)
    cases = [generate_case(*k) for k in keys]
    wrong = [
        next(s for s in STRATEGIES if strategy_multiplier_class(c.profile, s, c.secondary_profile) == "wrong")
        for c in cases
    ]
    rows = strategy_counterfactuals([{**UNIFORM_SLERP_PLAN, "strategy": s} for s in wrong], keys)
    slerp = strategy_counterfactuals([UNIFORM_SLERP_PLAN] * len(keys), keys)
    for r, s in zip(rows, slerp):
        assert r["class"] == "wrong" and s["class"] == "neutral"
        assert r["no_strategy"] == pytest.approx(s["as_written"]) == pytest.approx(s["no_strategy"])
        # the multiplier's 0.6, give or take the staging component the declared order earns
        assert 0.55 * r["no_strategy"] < r["as_written"] < 0.7 * r["no_strategy"]
        assert r["optimal_named"] >= r["no_strategy"]
    not_plans = [
        None,
        {"strategy": wrong[0], "tooth_groups": []},
        {"tooth_groups": [{"teeth": [11], "fraction": 2}]},
    ]
    assert (
        strategy_counterfactuals(not_plans, keys[:3])
        == [{"as_written": -2.0, "no_strategy": -2.0, "optimal_named": -2.0, "class": None}] * 3
    )


def _row(
    scaled: float, hard: float = 0.0, degenerate: float = 0.0, half: float = 0.1, repair: float = 0.2
) -> dict:
    """A planner's grouped evaluation with the same numbers in every cell, level and the pool (its raw
    plans a point lower, ``repair`` of them changed by the engine)."""
    values = {"scaled_reward": scaled, "hard_rule": hard, "degenerate": degenerate, "raw_scaled_reward_mean": scaled - 1,
              "raw_hard_rule_share": repair, "repair_share": repair, "fallback_share": 0.0}  # fmt: skip

    def summary() -> dict:
        return {
            m: {
                "mean": values.get(m, 0.5),
                "lo": values.get(m, 0.5) - half,
                "hi": values.get(m, 0.5) + half,
                "n": 32,
            }
            for m in (*METRICS, *ENGINE_METRICS)
        }

    levels = ("task_easy", "task_medium", "task_hard")
    return {"cells": {c: summary() for c in CELL_NAMES}, "levels": {t: summary() for t in levels},
            "pooled": summary(), "degenerate_forms": {}, "mean_tokens": 100.0}  # fmt: skip


def _report(
    stage0=3.0, grpo_stage0=(5.0, 6.6), bc=5.0, grpo_bc=(6.0, 7.4), repair=(0.3, 0.2, 0.1), **final
) -> dict:
    """A learning.json with two evaluations after each start (steps 30 and 60) on the curve and the
    same start and last evaluations on the final range; ``repair``: GRPO from BC's repair share at each
    of its three; ``final`` sets the canaries of GRPO from BC's last one."""

    def curve(start: float, later: Sequence[float], last: dict, shares=(0.2, 0.2, 0.2)) -> dict:
        rows = [{"step": 0, **_row(start, repair=shares[0])}]
        rows += [
            {"step": 30 * (k + 1), **_row(v, repair=shares[k + 1], **(last if k == len(later) - 1 else {}))}
            for k, v in enumerate(later)
        ]
        return {"evaluations": rows, "final": {"start": rows[0], "end": rows[-1]}}

    references = {"oracle": _row(7.8), "uniform_slerp": _row(6.4, half=0.01), "do_nothing": _row(0.0)}
    return {
        "config": {"eval_seeds": 32},
        "references": references,
        "final_references": references,
        "runs": {"grpo_stage0": curve(stage0, grpo_stage0, {}), "grpo_bc": curve(bc, grpo_bc, final, repair)},
    }


def test_targets_pass_only_when_every_claim_holds():
    """The pass/fail logic of make learn's self-check: a run that meets every target passes; each way
    of missing one fails that target."""
    from experiments.learning.report import markdown_tables, targets, targets_table

    good = targets(_report())
    assert [t["name"] for t in good] == [
        "grpo_bc_beats_bc", "grpo_bc_no_worse_per_level", "final_beats_slerp_per_level", "final_closes_the_gap",
        "grpo_stage0_beats_slerp_easy", "grpo_stage0_canaries", "grpo_stage0_stable", "grpo_bc_canaries",
        "grpo_bc_stable", "grpo_bc_repair_share_falls",
    ]  # fmt: skip
    assert all(t["passed"] for t in good), good

    def failed(report: dict) -> set[str]:
        return {t["name"] for t in targets(report) if not t["passed"]}

    assert failed(_report(grpo_bc=(6.0, 5.1))) >= {"grpo_bc_beats_bc", "final_beats_slerp_per_level"}
    assert failed(_report(grpo_bc=(6.0, 7.2))) == {"final_closes_the_gap"}  # above SLERP, 57 % of the gap
    # the gap is judged on the executed plans (the raw ones, a point lower, would close none of it)
    assert next(t for t in good if t["name"] == "final_closes_the_gap")["value"] == round(1.0 / 1.4, 3)
    assert failed(_report(grpo_bc=(4.0, 7.4))) == {
        "grpo_bc_stable"
    }  # a dip below the start after step 20 of 60
    assert failed(_report(grpo_stage0=(5.0, 6.45))) == {"grpo_stage0_beats_slerp_easy"}  # CIs overlap
    assert failed(_report(hard=1 / 32)) == {"grpo_bc_canaries"}
    assert failed(_report(degenerate=0.2)) == {"grpo_bc_canaries"}
    assert "grpo_bc_no_worse_per_level" in failed(_report(grpo_bc=(6.0, 4.7)))
    # the raw repair share must fall over GRPO's curve: up again at the end, or unknown, fails
    assert failed(_report(repair=(0.3, 0.1, 0.3))) == {"grpo_bc_repair_share_falls"}
    unknown = _report()
    del unknown["runs"]["grpo_bc"]["evaluations"][-1]["pooled"]["repair_share"]
    assert failed(unknown) == {"grpo_bc_repair_share_falls"}
    # the comparisons read the final range, not the curve: a final-range planner at SLERP fails them
    lower = _report()
    lower["runs"]["grpo_bc"]["final"]["end"] = _row(6.4)
    assert failed(lower) == {"final_beats_slerp_per_level", "final_closes_the_gap"}
    missing = _report()
    del missing["runs"]["grpo_bc"]
    assert failed(missing) == {"grpo_bc_beats_bc", "grpo_bc_no_worse_per_level", "final_beats_slerp_per_level",
                               "final_closes_the_gap", "grpo_bc_canaries", "grpo_bc_stable",
                               "grpo_bc_repair_share_falls"}  # fmt: skip
    table = targets_table(targets(_report(hard=1 / 32)))
    assert table.count("PASS") == 9 and table.count("FAIL") == 1
    tables = markdown_tables(_report())
    assert "GRPO from BC (final)" in tables and "the final range" in tables
    # executed beside raw, pooled: GRPO from BC executed 7.40, raw 6.40, repair share 0.10; the references
    # are scored as they are
    assert "| GRPO from BC (final) | 7.40 [7.30, 7.50] | 6.40 [6.30, 6.50] |" in tables
    assert "| 0.10 [0.00, 0.20] | 0.00 [-0.10, 0.10] |" in tables
    assert "the tuning range" in markdown_tables(_report(), "tuning")


def test_paired_differences_compare_the_same_cases():
    """Per-case scores from :func:`grouped` make a paired comparison: a planner 0.3 above another on
    every case differs by 0.3 with a narrow interval even where the cases themselves spread widely
    (force decay scores lower for everybody); different case counts are refused; a report without
    per-case scores leaves the pair out."""
    from experiments.learning.evaluation import grouped
    from experiments.learning.report import paired_differences, paired_table

    cases = heldout_cases(8)
    rng = np.random.default_rng(0)
    base = [(6.4 if not c.force_decay else 2.7) + rng.normal(0, 1.0) for c in cases]
    noise = rng.normal(0, 0.05, len(cases))

    def evaluation(scores):
        return grouped(
            cases,
            [{**{m: 0.0 for m in METRICS}, "scaled_reward": s, "degenerate_form": None} for s in scores],
        )

    bc, final = evaluation(base), evaluation([b + 0.3 + e for b, e in zip(base, noise)])
    assert final["per_case"]["task_easy/force_decay"] == [round(v, 4) for v, c in zip(
        [b + 0.3 + e for b, e in zip(base, noise)], cases) if c.task_id == "task_easy" and c.force_decay]  # fmt: skip
    report = _report()
    report["runs"]["grpo_bc"]["evaluations"][0].update(bc)
    report["runs"]["grpo_bc"]["evaluations"][-1].update(final)
    rows = paired_differences(report)
    assert [(r["planner"], r["against"]) for r in rows] == [
        ("grpo_bc", "bc")
    ]  # the others have no per-case scores
    pooled = rows[0]["pooled"]
    assert pooled["n"] == len(cases) and pooled["lo"] > 0.25 and pooled["hi"] < 0.35
    unpaired = final["pooled"]["scaled_reward"]
    assert unpaired["lo"] < bc["pooled"]["scaled_reward"]["hi"]  # the unpaired intervals overlap
    assert set(rows[0]["levels"]) == {"task_easy", "task_medium", "task_hard"}
    assert "GRPO from BC (final) | BC (stage 2) | 0.3" in paired_table(rows)
    report["runs"]["grpo_bc"]["evaluations"][0]["per_case"]["task_hard/ideal"].pop()
    with pytest.raises(ValueError, match="different cases in task_hard/ideal"):
        paired_differences(report)


def test_learning_grpo_settings_reach_trls_config(tmp_path):
    """run_grpo trains through the job's trainer: its GRPOJobConfig gives TRL the experiment's settings."""
    from experiments.learning.experiment import GRPO_PROMPT_SEED_START, LearnConfig, grpo_job_config
    from orthojob.stages.grpo_config import build_grpo_args, validate

    cfg = LearnConfig(out=str(tmp_path))
    job = grpo_job_config(cfg, tmp_path / "stage0")
    validate(job, n_processes=1, cuda=False)
    args, funcs = build_grpo_args(job, {"cuda": False, "bf16": False}, 1)
    # 4 prompts x 8 generations a step, one optimizer step per generation batch
    assert (args.per_device_train_batch_size, args.num_generations, args.gradient_accumulation_steps) == (
        32,
        8,
        1,
    )
    assert (args.loss_type, args.scale_rewards, args.temperature, args.beta) == ("dapo", "group", 0.8, 0.1)
    assert args.lr_scheduler_type == "constant" and args.learning_rate == cfg.lr == 3e-4
    assert (
        args.max_completion_length == cfg.stage0_completion_length == 128
        and job.mixed_cells
        and args.max_steps == cfg.stage0_steps
        and args.seed == cfg.seed
    )
    names = [f.__name__ for f in funcs]
    assert dict(zip(names, args.reward_weights)) == {
        "reward_terminal": 1.0, "reward_occlusion": 1.0, "reward_strategy": 3.0, "reward_format": 1.0, "reward_anchorage": 1.0
    }  # fmt: skip
    assert not args.gradient_checkpointing
    # each start samples at its own temperature, with its own KL coefficient
    hot = LearnConfig(out=str(tmp_path), bc_temperature=1.0, bc_beta=0.3)
    bc_args, _ = build_grpo_args(
        grpo_job_config(hot, tmp_path / "bc", "grpo_bc"), {"cuda": False, "bf16": False}, 1
    )
    stage0_args, _ = build_grpo_args(
        grpo_job_config(hot, tmp_path / "stage0"), {"cuda": False, "bf16": False}, 1
    )
    assert (bc_args.temperature, stage0_args.temperature) == (1.0, 0.8)
    assert (bc_args.beta, stage0_args.beta) == (0.3, 0.1)
    # each start's level weights reach its own GRPO run only
    weighted = LearnConfig(out=str(tmp_path), bc_level_weights={"task_hard": 2})
    assert grpo_job_config(weighted, tmp_path / "bc", "grpo_bc").level_weights == {"task_hard": 2}
    assert grpo_job_config(weighted, tmp_path / "stage0").level_weights == {}
    easy = LearnConfig(out=str(tmp_path), stage0_level_weights={"task_easy": 2})
    assert grpo_job_config(easy, tmp_path / "stage0").level_weights == {"task_easy": 2}
    assert grpo_job_config(easy, tmp_path / "bc", "grpo_bc").level_weights == {}
    assert (job.strategy_advantage, job.strategy_lr_scale) == ("counterfactual", 10.0)
    # from BC: its own completion budget (the oracle's plans are longer) and learning rate
    from_bc = grpo_job_config(cfg, tmp_path / "bc", "grpo_bc")
    assert (from_bc.max_completion_length, from_bc.lr, from_bc.out, from_bc.steps) == (
        384,
        cfg.bc_lr,
        str(tmp_path / "grpo_bc"),
        cfg.steps,
    )
    assert cfg.steps != cfg.stage0_steps  # each start has its own step budget
    assert (
        job.num_prompts == 1200
        and job.prompt_seed_start == GRPO_PROMPT_SEED_START == TRAIN_SEED_START + 50_000
    )
    # the objective and its repair-cost scale reach both runs' job config (the engine's, at 0.25, unless asked)
    assert (
        (job.objective, job.repair_cost_scale)
        == (from_bc.objective, from_bc.repair_cost_scale)
        == ("engine", 0.25)
    )
    raw = replace(cfg, objective="raw", repair_cost_scale=0.5)
    jobs = [grpo_job_config(raw, tmp_path / "x", run) for run in ("grpo_bc", "grpo_stage0")]
    assert {(j.objective, j.repair_cost_scale) for j in jobs} == {("raw", 0.5)}
    # the schedule flag reaches TRL
    decaying = grpo_job_config(replace(cfg, lr_scheduler="linear"), tmp_path / "stage0")
    assert build_grpo_args(decaying, {"cuda": False, "bf16": False}, 1)[0].lr_scheduler_type == "linear"


def test_strategy_conditioning_tells_a_case_blind_policy_from_one_that_reads_the_case():
    from experiments.learning.evaluation import strategy_conditioning

    optimal = list(STRATEGIES) * 4
    blind = np.tile([0.6, 0.1, 0.1, 0.1, 0.1], (len(optimal), 1))
    reads = np.array([[0.8 if s == o else 0.05 for s in STRATEGIES] for o in optimal])
    b, r = strategy_conditioning(blind, optimal), strategy_conditioning(reads, optimal)
    assert b["case_dependence"]["mean"] == pytest.approx(0.0) and b["p_optimal"]["mean"] == pytest.approx(0.2)
    assert r["case_dependence"]["mean"] == pytest.approx(0.6) and r["p_optimal"]["mean"] == pytest.approx(0.8)
    assert r["by_optimal"]["distal_first"] == pytest.approx([0.05, 0.8, 0.05, 0.05, 0.05])
    reads[0] = np.nan  # a plan naming no strategy is left out
    assert strategy_conditioning(reads, optimal)["p_optimal"]["n"] == len(optimal) - 1


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from orthojob.modeling import models

    path = tmp_path_factory.mktemp("tiny") / "tiny"
    return models.build_tiny(path, ["task_easy"], prompt_format="compact", hidden_size=32, layers=1, heads=2,
                             kv_heads=1, intermediate=32)  # fmt: skip


def test_strategy_probe_reads_the_policy_where_its_plan_names_the_strategy(tiny_model):
    """On the tiny model: the probe finds the strategy key in either key order, gives a distribution
    over the five per case, and NaN for a text that names no strategy."""
    from experiments.learning.evaluation import strategy_distribution
    from orthojob.core.prompts import plan_to_completion
    from orthojob.modeling import models

    model, tokenizer = models.load_policy(str(tiny_model), lora_r=0, max_seq_length=2048)
    cases = heldout_cases(3, [("task_easy", False)])
    plan = {"strategy": "distal_first", "tooth_groups": [{"teeth": [11], "fraction": 0.1}]}
    texts = [plan_to_completion(plan), plan_to_completion(plan, strategy_last=True), "no plan"]
    probs = strategy_distribution(model, tokenizer, cases, texts)
    assert probs.shape == (3, len(STRATEGIES))
    assert np.allclose(probs[:2].sum(axis=1), 1.0) and np.isnan(probs[2]).all()


def test_strategy_last_demos_are_the_same_plans_in_the_other_key_order():
    first = format_demonstrations(6, ["task_easy"], seed=3)
    last = format_demonstrations(6, ["task_easy"], seed=3, strategy_last=True)
    cols = {"seed": [d["seed"] for d in last], "task_id": ["task_easy"] * 6, "force_decay": [False] * 6}
    texts = [d["completion"][0]["content"] for d in last]
    assert all(t.startswith('{"tooth_groups": ') and '"strategy": "' in t for t in texts)
    assert [json.loads(t) for t in texts] == [json.loads(d["completion"][0]["content"]) for d in first]
    assert reward_format(texts, **cols) == pytest.approx([1.0] * 6)


def _away_from_default(f: Field, default):
    """A value of field ``f`` other than its ``default`` (a new kind of field fails here until it has one)."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default + 1 / 3  # no short decimal: the flag has to carry every digit
    if isinstance(default, str):
        return (
            next(c for c in f.metadata["choices"] if c != default)
            if "choices" in f.metadata
            else default + "-x"
        )
    if isinstance(default, dict):
        return {level: 2 + k / 3 for k, level in enumerate(TASK_IDS)}
    raise AssertionError(f"{f.name}: no value away from its default {default!r}")


def test_the_chain_process_is_given_every_setting_of_the_run():
    """make learn's chain's process (``chain_command``: flags from the metadata the parser is built from)
    rebuilds the run's config whole, with ``chain_only`` set: every field set away from its default
    (level weights included) comes back through the parser, and so do the defaults."""
    from experiments.learning.experiment import LearnConfig, build_parser, chain_command

    defaults = LearnConfig()
    away = LearnConfig(
        **{f.name: _away_from_default(f, getattr(defaults, f.name)) for f in fields(LearnConfig)}
    )
    assert [f.name for f in fields(LearnConfig) if getattr(away, f.name) == getattr(defaults, f.name)] == []
    for cfg in (away, defaults):
        command = chain_command(cfg)
        assert command[1:3] == ["-m", "experiments.learning"]
        assert LearnConfig(**vars(build_parser().parse_args(command[3:]))) == replace(cfg, chain_only=True)


def test_the_experiment_runs_end_to_end_on_a_one_layer_model(tmp_path, monkeypatch, capsys):
    """make learn's code path on a 1-layer model, a few steps each, the chain (BC, RSFT, GRPO from BC) in
    its own process as make learn starts it: the file has every cell, planner, curve and target, and an
    untrained model fails the targets (exit 1)."""
    from experiments.learning import experiment as learning
    from experiments.learning import report as learning_report

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as make learn: one thread a process
    argv = ["--out", str(tmp_path / "learn"), "--hidden-size", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
            "--intermediate", "32", "--sft-examples", "8", "--sft-steps", "2", "--bc-examples", "12", "--bc-steps", "2",
            "--steps", "2", "--stage0-steps", "2", "--eval-every", "1", "--num-generations", "2", "--prompts-per-step", "1", "--num-prompts",
            "4", "--max-completion-length", "16", "--stage0-completion-length", "16", "--eval-max-new-tokens", "16", "--eval-seeds", "1",
            "--rsft-prompts", "6", "--rsft-samples", "2", "--rsft-steps", "1", "--bc-ema", "0.5",
            "--bc-level-weight", "task_hard=2", "--objective", "engine", "--repair-cost-scale", "0.5"]  # fmt: skip
    assert learning.main(argv) == 1
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("SOME TARGETS FAILED") and "| target | passed | value |" in printed
    report = json.loads((tmp_path / "learn" / "learning.json").read_text())
    chain_log = (tmp_path / "learn" / "chain.log").read_text()
    assert "chain_error" not in report, chain_log
    # the chain ran in the process make learn starts, with every setting of the run
    chain = json.loads((tmp_path / "learn" / "chain.json").read_text())
    assert chain["config"] == {**report["config"], "chain_only": True} and report["config"]["parallel"]
    assert "grpo_bc step 2: pooled" in chain_log
    assert report["cells"] == list(CELL_NAMES) and report["passed"] is False
    assert set(report["runs"]) == {"grpo_stage0", "grpo_bc"}
    assert report["runs"]["grpo_bc"]["training"]["grpo_config"]["level_weights"] == {"task_hard": 2}
    # --objective engine and its cost scale reached both GRPO runs, the chain's process included
    configs = [run["training"]["grpo_config"] for run in report["runs"].values()]
    assert {(c["objective"], c["repair_cost_scale"]) for c in configs} == {("engine", 0.5)}
    assert (chain["config"]["objective"], chain["config"]["repair_cost_scale"]) == ("engine", 0.5)
    # the curves on the tuning range; each run's start and trained planner, and the references, on the
    # final range; every model evaluation with the engine's executed and raw figures
    assert report["final_cases"] == {"first_seed": FINAL.start, "seeds_per_cell": 1}
    assert report["final_references"]["oracle"]["seeds"] == {c: [FINAL.start] for c in CELL_NAMES}
    final_evals = [e for run in report["runs"].values() for e in run["final"].values()]
    final_evals.append(report["bc"]["final_evaluation"])
    assert len(final_evals) == 5 and all(
        e["seeds"] == {c: [FINAL.start] for c in CELL_NAMES} for e in final_evals
    )
    for run in report["runs"].values():
        assert [e["step"] for e in run["evaluations"]] == [0, 1, 2]
        for e in [*run["evaluations"], *final_evals]:
            assert list(e["cells"]) == list(CELL_NAMES) and e["pooled"]["scaled_reward"]["n"] == len(
                CELL_NAMES
            )
            assert e["engine_version"] == ENGINE_VERSION
            assert all(e["pooled"][m]["n"] == len(CELL_NAMES) for m in ENGINE_METRICS)
            assert all(
                TUNING.start <= s < FINAL.start for ss in run["evaluations"][0]["seeds"].values() for s in ss
            )
        assert run["training"]["steps_done"] == 2 and run["training"]["grpo_config"]["mixed_cells"] is True
    assert report["bc"]["examples"] == 12 and report["stage0"]["key"]["layers"] == 1
    # RSFT between BC and GRPO: BC evaluated on its own; an untrained model writes no plan to keep, so
    # GRPO starts from BC, and RSFT's row (GRPO's start) is BC's
    rsft = report["rsft"]
    assert rsft["counts"]["samples"] == 12 and rsft["counts"]["kept"] == 0 and rsft["skipped"]
    assert sum(rsft["kept_by_cell"].values()) == 0 and list(rsft["kept_by_cell"]) == list(CELL_NAMES)
    sampled = (tmp_path / "learn" / "rsft" / "rsft_samples.jsonl").read_text().splitlines()
    assert len(sampled) == 12 and all(json.loads(line)["dropped"] == "not_a_plan" for line in sampled)
    rows = learning_report.planners(report, "tuning")
    assert (
        rows["bc"] is report["bc"]["evaluation"]
        and rows["rsft"] is report["runs"]["grpo_bc"]["evaluations"][0]
    )
    final_rows = learning_report.planners(report)  # the table the targets read: the final range
    assert final_rows["bc"] is report["bc"]["final_evaluation"]
    assert final_rows["rsft"] is report["runs"]["grpo_bc"]["final"]["start"]
    assert final_rows["grpo_bc"] is report["runs"]["grpo_bc"]["final"]["end"]
    assert final_rows["oracle"] is report["final_references"]["oracle"]
    assert rows["rsft"]["pooled"]["scaled_reward"]["mean"] == pytest.approx(
        rows["bc"]["pooled"]["scaled_reward"]["mean"]
    )
    assert [t["name"] for t in report["targets"]] == [t["name"] for t in learning_report.targets(report)]
    assert not all(t["passed"] for t in report["targets"])
    assert "| GRPO from BC (final) |" in (tmp_path / "learn" / "comparison.md").read_text()
    # every planner was scored on the same cases: each comparison is paired, case by case
    assert [(r["planner"], r["against"]) for r in report["paired"]] == list(
        learning_report.PAIRED_COMPARISONS
    )
    assert all(r["pooled"]["n"] == len(CELL_NAMES) for r in report["paired"])
    comparison = (tmp_path / "learn" / "comparison.md").read_text()
    assert "Paired differences" in comparison
    for heading in ("the final range", "raw scaled_reward", "raw hard rule", "repair share"):
        assert heading in comparison and heading in printed
    assert "the tuning range" in comparison  # the table of the curves' range, for the earlier comparisons
    assert "grpo_bc_repair_share_falls" in {t["name"] for t in report["targets"]}
    assert (tmp_path / "learn" / "learning.png").is_file()


def test_stage0_only_runs_no_chain_and_its_targets_read_missing(tmp_path, monkeypatch):
    """``--stage0-only``: stage 0 and GRPO from it, no chain process and no chain; the chain's targets
    fail as missing, GRPO from stage 0's are judged (a curve level with its start is stable: the check
    compares the means unrounded)."""
    from experiments.learning import experiment as learning

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")

    def no_chain(*args, **kwargs):
        raise AssertionError("the chain ran")

    def fake_grpo(cfg, name, checkpoint, cases, record, save, deadline):
        slerp = learning.reference_rows(cases)["uniform_slerp"]  # the start and one step score as SLERP
        evals = [{"step": step, **slerp, "mean_tokens": 60.0} for step in (0, 3)]
        final = learning.reference_rows(final_cases(cfg.eval_seeds))["uniform_slerp"]
        record[name] = {
            "evaluations": evals,
            "final": {"start": final, "end": final},
            "training": {"steps_done": 3},
        }

    monkeypatch.setattr(learning, "run_chain", no_chain)
    monkeypatch.setattr(learning, "base_model", lambda cfg: tmp_path)
    monkeypatch.setattr(learning, "stage0", lambda cfg: (tmp_path, {"key": {}}))
    monkeypatch.setattr(learning, "_grpo_from", fake_grpo)
    monkeypatch.setattr(learning, "plot", lambda report, path: None)
    report = learning.run(learning.LearnConfig(out=str(tmp_path / "learn"), eval_seeds=1, stage0_only=True))
    targets = {t["name"]: t for t in report["targets"]}
    assert (
        targets["grpo_bc_beats_bc"]["value"].startswith("missing")
        and not targets["grpo_bc_beats_bc"]["passed"]
    )
    assert targets["grpo_stage0_stable"]["passed"] and "missing" not in str(
        targets["grpo_stage0_canaries"]["value"]
    )
    assert set(report["runs"]) == {"grpo_stage0"} and report["bc"] is None
    assert not (tmp_path / "learn" / "chain.log").exists()  # no chain process was started


def test_the_two_halves_run_apart_combine_into_the_report_make_learn_writes(tmp_path, monkeypatch, capsys):
    """experiments/learning/combine_halves.py: a ``--stage0-only`` run and a ``--chain-only`` run joined give the targets
    ``make learn`` gives with the same halves in one run; halves of different seeds or cases, and an
    output folder that is one of them or already holds a report, are refused (exit 2) saying why."""
    from experiments.learning import chain_report, combine_halves
    from experiments.learning import experiment as learning

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")

    def fake_grpo(cfg, name, checkpoint, cases, record, save, deadline):
        rows = learning.reference_rows(cases)  # from stage 0: SLERP throughout; from BC: SLERP -> the oracle
        final = rows["oracle"] if name == "grpo_bc" else rows["uniform_slerp"]
        evals = [
            {"step": 0, **rows["uniform_slerp"], "mean_tokens": 60.0},
            {"step": 3, **final, "mean_tokens": 90.0},
        ]
        ends = learning.reference_rows(final_cases(cfg.eval_seeds))
        record[name] = {
            "evaluations": evals,
            "final": {
                "start": ends["uniform_slerp"],
                "end": ends["oracle" if name == "grpo_bc" else "uniform_slerp"],
            },
            "training": {"steps_done": 3, "grpo_config": {"seed": cfg.seed}},
        }
        save()

    monkeypatch.setattr(learning, "base_model", lambda cfg: tmp_path)
    monkeypatch.setattr(learning, "stage0", lambda cfg: (tmp_path, {"key": {}}))
    monkeypatch.setattr(learning, "bc", lambda cfg: (tmp_path, {"key": {}, "wall_seconds": 1.0}))
    monkeypatch.setattr(learning, "_grpo_from", fake_grpo)
    monkeypatch.setattr(learning, "plot", lambda report, path: None)
    config = learning.LearnConfig(eval_seeds=1)

    learning.run(replace(config, out=str(tmp_path / "whole"), parallel=False))
    whole = json.loads((tmp_path / "whole" / "learning.json").read_text())
    learning.run(replace(config, out=str(tmp_path / "s0"), stage0_only=True))
    (tmp_path / "chain").mkdir()
    learning.run_chain(replace(config, out=str(tmp_path / "chain"), chain_only=True), heldout_cases(1))
    assert json.loads((tmp_path / "chain" / "chain.json").read_text())["config"]["seed"] == 0

    args = [str(tmp_path / "s0"), str(tmp_path / "chain"), "--out", str(tmp_path / "joined")]
    code = combine_halves.main(args)
    joined = json.loads((tmp_path / "joined" / "learning.json").read_text())
    assert code == (0 if joined["passed"] else 1) and capsys.readouterr().out.rstrip().endswith("FAILED")
    assert set(joined["runs"]) == {"grpo_stage0", "grpo_bc"} and joined["chain_config"]["chain_only"]
    assert [(t["name"], t["passed"], t["value"]) for t in joined["targets"]] == [
        (t["name"], t["passed"], t["value"]) for t in whole["targets"]
    ]
    by_name = {t["name"]: t for t in joined["targets"]}
    assert by_name["grpo_bc_beats_bc"]["passed"] and not by_name["grpo_stage0_beats_slerp_easy"]["passed"]
    assert (tmp_path / "joined" / "comparison.md").is_file()
    # a chain run on its own gets its report with the references (experiments/learning/chain_report.py): GRPO from BC
    # reaching the oracle closes the whole gap, its raw plans beside the executed ones
    assert chain_report.main([str(tmp_path / "chain")]) == 0
    printed = capsys.readouterr().out
    assert "| GRPO from BC raw | GRPO from BC repair share | gap closed |" in printed
    assert printed.rstrip().endswith(" | 1.0 |") and f"| {LearnConfig.objective} |" in printed
    assert (tmp_path / "chain" / "chain_report" / "comparison.md").is_file()

    chain_file = tmp_path / "chain" / "chain.json"
    record = json.loads(chain_file.read_text())
    assert combine_halves.main([*args[:2], "--out", str(tmp_path / "s0")]) == 2
    assert "new folder" in capsys.readouterr().err
    assert combine_halves.main(args) == 2 and "already holds a report" in capsys.readouterr().err
    args[-1] = str(tmp_path / "joined-again")
    chain_file.write_text(json.dumps({**record, "config": {**record["config"], "seed": 1}}))
    assert combine_halves.main(args) == 2 and "different seeds" in capsys.readouterr().err
    record["grpo_bc"]["evaluations"][0]["per_case"]["task_hard/ideal"].append(0.0)
    chain_file.write_text(json.dumps(record))
    assert combine_halves.main(args) == 2 and "different cases" in capsys.readouterr().err


def test_learning_refuses_a_grpo_setting_before_any_stage(tmp_path, capsys):
    """A GRPO setting that cannot train ends the run with exit 2 before stage 0 or BC spends a minute."""
    from experiments.learning.experiment import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(out), "--bc-level-weight", "task_hardest=2"])
    assert exc.value.code == 2
    assert "grpo_bc" in (err := capsys.readouterr().err) and "unknown task level 'task_hardest'" in err
    assert not out.exists()
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(out), "--stage0-level-weight", "task_easy=1.5"])
    assert exc.value.code == 2
    assert "grpo_stage0" in (err := capsys.readouterr().err) and "level weight of task_easy" in err
    assert not out.exists()


def test_weight_average_is_an_exponential_moving_average_swapped_in_for_evaluation():
    """GRPO from BC's weight average: avg = d * avg + (1 - d) * w after each step, from the first
    weights; evaluation sees the average and training gets its own weights back; decay 0 does nothing."""
    import torch

    from experiments.learning.weight_average import WeightAverage

    model = torch.nn.Linear(2, 1, bias=False)
    frozen = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    average = WeightAverage(0.5)
    average.start(model)
    for value in (4.0, 8.0):
        with torch.no_grad():
            model.weight.fill_(value)
        average.update(model)
    # 0 -> 0.5 * 0 + 0.5 * 4 = 2 -> 0.5 * 2 + 0.5 * 8 = 5
    with average.swapped_in(model):
        assert torch.allclose(model.weight, torch.full((1, 2), 5.0))
    assert torch.allclose(model.weight, torch.full((1, 2), 8.0))
    with pytest.raises(RuntimeError), average.swapped_in(model):  # weights restored on error too
        raise RuntimeError("evaluation failed")
    assert torch.allclose(model.weight, torch.full((1, 2), 8.0))
    average.copy_into(model)
    assert torch.allclose(model.weight, torch.full((1, 2), 5.0))

    off = WeightAverage(0.0)
    off.start(frozen)
    before = frozen.weight.detach().clone()
    with torch.no_grad():
        frozen.weight.add_(1.0)
    off.update(frozen)
    with off.swapped_in(frozen):
        assert torch.equal(frozen.weight, before + 1.0)
    off.copy_into(frozen)
    assert torch.equal(frozen.weight, before + 1.0)
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="decay must lie in"):
            WeightAverage(bad)
