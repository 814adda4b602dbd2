"""The fleet simulator: deterministic, built on the real scoring and cache, honest output."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

import modelfleet.scheduling
from modelfleet.cache import POLICIES, LruPolicy, ModelCache
from modelfleet.scheduling import ScoringSettings
from modelfleet.settings import Settings
from modelfleet.sim import pull
from modelfleet.sim.cli import main
from modelfleet.sim.compare import ROUTER_NAMES, compare, make_router
from modelfleet.sim.engine import Simulation
from modelfleet.sim.report import JSON_KEYS, summarise
from modelfleet.sim.scenario import ScenarioConfig, build_catalog, build_trace

TINY = ScenarioConfig(models=60, workers=4, duration_s=60.0, warmup_s=10.0, rate=12.0,
                      bursts_per_min=2.0, burst_rate=10.0, burst_s=3.0, device_gib=2.0,
                      host_gib=2.0, size_median_mb=150.0, size_max_mb=1_500.0,
                      sample_s=5.0, seed=3)
TINY_ARGS = ["--models", "60", "--workers", "4", "--duration", "60", "--warmup-s", "10",
             "--rate", "12", "--device-gib", "2", "--host-gib", "2", "--size-median-mb", "150",
             "--size-max-mb", "1500", "--sample-s", "5", "--seed", "3"]


def test_same_seed_gives_the_same_table() -> None:
    first = [summarise(r) for r in compare(TINY)]
    second = [summarise(r) for r in compare(TINY)]
    assert first == second
    assert [s.router for s in first] == list(ROUTER_NAMES)
    other_seed = [summarise(r) for r in compare(replace(TINY, seed=4))]
    assert other_seed != first


def test_routers_run_in_parallel_processes_give_the_same_results() -> None:
    counted: dict[str, int] = {}

    def progress(router: str, total: int) -> Callable[[int], None]:
        counted[router] = 0

        def advance(n: int) -> None:
            counted[router] += n
        return advance

    alone = compare(TINY)
    together = compare(TINY, progress=progress, jobs=2)
    assert together == alone
    assert counted == dict.fromkeys(ROUTER_NAMES, len(build_trace(TINY)))


def test_every_router_sees_the_same_trace_and_accounts_for_every_request() -> None:
    trace = build_trace(TINY)
    measured = sum(1 for t in trace.times if t >= TINY.warmup_s)
    for result in compare(TINY):
        assert len(result.latency_s) == measured
        assert all(0.0 <= x <= TINY.deadline_s for x in result.latency_s)
        assert 0 <= result.hits <= measured


def test_workers_hold_real_model_caches_and_pull_runs_the_real_scoring(
        monkeypatch: pytest.MonkeyPatch) -> None:
    catalog, trace = build_catalog(TINY), build_trace(TINY)
    calls = []
    real = modelfleet.scheduling.decide

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    # The pull router calls the worker's own decision step, not a copy of it.
    assert pull.decide is real
    monkeypatch.setattr(pull, "decide", spy)
    sim = Simulation(TINY, catalog, trace, make_router("pull-affinity", TINY, ScoringSettings()))
    sim.run()
    assert calls  # every worker re-scored through decide
    assert all(type(w.cache) is ModelCache for w in sim.workers)
    # The build's runtimes' eviction policy (runtime.eviction_policy), on both tiers.
    build_policy = POLICIES[Settings().runtime.eviction_policy]
    assert all(type(w.cache.policy) is build_policy for w in sim.workers)
    assert all(w.cache.host_budget_bytes == TINY.host_budget_bytes for w in sim.workers)

    push = Simulation(TINY, catalog, trace, make_router("round-robin", TINY, ScoringSettings()))
    push.run()
    assert all(isinstance(w.cache.policy, LruPolicy) for w in push.workers)
    assert all(w.cache.host_budget_bytes == 0 for w in push.workers)
    # The caches ran on the simulation's clock, not the wall clock.
    assert push.workers[0].cache.snapshot().taken_at_s == push.now


def test_cache_budgets_hold_throughout() -> None:
    catalog, trace = build_catalog(TINY), build_trace(TINY)
    sim = Simulation(TINY, catalog, trace, make_router("pull-affinity", TINY, ScoringSettings()))
    sim.run()
    for worker in sim.workers:
        snap = worker.cache.snapshot()
        assert snap.device_used_bytes + snap.device_reserved_bytes <= snap.device_budget_bytes
        assert snap.host_used_bytes <= snap.host_budget_bytes
        assert worker.in_flight == 0 or worker.in_flight <= worker.permits


def test_json_output_has_exactly_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY_ARGS, "--json", "--no-plot"]) == 0
    out, err = capsys.readouterr()
    rows = json.loads(out)  # stdout holds the JSON and nothing else (progress is on stderr)
    assert [row["router"] for row in rows] == list(ROUTER_NAMES)
    for row in rows:
        assert tuple(row) == JSON_KEYS
        assert all(isinstance(row[k], float) for k in JSON_KEYS if k != "router")
    assert "pull-affinity" in err  # the progress bar


def test_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "run.png"
    assert main([*TINY_ARGS, "--plot", str(png), "--no-progress",
                 "--routers", "pull-affinity,round-robin"]) == 0
    out = capsys.readouterr().out
    assert "| pull-affinity |" in out and "| round-robin |" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([*TINY_ARGS, "--routers", "random", "--no-plot"])
    with pytest.raises(SystemExit):
        main([*TINY_ARGS, "--scoring", "drop_threshold=9", "--no-plot"])
    assert "hysteresis" in capsys.readouterr().err


def test_pull_affinity_loads_fewer_models_than_round_robin_on_a_skewed_catalog() -> None:
    skewed = replace(TINY, models=120, zipf=1.1, duration_s=90.0, rate=16.0)
    results = {s.router: s for s in (summarise(r) for r in
                                    compare(skewed, ["pull-affinity", "round-robin"]))}
    assert results["pull-affinity"].loads_per_min < results["round-robin"].loads_per_min
    assert results["pull-affinity"].hit_rate > results["round-robin"].hit_rate


def test_python_dash_m_runs_the_cli() -> None:
    done = subprocess.run([sys.executable, "-m", "modelfleet.sim", *TINY_ARGS, "--json",
                           "--no-plot", "--routers", "round-robin"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert [row["router"] for row in json.loads(done.stdout)] == ["round-robin"]
