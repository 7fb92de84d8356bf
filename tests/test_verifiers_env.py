"""The verifiers face (:mod:`orthorl_aligner`, verifiers 0.4): ``load_environment(**kwargs)`` gives
a verifiers environment whose task rewards are the TRL reward functions' numbers, weighted as
GRPO weights them; verifiers' own ``vf-eval`` runs it offline against a scripted
OpenAI-compatible model on loopback (the model answers the oracle's plan for the case it is
shown, or prose for one case), one-shot and multi-turn with the agentic tools (an MCP server
verifiers launches per rollout; the reward is the tools' episode reward)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import verifiers.v1 as vf
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from verifiers.v1.graph import MessageNode
from verifiers.v1.state import state_cls
from verifiers.v1.trace import TraceTask

import orthorl_aligner
from orthojob.core.prompts import build_messages, plan_to_completion, reset_observation
from orthojob.rewards.reward_functions import REWARD_FUNCS, reward_weights
from server.dental_constants import TOOTH_IDS
from server.oracle import oracle_plan
from tests.services import running_uvicorn

REPO = Path(__file__).resolve().parents[1]
NOT_A_PLAN = "I would need an X-ray before planning this case."


def completions(task: orthorl_aligner.AlignerTask) -> list[str]:
    """The oracle's plan, uniform staging, a harmful plan (every tooth at once), a plan inside
    prose and a code fence, and prose."""
    obs = reset_observation(task.data.seed, task.data.task_id, task.data.force_decay)
    oracle = plan_to_completion(oracle_plan(obs))
    uniform = {"strategy": "anterior_first", "tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 1 / 24}]}
    harmful = {"strategy": "distal_first", "tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 1.0}]}
    fenced = f"Here is the plan:\n```json\n{json.dumps(uniform)}\n```\nGood luck."
    return [oracle, json.dumps(uniform), json.dumps(harmful), fenced, NOT_A_PLAN]


def scored(task: orthorl_aligner.AlignerTask, reply: str) -> vf.Trace:
    """A trace whose one sampled reply is ``reply``, scored by the task (verifiers' Task.score)."""
    trace = vf.Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        state=state_cls(type(task))(),
        agent=vf.AgentInfo(config=vf.AgentConfig(), name="offline", trainable=False),
    )
    trace.nodes.append(MessageNode(message=vf.AssistantMessage(content=reply), sampled=True))
    asyncio.run(task.score(trace))
    return trace


def trl_values(task: orthorl_aligner.AlignerTask, reply: str) -> dict[str, float]:
    columns = {
        "seed": [task.data.seed],
        "task_id": [task.data.task_id],
        "force_decay": [task.data.force_decay],
    }
    return {name: func([reply], **columns)[0] for name, func in REWARD_FUNCS.items()}


@pytest.mark.parametrize(("task_id", "force_decay"), [("task_easy", False), ("task_hard", True)])
def test_the_rewards_are_the_trl_reward_functions(task_id, force_decay):
    overrides = {"terminal": 2.0, "format": 0.5}
    env = orthorl_aligner.load_environment(
        task_id=task_id, force_decay=force_decay, num_tasks=2, reward_weights=overrides
    )
    assert isinstance(env, vf.Env)
    weights = dict(zip(REWARD_FUNCS, reward_weights(list(REWARD_FUNCS.values()), overrides)))
    tasks = list(env.taskset)
    assert [(t.data.task_id, t.data.seed, t.data.force_decay) for t in tasks] == [
        (task_id, 0, force_decay),
        (task_id, 1, force_decay),
    ]
    seen = set()
    for task in tasks:
        obs = reset_observation(task.data.seed, task_id, force_decay)
        assert [task.data.system_prompt, task.data.prompt] == [m["content"] for m in build_messages(obs)]
        for reply in completions(task):
            trace = scored(task, reply)
            expected = trl_values(task, reply)
            agentic = trace.rewards.pop("reward_agentic")  # the tools' reward: no tools here, weight 0
            assert agentic.weight == 0 and agentic.score == -2.0
            assert {k: r.score for k, r in trace.rewards.items()} == expected
            assert {k: r.weight for k, r in trace.rewards.items()} == weights
            assert trace.reward == pytest.approx(sum(weights[k] * v for k, v in expected.items()), abs=1e-12)
            seen.add(round(expected["reward_terminal"], 6))
    assert len(seen) >= 6  # the completions really differ in reward


