"""Case sets (docs/cases.md): generated cases exported and imported give the same cases bit for bit;
the validator names every problem of a hostile file by case id and FDI tooth, in bounded memory, and
the CLI's exit codes say whether the set is usable."""

from __future__ import annotations

import copy
import json
import tracemalloc

import numpy as np
import pytest

from orthojob.cli import main as cli_main
from orthojob.data import case_sets
from orthojob.eval.evaluation import UNIFORM_SLERP_PLAN
from orthojob.ops.exit_codes import ExitCode
from server.case_files import MAX_LINE_BYTES
from server.case_records import (
    FORMAT,
    case_digest,
    case_of_record,
    cases_of_records,
    pose_transforms,
    record_of_case,
)
from server.cases import TASK_IDS, generate_case
from server.dental_environment import initial_observation
from server.oracle import plan_for_case
from server.treatment import score_plans


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_export_then_import_gives_the_generated_cases_bit_for_bit(tmp_path, suffix):
    """Every level, both dynamics: the imported case's arrays, observation and scores (the oracle's
    plan and uniform SLERP) equal the generated case's exactly."""
    for task_id in TASK_IDS:
        for force_decay in (False, True):
            path = tmp_path / f"{task_id}-{force_decay}{suffix}"
            assert case_sets.export(task_id, range(4), force_decay, path) == 4
            report = case_sets.validate(str(path))
            assert report.ok and report.records == 4 and not report.problems, report.summary()
            for seed, case in enumerate(report.cases):
                generated = generate_case(task_id, seed, force_decay)
                for name in ("initial", "target", "crown_width_mm", "crown_depth_mm"):
                    assert np.array_equal(getattr(case, name), getattr(generated, name)), name
                assert (case.profile, case.optimal_strategy, case.summary) == (
                    generated.profile,
                    generated.optimal_strategy,
                    generated.summary,
                )
                assert initial_observation(case) == initial_observation(generated)
                plans = [plan_for_case(generated), UNIFORM_SLERP_PLAN]
                assert score_plans(plans, [case, case]) == score_plans(plans, [generated, generated])


@pytest.fixture()
def records() -> list[dict]:
    return [json.loads(json.dumps(record_of_case(generate_case("task_medium", s, False)))) for s in range(8)]


def test_the_validator_names_every_problem_of_a_hostile_file(tmp_path, records):
    bad = [copy.deepcopy(r) for r in records]
    bad[0]["initial"][3][0] = float("nan")  # tooth 14
    bad[1]["teeth"][0] = 18  # not one of the 28: and then 11 has no poses
    bad[2]["initial"][0][0] *= 1.2  # a quaternion far from unit length
    bad[3]["target"] = [[*p[:4], *[v * 1000 for v in p[4:]]] for p in bad[3]["target"]]  # mm as µm
    bad[4]["case_id"] = bad[0]["case_id"]  # duplicate
    bad[5]["target"][0][4] += 8.0  # tooth 11 moved 8 mm: infeasible, and into 21
    bad[6]["initial"][2] = "x"  # tooth 13
    bad[6]["labels"] = {"profile": "bogus"}
    bad[7]["initial"][5][0] *= 1.0005  # within tolerance: normalised and counted, not a problem
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in bad] + [
        "[1, 2, 3]",
        "",
        '{"format": "orthorl-case/1", "case_id": "cut", "te',
    ]
    path.write_text("\n".join(lines))
    report = case_sets.validate(str(path))
    text = "\n".join(report.problems)
    assert not report.ok and report.records == 10
    cid = [r["case_id"] for r in records]
    expected = [
        f"line 1, case '{cid[0]}', tooth 14: initial pose has a non-finite value",
        f"line 2, case '{cid[1]}', tooth 18: teeth has 18, not an FDI id",
        f"line 2, case '{cid[1]}', tooth 11: neither in teeth nor in absent",
        f"line 3, case '{cid[2]}', tooth 11: initial quaternion has norm 1.1",
        f"line 4, case '{cid[3]}': target crown centroids over 80 mm from the origin",
        f"line 5, case '{cid[0]}': case_id used twice",
        f"line 6, case '{cid[5]}', tooth 11: the target crowns of 11 and 21 interpenetrate",
        f"line 6, case '{cid[5]}', tooth 11: infeasible in 24 aligners",
        f"line 7, case '{cid[6]}', tooth 13: initial pose must be 7 numbers",
        f"line 7, case '{cid[6]}': labels.profile 'bogus' is not one of",
        "line 9, a case without a case_id: a case record must be a JSON object, got list",
        "line 11: not JSON (the file ends mid-record: truncated?)",
    ]
    for line in expected:
        assert line in text, line
    assert report.notes["quaternions_normalised"] == 1
    assert [c.seed for c in report.cases] == [7]  # the one good record (its duplicate id came later)


