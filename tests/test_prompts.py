"""Tests of orthojob.core.prompts: content drawn from the observation and the server's constants, rows, SFT text."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from orthojob.core import prompts
from orthojob.core.parsing import extract_plan, format_checks
from orthojob.core.prompts import (
    HELDOUT_SEED_START,
    PLAN_SEMANTICS,
    SYSTEM_PROMPT,
    TOP_TEETH,
    TRAIN_SEED_START,
    build_messages,
    build_prompt,
    plan_to_completion,
    prompt_rows,
    reset_observation,
)
from server.cases import TASK_IDS
from server.clinical_profiles import STRATEGIES
from server.dental_constants import (
    DEFAULT_PRIORITY,
    MAX_ROTATION_DEG,
    MAX_TRANSLATION_MM,
    MM_PER_DEG,
    N_STAGES,
    PRIORITY_START_STAGE,
    TOOTH_IDS,
)
from server.errors import InvalidActionError
from server.oracle import oracle_plan
from server.quaternion_utils import quaternion_angle

_LINE = re.compile(
    r"^  FDI (\d\d): dist=(\d+\.\d\d)mm  d=\(([+-]\d+\.\d\d),([+-]\d+\.\d\d),([+-]\d+\.\d\d)\)  "
    r"rot=(\d+\.\d)deg  min_stages=(\d+)$"
)


_TERSE_ROW = re.compile(r"^  (\d\d) (-?\d+) (-?\d+) (-?\d+) (\d+) (\d+)$")


@pytest.fixture(scope="module")
def obs() -> dict:
    return reset_observation(7, "task_medium", False)


def test_plan_semantics_states_the_server_constants() -> None:
    for priority, stage in PRIORITY_START_STAGE.items():
        assert f"{priority} at stage {stage}" in PLAN_SEMANTICS
    assert f"missing = {DEFAULT_PRIORITY}" in PLAN_SEMANTICS
    for s in STRATEGIES:
        assert f'"{s}"' in PLAN_SEMANTICS and f"  {s}: x" in PLAN_SEMANTICS
    assert f"1/{N_STAGES} = {1 / N_STAGES:.4f}" in PLAN_SEMANTICS
    assert "clip((s - start + 1) * fraction, 0, 1)" in PLAN_SEMANTICS
    assert f"by stage {N_STAGES}" in PLAN_SEMANTICS
    assert "A tooth listed twice takes its first group" in PLAN_SEMANTICS
    assert "Teeth in no group follow uniform SLERP" in PLAN_SEMANTICS
    assert f"({MAX_TRANSLATION_MM:g} mm, {MAX_ROTATION_DEG:g} deg)" in PLAN_SEMANTICS
    # the staging orders come from STRATEGY_LEVELS: spot-check two of them
    assert "anterior_first: x1-x2, then x3, then x4-x5, then x6-x7" in PLAN_SEMANTICS
    assert "distal_first: x7, then x6" in PLAN_SEMANTICS


def test_prompt_lists_the_top_teeth_of_the_observation(obs: dict) -> None:
    text = build_prompt(obs)
    rows = [m for m in map(_LINE.match, text.splitlines()) if m]
    assert len(rows) == TOP_TEETH
    initial = np.asarray(obs["initial_config"])
    target = np.asarray(obs["target_config"])
    t = np.linalg.norm(target[:, 4:] - initial[:, 4:], axis=-1)
    r = np.degrees(quaternion_angle(initial[:, :4], target[:, :4]))
    need = np.hypot(t, MM_PER_DEG * r)
    listed = [int(m.group(1)) for m in rows]
    expected = [TOOTH_IDS[i] for i in np.argsort(-need, kind="stable")[:TOP_TEETH]]
    assert listed == expected
    for m in rows:
        i = TOOTH_IDS.index(int(m.group(1)))
        assert float(m.group(2)) == pytest.approx(t[i], abs=0.006)
        d = target[i, 4:] - initial[i, 4:]
        assert [float(m.group(k)) for k in (3, 4, 5)] == pytest.approx(d, abs=0.006)
        assert float(m.group(6)) == pytest.approx(r[i], abs=0.06)
        min_stages = int(m.group(7))
        assert min_stages >= max(t[i] / MAX_TRANSLATION_MM, r[i] / MAX_ROTATION_DEG) - 1e-6
        assert min_stages - 1 < max(1.0, t[i] / MAX_TRANSLATION_MM, r[i] / MAX_ROTATION_DEG)


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_terse_prompt_lists_every_moving_tooth_as_integers(task_id: str) -> None:
    """The terse format: the compact prompt with every tooth that moves (not the top 12), most
    displaced first, in whole hundredths of a mm and tenths of a degree; a tooth whose numbers all
    round to 0 is counted as at its target and left out."""
    o = reset_observation(11, task_id, True)
    text, compact = build_prompt(o, "terse"), build_prompt(o, "compact")
    initial, target = np.asarray(o["initial_config"]), np.asarray(o["target_config"])
    d = target[:, 4:] - initial[:, 4:]
    t = np.linalg.norm(d, axis=-1)
    r = np.degrees(quaternion_angle(initial[:, :4], target[:, :4]))
    need = np.hypot(t, MM_PER_DEG * r)
    moving = [i for i in np.argsort(-need, kind="stable") if np.rint(d[i] * 100).any() or np.rint(r[i] * 10)]
    rows = [m for m in map(_TERSE_ROW.match, text.splitlines()) if m]
    assert [int(m.group(1)) for m in rows] == [TOOTH_IDS[i] for i in moving]
    assert f"({len(rows)} of 28; the other {28 - len(rows)} are at their target; " in text
    min_stages = {int(m.group(1)): int(m.group(7)) for m in map(_LINE.match, compact.splitlines()) if m}
    for m in rows:
        i = TOOTH_IDS.index(int(m.group(1)))
        assert [int(m.group(k)) / 100 for k in (2, 3, 4)] == pytest.approx(d[i], abs=0.0051)
        assert int(m.group(5)) / 10 == pytest.approx(r[i], abs=0.051)
        assert int(m.group(6)) == min_stages.get(TOOTH_IDS[i], int(m.group(6)))
    assert set(min_stages) & {int(m.group(1)) for m in rows}  # the compact rows' teeth move here too
    assert "FDI 1" not in text and "dist=" not in text and "-0 " not in text
    # the rest of the prompt is the compact one's
    assert text.split("Teeth")[0] == compact.split("Teeth")[0]
    assert text.splitlines()[-1] == compact.splitlines()[-1]
    assert len(text) < len(compact) or len(rows) > TOP_TEETH


def test_terse_prompt_of_a_case_that_moves_few_teeth_is_short() -> None:
    """A task_easy case moves a few teeth: the terse prompt lists those only, and is shorter."""
    o = reset_observation(1001, "task_easy", False)
    text = build_prompt(o, "terse")
    rows = [m for m in map(_TERSE_ROW.match, text.splitlines()) if m]
    assert 0 < len(rows) < TOP_TEETH
    assert f"({len(rows)} of 28; the other {28 - len(rows)} are at their target" in text
    assert len(text) < 0.8 * len(build_prompt(o, "compact"))


def test_prompt_carries_the_case_summary_constraints_and_semantics(obs: dict) -> None:
    text = build_prompt(obs)
    for key, value in obs["case_summary"].items():
        shown = f"{value + 0.0:.2f}" if isinstance(value, float) else str(value)
        assert f"  {key}: {shown}\n" in text
    assert f"at most {MAX_TRANSLATION_MM:g} mm translation and {MAX_ROTATION_DEG:g} deg rotation" in text
    assert text.endswith(PLAN_SEMANTICS)
    assert "task_medium" in text and "force_decay: off" in text
    assert "-0.00" not in text
    # no hidden answers: the profile and optimal strategy are not in the prompt
    assert "profile" not in text.lower()


def test_force_decay_is_stated() -> None:
    text = build_prompt(reset_observation(7, "task_medium", True))
    assert "force_decay: on" in text and "carries over" in text


def test_build_messages(obs: dict) -> None:
    messages = build_messages(obs)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"] == SYSTEM_PROMPT
    assert messages[1]["content"] == build_prompt(obs)


def test_prompt_rows() -> None:
    rows = prompt_rows(3, 40, "task_hard", True)
    assert [r["seed"] for r in rows] == [40, 41, 42]
    for r in rows:
        assert set(r) == {"prompt", "seed", "task_id", "force_decay"}
        assert r["task_id"] == "task_hard" and r["force_decay"] is True
        assert r["prompt"] == build_messages(reset_observation(r["seed"], "task_hard", True))
    assert rows[0]["prompt"] != rows[1]["prompt"]
    assert prompt_rows(3, 40, "task_hard", True) == rows  # deterministic
    assert prompt_rows(0, 0, "task_easy", False) == []
    json.dumps(rows)  # a datasets-friendly, JSON-safe row


def test_prompt_rows_refuse_bad_input() -> None:
    with pytest.raises(InvalidActionError, match="unknown task_id"):
        prompt_rows(1, 0, "task_impossible", False)
    with pytest.raises(ValueError, match="non-negative"):
        prompt_rows(-1, 0, "task_easy", False)


def test_mixed_prompt_rows_weigh_the_task_levels() -> None:
    """Level weights set how many prompts each level gets; without them the cells simply take turns."""
    plain = prompts.mixed_prompt_rows(12, 100, "terse")
    assert [(r["task_id"], r["force_decay"]) for r in plain] == [prompts.CELLS[i % 6] for i in range(12)]
    assert prompts.mixed_prompt_rows(12, 100, "terse", {"task_easy": 1}) == plain
    hard = prompts.mixed_prompt_rows(16, 100, "terse", {"task_hard": 2})
    levels = [r["task_id"] for r in hard]
    assert levels.count("task_hard") == 8 and levels.count("task_easy") == levels.count("task_medium") == 4
    assert [r["seed"] for r in hard] == list(range(100, 116))  # every prompt a case of its own
    assert sum(r["force_decay"] for r in hard if r["task_id"] == "task_hard") == 4  # both dynamics alike
    assert {
        r["task_id"] for r in prompts.mixed_prompt_rows(6, 0, "terse", {"task_easy": 0, "task_medium": 0})
    } == {"task_hard"}


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ({"task_hardest": 2}, "unknown task level 'task_hardest'"),
        ({"task_hard": 1.5}, "whole number of turns"),
        ({"task_hard": -1}, "whole number of turns"),
        ({"task_hard": True}, "whole number of turns"),
        ({"task_hard": "2"}, "whole number of turns"),
        ({"task_hard": float("nan")}, "whole number of turns"),
        ({"task_hard": 1000}, "whole number of turns"),
        ({t: 0 for t in TASK_IDS}, "no task level to train on"),
    ],
)
def test_level_weights_refuse_bad_input(weights: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        prompts.cell_turns(weights)


def test_the_observation_of_a_case_is_pure_and_matches_reset() -> None:
    """One public, pure way from a case to its observation: no module-global environment."""
    from server.dental_environment import StepwiseDentalEnvironment

    assert not hasattr(prompts, "_ENV")
    for task, seed, decay in (("task_easy", 3, False), ("task_hard", 7, True)):
        reset = StepwiseDentalEnvironment(max_sessions=1).reset(task, seed, decay)
        ours = reset_observation(seed, task, decay)
        assert ours == reset_observation(seed, task, decay)
        assert {k: v for k, v in ours.items() if k != "episode_id"} == {
            k: v for k, v in reset.items() if k != "episode_id"
        }


def test_seed_ranges_are_disjoint() -> None:
    assert TRAIN_SEED_START == 0 and HELDOUT_SEED_START == 1_000_000
    assert TRAIN_SEED_START + 100_000 < HELDOUT_SEED_START


@pytest.mark.parametrize(("task", "seed"), [("task_easy", 0), ("task_medium", 5), ("task_hard", 9)])
def test_plan_to_completion_round_trips(task: str, seed: int) -> None:
    plan = oracle_plan(reset_observation(seed, task, False))
    text = plan_to_completion(plan)
    assert "\n" not in text
    assert extract_plan(text) == plan
    assert format_checks(extract_plan(text))["total"] == 1.0
    assert text.startswith('{"strategy": ')
    # canonical: key order fixed, extra keys dropped
    shuffled = {
        "note": "x",
        "tooth_groups": [dict(reversed(list(g.items())), extra=1) for g in plan["tooth_groups"]],
        "strategy": plan["strategy"],
    }
    assert plan_to_completion(shuffled) == text


def test_plan_to_completion_refuses_non_finite() -> None:
    with pytest.raises(ValueError):
        plan_to_completion(
            {"strategy": "anterior_first", "tooth_groups": [{"teeth": [11], "fraction": float("nan")}]}
        )


def test_compact_prompt_format_is_the_case_alone_and_travels_with_the_model(obs: dict, tmp_path) -> None:
    """The compact format drops the plan semantics only; a model's format is read from its config.json,
    survives save/load, and every stage builds that model's prompts (SFT demos, GRPO rows, evaluation)."""
    from transformers import AutoConfig, Qwen2Config

    from orthojob.data.format_demos import format_demonstrations
    from orthojob.stages.rsft import training_rows
    from orthojob.stages.sft import oracle_demonstrations

    compact = prompts.build_prompt(obs, "compact")
    assert compact == prompts.case_description(obs)
    assert prompts.build_prompt(obs) == compact + "\n\n" + prompts.PLAN_SEMANTICS
    assert prompts.PLAN_SEMANTICS not in compact and "Plan semantics" not in compact
    with pytest.raises(ValueError, match="compact"):
        prompts.build_prompt(obs, "short")

    Qwen2Config(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=8,
                num_hidden_layers=1, vocab_size=16).save_pretrained(tmp_path)  # fmt: skip
    assert prompts.prompt_format_of(tmp_path) == "full"  # a model that records none: the full prompt
    prompts.set_prompt_format(tmp_path, "compact")
    config = AutoConfig.from_pretrained(tmp_path)
    assert prompts.prompt_format_of(config) == "compact"
    config.save_pretrained(tmp_path / "again")  # a later stage's save keeps it
    assert prompts.prompt_format_of(tmp_path / "again") == "compact"
    with pytest.raises(ValueError, match="not one of"):
        prompts.set_prompt_format(tmp_path, "tiny")

    def user(rows):
        return {r["prompt"][-1]["content"] for r in rows}

    seeds = range(TRAIN_SEED_START, TRAIN_SEED_START + 2)
    expected = {prompts.case_description(prompts.reset_observation(s, "task_easy", False)) for s in seeds}
    assert user(prompt_rows(2, TRAIN_SEED_START, "task_easy", False, "compact")) == expected
    assert user(format_demonstrations(2, ["task_easy"], prompt_format="compact")) == expected
    assert user(oracle_demonstrations(2, ["task_easy"], False, "compact")[0]) == expected
    kept = [{"seed": s, "task_id": "task_easy", "completion": "{}", "kept": True} for s in seeds]
    assert user(training_rows(kept, False, "compact")) == expected
