"""A small fleet scenario with bursts and two memory tiers, for the tests that check the
simulator's incremental bookkeeping against what it stands for after every step."""

from __future__ import annotations

from modelfleet.sim.scenario import ScenarioConfig

SMALL = ScenarioConfig(models=80, workers=5, duration_s=60.0, warmup_s=10.0, rate=20.0,
                       bursts_per_min=3.0, burst_rate=15.0, burst_s=4.0, device_gib=2.0,
                       host_gib=2.0, size_median_mb=150.0, size_max_mb=1_500.0,
                       sample_s=5.0, seed=5)
