"""PNG plots logged with a training run (matplotlib, Agg backend, no display needed).

* :func:`reward_components` — every ``rewards/<name>/mean`` and ``reward`` over steps, from the
  trainer's log history;
* :func:`tooth_trajectories` — one case's planned progress per tooth over the 25 stages;
* :func:`arch_before_after` — top view (x, y) of the arch: initial, after the plan, target.

The case plots use a plan (a JSON-like dict); :func:`case_plan` gives the oracle's when the run has
none better (e.g. the model's best completion).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from orthojob.core.prompts import reset_observation
from server.cases import generate_case
from server.oracle import oracle_plan
from server.plans import normalize_plan, planned_progress
from server.treatment import rollout_plans


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def reward_components(log_history: Sequence[dict], path: str | Path) -> Path:
    """Mean of each reward component (and the weighted total) per step."""
    plt = _plt()
    rows = [r for r in log_history if "reward" in r and "step" in r]
    names = sorted({k for r in rows for k in r if k.startswith("rewards/") and k.endswith("/mean")})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = [r["step"] for r in rows]
    for key in names:
        ax.plot(
            steps, [r.get(key, np.nan) for r in rows], marker="o", label=key[len("rewards/") : -len("/mean")]
        )
    ax.plot(steps, [r["reward"] for r in rows], color="black", linewidth=2, label="reward (weighted)")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("GRPO reward components")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, plt, path)


def case_plan(task_id: str, seed: int, force_decay: bool = False) -> dict:
    """The oracle's plan for a case (a plan dict, as a completion would hold)."""

    return oracle_plan(reset_observation(seed, task_id, force_decay))


def _rollout(plan: dict, task_id: str, seed: int, force_decay: bool):
    """(case, planned progress per stage and tooth, achieved poses per stage) of a plan on a case."""

    case = generate_case(task_id, seed, force_decay)
    spec = normalize_plan(plan)
    _, achieved = rollout_plans([spec], [case])
    progress = planned_progress(spec.start, spec.fraction, spec.overcorrection)
    return case, progress, achieved[0]


def tooth_trajectories(
    plan: dict, task_id: str, seed: int, path: str | Path, force_decay: bool = False
) -> Path:
    """Planned share of each tooth's movement per stage (one line per tooth)."""
    return _draw_trajectories(_rollout(plan, task_id, seed, force_decay), plan, task_id, seed, path)


def _draw_trajectories(rolled: tuple, plan: dict, task_id: str, seed: int, path: str | Path) -> Path:
    plt = _plt()
    _case, progress, _ = rolled
    fig, ax = plt.subplots(figsize=(8, 4.5))
    cmap = plt.get_cmap("viridis")
    n_teeth = progress.shape[-1]
    for tooth in range(n_teeth):
        ax.plot(progress[:, tooth], color=cmap(tooth / max(1, n_teeth - 1)), linewidth=1)
    ax.set_xlabel("stage")
    ax.set_ylabel("share of movement done")
    ax.set_title(f"{task_id} seed {seed}: per-tooth trajectory ({plan.get('strategy', '?')})")
    ax.grid(alpha=0.3)
    return _save(fig, plt, path)


def arch_before_after(
    plan: dict, task_id: str, seed: int, path: str | Path, force_decay: bool = False
) -> Path:
    """Top view of crown positions: initial, after the plan's last stage, and the target."""
    return _draw_arch(_rollout(plan, task_id, seed, force_decay), task_id, seed, path)


def _draw_arch(rolled: tuple, task_id: str, seed: int, path: str | Path) -> Path:
    plt = _plt()
    case, _, achieved = rolled
    fig, ax = plt.subplots(figsize=(6, 6))
    for poses, style, label in (
        (case.initial, "o", "before (initial)"),
        (achieved[-1], "x", "after the plan"),
        (case.target, "+", "target"),
    ):
        ax.scatter(poses[:, 4], poses[:, 5], marker=style, label=label)
    ax.set_aspect("equal")
    ax.set_xlabel("x (mm)")
    ax.set_ylabel("y (mm)")
    ax.set_title(f"{task_id} seed {seed}: arch before / after")
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def training_plots(
    log_history: Sequence[dict], folder: str | Path, task_id: str, seed: int, force_decay: bool = False
) -> list[Path]:
    """All three plots into ``folder``; returns their paths."""
    folder = Path(folder)
    plan = case_plan(task_id, seed, force_decay)
    rolled = _rollout(plan, task_id, seed, force_decay)  # one simulation for both case plots
    return [
        reward_components(log_history, folder / "reward_components.png"),
        _draw_trajectories(rolled, plan, task_id, seed, folder / "tooth_trajectories.png"),
        _draw_arch(rolled, task_id, seed, folder / "arch_before_after.png"),
    ]
