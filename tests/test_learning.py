"""Stage-0 format demonstrations and the learning experiment's metrics (no model is trained here)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import numpy as np
import pytest

from orthojob.format_demos import format_demonstrations, random_format_plan
from orthojob.learning import METRICS, _ci, episode_values, heldout_cases, reference_rows
from orthojob.parsing import find_plan
from orthojob.rewards import reward_format, reward_terminal
from orthojob.rollouts import DEFAULT_CACHE
from server.cases import HELDOUT_SEED_START, TRAIN_SEED_START, generate_case
from server.clinical_profiles import STRATEGIES


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


def test_ci_and_episode_metrics():
    ci = _ci([1.0, 2.0, 3.0, float("nan")])
    assert ci["n"] == 3 and ci["mean"] == pytest.approx(2.0) and ci["lo"] < 2.0 < ci["hi"]
    case = generate_case("task_easy", HELDOUT_SEED_START, False)
    failed = episode_values(None, case, case.optimal_strategy)
    assert failed["scaled_reward"] == -2.0 and failed["parse"] == 0.0
    assert set(failed) == set(METRICS)


def test_reference_rows_oracle_beats_slerp():
    refs = reference_rows(heldout_cases("task_easy", 6))
    assert refs["oracle"]["scaled_reward"]["mean"] > refs["uniform_slerp"]["scaled_reward"]["mean"]
    assert refs["oracle"]["strategy_accuracy"]["mean"] == 1.0
    assert refs["uniform_slerp"]["strategy_accuracy"]["mean"] == 0.0


def test_learning_grpo_settings_reach_trls_config(tmp_path):
    """run_grpo trains through the job's trainer: its GRPOJobConfig gives TRL the experiment's settings."""
    from orthojob.grpo_config import validate
    from orthojob.grpo_trainer import build_grpo_args
    from orthojob.learning import GRPO_PROMPT_SEED_START, LearnConfig, grpo_job_config

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
    assert args.max_completion_length == 128 and args.max_steps == cfg.steps and args.seed == cfg.seed
    names = [f.__name__ for f in funcs]
    assert dict(zip(names, args.reward_weights)) == {
        "reward_terminal": 1.0, "reward_occlusion": 1.0, "reward_strategy": 3.0, "reward_format": 1.0, "reward_anchorage": 1.0
    }  # fmt: skip
    assert not args.gradient_checkpointing
    assert (job.strategy_advantage, job.strategy_lr_scale) == ("counterfactual", 10.0)
    assert (
        job.num_prompts == 1000
        and job.prompt_seed_start == GRPO_PROMPT_SEED_START == TRAIN_SEED_START + 50_000
    )


def test_baselines_process_gets_the_same_settings_and_the_table_has_every_planner(tmp_path):
    """The BC/RSFT process is started with flags that rebuild the experiment's config; the comparison
    table has stage 0, BC, RSFT, GRPO's last evaluation, the oracle and SLERP, each with its CI."""
    import contextlib
    import io

    from orthojob import learning

    cfg = learning.LearnConfig(out=str(tmp_path), steps=7, lr=1e-3, strategy_last=False, prompt_format="full")
    argv = learning._argv(cfg, baselines_only=True)
    seen = {}
    with contextlib.redirect_stdout(io.StringIO()):
        original = learning.run_baselines
        learning.run_baselines = lambda c, cases: seen.setdefault("cfg", c)
        try:
            assert learning.main(argv) == 0
        finally:
            learning.run_baselines = original
    assert seen["cfg"] == dataclasses.replace(cfg, baselines_only=True)

    def row(value: float) -> dict:
        return {m: {"mean": value, "lo": value - 0.1, "hi": value + 0.1, "n": 8} for m in METRICS}

    report = {
        "evaluations": [{"step": 0, **row(1.0)}, {"step": 40, **row(3.0)}],
        "baselines": {"bc": row(2.0), "rsft": row(2.5)},
        "references": {"oracle": row(7.8), "uniform_slerp": row(6.4)},
    }
    rows = learning.comparison(report)
    assert [r["planner"] for r in rows] == [
        "stage 0 (format SFT)", "BC (stage 2)", "RSFT (stage 4)", "GRPO step 40", "oracle", "uniform SLERP"
    ]  # fmt: skip
    assert [r["scaled_reward"]["mean"] for r in rows] == [1.0, 2.0, 2.5, 3.0, 7.8, 6.4]
    table = learning.markdown_table(rows).splitlines()
    assert len(table) == 2 + 6 and "3.000 [2.900, 3.100]" in table[5]
    del report["baselines"]  # --no-baselines: the table has what was run
    assert [r["planner"] for r in learning.comparison(report)][1] == "GRPO step 40"


def test_strategy_conditioning_tells_a_case_blind_policy_from_one_that_reads_the_case():
    from orthojob.learning import strategy_conditioning

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
    from orthojob import models

    path = tmp_path_factory.mktemp("tiny") / "tiny"
    return models.build_tiny(path, ["task_easy"], prompt_format="compact", hidden_size=32, layers=1, heads=2,
                             kv_heads=1, intermediate=32)  # fmt: skip


def test_strategy_probe_reads_the_policy_where_its_plan_names_the_strategy(tiny_model):
    """On the tiny model: the probe finds the strategy key in either key order, gives a distribution
    over the five per case, and NaN for a text that names no strategy."""
    from orthojob import models
    from orthojob.learning import strategy_distribution
    from orthojob.prompts import plan_to_completion

    model, tokenizer = models.load_policy(str(tiny_model), lora_r=0, max_seq_length=2048)
    cases = heldout_cases("task_easy", 3)
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


def test_baselines_train_bc_and_rsft_and_evaluate_them(tmp_path):
    """The BC and RSFT rows on a 1-layer model and a few steps: BC trains from the base model on the
    oracle's plans, RSFT samples stage 0 and keeps what the rule keeps (here, from an untrained stage 0,
    nothing: the row says why instead of failing the run), and both land in baselines.json."""
    from orthojob import learning

    cfg = learning.LearnConfig(out=str(tmp_path), hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate=32,
                               sft_examples=8, sft_steps=2, bc_steps=2, rsft_prompts=2, rsft_samples=2, rsft_steps=1,
                               eval_seeds=2, max_completion_length=24)  # fmt: skip
    learning.stage0(cfg)
    rows = learning.run_baselines(cfg, learning.heldout_cases(cfg.task_id, cfg.eval_seeds))
    assert (
        set(rows) == {"bc", "rsft"}
        and json.loads((tmp_path / learning.BASELINES_FILE).read_text()).keys() == rows.keys()
    )
    assert rows["bc"]["scaled_reward"]["n"] == 2 and "strategy_conditioning" in rows["bc"]
    assert (tmp_path / "bc" / "model.safetensors").is_file()
    if "error" in rows["rsft"]:
        assert "keep rule" in rows["rsft"]["error"]
    else:
        assert rows["rsft"]["rsft"]["samples"] == 4
    report = {"evaluations": [{"step": 0, **rows["bc"]}], "baselines": rows,
              "references": {"oracle": rows["bc"], "uniform_slerp": rows["bc"]}}  # fmt: skip
    assert "BC (stage 2)" in [r["planner"] for r in learning.comparison(report)]
