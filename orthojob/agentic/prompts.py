"""The agentic prompt: the system and user messages before the case, and one dataset row per case.

``reset`` appends the case (:func:`orthojob.core.prompts.case_description`) to the last user
message; :func:`full_prompt` is that whole prompt, as the tool-use SFT data and the gates render it.
"""

from __future__ import annotations

from orthojob.core.prompts import PLAN_SEMANTICS, case_description, reset_observation
from server.cases import HELDOUT_SEED_START, TASK_IDS
from server.dental_constants import (
    MAX_ROTATION_DEG,
    MAX_TRANSLATION_MM,
    N_STAGES,
)
from server.dental_environment import MAX_ROLLBACKS

AGENTIC_SYSTEM_PROMPT: str = (
    "You are an orthodontic treatment planner for clear aligner therapy. You examine a case with "
    "tools, try stages on the simulator, and finish by submitting the whole staging plan."
)


AGENTIC_INSTRUCTIONS: str = f"""\
Plan a clear-aligner treatment of {N_STAGES} aligners with the tools. The case follows this message.
- inspect_tooth(tooth_id): one tooth's remaining movement and planned progress.
- simulate_stage(groups, strategy): try the next aligner without wearing it.
- check_collisions(groups): contacts of the current arch, or of a proposed aligner.
- commit_stage(groups, strategy): wear the next aligner; the {N_STAGES}th finishes the episode.
- rollback_stage(): undo the last aligner (at most {MAX_ROLLBACKS} per episode).
- submit_plan(plan): submit the whole plan as JSON (format below); this finishes the episode.
A stage (groups) is a list of {{"teeth": [FDI ids], "fraction": f}}: the aligner moves each tooth \
a further share f in [0, 1] of its total movement (initial to target); teeth in no group hold still. \
Limits: {MAX_TRANSLATION_MM:g} mm and {MAX_ROTATION_DEG:g} deg per tooth per stage. An episode that \
ends without a submitted plan or {N_STAGES} committed stages scores the minimum.

The plan for submit_plan:
{PLAN_SEMANTICS}"""
"""The user message of an agentic prompt, before the case that ``reset`` appends."""


def agentic_messages() -> list[dict]:
    """The prompt of every agentic row (system + instructions); ``reset`` appends the case."""
    return [
        {"role": "system", "content": AGENTIC_SYSTEM_PROMPT},
        {"role": "user", "content": AGENTIC_INSTRUCTIONS},
    ]


def agentic_rows(n: int, seed_start: int, task_id: str, force_decay: bool) -> list[dict]:
    """``n`` dataset rows ``{"prompt", "seed", "task_id", "force_decay"}`` (seeds from seed_start,
    below the held-out seeds), as :func:`orthojob.core.prompts.prompt_rows` without the case in the prompt."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    if seed_start + n > HELDOUT_SEED_START:
        raise ValueError(
            f"seeds {seed_start}..{seed_start + n - 1} reach the held-out seeds ({HELDOUT_SEED_START})"
        )
    if task_id not in TASK_IDS:
        raise ValueError(f"task_id must be one of {TASK_IDS}, got {task_id!r}")
    return [
        {"prompt": agentic_messages(), "seed": seed, "task_id": task_id, "force_decay": bool(force_decay)}
        for seed in range(seed_start, seed_start + n)
    ]


def full_prompt(row: dict) -> list[dict]:
    """The messages the policy sees for a row: the row's prompt with the case appended to the last
    user message, as TRL does with the text ``reset`` returns (what the prompt-length measurement reads)."""
    obs = reset_observation(int(row["seed"]), row["task_id"], bool(row["force_decay"]))
    messages = [dict(m) for m in row["prompt"]]
    messages[-1]["content"] += _case_text(obs)
    return messages


def _case_text(observation: dict) -> str:
    """What ``reset`` returns (TRL appends it to the last user message): the case, after a blank line."""
    return "\n\n" + case_description(observation)