def test_bad_taskset_arguments_are_refused():
    with pytest.raises(ValueError, match="task_id must be one of"):
        list(orthorl_aligner.load_environment(task_id="task_impossible").taskset)
    with pytest.raises(ValueError, match="unknown reward"):
        orthorl_aligner.load_environment(reward_weights={"speed": 1.0})
    with pytest.raises(ValueError, match="mode must be"):
        orthorl_aligner.load_environment(mode="chat")
    with pytest.raises(ValueError, match="reward_agentic alone"):
        orthorl_aligner.load_environment(mode="tools", reward_weights={"terminal": 2.0})


def task_config(task: dict, **taskset) -> vf.EnvConfig:
    """The env config verifiers resolves from a config file or ``--env.taskset.task.*`` flags: the
    task's fields given directly, not through :func:`orthorl_aligner.env_config`'s weights."""
    return vf.resolve_env_config({"taskset": {"id": orthorl_aligner.TASKSET_ID, **taskset, "task": task}})


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ({"rewards": {"reward_terminal": {"weight": -1.0}}}, "is negative"),
        ({"rewards": {"reward_terminal": {"weight": 0.0}}}, "weigh without reward_terminal"),
        ({"rewards": {"reward_format": {"weight": -0.5}}}, "is negative"),
        ({"rewards": {n: {"weight": 0.0} for n in REWARD_FUNCS}}, "every reward weight is 0"),
        ({"rewards": {"reward_agentic": {"weight": 1.0}}}, "reward_agentic weighs 1.0 without the tools"),
        ({"rewards": {"speed": {"weight": 1.0}}}, "are not this task's"),
        (
            {"rewards": {"reward_terminal": {"fn": "tests.test_verifiers_env:NOT_A_PLAN"}}},
            "set a weight only",
        ),
        ({"judges": [{"id": "decision", "name": "style"}]}, "judges style would add to the reward"),
        ({"tools": True, "rewards": {"reward_agentic": {"weight": -1.0}}}, "give it a weight > 0"),
        ({"tools": True, "rewards": {"reward_terminal": {"weight": 1.0}}}, "reward_terminal=1.0"),
    ],
)
def test_weights_set_in_the_task_config_go_through_the_ordering_check(task, message):
    """Per-reward weights given in the task config (``rewards.<name>.weight``), plugged reward
    functions and weighted judges: each refused with a clear error, where they once bypassed the check
    that ``reward_weights`` overrides go through; ``load_environment(task=...)`` reads the same."""
    with pytest.raises(ValueError, match=message):
        task_config(task, num_tasks=1)
    mode = "tools" if task.get("tools") else "oneshot"
    with pytest.raises(ValueError, match=message):
        orthorl_aligner.load_environment(mode=mode, num_tasks=1, task=task)


