"""The treatment viewer: its arrays are the environment's, its page is self-contained, and in a real
browser (headless Chromium) its slider moves the arches to the environment's poses; MLflow's server
lists and serves it as an artifact and its UI shows it."""

from __future__ import annotations

import json
import re
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from orthojob import cli
from orthojob.eval import plan_geometry, viewer, viewer_logging
from server.cases import HELDOUT_SEED_START, generate_case
from server.collisions import COLLISION_TOLERANCE_MM
from server.dental_constants import ADJACENT_PAIRS, N_STAGES, TOOTH_IDS
from server.dental_environment import StepwiseDentalEnvironment, initial_observation
from server.oracle import oracle_plan
from server.plans import normalize_plan
from server.scoring import pdl_stress_kpa, stage_measures
from server.treatment import rollout_plans, score_plans
from tests.browser import chromium, chromium_binary

HARD = ("task_hard", HELDOUT_SEED_START, True, True)  # force decay and non-compliance: the teeth lag


def _env_poses(case, plan) -> np.ndarray:
    """(25, 28, 7) the poses a fresh environment episode reaches wearing the plan's aligners."""
    spec = normalize_plan(plan)
    planned = rollout_plans([spec], [case])[0][0]
    env = StepwiseDentalEnvironment()
    obs = env.reset(case.task_id, case.seed, case.force_decay, non_compliance=case.non_compliance)
    poses = [np.array(obs["current_config"])]
    for s in range(1, N_STAGES + 1):
        obs = env.step(obs["episode_id"], planned[s].tolist(), strategy=spec.strategy)
        poses.append(np.array(obs["current_config"]))
    return np.stack(poses)


def test_plan_view_is_the_environment():
    case = generate_case(*HARD)
    plan = oracle_plan(initial_observation(case))
    view = plan_geometry.plan_view(case, plan, "oracle")
    spec = normalize_plan(plan)
    planned, achieved = rollout_plans([spec], [case])
    assert np.array_equal(view.planned, planned[0])
    np.testing.assert_allclose(view.achieved, achieved[0], atol=1e-12)  # stepwise == vectorised
    np.testing.assert_allclose(view.achieved, _env_poses(case, plan), atol=0)
    assert np.abs(view.achieved - view.planned).max() > 0.05  # force decay: the page shows both
    m = stage_measures(planned, achieved, case.crown_width_mm[None], case.crown_depth_mm[None])
    np.testing.assert_allclose(view.pdl_kpa[1:], pdl_stress_kpa(m.mis_t, m.mis_r)[0], atol=1e-9)
    # the step reward is the accuracy gain less the two penalties the page shows
    gain = np.diff(view.accuracy, prepend=0.0)
    np.testing.assert_allclose(
        view.step_reward[1:], (gain - view.limit_penalty - view.collision_penalty)[1:], atol=1e-12
    )
    assert view.result == score_plans([plan], [HARD])[0]


