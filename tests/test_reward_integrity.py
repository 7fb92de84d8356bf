"""The objective GRPO trains on ranks every rule-breaker below every safe plan, and the auxiliary
rewards cannot be gamed by the plans that gamed them: an optimiser's attacks, called exactly as TRL
calls the rewards (completions and the dataset columns as keyword lists)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from experiments.audits.plan_search import exploit_plans
from experiments.learning.experiment import LearnConfig
from orthojob.core.prompts import plan_to_completion
from orthojob.rewards.reward_functions import REWARD_FUNCS, check_ordering, reward_weights
from orthojob.stages.presets import PRESETS
from server.cases import HELDOUT_SEED_START, TASK_IDS, generate_case
from server.clinical_profiles import STRATEGY_LEVELS
from server.dental_constants import MIRROR_INDEX, MM_PER_DEG, N_STAGES, TOOTH_IDS, TOOTH_INDEX
from server.oracle import plan_for_case
from server.scoring import MOVEMENT_EPS_MM
from server.treatment import score_plans

H = HELDOUT_SEED_START
EVERY = list(TOOTH_IDS)


def _weights(overrides: dict | None = None) -> dict[str, float]:
    funcs = list(REWARD_FUNCS.values())
    return dict(zip(REWARD_FUNCS, reward_weights(funcs, overrides)))


WEIGHTS = {
    "default": _weights(),
    **{f"preset {name}": _weights(p.grpo.reward_weights) for name, p in PRESETS.items()},
    "make learn": _weights({"reward_strategy": LearnConfig().strategy_weight}),
}
"""Every weighting the project trains with."""


def _rewards(case, plans: list[dict]) -> dict[str, np.ndarray]:
    completions = [plan_to_completion(p) for p in plans]
    n = len(plans)
    cols = {
        "seed": [case.seed] * n,
        "task_id": [case.task_id] * n,
        "force_decay": [case.force_decay] * n,
        "non_compliance": [case.non_compliance] * n,
    }
    return {name: np.asarray(f(completions, **cols)) for name, f in REWARD_FUNCS.items()}


def _sums(values: dict[str, np.ndarray], weights: dict[str, float]) -> np.ndarray:
    return sum(weights[k] * v for k, v in values.items())


def _uniform(fraction: float = 1 / N_STAGES, strategy: str | None = None, **extra) -> dict:
    plan = {"tooth_groups": [{"teeth": EVERY, "fraction": fraction, **extra}]}
    return {"strategy": strategy, **plan} if strategy else plan


def _treated(case) -> np.ndarray:
    return np.hypot(case.need[0], MM_PER_DEG * case.need[1]) > MOVEMENT_EPS_MM


def _one_tooth_over_limit(case, oracle: dict, factor: float) -> dict:
    """The oracle's plan with its most-moved treated tooth alone at ``factor`` x its per-stage limit."""
    tooth = int(TOOTH_IDS[int(np.argmax(np.maximum(case.need[0] / 0.25, case.need[1] / 2.0)))])
    ratio = max(case.need[0][TOOTH_INDEX[tooth]] / 0.25, case.need[1][TOOTH_INDEX[tooth]] / 2.0)
    plan = copy.deepcopy(oracle)
    for g in plan["tooth_groups"]:
        g["teeth"] = [t for t in g["teeth"] if t != tooth]
    plan["tooth_groups"] = [g for g in plan["tooth_groups"] if g["teeth"]]
    plan["tooth_groups"].insert(0, {"teeth": [tooth], "fraction": min(1.0, factor / ratio)})
    return plan


def _attack_plans(case) -> tuple[list[dict], list[str]]:
    oracle = plan_for_case(case)
    exploits = exploit_plans(case)
    plans = {
        "oracle": oracle,
        "slerp": _uniform(),
        "slerp+strategy": _uniform(strategy=oracle["strategy"]),
        "nothing": _uniform(0.0, strategy=oracle["strategy"]),
        "ten_percent": _uniform(0.1 / N_STAGES, strategy=oracle["strategy"]),
        "one_tooth_1.15": _one_tooth_over_limit(case, oracle, 1.15),
        "one_tooth_1.5": _one_tooth_over_limit(case, oracle, 1.5),
        "one_tooth_3": _one_tooth_over_limit(case, oracle, 3.0),
        "everything_at_once": exploits["all_at_once"],
        "oracle_x3": exploits["oracle_x3"],
        "mirrored": exploits["mirrored"],
    }
    return list(plans.values()), list(plans)