def test_weights_in_the_task_config_that_keep_the_ordering_are_used():
    """Positive weights with the terminal weighing, a weight left unset (the default kept), and the
    tools' reward alone with tools: accepted, and the tasks carry exactly those weights."""
    config = task_config(
        {"rewards": {"reward_terminal": {"weight": 3.0}, "reward_strategy": {"weight": 0.0},
                     "reward_format": {"priority": 2}}},
        num_tasks=1,
    )  # fmt: skip
    (task,) = vf.load_environment(config).taskset
    weights = {name: r.weight for name, r in task.config.rewards.items()}
    assert weights == {**dict.fromkeys(REWARD_FUNCS, 1.0), "reward_terminal": 3.0, "reward_strategy": 0.0,
                       "reward_agentic": 0.0}  # fmt: skip
    (tools,) = vf.load_environment(task_config({"tools": True}, num_tasks=1)).taskset
    assert {n: r.weight for n, r in tools.config.rewards.items()} == {
        **dict.fromkeys(REWARD_FUNCS, 0.0),
        "reward_agentic": 1.0,
    }
    with pytest.raises(ValueError, match="not both"):
        orthorl_aligner.load_environment(reward_weights={"terminal": 2.0}, task={"rewards": {"format": {}}})
    with pytest.raises(ValueError, match="contradicts mode"):
        orthorl_aligner.load_environment(task={"tools": True})


