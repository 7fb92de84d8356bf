"""Cases: determinism across processes, penetration-free, feasible, ideal targets (docs/environment.md, "Cases")."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from server import cases as cases_module
from server.cases import TASK_IDS, generate_case
from server.clinical_profiles import (
    LITTLE_INDEX_MM,
    OPTIMAL_STRATEGY,
    OVERBITE_MM,
    PROFILES,
    STRATEGIES,
    optimal_strategy,
)
from server.collisions import COLLISION_TOLERANCE_MM, penetration_mm
from server.dental_constants import MAX_ROTATION_DEG, MAX_TRANSLATION_MM, N_STAGES, N_TEETH
from server.errors import InvalidActionError
from server.occlusion import occlusion_composite
from server.quaternion_utils import quaternion_angle
from server.scoring import movement_mm
from server.treatment import score_plans

REPO_ROOT = Path(__file__).resolve().parents[1]
N_SEEDS = 1000
TRIPLES = [
    ("task_easy", 0, False),
    ("task_easy", 7, True),
    ("task_medium", 12345, False),
    ("task_medium", 2**40 + 3, True),
    ("task_hard", 1, False),
    ("task_hard", 999_999, True),
]


def case_digest(task_id: str, seed: int, force_decay: bool) -> str:
    c = generate_case(task_id, seed, force_decay)
    h = hashlib.sha256()
    for arr in (c.initial, c.target, c.crown_width_mm, c.crown_depth_mm):
        h.update(np.ascontiguousarray(arr, dtype=np.float64).tobytes())
    h.update(f"{c.profile}|{c.secondary_profile}|{c.optimal_strategy}".encode())
    return h.hexdigest()


_SUBPROCESS_CODE = """
import hashlib, json, sys
import numpy as np
from server.cases import generate_case
out = []
for task_id, seed, force_decay in json.loads(sys.argv[1]):
    c = generate_case(task_id, seed, force_decay)
    h = hashlib.sha256()
    for arr in (c.initial, c.target, c.crown_width_mm, c.crown_depth_mm):
        h.update(np.ascontiguousarray(arr, dtype=np.float64).tobytes())
    h.update(f"{c.profile}|{c.secondary_profile}|{c.optimal_strategy}".encode())
    out.append(h.hexdigest())
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def arrays_by_task() -> dict[str, dict[str, np.ndarray]]:
    """Stacked arrays of seeds 0..N_SEEDS-1 per task level."""
    out = {}
    for task in TASK_IDS:
        cs = [generate_case(task, s) for s in range(N_SEEDS)]
        out[task] = {
            "initial": np.stack([c.initial for c in cs]),
            "target": np.stack([c.target for c in cs]),
            "width": np.stack([c.crown_width_mm for c in cs]),
            "depth": np.stack([c.crown_depth_mm for c in cs]),
            "profile": np.array([c.profile for c in cs]),
            "summary": [c.summary for c in cs],
        }
    return out


# --- determinism ------------------------------------------------------------------------------


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_cases_are_bit_identical_in_a_separate_process(hash_seed):
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS_CODE, json.dumps(TRIPLES)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = [case_digest(*t) for t in TRIPLES]
    assert theirs == ours


def test_cache_returns_the_same_arrays_as_a_fresh_generation():
    for task_id, seed, force_decay in TRIPLES:
        cached = generate_case(task_id, seed, force_decay)
        fresh = cases_module._geometry.__wrapped__(task_id, seed)
        for name in ("initial", "target", "crown_width_mm", "crown_depth_mm"):
            assert getattr(cached, name).tobytes() == getattr(fresh, name).tobytes(), name
        assert cached.summary == fresh.summary


def test_different_seeds_and_tasks_give_different_cases():
    digests = {case_digest(t, s, False) for t in TASK_IDS for s in range(20)}
    assert len(digests) == 3 * 20


def test_force_decay_does_not_change_the_configurations():
    for task in TASK_IDS:
        a, b = generate_case(task, 5, False), generate_case(task, 5, True)
        assert a.force_decay is False and b.force_decay is True
        assert np.array_equal(a.initial, b.initial) and np.array_equal(a.target, b.target)


