"""Stage 1, tool-use SFT (``orthojob tool-sft``): the oracle's plans as tool conversations.

**Demonstrations** (:func:`tool_demonstrations` on generated training seeds,
:func:`case_set_tool_demonstrations` on a case set's training patients): for each training case the oracle
(:func:`server.oracle.oracle_plan`) plays an episode of :class:`orthojob.agentic.tools.DentalToolEnv`
through the very tools GRPO's agentic mode exposes: it inspects one or two of the teeth with the
most movement (``inspect_tooth``), checks the arch's contacts (``check_collisions``) and submits its
plan (``submit_plan``), then says it is done. Each row is the agentic prompt (system + instructions
with the case appended, :func:`orthojob.agentic.prompts.full_prompt`), the assistant's tool calls in the
chat template's tool-call format with the tools' real results as ``tool`` messages, and the tools'
JSON schemas (column ``tools``, which TRL's SFTTrainer renders into the system message as GRPO
does). Traces whose plan breaks a hard rule are skipped (as stage 2 does; counted). A trace ends
with the reward the environment gave it, the one-shot reward of the oracle's plan.

**Training** is :func:`orthojob.stages.sft.run_sft` (the tokenizer gets the tool-calling template,
:func:`orthojob.agentic.chat_template.prepare_tokenizer`) on the conversations as messages
(:func:`conversation_dataset`). The loss covers the assistant's turns only, each tool call's JSON and
the closing turn with their end-of-turn tokens: not the prompt, not the tools' results (the
environment's text). TRL's SFTTrainer (``assistant_only_loss``) renders each conversation with the
training variant of the template, which marks the assistant's turns with ``{% generation %}`` (for
TRL's Qwen2.5 template, its ``qwen2_5_training``: the same text), and trains on the marked tokens;
the checkpoint keeps the inference template, the one GRPO's agentic mode recognises.

**Gate** (stage ``tool_sft``, :func:`orthojob.agentic.episodes.tool_gate_metrics`, checked by :func:`orthojob.stages.gate.gate_report`): greedy agentic rollouts on held-out seeds
(or a case set's held-out patients),
up to ``GateSettings.tool_turns`` assistant turns each, the tools run on :class:`DentalToolEnv`.
Metrics: ``tool_call_rate`` (share of episodes whose first turn is a parseable call of a known
tool), ``finished_rate`` (share that submitted a plan or committed 24 stages), ``valid_call_rate``,
``reward_mean``, ``turns_mean``. Default thresholds: tool_call_rate >= 0.9, finished_rate >= 0.8
(``--min-tool-call-rate``, ``--min-finished-rate``).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence

import numpy as np

from orthojob.agentic.chat_template import prepare_tokenizer
from orthojob.agentic.episodes import tool_call_message
from orthojob.agentic.prompts import agentic_messages, agentic_rows, full_prompt
from orthojob.agentic.tools import DentalToolEnv
from orthojob.core.prompts import TRAIN_SEED_START, plan_to_completion, reset_observation
from orthojob.modeling.models import build_tiny, tiny_corpus
from server.agent_tools import TOOL_NAMES
from server.cases import CaseKey
from server.dental_constants import MM_PER_DEG, TOOTH_IDS
from server.oracle import oracle_plan

log = logging.getLogger(__name__)

TOOL_SFT_STAGE = "tool_sft"
"""The gate's stage name."""
DONE_MESSAGE = "The plan is submitted."
"""The assistant's last turn of a demonstration (after submit_plan's result)."""


def tool_schemas() -> list[dict]:
    """The JSON schemas of the tools, as TRL derives them from :class:`DentalToolEnv`'s methods."""
    from transformers.utils import get_json_schema

    env = DentalToolEnv.__new__(DentalToolEnv)  # the bound methods only: no environment needed
    return [get_json_schema(getattr(env, name)) for name in TOOL_NAMES]


def oracle_tool_trace(seed: int, task_id: str, force_decay: bool, rng: random.Random) -> dict:
    """One demonstration (module docstring) on a generated training seed: the row, plus ``plan``,
    ``reward`` (the environment's scaled reward of the trace), ``broken_rules`` and ``calls`` (the tool
    names in order)."""
    (row,) = agentic_rows(1, seed, task_id, force_decay)  # refuses held-out seeds
    return _trace(row, rng)