def scripted_model(answers: dict[str, str], seen: list[dict], tool: str | None = None) -> FastAPI:
    """An OpenAI-compatible chat-completions endpoint answering ``answers[user prompt]``; with
    ``tool``, its first turn calls that tool with ``{"plan": answer}`` and its second (after the
    tool's result) says it is done."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append(body)
        user = next(m["content"] for m in body["messages"] if m["role"] == "user")
        if isinstance(user, list):
            user = "".join(part.get("text", "") for part in user)
        text = answers.get(user, NOT_A_PLAN)
        message, finish = {"role": "assistant", "content": text}, "stop"
        if tool is not None and body["messages"][-1]["role"] != "tool":
            call = {
                "id": "call-1",
                "type": "function",
                "function": {"name": tool, "arguments": json.dumps({"plan": text})},
            }
            message, finish = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
        elif tool is not None:
            message = {"role": "assistant", "content": "Submitted."}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        head = {"id": "scripted", "created": int(time.time()), "model": body["model"]}
        if not body.get("stream"):
            return JSONResponse(
                {**head, "object": "chat.completion", "usage": usage,
                 "choices": [{"index": 0, "message": message, "finish_reason": finish}]}
            )  # fmt: skip

        def chunks():
            delta = dict(message)
            if "tool_calls" in delta:
                delta["tool_calls"] = [{"index": 0, **c} for c in delta["tool_calls"]]
            chunk = {**head, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
            yield f"data: {json.dumps(chunk)}\n\n"
            chunk["choices"], chunk["usage"] = [{"index": 0, "delta": {}, "finish_reason": finish}], usage
            yield f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


def vf_eval(tmp_path: Path, model_url: str, *flags: str) -> list[dict]:
    """``vf-eval orthorl-aligner FLAGS`` (verifiers' own eval) against ``model_url``; its episodes."""
    bin_dir = str(Path(sys.executable).parent)
    out = subprocess.run(
        [sys.executable, "-c", "from verifiers.v1.cli.eval.main import main; main()", "orthorl-aligner", *flags,
         "--env.agent.harness.id", "null", "--env.agent.runtime.type", "subprocess", "-m", "scripted",
         "--client.base_url", model_url + "/v1", "--client.api_key_var", "SCRIPTED_MODEL_KEY",
         "--no-push", "--no-rich", "--output-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
             "PYTHONPATH": str(REPO), "SCRIPTED_MODEL_KEY": "none"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (traces_file,) = tmp_path.glob("*/traces.jsonl")
    return [json.loads(line) for line in traces_file.read_text().splitlines()]


def test_vf_eval_runs_offline_against_a_scripted_model(tmp_path):
    """``vf-eval orthorl-aligner`` (verifiers' own eval: its null harness's chat program, its
    interception server, its scoring) against the scripted model: every rollout completes and
    its rewards are the TRL functions' on the reply the model gave."""
    env = orthorl_aligner.load_environment(task_id="task_medium", force_decay=True, num_tasks=3)
    tasks = list(env.taskset)
    answers = {
        t.data.prompt: plan_to_completion(oracle_plan(reset_observation(t.data.seed, "task_medium", True)))
        for t in tasks[:2]
    }  # the third case gets prose
    seen: list[dict] = []
    with running_uvicorn(scripted_model(answers, seen)) as model_url:
        flags = ("--env.taskset.task_id", "task_medium", "--env.taskset.force_decay", "true")
        episodes = vf_eval(tmp_path, model_url, *flags, "--env.taskset.num_tasks", "3")
    assert len(episodes) == 3 and all(e["ok"] for e in episodes)
    assert len(seen) == 3 and {
        m["content"] for body in seen for m in body["messages"] if m["role"] == "user"
    } == {t.data.prompt for t in tasks}
    by_seed = {t.data.seed: t for t in tasks}
    terminal = {}
    for episode in episodes:
        (trace,) = episode["traces"]
        task = by_seed[trace["task"]["data"]["seed"]]
        reply = next(
            n["message"]["content"] for n in reversed(trace["nodes"]) if n["message"]["role"] == "assistant"
        )
        assert reply == answers.get(task.data.prompt, NOT_A_PLAN)
        rewards = {k: r["score"] for k, r in trace["rewards"].items() if k != "reward_agentic"}
        assert rewards == trl_values(task, reply) and trace["rewards"]["reward_agentic"]["weight"] == 0
        terminal[task.data.seed] = trace["rewards"]["reward_terminal"]["score"]
    assert terminal[2] == -2.0 and min(terminal[0], terminal[1]) > 4  # prose: the minimum; the oracle: high


def test_vf_eval_with_the_tools_scores_the_episode_the_tools_played(tmp_path):
    """``mode="tools"``: the agentic prompt, the six tools as an MCP server verifiers launches per
    rollout, and ``reward_agentic`` the episode's reward. The scripted model calls submit_plan
    with the oracle's plan (one case) or prose (the other): the rewards are what DentalToolEnv
    gives the same calls in process."""
    from orthojob.agentic.tools import DentalToolEnv

    env = orthorl_aligner.load_environment(mode="tools", task_id="task_easy", num_tasks=2)
    tasks = list(env.taskset)
    assert tasks[0].toolsets(tasks[0].config)[0].__class__.__name__ == "StagingToolset"
    answers = {
        tasks[0].data.prompt: plan_to_completion(oracle_plan(reset_observation(0, "task_easy", False)))
    }
    seen: list[dict] = []
    with running_uvicorn(scripted_model(answers, seen, tool="submit_plan")) as model_url:
        episodes = vf_eval(tmp_path, model_url, "--env.taskset.task_id", "task_easy", "--env.taskset.num_tasks", "2",
                           "--env.taskset.task.tools", "true")  # fmt: skip
    tools_offered = {t["function"]["name"] for t in seen[0]["tools"]}
    assert tools_offered == {
        "inspect_tooth",
        "simulate_stage",
        "check_collisions",
        "commit_stage",
        "rollback_stage",
        "submit_plan",
    }
    assert len(episodes) == 2 and all(e["ok"] for e in episodes)
    rewards = {}
    for episode in episodes:
        (trace,) = episode["traces"]
        seed = trace["task"]["data"]["seed"]
        local = DentalToolEnv()
        local.reset(seed=seed, task_id="task_easy", force_decay=False)
        result = local.submit_plan(answers.get(tasks[seed].data.prompt, NOT_A_PLAN))
        (tool_message,) = [n["message"] for n in trace["nodes"] if n["message"]["role"] == "tool"]
        assert result in json.dumps(tool_message["content"]) or tool_message["content"] == result
        assert trace["rewards"]["reward_agentic"] == {"score": local.reward, "weight": 1.0}
        assert all(r["weight"] == 0 for k, r in trace["rewards"].items() if k != "reward_agentic")
        rewards[seed] = local.reward
    assert rewards[1] == -2.0 and rewards[0] > 4  # prose (seed 1): refused, unfinished; the oracle: high
