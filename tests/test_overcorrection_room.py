"""Tests of the overcorrection room (server.staging.overcorrection_room) and the ``room`` prompt that shows it."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest

from orthojob.core.prompts import build_prompt, reset_observation
from server.case_records import case_of_record, record_of_case, register_case
from server.cases import HELDOUT_SEED_START, TASK_IDS, generate_case
from server.collisions import COLLISION_TOLERANCE_MM, all_pairs_penetration_mm
from server.dental_constants import (
    ADJACENT_PAIRS,
    CROWN_DEPTH_MM,
    CROWN_WIDTH_MM,
    SECOND_NEIGHBOUR_PAIRS,
    TOOTH_IDS,
)
from server.dental_environment import initial_observation
from server.oracle import oracle_plan
from server.plans import MAX_OVERCORRECTION, interpolate_poses, normalize_plan
from server.staging import OC_QUANTUM, overcorrection_room

PAIRS = np.concatenate((ADJACENT_PAIRS, SECOND_NEIGHBOUR_PAIRS))
_ROOM_ROW = re.compile(r"^  (\d\d) (-?\d+) (-?\d+) (-?\d+) (\d+) (\d+) (\d+)$")
_TERSE_ROW = re.compile(r"^  (\d\d) (-?\d+) (-?\d+) (-?\d+) (\d+) (\d+)$")


def _tooth_collides(case, level: float, tooth: int) -> bool:
    """Whether, with every tooth overcorrected by ``level``, a pair of ``tooth`` penetrates beyond tolerance."""
    poses = interpolate_poses(case.initial, case.target, np.full((1, 28), 1.0 + level))[0]
    pen = all_pairs_penetration_mm(poses, case.crown_width_mm, case.crown_depth_mm)
    return bool((pen[(tooth == PAIRS).any(axis=1)] > COLLISION_TOLERANCE_MM).any())


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_the_room_is_the_last_overcorrection_before_the_tooths_aligner_shape_collides(task_id: str) -> None:
    """Every tooth clears its pairs at its room and (below the maximum) collides one step above it;
    checked pair by pair on the overcorrected poses, not through the function's own sweep."""
    limited = 0
    for seed in range(HELDOUT_SEED_START, HELDOUT_SEED_START + 4):
        case = generate_case(task_id, seed, True)
        room = overcorrection_room(case.initial, case.target, case.crown_width_mm, case.crown_depth_mm)
        assert room.shape == (28,) and (room >= 0).all() and (room <= MAX_OVERCORRECTION + 1e-12).all()
        assert np.allclose(room / OC_QUANTUM, np.rint(room / OC_QUANTUM))
        for i in range(28):
            if room[i] > 0 or not _tooth_collides(case, 0.0, i):
                assert not _tooth_collides(case, room[i], i), (seed, TOOTH_IDS[i], room[i])
            if room[i] < MAX_OVERCORRECTION:
                limited += 1
                assert _tooth_collides(case, room[i] + OC_QUANTUM, i), (seed, TOOTH_IDS[i], room[i])
    assert limited > 0  # some tooth of these cases is limited: the check above ran


def test_the_oracles_compensation_mostly_stays_within_the_room() -> None:
    """The oracle finds its overcorrection on the simulator and trims it where aligner shapes collide;
    the room, found without a plan, bounds it on all but a few teeth (the oracle's neighbours are not
    always overcorrected alike)."""
    within = total = 0
    for seed in range(HELDOUT_SEED_START, HELDOUT_SEED_START + 12):
        case = generate_case("task_hard", seed, True)
        room = overcorrection_room(case.initial, case.target, case.crown_width_mm, case.crown_depth_mm)
        oc = normalize_plan(oracle_plan(initial_observation(case))).overcorrections()
        total += int((oc > 0).sum())
        within += int(((oc > 0) & (oc <= room + 1e-9)).sum())
    assert total > 100 and within >= 0.85 * total, (within, total)


def test_the_room_prompt_adds_the_column_under_force_decay_only() -> None:
    decay = reset_observation(HELDOUT_SEED_START + 1, "task_hard", True)
    text, terse = build_prompt(decay, "room"), build_prompt(decay, "terse")
    rows = [m for m in map(_ROOM_ROW.match, text.splitlines()) if m]
    terse_rows = [m for m in map(_TERSE_ROW.match, terse.splitlines()) if m]
    assert rows and len(rows) == len(terse_rows)
    case = generate_case("task_hard", HELDOUT_SEED_START + 1, True)
    room = overcorrection_room(case.initial, case.target, case.crown_width_mm, case.crown_depth_mm)
    for m, t in zip(rows, terse_rows, strict=True):
        assert m.groups()[:6] == t.groups()  # the terse row, then the room in hundredths
        assert int(m.group(7)) == round(100 * room[TOOTH_IDS.index(int(m.group(1)))])
    assert "overcorrection in 0.01 at which this tooth's aligner shape would collide" in text
    assert {int(m.group(7)) for m in rows} != {100}  # this case has limited teeth
    ideal = reset_observation(HELDOUT_SEED_START + 1, "task_hard", False)
    assert build_prompt(ideal, "room") == build_prompt(ideal, "terse")


def test_an_imported_cases_room_uses_its_crowns_and_an_edited_observation_the_norms() -> None:
    """An imported case (narrower crowns, two teeth absent) is read with its own crown sizes; an
    observation whose poses are not its case's (edited by hand) with the crown norms, without failing."""
    record = json.loads(json.dumps(record_of_case(generate_case("task_hard", 7, True))))
    record = {k: v for k, v in record.items() if k not in ("task_id", "seed", "labels")}
    keep = [i for i, t in enumerate(record["teeth"]) if t not in (17, 27)]
    for name in ("teeth", "initial", "target", "crown_width_mm", "crown_depth_mm"):
        record[name] = [record[name][i] for i in keep]
    record["crown_width_mm"] = [w * 0.97 for w in record["crown_width_mm"]]
    record["absent"] = [17, 27]
    record["force_decay"] = True
    case = case_of_record(record).case
    key = register_case(case)
    observation = initial_observation(generate_case(*key))
    own = overcorrection_room(
        case.initial, case.target, case.crown_width_mm, case.crown_depth_mm, case.absent
    )
    norms = overcorrection_room(case.initial, case.target, CROWN_WIDTH_MM, CROWN_DEPTH_MM, case.absent)
    assert not np.array_equal(own, norms)  # the two readings differ on this case

    def column(text: str) -> dict[int, int]:
        return {int(m.group(1)): int(m.group(7)) for m in map(_ROOM_ROW.match, text.splitlines()) if m}

    shown = column(build_prompt(observation, "room"))
    assert shown and 17 not in shown and 27 not in shown
    assert shown == {t: round(100 * own[TOOTH_IDS.index(t)]) for t in shown}
    edited = dict(observation, initial_config=(np.asarray(observation["initial_config"]) + 1e-3).tolist())
    moved = replace(case, initial=np.asarray(edited["initial_config"]))
    expect = overcorrection_room(moved.initial, moved.target, CROWN_WIDTH_MM, CROWN_DEPTH_MM, case.absent)
    shown = column(build_prompt(edited, "room"))
    assert shown == {t: round(100 * expect[TOOTH_IDS.index(t)]) for t in shown}
