"""Agentic GRPO: the stepwise environment as TRL tools (:mod:`orthojob.agentic.tools`).

(a) a 2-step tiny-model GRPO run driven by TRL's GRPOTrainer with ``environment_factory`` (the first
turns scripted, so that tools are called and a plan submitted; later turns generated), its tool
metrics in the MLflow run; (b) the tool schemas TRL derives from the methods; (c) bad tool arguments
give a clear error and leave the episode intact; (d) the oracle's plan submitted through the tools
scores exactly what the one-shot reward gives it.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
from transformers.utils import get_json_schema

from orthojob.agentic.prompts import agentic_rows, full_prompt
from orthojob.agentic.reward import reward_agentic
from orthojob.agentic.tools import DentalToolEnv, plan_stages
from orthojob.core.prompts import TRAIN_SEED_START, plan_to_completion, reset_observation
from orthojob.ops.run_identity import config_digest
from orthojob.rewards.reward_functions import reward_terminal
from orthojob.rewards.rollouts import DEFAULT_CACHE
from orthojob.stages.grpo_config import ConfigError, GRPOJobConfig
from server.agent_tools import TOOL_NAMES
from server.cases import TASK_IDS
from server.dental_constants import N_STAGES, N_TEETH, TOOTH_IDS
from server.dental_environment import MAX_ROLLBACKS
from server.oracle import oracle_plan
from server.reward_scaler import REWARD_MIN

CASE = {"seed": TRAIN_SEED_START, "task_id": "task_easy", "force_decay": False}
STAGE = [{"teeth": [11, 21], "fraction": 0.04}]


@pytest.fixture
def env() -> DentalToolEnv:
    e = DentalToolEnv()
    e.reset(prompt=[{"role": "user", "content": "x"}], **CASE)  # TRL passes the whole row
    return e


# --- (b) the schemas TRL derives ----------------------------------------------------------------


def test_tool_schemas_match_the_documented_arguments(env):
    import inspect

    from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: F401  (the version whose contract this is)

    # what TRL exposes: every public function of the class but reset/get_reward
    public = [n for n, _ in inspect.getmembers(DentalToolEnv, inspect.isfunction) if not n.startswith("_")]
    assert sorted(set(public) - {"reset"}) == sorted(TOOL_NAMES) and "get_reward" not in public
    expected = {
        "inspect_tooth": ({"tooth_id": "integer"}, ["tooth_id"]),
        "simulate_stage": ({"groups": "array", "strategy": "string"}, ["groups"]),
        "check_collisions": ({"groups": "array"}, []),
        "commit_stage": ({"groups": "array", "strategy": "string"}, ["groups"]),
        "rollback_stage": ({}, []),
        "submit_plan": ({"plan": "string"}, ["plan"]),
    }
    for name in TOOL_NAMES:
        method = getattr(env, name)
        schema = get_json_schema(method)["function"]
        params = schema["parameters"]
        types, required = expected[name]
        assert schema["name"] == name and schema["description"]
        assert {k: v["type"] for k, v in params["properties"].items()} == types, name
        assert sorted(params.get("required", [])) == sorted(required), name
        assert list(inspect.signature(method).parameters) == list(types), name  # the wrapper keeps it
        for arg in params["properties"].values():
            assert len(arg["description"]) > 10, (name, arg)
        assert schema["return"]["description"], name
    groups = get_json_schema(env.simulate_stage)["function"]["parameters"]["properties"]["groups"]
    assert groups["items"] == {"type": "object"} and '"fraction"' in groups["description"]
    returns = get_json_schema(env.inspect_tooth)["function"]["return"]["description"]
    assert "(mm)" in returns and "(degrees)" in returns  # units documented


def test_the_tiny_tokenizer_renders_and_parses_tool_calls(tiny_agentic_model):
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema, parse_response, supports_tool_calling

    from orthojob.agentic.chat_template import prepare_tokenizer

    tok = AutoTokenizer.from_pretrained(tiny_agentic_model)
    assert not supports_tool_calling(tok)  # its own ChatML has no tools
    tok = add_response_schema(prepare_tokenizer(tok))
    assert supports_tool_calling(tok)
    env = DentalToolEnv()
    tools = [getattr(env, n) for n in TOOL_NAMES]
    row = agentic_rows(1, TRAIN_SEED_START, "task_easy", False)[0]
    text = tok.apply_chat_template(full_prompt(row), tools=tools, add_generation_prompt=True, tokenize=False)
    assert all(f'"name": "{n}"' in text for n in TOOL_NAMES) and "Case summary" in text
    call = '<tool_call>\n{"name": "inspect_tooth", "arguments": {"tooth_id": 11}}\n</tool_call><|im_end|>'
    prefix = tok(text, add_special_tokens=False)["input_ids"]
    parsed = parse_response(tok, tok(call, add_special_tokens=False)["input_ids"], prefix=prefix, tools=tools)
    assert parsed["tool_calls"][0]["function"] == {"name": "inspect_tooth", "arguments": {"tooth_id": 11}}


# --- (c) bad arguments ---------------------------------------------------------------------------


def test_bad_tool_arguments_return_errors_and_keep_the_episode(env):
    env.commit_stage(STAGE)
    before = json.loads(env.inspect_tooth(11))
    bad = [
        env.inspect_tooth(99),  # unknown tooth
        env.inspect_tooth(True),
        env.inspect_tooth("11"),
        env.simulate_stage([{"teeth": [11], "fraction": math.nan}]),  # NaN
        env.simulate_stage([{"teeth": [11], "fraction": math.inf}]),
        env.commit_stage([{"teeth": [11], "fraction": 1.5}]),
        env.commit_stage([{"teeth": [18], "fraction": 0.1}]),  # unknown tooth
        env.commit_stage([[0.0] * 7] * 28),  # wrong shape: poses instead of groups
        env.commit_stage({"teeth": [11], "fraction": 0.1}),  # an object, not a list
        env.commit_stage([{"teeth": [11, 11], "fraction": 0.1}]),  # a tooth twice
        env.commit_stage([{"teeth": [11], "fraction": 0.1, "priority": "high"}]),  # unknown key
        env.commit_stage(STAGE, strategy="fastest_first"),
        env.check_collisions([{"teeth": [], "fraction": 0.1}]),
        env.simulate_stage(groups=STAGE, poses=[]),  # an argument the tool does not have
        env.submit_plan("I would move the incisors first"),  # not a plan
        env.submit_plan(["not", "text"]),
    ]
    for message in bad:
        assert message.startswith("error: ") and len(message) > 20, message
    assert "99" in bad[0] and "nan" in bad[3] and "group 0" in bad[6] and "already" in bad[9]
    assert json.loads(env.inspect_tooth(11)) == before  # nothing changed
    assert env.metrics.invalid == len(bad) and env.metrics.stages_committed == 1 and not env.finished

    # rollbacks: two allowed, a third refused; the episode goes on
    env.commit_stage(STAGE)
    assert json.loads(env.rollback_stage()) == {"current_stage": 1, "rollbacks_left": 1}
    assert json.loads(env.rollback_stage()) == {"current_stage": 0, "rollbacks_left": 0}
    env.commit_stage(STAGE)
    third = env.rollback_stage()
    assert third.startswith("error: ") and f"({MAX_ROLLBACKS} per episode)" in third
    assert env.metrics.rollbacks == MAX_ROLLBACKS and env.metrics.stages_committed == 1
    assert json.loads(env.simulate_stage(STAGE))["stage"] == 2  # still usable
    assert env.reward == REWARD_MIN  # unfinished
    # after the end every call is an error, and nothing changes
    env.submit_plan(plan_to_completion(oracle_plan(reset_observation(**_obs_args()))))
    reward = env.reward
    late = env.commit_stage(STAGE)
    assert late.startswith("error: the episode is finished") and env.reward == reward
    assert env.metrics.calls["commit_stage"] == 11 and env.metrics.calls["submit_plan"] == 3


def _obs_args() -> dict:
    return {"seed": CASE["seed"], "task_id": CASE["task_id"], "force_decay": CASE["force_decay"]}


# --- (d) the oracle through the tools ---------------------------------------------------------------


@pytest.mark.parametrize("task_id, force_decay", [("task_easy", False), ("task_hard", True)])
def test_the_oracle_submitted_through_the_tools_scores_as_the_one_shot_reward(task_id, force_decay):
    seed = TRAIN_SEED_START + 3
    text = plan_to_completion(oracle_plan(reset_observation(seed, task_id, force_decay)))
    env = DentalToolEnv()
    env.reset(seed=seed, task_id=task_id, force_decay=force_decay)
    json.loads(env.inspect_tooth(13))
    json.loads(env.simulate_stage([{"teeth": [13, 23], "fraction": 0.05}]))
    report = json.loads(env.submit_plan(text))
    DEFAULT_CACHE.clear()  # score afresh, one plan per batch, as submit_plan does
    (expected,) = reward_terminal([text], seed=[seed], task_id=[task_id], force_decay=[force_decay])
    assert env.reward == expected and report["finished"] and env.finished
    assert report["scaled_reward"] == pytest.approx(expected, abs=1e-4)
    assert env.result["finished_by"] == "submit_plan" and expected > 0
    values = reward_agentic([[{"role": "assistant", "content": ""}]], environments=[env])
    assert values == [expected]


@pytest.mark.parametrize("store", ["sqlite", "server"])
def test_sampled_episodes_are_mlflow_traces_with_a_span_per_tool_call(tmp_path, monkeypatch, store):
    """Within an active run, the sampled episodes (here 2 of a batch of 3) become MLflow traces when
    the reward is read: a root span ``episode`` with the case and the reward, one span per tool call
    with its arguments, result and duration; outside a run nothing is recorded. In a SQLite store and
    read back from a real ``mlflow server``."""
    from tests.services import mlflow_server

    if store == "sqlite":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
        _check_sampled_traces(monkeypatch)
        return
    with mlflow_server(tmp_path / "server", str(tmp_path / "artifacts")) as service:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", service.uri)
        _check_sampled_traces(monkeypatch)


def _check_sampled_traces(monkeypatch) -> None:
    import mlflow

    from orthojob.agentic.traces import TRACE_EPISODES_ENV, TRACE_REWARD_TAG, flush_traces
    from orthojob.ops import tracking

    monkeypatch.setenv(TRACE_EPISODES_ENV, "2")
    flush_traces([])  # a fresh budget (an earlier test's episodes may have claimed some)
    outside = DentalToolEnv()
    outside.reset(**CASE)
    assert outside._trace_calls is None  # no run: the hot path records nothing
    seed = TRAIN_SEED_START + 3
    text = plan_to_completion(oracle_plan(reset_observation(seed, "task_easy", False)))
    with tracking.stage_run("grpo", experiment="traces") as run:
        envs = [DentalToolEnv() for _ in range(3)]
        for e in envs:
            e.reset(seed=seed, task_id="task_easy", force_decay=False)
            e.inspect_tooth(tooth_id=13)
            e.simulate_stage(groups=STAGE)
        envs[0].submit_plan(plan=text)
        assert envs[2]._trace_calls is None  # beyond the budget: not recorded
        rewards = reward_agentic([[{"role": "assistant", "content": ""}]] * 3, environments=envs)
    mlflow.flush_trace_async_logging()
    traces = mlflow.search_traces(
        locations=[run.info.experiment_id], run_id=run.info.run_id, return_type="list"
    )
    assert len(traces) == 2
    by_reward = {float(t.info.tags[TRACE_REWARD_TAG]): t for t in traces}
    assert sorted(by_reward) == pytest.approx(sorted(rewards[:2]), abs=1e-5)
    submitted = by_reward[max(by_reward)]
    root = next(sp for sp in submitted.data.spans if sp.parent_id is None)
    assert root.name == "episode" and root.inputs == {
        "task_id": "task_easy",
        "seed": seed,
        "force_decay": False,
    }
    assert (
        root.attributes["reward"] == pytest.approx(rewards[0])
        and root.outputs["finished_by"] == "submit_plan"
    )
    tools = sorted((sp for sp in submitted.data.spans if sp.parent_id), key=lambda sp: sp.start_time_ns)
    assert [sp.name for sp in tools] == ["inspect_tooth", "simulate_stage", "submit_plan"]

    def result(span) -> dict:  # the tool's JSON text (MLflow reads a JSON output back as its value)
        return span.outputs if isinstance(span.outputs, dict) else json.loads(span.outputs)

    assert tools[0].inputs == {"tooth_id": 13} and result(tools[0])["tooth_id"] == 13
    assert tools[1].inputs == {"groups": STAGE} and tools[2].inputs == {"plan": text}
    assert result(tools[2])["finished"] is True
    assert all(0 < sp.end_time_ns - sp.start_time_ns < 10e9 for sp in tools)  # each call's duration
    unfinished = by_reward[min(by_reward)]
    assert min(by_reward) == REWARD_MIN and len(unfinished.data.spans) == 3  # root + 2 tool calls


def test_committing_24_stages_finishes_with_the_stepwise_score():
    env = DentalToolEnv()
    env.reset(**CASE)
    uniform = [
        {"teeth": [t for q in (10, 20, 30, 40) for t in range(q + 1, q + 8)], "fraction": 1 / N_STAGES}
    ]
    for stage in range(1, N_STAGES):
        assert json.loads(env.commit_stage(uniform))["stages_remaining"] == N_STAGES - stage
    last = json.loads(env.commit_stage(uniform, strategy="anterior_first"))
    assert last["score"]["finished"] and env.result["finished_by"] == "commit_stage"
    # the same staging written as a plan, scored one-shot: the same score up to rounding
    plan = {"strategy": "anterior_first", "tooth_groups": uniform}
    (one_shot,) = reward_terminal([json.dumps(plan)], **{k: [v] for k, v in CASE.items()})
    assert env.reward == pytest.approx(one_shot, abs=1e-6) and env.reward > 0


# --- tool results are unchanged by speed work -------------------------------------------------------

TOOLS_DIGEST = ("008fd2c0237972b5debc73a29fdcf318347b5725addcca03ef712b2ed2f2e463",)
"""sha256 of :func:`tool_transcript`'s results for 4 seeds x 3 tasks x force decay on and off: the
same on both machine kinds of tests/test_behaviour_digest.py's EXPECTED (the tool results are rounded
text). Re-recorded on both when the arch widths moved to their landmarks and the oracle's force-decay
compensation changed (CHANGELOG.md)."""
ALTERNATE = [{"teeth": list(TOOTH_IDS[::2]), "fraction": 1.0}]  # every other tooth at once: collides
HALF = [{"teeth": list(TOOTH_IDS[1::2]), "fraction": 0.5}]


def tool_transcript(task_id: str, seed: int, force_decay: bool, submit: bool, env=None) -> list[str]:
    """Every tool's text on one episode: inspections, collision checks, stages that collide and
    break the limits (committed, then rolled back), the oracle's plan stage by stage (simulated,
    then committed), finished by the 24th commit or by submitting the plan at stage 10. ``env``:
    another face of the same tools (default a :class:`DentalToolEnv`)."""
    plan = oracle_plan(reset_observation(seed, task_id, force_decay))
    env = DentalToolEnv() if env is None else env
    out = [env.reset(seed=seed, task_id=task_id, force_decay=force_decay)]
    out += [
        env.inspect_tooth(13),
        env.inspect_tooth(36),
        env.check_collisions(),
        env.check_collisions(ALTERNATE),
        env.simulate_stage(ALTERNATE, strategy=plan["strategy"]),
        env.simulate_stage(HALF),
    ]
    for s, groups in enumerate(plan_stages(plan), start=1):
        if submit and s == 10:
            out.append(env.submit_plan(plan_to_completion(plan)))
            break
        if s in (5, 12):
            out.append(env.simulate_stage(HALF))
            out += [env.commit_stage(ALTERNATE), env.check_collisions(), env.rollback_stage()]
        out.append(env.simulate_stage(groups))
        out.append(env.commit_stage(groups, strategy=plan["strategy"] if s == 1 else None))
        if s % 6 == 0:
            out.append(env.inspect_tooth(TOOTH_IDS[s]))
    assert env.finished
    return out


def test_tool_results_digest_unchanged():
    import hashlib

    h = hashlib.sha256()
    texts = [
        text
        for task_id in TASK_IDS
        for decay in (False, True)
        for k in range(4)
        for text in tool_transcript(task_id, TRAIN_SEED_START + k, decay, submit=k % 2 == 1)
    ]
    for text in texts:
        h.update(text.encode())
        h.update(b"\0")
    errors = [t for t in texts if t.startswith("error: ")]
    assert len(texts) == 1176 and len(errors) == 12  # the inspection after each 24th commit
    assert all(t.startswith("error: the episode is finished") for t in errors)
    # the digest covers stage reports with colliding pairs, not only collision-free ones
    assert sum('"committed":' in t and '"colliding_pairs":[{' in t for t in texts) >= 20
    assert h.hexdigest() in TOOLS_DIGEST


def test_stage_poses_are_interpolate_poses_bit_for_bit():
    from server.cases import generate_case
    from server.plans import StagePoses, interpolate_poses

    rng = np.random.default_rng(15)
    for task_id in TASK_IDS:
        for seed in range(4):
            case = generate_case(task_id, seed, seed % 2 == 1)
            target = case.target.copy()
            if seed == 3:  # teeth without rotation (SLERP's small-angle branch), one sign-flipped
                target[:3, :4] = case.initial[:3, :4]
                target[3, :4] = -case.initial[3, :4]
            stage_poses = StagePoses(case.initial, target)
            for progress in (
                np.zeros(N_TEETH),
                np.ones(N_TEETH),
                rng.uniform(0.0, 1.0, N_TEETH),
                np.where(rng.uniform(size=N_TEETH) < 0.5, 0.0, rng.uniform(0.0, 1.6, N_TEETH)),
            ):
                expected = interpolate_poses(case.initial, target, progress[None])[0]
                assert stage_poses(progress).tobytes() == expected.tobytes(), (task_id, seed)


# --- config ----------------------------------------------------------------------------------------


def test_mode_flag_and_one_shot_identity_unchanged():
    import argparse

    from orthojob.stages.grpo import add_train_arguments, config_from_args

    parse = add_train_arguments(argparse.ArgumentParser()).parse_args
    config = config_from_args(parse(["--mode", "agentic", "--max-tool-turns", "3"]))
    assert (config.mode, config.max_tool_turns) == ("agentic", 3)
    assert [f.__name__ for f in config.reward_funcs] == ["reward_agentic"] and config.weights == [1.0]
    assert config_from_args(parse([])).mode == "oneshot"
    with pytest.raises(ConfigError, match="--mode agentic"):
        GRPOJobConfig(mode="agentic", rewards=["format"])
    with pytest.raises(SystemExit):
        parse(["--mode", "chatty"])
    # a one-shot config's run identity is what it was before the two fields existed
    old = {k: v for k, v in GRPOJobConfig().to_dict().items() if k not in ("mode", "max_tool_turns")}
    assert config_digest(GRPOJobConfig().to_dict()) == config_digest(old)
    assert config_digest(config.to_dict()) != config_digest(old)


# --- (a) TRL drives the tools ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_agentic_model(tmp_path_factory) -> Path:
    """The tiny Qwen2 model, its tokenizer also trained on agentic prompts (shorter prompts)."""
    from orthojob.agentic.chat_template import prepare_tokenizer
    from orthojob.modeling.tiny_model import build_tiny_model, train_tokenizer

    rows = agentic_rows(2, TRAIN_SEED_START, "task_easy", False)
    env = DentalToolEnv()
    tools = [getattr(env, n) for n in TOOL_NAMES]
    tok = prepare_tokenizer(train_tokenizer(["x y"]))
    corpus = [tok.apply_chat_template(full_prompt(r), tools=tools, tokenize=False) for r in rows]
    path = tmp_path_factory.mktemp("tiny-agentic") / "tiny"
    return build_tiny_model(path, vocab_size=1024, max_position_embeddings=8192, corpus=corpus)


def _scripted_turns(monkeypatch, tokenizer_path: Path, plan_text: str) -> dict:
    """Script the policy's first two turns (TRL still parses, calls the tools and trains on them):
    turn 1 inspects tooth 11 (even rollouts) or tooth 99 (odd: an invalid call); turn 2 submits
    ``plan_text`` (even rollouts) or is generated (odd); later turns are generated."""
    from transformers import AutoTokenizer

    from orthojob.stages.grpo_trainer import RecordingGRPOTrainer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def call(name: str, arguments: dict) -> list[int]:
        body = json.dumps({"name": name, "arguments": arguments})
        return tok(f"<tool_call>\n{body}\n</tool_call>", add_special_tokens=False)["input_ids"] + [eos]

    original = RecordingGRPOTrainer._generate_single_turn
    state = {"turn": 0, "batches": 0}

    def scripted(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if num_generations != 1:  # the batch's first turn (tool turns generate 1 per sample)
            state["turn"], state["batches"] = 1, state["batches"] + 1
            ids = [
                call("inspect_tooth", {"tooth_id": 11 if i % 2 == 0 else 99}) for i in range(len(prompt_ids))
            ]
            return ids, None
        state["turn"] += 1
        ids, logprobs = original(
            self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images
        )
        if state["turn"] == 2:
            ids = [call("submit_plan", {"plan": plan_text}) if i % 2 == 0 else x for i, x in enumerate(ids)]
        return ids, logprobs

    monkeypatch.setattr(RecordingGRPOTrainer, "_generate_single_turn", scripted)
    return state


def _server_status(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url + "/status", timeout=10) as response:
        return json.loads(response.read())


@pytest.mark.parametrize("over_server", [False, True], ids=["in_process", "env_url"])
def test_agentic_grpo_two_steps_through_trl(tiny_agentic_model, tmp_path, monkeypatch, over_server):
    """The 2-step run; with ``over_server``, ``--env-url`` to a real local server (uvicorn in a thread):
    reset and commits through OpenEnv's client, the other tools as WebSocket ``tool`` messages, and the
    sessions closed when training ends."""
    import contextlib

    with contextlib.ExitStack() as stack:
        url = None
        if over_server:
            from server.app import create_app
            from server.serving.settings import ServerSettings
            from tests.services import running_uvicorn

            settings = ServerSettings(max_sessions=8, ws_idle_timeout_s=300)
            url = stack.enter_context(running_uvicorn(create_app(settings)))
        result, config = _two_agentic_steps(tiny_agentic_model, tmp_path, monkeypatch, url)
        if over_server:
            # every rollout's environment held one WebSocket session; all closed by the run, none
            # left for the idle timeout, no episode left on the server
            environments = [e for pool in result.trainer._environment_pool.values() for e in pool]
            assert len(environments) == config.batch_size
            assert all(type(e._env).__name__ == "RemoteStepwise" for e in environments)
            deadline = time.monotonic() + 10  # the server handles the closes on its own thread
            status = _server_status(url)
            while status["websocket_sessions"]["live"] and time.monotonic() < deadline:
                time.sleep(0.05)
                status = _server_status(url)
            ws = status["websocket_sessions"]
            assert ws["live"] == 0 and ws["accepted"] == ws["closed"] == config.batch_size, ws
            assert ws["reaped_idle"] == 0 and ws["bad_messages"] == 0, ws
            assert status["episodes"]["live"] == 0, status


def _two_agentic_steps(tiny_agentic_model: Path, tmp_path: Path, monkeypatch, env_url: str | None):
    from mlflow.tracking import MlflowClient

    from orthojob.agentic.traces import flush_traces
    from orthojob.ops import tracking
    from orthojob.stages import grpo_trainer
    from orthojob.stages.grpo import config_from_args
    from orthojob.stages.grpo_config import validate

    flush_traces([])  # a fresh trace budget (an earlier test's episodes may have claimed some)
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    plan = {"strategy": "anterior_first", "tooth_groups": [{"teeth": [11, 21], "fraction": 0.1}]}
    plan_text = json.dumps(plan)
    state = _scripted_turns(monkeypatch, tiny_agentic_model, plan_text)
    values = {"preset": "tiny-cpu", "model": str(tiny_agentic_model), "steps": 2, "mode": "agentic",
              "max_tool_turns": 2, "num_generations": 2, "batch_size": 4, "max_prompt_length": 7000,
              "max_completion_length": 320, "max_seq_length": 7400, "out": str(tmp_path / "grpo"),
              "skip_sft_gate": True, "env_url": env_url}  # fmt: skip
    config = config_from_args(values)
    validate(config)
    with tracking.stage_run("grpo", experiment="agentic") as run:
        result = grpo_trainer.train(config)
    assert result.trainer.state.global_step == 2 and state["batches"] == 2

    rows = [r for r in result.trainer.state.log_history if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["agentic/calls/inspect_tooth"] == 1.0 and r["agentic/invalid_calls"] >= 0.5
        assert r["agentic/submitted_share"] == 0.5 and r["agentic/calls/submit_plan"] >= 0.5
        assert r["agentic/turns"] >= 2 and r["tools/call_frequency"] >= 1.5
        assert math.isfinite(r["rewards/reward_agentic/mean"]) and math.isfinite(r["loss"])
        assert "agentic/component/collision_free" in r
        # the environment's own time (reset + tools) is measured, and is a part of the step
        assert r["agentic/env_seconds"] > 0 and 0 < r["agentic/env_ms_per_call"] < 1000
        if "step_time" in r:
            assert r["agentic/env_seconds"] < r["step_time"]
            print(
                f"agentic step {r['step']}: environment {r['agentic/env_seconds']:.4f} s of {r['step_time']:.2f} s"
            )
    # the sampled episodes of each step are MLflow traces of the run: a span per tool call
    import mlflow

    from orthojob.agentic.traces import DEFAULT_TRACE_EPISODES, TRACE_REWARD_TAG

    mlflow.flush_trace_async_logging()
    traces = mlflow.search_traces(
        locations=[run.info.experiment_id], run_id=run.info.run_id, return_type="list"
    )
    assert len(traces) == 2 * DEFAULT_TRACE_EPISODES
    for trace in traces:
        root = next(sp for sp in trace.data.spans if sp.parent_id is None)
        assert root.name == "episode"
        assert float(trace.info.tags[TRACE_REWARD_TAG]) == pytest.approx(root.attributes["reward"], abs=1e-5)
        names = [sp.name for sp in trace.data.spans if sp.parent_id]
        assert "inspect_tooth" in names and set(names) <= set(TOOL_NAMES)
    client = MlflowClient()
    for key in ("agentic/calls/inspect_tooth", "agentic/invalid_calls", "agentic/rollbacks", "agentic/turns",
                "agentic/finished_share", "rewards/reward_agentic/mean"):  # fmt: skip
        history = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in history] == [1, 2], key

    # the recorded rewards are the environment's: the submitted plan's one-shot score, else the minimum
    records = [json.loads(x) for x in (tmp_path / "grpo" / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 2 * config.batch_size
    for rec in records:
        messages = json.loads(rec["completion"])
        submitted = any(
            c["function"]["name"] == "submit_plan" for m in messages for c in m.get("tool_calls") or []
        )
        assert any(m["role"] == "tool" for m in messages)
        DEFAULT_CACHE.clear()
        expected = reward_terminal(
            [plan_text], seed=[rec["seed"]], task_id=["task_easy"], force_decay=[False]
        )
        value = rec["rewards"]["reward_agentic"]
        assert value == pytest.approx(expected[0] if submitted else REWARD_MIN, abs=1e-5), rec["seed"]
    assert np.isfinite([r["advantage"] for r in records]).all()
    return result, config
