"""Agentic tools over the environment server: :class:`DentalToolEnv` with ``env_url`` drives
a real local server (``server.app``, uvicorn in a thread) through OpenEnv's WebSocket client and gives
the very results the in-process environment gives; the server's capacity is checked against the
generation batch."""

from __future__ import annotations

import json

import pytest

from orthojob.agentic.remote import check_server_capacity
from orthojob.agentic.tools import DentalToolEnv
from orthojob.core.prompts import TRAIN_SEED_START, plan_to_completion, reset_observation
from server.app import create_app
from server.oracle import oracle_plan
from server.serving.settings import ServerSettings
from tests.services import running_uvicorn

CASE = {"seed": TRAIN_SEED_START + 1, "task_id": "task_hard", "force_decay": True}
STAGE = [{"teeth": [11, 21, 31, 41], "fraction": 0.05}, {"teeth": [13, 23], "fraction": 0.5}]


def script(env: DentalToolEnv) -> list[str]:
    """Every tool, valid and refused calls, a rollback, then the oracle's plan."""
    plan = plan_to_completion(oracle_plan(reset_observation(**CASE)))
    out = [env.reset(**CASE)]
    out += [
        env.inspect_tooth(13),
        env.inspect_tooth(99),
        env.check_collisions(),
        env.check_collisions(STAGE),
        env.simulate_stage(STAGE, strategy="anterior_first"),
        env.commit_stage(STAGE),
        env.commit_stage([{"teeth": [11], "fraction": 0.02}], strategy="distal_first"),
        env.rollback_stage(),
        env.inspect_tooth(11),
        env.simulate_stage([{"teeth": [11], "fraction": 1.0}]),  # over the per-stage limits
        env.commit_stage([{"teeth": [11], "fraction": 2}]),  # refused before the environment
        env.rollback_stage(),
        env.rollback_stage(),  # the third: refused by the environment
        env.submit_plan(plan),
        env.commit_stage(STAGE),  # after the end
    ]
    return out


@pytest.fixture(scope="module")
def server_url():
    with running_uvicorn(create_app(ServerSettings(max_sessions=4, ws_idle_timeout_s=30))) as url:
        yield url


def test_scripted_tools_over_the_server_match_in_process(server_url):
    local = DentalToolEnv()
    remote = DentalToolEnv(env_url=server_url)
    try:
        expected, got = script(local), script(remote)
    finally:
        remote._env.close()
    assert got == expected
    refused = [k for k, x in enumerate(got) if x.startswith("error: ")]
    assert refused == [2, 11, 13, 15]  # 13: the server refuses, in the same words
    assert json.loads(got[-2])["finished"] and remote.reward == local.reward > 0
    assert remote.metrics == local.metrics
    # 24 committed stages finish the episode with the server's terminal score
    uniform = [{"teeth": [t for q in (10, 20, 30, 40) for t in range(q + 1, q + 8)], "fraction": 1 / 24}]
    results = []
    for env in (DentalToolEnv(), DentalToolEnv(env_url=server_url)):
        env.reset(**CASE)
        results.append([env.commit_stage(uniform) for _ in range(24)][-1])
        results.append(env.result)
        if env._env.__class__.__name__ == "RemoteStepwise":
            env._env.close()
    assert (
        results[0] == results[2] and results[1] == results[3] and results[1]["finished_by"] == "commit_stage"
    )


def test_server_capacity_is_checked_against_the_generation_batch(server_url):
    assert check_server_capacity(server_url, 4)["max_sessions"] == 4
    with pytest.raises(ValueError, match="--max-sessions 8"):
        check_server_capacity(server_url, 8)
    with pytest.raises(ValueError, match="did not answer"):
        check_server_capacity("http://127.0.0.1:9", 1, timeout_s=2)


def test_env_url_flag(server_url):
    import argparse

    from orthojob.ops.run_identity import config_digest
    from orthojob.stages.grpo import add_train_arguments, config_from_args
    from orthojob.stages.grpo_config import ConfigError

    parse = add_train_arguments(argparse.ArgumentParser()).parse_args
    config = config_from_args(parse(["--mode", "agentic", "--env-url", server_url]))
    assert config.env_url == server_url
    assert config_digest(config.to_dict()) != config_digest({**config.to_dict(), "env_url": None})
    with pytest.raises(ConfigError, match="--mode agentic"):
        config_from_args(parse(["--env-url", server_url]))