def key_tool_trace(key: CaseKey, rng: random.Random) -> dict:
    """:func:`oracle_tool_trace` on any case by its key (a case set's training patient's: held out by
    patient, not by seed)."""
    row = {"prompt": agentic_messages(), "seed": int(key.seed), "task_id": key.task_id,
           "force_decay": bool(key.force_decay)}  # fmt: skip
    return _trace(row, rng)


def _trace(row: dict, rng: random.Random) -> dict:
    """The oracle's tool episode on the case of an agentic dataset ``row``."""
    seed, task_id, force_decay = row["seed"], row["task_id"], row["force_decay"]
    env = DentalToolEnv()
    env.reset(**row)
    obs = reset_observation(seed, task_id, force_decay)
    plan = oracle_plan(obs)
    # the teeth the patient has with the most movement left (mm-equivalent), one or two of them
    dist, rot = env._case.need
    present = set(env._case.present_ids)
    order = [TOOTH_IDS[int(i)] for i in np.argsort(-(dist + MM_PER_DEG * rot), kind="stable")]
    teeth = [t for t in order if t in present][: rng.randint(1, 2)]
    calls = [("inspect_tooth", {"tooth_id": t}) for t in teeth]
    calls += [("check_collisions", {}), ("submit_plan", {"plan": plan_to_completion(plan)})]
    completion = []
    for name, arguments in calls:
        result = getattr(env, name)(**arguments)
        if result.startswith("error: "):
            raise RuntimeError(f"the oracle's {name}({arguments}) was refused: {result}")
        completion += [tool_call_message(name, arguments), {"role": "tool", "name": name, "content": result}]
    completion.append({"role": "assistant", "content": DONE_MESSAGE})
    return {
        "prompt": full_prompt(row),
        "completion": completion,
        "tools": json.dumps(tool_schemas()),
        "seed": seed,
        "task_id": task_id,
        "force_decay": bool(force_decay),
        "plan": plan,
        "reward": env.reward,
        "broken_rules": list(env.result["broken_rules"]),
        "calls": [name for name, _ in calls],
    }


def tool_demonstrations(
    n: int, task_ids: Sequence[str], force_decay: bool = False, seed: int = 0
) -> tuple[list[dict], dict]:
    """``n`` tool-trace rows on training seeds (tasks take turns; traces whose plan breaks a hard
    rule skipped and the next seed taken), and their counts."""
    rng = random.Random(seed)
    tasks = list(task_ids)
    next_seed = dict.fromkeys(tasks, TRAIN_SEED_START)
    rows: list[dict] = []
    filtered = 0
    k = 0
    while len(rows) < n:
        task_id = tasks[k % len(tasks)]
        k += 1
        row = oracle_tool_trace(next_seed[task_id], task_id, force_decay, rng)
        next_seed[task_id] += 1
        if row["broken_rules"]:
            filtered += 1
            k -= 1  # the same task again, on its next seed
            continue
        rows.append(row)
    return rows, _tool_info(rows, filtered)


def case_set_tool_demonstrations(
    keys: Sequence[CaseKey], case_ids: Sequence[str], n: int, seed: int = 0
) -> tuple[list[dict], dict]:
    """Tool-trace rows on the cases ``keys`` (a case set's training patients, ``case_ids`` naming
    them): each case once, in order, at most ``n`` rows; a trace whose plan breaks a hard rule is
    skipped (counted). Each row carries its ``case_id``; returns the rows and their counts."""
    rng = random.Random(seed)
    rows: list[dict] = []
    filtered = 0
    for key, case_id in zip(keys, case_ids, strict=True):
        if len(rows) == n:
            break
        row = key_tool_trace(key, rng)
        if row["broken_rules"]:
            filtered += 1
            continue
        rows.append({**row, "case_id": case_id})
    return rows, _tool_info(rows, filtered)