@pytest.mark.parametrize("task", TASK_IDS)
@pytest.mark.parametrize("force_decay", [False, True])
def test_every_rule_breaker_sums_below_every_safe_plan(task, force_decay):
    """For every weighting the project trains with: max over breaking plans of the weighted sum <
    min over safe plans (doing nothing included), and within the failing band more breach sums lower."""
    for seed in (
        H,
        H + 1,
        H + 8,
        H + 15,
        H + 22,
        H + 29,
    ):  # H: one tooth over its limit beat doing nothing here
        case = generate_case(task, seed, force_decay)
        plans, names = _attack_plans(case)
        results = score_plans(plans, [case] * len(plans))
        values = _rewards(case, plans)
        broken = np.array([bool(r["broken_rules"]) for r in results])
        assert broken[names.index("one_tooth_1.15")] and broken[names.index("everything_at_once")], names
        assert not broken[names.index("nothing")] and not broken[names.index("oracle")]
        for label, weights in WEIGHTS.items():
            total = _sums(values, weights)
            assert total[broken].max() < total[~broken].min(), (
                label,
                case.task_id,
                case.seed,
                dict(zip(names, total)),
            )
            # graded inside the failing band: a larger excess over the limit sums lower
            # (a tooth whose whole movement is under 1.5 or 3 limits gets the same plan at both)
            i, j, m = (names.index(n) for n in ("one_tooth_1.15", "one_tooth_1.5", "one_tooth_3"))
            assert total[i] > total[j] >= total[m], (label, total[i], total[j], total[m])
            assert plans[j] == plans[m] or total[j] > total[m], (label, total[j], total[m])
        for name in ("reward_occlusion", "reward_strategy", "reward_format", "reward_anchorage"):
            assert np.all(values[name][broken] == 0.0), (name, dict(zip(names, values[name])))


def test_weights_that_would_break_the_ordering_are_refused():
    funcs = list(REWARD_FUNCS.values())
    with pytest.raises(ValueError, match="negative"):
        reward_weights(funcs, {"reward_format": -1.0})
    with pytest.raises(ValueError, match="reward_terminal"):
        reward_weights(funcs, {"reward_terminal": 0.0})
    with pytest.raises(ValueError, match="reward_terminal"):
        reward_weights([REWARD_FUNCS["reward_format"], REWARD_FUNCS["reward_occlusion"]])
    with pytest.raises(ValueError, match="nothing to learn"):
        check_ordering({"reward_terminal": 0.0})
    assert reward_weights(funcs, {"reward_strategy": 3.0, "reward_format": 0.0})[2] == 3.0


def _first_level(strategy: str) -> np.ndarray:
    return STRATEGY_LEVELS[strategy] == 0


def test_leaving_the_first_level_unmoved_is_not_following_the_sequence():
    """task_medium seed 1000167: the canines, retraction_first's first level, left where they are while
    every other tooth moves: no optimal multiplier, a negative sequence concordance, and a scaled
    reward below uniform SLERP with the strategy."""
    case = generate_case("task_medium", 1_000_167)
    assert case.optimal_strategy == "retraction_first"
    rest = [t for t in EVERY if t not in (33, 43)]
    plan = {
        "strategy": "retraction_first",
        "tooth_groups": [{"teeth": [33, 43], "fraction": 0.0}, {"teeth": rest, "fraction": 0.041667}],
    }
    gamed, slerp = score_plans([plan, _uniform(strategy="retraction_first")], [case, case])
    assert gamed["scaled_reward"] < slerp["scaled_reward"]
    assert gamed["reward_breakdown"]["strategy_multiplier"] < 1.2
    assert gamed["diagnostics"]["sequence_concordance"] < 0.0