def test_case_arrays_are_read_only():
    c = generate_case("task_medium", 3)
    for arr in (c.initial, c.target, c.crown_width_mm, c.crown_depth_mm):
        with pytest.raises(ValueError):
            arr[0] = 0.0


@pytest.mark.parametrize("seed", [True, -1, 2**63, 1.0, "3", None])
def test_bad_seeds_are_refused(seed):
    with pytest.raises(InvalidActionError):
        generate_case("task_easy", seed)


@pytest.mark.parametrize("task", ["task_impossible", "", "TASK_EASY"])
def test_unknown_task_is_refused_with_the_valid_ids(task):
    with pytest.raises(InvalidActionError, match="task_easy"):
        generate_case(task, 0)


def test_numpy_integer_seed_is_the_same_case():
    assert case_digest("task_hard", 42, False) == case_digest("task_hard", np.int64(42), False)


# --- shapes and unit quaternions --------------------------------------------------------------------


@pytest.mark.parametrize("task", TASK_IDS)
def test_configurations_are_well_formed(arrays_by_task, task):
    a = arrays_by_task[task]
    for key in ("initial", "target"):
        arr = a[key]
        assert arr.shape == (N_SEEDS, N_TEETH, 7)
        assert np.all(np.isfinite(arr))
        assert np.allclose(np.linalg.norm(arr[..., :4], axis=-1), 1.0, atol=1e-9)
    assert np.all(a["width"] > 3.0) and np.all(a["width"] < 13.0)
    assert np.all(a["depth"] > 2.0)


# --- penetration-free ------------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASK_IDS)
@pytest.mark.parametrize("which", ["initial", "target"])
def test_no_inter_tooth_penetration(arrays_by_task, task, which):
    a = arrays_by_task[task]
    pen = penetration_mm(a[which], a["width"], a["depth"])  # (N, 26)
    worst = pen.max(axis=-1)
    bad = np.flatnonzero(worst > COLLISION_TOLERANCE_MM)
    assert bad.size == 0, (
        f"{task} {which}: {bad.size}/{N_SEEDS} seeds penetrate beyond {COLLISION_TOLERANCE_MM} mm, "
        f"e.g. seeds {bad[:10].tolist()} worst {worst[bad[:10]].round(3).tolist()} mm"
    )


# --- feasibility -------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASK_IDS)
def test_every_tooth_can_reach_its_target_within_the_limits(arrays_by_task, task):
    a = arrays_by_task[task]
    trans = np.linalg.norm(a["initial"][..., 4:] - a["target"][..., 4:], axis=-1)
    rot = np.degrees(quaternion_angle(a["initial"][..., :4], a["target"][..., :4]))
    t_cap, r_cap = N_STAGES * MAX_TRANSLATION_MM, N_STAGES * MAX_ROTATION_DEG  # 6 mm, 48 deg
    bad = np.flatnonzero((trans.max(-1) > t_cap) | (rot.max(-1) > r_cap))
    assert bad.size == 0, (
        f"{task}: {bad.size} infeasible seeds, e.g. {bad[:10].tolist()}: "
        f"max translation {trans.max():.3f} mm (cap {t_cap}), max rotation {rot.max():.2f} deg (cap {r_cap})"
    )


@pytest.mark.parametrize("task", TASK_IDS)
def test_uniform_slerp_complies_with_the_limits_on_every_seed(task):
    results = score_plans([None] * N_SEEDS, [(task, s, False) for s in range(N_SEEDS)])
    compliance = np.array([r["reward_breakdown"]["limits_compliance"] for r in results])
    violations = np.array([r["diagnostics"]["limit_violations"] for r in results])
    bad = np.flatnonzero(compliance != 1.0)
    assert bad.size == 0, f"{task}: seeds {bad[:10].tolist()} have limits_compliance {compliance[bad[:10]]}"
    assert violations.sum() == 0
    # uniform SLERP reaches the target: accuracy 1 (arccos noise near 0 is ~1e-8 rad) and constant speed
    assert min(r["reward_breakdown"]["accuracy"] for r in results) == pytest.approx(1.0, abs=1e-6)
    assert min(r["reward_breakdown"]["smoothness"] for r in results) >= 0.9


