"""The quality gates judge cases drawn for the run, with enough of them to see a rare break: a memoriser
of a fixed window fails, the oracle passes, the oracle written at 3 decimals (a rule broken on about
2.7 % of task_hard cases under force decay) fails at the GPU preset's size, the window is recorded and
lies in the gates' seed range, and the guarantee figures follow the binomial bound."""

from __future__ import annotations

import itertools
import json
import math
from functools import lru_cache

import pytest

from orthojob.core.prompts import plan_to_completion
from orthojob.lifecycle import gate_file
from orthojob.stages import gate, presets
from server.cases import CaseKey
from server.dental_constants import TOOTH_IDS
from server.oracle import oracle_plan
from server.seed_ranges import FINAL, GATES, SEED_RANGES, TESTS, TRAINING, TUNING, gate_window_start
from tests.test_sft_gate import fake_checkpoint

EVERYTHING_AT_ONCE = plan_to_completion({"tooth_groups": [{"teeth": list(TOOTH_IDS), "fraction": 1.0}]})
"""Every tooth to its target in aligner 1: breaks the per-stage limits on every case."""


def _key(o: dict) -> CaseKey:
    return CaseKey(o["task_id"], int(o["seed"]), bool(o["force_decay"]))


@lru_cache(maxsize=4096)
def _oracle_of(key: CaseKey) -> dict:
    from server.cases import generate_case
    from server.dental_environment import initial_observation

    return oracle_plan(initial_observation(generate_case(*key)))


@pytest.fixture(autouse=True)
def shared_oracle(monkeypatch):
    """The gate's oracle baseline and the scripted planners read one memo of the oracle's plans (the
    same plans, computed once per case: the oracle takes ~50 ms a case)."""
    monkeypatch.setitem(gate.BASELINES, "oracle", lambda o: _oracle_of(_key(o)))


def oracle(obs: list[dict]) -> list[str]:
    return [plan_to_completion(_oracle_of(_key(o))) for o in obs]


def oracle_at_3_decimals(obs: list[dict]) -> list[str]:
    """The oracle's plans with each group's fraction written at 3 decimals instead of 4."""
    out = []
    for o in obs:
        plan = _oracle_of(_key(o))
        groups = [{**g, "fraction": round(g["fraction"], 3)} for g in plan["tooth_groups"]]
        out.append(plan_to_completion({**plan, "tooth_groups": groups}))
    return out


def memoriser(window: set[CaseKey]):
    """A planner that writes the oracle's plan on the cases of ``window`` and everything in aligner 1
    elsewhere."""

    def policy(obs: list[dict]) -> list[str]:
        return [
            plan_to_completion(_oracle_of(_key(o))) if _key(o) in window else EVERYTHING_AT_ONCE for o in obs
        ]

    return policy


TUNED_WINDOW = {CaseKey(t, TUNING.start + i, fd) for t, fd in gate.QUALITY_CELLS for i in range(4)}
"""The first seeds of the tuning range in every cell: the window the gates judged before."""


def test_seed_ranges_are_disjoint_and_the_gates_range_is_apart():
    ordered = sorted(SEED_RANGES, key=lambda r: r.start)
    assert all(a.stop <= b.start for a, b in itertools.pairwise(ordered))
    assert {r.name for r in SEED_RANGES} == {"training", "tuning", "tests", "audits", "final", "gates"}
    for other in (TRAINING, TUNING, TESTS, FINAL):
        assert GATES.start >= other.stop
    assert gate_window_start("a", 50) == gate_window_start("a", 50) != gate_window_start("b", 50)
    assert all(GATES.holds(gate_window_start(f"run-{k}", 300), 300) for k in range(200))


@pytest.mark.parametrize("engine", [True, False], ids=["engine", "raw"])
@pytest.mark.parametrize("stage", [gate_file.BC_SFT, gate_file.GRPO])
def test_a_memoriser_of_a_fixed_window_fails_the_windows_of_two_runs(stage, engine):
    """Judged raw, its plans elsewhere break the hard-rule bound; with the staging engine they ship safe,
    but the engine had to rewrite every one of them, and the repair bound fails it."""
    policy = memoriser(TUNED_WINDOW)
    on_its_window = gate.gate_report(
        "m", stage=stage, policy=policy, keys=sorted(TUNED_WINDOW), engine=engine
    )
    assert on_its_window["passed"] is True  # the fixed window the gates judged before: it passes there
    reports = [
        gate.gate_report("m", n_seeds=2, stage=stage, policy=policy, identity=f"run-{r}", engine=engine)
        for r in "ab"
    ]
    assert reports[0]["window"]["start"] != reports[1]["window"]["start"]
    for report in reports:
        m = report["metrics"]
        assert m["n"] == 2 * len(gate.QUALITY_CELLS) and m["raw_hard_rule_share"] == 1.0
        assert m["oracle_hard_rule_share"] == 0.0 and report["passed"] is False
        if engine:
            assert m["hard_rule_share"] == 0.0 and m["repair_share"] == 1.0
            assert report["checks"]["repair_share"] is False and report["guarantee"]["breaks"] == 0
        else:
            assert m["hard_rule_share"] == 1.0 and m["repair_share"] == 0.0
            assert report["checks"]["hard_rule_share_over_oracle"] is False
            assert report["guarantee"]["breaks"] == m["n"]


