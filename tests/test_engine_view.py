"""The treatment viewer with the staging engine: a plan the engine changes is shown as written and as
executed, side by side, each scored by the environment; the page's change table is the engine's record,
and the aligner cells it outlines on the executed plan's staging chart are where the two plans' planned
movements differ. A plan the engine leaves alone is shown once; ``orthojob view --engine off`` shows the
plans as written; an evaluation's MLflow viewers show the executed plan from the episode's rollout."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from orthojob import cli
from orthojob.eval import engine_view, plan_geometry, viewer, viewer_logging
from server.cases import CaseKey, generate_case
from server.plans import UNIFORM_FRACTION
from server.staging_engine import ENGINE_VERSION, FALLBACK, UNCHANGED, execute_plan_dicts
from tests.browser import chromium

SEED = 2_000_123
CASE = ("task_easy", SEED)


def _all_at_once(case) -> dict:
    """Every tooth's whole movement in one aligner: over the per-stage limits."""
    return {"tooth_groups": [{"teeth": case.present_ids, "fraction": 1.0}]}


def _page_json(page: str, element_id: str) -> dict:
    found = re.search(rf"id='{element_id}'>(.*?)</script>", page).group(1)
    return json.loads(found.replace("<\\/", "</"))


def _change_rows(page: str, index: int) -> list[list[str]]:
    table = re.search(rf"<table class='changes' id='changes-{index}'>(.*?)</table>", page).group(1)
    return [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", table)[1:]]


def test_a_changed_plan_is_shown_as_written_and_executed():
    case = generate_case(*CASE)
    plan = _all_at_once(case)
    executed, run = execute_plan_dicts([plan], [case])
    record = run.records[0]
    assert record.status != UNCHANGED and record.raw_broken_rules
    views = engine_view.executed_views(case, [("bc", plan, None)])
    assert [v.name for v in views] == ["bc (as written)", f"bc (executed, staging engine v{ENGINE_VERSION})"]
    written, done = views
    # both scored by the environment: the raw plan breaks the rules the record names, the executed none
    assert set(written.result["broken_rules"]) == set(record.raw_broken_rules)
    assert done.result["broken_rules"] == [] and done.plan == executed[0]
    assert done.result["scaled_reward"] == pytest.approx(run.results[0]["scaled_reward"], abs=1e-9)
    assert done.written is written and done.engine == record.as_dict()

    page = viewer.render_html(case, views)
    assert [p["name"] for p in _page_json(page, "viewer-data")["plans"]] == [v.name for v in views]
    assert "What the staging engine changed: bc (as written)" in page
    assert f"The plan as written broke: <b>{', '.join(record.raw_broken_rules)}</b>" in page
    rows = _change_rows(page, 1)
    assert len(rows) == len(record.changes) > 0
    for (tooth, field, old, new, repair), change in zip(rows, record.changes):
        assert int(tooth) == change.tooth and repair == change.repair
        assert field == engine_view.FIELD_TEXT[change.field]
        assert float(old) == pytest.approx(change.old, abs=5e-5)
        assert float(new) == pytest.approx(change.new, abs=5e-5)
    assert f"Planned movement kept: <b>{100 * record.kept_share:.1f}%</b>" in page

    # the outlined aligner cells: where the two plans' planned movement per aligner differs
    figures = _page_json(page, "figure-data")
    marked = [t for t in figures["staging-1"]["data"] if t.get("name") == engine_view.CHANGED_TRACE]
    assert not [t for t in figures["staging-0"]["data"] if t.get("name") == engine_view.CHANGED_TRACE]
    raw_inc = plan_geometry.plan_view(case, plan, "raw").increment_mm[1:]
    new_inc = plan_geometry.plan_view(case, executed[0], "executed").increment_mm[1:]
    differs = np.argwhere(np.abs(new_inc - raw_inc) > engine_view.MOVEMENT_CHANGE_MM)
    cells = set(zip(marked[0]["x"], marked[0]["y"]))
    assert cells == {(int(s) + 1, str(viewer.TOOTH_LABELS[t])) for s, t in differs} and cells
    assert {int(y) for _, y in cells} <= set(
        record.teeth
    )  # only the teeth the engine changed moved differently


def test_a_safe_plan_is_shown_once_executed_as_written():
    case = generate_case(*CASE)
    plan = {"tooth_groups": [{"teeth": case.present_ids, "fraction": UNIFORM_FRACTION}]}
    views = engine_view.executed_views(case, [("uniform", plan, None)])
    assert [v.name for v in views] == ["uniform"] and views[0].engine["status"] == UNCHANGED
    page = viewer.render_html(case, views)
    assert f"The staging engine (v{ENGINE_VERSION}) executed this plan as written" in page
    assert "What the staging engine changed" not in page and engine_view.CHANGED_TRACE not in page


def test_a_plan_replaced_by_its_fallback_says_which():
    case = generate_case("task_medium", 2_000_100, True)
    # every tooth starts at aligner 20, too late to finish at its speed within the limits
    plan = {
        "tooth_groups": [
            {"teeth": case.present_ids, "fraction": 0.05, "start_stage": 20, "overcorrection": 0.5}
        ]
    }
    _, run = execute_plan_dicts([plan], [case])
    record = run.records[0]
    assert record.status == FALLBACK
    views = engine_view.executed_views(case, [("late", plan, None)])
    page = viewer.render_html(case, views)
    assert f"replaced by its fallback, {engine_view.fallback_text(record.fallback)}" in page
    assert {row[4] for row in _change_rows(page, 1)} == {FALLBACK}
    assert views[1].result["broken_rules"] == record.broken_rules == []


def test_view_runs_the_engine_unless_told_off(tmp_path, capsys):
    case = generate_case(*CASE)
    plan_file = tmp_path / "rushed.json"
    plan_file.write_text(json.dumps(_all_at_once(case)))
    out = tmp_path / "view.html"
    argv = [
        "view",
        "--task-id",
        CASE[0],
        "--seed",
        str(SEED),
        "--plan",
        f"plan:{plan_file}",
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    page = out.read_text()
    assert [p["name"] for p in _page_json(page, "viewer-data")["plans"]] == [
        "rushed (as written)",
        f"rushed (executed, staging engine v{ENGINE_VERSION})",
    ]
    assert "<div class='engine' id='engine-1'>" in page
    assert cli.main([*argv, "--engine", "off"]) == 0
    page = out.read_text()
    assert [p["name"] for p in _page_json(page, "viewer-data")["plans"]] == ["rushed"]
    assert "<div class='engine'" not in page and "<p class='engine-note'>" not in page
    assert "rushed" in capsys.readouterr().out


def test_an_evaluation_viewer_shows_the_executed_plan_of_its_rollout():
    mlflow = pytest.importorskip("mlflow")
    from orthojob.eval.evaluation import CheckpointEpisodes
    from orthojob.rewards.rollouts import score_texts

    case = generate_case(*CASE)
    texts = [json.dumps(_all_at_once(case))]
    rollouts = score_texts(texts, [CaseKey(*CASE)], engine=True)
    assert rollouts[0].changed
    episodes = CheckpointEpisodes(["task_easy"], [SEED], False, texts, [9], [True], rollouts=rollouts,
                                  engine=ENGINE_VERSION)  # fmt: skip
    with mlflow.start_run() as run:
        logged = viewer_logging.log_checkpoint_viewers(episodes, "bc_sft", per_task=1)
    assert [str(p) for p in logged] == [f"viewers/evaluate/bc_sft/task_easy_seed{SEED}.html"]
    local = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path=str(logged[0])))
    page = local.read_text()
    assert [p["name"] for p in _page_json(page, "viewer-data")["plans"]] == [
        "bc_sft (as written)",
        f"bc_sft (executed, staging engine v{ENGINE_VERSION})",
        "oracle",
        "uniform_slerp",
    ]
    executed = json.dumps(rollouts[0].executed.plan, indent=1)
    assert f"<pre>{executed}</pre>".replace('"', "&quot;") in page
    assert len(_change_rows(page, 1)) == len(rollouts[0].repair["changes"])


def test_the_page_with_both_plans_renders_in_chromium(tmp_path):
    case = generate_case(*CASE)
    path = viewer.write_viewer(tmp_path / "view.html", case, [("bc", _all_at_once(case), None)], engine=True)
    _, run = execute_plan_dicts([_all_at_once(case)], [case])
    with chromium(tmp_path, 1300, 1000) as page:
        page.goto(path.as_uri())
        page.wait_for("document.body && document.body.dataset.ready === '1'", timeout=120)
        rows = page.evaluate("document.getElementById('changes-1').rows.length")
        assert rows == len(run.records[0].changes) + 1  # the header and one row per change
        assert page.evaluate("document.getElementById('engine-1').getBoundingClientRect().height") > 0
        legend = page.evaluate(
            "Array.from(document.querySelectorAll('#staging-1 .legendtext')).map(e => e.textContent)"
        )
        assert engine_view.CHANGED_TRACE in legend
        assert "What the staging engine changed" in page.evaluate("document.body.innerText")
        assert not [line for line in page.console if line.startswith("exception")]