def test_collisions_and_breaches_are_marked():
    case = generate_case("task_hard", HELDOUT_SEED_START)
    # every tooth planned twice its movement at 0.1 a stage: over the limits, and neighbours collide
    plan = {"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 0.1, "overcorrection": 1.0}]}
    view = plan_geometry.plan_view(case, plan, "overdone")
    assert {"collision", "limits"} <= set(view.result["broken_rules"])
    colliding = view.penetration > COLLISION_TOLERANCE_MM
    assert colliding.sum() == view.violations[-1, 1] > 0
    segments = plan_geometry.collision_segments(view.achieved, view.penetration)
    assert [len(s["x"]) for s in segments] == (3 * colliding.sum(axis=1)).tolist()  # two ends and a gap each
    s, k = np.argwhere(colliding)[0]
    a, b = ADJACENT_PAIRS[k]
    assert segments[s]["x"][:3] == [round(view.achieved[s, a, 4], 4), round(view.achieved[s, b, 4], 4), None]
    assert segments[s]["label"][0] == f"{TOOTH_IDS[a]}-{TOOTH_IDS[b]}: {view.penetration[s, k]:.2f} mm"
    staging = viewer.staging_figure(view)
    marks = {t.get("name"): t for t in staging["data"]}
    assert (
        len(marks["over the per-stage limit"]["x"])
        == int((view.limit[1:] > 1.05).sum())
        == view.violations[-1, 0]
    )
    assert len(marks["in a colliding contact"]["x"]) > 0
    summary = plan_geometry.stage_data(view, case)["summary"]
    assert [x["colliding"] for x in summary] == colliding.sum(axis=1).tolist()
    assert [x["over_limit"] for x in summary] == np.diff(view.violations[:, 0], prepend=0).tolist()
    assert view.collision_penalty[s] > 0 and view.limit_penalty[1] > 0


def test_prisms_are_centred_on_the_crowns():
    case = generate_case(*HARD)
    v = plan_geometry.crown_prisms(case.initial, case.crown_width_mm, case.crown_depth_mm)
    np.testing.assert_allclose(v.mean(axis=-2), case.initial[:, 4:], atol=1e-12)
    assert max(max(t) for t in plan_geometry.prism_triangles()) == v.shape[0] * v.shape[1] - 1


def test_view_command_writes_a_self_contained_page(tmp_path, capsys):
    completion = tmp_path / "completion.txt"
    plan = {"strategy": "anterior_first", "tooth_groups": [{"teeth": [11, 21], "fraction": 0.05}]}
    completion.write_text(f"I stage the incisors first.\n{json.dumps(plan)}\n")
    out = tmp_path / "view.html"
    argv = [
        "view",
        "--seed",
        str(HELDOUT_SEED_START),
        "--plan",
        f"completion:{completion}",
        "--plan",
        "oracle",
    ]
    assert cli.main([*argv, "--out", str(out)]) == 0
    page = out.read_text()
    assert "completion vs oracle" in capsys.readouterr().out
    assert not re.search(r"<script[^>]*\bsrc=", page) and "<link" not in page  # nothing fetched at view time
    assert "Plotly.newPlot" in page and len(page) > 3_000_000  # plotly.js inlined
    data = json.loads(re.search(r"id='viewer-data'>(.*?)</script>", page).group(1).replace("<\\/", "</"))
    assert [p["name"] for p in data["plans"]] == ["completion", "oracle"]
    assert "I stage the incisors first." in page  # the completion's text is on the page
    # bad sources name what to pass
    assert cli.main(["view", "--plan", "nonsense", "--out", str(out)]) == 2
    assert "unknown plan source 'nonsense'" in capsys.readouterr().err
    (tmp_path / "prose.txt").write_text("no plan here")
    assert cli.main(["view", "--plan", f"completion:{tmp_path / 'prose.txt'}", "--out", str(out)]) == 2
    assert "holds no plan" in capsys.readouterr().err
    assert cli.main(["view", "--task-id", "task_easy", "--non-compliance", "--out", str(out)]) == 2
    assert "non_compliance is an option of task_hard" in capsys.readouterr().err


def _rect(page, element_id: str) -> dict:
    x, y, w, h = page.evaluate(
        f"(() => {{const r = document.getElementById('{element_id}').getBoundingClientRect();"
        "return [r.x + scrollX, r.y + scrollY, r.width, r.height];})()"
    )
    return {"x": x, "y": y, "width": w, "height": h, "scale": 1}


def _shot(page, clip: dict) -> bytes:
    return page.call("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)["data"]


def _centroids(page, arch: int, trace: int) -> np.ndarray:
    xyz = page.evaluate(f"(() => {{const d = document.getElementById('arch-{arch}').data[{trace}];"
                        "return [Array.from(d.x), Array.from(d.y), Array.from(d.z)];})()")  # fmt: skip
    return np.array(xyz, dtype=float).T


def _mesh_centres(page, arch: int, trace: int, per_tooth: int) -> np.ndarray:
    return _centroids(page, arch, trace).reshape(len(TOOTH_IDS), per_tooth, 3).mean(axis=1)


def test_viewer_in_chromium_follows_the_environment(tmp_path):
    chromium_binary()
    case = generate_case(*HARD)
    oracle = oracle_plan(initial_observation(case))
    plans = [("oracle", oracle, None), ("uniform_slerp", viewer.BASELINE_PLANS["uniform_slerp"], None)]
    path = viewer.write_viewer(tmp_path / "view.html", case, plans)
    expected = [_env_poses(case, plan) for _, plan, _ in plans]
    planned = [rollout_plans([normalize_plan(p)], [case])[0][0] for _, p, _ in plans]
    with chromium(tmp_path, 1200, 1000) as page:
        page.goto(path.as_uri())
        page.wait_for("document.body && document.body.dataset.ready === '1'", timeout=120)
        per_tooth = page.evaluate("window.orthoViewer.data.plans[0].vertices_per_tooth")
        clip = _rect(page, "arch-0")
        before = _shot(page, clip)
        for i in range(2):
            np.testing.assert_allclose(_centroids(page, i, 2), expected[i][0, :, 4:], atol=1e-4)
        # a real click half-way along the slider
        box = page.evaluate("(() => {const r = document.getElementById('stage').getBoundingClientRect();"
                            "return [r.x + r.width / 2, r.y + r.height / 2];})()")  # fmt: skip
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            page.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)
        stage = int(page.wait_for("document.body.dataset.rendered !== '0' && document.body.dataset.rendered"))
        assert 8 <= stage <= 16
        assert page.evaluate("document.getElementById('stage').value") == str(stage)
        middle = _shot(page, clip)
        assert middle != before
        for i in range(2):  # both plans on the one slider, each at the environment's poses of that stage
            np.testing.assert_allclose(_centroids(page, i, 2), expected[i][stage, :, 4:], atol=1e-4)
            np.testing.assert_allclose(
                _mesh_centres(page, i, 0, per_tooth), expected[i][stage, :, 4:], atol=1e-4
            )
            np.testing.assert_allclose(
                _mesh_centres(page, i, 1, per_tooth), planned[i][stage, :, 4:], atol=1e-4
            )
        status = page.evaluate("document.getElementById('status-0').textContent")
        step_reward = plan_geometry.plan_view(case, oracle, "oracle").step_reward[stage]
        assert status.startswith(f"stage {stage}: step reward {step_reward:.4f}")
        # the keyboard: End goes to the last aligner
        page.evaluate("document.getElementById('stage').focus()")
        page.press("End")
        assert (
            page.wait_for("document.body.dataset.rendered === '24' && document.body.dataset.rendered") == "24"
        )
        assert _shot(page, clip) not in (before, middle)
        np.testing.assert_allclose(_centroids(page, 1, 2), expected[1][24, :, 4:], atol=1e-4)
        # the colour switch recolours the crowns by the limit ratio
        page.evaluate("(() => {const c = document.getElementById('colour'); c.value = 'limit';"
                      "c.dispatchEvent(new Event('change')); return window.orthoViewer.update(24);})()")  # fmt: skip
        assert page.evaluate("document.getElementById('arch-0').data[0].cmax") == viewer.LIMIT_COLOUR_MAX
        status = page.evaluate("document.getElementById('status-0').textContent")
        assert "peak lag" in status and f"aligner worn {100 * case.wear[23].mean():.0f}%" in status
        assert not [line for line in page.console if line.startswith("exception")]


def test_mlflow_server_serves_and_shows_the_viewer(tmp_path):
    chromium_binary()
    mlflow = pytest.importorskip("mlflow")
    from tests.services import mlflow_server

    case = generate_case("task_easy", HELDOUT_SEED_START)
    with mlflow_server(tmp_path / "mlflow", str(tmp_path / "artifacts")) as service:
        previous = mlflow.get_tracking_uri()
        mlflow.set_tracking_uri(service.uri)
        try:  # an experiment id of its own, not made the process's active experiment (later tests')
            experiment_id = mlflow.tracking.MlflowClient().create_experiment("viewer-test")
            with mlflow.start_run(experiment_id=experiment_id) as run:
                # one plan: a 3-D scene less to draw on the CPU than a side-by-side page
                logged = viewer_logging.log_viewer(
                    case, viewer_logging.reference_plans(case)[:1], "viewers/evaluate", "case.html"
                )
        finally:
            mlflow.set_tracking_uri(previous)
        assert logged == Path("viewers/evaluate/case.html")
        run_id = run.info.run_id
        query = urllib.parse.urlencode({"run_id": run_id, "path": "viewers/evaluate"})
        with urllib.request.urlopen(
            f"{service.uri}/ajax-api/2.0/mlflow/artifacts/list?{query}", timeout=30
        ) as r:
            listed = json.load(r)
        assert [f["path"] for f in listed["files"]] == ["viewers/evaluate/case.html"]
        served_url = f"{service.uri}/get-artifact?" + urllib.parse.urlencode(
            {"path": "viewers/evaluate/case.html", "run_uuid": run_id}
        )
        with urllib.request.urlopen(served_url, timeout=30) as r:
            served = r.read().decode()
        assert "Plotly.newPlot" in served and served.startswith("<!DOCTYPE html>")
        with chromium(tmp_path, 1200, 900) as page:
            ui = f"{service.uri}/#/experiments/{experiment_id}/runs/{run_id}/artifacts/viewers/evaluate/case.html"
            page.goto(ui)
            # the run's artifact tree lists the file, and the UI renders the HTML artifact in a frame
            page.wait_for("document.body && document.body.innerText.includes('case.html')", timeout=90)
            frame = page.wait_for(
                "(() => {const f = document.querySelector('iframe'); return f && (f.getAttribute('src') || "
                "(f.srcdoc ? 'srcdoc' : ''));})()",
                timeout=90,
            )
            assert frame
            # the viewer runs inside the UI's sandboxed frame: its page became ready (plots drawn)
            # the frame is listed before it has navigated to the artifact's blob URL: wait for both
            deadline = time.monotonic() + 60
            inner = page.child_frames()
            while not (inner and inner[0]["url"]) and time.monotonic() < deadline:
                time.sleep(0.2)
                inner = page.child_frames()
            assert [f["name"] for f in inner] == ["html"] and inner[0]["url"].startswith("blob:"), inner
            context = page.frame_context(inner[0]["id"])
            page.wait_for(
                "document.body && document.body.dataset.ready === '1'", timeout=120, context=context
            )
            names = page.evaluate(
                "JSON.parse(document.getElementById('viewer-data').textContent).plans.map(p => p.name).join()",
                context=context,
            )
            assert names == "oracle"


def _artifacts(run_id: str, path: str) -> list[str]:
    from mlflow.tracking import MlflowClient

    return sorted(f.path for f in MlflowClient().list_artifacts(run_id, path))


def test_evaluations_log_viewers_of_a_few_cases():
    """A checkpoint's evaluation (its episodes as :func:`orthojob.eval.evaluation.run_checkpoint` leaves
    them) logs one viewer per case for the first cases of each task, the checkpoint's plan against the
    oracle and uniform SLERP; a completion without a plan gets the references only; nothing is logged
    outside a run."""
    mlflow = pytest.importorskip("mlflow")
    from orthojob.eval.evaluation import CheckpointEpisodes
    from orthojob.rewards.rollouts import score_texts
    from server.cases import CaseKey

    seeds = [HELDOUT_SEED_START + i for i in range(3)]
    plan = {"strategy": "anterior_first", "tooth_groups": [{"teeth": [11, 21], "fraction": 0.05}]}
    texts = [json.dumps(plan), "I would rather not plan.", json.dumps(plan)]
    cases = [CaseKey("task_easy", s) for s in seeds]
    episodes = CheckpointEpisodes(["task_easy"] * 3, seeds, False, texts, [9, 5, 9], [True] * 3,
                                  rollouts=score_texts(texts, cases))  # fmt: skip
    assert viewer_logging.log_checkpoint_viewers(episodes, "bc_sft") == []  # no active run
    with mlflow.start_run() as run:
        logged = viewer_logging.log_checkpoint_viewers(episodes, "bc_sft", per_task=2)
    names = [f"viewers/evaluate/bc_sft/task_easy_seed{s}.html" for s in seeds[:2]]
    assert [str(p) for p in logged] == names == _artifacts(run.info.run_id, "viewers/evaluate/bc_sft")
    local = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="viewers"))
    for name, shown in zip(names, (["bc_sft", "oracle", "uniform_slerp"], ["oracle", "uniform_slerp"])):
        page = (local.parent / name).read_text()
        data = json.loads(re.search(r"id='viewer-data'>(.*?)</script>", page).group(1).replace("<\\/", "</"))
        assert [p["name"] for p in data["plans"]] == shown
    with mlflow.start_run() as run:
        assert (
            len(
                viewer_logging.log_baseline_viewers(
                    ["task_easy", "task_hard"], HELDOUT_SEED_START, per_task=1
                )
            )
            == 2
        )
    assert _artifacts(run.info.run_id, "viewers/evaluate/baselines") == [
        f"viewers/evaluate/baselines/{t}_seed{HELDOUT_SEED_START}.html" for t in ("task_easy", "task_hard")
    ]


