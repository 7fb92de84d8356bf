"""Prompts: one builder for SFT, GRPO and evaluation alike.

A prompt is built from a reset observation of the environment (stage 0): the case's top-12
most displaced teeth (:data:`TOP_TEETH`), its clinical summary, the per-stage limits, and
the plan format with its semantics (:data:`PLAN_SEMANTICS`, the statement of
:mod:`server.plans`, built from the server's constants so no number is restated by hand).

Four prompt formats (:data:`PROMPT_FORMATS`), a property of the policy model
(:func:`prompt_format_of`, recorded in the model's ``config.json`` as :data:`PROMPT_FORMAT_KEY`):
``full`` (default) is the above; ``compact`` is the case part alone (:func:`case_description`),
for small models whose format stage teaches the plan format: half the tokens, so a CPU learning run
trains about three times faster per completion. ``terse`` is ``compact`` with the teeth as bare
integers (:data:`TERSE_COLUMNS`), every tooth that moves listed, not the top 12: a tiny model's
tokenizer spells each digit, so the labels cost as much as the numbers. ``room`` is ``terse`` with,
under force decay, a last column: each tooth's overcorrection room
(:func:`server.staging.overcorrection_room`), the overcorrection at which its aligner shape would
collide, which the case's poses alone do not show.

Seeds: training prompts use seeds from :data:`TRAIN_SEED_START`, held-out evaluation seeds
from :data:`HELDOUT_SEED_START`; the two ranges never meet for any realistic dataset size.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from server.absent_teeth import SUMMARY_KEY as ABSENT_KEY
from server.cases import HELDOUT_SEED_START, TASK_IDS, TRAIN_SEED_START, CaseKey, generate_case
from server.clinical_profiles import STRATEGIES, STRATEGY_LEVELS
from server.dental_constants import (
    CROWN_DEPTH_MM,
    CROWN_WIDTH_MM,
    DEFAULT_PRIORITY,
    MAX_ROTATION_DEG,
    MAX_TRANSLATION_MM,
    MM_PER_DEG,
    N_STAGES,
    N_TEETH,
    PRIORITY_START_STAGE,
    TOOTH_IDS,
    TOOTH_NUMBER,
)
from server.dental_environment import initial_observation
from server.errors import InvalidActionError
from server.plans import MAX_OVERCORRECTION
from server.quaternion_utils import quaternion_angle
from server.staging import overcorrection_room

TOP_TEETH: int = 12
"""Teeth listed in a prompt, most displaced first (as many as the prompt of the project's original
specification lists)."""

SYSTEM_PROMPT: str = (
    "You are an orthodontic treatment planner for clear aligner therapy. You read a case and "
    "write its whole staging plan as a single JSON object, with no prose and no code fence."
)

_PRIORITIES = sorted(PRIORITY_START_STAGE, key=PRIORITY_START_STAGE.get)


def _fmt(x: float, digits: int = 4) -> str:
    return f"{x:.{digits}f}".rstrip("0").rstrip(".")


def _strategy_order(strategy: str) -> str:
    """'x1-x2, then x3, ...': the FDI last digits of each level of a strategy's staging order."""
    levels = STRATEGY_LEVELS[strategy]
    steps = []
    for level in np.unique(levels):
        numbers = sorted({int(n) for n in TOOTH_NUMBER[levels == level]})
        runs, run = [], [numbers[0]]
        for n in numbers[1:]:
            if n == run[-1] + 1:
                run.append(n)
            else:
                runs.append(run)
                run = [n]
        runs.append(run)
        steps.append(" and ".join(f"x{r[0]}" if len(r) == 1 else f"x{r[0]}-x{r[-1]}" for r in runs))
    return ", then ".join(steps)