@pytest.mark.parametrize("task", TASK_IDS)
def test_cases_are_not_trivial(arrays_by_task, task):
    """Every case asks for some treatment (otherwise every plan scores the same)."""
    a = arrays_by_task[task]
    need = movement_mm(a["initial"], a["target"]).sum(-1)
    assert need.min() > 1.0, f"{task}: seed {int(need.argmin())} needs only {need.min():.3f} mm-equivalent"


def test_task_levels_scale_the_magnitudes(arrays_by_task):
    means = {
        t: float(movement_mm(arrays_by_task[t]["initial"], arrays_by_task[t]["target"]).sum(-1).mean())
        for t in TASK_IDS
    }
    assert means["task_easy"] < means["task_medium"] < means["task_hard"], means


# --- the ideal target ----------------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASK_IDS)
def test_target_occlusion_is_ideal_and_initial_is_worse(arrays_by_task, task):
    a = arrays_by_task[task]
    target_score = occlusion_composite(a["target"], a["target"], a["width"])
    initial_score = occlusion_composite(a["initial"], a["target"], a["width"])
    print(f"{task}: target occlusion min {target_score.min():.4f}, initial mean {initial_score.mean():.4f}")
    assert target_score.min() >= 0.95, f"{task}: seed {int(target_score.argmin())} {target_score.min():.4f}"
    assert initial_score.mean() < target_score.mean() - 0.03, (initial_score.mean(), target_score.mean())
    assert np.all(initial_score <= target_score + 1e-9)


# --- profiles and the observable summary ----------------------------------------------------------------


@pytest.mark.parametrize("task", TASK_IDS)
def test_every_profile_occurs_and_hard_cases_combine_two(task):
    cs = [generate_case(task, s) for s in range(300)]
    counts = Counter(c.profile for c in cs)
    assert set(counts) == set(PROFILES)
    assert min(counts.values()) >= 30, counts
    for c in cs:
        assert c.optimal_strategy == optimal_strategy(c.profile, c.secondary_profile)
        if c.secondary_profile != "class_ii":
            assert c.optimal_strategy == OPTIMAL_STRATEGY[c.profile]
        if task == "task_hard":
            assert c.secondary_profile in PROFILES and c.secondary_profile != c.profile
        else:
            assert c.secondary_profile is None


def test_summary_is_json_safe_and_names_no_strategy_or_profile():
    required = {
        "upper_irregularity_mm",
        "lower_irregularity_mm",
        "upper_spacing_mm",
        "lower_spacing_mm",
        "overjet_mm",
        "overbite_mm",
        "molar_relation_right_mm",
        "molar_relation_left_mm",
        "molar_class",
        "midline_mm",
    }
    for task in TASK_IDS:
        for s in range(30):
            summary = generate_case(task, s).summary
            assert required <= set(summary)
            text = json.dumps(summary, allow_nan=False)
            for name in (*STRATEGIES, *PROFILES, "strategy", "profile"):
                assert name not in text


@pytest.mark.parametrize("task", TASK_IDS)
def test_summary_reflects_the_profile(arrays_by_task, task):
    a = arrays_by_task[task]
    profile, summary = a["profile"], a["summary"]

    def mean(key, mask):
        return float(np.mean([summary[i][key] for i in np.flatnonzero(mask)]))

    class_ii = profile == "class_ii"
    assert all(summary[i]["molar_class"] == "II" for i in np.flatnonzero(class_ii))
    assert mean("overjet_mm", class_ii) > mean("overjet_mm", ~class_ii) + 1.0
    deep = profile == "deep_bite"
    assert mean("overbite_mm", deep) > mean("overbite_mm", ~deep) + 0.8
    crowd = profile == "crowding"
    lo, hi = LITTLE_INDEX_MM[cases_module.TASK_SEVERITY[task]]
    little = mean("lower_irregularity_mm", crowd)
    assert lo <= little <= hi, f"{task}: crowding cases' mean Little index {little:.2f} not in [{lo}, {hi}]"
    lo, hi = OVERBITE_MM[cases_module.TASK_SEVERITY[task]]
    assert lo <= mean("overbite_mm", deep) <= hi
