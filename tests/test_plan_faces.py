"""One reading of a plan on every face: the same hostile texts through the training rewards, the
environment's ``score_plans``, ``POST /plans/score`` (text and object forms), the agent tools'
``submit_plan`` (in process, the job's TRL tools, MCP over HTTP and over the WebSocket) and the
verifiers taskset. Every face must agree on plan vs not-a-plan; a non-plan scores -2 (or is refused
with the reader's reason) and a plan scores the same scaled reward everywhere."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from orthojob.agentic.tools import DentalToolEnv
from orthojob.rewards.reward_functions import reward_terminal
from orthojob.rewards.rollouts import NO_PLAN, score_texts
from server.app import build_app
from server.dental_environment import StepwiseDentalEnvironment
from server.plan_text import MAX_COMPLETION_CHARS, read_plan, read_plan_text
from server.reward_scaler import REWARD_MIN
from server.serving.mcp_tools import ServerToolEpisode

TASK_ID, SEED, FORCE_DECAY = "task_hard", 2_000_055, True
CASE = {"task_id": TASK_ID, "seed": SEED, "force_decay": FORCE_DECAY}

PLAN = {
    "strategy": "anterior_first",
    "tooth_groups": [
        {"teeth": [11, 21], "fraction": 0.04, "priority": "high"},
        {"teeth": [13, 23], "fraction": 0.05, "priority": "medium"},
    ],
}
OTHER = {"strategy": "distal_first", "tooth_groups": [{"teeth": [17, 27, 37, 47], "fraction": 0.05}]}
TEXT = json.dumps(PLAN)
G1 = '{"teeth": [11, 21], "fraction": 0.04}'
G2 = '{"teeth": [13], "fraction": 0.05}'


def plan_with(*groups: dict, strategy: str = "anterior_first") -> dict:
    return {"strategy": strategy, "tooth_groups": list(groups)}


# (name, text, the plan the text holds, or None when it holds none)
HOSTILE: list[tuple[str, str, dict | None]] = [
    ("prose", "I would need an X-ray before planning this case.", None),
    ("bare plan", TEXT, PLAN),
    ("fenced", f"Here is the plan:\n```json\n{json.dumps(PLAN, indent=2)}\n```\nGood luck.", PLAN),
    ("fence without tag, braces after", f"```\n{TEXT}\n```\nUse {{x}} later.", PLAN),
    ("two plan blocks", TEXT + "\nor maybe\n" + json.dumps(OTHER), PLAN),
    ("note object, then the plan", '{"note": "see below"} ' + TEXT, PLAN),
    ("prose braces, then the plan", "Use {curly} braces: " + TEXT, PLAN),
    ("plan inside a JSON list", "[" + TEXT + "]", PLAN),
    ("repeat in a later object only", TEXT + ' {"a": 1, "a": 2}', PLAN),
    ("tooth_groups twice", '{"tooth_groups": [' + G1 + '], "tooth_groups": [' + G2 + "]}", None),
    (
        "fraction twice in a group",
        '{"tooth_groups": [{"teeth": [11], "fraction": 0.04, "fraction": 1}]}',
        None,
    ),
    (
        "strategy twice",
        '{"strategy": "distal_first", "strategy": "anterior_first", "tooth_groups": [' + G1 + "]}",
        None,
    ),
    (
        "escaped repeat of tooth_groups",
        '{"tooth_groups": [' + G1 + '], "tooth_gr\\u006fups": [' + G2 + "]}",
        None,
    ),
    (
        "NaN in one group",
        '{"tooth_groups": [{"teeth": [12], "fraction": NaN}, ' + G1 + "]}",
        {"tooth_groups": [{"teeth": [12], "fraction": None}, json.loads(G1)]},
    ),
    (
        "-Infinity in one group",
        '{"tooth_groups": [' + G1 + ', {"teeth": [12], "fraction": -Infinity}]}',
        {"tooth_groups": [json.loads(G1), {"teeth": [12], "fraction": None}]},
    ),
    (
        "only NaN and Infinity",
        '{"tooth_groups": [{"teeth": [11], "fraction": NaN}, {"teeth": [12], "fraction": Infinity}]}',
        None,
    ),
    (
        "1e308 in one group",
        '{"tooth_groups": [{"teeth": [12], "fraction": 1e308}, ' + G1 + "]}",
        {"tooth_groups": [{"teeth": [12], "fraction": 1e308}, json.loads(G1)]},
    ),
    ("only 1e999", '{"tooth_groups": [{"teeth": [11, 21], "fraction": 1e999}]}', None),
    ("a 400-digit tooth id", '{"tooth_groups": [{"teeth": [' + "9" * 400 + '], "fraction": 0.04}]}', None),
    (
        "teeth listed twice",
        '{"tooth_groups": [{"teeth": [11, 11, 21], "fraction": 0.04}, {"teeth": [11], "fraction": 0.5}]}',
        {"tooth_groups": [{"teeth": [11, 11, 21], "fraction": 0.04}, {"teeth": [11], "fraction": 0.5}]},
    ),
    ("unknown strategy", json.dumps({**PLAN, "strategy": "teleport"}), {**PLAN, "strategy": "teleport"}),
    (
        "do nothing",
        json.dumps(plan_with({"teeth": [11, 21, 31, 41], "fraction": 0})),
        plan_with({"teeth": [11, 21, 31, 41], "fraction": 0}),
    ),
    ("empty tooth_groups", '{"strategy": "distal_first", "tooth_groups": []}', None),
    ("tooth_groups not a list", '{"tooth_groups": "all"}', None),
    ("empty object", "{}", None),
    ("null", "null", None),
    ("a JSON list", "[1, 2, 3]", None),
    ("a number", "42", None),
    ("object without tooth_groups", '{"strategy": "distal_first", "teeth": [11]}', None),
    (
        "all fractions invalid",
        '{"tooth_groups": [{"teeth": [11], "fraction": 2}, {"teeth": [12], "fraction": -1}]}',
        None,
    ),
    ("strings as fractions", '{"tooth_groups": [{"teeth": [11, 21], "fraction": "0.04"}]}', None),
    ("booleans as teeth", '{"tooth_groups": [{"teeth": [true, false], "fraction": 0.04}]}', None),
    ("unknown tooth ids", '{"tooth_groups": [{"teeth": [19, 99, -11], "fraction": 0.04}]}', None),
    ("nested too deep", '{"tooth_groups": [{"teeth": [11], "fraction": 0.04, "x": [[[[[[1]]]]]]}]}', None),
    ("truncated plan", TEXT[:-12], None),
    ("plan as a JSON string", json.dumps(TEXT), None),
    ("plan past the scanned length", "lorem ipsum " * (MAX_COMPLETION_CHARS // 12 + 1) + TEXT, None),
    ("100k characters of prose", ("no plan { here } " * 6000)[:100_000], None),
    ("unicode garbage", 'ñ😀 ☃ {{ }} \u202e\x00 {"é": ', None),
]


def reference_scores(env: StepwiseDentalEnvironment) -> list[float | None]:
    """The scaled reward of each expected plan (its object scored), None for a non-plan."""
    plans = [(i, p) for i, (_, _, p) in enumerate(HOSTILE) if p is not None]
    scored = env.score_plans([p for _, p in plans], [(TASK_ID, SEED, FORCE_DECAY)] * len(plans))
    out: list[float | None] = [None] * len(HOSTILE)
    for (i, _), result in zip(plans, scored):
        assert result["not_a_plan"] is None, HOSTILE[i][0]
        out[i] = result["scaled_reward"]
    return out


@pytest.fixture(scope="module")
def env() -> StepwiseDentalEnvironment:
    return StepwiseDentalEnvironment()


@pytest.fixture(scope="module")
def expected(env: StepwiseDentalEnvironment) -> list[float | None]:
    return reference_scores(env)


@pytest.fixture(scope="module")
def client():
    with TestClient(build_app(max_sessions=8)) as c:
        yield c


def check_face(name: str, got: list[float | str], expected: list[float | None]) -> None:
    """``got``: a scaled reward per text, or a refusal's reason (str). A plan scores its expected
    reward; a non-plan -2 or a refusal naming what is wrong."""
    for (label, _, _), value, want in zip(HOSTILE, got, expected):
        if want is None:
            assert isinstance(value, str) or value == REWARD_MIN, (name, label, value)
            if isinstance(value, str):
                assert value == read_plan_text(HOSTILE_TEXT[label]).reason, (name, label, value)
        else:
            assert not isinstance(value, str), (name, label, value)
            assert value == pytest.approx(want, abs=1e-9), (name, label)


HOSTILE_TEXT = {name: text for name, text, _ in HOSTILE}


def test_the_reader_reads_each_text_as_labelled(expected):
    assert len(HOSTILE) >= 30 and len(HOSTILE_TEXT) == len(HOSTILE)
    for name, text, plan in HOSTILE:
        reading = read_plan_text(text)
        assert reading.is_plan is (plan is not None), (name, reading.reason)
        if plan is None:
            assert reading.plan is None and reading.spec is None and len(reading.reason) > 20, name
        else:
            assert reading.plan == plan and reading.spec is not None, name
    assert sum(p is not None for p in expected) >= 10
    assert len({round(v, 9) for v in expected if v is not None}) >= 4  # the plans really differ
    assert "tooth_groups" in read_plan_text(HOSTILE_TEXT["tooth_groups twice"]).reason
    assert '"fraction"' in read_plan_text(HOSTILE_TEXT["fraction twice in a group"]).reason
    assert read_plan_text(HOSTILE_TEXT["two plan blocks"]).plan_objects == 2


def test_rewards(expected):
    texts = [t for _, t, _ in HOSTILE]
    columns = {
        "seed": [SEED] * len(texts),
        "task_id": [TASK_ID] * len(texts),
        "force_decay": [FORCE_DECAY] * len(texts),
    }
    check_face("reward_terminal", reward_terminal(texts, **columns), expected)
    rollouts = score_texts(texts, [(TASK_ID, SEED, FORCE_DECAY)] * len(texts))
    for (name, text, plan), rollout in zip(HOSTILE, rollouts):
        assert (rollout.error == NO_PLAN) is (plan is None), name
        assert rollout.not_a_plan == read_plan_text(text).reason, name


def test_environment_score_plans(env, expected):
    texts = [t for _, t, _ in HOSTILE]
    results = env.score_plans(texts, [(TASK_ID, SEED, FORCE_DECAY)] * len(texts))
    keys = set(env.score_plan(TEXT, TASK_ID, SEED, FORCE_DECAY))
    for (name, _, plan), result in zip(HOSTILE, results):
        assert set(result) == keys, name  # a non-plan's result has a plan's keys
        if plan is None:
            assert result["terminal_reward"] == 0.0 and result["broken_rules"] == [], name
            assert result["not_a_plan"] == read_plan_text(HOSTILE_TEXT[name]).reason, name
    check_face("score_plans", [r["scaled_reward"] for r in results], expected)
    # decoded values: the plan object itself, or not a plan
    assert env.score_plan(PLAN, TASK_ID, SEED, FORCE_DECAY)["scaled_reward"] == pytest.approx(expected[1])
    for value in (None, {}, {"tooth_groups": []}, [PLAN], 3, True, b"I am not a plan"):
        result = env.score_plan(value, TASK_ID, SEED, FORCE_DECAY)
        assert result["scaled_reward"] == REWARD_MIN and result["not_a_plan"], value
    assert env.score_plan(TEXT.encode(), TASK_ID, SEED, FORCE_DECAY)["not_a_plan"] is None


def test_http_plan_route(client, expected):
    got, as_objects = [], []
    for name, text, _ in HOSTILE:
        response = client.post("/plans/score", json={"plan": text, **CASE})
        assert response.status_code == 200, (name, response.text)
        body = response.json()
        assert (body["not_a_plan"] is None) is (body["scaled_reward"] != REWARD_MIN), name
        got.append(body["scaled_reward"])
        try:
            decoded = json.loads(text)
        except ValueError:
            continue
        if isinstance(decoded, dict):  # the object form, sent as written (repeated keys kept)
            raw = json.dumps(CASE)[:-1] + ', "plan": ' + text + "}"
            response = client.post("/plans/score", content=raw, headers={"content-type": "application/json"})
            assert response.status_code == 200, (name, response.text)
            as_objects.append((name, response.json()["scaled_reward"]))
    check_face("POST /plans/score", got, expected)
    by_name = dict(zip(HOSTILE_TEXT, expected))
    assert len(as_objects) >= 20
    for name, value in as_objects:
        want = by_name[name]
        assert value == (REWARD_MIN if want is None else pytest.approx(want, abs=1e-9)), name


def submitted(answer: str) -> float | str:
    """A submit_plan answer as a scaled reward, or the refusal's reason."""
    if answer.startswith("error: "):
        return answer[len("error: ") :]
    return json.loads(answer)["scaled_reward"]


