"""bench/prompt_tokens.py: each prompt format's length and the moving teeth it lists."""

from __future__ import annotations

import numpy as np

from orthojob.core.prompts import reset_observation
from tests.bench_scripts import load_bench


def _bench():
    return load_bench("prompt_tokens")


def test_moving_teeth_are_the_teeth_off_target_and_present() -> None:
    bench = _bench()
    obs = reset_observation(1001, "task_easy", False)
    moving = bench.moving_teeth(obs)
    assert moving == {11, 12, 21, 22}
    still = dict(obs, target_config=obs["initial_config"])  # every tooth at its target
    assert bench.moving_teeth(still) == set()
    nudged = np.array(obs["initial_config"], dtype=float)
    nudged[0, 4] += 0.004  # tooth 11 by 0.004 mm: rounds to 0.00, not a movement
    assert bench.moving_teeth(dict(obs, target_config=nudged.tolist())) == set()


def test_terse_lists_every_moving_tooth_in_fewer_tokens_and_compact_misses_some(tiny_model) -> None:
    from transformers import AutoTokenizer

    bench = _bench()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    compact = bench.measure(tokenizer, "compact", "task_hard", 2)
    terse = bench.measure(tokenizer, "terse", "task_hard", 2)
    assert terse["all_moving_listed"] == 1.0
    assert compact["all_moving_listed"] < 1.0 and compact["moving_listed"] <= 12
    assert terse["moving_listed"] > compact["moving_listed"]
    easy = bench.measure(tokenizer, "terse", "task_easy", 2)
    assert easy["tokens_mean"] < bench.measure(tokenizer, "compact", "task_easy", 2)["tokens_mean"]
    assert easy["tokens_min"] <= easy["tokens_mean"] <= easy["tokens_max"]
