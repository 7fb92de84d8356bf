"""The reward judges clinical quality: no plan that breaks a hard rule
out-earns one that keeps them, per-stage limits bind, strategy is judged by sequence, the oracle
is safe, and every reward carries a within-group signal in the clinical direction.

The plans are exploits a reward that judges outcomes loosely would pay: the oracle's staging sped
up, teeth moved all at once, nothing moved, and one slow group declaring the Class II strategy."""

from __future__ import annotations

import numpy as np
import pytest

from orthojob.core.prompts import plan_to_completion
from orthojob.eval.reward_signal import (
    MIN_GROUP_STD,
    MIN_INFORMATIVE_SHARE,
    format_report,
    signal_groups,
    signal_report,
)
from orthojob.rewards.reward_functions import REWARD_FUNCS, reward_anchorage
from server.cases import TASK_IDS, generate_case
from server.dental_constants import TOOTH_IDS
from server.oracle import plan_for_case
from server.plans import normalize_plan
from server.reward_scaler import FAIL_TOP, REWARD_MIN
from server.scoring import STAGING_FOLLOWS_RHO, score_episodes
from server.treatment import rollout_plans, score_plans

ONE_GROUP = {
    "strategy": "distal_first",
    "tooth_groups": [{"teeth": [11, 12, 21, 22, 31, 32, 41, 42], "fraction": 0.0556, "priority": "medium"}],
}
"""The incisors as one slow group under ``distal_first``, Class II's optimal strategy, with no
sequence: it claims the strategy's multiplier without staging the buccal segments first."""
NOTHING = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 0.0}]}
ALL_AT_ONCE = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 1.0}]}
SEEDS = range(50)
SLERP_TIE = 1e-4
"""The oracle writes fractions to 4 decimals: where it falls back to uniform staging it can trail
exact uniform SLERP by ~5e-6 on the scaled reward."""


def scaled_plan(plan: dict, k: float) -> dict:
    return {
        **plan,
        "tooth_groups": [
            dict(g, fraction=min(1.0, round(g["fraction"] * k, 4))) for g in plan["tooth_groups"]
        ],
    }


def most_displaced_tooth_at_once(case) -> dict:
    worst = int(np.argmax(np.hypot(case.need[0], 0.125 * case.need[1])))
    return {"tooth_groups": [{"teeth": [TOOTH_IDS[worst]], "fraction": 1.0}]}


@pytest.fixture(scope="module", params=[(t, d) for d in (False, True) for t in TASK_IDS], ids=str)
def level(request) -> dict:
    """Per (task, dynamics): 50 cases scored under the oracle, SLERP, x2, x3 and the degenerate plans."""
    task, decay = request.param
    rows = []
    for seed in SEEDS:
        case = generate_case(task, seed, decay)
        oracle = plan_for_case(case)
        plans = {
            "oracle": oracle,
            "slerp": None,
            "x2": scaled_plan(oracle, 2.0),
            "x3": scaled_plan(oracle, 3.0),
            "tooth_at_once": most_displaced_tooth_at_once(case),
            "all_at_once": ALL_AT_ONCE,
            "nothing": NOTHING,
            "one_group": ONE_GROUP,
        }
        results = dict(zip(plans, score_plans(list(plans.values()), [case] * len(plans))))
        rows.append({"case": case, "plans": plans, "results": results})
    return {"task": task, "decay": decay, "rows": rows}


def _scaled(row: dict, name: str) -> float:
    return row["results"][name]["scaled_reward"]


# --- the ordering principle ---------------------------------------------------------------------------


def test_the_exploit_plans_on_task_medium_seed_0():
    """A safe plan that barely moves beats colliding, over-limit and everything-at-once plans."""
    case = generate_case("task_medium", 0)
    oracle = plan_for_case(case)
    ten_percent = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 0.1 / 24}]}
    incisors_rushed = {
        "tooth_groups": [{"teeth": [t for t in TOOTH_IDS if t % 10 <= 2], "fraction": 0.5}],
    }
    names = ["ten_percent", "nothing", "all_at_once", "x3", "oracle", "slerp", "incisors_rushed"]
    plans = [ten_percent, NOTHING, ALL_AT_ONCE, scaled_plan(oracle, 3.0), oracle, None, incisors_rushed]
    r = dict(zip(names, score_plans(plans, [case] * len(plans))))
    s = {k: v["scaled_reward"] for k, v in r.items()}
    print({k: (round(v, 3), r[k]["broken_rules"]) for k, v in s.items()})
    assert not r["ten_percent"]["broken_rules"] and not r["nothing"]["broken_rules"]
    for failing in ("all_at_once", "x3", "incisors_rushed"):
        assert r[failing]["broken_rules"], failing
        assert REWARD_MIN < s[failing] <= FAIL_TOP < s["nothing"] == 0.0 < s["ten_percent"], failing
    assert s["x3"] < s["slerp"] < s["oracle"]


