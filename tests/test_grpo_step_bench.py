"""bench/grpo_step.py: its clock's exclusive seconds and the step breakdown add up (a fake clock, no model)."""

from __future__ import annotations

import math

import pytest

from tests.bench_scripts import load_bench


class FakeTime:
    """A clock that moves only when told (seconds)."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def test_nested_sections_count_each_second_once_and_the_parts_add_up_to_the_step():
    bench = load_bench("grpo_step")
    now = FakeTime()
    clock = bench.Clock(now)
    with clock.section("callbacks"):  # before any step: not kept
        now.advance(7.0)
    clock.begin_step()
    now.advance(0.5)  # outside any section: TRL's glue
    with clock.section("_prepare_inputs"):  # not a named part: its own time is glue
        now.advance(0.25)
        with clock.section("generate"):
            now.advance(4.0)
        with clock.section("_calculate_rewards"):
            with clock.section("reward_a"):
                now.advance(0.125)
            with clock.section("reward_b"):
                now.advance(0.0625)
        with clock.section("strategy_advantage"):
            now.advance(0.375)
        with clock.section("ref_logps"):
            now.advance(1.5)
    with clock.section("compute_loss"):
        now.advance(0.0625)
        with clock.section("policy_logps"):
            now.advance(2.0)
    with clock.section("backward"):
        now.advance(3.0)
    with clock.section("optimizer"):
        now.advance(0.01)
    with clock.section("logging"):
        now.advance(0.02)
        with clock.section("callbacks"):
            now.advance(0.03)
    clock.end_step()
    now.advance(0.2)
    clock.begin_step()
    now.advance(1.0)
    clock.end_step()

    first, second = clock.steps
    wall = 0.5 + 0.25 + 4.0 + 0.125 + 0.0625 + 0.375 + 1.5 + 0.0625 + 2.0 + 3.0 + 0.01 + 0.02 + 0.03
    assert first["wall"] == pytest.approx(wall)
    assert first["before"] is None and second["before"] == pytest.approx(0.2)
    assert first["sections"]["_prepare_inputs"] == pytest.approx(0.25)  # without what ran inside it
    assert first["sections"]["callbacks"] == pytest.approx(0.03)  # the one before the step is not kept
    assert sum(first["sections"].values()) <= first["wall"] + 1e-12

    parts = bench.breakdown(first["wall"], first["sections"], ["reward_a", "reward_b"])
    top = [row for row, _ in bench.TOP_PARTS] + [bench.REWARDS, bench.OTHER]
    assert sum(parts[row] for row in top) == pytest.approx(first["wall"])
    assert parts["generation"] == pytest.approx(4.0)
    assert parts["policy log-probs, loss forward"] == pytest.approx(2.0)
    assert parts["reference log-probs"] == pytest.approx(1.5)
    assert parts["loss, rest of compute_loss"] == pytest.approx(0.0625)
    assert parts[bench.REWARDS] == pytest.approx(parts["reward:reward_a"] + parts["reward:reward_b"])
    assert parts[bench.REWARDS] == pytest.approx(0.1875)
    other_rows = [f"{bench.OTHER}:{row}" for row, _ in (*bench.OTHER_PARTS, (bench.REST, ""))]
    assert sum(parts[row] for row in other_rows) == pytest.approx(parts[bench.OTHER])
    assert parts[f"{bench.OTHER}:counterfactual strategy scoring"] == pytest.approx(0.375)
    # the glue: outside any section, plus _prepare_inputs' and _calculate_rewards' own time
    assert parts[f"{bench.OTHER}:{bench.REST}"] == pytest.approx(0.5 + 0.25)
    assert all(value >= -1e-12 for value in parts.values())

    empty = bench.breakdown(second["wall"], second["sections"], ["reward_a"])
    assert empty[bench.OTHER] == pytest.approx(1.0) == empty[f"{bench.OTHER}:{bench.REST}"]


def test_generation_figures_count_padding_after_eos_and_prompt_left_padding():
    bench = load_bench("grpo_step")
    record = bench.generation_record([10, 6, 10, 8], [4, 2, 8, 6], [True, True, False, True])
    assert record["decode_steps"] == 8 and record["slots"] == 32 and record["tokens"] == 20
    stats = bench.generation_stats([record], seconds=2.0)
    assert stats["decode steps"] == 8
    assert stats["tokens/s"] == pytest.approx(10.0)
    assert stats["EOS padding share"] == pytest.approx(1 - 20 / 32)
    assert stats["prompt padding share"] == pytest.approx(1 - 34 / 40)
    assert stats["stopped at EOS"] == pytest.approx(0.75)
    assert stats["sequence slots"] == 40 + 32
    two = bench.generation_stats([record, bench.generation_record([5], [3], [False])], seconds=1.0)
    assert two["decode steps"] == 11 and two["generated tokens"] == 23
    assert math.isnan(bench.generation_stats([], seconds=0.0)["tokens/s"])