def _plan_semantics() -> str:
    starts = ", ".join(f"{p} at stage {PRIORITY_START_STAGE[p]}" for p in _PRIORITIES)
    uniform = 1.0 / N_STAGES
    strategy_alts = " | ".join(f'"{s}"' for s in STRATEGIES)
    priority_alts = " | ".join(f'"{p}"' for p in _PRIORITIES)
    orders = "\n".join(f"  {s}: {_strategy_order(s)}" for s in STRATEGIES)
    quadrants = ", ".join(f"{q}1-{q}7" for q in (1, 2, 3, 4))
    return f"""\
Return ONLY one JSON object of this shape:
{{"strategy": {strategy_alts},
 "tooth_groups": [{{"teeth": [<FDI ids>], "fraction": <number in [0, 1]>, "priority": {priority_alts}}}, ...]}}
(a group may give "start_stage": <integer 1-{N_STAGES}> instead of priority, and "overcorrection": <number in [0, {_fmt(MAX_OVERCORRECTION)}]>)

Plan semantics:
- Teeth are FDI ids {quadrants} (xN = tooth number N in any quadrant: 1-2 incisors, 3 canine, \
4-5 premolars, 6-7 molars).
- priority sets the stage at which a group starts moving: {starts}; missing = {DEFAULT_PRIORITY}. start_stage (an integer 1-{N_STAGES}) sets it directly and overrides priority.
- fraction is the share of each tooth's total movement performed per stage once it starts, at \
constant speed, until the tooth reaches its target: planned progress at stage s is \
clip((s - start + 1) * fraction, 0, 1). fraction 1/{N_STAGES} = {_fmt(uniform)} from stage 1 is \
uniform SLERP over all {N_STAGES} aligners; fraction 0 keeps a tooth where it is. A group starting at \
stage start reaches its target by stage {N_STAGES} only if fraction >= 1 / ({N_STAGES} - start + 1).
- overcorrection (default 0) plans a group's teeth beyond their targets, to (1 + overcorrection) times their movement: under force decay teeth express only part of each aligner (extrusion and rotation of canines and premolars least), so clinicians overcorrect; an overshoot that is expressed costs accuracy. The per-stage limits apply to the overcorrected steps.
- A tooth stays within the per-stage limits ({_fmt(MAX_TRANSLATION_MM)} mm, \
{_fmt(MAX_ROTATION_DEG)} deg) when fraction <= 1 / min_stages.
- Teeth in no group follow uniform SLERP. A tooth listed twice takes its first group. Unknown FDI \
ids, non-integer ids, fractions outside [0, 1] or not numbers (NaN included), and unknown priorities \
are ignored (a group with a bad fraction is ignored whole) and lower the score. A reply without a \
usable tooth group is not a plan and scores the minimum. Write one plan object.
- Hard rules: a plan that makes crowns collide, overloads a tooth's ligament, or moves a tooth \
faster than the per-stage limits scores below doing nothing.
- strategy is one of {", ".join(STRATEGIES)}. It is judged against the case and against the \
order in which the plan moves the teeth (each level's movement should come before the next \
level's, not merely start first); each strategy moves the teeth in this order:
{orders}"""


PLAN_SEMANTICS: str = _plan_semantics()
"""The plan format and semantics of :mod:`server.plans`, as the prompt states them."""


def _tooth_needs(observation: dict) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(order, delta, dist, rot, min_stages)`` of the patient's present teeth: their row indices, most
    displaced first (mm-equivalent distance, as the server scores it; ties by index), and per row the
    translation to target (mm, (28, 3)), its length (mm), the rotation to target (deg) and the fewest
    stages within the per-stage limits."""
    initial = np.asarray(observation.get("current_config") or observation["initial_config"], dtype=np.float64)
    target = np.asarray(observation["target_config"], dtype=np.float64)
    delta = target[:, 4:] - initial[:, 4:]
    dist = np.linalg.norm(delta, axis=-1)
    rot = np.degrees(quaternion_angle(initial[:, :4], target[:, :4]))
    need = np.hypot(dist, MM_PER_DEG * rot)
    stages = np.maximum(dist / MAX_TRANSLATION_MM, rot / MAX_ROTATION_DEG)
    min_stages = np.maximum(1, np.ceil(stages - 1e-9)).astype(int)
    absent = set((observation.get("case_summary") or {}).get(ABSENT_KEY) or ())
    here = [i for i in range(N_TEETH) if TOOTH_IDS[i] not in absent]
    return sorted(here, key=lambda i: (-need[i], i)), delta, dist, rot, min_stages


def _tooth_rows(observation: dict) -> list[str]:
    """The TOP_TEETH most displaced teeth, one labelled row each."""
    order, delta, dist, rot, min_stages = _tooth_needs(observation)
    rows = []
    for i in order[:TOP_TEETH]:
        dx, dy, dz = delta[i] + 0.0  # + 0.0 turns -0.0 into 0.0
        rows.append(
            f"  FDI {TOOTH_IDS[i]}: dist={dist[i]:.2f}mm  d=({dx:+.2f},{dy:+.2f},{dz:+.2f})  "
            f"rot={rot[i]:.1f}deg  min_stages={min_stages[i]}"
        )
    return rows


TERSE_COLUMNS: str = (
    "FDI, target - current in 0.01 mm (x patient's left, y anterior, z occlusal-up), rotation in 0.1 deg, "
    "fewest stages within the per-stage limits"
)
"""The columns of a terse prompt's tooth rows (:func:`_tooth_table`)."""
ROOM_COLUMN: str = (
    "overcorrection in 0.01 at which this tooth's aligner shape would collide with every tooth overcorrected "
    "alike (100: none up to 1)"
)
"""The last column of a ``room`` prompt's tooth rows under force decay."""


