"""``orthojob/``'s packages are floors: a module imports only from its own floor and the floors below.

:data:`FLOORS` is the one statement of the order; docs/architecture.md draws it (a test keeps the
drawing and its module names true). A floor is a sub-package (``orthojob/<name>/``) or one of the two
top modules (``orthojob/cli.py``, ``orthojob/job.py``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "orthojob"
ARCHITECTURE = REPO / "docs" / "architecture.md"

FLOORS: tuple[str, ...] = (
    "core",
    "ops",
    "rewards",
    "data",
    "modeling",
    "agentic",
    "eval",
    "lifecycle",
    "deploy",
    "stages",
    "cli",
    "job",
)
"""``orthojob/``'s floors, bottom to top."""


def floor_of(path: Path, root: Path = JOB) -> str | None:
    """The floor a file of ``root`` stands on: its sub-package, or its own name at the top (None for
    the root's ``__init__.py``)."""
    parts = path.relative_to(root).with_suffix("").parts
    return None if parts == ("__init__",) else parts[0]


def floors_present(root: Path = JOB) -> set[str]:
    """The sub-packages and top modules of ``root``."""
    found = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    return found | {p.stem for p in root.glob("*.py") if p.stem != "__init__"}


def imports(path: Path, root: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted target) of every import of ``path`` (a file of package ``root``), function-local
    ones too; a relative import resolved against the file's place; ``from pkg import mod`` as ``pkg.mod``."""
    here = path.relative_to(root.parent).with_suffix("").parts[:-1]  # the file's own package
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*here[: len(here) - node.level + 1], *([base] if base else [])])
            for a in node.names:
                yield node.lineno, f"{base}.{a.name}" if base == root.name else base


def upward_imports(root: Path = JOB, floors: tuple[str, ...] = FLOORS) -> list[str]:
    """``file:line imports target`` for each import of a module of ``root`` that names a higher floor."""
    rank = {name: i for i, name in enumerate(floors)}
    found = []
    for path in sorted(root.rglob("*.py")):
        here = floor_of(path, root)
        if here not in rank:  # the root's __init__; a package off the list fails the test above
            continue
        for line, target in imports(path, root):
            parts = target.split(".")
            if parts[0] != root.name or len(parts) < 2:
                continue
            there = parts[1]
            if rank.get(there, len(floors)) > rank[here]:
                found.append(
                    f"{path.relative_to(root.parent)}:{line} imports {target} (floor {there} over {here})"
                )
    return found


def test_every_package_of_the_job_stands_on_a_floor():
    assert floors_present() == set(FLOORS), (
        f"not in FLOORS: {sorted(floors_present() - set(FLOORS))}; "
        f"in FLOORS but absent: {sorted(set(FLOORS) - floors_present())}"
    )
    assert {p.stem for p in JOB.glob("*.py")} - {"__init__"} == {"cli", "job"}


def test_no_import_runs_from_a_lower_floor_to_a_higher_one():
    found = upward_imports()
    assert not found, "imports running back up a floor:\n" + "\n".join(found)


def test_the_floor_walk_sees_an_import_running_up(tmp_path):
    """A function-local import, a relative one and a ``from pkg import module`` all name their floor."""
    pkg = tmp_path / "house"
    for name in ("low", "high"):
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "high" / "a.py").write_text("from house.low import b\n")
    (pkg / "low" / "b.py").write_text("def f():\n    from house.high import a\n")
    (pkg / "low" / "c.py").write_text("from ..high import a\n")
    (pkg / "low" / "d.py").write_text("from house import high\n")
    (pkg / "top.py").write_text("import house.high.a\n")
    found = upward_imports(pkg, ("low", "high", "top"))
    assert [f.split(" imports ")[0] for f in found] == [
        "house/low/b.py:2",
        "house/low/c.py:1",
        "house/low/d.py:1",
    ]
    assert all("(floor high over low)" in f for f in found)
    assert upward_imports(pkg, ("high", "low", "top")) == [
        "house/high/a.py:1 imports house.low (floor low over high)"
    ]


def drawn_floors(text: str) -> list[tuple[str, str]]:
    """(floor, what the row says) of each row of the floors drawing, top to bottom:
    ``| `orthojob/<name>/` |`` or ``| `orthojob/<name>.py` |``."""
    return re.findall(r"^\| `orthojob/([a-z_]+)(?:/|\.py)` \|([^\n]*)", text, re.MULTILINE)


def test_the_architecture_page_draws_the_floors_in_order():
    rows = drawn_floors(ARCHITECTURE.read_text(encoding="utf-8"))
    assert [floor for floor, _ in reversed(rows)] == list(FLOORS)
    for floor, cells in rows:  # a floor's row names its modules bare
        for module in re.findall(r"`([a-z_]+\.py)`", cells):
            assert (JOB / floor / module).is_file(), f"orthojob/{floor}/{module}"


def test_the_architecture_page_names_only_modules_that_exist():
    text = ARCHITECTURE.read_text(encoding="utf-8")
    named = set(re.findall(r"\b((?:orthojob|server|experiments)(?:/[a-z_]+)*(?:\.py|/))", text))
    assert len(named) > 40
    assert sorted(p for p in named if not (REPO / p).exists()) == []
