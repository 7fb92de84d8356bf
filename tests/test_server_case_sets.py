"""The server on imported cases: ``python -m server.app --cases FILE`` serves a case set by case id,
and a reset may carry a whole case record; OpenEnv's own client drives both, and an episode of an
imported case is the episode of the same case generated."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import numpy as np
import pytest
from openenv.core.generic_client import GenericEnvClient

from orthojob.data import case_sets
from server.dental_constants import N_STAGES
from server.dental_environment import StepwiseDentalEnvironment
from tests.services import free_port, start_server_process
from tests.test_http_app import interpolated_poses

SEEDS = (3, 4, 5)


@pytest.fixture(scope="module")
def case_file(tmp_path_factory):
    """Three task_medium cases as imported records (no generated key): ids ``patient-<seed>``."""
    path = tmp_path_factory.mktemp("cases") / "patients.jsonl"
    case_sets.export("task_medium", SEEDS, False, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        seed = row.pop("seed")
        row.pop("task_id")
        row["case_id"] = f"patient-{seed}"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, {r["case_id"]: r for r in rows}


@pytest.fixture(scope="module")
def server(case_file, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "server.app", "--port", str(port), "--cases", str(case_file[0])]
    proc = start_server_process(cmd, port, log)
    try:
        yield proc
    finally:
        proc.stop()


def _episode(client, first) -> float:
    for stage in range(1, N_STAGES + 1):
        result = client.step({"poses": interpolated_poses(first, stage)})
    assert result.done
    return result.observation["terminal_reward"]


def _generated_terminal(seed: int) -> tuple[dict, float]:
    env = StepwiseDentalEnvironment()
    first = env.reset("task_medium", seed)
    for stage in range(1, N_STAGES + 1):
        obs = env.step(first["episode_id"], np.array(interpolated_poses(first, stage)))
    return first, obs["terminal_reward"]


@pytest.mark.parametrize("how", ["case_id", "case"])
def test_openenv_client_plays_an_imported_case_like_its_generated_twin(server, case_file, how):
    seed = SEEDS[1]
    record = case_file[1][f"patient-{seed}"]
    reset = {"case_id": f"patient-{seed}"} if how == "case_id" else {"case": record}
    client = GenericEnvClient(base_url=server.url, message_timeout_s=120).sync()
    with client:
        first = client.reset(**reset).observation
        terminal = _episode(client, first)
    twin, twin_terminal = _generated_terminal(seed)
    assert first["task_id"] == "imported" and first["current_stage"] == 0
    assert (
        first["initial_config"] == twin["initial_config"] and first["target_config"] == twin["target_config"]
    )
    assert first["case_summary"] == twin["case_summary"]
    assert terminal == twin_terminal


def test_bad_resets_get_clear_4xx_and_the_server_stays_up(server, case_file):
    record = dict(case_file[1][f"patient-{SEEDS[0]}"])
    with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as http:
        r = http.post("/episodes", json={"case_id": "nobody"})
        assert r.status_code in (400, 422) and "unknown case_id 'nobody'" in r.text and "3 cases" in r.text
        bad = {**record, "initial": record["initial"][:-1]}
        r = http.post("/episodes", json={"case": bad})
        assert r.status_code in (400, 422) and "initial must be a list of 28 poses" in r.text
        r = http.post("/episodes", json={"case_id": "patient-3", "task_id": "task_easy"})
        assert r.status_code == 422 and "not both" in r.text
        r = http.post("/episodes", json={"case": record, "case_id": "patient-3"})
        assert r.status_code in (400, 422) and "not both" in r.text
        r = http.post("/episodes", json={"case_id": "patient-3", "force_decay": True})
        assert r.status_code == 200 and r.json()["force_decay"] is True
        assert http.post("/episodes", json={"task_id": "task_easy", "seed": 1}).status_code == 200


def test_a_bad_case_file_stops_the_server_at_start_with_what_to_fix(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "orthorl-case/1", "case_id": "x", "patient_id": "p"}\n')
    out = subprocess.run(
        [sys.executable, "-m", "server.app", "--port", str(free_port()), "--cases", str(bad)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert "case 'x'" in out.stderr and "teeth" in out.stderr


@pytest.mark.parametrize("how", ["case_id", "case"])
def test_the_agentic_tools_work_on_imported_cases(server, case_file, how):
    """OpenEnv's MCPToolClient calls the tools on an episode of an imported case (by id or inline):
    the same text as the in-process tools on the generated twin."""
    import asyncio

    from openenv.core.mcp_client import MCPToolClient

    from orthojob.agentic.tools import DentalToolEnv
    from tests.test_openenv_package import UNIFORM

    seed = SEEDS[2]
    params = {"case_id": f"patient-{seed}"} if how == "case_id" else {"case": case_file[1][f"patient-{seed}"]}
    opened = httpx.post(
        server.url + "/mcp",
        json={"jsonrpc": "2.0", "id": 1, "method": "openenv/session/create", "params": params},
        timeout=60,
    ).json()["result"]
    assert opened["task_id"] == "imported"

    async def play() -> list[str]:
        client = MCPToolClient(base_url=server.url)
        client.use_production_mode = True
        client._production_session_id = opened["session_id"]
        try:
            return [
                await client.call_tool("inspect_tooth", tooth_id=13),
                await client.call_tool("commit_stage", groups=UNIFORM),
                await client.call_tool("check_collisions"),
            ]
        finally:
            await client.close()

    local = DentalToolEnv()
    local.reset(seed=seed, task_id="task_medium", force_decay=False)
    want = [local.inspect_tooth(13), local.commit_stage(UNIFORM), local.check_collisions()]
    assert asyncio.run(play()) == want