def _overcorrection_room(observation: dict) -> np.ndarray:
    """(28,) :func:`server.staging.overcorrection_room` of the observation's case, with its crown sizes
    where the observation is its case's (generated or imported), else the crown norms."""
    initial = np.asarray(observation["initial_config"], dtype=np.float64)
    target = np.asarray(observation["target_config"], dtype=np.float64)
    width, depth, absent = CROWN_WIDTH_MM, CROWN_DEPTH_MM, None
    try:
        case = generate_case(
            observation["task_id"],
            int(observation["seed"]),
            bool(observation.get("force_decay")),
            bool(observation.get("non_compliance")),
        )
    except (InvalidActionError, KeyError, TypeError, ValueError):
        case = None
    if case is not None and np.array_equal(case.initial, initial) and np.array_equal(case.target, target):
        width, depth, absent = case.crown_width_mm, case.crown_depth_mm, case.absent
    else:
        gone = set((observation.get("case_summary") or {}).get(ABSENT_KEY) or ())
        absent = np.array([t in gone for t in TOOTH_IDS]) if gone else None
    return overcorrection_room(initial, target, width, depth, absent)


def _tooth_table(observation: dict, room: bool = False) -> tuple[list[str], int]:
    """Every present tooth that moves, most displaced first, as bare integers in :data:`TERSE_COLUMNS`'
    order, and how many present teeth are left out because all their numbers round to 0 (at target).

    A small model's tokenizer writes each digit as a token, so whole hundredths of a mm cost about half
    the tokens of a labelled row (:func:`_tooth_rows`): every moving tooth for the price of the top 12.
    A ``task_hard`` case often moves all 28 teeth and a ``task_easy`` case four. ``room``: each row ends
    with the tooth's overcorrection room in hundredths (:data:`ROOM_COLUMN`).
    """
    order, delta, _dist, rot, min_stages = _tooth_needs(observation)
    hundredths = np.rint(delta * 100.0).astype(int)
    tenths = np.rint(rot * 10.0).astype(int)
    moving = [i for i in order if hundredths[i].any() or tenths[i]]
    rows = [
        f"  {TOOTH_IDS[i]} {hundredths[i, 0]} {hundredths[i, 1]} {hundredths[i, 2]} {tenths[i]} {min_stages[i]}"
        for i in moving
    ]
    if room:
        oc_room = np.rint(_overcorrection_room(observation) * 100.0).astype(int)
        rows = [f"{row} {oc_room[i]}" for row, i in zip(rows, moving, strict=True)]
    return rows, len(order) - len(moving)


def _summary_rows(summary: dict) -> list[str]:
    rows = []
    for key, value in summary.items():
        if key == ABSENT_KEY:
            value = (
                f"{', '.join(map(str, value))} (the patient has no such tooth: leave them out of every group)"
            )
        elif isinstance(value, float):
            value = f"{value + 0.0:.2f}"
        rows.append(f"  {key}: {value}")
    return rows


PROMPT_FORMATS: tuple[str, ...] = ("full", "compact", "terse", "room")
"""``full``: case and plan format; ``compact``: the case only; ``terse``: the case only, every moving tooth
as bare numbers; ``room``: ``terse`` with each tooth's overcorrection room under force decay (module
docstring)."""
PROMPT_FORMAT_KEY: str = "orthorl_prompt_format"
"""The model config attribute (saved in ``config.json``) naming the policy's prompt format."""


def check_prompt_format(prompt_format: str) -> str:
    """``prompt_format`` if it is one of :data:`PROMPT_FORMATS`, else ValueError naming them."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt format {prompt_format!r} is not one of {', '.join(PROMPT_FORMATS)}")
    return prompt_format


def prompt_format_of(model) -> str:
    """The prompt format a policy was trained with: its config's :data:`PROMPT_FORMAT_KEY`
    (``model`` is a model, a config or a folder with ``config.json``); ``full`` when unset."""
    config = getattr(model, "config", model)
    if isinstance(config, (str, bytes)) or hasattr(config, "__fspath__"):
        from pathlib import Path

        path = Path(config) / "config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
    value = (
        config.get(PROMPT_FORMAT_KEY)
        if isinstance(config, dict)
        else getattr(config, PROMPT_FORMAT_KEY, None)
    )
    return check_prompt_format(value or "full")


def set_prompt_format(model_dir, prompt_format: str) -> None:
    """Record ``prompt_format`` in the saved model's ``config.json`` (every later stage reads it)."""
    from pathlib import Path

    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    config[PROMPT_FORMAT_KEY] = check_prompt_format(prompt_format)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def build_prompt(observation: dict, prompt_format: str = "full") -> str:
    """The user message for a reset observation of the environment: :func:`case_description` and
    (``full`` format) the plan format (:data:`PLAN_SEMANTICS`)."""
    prompt_format = check_prompt_format(prompt_format)
    if prompt_format != "full":
        return case_description(
            observation, terse=prompt_format in ("terse", "room"), room=prompt_format == "room"
        )
    return "\n".join([case_description(observation), "", PLAN_SEMANTICS])