@pytest.mark.parametrize("task", TASK_IDS)
def test_unmoved_first_level_never_counts_as_moved_first(task):
    """50 seeds a level: the optimal strategy named, its first level's treated teeth left unmoved and
    every other tooth moving uniformly never earns the optimal multiplier, scores a negative sequence
    concordance and stays below uniform SLERP with the strategy."""
    plans, cases = [], []
    for k in range(50):
        case = generate_case(task, H + 1000 + k)
        treated = _treated(case)
        first = _first_level(case.optimal_strategy) & treated
        if not first.any() or first.sum() == treated.sum():  # one level: nothing to sequence
            continue
        unmoved = [int(t) for t in np.asarray(TOOTH_IDS)[first]]
        rest = [t for t in EVERY if t not in unmoved]
        groups = [{"teeth": unmoved, "fraction": 0.0}, {"teeth": rest, "fraction": 1 / N_STAGES}]
        plans += [
            {"strategy": case.optimal_strategy, "tooth_groups": groups},
            _uniform(strategy=case.optimal_strategy),
        ]
        cases += [case, case]
    assert len(cases) >= 40
    results = score_plans(plans, cases)
    for gamed, slerp in zip(results[::2], results[1::2]):
        assert gamed["reward_breakdown"]["strategy_multiplier"] < 1.2
        assert gamed["diagnostics"]["sequence_concordance"] < 0.0
        assert gamed["scaled_reward"] < slerp["scaled_reward"]


def test_the_mirrored_malocclusion_scores_below_doing_nothing():
    """task_easy seed 1000004 (Class II): every tooth overcorrected by 1.0 under ideal dynamics ends in
    an anterior crossbite and a Class III molar relation: it breaks the overshoot rule and scores below
    doing nothing, under every weighting of the rewards."""
    case = generate_case("task_easy", 1_000_004)
    mirrored, nothing = score_plans([_uniform(overcorrection=1.0), _uniform(0.0)], [case, case])
    assert "overshoot" in mirrored["broken_rules"]
    assert mirrored["scaled_reward"] < nothing["scaled_reward"] == 0.0
    values = _rewards(case, [_uniform(overcorrection=1.0), _uniform(0.0)])
    for weights in WEIGHTS.values():
        s = _sums(values, weights)
        assert s[0] < s[1]


@pytest.mark.parametrize("task", TASK_IDS)
def test_overshoot_scores_below_reaching_and_below_stopping_as_short(task):
    """50 seeds a level, ideal dynamics: overshooting the target by 15 % scores below reaching it and
    below stopping 15 % short of it; overshooting by 100 % (the malocclusion mirrored) below doing
    nothing; on the weighted sum too, at every weighting the project trains with."""
    cases = [generate_case(task, H + 2000 + k) for k in range(50)]
    kinds = [
        _uniform(),
        _uniform(overcorrection=0.15),
        _uniform(0.85 / N_STAGES),
        _uniform(overcorrection=1.0),
    ]
    results = score_plans([p for _ in cases for p in kinds], [c for c in cases for _ in kinds])
    for k in range(len(cases)):
        reach, over, short, mirrored = (r["scaled_reward"] for r in results[4 * k : 4 * k + 4])
        assert over < reach and over < short, (task, k, reach, over, short)
        assert mirrored < 0.0, (task, k, mirrored)
    # and the sum GRPO trains on, at every weighting: overshooting never beats stopping as short
    completions = [plan_to_completion(p) for _ in cases for p in kinds]
    cols = {
        "seed": [c.seed for c in cases for _ in kinds],
        "task_id": [task] * len(completions),
        "force_decay": [False] * len(completions),
        "non_compliance": [c.non_compliance for c in cases for _ in kinds],
    }
    values = {name: np.asarray(f(completions, **cols)) for name, f in REWARD_FUNCS.items()}
    for label, weights in WEIGHTS.items():
        total = _sums(values, weights).reshape(len(cases), len(kinds))
        assert np.all(total[:, 1] < total[:, 2]), (label, task, total[total[:, 1] >= total[:, 2]])
        assert np.all(total[:, 3] < total[:, 0]), (label, task)