def test_breaking_plans_score_below_every_safe_plan(level):
    """Over every plan scored for the level: max(failing) < min(safe), doing nothing included."""
    safe, failing = [], []
    for row in level["rows"]:
        for res in row["results"].values():
            (failing if res["broken_rules"] else safe).append(res["scaled_reward"])
    assert failing and safe
    assert max(failing) < min(safe), (max(failing), min(safe))


def test_failing_band_is_graded_by_the_breach(level):
    """Within a case, the plan that breaks more scores lower (x3 breaks more than x2)."""
    graded = [
        row
        for row in level["rows"]
        if row["results"]["x2"]["broken_rules"] and row["results"]["x3"]["broken_rules"]
    ]
    ok = [
        _scaled(row, "x3") < _scaled(row, "x2")
        for row in graded
        if sum(
            row["results"]["x3"]["diagnostics"][k] for k in ("limit_breach", "pdl_breach", "collision_breach")
        )
        > sum(
            row["results"]["x2"]["diagnostics"][k] for k in ("limit_breach", "pdl_breach", "collision_breach")
        )
    ]
    assert all(ok)


# --- per-stage limits bind ---------------------------------------------------------------------------


def test_compressed_oracle_that_breaks_the_limits_scores_below_oracle_and_slerp(level):
    breaking = below = 0
    for row in level["rows"]:
        for name in ("x2", "x3"):
            if "limits" in row["results"][name]["broken_rules"]:
                breaking += 1
                below += _scaled(row, name) < min(_scaled(row, "oracle"), _scaled(row, "slerp"))
    print(f"{level['task']} decay={level['decay']}: {below}/{breaking} over-limit compressions below both")
    assert breaking > 0
    assert below / breaking >= 0.95


def test_degenerate_moves_score_below_a_plan_that_barely_moves(level):
    """Everything (or the most displaced tooth) in one aligner breaks the rules and scores below
    doing nothing, except on a case whose every movement fits one aligner within the limits."""
    legit = 0
    for row in level["rows"]:
        for name in ("all_at_once", "tooth_at_once"):
            if row["results"][name]["broken_rules"]:
                assert _scaled(row, name) < _scaled(row, "nothing")
                assert _scaled(row, "nothing") == pytest.approx(0.0, abs=1e-9)
                if not row["results"]["slerp"]["broken_rules"]:  # under decay lags can make it collide
                    assert _scaled(row, "nothing") < _scaled(row, "slerp")
            else:  # a correction small enough for one aligner: a legitimate plan
                legit += 1
    assert legit <= 0.1 * len(level["rows"])


def test_a_plan_over_the_limits_earns_no_more_than_at_a_feasible_speed():
    """The same staging, slowed into the limits, scores at least as much as its over-limit version."""
    for task in TASK_IDS:
        for seed in range(20):
            case = generate_case(task, seed)
            oracle = plan_for_case(case)
            fast = scaled_plan(oracle, 2.5)
            res_fast, res_slow = score_plans([fast, oracle], [case, case])
            if "limits" in res_fast["broken_rules"]:
                assert res_fast["scaled_reward"] < res_slow["scaled_reward"]


# --- strategy is judged by sequence -------------------------------------------------------------------


def test_one_group_plan_does_not_beat_the_oracle_on_class_ii(level):
    rows = [row for row in level["rows"] if row["case"].optimal_strategy == "distal_first"]
    assert rows
    beaten = [row["case"].seed for row in rows if _scaled(row, "one_group") >= _scaled(row, "oracle")]
    assert not beaten, f"{level['task']}: the one-group plan beats the oracle on seeds {beaten}"
    assert all(row["results"]["one_group"]["reward_breakdown"]["strategy_multiplier"] < 1.2 for row in rows)


def test_moving_the_buccal_segment_at_once_does_not_earn_distal_first():
    buccal_at_once = {
        "strategy": "distal_first",
        "tooth_groups": [
            {"teeth": [t for t in TOOTH_IDS if t % 10 >= 3], "fraction": 0.0417},
            {"teeth": [t for t in TOOTH_IDS if t % 10 < 3], "fraction": 0.0834, "priority": "low"},
        ],
    }
    cases = [generate_case(t, s) for t in TASK_IDS for s in range(60)]
    cases = [c for c in cases if c.optimal_strategy == "distal_first"]
    assert len(cases) >= 20
    results = score_plans([buccal_at_once] * len(cases), cases)
    assert all(r["reward_breakdown"]["strategy_multiplier"] < 1.2 for r in results)