def case_description(observation: dict, terse: bool = False, room: bool = False) -> str:
    """The case part of :func:`build_prompt`: the task, the clinical summary, the teeth furthest
    from target and the per-stage limits (the agentic mode's first observation,
    :mod:`orthojob.agentic.tools`). ``terse``: every tooth that moves in :func:`_tooth_table`'s rows
    instead of the top :data:`TOP_TEETH` in labelled ones; ``room`` (terse only): under force decay each
    row's overcorrection room too (:data:`ROOM_COLUMN`)."""
    decay = bool(observation.get("force_decay"))
    present = _present(observation)
    if terse:
        with_room = room and decay
        rows, still = _tooth_table(observation, room=with_room)
        columns = f"{TERSE_COLUMNS}, {ROOM_COLUMN}" if with_room else TERSE_COLUMNS
        teeth = [
            f"Teeth that move, furthest from target first ({len(rows)} of {present}; the other {still} are at "
            f"their target; {columns}):",
            *rows,
        ]
    else:
        teeth = [
            f"Teeth furthest from target (top {TOP_TEETH} of {present}; dist = translation mm, d = target - "
            "current in mm (x patient's left, y anterior, z occlusal-up), rot = rotation deg, min_stages = "
            "fewest stages within the per-stage limits):",
            *_tooth_rows(observation),
        ]
    lines = [
        f"Plan a clear-aligner treatment of {N_STAGES} aligners (stages 1-{N_STAGES}; stage 0 is the "
        "initial state).",
        f"Task: {observation.get('task_id')}  force_decay: {'on' if decay else 'off'}"
        + (
            " (each aligner expresses only part of its movement; the rest carries over to the next)"
            if decay
            else ""
        ),
        "",
        "Case summary (initial casts, mm):",
        *_summary_rows(observation.get("case_summary") or {}),
        "",
        *teeth,
        "",
        f"Constraints: at most {_fmt(MAX_TRANSLATION_MM)} mm translation and {_fmt(MAX_ROTATION_DEG)} deg "
        "rotation per tooth per stage.",
    ]
    return "\n".join(lines)


def _present(observation: dict) -> int:
    """How many teeth the observation's patient has (28 less the summary's absent teeth)."""
    return N_TEETH - len((observation.get("case_summary") or {}).get(ABSENT_KEY) or ())


def build_messages(observation: dict, prompt_format: str = "full") -> list[dict]:
    """Chat messages (system + user) for a reset observation, in ``prompt_format``."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": build_prompt(observation, prompt_format)},
    ]


def reset_observation(seed: int, task_id: str, force_decay: bool) -> dict:
    """The stage-0 observation of a case (:func:`server.dental_environment.initial_observation`,
    pure: no environment, no session store)."""
    return initial_observation(generate_case(task_id, seed, bool(force_decay)))


def prompt_cases(
    n: int, seed_start: int, task_id: str, force_decay: bool, prompt_format: str = "full"
) -> Iterator[tuple[dict, dict]]:
    """``(row, observation)`` for ``n`` seeds from seed_start: each case is reset once, and its
    :func:`prompt_rows` row comes with the observation it was built from (e.g. for the oracle)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    check_prompt_format(prompt_format)
    return (
        _case_row(seed, task_id, force_decay, prompt_format) for seed in range(seed_start, seed_start + n)
    )


def _case_row(seed: int, task_id: str, force_decay: bool, prompt_format: str) -> tuple[dict, dict]:
    obs = reset_observation(seed, task_id, force_decay)
    row = {
        "prompt": build_messages(obs, prompt_format),
        "seed": seed,
        "task_id": task_id,
        "force_decay": bool(force_decay),
    }
    return row, obs