def _rushed(case, teeth: list[int], stages: int) -> dict:
    rest = [t for t in EVERY if t not in teeth]
    return {
        "strategy": plan_for_case(case)["strategy"],
        "tooth_groups": [
            {"teeth": teeth, "fraction": 1.0 / stages},
            {"teeth": rest, "fraction": 1 / N_STAGES},
        ],
    }


def test_rushing_single_teeth_does_not_pay_on_occlusion():
    """task_easy seed 1000200 (deep bite): 11, 31, 41 intruded in 5 aligners (within the limits) while
    the contralateral 21 takes 24: a lopsided bite on the way, which earns less than the oracle on the
    terminal reward and on every weighted sum, and no more than 0.05 above it on occlusion."""
    case = generate_case("task_easy", 1_000_200)
    oracle = plan_for_case(case)
    rush = copy.deepcopy(oracle)
    for g in rush["tooth_groups"]:
        g["teeth"] = [t for t in g["teeth"] if t not in (11, 31, 41)]
    rush["tooth_groups"] = [g for g in rush["tooth_groups"] if g["teeth"]]
    rush["tooth_groups"].insert(0, {"teeth": [11, 31, 41], "fraction": 0.2})
    values = _rewards(case, [oracle, rush])
    assert values["reward_terminal"][1] < values["reward_terminal"][0]
    assert values["reward_occlusion"][1] <= values["reward_occlusion"][0] + 0.05
    for weights in WEIGHTS.values():
        s = _sums(values, weights)
        assert s[1] < s[0]


