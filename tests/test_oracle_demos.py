"""BC's oracle demonstrations computed in worker processes are the ones computed in process."""

from __future__ import annotations

import pytest

from orthojob.data import oracle_demos
from server.cases import CaseKey

KEYS = [CaseKey("task_easy", 2_000_900 + i, bool(i % 2)) for i in range(6)]


def test_workers_give_the_same_plans_in_the_same_order(monkeypatch):
    monkeypatch.setattr(oracle_demos, "CHUNK", 2)  # three chunks: the pool is used
    alone = oracle_demos.oracle_cases(KEYS, workers=1)
    pooled = oracle_demos.oracle_cases(KEYS, workers=2)
    assert pooled == alone and len(alone) == len(KEYS)
    assert [o["seed"] for o, _, _ in pooled] == [k.seed for k in KEYS]
    assert all(isinstance(safe, bool) and "tooth_groups" in plan for _, plan, safe in pooled)


def test_the_worker_count_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(oracle_demos.WORKERS_ENV, "3")
    assert oracle_demos.demo_workers() == 3
    for bad in ("0", "two"):
        monkeypatch.setenv(oracle_demos.WORKERS_ENV, bad)
        with pytest.raises(ValueError, match=oracle_demos.WORKERS_ENV):
            oracle_demos.demo_workers()
    monkeypatch.delenv(oracle_demos.WORKERS_ENV)
    assert 1 <= oracle_demos.demo_workers() <= oracle_demos.MAX_WORKERS