def prompt_rows(
    n: int, seed_start: int, task_id: str, force_decay: bool, prompt_format: str = "full"
) -> list[dict]:
    """``n`` dataset rows ``{"prompt": messages, "seed", "task_id", "force_decay"}``, seeds from seed_start.

    The extra columns reach the reward functions through TRL. A bad task id or seed raises the
    environment's InvalidActionError (no row is silently dropped).
    """
    return [row for row, _obs in prompt_cases(n, seed_start, task_id, force_decay, prompt_format)]


def key_prompt_rows(
    keys: Sequence[CaseKey], case_ids: Sequence[str], prompt_format: str = "full"
) -> list[dict]:
    """:func:`prompt_rows` rows of the cases ``keys`` (an imported case set's,
    :func:`orthojob.data.case_sets.register`), each with its ``case_id`` as a column too."""
    check_prompt_format(prompt_format)
    rows = []
    for key, case_id in zip(keys, case_ids, strict=True):
        obs = initial_observation(generate_case(*key))
        rows.append({"prompt": build_messages(obs, prompt_format), "seed": key.seed, "task_id": key.task_id,
                     "force_decay": bool(key.force_decay), "case_id": case_id})  # fmt: skip
    return rows


CELLS: tuple[tuple[str, bool], ...] = tuple((t, fd) for t in TASK_IDS for fd in (False, True))
"""Every (task level, force decay) cell, in the order mixed prompts take turns."""


def mixed_prompt_rows(
    n: int, seed_start: int, prompt_format: str = "full", level_weights: Mapping[str, int] | None = None
) -> list[dict]:
    """``n`` :func:`prompt_rows` rows over every cell of :data:`CELLS`, taking turns: row ``i`` is seed
    ``seed_start + i`` of turn ``i`` of :func:`cell_turns` (``level_weights``: a task level's turns per
    round, default 1 each, so without it row ``i`` is cell ``i % len(CELLS)``)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    check_prompt_format(prompt_format)
    turns = cell_turns(level_weights)
    return [_case_row(seed_start + i, *turns[i % len(turns)], prompt_format)[0] for i in range(n)]


def cell_turns(level_weights: Mapping[str, int] | None = None) -> list[tuple[str, bool]]:
    """One round of the cells' turns in a mixed prompt set: each cell of level ``t`` appears
    ``level_weights[t]`` times (default 1), the cells interleaved in :data:`CELLS` order
    (``{"task_hard": 2}``: easy, easy-decay, medium, medium-decay, hard, hard-decay, hard, hard-decay).
    Raises ValueError naming the fix for an unknown level, a weight that is not a whole number in [0, 100],
    or weights that leave no turn."""
    weights = dict.fromkeys(TASK_IDS, 1)
    for name, w in (level_weights or {}).items():
        if name not in weights:
            raise ValueError(
                f"level weight for unknown task level {name!r}: use one of {', '.join(TASK_IDS)}"
            )
        if (
            isinstance(w, bool)
            or not isinstance(w, int | float)
            or not float(w).is_integer()
            or not 0 <= w <= 100
        ):
            raise ValueError(f"level weight of {name} must be a whole number of turns in [0, 100], got {w!r}")
        weights[name] = int(w)
    turns = [cell for r in range(max(weights.values())) for cell in CELLS if weights[cell[0]] > r]
    if not turns:
        raise ValueError("level weights leave no task level to train on: give one a weight >= 1")
    return turns


def plan_to_completion(plan: dict, strategy_last: bool = False) -> str:
    """Canonical one-line JSON text of a plan (the SFT target): ``strategy`` then ``tooth_groups``
    (``strategy_last``: the other way round), each group ``teeth``, ``fraction``, ``priority``,
    ``start_stage``; other keys are dropped."""
    groups = []
    for g in plan.get("tooth_groups") or []:
        if not isinstance(g, dict):
            continue
        out = {k: g[k] for k in ("teeth", "fraction", "priority", "start_stage", "overcorrection") if k in g}
        groups.append(out)
    if strategy_last:
        return json.dumps({"tooth_groups": groups, "strategy": plan.get("strategy")}, allow_nan=False)
    return json.dumps({"strategy": plan.get("strategy"), "tooth_groups": groups}, allow_nan=False)


__all__ = [
    "HELDOUT_SEED_START",
    "PLAN_SEMANTICS",
    "PROMPT_FORMATS",
    "PROMPT_FORMAT_KEY",
    "SYSTEM_PROMPT",
    "TOP_TEETH",
    "TRAIN_SEED_START",
    "build_messages",
    "build_prompt",
    "case_description",
    "key_prompt_rows",
    "plan_to_completion",
    "prompt_cases",
    "prompt_rows",
    "reset_observation",
]
