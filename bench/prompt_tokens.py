"""How long each prompt format is, and how much of the case it shows.

Per prompt format (:data:`orthojob.core.prompts.PROMPT_FORMATS`) and task level, over ``--seeds``
training cases per (level x force decay) cell: the prompt's tokens with the chat template and the
system prompt (mean, min, max), and the teeth the prompt lists among those that move (a displacement
or rotation that rounds to at least 0.01 mm or 0.1 deg): their mean count and the share of cases
whose every moving tooth is listed. The tokenizer is ``--tokenizer``'s (a model folder, such as a
learning run's ``<out>/base-model``), or the offline tiny model's, built into a temporary folder.

    OMP_NUM_THREADS=1 python bench/prompt_tokens.py --tokenizer runs/learn/base-model
"""

from __future__ import annotations

import argparse
import re
import tempfile

import numpy as np

from orthojob.core.prompts import PROMPT_FORMATS, build_messages, reset_observation
from server.absent_teeth import SUMMARY_KEY as ABSENT_KEY
from server.cases import TASK_IDS, TRAIN_SEED_START
from server.dental_constants import TOOTH_IDS
from server.quaternion_utils import quaternion_angle

_LISTED = re.compile(r"^  (?:FDI )?(\d\d)[: ]", re.MULTILINE)
"""A tooth row of any format: the labelled ``  FDI 11: ...`` or the terse ``  11 -5 ...``."""


def moving_teeth(observation: dict) -> set[int]:
    """FDI ids of the present teeth whose translation or rotation to target rounds to at least 0.01 mm
    or 0.1 deg."""
    initial = np.asarray(observation["initial_config"], dtype=np.float64)
    target = np.asarray(observation["target_config"], dtype=np.float64)
    moves = np.abs(np.rint((target[:, 4:] - initial[:, 4:]) * 100.0)).max(axis=1) > 0
    moves |= np.rint(np.degrees(quaternion_angle(initial[:, :4], target[:, :4])) * 10.0) > 0
    absent = set((observation.get("case_summary") or {}).get(ABSENT_KEY) or ())
    return {int(t) for t, m in zip(TOOTH_IDS, moves) if m and t not in absent}


def measure(tokenizer, prompt_format: str, task_id: str, seeds: int) -> dict:
    """Token counts and moving-teeth coverage of ``prompt_format`` over ``seeds`` cases per dynamics."""
    tokens, listed, complete = [], [], []
    for decay in (False, True):
        for seed in range(TRAIN_SEED_START, TRAIN_SEED_START + seeds):
            obs = reset_observation(seed, task_id, decay)
            messages = build_messages(obs, prompt_format)
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            tokens.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
            shown = {int(t) for t in _LISTED.findall(messages[-1]["content"])}
            moving = moving_teeth(obs)
            listed.append(len(shown & moving))
            complete.append(moving <= shown)
    return {
        "tokens_mean": float(np.mean(tokens)),
        "tokens_min": int(np.min(tokens)),
        "tokens_max": int(np.max(tokens)),
        "moving_listed": float(np.mean(listed)),
        "all_moving_listed": float(np.mean(complete)),
    }


def _tokenizer(path: str | None):
    from transformers import AutoTokenizer

    if path:
        return AutoTokenizer.from_pretrained(path)
    from orthojob.modeling import models

    folder = tempfile.mkdtemp(prefix="prompt-tokens-")
    models.build_tiny(folder, list(TASK_IDS))
    return AutoTokenizer.from_pretrained(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=None, help="a model folder whose tokenizer counts the tokens")
    parser.add_argument("--seeds", type=int, default=24, help="training cases per (level x force decay) cell")
    args = parser.parse_args(argv)
    tokenizer = _tokenizer(args.tokenizer)
    print(
        "| format | level | tokens, mean [min, max] | moving teeth listed | cases with every moving tooth listed |"
    )
    print("|---|---|---|---|---|")
    for prompt_format in PROMPT_FORMATS:
        for task_id in TASK_IDS:
            m = measure(tokenizer, prompt_format, task_id, args.seeds)
            print(
                f"| {prompt_format} | {task_id} | {m['tokens_mean']:.0f} [{m['tokens_min']}, {m['tokens_max']}] "
                f"| {m['moving_listed']:.1f} | {m['all_moving_listed']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
