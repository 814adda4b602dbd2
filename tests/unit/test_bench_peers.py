"""bench/peers: what can go wrong silently (no model servers started).

The catalog is deterministic and its sizes log-uniform within bounds, the modelfleet
package it writes serves the same logits as the shared mlp code (mapped or copied), the
Zipf sampler draws the frequencies it claims, the percentile, metric and table code
computes what the table says, the static optimum is the knapsack's, the sampler follows a
real process tree's RSS and CPU, the scale variant's options are the issue's, and the
private RabbitMQ node is one of its own (port, descriptor limit) and goes away after.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import itertools
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import pytest

PEERS = Path(__file__).resolve().parents[2] / "bench" / "peers"
sys.path.insert(0, str(PEERS))
try:
    import catalog as cat
    import mlp
    import optimum
    import procs
    import run as bench_run
    import stats
    from report import render
finally:
    sys.path.remove(str(PEERS))

from modelfleet import Context, LocalModel  # noqa: E402
from modelfleet.devtools.rabbit_node import RabbitNodeError  # noqa: E402
from modelfleet.repository.manifest import load_manifest  # noqa: E402
from tests.private_rabbit import require_rabbitmq_server  # noqa: E402

MiB = 1024 * 1024


# -- catalog ------------------------------------------------------------------------------

def test_catalog_spec_is_deterministic_and_seeded() -> None:
    first, again = cat.catalog_spec(), cat.catalog_spec()
    assert first == again
    assert [m.name for m in first] == [f"model-{i:02d}" for i in range(50)]
    assert [m.rank for m in first] == list(range(50))
    assert [m.hidden for m in cat.catalog_spec(seed=cat.SEED + 1)] != [m.hidden for m in first]


def test_catalog_sizes_are_within_bounds_and_log_uniform() -> None:
    sizes = [m.weight_bytes for m in cat.catalog_spec()]
    per_unit = 4 * 75  # bytes one hidden unit adds: the rounding error of hidden_for
    assert min(sizes) >= 1 * MiB - per_unit and max(sizes) <= 40 * MiB + per_unit
    # Log-uniform: the median is near the geometric mean (6.3 MiB), not the middle (20 MiB),
    # and the catalog spans most of the range.
    assert 3 * MiB < float(np.median(sizes)) < 13 * MiB
    assert min(sizes) < 2 * MiB and max(sizes) > 25 * MiB
    # Many draws of the same generator: equal shares in equal bins of log size.
    logs = np.log([m.target_bytes for m in cat.catalog_spec(n=4000, seed=7)])
    counts, _ = np.histogram(logs, bins=4, range=(math.log(1 * MiB), math.log(40 * MiB)))
    assert counts.sum() == 4000
    assert all(abs(c / 4000 - 0.25) < 0.03 for c in counts), counts


@pytest.mark.parametrize("target", [1 * MiB, 3_333_333, 40 * MiB])
def test_hidden_width_hits_the_target_size(target: int) -> None:
    hidden = cat.hidden_for(target)
    assert abs(mlp.weight_bytes(hidden) - target) <= 4 * 75 / 2 + 4


def _digest(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*.npz"))}


def test_written_catalog_is_byte_identical_and_loads(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    small = {"n": 3, "min_bytes": 20_000, "max_bytes": 80_000}
    one = cat.write_catalog(tmp_path / "a", **small)
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 86_400)  # written a day later: same bytes
    two = cat.write_catalog(tmp_path / "b", **small)
    monkeypatch.undo()
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert len(_digest(tmp_path / "a")) == 3
    for spec in one.models:
        size = one.artifact(spec.name).stat().st_size
        assert 0 < size - spec.weight_bytes <= cat.NPZ_OVERHEAD
        net = mlp.load(one.artifact(spec.name))
        assert net.hidden == spec.hidden and net.nbytes == spec.weight_bytes
        assert net.W1.dtype == np.float32
    # A complete catalog is not rewritten.
    before = one.artifact("model-00").stat().st_mtime_ns
    cat.write_catalog(tmp_path / "a", **small)
    assert one.artifact("model-00").stat().st_mtime_ns == before
    assert two.total_bytes == one.total_bytes == sum(one.sizes().values())


# -- mlp ----------------------------------------------------------------------------------

def _tiny_model(tmp_path: Path) -> Path:
    catalog = cat.write_catalog(tmp_path / "cat", n=1, min_bytes=30_000, max_bytes=30_000)
    return catalog.artifact("model-00")


def test_predict_shape_and_values_match_the_formula(tmp_path: Path) -> None:
    net = mlp.load(_tiny_model(tmp_path))
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    out = mlp.predict(net, x)
    assert out.shape == (5, 10) and out.dtype == np.float32
    expected = np.maximum(x @ net.W1 + net.b1, 0) @ net.W2 + net.b2
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert mlp.predict(net, x[0]).shape == (1, 10)  # one row of 64
    with pytest.raises(ValueError):
        mlp.predict(net, np.zeros((2, 63)))


def test_load_appends_one_line_per_load_to_the_log(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = _tiny_model(tmp_path)
    log = tmp_path / "loads.log"
    monkeypatch.setenv(mlp.LOAD_LOG_ENV, str(log))
    mlp.load(path, name="a")
    mlp.load(path, name="b")
    lines = log.read_text().splitlines()
    assert [line.split()[2] for line in lines] == ["a", "b"]
    monkeypatch.delenv(mlp.LOAD_LOG_ENV)
    mlp.load(path)
    assert len(log.read_text().splitlines()) == 2


@pytest.mark.parametrize("payload", [{"inputs": [1.0] * 63}, {"inputs": "x"}, [1.0] * 64,
                                     {"inputs": [1.0] * 63 + [float("nan")]},
                                     {"inputs": [1.0] * 63 + ["a"]}])
def test_parse_inputs_refuses_what_is_not_64_finite_numbers(payload: object) -> None:
    with pytest.raises(ValueError):
        mlp.parse_inputs(payload)


def test_modelfleet_package_serves_the_shared_mlp(tmp_path: Path) -> None:
    catalog = cat.write_catalog(tmp_path / "cat", n=2, min_bytes=20_000, max_bytes=60_000)
    repo = cat.write_modelfleet_repo(catalog, tmp_path / "repo")
    row = [round(0.01 * i, 2) for i in range(64)]
    for spec in catalog.models:
        package = repo / spec.name / "1"
        manifest = load_manifest(package / "model.toml")
        assert manifest.name == spec.name and manifest.accepts == ("application/json",)
        # The estimate is the artifact's bytes (not a guess).
        assert abs(manifest.memory_estimate_bytes - catalog.artifact(spec.name).stat().st_size) \
            < 2048
        answer = LocalModel.from_package(package).infer(
            json.dumps({"inputs": row}).encode(), "application/json")
        expected = mlp.predict(mlp.load(catalog.artifact(spec.name)), row)[0]
        np.testing.assert_allclose(answer["outputs"], expected, rtol=1e-5, atol=1e-6)


# -- Zipf -----------------------------------------------------------------------------------

def test_zipf_probabilities_follow_one_over_rank() -> None:
    z = stats.Zipf(50, 1.0, seed=3)
    p = z.probabilities
    assert math.isclose(sum(p), 1.0)
    assert math.isclose(p[0] / p[1], 2.0) and math.isclose(p[0] / p[9], 10.0)
    harmonic = sum(1 / k for k in range(1, 51))
    assert math.isclose(p[0], 1 / harmonic)


def test_zipf_sampled_frequencies_match_and_are_reproducible() -> None:
    n = 200_000
    draws = stats.Zipf(50, 1.0, seed=11).sample(n)
    assert draws[:100] == stats.Zipf(50, 1.0, seed=11).sample(100)
    assert draws[:100] != stats.Zipf(50, 1.0, seed=12).sample(100)
    assert min(draws) == 0 and max(draws) == 49
    counts = np.bincount(draws, minlength=50) / n
    expected = np.array(stats.Zipf(50, 1.0).probabilities)
    # Within 4 standard errors of a binomial share, rank by rank.
    tolerance = 4 * np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(counts - expected) < tolerance), (counts - expected)[:5]


def test_zipf_with_larger_s_is_more_skewed() -> None:
    flat = stats.Zipf(50, 0.5).probabilities[0]
    steep = stats.Zipf(50, 1.5).probabilities[0]
    assert flat < stats.Zipf(50, 1.0).probabilities[0] < steep


# -- percentiles and summaries ---------------------------------------------------------------

def test_percentile_interpolates_like_numpy() -> None:
    assert stats.percentile(list(range(1, 101)), 50) == 50.5
    assert math.isclose(stats.percentile(list(range(1, 101)), 99), 99.01)
    assert stats.percentile([7.0], 99) == 7.0
    assert math.isnan(stats.percentile([], 50))
    rng = random.Random(5)
    values = [rng.expovariate(1.0) for _ in range(1001)]
    for q in (0, 10, 50, 90, 99, 99.9, 100):
        assert math.isclose(stats.percentile(values, q), float(np.percentile(values, q)))
    with pytest.raises(ValueError):
        stats.percentile(values, 101)


def test_summarize_reports_ms_and_rate_of_successes() -> None:
    latencies = [0.001 * i for i in range(1, 101)]  # 1..100 ms
    s = stats.summarize(latencies, seconds=10, errors=3, timeouts=2)
    assert s["ok"] == 100 and s["req_per_s"] == 10.0
    assert s["p50_ms"] == 50.5 and s["p99_ms"] == 99.01 and s["max_ms"] == 100.0
    assert (s["errors"], s["timeouts"]) == (3, 2)
    empty = stats.summarize([], seconds=5, errors=4)
    assert empty["ok"] == 0 and empty["req_per_s"] == 0 and math.isnan(empty["p50_ms"])


def test_ratio_guards_missing_and_zero() -> None:
    assert stats.ratio(30.0, 10.0) == 3.0
    assert stats.ratio(None, 1.0) is None and stats.ratio(1.0, 0) is None
    assert stats.ratio(float("nan"), 2.0) is None


# -- metrics ----------------------------------------------------------------------------------

EXPOSITION = """\
# HELP modelfleet_model_loads_total Model loads, by source
# TYPE modelfleet_model_loads_total counter
modelfleet_model_loads_total{source="repository"} 12.0
modelfleet_model_loads_total{source="host"} 3.0
modelfleet_model_loads_created{source="host"} 1.7e9
modelfleet_gateway_requests_total{model="model-00",status="200"} 90.0
modelfleet_gateway_requests_total{model="model-01",status="200"} 10.0
modelfleet_gateway_requests_total{model="model-01",status="503"} 4.0
modelfleet_gateway_request_seconds_bucket{le="0.1",model="model-00"} 5.0
modelfleet_gateway_request_seconds_count{model="model-00"} 90.0
modelfleet_worker_permits_cap 16.0
process_cpu_seconds_total 4.5
"""


def test_fold_prometheus_sums_over_models_and_drops_buckets() -> None:
    folded = stats.fold_prometheus(EXPOSITION)
    assert folded['modelfleet_gateway_requests_total{status="200"}'] == 100.0
    assert folded['modelfleet_gateway_requests_total{status="503"}'] == 4.0
    assert not any("_bucket" in k or "_created" in k or k.startswith("process_")
                   for k in folded)
    assert stats.metric_total(folded, "modelfleet_model_loads_total") == 15.0
    assert stats.metric_total(folded, "modelfleet_model_loads_total", source="host") == 3.0
    assert stats.metric_total(folded, "modelfleet_worker_idle_permit_seconds_total") is None
    later = dict(folded)
    later['modelfleet_model_loads_total{source="repository"}'] = 20.0
    delta = stats.counter_delta(folded, later)
    assert delta['modelfleet_model_loads_total{source="repository"}'] == 8.0
    assert delta['modelfleet_model_loads_total{source="host"}'] == 0.0
    assert "modelfleet_worker_permits_cap" not in delta  # a gauge has no delta


# -- the table --------------------------------------------------------------------------------

def test_table_shows_ratios_to_plain_and_to_peers() -> None:
    def row(system: str, rps: float, p99: float) -> dict[str, object]:
        return {"system": system, "summary": {
            "system": system, "zipf_rps": rps, "zipf_p50_ms": 1.0, "zipf_p99_ms": p99,
            "zipf_errors": 0, "zipf_timeouts": 0, "zipf_loads": 0, "c1_p50_ms": 2.0,
            "c32_rps": rps, "rss_mb": 100}}
    results = {"systems": [row("plain", 400.0, 10.0), row("mlserver", 100.0, 40.0),
                           row("modelfleet", 200.0, 20.0),
                           {"system": "ray", "summary": {"system": "ray", "error": "boom"}}],
               "catalog": {"models": 50, "total_bytes": 510 * MiB},
               "machine": {"nproc": 2, "ram_gib": 23.5}, "durations": {}}
    table = render(results)
    lines = table.splitlines()
    assert any(line.startswith("| modelfleet | 200.0 |") for line in lines)
    ratios = [line for line in lines if line.startswith("| modelfleet | 0.50x | 2.00x")]
    assert ratios, table  # req/s half of plain's, p99 twice plain's
    assert any(line.startswith("| modelfleet | 2.00x | 0.50x") for line in lines), table
    assert any(line.startswith("| ray | failed") for line in lines)


def test_table_labels_an_unavailable_row_and_compares_cpu_and_bytes() -> None:
    def row(system: str, rps: float, cpu: float, **extra: object) -> dict[str, object]:
        return {"system": system, "summary": {
            "system": system, "zipf_rps": rps, "zipf_p50_ms": 1.0, "zipf_p99_ms": 10.0,
            "zipf_errors": 0, "zipf_timeouts": 0, "zipf_loads": 5,
            "zipf_cpu_ms_per_request": cpu, "rss_start_mb": 100, "rss_max_mb": 300,
            "rss_end_mb": 250, "pss_start_mb": 80, "pss_max_mb": 200, "pss_end_mb": 150,
            "startup_s": 3.0, **extra}}
    results = {"systems": [
        row("ray", 50.0, 20.0),
        row("modelfleet", 150.0, 5.0, zipf_bytes_per_request=110_000.0,
            zipf_optimum_bytes_per_request=100_000.0,
            zipf_optimum_bound_bytes_per_request=99_000.0,
            zipf_optimum_no_reserve_bytes_per_request=90_000.0),
        {"system": "modelfleet-mapped", "summary": {
            "system": "modelfleet-mapped", "error": "not available: no map_array",
            "not_available": True}}],
        "catalog": {"models": 5000, "total_bytes": 1_277_537_600, "min_bytes": 20_000,
                    "max_bytes": 1_000_000, "pooled_budget_bytes": 408_000_000},
        "machine": {"nproc": 2, "ram_gib": 23.5}, "durations": {}}
    table = render(results)
    lines = table.splitlines()
    assert "warm c1" not in table  # no warm workloads ran: no empty columns for them
    assert any(line.startswith("| modelfleet | 150.0 |")
               and "| 100 / 300 / 250 | 80 / 200 / 150 |" in line for line in lines), table
    # The mapped row is labelled apart (not the shared load code) and says why it is missing.
    assert any(line.startswith("| modelfleet-mapped † | not available |") for line in lines)
    assert any(line.startswith("† modelfleet-mapped: not the shared load code") for line in lines)
    # Against Ray: 3x the req/s, the same p99, a quarter of the CPU per request, same RSS
    # and PSS.
    assert any(line.startswith("| modelfleet | 3.00x | 1.00x | 0.25x | 1.00x | 1.00x |")
               for line in lines), table
    assert "static optimum 0.100 MB" in table and "= 1.10x" in table
    assert "modelfleet_model_load_bytes_total" not in table  # a build without the counter


def test_bytes_loaded_from_the_counter_beside_the_load_log() -> None:
    delta = stats.fold_prometheus(
        'modelfleet_model_load_bytes_total{source="repository"} 3000000\n'
        'modelfleet_model_load_bytes_total{source="disk"} 1000000\n'
        'modelfleet_model_load_bytes_total{source="host"} 500000\n'
        'modelfleet_model_loads_total{source="repository"} 3\n')
    assert stats.metric_by_label(delta, "modelfleet_model_load_bytes_total", "source") == {
        "repository": 3e6, "disk": 1e6, "host": 5e5}
    costs = bench_run.metric_load_bytes(delta, log_bytes=3_900_000, requests=100)
    # Storage reads only (a promotion from host memory is not a load from storage).
    assert costs["metric_load_bytes_window"]["storage_bytes"] == 4e6
    assert costs["bytes_loaded_per_request_metric"] == 40_000.0
    assert costs["metric_over_load_log"] == round(4e6 / 3.9e6, 3)
    # A build without the counter: nothing, and the load log's figure stands alone.
    assert bench_run.metric_load_bytes(stats.fold_prometheus(
        'modelfleet_model_loads_total{source="repository"} 3\n'), 10, 1) == {}
    assert bench_run.metric_load_bytes(None, 10, 1) == {}
    summary = {"system": "modelfleet", "summary": {
        "system": "modelfleet", "zipf_rps": 1.0, "zipf_bytes_per_request": 39_000.0,
        "zipf_bytes_per_request_metric": 40_000.0, "zipf_optimum_bytes_per_request": 20_000.0}}
    table = render({"systems": [summary], "catalog": {}, "machine": {}, "durations": {}})
    assert "modelfleet_model_load_bytes_total says 0.040 MB" in table


# -- the static optimum -----------------------------------------------------------------------

def _brute_force(counts: dict[str, int], sizes: dict[str, int], capacity: int,
                 warm: set[str]) -> int:
    """Bytes loaded by the best subset, by trying them all (tiny instances only)."""
    names = list(counts)
    total = sum(counts[m] * sizes[m] for m in names)
    best = 0
    for k in range(len(names) + 1):
        for subset in itertools.combinations(names, k):
            if sum(sizes[m] for m in subset) <= capacity:
                best = max(best, sum((counts[m] - (0 if m in warm else 1)) * sizes[m]
                                     for m in subset))
    return total - best


def test_static_optimum_beats_greedy_where_greedy_is_not_optimal() -> None:
    # Budget 10 + reserve 6 (the largest model). Greedy by count keeps "a" (6) and then
    # nothing fits; keeping "b" and "c" (5 + 5) saves more.
    counts = {"a": 6, "b": 5, "c": 5}
    sizes = {"a": 6, "b": 5, "c": 5}
    best = optimum.static_optimum(counts, sizes, budget_bytes=16)
    assert best.reserve_bytes == 6
    assert best.resident == {"b", "c"} and best.method == "dp"
    # a loads 6 times (36); b and c load once each (their first request: 10).
    assert best.loaded_bytes == 46 and best.requests == 16
    assert best.bytes_per_request == pytest.approx(46 / 16)
    assert best.bound_bytes_per_request is not None
    assert best.bound_bytes_per_request <= best.bytes_per_request


def test_static_optimum_matches_brute_force_on_random_instances() -> None:
    rng = random.Random(4)
    for _ in range(40):
        n = rng.randint(1, 8)
        sizes = {f"m{i}": rng.randint(1, 50) for i in range(n)}
        counts = {m: rng.randint(0, 9) for m in sizes}
        warm = {m for m in sizes if rng.random() < 0.3}
        budget = rng.randint(0, 200)
        best = optimum.static_optimum(counts, sizes, budget, warm=warm)
        capacity = max(0, budget - max(sizes.values()))
        assert best.loaded_bytes == _brute_force(counts, sizes, capacity, warm)
        assert best.bound_loaded_bytes <= best.loaded_bytes + 1e-9
        assert sum(sizes[m] for m in best.resident) <= capacity


def test_static_optimum_counts_first_loads_and_the_reserve() -> None:
    sizes = {"hot": 10, "cold": 10, "big": 40}
    counts = {"hot": 5, "cold": 1}
    # Room for everything requested: the only loads left are the first ones.
    roomy = optimum.static_optimum(counts, sizes, budget_bytes=100)
    assert roomy.loaded_bytes == 20 and roomy.reserve_bytes == 40
    # Requested in the warm-up: may be resident already, no first load.
    assert optimum.static_optimum(counts, sizes, 100, warm={"hot"}).loaded_bytes == 10
    assert optimum.static_optimum(counts, sizes, 100, compulsory=False).loaded_bytes == 0
    # A budget that holds only the reservation keeps nothing resident.
    tight = optimum.static_optimum(counts, sizes, budget_bytes=45)
    assert tight.resident == frozenset() and tight.loaded_bytes == 60
    assert optimum.static_optimum({}, sizes, 100).bytes_per_request is None
    with pytest.raises(KeyError, match="nobody"):
        optimum.static_optimum({"nobody": 1}, sizes, 100)
    with pytest.raises(ValueError):
        optimum.static_optimum(counts, sizes, -1)


def test_static_optimum_of_the_50_model_catalog_is_the_issue_figure() -> None:
    # Issue 20: for bench/peers' trace, one pooled budget of 2 x 16 % keeping one reserve
    # of the largest model loads about 3.3 MB per request (2.75 MB with no reserve).
    specs = cat.catalog_spec()
    sizes = {m.name: m.weight_bytes for m in specs}
    draws = stats.Zipf(50, 1.0, seed=1).sample(8735)
    counts: dict[str, int] = {}
    for rank in draws:
        counts[specs[rank].name] = counts.get(specs[rank].name, 0) + 1
    pooled = 2 * int(0.16 * sum(sizes.values()))
    one = optimum.static_optimum(counts, sizes, pooled)
    bare = optimum.static_optimum(counts, sizes, pooled, reserve_bytes=0)
    assert one.bytes_per_request is not None and bare.bytes_per_request is not None
    assert 3.0 * MiB < one.bytes_per_request < 3.6 * MiB
    assert 2.4 * MiB < bare.bytes_per_request < one.bytes_per_request
    assert one.as_dict()["capacity_bytes"] == pooled - max(sizes.values())


# -- the scale variant's catalog and options ------------------------------------------------

def test_scale_catalog_names_and_sizes() -> None:
    specs = cat.catalog_spec(n=cat.SCALE_MODELS, min_bytes=cat.SMALL_MIN_BYTES,
                             max_bytes=cat.SMALL_MAX_BYTES)
    assert specs[0].name == "model-0000" and specs[-1].name == "model-4999"
    assert len({s.name for s in specs}) == 5000
    sizes = [s.weight_bytes for s in specs]
    assert min(sizes) >= 20_000 - 300 and max(sizes) <= 1_000_000 + 300
    assert 1.1e9 < sum(sizes) < 1.4e9  # about 1.25 GB: 5,000 x the log-uniform mean
    assert cat.catalog_spec()[0].name == "model-00"  # the default catalog keeps its names


def test_scale_flag_sets_the_variant_and_keeps_the_default() -> None:
    scale = bench_run.parse_args(["--scale"])
    assert (scale.models, scale.sizes, scale.workloads) == (5000, "small", ["zipf-32"])
    assert scale.systems == ["plain", "mlserver", "ray", "modelfleet", "modelfleet-amqp"]
    assert scale.private_rabbit_on and scale.start_timeout_s >= 600
    assert bench_run.parse_args(["--models", "5000"]).systems == scale.systems
    assert bench_run.per_replica(5000) == 800 and bench_run.per_replica(50) == 8
    default = bench_run.parse_args([])
    assert (default.models, default.sizes) == (50, "large")
    assert default.workloads == bench_run.WORKLOADS and not default.private_rabbit_on
    assert "modelfleet-mapped" not in default.systems
    mapped = bench_run.parse_args(["--mapped"])
    assert mapped.systems.index("modelfleet-mapped") == mapped.systems.index("modelfleet") + 1


def test_extra_modelfleet_settings_must_be_modelfleet_variables(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = bench_run.parse_args(["--mf-env", "MODELFLEET_RUNTIME__RSS_MARGIN=1",
                                 "--mf-env", "MODELFLEET_X=a=b"])
    assert args.mf_env == {"MODELFLEET_RUNTIME__RSS_MARGIN": "1", "MODELFLEET_X": "a=b"}
    for bad in ("RSS_MARGIN=1", "MODELFLEET_RUNTIME__RSS_MARGIN"):
        with pytest.raises(SystemExit):
            bench_run.parse_args(["--mf-env", bad])
        assert "--mf-env takes MODELFLEET_NAME=VALUE" in capsys.readouterr().err
    small50 = bench_run.parse_args(["--models", "50", "--sizes", "small"])
    assert bench_run.catalog_dir(50, "small") != bench_run.catalog_dir(50, "large")
    assert small50.workloads == ["zipf-32"]
    with pytest.raises(SystemExit):
        bench_run.parse_args(["--models", "0"])


def test_mapped_repository_points_at_npy_arrays(tmp_path: Path) -> None:
    catalog = cat.write_catalog(tmp_path / "cat", n=2, min_bytes=20_000, max_bytes=40_000)
    with pytest.raises(FileNotFoundError, match="write_npy_arrays"):
        cat.write_modelfleet_repo(catalog, tmp_path / "repo", handler="mapped")
    with pytest.raises(ValueError, match="handler"):
        cat.write_modelfleet_repo(catalog, tmp_path / "repo", handler="mmap")
    cat.write_npy_arrays(catalog)
    repo = cat.write_modelfleet_repo(catalog, tmp_path / "repo", handler="mapped")
    package = repo / "model-00" / "1"
    assert load_manifest(package / "model.toml").entrypoint == "handler:BenchMLPMapped"
    assert f"ctx.{cat.MAPPED_API}(" in (package / "handler.py").read_text()
    net = mlp.load(catalog.artifact("model-00"))
    for key in mlp.WEIGHTS:
        mapped = np.load(package / "artifacts" / f"{key}.npy", mmap_mode="r")
        np.testing.assert_array_equal(mapped, getattr(net, key))
    # The generated handler serves the shared MLP's logits from mapped arrays. The model
    # API's Context.map_array is issue 20's (not on this branch yet): np.load's mmap mode
    # stands in for it here, so the generated code is held to the arrays it maps.

    class MappingContext(Context):
        def map_array(self, name: str) -> np.ndarray:
            return np.load(self.artifact(name), mmap_mode="r")

    sys.path.insert(0, str(package))
    try:
        spec = importlib.util.spec_from_file_location("bench_mapped_handler",
                                                      package / "handler.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(package))
    handler = module.BenchMLPMapped()
    handler.load(MappingContext(model_id="model-00", version="1", package_dir=package,
                                device="cpu"))
    assert isinstance(handler.net.W1, np.memmap)  # mapped, not copied
    row = np.linspace(-1, 1, 64, dtype=np.float32)
    np.testing.assert_allclose(handler.predict([row])[0], mlp.predict(net, row)[0],
                               rtol=1e-6)
    with pytest.raises(ValueError, match="not a 64"):
        mlp.from_arrays("bad", {"W1": np.zeros((3, 4)), "b1": np.zeros(4),
                                "W2": np.zeros((4, 10)), "b2": np.zeros(10)})


# -- samples over the run ---------------------------------------------------------------------

def test_cpu_and_rss_over_a_window_from_the_series() -> None:
    series = [(100.0, 10, 1.0, 1), (101.0, 30, 2.0, 2), (102.0, 20, 4.0, 2)]
    assert procs.cpu_between(series, 100.5, 101.5) == pytest.approx(1.5)
    assert procs.cpu_between(series, 100.0, 102.0) == pytest.approx(3.0)
    assert procs.cpu_between(series, 99.0, 101.0) is None  # before the first sample
    assert procs.rss_summary(series) == {"start_bytes": 10, "max_bytes": 30,
                                         "end_bytes": 20, "samples": 3}
    assert procs.rss_summary(series, 101.0, 102.0)["start_bytes"] == 30
    assert procs.rss_summary(series, 200.0) == {}


def test_sampler_follows_a_real_process_tree(tmp_path: Path) -> None:
    # A parent that starts a child holding 64 MiB and burning CPU until told to stop.
    code = ("import subprocess, sys; "
            "c = subprocess.Popen([sys.executable, '-c', "
            "'b = bytearray(64 << 20); import sys\\nfor _ in iter(sys.stdin.readline, \"\"): "
            "sum(range(10**6))'], stdin=subprocess.PIPE, text=True); "
            "[c.stdin.write('x\\n') or c.stdin.flush() for _ in range(40)]; "
            "c.stdin.close(); c.wait()")
    server = procs.Server("tree", [sys.executable, "-c", code], dict(os.environ), tmp_path,
                          tmp_path / "tree.log")
    try:
        with procs.RssSampler([server], interval_s=0.05) as sampler:
            deadline = time.monotonic() + 60
            while server.alive() and time.monotonic() < deadline:
                sampler.sample()
                time.sleep(0.02)
        assert server.popen.wait(10) == 0, server.log_tail()
    finally:
        server.stop()
    assert sampler.peak_bytes > 64 << 20 and sampler.peak_processes == 2
    first, last = sampler.series[0], sampler.series[-1]
    assert last[2] > first[2]  # CPU seconds accumulate, the child's included
    # The child's CPU is kept after it exits: the last samples see no process, not less CPU.
    assert [s[2] for s in sampler.series] == sorted(s[2] for s in sampler.series)


def test_pss_counts_pages_a_fork_shares_once_where_rss_counts_them_twice(
        tmp_path: Path) -> None:
    # A parent touches 64 MiB, then forks: the child maps the same pages (copy-on-write).
    ready, done = tmp_path / "ready", tmp_path / "done"
    code = ("import os, time; b = bytearray(64 << 20); "
            "pid = os.fork(); "
            f"open({str(ready)!r} + str(pid > 0), 'w').close(); "
            f"[time.sleep(0.02) for _ in iter(lambda: os.path.exists({str(done)!r}), True)]; "
            "pid and os.waitpid(pid, 0)")
    server = procs.Server("forked", [sys.executable, "-c", code], dict(os.environ), tmp_path,
                          tmp_path / "forked.log")
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{side}").exists() for side in (True, False)):
            assert time.monotonic() < deadline and server.alive(), server.log_tail()
            time.sleep(0.02)
        sampler = procs.RssSampler([server])
        sampler.sample()
        done.touch()
        assert server.popen.wait(10) == 0, server.log_tail()
    finally:
        server.stop()
    (_, rss, _, processes), (_, pss) = sampler.series[-1], sampler.pss_series[-1]
    assert processes == 2 and rss > 2 * (64 << 20)
    assert pss < rss - (48 << 20)  # the 64 MiB once, not twice
    assert sampler.pss_summary()["max_bytes"] == pss


def test_load_log_window_counts_lines_and_bytes_in_the_window(tmp_path: Path) -> None:
    log = tmp_path / "loads.log"
    log.write_text("10.0 1 a 100\n15.5 1 b 200\nnot a line\n20.0 2 c 400\n")
    assert bench_run.load_log_window(log, 10.0, 20.0) == (2, 300)
    assert bench_run.load_log_window(log, 0.0, 100.0) == (3, 700)
    assert bench_run.load_log_window(tmp_path / "missing.log", 0.0, 1.0) == (0, 0)


# -- the private RabbitMQ node ------------------------------------------------------------------

def test_private_rabbit_node_has_its_own_port_and_limit_and_goes_away(tmp_path: Path) -> None:
    """The bench's amqp row on a node of its own (modelfleet.devtools.rabbit_node): not the
    shared port, a raised limit, and after the row nothing of it runs and its data is gone
    while its logs stay in the run folder."""
    aio_pika = pytest.importorskip("aio_pika")
    require_rabbitmq_server()
    folder = tmp_path / "modelfleet-amqp" / "rabbitmq"
    node = bench_run.start_private_rabbit(folder)
    try:
        assert node.port != 5672 and node.dist_port + 10_000 < 65_536  # room for rabbitmqctl
        limit = bench_run.node_fd_limit(node)
        assert limit is not None and limit > 10_000, limit  # not the shared node's 1,024
        assert node.startup_s is not None and node.startup_s > 0

        async def declare() -> int:
            connection = await aio_pika.connect(node.url, timeout=30)
            try:
                channel = await connection.channel()
                queue = await channel.declare_queue("bench-probe", durable=True,
                                                    arguments={"x-queue-type": "quorum"})
                return int(queue.declaration_result.message_count)
            finally:
                await connection.close()
        assert asyncio.run(declare()) == 0
        pid = node.pid
        assert pid is not None
    finally:
        bench_run.stop_private_rabbit(node)
    assert node.pid is None
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the node's whole process group is gone
    assert not (folder / "mnesia").exists()  # its data went with it; its logs were kept
    assert any(p.name.endswith(".log") for p in (folder / "log").iterdir())
    with pytest.raises(RabbitNodeError):
        node.ctl("status", timeout_s=60)


def test_the_tail_breakdown_reads_server_timing_and_takes_the_slowest_one_percent() -> None:
    sys.path.insert(0, str(PEERS))
    try:
        import loadgen
    finally:
        sys.path.remove(str(PEERS))
    assert loadgen.parse_server_timing("queue_wait;dur=1.50, predict;dur=0.20, bad;x") == {
        "queue_wait": 1.5, "predict": 0.2}
    # 99 fast warm answers and one slow cold one: the tail is that one alone.
    rows = [(0.01, "queue_wait;dur=2.00, predict;dur=1.00", False)] * 99
    rows.append((2.0, "queue_wait;dur=1500.00, model_load;dur=400.00, predict;dur=1.00", True))
    out = loadgen.phase_breakdown(rows)
    assert out["tail"] == {"n": 1, "latency_ms": 2000.0, "cold_share": 1.0, "phase_ms": {
        "model_load": 400.0, "predict": 1.0, "queue_wait": 1500.0}}
    assert out["all"]["n"] == 100 and out["all"]["cold_share"] == 0.01
    assert out["all"]["phase_ms"]["queue_wait"] == round((99 * 2 + 1500) / 100, 1)
    # The middle tenth, what the median is made of: ten of the fast ones.
    assert out["middle"] == {"n": 10, "latency_ms": 10.0, "cold_share": 0.0, "phase_ms": {
        "predict": 1.0, "queue_wait": 2.0}}