def test_a_huge_line_is_refused_in_bounded_memory(tmp_path, records):
    """A 64 MiB line (as a 1 GB one would, 16 times over) is skipped unread: peak memory stays near the
    line cap, and the records around it are read."""
    path = tmp_path / "huge.jsonl"
    with path.open("w") as f:
        f.write(json.dumps(records[0]) + "\n")
        f.write('{"case_id": "' + "x" * (64 << 20) + '"}\n')
        f.write(json.dumps(records[1]) + "\n")
    tracemalloc.start()
    try:
        report = case_sets.validate(str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * MAX_LINE_BYTES, peak
    assert report.records == 3 and len(report.cases) == 2
    assert report.problems == [f"line 2: longer than {MAX_LINE_BYTES} bytes: not a case record"]


def test_wrong_types_and_missing_fields_are_reported_not_raised(records):
    for broken in (None, 3, "text", {}, {"format": "other"}, {**records[0], "teeth": "all"}, {**records[0], "initial": 5},
                   {**records[0], "crown_width_mm": [100.0] * 28}, {**records[0], "force_decay": "yes"},
                   {**records[0], "seed": -1}, {**records[0], "extra": 1}, {**records[0], "labels": None} | {"labels": []}):  # fmt: skip
        checked = case_of_record(broken)
        assert checked.case is None and checked.problems, broken
    ok = case_of_record({**records[0], "crown_depth_mm": None, "task_id": "imported"})
    assert ok.case is not None and ok.notes == {"crown_depth_mm_from_norms": 1}
    assert ok.case.task_id == "imported" and records[0]["format"] == FORMAT
    # the norms' crown widths do not fit this arrangement: said, with what to give instead
    normed = case_of_record({**records[0], "crown_width_mm": None})
    assert normed.case is None and all("give crown_width_mm" in p.message for p in normed.problems)


def test_cases_cli_exit_codes(tmp_path, records, capsys):
    good = tmp_path / "good.jsonl"
    assert cli_main(["cases", "export", "--task", "task_hard", "--seeds", "3:5", "--out", str(good)]) == 0
    assert "wrote 2 task_hard cases" in capsys.readouterr().out
    assert cli_main(["cases", "validate", str(good)]) == 0
    assert "2 records, 2 usable cases of 2 patients, 0 problems" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**records[0], "teeth": records[0]["teeth"][1:]}) + "\n")
    assert cli_main(["cases", "validate", str(bad)]) == ExitCode.USAGE
    assert "tooth 11" in capsys.readouterr().out
    assert cli_main(["cases", "validate", str(tmp_path / "none.jsonl")]) == ExitCode.USAGE
    assert "no case file" in capsys.readouterr().err
    assert (
        cli_main(["cases", "export", "--task", "task_easy", "--seeds", "5:2", "--out", str(bad)])
        == ExitCode.USAGE
    )
    assert "--seeds" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert cli_main(["cases", "validate", str(empty)]) == ExitCode.USAGE


