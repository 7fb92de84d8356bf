"""What the stepwise faces (OpenEnv ``step``, Gymnasium) make of plans an optimiser can write there.

Two tables, on cases from seed 3,000,000 on (no default was tuned on them), ideal dynamics:

1. Off-path aligner series on the oracle's trajectory (each ends where it ends): the lower molars
   driven 2.4 mm up into their antagonists by aligner 12 and back; every tooth jiggled 0.1 mm
   sideways and back each aligner; every tooth taken 0.9 mm sideways and back (a 1.8 mm round trip).
   Per level: how many break a hard rule, how many earn at least the clean path, how many raise
   smoothness.
2. Gymnasium ``reward_mode="shaped"`` under discounting: per level and gamma, how many cases where a
   rule-breaking plan (every tooth in aligner 1; rushed in 6 aligners) returns at least doing
   nothing, or at least the lower of uniform SLERP and the oracle when those are safe.

3. Small wobbles of the worn aligners, both dynamics, cases from seed 3,600,000 on: the oracle's
   aligners shifted sideways by 0.002-0.05 mm on the odd (or the even) aligners, and the same shift
   held from aligner 1 to 23 (out at the start, back at the end). Per level and dynamics: how many
   earn more than the clean path without breaking a rule.

``OMP_NUM_THREADS=1 python experiments/audits/stepwise_faces.py [seeds per level] [wobble seeds]`` (defaults 30
and 12; single process).
"""

from __future__ import annotations

import sys

import gymnasium as gym
import numpy as np

from server.cases import TASK_IDS, generate_case
from server.dental_constants import LOWER_PAIRS, N_STAGES, TOOTH_IDS
from server.dental_environment import StepwiseDentalEnvironment
from server.gym_env import ENV_ID
from server.oracle import oracle_plan
from server.plans import interpolate_poses, normalize_plan
from server.treatment import rollout_plans

SEED_START = 3_000_000
GAMMAS = (1.0, 0.99, 0.95, 0.9, 0.5)
_STAGES = np.arange(N_STAGES + 1)
_OUT_AND_BACK = np.minimum(_STAGES, N_STAGES - _STAGES) / (N_STAGES / 2)
_UNIFORM = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 1 / N_STAGES}]}


def detours(clean: np.ndarray) -> dict[str, np.ndarray]:
    """The off-path series built on a clean trajectory (25, 28, 7)."""
    molars = clean.copy()
    molars[:, LOWER_PAIRS[5:].ravel(), 6] += 2.4 * _OUT_AND_BACK[:, None]
    jiggle = clean.copy()
    jiggle[:, :, 4] += 0.1 * (_STAGES % 2)[:, None]
    trip = clean.copy()
    trip[:, :, 4] += 0.9 * _OUT_AND_BACK[:, None]
    return {"molars_up_and_back": molars, "jiggle_0.1mm": jiggle, "round_trip_1.8mm": trip}


WOBBLE_SEED_START = 3_600_000
WOBBLE_AMPLITUDES_MM = (0.002, 0.005, 0.01, 0.02, 0.05)


def wobbles(clean: np.ndarray, amplitude: float) -> dict[str, np.ndarray]:
    """The oracle's aligners (25, 28, 7) shifted ``amplitude`` mm along x on odd or even aligners,
    or from aligner 1 to 23; each ends where the clean path ends."""
    out = {}
    for name, on in (("odd", _STAGES % 2 == 1), ("even", (_STAGES % 2 == 0) & (_STAGES % N_STAGES > 0))):
        t = clean.copy()
        t[on, :, 4] += amplitude
        out[name] = t
    held = clean.copy()
    held[1:N_STAGES, :, 4] += amplitude
    out["held"] = held
    return out


def terminal(store: StepwiseDentalEnvironment, case, trajectory: np.ndarray, strategy: str | None) -> dict:
    obs = store.reset(case.task_id, case.seed, case.force_decay)
    for stage in range(1, N_STAGES + 1):
        obs = store.step(obs["episode_id"], trajectory[stage], strategy=strategy)
    out = store.sessions.get(obs["episode_id"]).terminal
    store.close_episode(obs["episode_id"])
    return out


def discounted_return(env: gym.Env, seed: int, trajectory: np.ndarray, strategy: str | None, gamma: float):
    env.reset(options={"case_seed": seed, "strategy": strategy})
    total = 0.0
    for stage in range(1, N_STAGES + 1):
        _, reward, _, _, info = env.step(trajectory[stage])
        total += gamma ** (stage - 1) * reward
    return total, info


def _along(case, progress: np.ndarray) -> np.ndarray:
    return interpolate_poses(case.initial, case.target, np.repeat(progress[:, None], 28, axis=1))