def test_the_oracle_follows_its_strategys_sequence(level):
    """The oracle's staging earns 1.2 (the movement follows the sequence) on >= 85 % of the cases;
    the rest are cases it could only make safe, or compensate under force decay, with a flatter
    sequence (it then earns the neutral multiplier, never the wrong one)."""
    rows = level["rows"]
    follows = [
        row["results"]["oracle"]["diagnostics"]["sequence_concordance"] >= STAGING_FOLLOWS_RHO for row in rows
    ]
    assert np.mean(follows) >= 0.85, np.mean(follows)
    assert all(row["results"]["oracle"]["reward_breakdown"]["strategy_multiplier"] >= 1.0 for row in rows)
    for row, ok in zip(rows, follows):
        if ok:
            assert row["results"]["oracle"]["reward_breakdown"]["strategy_multiplier"] == 1.2


# --- a safe oracle ------------------------------------------------------------------------------------


def test_the_oracle_is_safe_and_at_least_uniform_slerp(level):
    for row in level["rows"]:
        assert not row["results"]["oracle"]["broken_rules"], (level["task"], row["case"].seed)
        assert _scaled(row, "oracle") >= _scaled(row, "slerp") - SLERP_TIE


# --- every reward earns its place -----------------------------------------------------------------


@pytest.fixture(scope="module")
def signal() -> dict:
    cases = [(t, s, d) for t in TASK_IDS for s in range(2) for d in (False, True)]
    groups = signal_groups(cases, group_size=32, seed=0)
    report = signal_report(groups)
    print("\n" + format_report(report, len(groups), 32))
    return report


@pytest.mark.parametrize("name", list(REWARD_FUNCS))
def test_every_reward_varies_within_groups(signal, name):
    """>= 12 prompts x groups of 32 plausible plans: each reward is informative in most groups."""
    r = signal[name]
    assert r["std"] > MIN_GROUP_STD[name]
    assert r["share_informative"] >= MIN_INFORMATIVE_SHARE, r


def test_auxiliary_rewards_are_not_copies_of_the_terminal(signal):
    for name in REWARD_FUNCS:
        if name != "reward_terminal":
            assert signal[name]["rank_corr"] < 0.95, (name, signal[name])


def test_anchorage_prefers_the_staged_oracle_to_all_at_once_and_to_nothing(level):
    rows = level["rows"]
    comps = []
    for row in rows:
        comps += [plan_to_completion(row["plans"][k]) for k in ("oracle", "all_at_once", "nothing")]
    n = len(comps)
    cols = {
        "seed": [row["case"].seed for row in rows for _ in range(3)],
        "task_id": [level["task"]] * n,
        "force_decay": [level["decay"]] * n,
    }
    values = np.array(reward_anchorage(comps, **cols)).reshape(-1, 3)
    assert np.mean(values[:, 0] > values[:, 1]) >= 0.9
    assert np.mean(values[:, 0] > values[:, 2]) >= 0.9


def test_occlusion_prefers_a_bite_kept_to_a_bite_wrecked_midway():
    """Two trajectories that both arrive: one straight, one whose upper incisors swing 2 mm forward
    midway (an overjet opened and closed again)."""
    for task in TASK_IDS:
        for seed in range(5):
            case = generate_case(task, seed)
            planned, _ = rollout_plans([normalize_plan(None)], [case])
            wrecked = planned.copy()
            incisors = np.array([t % 10 <= 2 and t < 30 for t in TOOTH_IDS])
            bump = np.sin(np.linspace(0.0, np.pi, planned.shape[1]))[:, None] * 2.0
            wrecked[0, :, incisors, 5] += bump.T  # anterior (y) excursion, back at the end
            both = np.concatenate((planned, wrecked))
            scores = score_episodes(
                initial=np.stack([case.initial] * 2),
                target=np.stack([case.target] * 2),
                width_mm=np.stack([case.crown_width_mm] * 2),
                depth_mm=np.stack([case.crown_depth_mm] * 2),
                planned=both,
                achieved=both,
                profiles=[case.profile] * 2,
                strategies=[None, None],
            )
            kept, wreck = scores.components["occlusion_course"]
            final_kept, final_wreck = scores.components["occlusion_composite"]
            assert final_kept == pytest.approx(final_wreck)  # the end alone cannot tell them apart
            assert kept > wreck + 0.05, (task, seed, kept, wreck)
