"""The module map: imports run one way, the CLI imports the stages and never the reverse."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("orthojob", "server", "experiments")
PRODUCT = ("orthojob", "server")
STAGE_MODULES = (
    "stages.grpo",
    "stages.grpo_config",
    "stages.grpo_trainer",
    "stages.sft",
    "stages.sft_config",
    "stages.rsft",
    "stages.rsft_config",
    "stages.pipeline",
    "stages.presets",
    "stages.gate",
)
ENTRY_POINTS = ("orthojob.job",)
"""Above the CLI: the container's command (``python -m orthojob.job``) runs ``orthojob pipeline`` then
``orthojob promote`` through it; nothing imports it."""
SERVING = ("server.app", "server.serving")
"""The serving layer: FastAPI, OpenEnv's server, sessions. The simulation (every other ``server``
module) never imports it."""
WEB_FRAMEWORKS = ("fastapi", "starlette", "uvicorn", "openenv", "pydantic")


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages (sub-packages too)."""
    files = {}
    for pkg in PACKAGES:
        for f in sorted((REPO / pkg).rglob("*.py")):
            parts = f.relative_to(REPO).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return files


def imported_names(path: Path) -> set[str]:
    """Every absolute import of the module's source, function-local ones too: ``a.b`` for
    ``import a.b``; ``a.b`` and ``a.b.c`` for ``from a.b import c``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its source (function-local imports too).
    Importing ``pkg.mod`` counts as importing ``pkg.mod``, not the package ``pkg`` (whose
    ``__init__`` holds only a docstring)."""
    files = module_files()
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        graph[module] = {t for t in imported_names(path) if t in files and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_orthojob_or_server():
    graph = import_graph()
    assert "orthojob.stages.grpo" in graph and "server.cases" in graph
    assert cycles(graph) == []


def test_no_stage_module_imports_the_cli():
    graph = import_graph()
    importers = sorted(m for m, targets in graph.items() if "orthojob.cli" in targets)
    assert [m for m in importers if m not in ENTRY_POINTS] == []
    assert not any(e in targets for e in ENTRY_POINTS for targets in graph.values())
    for stage in STAGE_MODULES:
        assert f"orthojob.{stage}" in graph, stage
        assert (
            f"orthojob.{stage}" in graph["orthojob.cli"]
            or stage in ("stages.gate", "stages.grpo_trainer")
            or any(f"orthojob.{stage}" in graph[m] for m in graph["orthojob.cli"])
        ), stage


def test_server_never_imports_the_job():
    graph = import_graph()
    assert not [
        (m, t)
        for m, targets in graph.items()
        if m.startswith("server")
        for t in targets
        if t.startswith("orthojob")
    ]


def test_the_simulation_imports_nothing_from_serving_or_the_job():
    """``server``'s simulation is pure numpy: no web framework, no serving module, nothing of ``orthojob``."""
    files = module_files()
    simulation = [m for m in files if m.startswith("server") and not m.startswith(SERVING) and m != "server"]
    assert "server.scoring" in simulation and "server.serving.sessions" not in simulation
    bad = {
        m: sorted(
            t
            for t in imported_names(files[m])
            if t.startswith(("orthojob", *SERVING)) or t.split(".")[0] in WEB_FRAMEWORKS
        )
        for m in simulation
    }
    assert {m: v for m, v in bad.items() if v} == {}


def test_nothing_in_the_product_imports_an_experiment():
    """``experiments/`` (``make learn``, the audits) runs on the product; no module of ``orthojob`` or ``server`` imports it."""
    graph = import_graph()
    assert "experiments.learning.experiment" in graph
    assert [
        (m, t) for m, ts in graph.items() if m.startswith(PRODUCT) for t in ts if t.startswith("experiments")
    ] == []


def test_the_module_map_sees_an_upward_import(tmp_path, monkeypatch):
    """The walk finds a function-local import of a serving module in a simulation module."""
    (tmp_path / "m.py").write_text(
        "def f():\n    from server.serving.sessions import X\n    import fastapi\n"
    )
    assert {"server.serving.sessions", "server.serving.sessions.X", "fastapi"} <= imported_names(
        tmp_path / "m.py"
    )


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_cli_imports_no_heavy_dependency():
    """``orthojob --help`` stays fast: torch, TRL, transformers, MLflow and OpenEnv's client load when a
    stage (or ``--env-url``) needs them."""
    import subprocess
    import sys

    code = "import sys, orthojob.cli; print(sorted(m for m in ('torch', 'trl', 'transformers', 'mlflow', 'openenv') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


def test_one_json_walk_with_two_policies():
    """The job's files and the server's outputs take one walk (server.json_values); they differ
    only in what a non-finite number becomes: null in a file, a refusal naming its path on the wire."""
    import math

    import numpy as np
    import pytest
    import torch

    from orthojob.ops.records import json_value
    from server.json_values import NonFiniteOutputError
    from server.serving.serialization import to_jsonable

    value = {
        "a": np.float32(0.5),
        1: (np.int64(3), np.bool_(True)),
        "t": torch.tensor([1.5, 2.0]),
        "s": torch.tensor(4),
    }
    plain = {"a": 0.5, "1": [3, True], "t": [1.5, 2.0], "s": 4}
    assert json_value(value) == to_jsonable(value) == plain
    assert [type(v) for v in json_value(value)["1"]] == [int, bool]
    bad = {"x": [1.0, {"y": np.array([0.0, math.nan])}]}
    assert json_value(bad) == {"x": [1.0, {"y": [0.0, None]}]}
    with pytest.raises(NonFiniteOutputError, match=r"x\[1\]\.y\[1\]"):
        to_jsonable(bad)
    assert json_value({"o": object}) == {"o": str(object)}  # a file never fails on an odd type
    with pytest.raises(NonFiniteOutputError, match="type"):
        to_jsonable({"o": object})