def main(n: int) -> None:
    store = StepwiseDentalEnvironment(max_sessions=4)
    print(
        f"off-path series on the oracle's trajectory, ideal dynamics, {n} seeds per level from {SEED_START}"
    )
    print(f"{'level':12s} {'series':20s} {'breaks':>7s} {'>= clean':>9s} {'smoother':>9s}")
    for task_id in TASK_IDS:
        counts = {}
        for seed in range(SEED_START, SEED_START + n):
            case = generate_case(task_id, seed)
            oracle = oracle_plan(store.reset(task_id, seed))
            clean = rollout_plans([normalize_plan(oracle)], [case])[0][0]
            base = terminal(store, case, clean, oracle.get("strategy"))
            for name, trajectory in detours(clean).items():
                result = terminal(store, case, trajectory, oracle.get("strategy"))
                c = counts.setdefault(name, [0, 0, 0])
                c[0] += bool(result["broken_rules"])
                c[1] += not result["broken_rules"] and result["scaled_reward"] >= base["scaled_reward"]
                smooth = result["reward_breakdown"]["smoothness"]
                c[2] += smooth > base["reward_breakdown"]["smoothness"]
        for name, (broke, paid, smoother) in counts.items():
            print(f"{task_id:12s} {name:20s} {broke:4d}/{n} {paid:6d}/{n} {smoother:6d}/{n}")

    print(f"\nGymnasium shaped returns under discounting, {n} seeds per level from {SEED_START}")
    print("cases where a breaker returns >= doing nothing | >= min(uniform, oracle) when both are safe")
    print(f"{'level':12s} {'gamma':>5s} {'at_once':>16s} {'rushed_6':>16s} {'rushed_6 broke':>15s}")
    for task_id in TASK_IDS:
        envs = {g: gym.make(ENV_ID, task_id=task_id, reward_mode="shaped", gamma=g) for g in GAMMAS}
        tally = {g: {"at_once": [0, 0], "rushed_6": [0, 0]} for g in GAMMAS}
        rushed_broke = 0
        for seed in range(SEED_START, SEED_START + n):
            case = generate_case(task_id, seed)
            oracle = oracle_plan(store.reset(task_id, seed))
            safe = {
                "uniform": (rollout_plans([normalize_plan(_UNIFORM)], [case])[0][0], None),
                "oracle": (rollout_plans([normalize_plan(oracle)], [case])[0][0], oracle.get("strategy")),
            }
            breakers = {
                "at_once": _along(case, np.minimum(_STAGES, 1.0)),
                "rushed_6": _along(case, np.minimum(_STAGES / 6, 1.0)),
            }
            for g, env in envs.items():
                floor, all_safe = np.inf, True
                for trajectory, strategy in safe.values():
                    value, info = discounted_return(env, seed, trajectory, strategy, g)
                    floor, all_safe = min(floor, value), all_safe and not info["broken_rules"]
                for name, trajectory in breakers.items():
                    value, info = discounted_return(env, seed, trajectory, None, g)
                    if not info["broken_rules"]:
                        continue
                    rushed_broke += name == "rushed_6" and g == 1.0
                    tally[g][name][0] += value >= 0.0
                    tally[g][name][1] += all_safe and value >= floor
        for g in GAMMAS:
            a, r = tally[g]["at_once"], tally[g]["rushed_6"]
            print(f"{task_id:12s} {g:5.2f} {a[0]:6d} | {a[1]:6d} {r[0]:7d} | {r[1]:6d} {rushed_broke:9d}/{n}")


def wobble_table(n: int) -> None:
    """Table 3: per level and dynamics, wobbled paths that earn more than the clean path, safe."""
    store = StepwiseDentalEnvironment(max_sessions=4)
    print(f"\n3. wobbles of {WOBBLE_AMPLITUDES_MM} mm, seeds {WOBBLE_SEED_START}+{n}")
    print("level        decay   odd  even  held  tried  largest gain (scaled)")
    for task_id in TASK_IDS:
        for force_decay in (False, True):
            wins, tried, largest = {"odd": 0, "even": 0, "held": 0}, 0, 0.0
            for seed in range(WOBBLE_SEED_START, WOBBLE_SEED_START + n):
                case = generate_case(task_id, seed, force_decay)
                oracle = oracle_plan(store.reset(task_id, seed, force_decay))
                strategy = oracle.get("strategy")
                clean = rollout_plans([normalize_plan(oracle)], [case])[0][0]
                base = terminal(store, case, clean, strategy)["scaled_reward"]
                for amplitude in WOBBLE_AMPLITUDES_MM:
                    for name, trajectory in wobbles(clean, amplitude).items():
                        result = terminal(store, case, trajectory, strategy)
                        gain = result["scaled_reward"] - base
                        tried += name == "odd"
                        if not result["broken_rules"] and gain > 0.0:
                            wins[name] += 1
                            largest = max(largest, gain)
            print(
                f"{task_id:12s} {force_decay!s:5s} {wins['odd']:5d} {wins['even']:5d} {wins['held']:5d}"
                f" {tried:6d}  {largest:+.4f}"
            )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
    wobble_table(int(sys.argv[2]) if len(sys.argv) > 2 else 12)
