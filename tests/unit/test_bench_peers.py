"""bench/peers: what can go wrong silently (no servers started).

The catalog is deterministic and its sizes log-uniform within bounds, the modelfleet
package it writes serves the same logits as the shared mlp code, the Zipf sampler draws
the frequencies it claims, and the percentile, metric and table code computes what the
table says.
"""

from __future__ import annotations

import hashlib
import json
import math
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
    import stats
    from report import render
finally:
    sys.path.remove(str(PEERS))

from modelfleet import LocalModel  # noqa: E402
from modelfleet.repository.manifest import load_manifest  # noqa: E402

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
