"""The cache benchmark still runs end to end (tiny catalog; no timing asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cache_policy.py"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cache_policy_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_bench_json_has_one_row_per_policy_and_budget(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench()
    argv = ["--models", "12", "--total-mb", "2", "--requests", "60", "--budgets", "0.25,0.5"]
    assert bench.main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["budget_fraction"]) for r in rows] == [
        ("lru", 0.25),
        ("gdsf", 0.25),
        ("lru", 0.5),
        ("gdsf", 0.5),
    ]
    for row in rows:
        assert set(row) == {"policy", "budget_fraction", "hit_ratio", "bytes_loaded", "load_time_s"}
        assert 0.0 <= row["hit_ratio"] <= 1.0 and row["bytes_loaded"] > 0