def _tool_info(rows: Sequence[dict], filtered: int) -> dict:
    """The counts of tool demonstrations: examples, traces filtered for a hard rule, mean reward and
    mean tool calls per trace."""
    info = {
        "source": "tool",
        "examples": len(rows),
        "filtered_hard_rule": filtered,
        "reward_mean": float(np.mean([r["reward"] for r in rows])) if rows else 0.0,
        "calls_mean": float(np.mean([len(r["calls"]) for r in rows])) if rows else 0.0,
    }
    log.info("tool demonstrations: %s", info)
    return info


def conversation_dataset(rows: Sequence[dict]):
    """The rows as a conversational prompt/completion dataset with the tools' schemas (column
    ``tools``, JSON), what SFTTrainer's ``assistant_only_loss`` trains on. The completions are stored
    as JSON (``datasets``' ``Json`` type): each tool call keeps its own arguments (Arrow records would
    unify them into one record type, adding null fields to every call)."""
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "prompt": [r["prompt"] for r in rows],
            "completion": [r["completion"] for r in rows],
            "tools": [r["tools"] if isinstance(r["tools"], str) else json.dumps(r["tools"]) for r in rows],
        },
        on_mixed_types="use_json",
    )


def render_rows(rows: Sequence[dict], tokenizer) -> list[dict]:
    """The rows as text prompt/completion pairs, rendered with ``tokenizer``'s tool-calling template
    (the tools' schemas in the system message, as GRPO's agentic prompts): the prompt up to the first
    assistant turn's header, the completion the rest of the conversation (the tiny model's tokenizer
    corpus, :func:`tiny_tool_corpus`)."""
    out = []
    for row in rows:
        tools = json.loads(row["tools"]) if isinstance(row["tools"], str) else row["tools"]
        prompt = tokenizer.apply_chat_template(
            row["prompt"], tools=tools, add_generation_prompt=True, tokenize=False
        )
        full = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tools=tools, tokenize=False)
        if not full.startswith(prompt):
            raise ValueError("the chat template does not render the prompt as a prefix of the conversation")
        completion = full[len(prompt) :].rstrip("\n")
        out.append({"prompt": prompt, "completion": completion})
    return out


def tiny_tool_corpus(task_ids: Sequence[str], force_decay: bool = False, n_per_task: int = 4) -> list[str]:
    """Tokenizer corpus for a tiny model of stage 1: the one-shot corpus
    (:func:`orthojob.modeling.models.tiny_corpus`) and a few training tool conversations rendered with the
    tool-calling template, so that the tools' schemas cost few tokens."""
    from orthojob.modeling.tiny_model import train_tokenizer  # torch at import: orthojob --help stays light

    renderer = prepare_tokenizer(train_tokenizer(["x y"]))
    rows, _ = tool_demonstrations(n_per_task * len(task_ids), task_ids, force_decay)
    texts = [r["prompt"] + r["completion"] for r in render_rows(rows, renderer)]
    return tiny_corpus(task_ids, force_decay) + texts


def build_tiny_tool_model(out_dir, task_ids: Sequence[str], force_decay: bool = False, **arch):
    """The offline tiny model (:func:`orthojob.modeling.tiny_model.build_tiny_model`) with a tokenizer that also
    knows the tool conversations and room for them (at least 8192 positions). ``arch`` may name a
    ``prompt_format`` (:func:`orthojob.modeling.models.build_tiny`), recorded in its ``config.json``."""
    from pathlib import Path

    path = Path(out_dir)
    if (path / "config.json").is_file():
        return path
    arch = {**arch, "max_position_embeddings": max(int(arch.get("max_position_embeddings", 0)), 8192)}
    return build_tiny(path, task_ids, force_decay, corpus=tiny_tool_corpus(task_ids, force_decay), **arch)


__all__ = [
    "DONE_MESSAGE",
    "TOOL_SFT_STAGE",
    "build_tiny_tool_model",
    "case_set_tool_demonstrations",
    "conversation_dataset",
    "key_tool_trace",
    "oracle_tool_trace",
    "render_rows",
    "tiny_tool_corpus",
    "tool_demonstrations",
    "tool_schemas",
]