def test_a_case_set_in_s3_validates_like_a_local_file(s3_env, tmp_path, capsys):
    """The storage layer reads an s3:// case file (a real SeaweedFS); a key that is not there is a
    storage error naming the URI, not a crash."""
    from orthojob.ops import storage

    local = tmp_path / "hard.jsonl"
    case_sets.export("task_hard", range(3), True, local)
    storage.s3_client().upload_file(str(local), "orthorl", "cases/hard.jsonl")
    assert cli_main(["cases", "validate", "s3://orthorl/cases/hard.jsonl"]) == 0
    assert "3 records, 3 usable cases" in capsys.readouterr().out
    assert [c.seed for c in case_sets.validate("s3://orthorl/cases/hard.jsonl").cases] == [0, 1, 2]
    code = cli_main(["cases", "validate", "s3://orthorl/cases/none.jsonl"])
    assert code in (ExitCode.STORAGE, ExitCode.STORAGE_DENIED)
    assert "s3://orthorl/cases/none.jsonl" in capsys.readouterr().err


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_a_batch_of_unlabelled_records_gives_what_each_record_gives_alone(records):
    for r in records:
        del r["labels"]
    batch = cases_of_records(records)
    for record, together in zip(records, batch):
        alone = case_of_record(record)
        assert together.notes == alone.notes == {"diagnosis_computed": 1}
        assert together.diagnosis == alone.diagnosis
        assert (together.case.profile, together.case.secondary_profile, together.case.optimal_strategy) == (
            alone.case.profile, alone.case.secondary_profile, alone.case.optimal_strategy,
        )  # fmt: skip


def test_the_split_is_by_patient_deterministic_and_respects_given_splits(tmp_path):
    rows = []
    for s in range(60):  # 20 patients of 3 cases each
        for level in TASK_IDS:
            rows.append(record_of_case(generate_case(level, s, False),
                                       case_id=f"{level}-{s}", patient_id=f"p{s // 3}"))  # fmt: skip
    rows = [json.loads(json.dumps(r)) for r in rows]
    report = case_sets.validate(_write(tmp_path / "a.jsonl", rows))
    assert report.ok, report.summary()
    split = case_sets.split_by_patient(report, 0.3)
    assert sorted(split.train + split.heldout) == list(range(len(rows)))
    train_patients = {report.patient_ids[k] for k in split.train}
    heldout_patients = {report.patient_ids[k] for k in split.heldout}
    assert train_patients and heldout_patients and not train_patients & heldout_patients
    # the file's order does not matter: the same patients are held out, with the same digest per order
    again = case_sets.validate(_write(tmp_path / "b.jsonl", rows[::-1]))
    other = case_sets.split_by_patient(again, 0.3)
    assert {again.patient_ids[k] for k in other.heldout} == heldout_patients
    assert case_sets.split_by_patient(report, 0.3).digest == split.digest
    assert case_sets.split_by_patient(report, 0.5).digest != split.digest
    # a record's own split wins, for every case of its patient
    moved = [{**r, "split": "heldout"} if r["patient_id"] == sorted(train_patients)[0] else r for r in rows]
    given = case_sets.validate(_write(tmp_path / "c.jsonl", moved))
    assert sorted(train_patients)[0] in {
        given.patient_ids[k] for k in case_sets.split_by_patient(given, 0.3).heldout
    }
    with pytest.raises(ValueError, match="heldout_share"):
        case_sets.split_by_patient(report, 1.5)


def test_a_patient_in_both_splits_and_a_bad_split_are_refused(tmp_path, records, capsys):
    rows = [
        {**r, "patient_id": "p1", "split": "train" if k else "heldout"} for k, r in enumerate(records[:3])
    ]
    rows.append({**records[3], "split": "test"})
    report = case_sets.validate(_write(tmp_path / "bad.jsonl", rows))
    text = "\n".join(report.problems)
    assert "patient 'p1' has cases in both splits" in text
    assert "split must be one of 'train', 'heldout'" in text
    good = _write(tmp_path / "good.jsonl", records)
    assert cli_main(["cases", "validate", good]) == 0
    assert "split by patient: train" in capsys.readouterr().out


def test_the_content_digest_follows_the_case_not_its_id(records):
    a = case_of_record(records[0]).case
    b = case_of_record({**records[0], "case_id": "other", "patient_id": "someone"}).case
    assert case_digest(a) == case_digest(b) == case_digest(generate_case("task_medium", 0, False))
    assert case_digest(a) != case_digest(case_of_record(records[1]).case)
    assert case_digest(a) != case_digest(case_of_record({**records[0], "force_decay": True}).case)


