"""bench/figures.csv, the current figure of each benchmark as data: every row names a benchmark that
exists, and every number it states is one docs/benchmarks.md states."""

from __future__ import annotations

import csv
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "bench" / "figures.csv"
NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")


def _rows() -> list[dict[str, str]]:
    with FIGURES.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_every_row_names_a_benchmark_and_its_command():
    rows = _rows()
    assert rows
    assert set(rows[0]) == {"benchmark", "command", "measure", "figure", "unit", "machine", "date"}
    for row in rows:
        assert all(row.values()), row
        assert (ROOT / "bench" / f"{row['benchmark']}.py").is_file(), row["benchmark"]
        script = re.search(r"bench/[\w]+\.(?:py|sh)", row["command"])
        assert script and (ROOT / script.group()).is_file(), row["command"]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]), row["date"]


def test_every_figure_is_one_the_benchmarks_page_states():
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert "bench/figures.csv" in page
    stated = set(NUMBER.findall(page))
    missing = [
        (row["benchmark"], n) for row in _rows() for n in NUMBER.findall(row["figure"]) if n not in stated
    ]
    assert missing == []
