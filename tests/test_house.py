"""The house a newcomer walks: a short README that reaches every docs page, no history in the code,
tests or docs (it lives in CHANGELOG.md), and modules of a readable size."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

README_MAX_BYTES = 15_000
MODULE_MAX_LINES = 600
# one concept each, argued in docs/architecture.md's terms: TRL's trainer subclass with its callbacks,
# and the parser of every command; a little over the line, never far
LONGER_MODULES = {"orthojob/stages/grpo_trainer.py": 650, "orthojob/cli.py": 650}

HISTORY = re.compile(
    r"\bissues? #?\d+\b|\(issue\b|\b(?:last|previous|earlier) session\b|\btrial \d+[A-Z]?\b"
    r"|\bcommit [0-9a-f]{7,40}\b",
    re.IGNORECASE,
)
# external provenance a reader can check (which upstream commit a file was taken from), not our history
PROVENANCE = {"k8s/schemas/README.md", "scripts/open_full_jaw_fixture.py"}


def _project_files(*suffixes: str) -> list[Path]:
    skip = {".venv", ".git", "runs", "node_modules", "mlruns"}
    return [
        p
        for p in ROOT.rglob("*")
        if p.is_file() and p.suffix in suffixes and not skip & set(p.relative_to(ROOT).parts)
    ]


def test_the_readme_is_short_and_reaches_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= README_MAX_BYTES
    linked = set(re.findall(r"docs/([\w-]+\.md)", readme))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"


def test_no_history_outside_the_changelog():
    found = []
    for path in _project_files(".py", ".md", ".yaml", ".toml", ".cfg"):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "CHANGELOG.md" or rel in PROVENANCE or rel == "tests/test_house.py":
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{rel}:{number}: {line.strip()[:120]}")
    assert not found, "history belongs in CHANGELOG.md:\n" + "\n".join(found)


def test_the_history_pattern_sees_history():
    # built from parts, so this file holds no history line of its own
    cited = (
        "see " + "issue 12",
        "(" + "issue 7)",
        "measured last " + "session",
        "trial " + "7Q",
        "fixed in commit " + "a765666",
    )
    for line in cited:
        assert HISTORY.search(line), line
    for line in ("this session has no episode", "the session store", "an MLflow run"):
        assert not HISTORY.search(line), line


def test_no_module_is_longer_than_one_concept_needs():
    long = {}
    for path in _project_files(".py"):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(("orthojob/", "server/", "examples/")):
            continue
        lines = len(path.read_text().splitlines())
        if lines > LONGER_MODULES.get(rel, MODULE_MAX_LINES):
            long[rel] = lines
    assert not long, f"split these along their concepts (or argue one concept in LONGER_MODULES): {long}"