@pytest.mark.parametrize("task", TASK_IDS)
def test_finishing_one_side_first_does_not_pay_on_occlusion(task):
    """50 seeds a level: the right side's teeth finished in half the treatment and the left side
    uniformly. Where contralateral treated teeth are left apart, the occlusion over the course is
    below uniform SLERP's with the same strategy; wherever rushing costs terminal reward, what it
    gains on occlusion is less than that cost."""
    apart = 0
    for k in range(50):
        case = generate_case(task, H + 3000 + k)
        right = [t for t in EVERY if t // 10 in (1, 4)]
        strategy = plan_for_case(case)["strategy"]
        v = _rewards(case, [_rushed(case, right, 12), _uniform(strategy=strategy)])
        treated = _treated(case)
        paired = bool((treated & treated[MIRROR_INDEX]).any())
        if paired and v["reward_terminal"][0] >= 0.0:
            apart += 1
            assert v["reward_occlusion"][0] < v["reward_occlusion"][1] or v["reward_occlusion"][1] == 0.0, (
                task,
                k,
                v,
            )
        if v["reward_terminal"][0] < v["reward_terminal"][1]:  # rushing costs treatment quality:
            gain = v["reward_occlusion"][0] - v["reward_occlusion"][1]  # occlusion never makes up for it
            assert gain < v["reward_terminal"][1] - v["reward_terminal"][0], (task, k, v)
    assert apart >= 5


@pytest.mark.parametrize("task", TASK_IDS)
def test_strategy_credit_grows_with_the_movement_done(task):
    """50 seeds a level: the oracle's staging scaled to 3.6 %, 25 %, 50 % and 100 % of its speed earns
    a reward_strategy that grows with the movement; the 3.6 % plan, which barely moves, earns
    below 0.1."""
    for k in range(50):
        case = generate_case(task, H + 4000 + k)
        oracle = plan_for_case(case)
        plans = []
        for share in (0.036, 0.25, 0.5, 1.0):
            p = copy.deepcopy(oracle)
            for g in p["tooth_groups"]:
                g["fraction"] = g["fraction"] * share
            plans.append(p)
        r = _rewards(case, plans)["reward_strategy"]
        assert r[0] < 0.1 and np.all(np.diff(r) >= -1e-9), (task, k, r)


@pytest.mark.parametrize("task", TASK_IDS)
def test_format_does_not_penalise_the_overcorrection_force_decay_needs(task):
    """50 seeds a level under force decay: the oracle's overcorrected plan is executable (an aligner
    series carries it out within the limits) and earns no less reward_format than uniform SLERP
    with the strategy, on every case."""
    worse = 0
    for k in range(50):
        case = generate_case(task, H + 5000 + k, True)
        oracle = plan_for_case(case)
        r = score_plans([oracle], [case])[0]
        values = _rewards(case, [oracle, _uniform(strategy=oracle["strategy"])])["reward_format"]
        if any("overcorrection" in g for g in oracle["tooth_groups"]) and not r["broken_rules"]:
            assert r["reward_breakdown"]["executable"] == 1.0, (task, k, r["reward_breakdown"]["executable"])
        worse += values[0] < values[1] - 1e-9
    assert worse == 0


def test_non_compliance_reaches_the_rewards():
    """A dataset row's non_compliance column picks the case with the compliance schedule."""
    plan = plan_to_completion(_uniform())
    cols = {"seed": [3, 3], "task_id": ["task_hard"] * 2, "force_decay": [False, False]}
    worn = REWARD_FUNCS["reward_terminal"]([plan, plan], **cols, non_compliance=[False, True])
    expected = [
        score_plans([_uniform()], [("task_hard", 3, False, w)])[0]["scaled_reward"] for w in (False, True)
    ]
    assert worn == pytest.approx(expected, abs=1e-12)
    assert worn[0] != worn[1]
    with pytest.raises(ValueError, match="non_compliance"):
        REWARD_FUNCS["reward_terminal"](
            [plan], seed=[3], task_id=["task_hard"], force_decay=[False], non_compliance=["yes"]
        )


def _stepwise_rules(case, poses_at) -> list[str]:
    """The hard rules an episode breaks that wears ``poses_at(stage)`` (28 x 7) as each aligner,
    through the environment's stepwise store."""
    from server.dental_environment import StepwiseDentalEnvironment

    store = StepwiseDentalEnvironment()
    eid = store.reset(case.task_id, case.seed, case.force_decay)["episode_id"]
    for stage in range(1, N_STAGES + 1):
        store.step(eid, poses_at(stage))
    return store.sessions.get(eid).terminal["broken_rules"]


def _moved(case, shifts: dict[int, tuple[float, float, float]], over: int = 6):
    """Aligners that shift teeth (FDI id -> mm in x, y, z) from their initial poses, in ``over`` stages."""

    def poses_at(stage: int) -> np.ndarray:
        poses = case.initial.copy()
        for tooth, shift in shifts.items():
            poses[TOOTH_INDEX[tooth], 4:] += min(1.0, stage / over) * np.asarray(shift)
        return poses

    return poses_at


def test_each_new_hard_rule_fires_on_the_plan_that_breaks_it():
    """Crowns one apart meeting, the bite closing through the opposing incisors, the aligner shapes
    colliding where the teeth lag them, and overshoot each break their own hard rule; doing nothing
    breaks none. (x: the patient's left, y: anterior, z: occlusal-up for the upper arch, mm.)"""
    case = generate_case("task_easy", H)
    assert _stepwise_rules(case, _moved(case, {})) == []
    # the upper right canine moved mesially onto the central incisor, the lateral moved out of its way
    (x11, y11), (x13, y13) = case.initial[TOOTH_INDEX[11], 4:6], case.initial[TOOTH_INDEX[13], 4:6]
    second = _stepwise_rules(
        case, _moved(case, {12: (0.0, 12.0, 0.0), 13: (x11 - x13 - 6.5, y11 - y13, 0.0)})
    )
    assert "second_neighbour_collision" in second, second
    # the upper centrals pushed down and back through the lower incisors
    bite = _stepwise_rules(case, _moved(case, {11: (0.0, -2.9, -6.5), 21: (0.0, -2.9, -6.5)}))
    assert "occlusal_collision" in bite and "second_neighbour_collision" not in bite, bite
    # every tooth overcorrected by its whole movement: under force decay the aligner shapes collide
    # where the teeth lag; under ideal dynamics the teeth end past their targets
    mirrored = _uniform(strategy=plan_for_case(case)["strategy"], overcorrection=1.0)
    decayed = generate_case("task_easy", H + 7, True)
    (lagging,) = score_plans([mirrored], [decayed])
    assert "aligner_collision" in lagging["broken_rules"], lagging["broken_rules"]
    (ideal,) = score_plans([mirrored], [case])
    assert "overshoot" in ideal["broken_rules"], ideal["broken_rules"]
