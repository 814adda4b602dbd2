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
        (policy, budget)
        for budget in (0.25, 0.5)
        for policy in ("lru", "gdsf", "tinylfu", "static", "belady", "bound")
    ]
    for row in rows:
        assert set(row) == {"policy", "budget_fraction", "hit_ratio", "bytes_loaded",
                            "load_time_s", "bytes_per_request"}
        assert 0.0 <= row["hit_ratio"] <= 1.0 and row["bytes_loaded"] > 0
        assert (row["load_time_s"] is None) == (row["policy"] in {"static", "belady", "bound"})
    for budget in (0.25, 0.5):
        by_policy = {r["policy"]: r["bytes_loaded"] for r in rows if r["budget_fraction"] == budget}
        # The lower bound is below every schedule, the offline Belady one included.
        assert by_policy["bound"] <= min(v for k, v in by_policy.items() if k != "bound")


def test_offline_bounds_on_a_trace_worked_by_hand() -> None:
    bench = load_bench()
    sizes = [10, 10, 10]
    trace = [0, 1, 0, 2, 0, 1]  # budget 20: room for two of the three
    # Belady: 0,1 loaded; 0 hit; 2 evicts 1 (next use farthest); 0 hit; 1 reloaded.
    assert bench.belady(sizes, trace, 20) == (2, 40)
    # Static: keep 0 (3 requests), leaving room for a 10-byte miss: 0 loaded once.
    assert bench.static_optimum(sizes, trace, 20) == (2, 40)
    # PFOO-L: gaps 0->0 (2 steps, twice) and 1->1 (4 steps); budget-time 20 x 6 = 120
    # takes all three (20 + 20 + 40 = 80): 30 bytes saved of 60 requested.
    assert bench.pfoo_lower_bound(sizes, trace, 20) == (3, 30)


def test_unknown_policy_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench()
    with pytest.raises(SystemExit):
        bench.main(["--policies", "lru,fifo"])
    assert "unknown fifo" in capsys.readouterr().err