@pytest.mark.slow  # 300 oracle plans, about 13 s of CPU
def test_the_oracle_passes_and_the_oracle_at_3_decimals_fails_at_the_gpu_presets_size():
    """One run's window of qwen2.5-3b's size (50 seeds in each cell, 300 cases). ``run-4`` is the first
    of run-0, run-1, ... whose task_hard force-decay cases hold a plan the 3-decimal oracle breaks a
    rule on (at 2.7 % a 50-case cell holds none with probability 0.25)."""
    n = presets.PRESETS["qwen2.5-3b"].grpo.gate_seeds
    assert n == presets.PRESETS["qwen2.5-3b"].bc_sft_gate.n_seeds == presets.GPU_GATE_SEEDS
    exact = gate.gate_report("o", n_seeds=n, stage=gate_file.GRPO, policy=oracle, identity="run-4")
    assert exact["passed"] is True and exact["metrics"]["hard_rule_share"] == 0.0
    g = exact["guarantee"]
    assert g["n_cases"] == 300 and g["breaks"] == 0
    assert (
        g["hard_rule_rate_ruled_out"] == pytest.approx(1 - 0.05 ** (1 / 300))
        and g["hard_rule_rate_ruled_out"] <= 0.01
    )

    rounded = gate.gate_report(
        "o", n_seeds=n, stage=gate_file.GRPO, policy=oracle_at_3_decimals, identity="run-4", engine=False
    )
    assert rounded["window"] == exact["window"]
    m = rounded["metrics"]
    assert (
        m["per_cell_hard_rule_share"]["task_hard/force_decay"]
        > m["oracle_per_cell_hard_rule_share"]["task_hard/force_decay"]
    )
    assert m["hard_rule_share"] > m["oracle_hard_rule_share"]
    assert rounded["passed"] is False and rounded["checks"]["hard_rule_share_over_oracle"] is False
    g = rounded["guarantee"]
    assert g["breaks"] == round(m["hard_rule_share"] * 300) >= 1
    assert g["hard_rule_rate_ruled_out"] > g["rate_ruled_out_with_no_break"]


def test_the_window_is_drawn_from_the_checkpoint_and_recorded_in_the_gate_file(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "ckpt")
    identity = gate.window_identity(ckpt)
    report = gate.gate_report(str(ckpt), n_seeds=1, stage=gate_file.BC_SFT, policy=oracle)
    content = json.loads(json.dumps(gate_file.write_gate(ckpt, report)))
    window = gate_file.read_gate(ckpt)["evaluation"]["window"]
    assert window == content["evaluation"]["window"] and window["identity"] == identity
    assert window["start"] == gate_window_start(identity, 1) and window["n_cases"] == 6
    assert {(c["task_id"], c["force_decay"]) for c in window["cells"]} == set(gate.QUALITY_CELLS)
    assert window["start"] in GATES and all(window["start"] not in r for r in SEED_RANGES if r is not GATES)
    assert content["evaluation"]["guarantee"]["n_cases"] == 6
    text = gate_file.format_gate(content)
    assert (
        f"window: seeds {window['start']}..{window['start']}" in text and "guarantee: 0 rule-breaking" in text
    )
    (ckpt / "model.safetensors").write_bytes(b"other weights")  # another checkpoint: another window
    assert gate.window_identity(ckpt) != identity


@pytest.mark.parametrize("breaks, n", [(0, 96), (0, 300), (1, 300), (4, 96), (7, 300)])
def test_the_rate_ruled_out_is_the_binomial_bound(breaks, n):
    p = gate.hard_rule_rate_bound(breaks, n)
    at_most = sum(math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(breaks + 1))
    assert at_most == pytest.approx(0.05, abs=1e-9)  # seeing so few breaks at a rate p is a 5 % event
    assert gate.hard_rule_rate_bound(breaks, n) > breaks / n
    if breaks == 0:
        assert p == pytest.approx(-math.log(0.05) / n, rel=0.02)


def test_the_presets_gate_sizes_rule_out_what_they_say():
    tiny, gpu = presets.PRESETS["tiny-cpu"], presets.PRESETS["qwen2.5-3b"]
    cells = len(gate.QUALITY_CELLS)
    assert tiny.bc_sft_gate.n_seeds * cells == tiny.grpo.gate_seeds * cells == 96
    assert 0.03 < gate.hard_rule_rate_bound(0, 96) < 0.032
    assert gpu.bc_sft_gate.n_seeds * cells == gpu.rsft_gate.n_seeds * cells == 300
    assert gate.hard_rule_rate_bound(0, 300) < 0.01


def test_only_the_weights_a_loader_reads_draw_the_window(tmp_path):
    """A file no loader reads, or a config written another way, draws no new window (a gate cannot be
    re-drawn without other weights); tensors name it, not the safetensors header's metadata."""
    import torch
    from safetensors.torch import save_file

    ckpt = fake_checkpoint(tmp_path / "ckpt")
    save_file({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, str(ckpt / "model.safetensors"))
    identity = gate.window_identity(ckpt)
    assert identity.startswith("weights:")
    (ckpt / "zz.pt").write_bytes(b"junk no loader reads")
    (ckpt / "config.json").write_text('{"model_type": "qwen2"} ')
    assert gate.window_identity(ckpt) == identity
    save_file({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, str(ckpt / "model.safetensors"),
              metadata={"note": "another header"})  # fmt: skip
    assert gate.window_identity(ckpt) == identity
    save_file({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3) + 1}, str(ckpt / "model.safetensors"))
    assert gate.window_identity(ckpt) != identity
    # a scripted policy is named by its resolved path, however the path is written
    (tmp_path / "scripted").mkdir()
    assert len({gate.window_identity(p) for p in (tmp_path / "scripted", f"{tmp_path}/./scripted/")}) == 1