def test_grpo_callback_logs_the_best_and_worst_completion(tmp_path):
    """The GRPO callback reads the completions file's new lines every N steps and logs the viewers of
    the best and the worst scored completion of the latest batch (by the environment's scaled reward);
    completions without a plan are never picked; a half-written last line waits for the next look."""
    mlflow = pytest.importorskip("mlflow")
    from types import SimpleNamespace

    from orthojob.rewards.rollouts import score_texts
    from server.cases import CaseKey

    good = json.dumps(oracle_plan(initial_observation(generate_case("task_easy", HELDOUT_SEED_START))))
    slow = json.dumps({"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 0.02}]})
    texts = ["no plan at all", slow, good]
    records = [
        {"step": 2, "seed": HELDOUT_SEED_START, "task_id": "task_easy", "force_decay": False, "completion": t}
        for t in texts
    ]
    rolls = score_texts(texts, [CaseKey("task_easy", HELDOUT_SEED_START)] * 3)
    assert rolls[0].error is not None and rolls[2].scaled_reward > rolls[1].scaled_reward
    assert viewer_logging.best_and_worst(records) == (2, 1)
    path = tmp_path / "completions.jsonl"
    old = {**records[1], "step": 1, "completion": good}
    path.write_text(json.dumps(old) + "\n" + "".join(json.dumps(r) + "\n" for r in records) + '{"step": 3')
    callback = viewer_logging.grpo_viewer_callback(path, every=2)
    state = SimpleNamespace(is_world_process_zero=True, global_step=1)
    with mlflow.start_run() as run:
        callback.on_step_end(None, state, None)  # not a multiple of 2: no look
        assert callback.offset == 0
        state.global_step = 2
        callback.on_step_end(None, state, None)
        assert _artifacts(run.info.run_id, "viewers/grpo") == [
            "viewers/grpo/step_000002_best.html",
            "viewers/grpo/step_000002_worst.html",
        ]
        assert callback.offset == path.stat().st_size - len('{"step": 3')
        best = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="viewers/grpo"))
        assert "step 2 best" in (best / "step_000002_best.html").read_text()
        state.global_step = 3
        callback.on_train_end(None, state, None)  # nothing new and whole: nothing more
        assert len(_artifacts(run.info.run_id, "viewers/grpo")) == 2


