"""LoadCostModel learns a fixed part and a per-byte part per source."""

from __future__ import annotations

import random

import pytest

from modelfleet.cache import DEFAULT_COSTS, LoadCostModel

MB = 1_000_000


def test_defaults_before_any_observation_rank_sources_sensibly() -> None:
    model = LoadCostModel()
    size = 500 * MB
    assert model.estimate("host", size) < model.estimate("disk", size)
    assert model.estimate("disk", size) < model.estimate("repository", size)
    fixed_s, per_byte = DEFAULT_COSTS["disk"]
    assert model.estimate("disk", size) == pytest.approx(fixed_s + per_byte * size)
    assert model.estimate("disk", 0) > 0


def test_learns_fixed_and_per_byte_parts_from_noisy_loads() -> None:
    rng = random.Random(7)
    model = LoadCostModel()
    for _ in range(200):  # disk: 0.3 s fixed + 2 s per GB, with 5% noise
        size = rng.randint(1, 2000) * MB
        model.observe("disk", size, (0.3 + 2e-9 * size) * rng.uniform(0.95, 1.05))
    fixed_s, per_byte = model.line("disk")
    assert fixed_s == pytest.approx(0.3, rel=0.3)
    assert per_byte == pytest.approx(2e-9, rel=0.1)
    assert model.estimate("disk", 1000 * MB) == pytest.approx(2.3, rel=0.1)
    # Other sources are untouched.
    assert model.line("repository") == DEFAULT_COSTS["repository"]


def test_one_size_only_scales_the_default_line_to_the_measurement() -> None:
    model = LoadCostModel()
    default = model.estimate("repository", 100 * MB)
    for _ in range(5):
        model.observe("repository", 100 * MB, 3 * default)
    assert model.estimate("repository", 100 * MB) == pytest.approx(3 * default)


def test_recent_loads_outweigh_old_ones() -> None:
    model = LoadCostModel(half_life_loads=8)
    for size_mb in range(1, 101):
        model.observe("disk", size_mb * MB, 0.01 * size_mb)  # fast disk
    for size_mb in range(1, 101):
        model.observe("disk", size_mb * MB, 0.05 * size_mb)  # then 5x slower
    assert model.estimate("disk", 50 * MB) == pytest.approx(2.5, rel=0.1)


def test_ignores_nonsense_durations() -> None:
    model = LoadCostModel()
    model.observe("disk", MB, float("nan"))
    model.observe("disk", MB, -1.0)
    model.observe("disk", MB, float("inf"))
    assert model.observations("disk") == 0.0
    with pytest.raises(ValueError):
        LoadCostModel(half_life_loads=0)


def test_reload_cost_uses_the_models_own_loads_smoothed() -> None:
    model = LoadCostModel()
    assert model.reload_cost("never-loaded", 100 * MB) == model.estimate("repository", 100 * MB)
    model.observe("disk", 100 * MB, 8.0, model_id="heavy-pickle")
    assert model.reload_cost("heavy-pickle", 100 * MB) == 8.0
    model.observe("disk", 100 * MB, 4.0, model_id="heavy-pickle")
    assert model.reload_cost("heavy-pickle", 100 * MB) == 6.0  # halfway, not jumping
    model.observe("host", 100 * MB, 0.01, model_id="heavy-pickle")  # a promotion
    assert model.reload_cost("heavy-pickle", 100 * MB) == 6.0
