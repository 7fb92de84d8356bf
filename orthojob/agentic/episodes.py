"""Greedy tool-calling episodes of a model on :class:`orthojob.agentic.tools.DentalToolEnv`, and the
tool-use gate's metrics over them (stage 1's gate, :func:`orthojob.stages.gate.gate_report`).

Metrics (:func:`tool_gate_metrics`): ``tool_call_rate`` (share of episodes whose first turn is a
parseable call of a known tool), ``finished_rate`` (share that submitted a plan or committed 24
stages), ``valid_call_rate``, ``reward_mean``, ``turns_mean``, ``calls_mean``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence

import numpy as np

from orthojob.agentic.chat_template import prepare_tokenizer
from orthojob.agentic.prompts import agentic_messages, full_prompt
from orthojob.agentic.tools import DentalToolEnv
from server.agent_tools import TOOL_NAMES

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
"""A tool call in a generated turn, in the chat template's tool-call format."""


def tool_call_message(name: str, arguments: dict) -> dict:
    """The assistant message that calls tool ``name`` with ``arguments`` (chat-template form)."""
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}  # fmt: skip


def parse_tool_call(text: str) -> tuple[str, dict] | None:
    """The first ``<tool_call>{"name", "arguments"}</tool_call>`` of a turn, if it names a tool."""
    match = TOOL_CALL.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in TOOL_NAMES:
        return None
    arguments = call.get("arguments", {})
    return (call["name"], arguments) if isinstance(arguments, dict) else None


def agentic_rollouts(
    model, tokenizer, rows: Sequence[dict], max_turns: int, max_new_tokens: int, batch_size: int
) -> list[dict]:
    """Greedy tool-calling episodes, one per row (:func:`orthojob.agentic.prompts.agentic_rows`): each turn
    is generated, its first tool call run on the row's :class:`DentalToolEnv` and the result
    appended as a ``tool`` message, until a turn without a tool call, the episode's end, or
    ``max_turns`` turns. Returns per episode: ``turns``, ``first_call`` (the first turn was a
    parseable call), ``calls``, ``invalid``, ``finished``, ``reward``, ``messages``."""
    import torch

    tokenizer = prepare_tokenizer(tokenizer)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    envs = [DentalToolEnv() for _ in rows]
    tools = [getattr(envs[0], name) for name in TOOL_NAMES]
    episodes = []
    for env, row in zip(envs, rows):
        env.reset(**row)
        messages = full_prompt(row)
        episodes.append({"messages": messages, "turns": 0, "first_call": False, "calls": 0, "done": False})
    device = next(model.parameters()).device
    for turn in range(max_turns):
        active = [i for i, e in enumerate(episodes) if not e["done"]]
        for start in range(0, len(active), batch_size):
            chunk = active[start : start + batch_size]
            texts = [
                tokenizer.apply_chat_template(
                    episodes[i]["messages"], tools=tools, add_generation_prompt=True, tokenize=False
                )
                for i in chunk
            ]
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            with torch.no_grad():
                out = model.generate(
                    **batch,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                )
            new = out[:, batch["input_ids"].shape[1] :]
            for i, ids in zip(chunk, new):
                text = tokenizer.decode(ids, skip_special_tokens=True)
                ep, env = episodes[i], envs[i]
                ep["turns"] += 1
                call = parse_tool_call(text)
                if turn == 0:
                    ep["first_call"] = call is not None
                if call is None:
                    ep["messages"].append({"role": "assistant", "content": text})
                    ep["done"] = True
                    continue
                name, arguments = call
                ep["calls"] += 1
                result = getattr(env, name)(**arguments)
                ep["messages"] += [
                    tool_call_message(name, arguments),
                    {"role": "tool", "name": name, "content": result},
                ]
                ep["done"] = env.finished
    return [
        {
            "turns": e["turns"],
            "first_call": e["first_call"],
            "calls": e["calls"],
            "invalid": env.metrics.invalid,
            "finished": env.finished,
            "reward": env.reward,
            "messages": e["messages"],
        }
        for e, env in zip(episodes, envs)
    ]


def tool_gate_metrics(
    model,
    tokenizer,
    rows: Sequence[dict],
    max_turns: int = 4,
    max_new_tokens: int = 512,
    batch_size: int = 16,
) -> tuple[dict, list[dict]]:
    """The tool-use gate's metrics (module docstring) over greedy agentic episodes of ``rows``
    (``seed``, ``task_id``, ``force_decay``), and three sample episodes. :func:`orthojob.stages.gate.gate_report`
    checks them against the stage's thresholds and writes the report."""
    rows = [{"prompt": agentic_messages(), **r} for r in rows]
    t_gen = time.perf_counter()
    episodes = agentic_rollouts(model, tokenizer, rows, max_turns, max_new_tokens, batch_size)
    n = len(episodes)
    calls = sum(e["calls"] for e in episodes)
    metrics = {
        "tool_call_rate": sum(e["first_call"] for e in episodes) / n,
        "finished_rate": sum(e["finished"] for e in episodes) / n,
        "valid_call_rate": (calls - sum(e["invalid"] for e in episodes)) / calls if calls else 0.0,
        "reward_mean": float(np.mean([e["reward"] for e in episodes])),
        "turns_mean": float(np.mean([e["turns"] for e in episodes])),
        "calls_mean": calls / n,
        "generate_seconds": time.perf_counter() - t_gen,
    }
    samples = [
        {"task_id": r["task_id"], "seed": r["seed"], "completion": json.dumps(e["messages"][2:])[:2000]}
        for r, e in zip(rows[:3], episodes[:3])
    ]
    return metrics, samples


__all__ = ["TOOL_CALL", "agentic_rollouts", "parse_tool_call", "tool_call_message", "tool_gate_metrics"]