def test_a_checkpoint_evaluation_logs_viewers_and_view_decodes_the_checkpoint(tmp_path, capsys):
    """``orthojob evaluate --checkpoint`` (a tracked stage: an MLflow run) logs a viewer per held-out
    case; ``orthojob view --plan checkpoint:DIR`` decodes the checkpoint's greedy plan (the untrained
    tiny model writes none, and view says so)."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from orthojob.modeling import models
    from orthojob.ops import tracking

    tiny = models.build_tiny(tmp_path / "tiny", ["task_easy"], max_position_embeddings=2048)
    argv = [
        "evaluate",
        "--checkpoint",
        str(tiny),
        "--task-id",
        "task_easy",
        "--seeds",
        "3",
        "--max-new-tokens",
        "16",
    ]
    assert cli.main(argv) == 0
    run_id = tracking.last_stage_run("evaluate")
    files = [f.path for f in MlflowClient().list_artifacts(run_id, "viewers/evaluate/checkpoint")]
    assert files == [
        f"viewers/evaluate/checkpoint/task_easy_seed{HELDOUT_SEED_START + i}.html" for i in range(2)
    ]
    capsys.readouterr()
    out = tmp_path / "view.html"
    assert (
        cli.main(["view", "--plan", f"checkpoint:{tiny}", "--max-new-tokens", "16", "--out", str(out)]) == 2
    )
    assert f"checkpoint {tiny}: the completion holds no plan" in capsys.readouterr().err and not out.exists()
