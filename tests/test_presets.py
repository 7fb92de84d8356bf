"""The presets resolve to the values recorded in ``tests/data/presets_resolved.json``: every field of
every stage config, gate and evaluation, flattened. The presets are built from one base with each
preset's differences (:func:`orthojob.stages.presets._preset`); how they are written may change, what
they resolve to may not unless the recording changes with it. A deliberate change of a preset's value
(or of a config default a preset keeps) rewrites the file in the same change::

    python -c "import dataclasses, json; from orthojob.stages.presets import PRESETS; \
json.dump({n: dataclasses.asdict(p) for n, p in PRESETS.items()}, \
open('tests/data/presets_resolved.json', 'w'), indent=1)"
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from orthojob.stages.presets import PRESETS, apply_overrides

RECORDED = Path(__file__).parent / "data" / "presets_resolved.json"


def flatten(value: object, prefix: str = "") -> dict[str, object]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; tuples as lists (as JSON holds them)."""
    if isinstance(value, dict) and value:
        out: dict[str, object] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): list(value) if isinstance(value, tuple) else value}


def resolved(preset) -> dict[str, object]:
    return flatten(json.loads(json.dumps(dataclasses.asdict(preset))))


def test_every_preset_resolves_to_its_recorded_values():
    recorded = json.loads(RECORDED.read_text())
    assert list(PRESETS) == list(recorded)
    for name, preset in PRESETS.items():
        now, then = resolved(preset), flatten(recorded[name])
        assert now.keys() == then.keys(), (
            f"{name}: fields added {now.keys() - then.keys()}, gone {then.keys() - now.keys()}"
        )
        changed = {key: (then[key], now[key]) for key in now if now[key] != then[key]}
        assert not changed, f"{name}: (recorded, now) {changed}"
        assert len(now) > 200  # every stage's config is in it, not a summary


def test_flatten_sees_a_changed_value_deep_in_a_section():
    """The comparison above would fail on one changed threshold of one gate."""
    preset = PRESETS["qwen2.5-3b"]
    before = resolved(preset)
    after = resolved(apply_overrides(preset, {"rsft_gate.thresholds.min_parse_rate": 0.123}))
    assert {k for k in before if before[k] != after[k]} == {"rsft_gate.thresholds.min_parse_rate"}


def test_presets_share_one_gate_size_per_preset():
    """A preset's quality gates (BC, RSFT, GRPO's own) judge the same seeds per cell."""
    for preset in PRESETS.values():
        assert preset.bc_sft_gate.n_seeds == preset.rsft_gate.n_seeds == preset.grpo.gate_seeds