def check_rounded(name: str, got: list[float | str], expected: list[float | None]) -> None:
    """:func:`check_face` for the tools' answers (their floats rounded to 4 digits)."""
    check_face(name, got, [None if e is None else round(e, 4) for e in expected])


def test_agent_tools_submit_plan(env, expected):
    server_side, job_side = [], []
    for _, text, _ in HOSTILE:
        tools = ServerToolEpisode(env)
        tools.start(**CASE)
        server_side.append(submitted(tools.submit_plan(text)))
        tools.release()
        job = DentalToolEnv()
        job.reset(**CASE)
        job_side.append(submitted(job.submit_plan(text)))
        job._close()
    check_rounded("StagingTools.submit_plan", server_side, expected)
    check_rounded("DentalToolEnv.submit_plan", job_side, expected)
    tools = ServerToolEpisode(env)
    tools.start(**CASE)
    assert tools.submit_plan(None).startswith("error: plan must be JSON text")
    assert submitted(tools.submit_plan(PLAN)) == round(expected[1], 4)  # a decoded object, as TRL passes it


def test_mcp_over_http_and_websocket(client, expected):
    over_http, over_ws = [], []
    for _, text, _ in HOSTILE:
        session = client.post(
            "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "openenv/session/create", "params": CASE}
        )
        session_id = session.json()["result"]["session_id"]
        call = {"name": "submit_plan", "arguments": {"plan": text}, "session_id": session_id}
        answer = client.post(
            "/mcp", json={"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": call}
        ).json()
        over_http.append(
            answer["error"]["message"] if "error" in answer else submitted(answer["result"]["data"])
        )
    with client.websocket_connect("/ws") as ws:
        for name, text, _ in HOSTILE:
            ws.send_json({"type": "reset", "data": CASE})
            assert ws.receive_json()["type"] == "observation", name
            call = {"name": "submit_plan", "arguments": {"plan": text}}
            ws.send_json(
                {"type": "mcp", "data": {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": call}}
            )
            answer = ws.receive_json()["data"]
            over_ws.append(
                answer["error"]["message"] if "error" in answer else submitted(answer["result"]["data"])
            )
    check_rounded("MCP over POST /mcp", over_http, expected)
    check_rounded("MCP over /ws", over_ws, expected)


def test_verifiers_taskset(expected):
    vf = pytest.importorskip("verifiers.v1")
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import TraceTask

    import orthorl_aligner

    (task,) = orthorl_aligner.load_environment(
        task_id=TASK_ID, force_decay=FORCE_DECAY, seed_start=SEED, num_tasks=1
    ).taskset
    got = []
    for _, text, _ in HOSTILE:
        trace = vf.Trace(
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            state=state_cls(type(task))(),
            agent=vf.AgentInfo(config=vf.AgentConfig(), name="offline", trainable=False),
        )
        trace.nodes.append(MessageNode(message=vf.AssistantMessage(content=text), sampled=True))
        asyncio.run(task.score(trace))
        got.append(trace.rewards["reward_terminal"].score)
    check_face("verifiers reward_terminal", got, expected)


def test_decoded_values_read_as_their_text():
    """A face given the object reads it as the text of that object."""
    for name, text, _ in HOSTILE:
        try:
            decoded = json.loads(text)
        except ValueError:
            continue
        if isinstance(decoded, dict) and "twice" not in name and "repeat" not in name:
            assert read_plan(decoded).is_plan is read_plan_text(text).is_plan, name


def test_mcp_and_websocket_read_a_plan_sent_as_an_object_as_its_text(client, expected):
    """The object form over MCP and the WebSocket, written as raw JSON so that a repeated key reaches
    the server as a client wrote it: each reads as its text does on every other face."""
    by_name = dict(zip(HOSTILE_TEXT, expected))
    checked = 0
    with client.websocket_connect("/ws") as ws:
        for name, text, _ in HOSTILE:
            try:
                decoded = json.loads(text)
            except ValueError:
                continue
            if not isinstance(decoded, dict):
                continue
            call = '{"name": "submit_plan", "arguments": {"plan": ' + text + "}"
            session = client.post(
                "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "openenv/session/create", "params": CASE}
            ).json()["result"]["session_id"]
            body = '{"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": ' + call
            body += ', "session_id": "' + session + '"}}'
            over_http = client.post("/mcp", content=body, headers={"content-type": "application/json"}).json()
            ws.send_json({"type": "reset", "data": CASE})
            assert ws.receive_json()["type"] == "observation", name
            ws.send_text('{"type": "mcp", "data": {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": '
                         + call + "}}}")  # fmt: skip
            over_ws = ws.receive_json()["data"]
            want = by_name[name]
            for face, answer in (("POST /mcp", over_http), ("/ws", over_ws)):
                got = answer["error"]["message"] if "error" in answer else submitted(answer["result"]["data"])
                if want is None:
                    assert isinstance(got, str), (face, name, got)
                else:
                    assert got == round(want, 4), (face, name, got)
            checked += 1
    assert checked >= 20


def test_a_plan_object_longer_than_a_text_face_reads_is_not_a_plan(client):
    """An object holds no more than a text face reads: a plan padded past MAX_COMPLETION_CHARS is not
    a plan as an object either (over HTTP's object form and in process)."""
    padded = {**PLAN, "notes": "x" * (MAX_COMPLETION_CHARS + 1)}
    reading = read_plan(padded)
    assert not reading.is_plan and "characters" in reading.reason
    assert not read_plan_text(json.dumps(padded)).is_plan
    body = client.post("/plans/score", json={"plan": padded, **CASE}).json()
    assert body["scaled_reward"] == REWARD_MIN and "characters" in body["not_a_plan"]
    assert read_plan({**PLAN, "notes": "x" * 100}).is_plan