def test_transforms_from_planning_software_give_the_same_case(records):
    record = records[0]
    as_transforms = {k: v for k, v in record.items() if k not in ("initial", "target")}
    for name in ("initial", "target"):
        as_transforms[f"{name}_transforms"] = pose_transforms(np.array(record[name])).tolist()
    checked = case_of_record(json.loads(json.dumps(as_transforms)))
    assert checked.problems == [] and checked.notes["transforms_converted"] == 2
    generated = generate_case("task_medium", 0, False)
    for got, want in ((checked.case.initial, generated.initial), (checked.case.target, generated.target)):
        np.testing.assert_allclose(got, want, atol=1e-12)
    plans = [plan_for_case(generated), UNIFORM_SLERP_PLAN]
    for a, b in zip(score_plans(plans, [checked.case] * 2), score_plans(plans, [generated] * 2)):
        assert a["terminal_reward"] == pytest.approx(b["terminal_reward"], abs=1e-9)


def test_bad_transforms_are_refused_by_tooth(records):
    record = {k: v for k, v in records[0].items() if k != "initial"}
    t = pose_transforms(np.array(records[0]["initial"]))
    t[0, :3, :3] *= 10.0  # tooth 11 in cm -> mm twice over: not a rotation
    t[1, :3, 0] *= -1.0  # tooth 12 mirrored
    t[2, 3] = [0.0, 0.0, 1.0, 1.0]  # tooth 13: not an affine last row
    bad = t.tolist()
    bad[3] = [[1, 0, 0], [0, 1, 0]]  # tooth 14: wrong shape
    checked = case_of_record({**record, "initial_transforms": bad})
    text = "\n".join(map(str, checked.problems))
    assert checked.case is None
    assert "tooth 11: initial_transforms: the rotation part is not orthonormal" in text
    assert "tooth 12: initial_transforms: the rotation part is a reflection" in text
    assert "tooth 13: initial_transforms: the last row must be [0, 0, 0, 1]" in text
    assert "tooth 14: initial_transforms must hold a 4 x 4 matrix" in text
    both = case_of_record({**records[0], "initial_transforms": t.tolist()})
    assert "give initial (poses) or initial_transforms" in str(both.problems[0])


def test_evaluate_judges_an_imported_case_set_on_its_heldout_patients(tmp_path, capsys):
    """`orthojob evaluate --cases` scores the baselines on the held-out patients of a case set; a case
    with no generated key is found by its content (the same scores as its generated twin), and the
    run records the case set as an MLflow dataset input with its split."""
    import mlflow

    from orthojob.ops import tracking

    rows = []
    for s in range(12):
        record = json.loads(json.dumps(record_of_case(generate_case("task_easy", s), patient_id=f"p{s}")))
        if s % 2:  # an imported case: no generated key, a label-free diagnosis
            for k in ("task_id", "seed", "labels"):
                del record[k]
        rows.append({**record, "split": "heldout" if s < 4 else "train"})
    source = _write(tmp_path / "patients.jsonl", rows)
    out = tmp_path / "eval.json"
    assert cli_main(["evaluate", "--baselines", "--cases", source, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "split by patient: train 8 cases of 8 patients, heldout 4 cases of 4 patients" in printed
    assert f"4 held-out cases of {source}" in printed
    result = json.loads(out.read_text())
    assert result["cases"]["n_cases"] == 4 and result["cases"]["n_patients"] == 4
    assert set(result["results"]) == {"task_easy", "imported"}
    generated = [generate_case("task_easy", s) for s in range(4)]
    for task, seeds in (("task_easy", [0, 2]), ("imported", [1, 3])):
        want = score_plans([UNIFORM_SLERP_PLAN] * 2, [generated[s] for s in seeds])
        got = result["results"][task]["uniform_slerp"]["scaled_reward"]["mean"]
        assert got == pytest.approx(np.mean([w["scaled_reward"] for w in want]), abs=1e-12)
    run = mlflow.get_run(tracking.last_stage_run("evaluate"))
    (dataset,) = run.inputs.dataset_inputs
    tags = {t.key: t.value for t in dataset.tags}
    assert tags["split"] == "heldout" and tags["cases"] == "4" and tags["patients"] == "4"
    assert tags["mlflow.data.context"] == "evaluation"
    assert dataset.dataset.name == "patients.jsonl:heldout"
    assert tags["split_digest"] == case_sets.split_by_patient(case_sets.validate(source)).digest
    # a set that holds out no patient is refused with what to do
    train_only = _write(tmp_path / "train.jsonl", [{**r, "split": "train"} for r in rows])
    assert cli_main(["evaluate", "--baselines", "--cases", train_only]) == ExitCode.USAGE
    assert "holds out no patient" in capsys.readouterr().err
