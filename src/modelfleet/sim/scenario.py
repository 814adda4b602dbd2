"""The scenario: a model catalog and a request trace, both drawn from one seed.

Every router is run on the same catalog and the same trace, so their numbers
differ only by the routing (and the cache policy that goes with it).

- Catalog: ``models`` models with log-normal sizes (most are small fine-tunes,
  a few are foundation-sized) and log-normal inference times that grow with
  size; a fan-out of ``fanout_max_workers`` each (the model.toml default) and
  a plan drawn from a free/pro/enterprise mix.
- Trace: Poisson arrivals at ``rate`` requests per second, the model of each
  drawn from a Zipf law over popularity ranks; at the middle of the run the
  ranks are permuted (yesterday's head becomes a random part of the tail).
  On top, bursts: at Poisson times a uniformly chosen model (so usually a
  tail model) receives ``burst_rate`` requests per second for a while.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MB = 1_000_000
GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class ScenarioConfig:
    """Everything that shapes the workload and the fleet; every field is a CLI option."""

    models: int = 2_000
    zipf: float = 1.0
    workers: int = 40
    duration_s: float = 600.0
    warmup_s: float = 120.0  # caches start empty: the first minutes are not counted
    seed: int = 1
    rate: float | None = None  # requests per second; None: rate_per_worker * workers
    rate_per_worker: float = 2.0
    shift: bool = True  # permute the popularity ranks at the middle of the run
    bursts_per_min: float = 2.0
    burst_rate: float = 20.0  # requests per second to the burst's model
    burst_s: float = 10.0
    size_median_mb: float = 300.0
    size_sigma: float = 1.0
    size_min_mb: float = 20.0
    size_max_mb: float = 8_000.0
    infer_median_ms: float = 30.0
    infer_sigma: float = 0.5
    device_gib: float = 8.0
    host_gib: float = 8.0
    load_fixed_s: float = 2.0
    load_mb_per_s: float = 150.0  # registry fetch + deserialisation
    pcie_gb_per_s: float = 12.0  # host -> device copy (a promotion)
    permits: int = 8  # concurrent tasks per worker (inference slots)
    loaders: int = 2  # concurrent model loads per worker (RuntimeSettings.max_concurrent_loads)
    deadline_s: float = 30.0
    fanout_max_workers: int = 2
    pinned: int = 0  # the most popular models, preloaded on every worker, never evicted
    rescore_s: float = 1.0  # pull-affinity: how often each worker re-scores its queues
    sample_s: float = 10.0  # time-series resolution of the plot

    @property
    def total_rate(self) -> float:
        return self.rate if self.rate is not None else self.rate_per_worker * self.workers

    @property
    def device_budget_bytes(self) -> int:
        return int(self.device_gib * GiB)

    @property
    def host_budget_bytes(self) -> int:
        return int(self.host_gib * GiB)


@dataclass(frozen=True, slots=True)
class Catalog:
    """The models, indexed 0..n-1. ``names[i]`` is the model id the cache and scoring see."""

    names: tuple[str, ...]
    size_bytes: tuple[int, ...]
    infer_s: tuple[float, ...]
    load_s: tuple[float, ...]  # a full load from the registry
    promote_s: tuple[float, ...]  # a copy from host memory to the device
    fanout_max_workers: tuple[int, ...]
    plans: tuple[str, ...]
    pinned: frozenset[int]


@dataclass(frozen=True, slots=True)
class Trace:
    """Requests in arrival order: ``times[i]`` seconds, for model ``models[i]``."""

    times: list[float]
    models: list[int]

    def __len__(self) -> int:
        return len(self.times)


def build_catalog(config: ScenarioConfig) -> Catalog:
    rng = np.random.default_rng([config.seed, 1])
    n = config.models
    sizes_mb = np.clip(rng.lognormal(np.log(config.size_median_mb), config.size_sigma, n),
                       config.size_min_mb, min(config.size_max_mb, config.device_gib * GiB / MB))
    # Bigger models take longer to run, with plenty of spread around that trend.
    infer = (config.infer_median_ms / 1000.0
             * np.sqrt(sizes_mb / config.size_median_mb)
             * rng.lognormal(0.0, config.infer_sigma, n))
    size_bytes = (sizes_mb * MB).astype(np.int64)
    load_s = config.load_fixed_s + sizes_mb / config.load_mb_per_s
    promote_s = sizes_mb / (config.pcie_gb_per_s * 1000.0)
    plans = rng.choice(np.array(["free", "pro", "enterprise"]), size=n, p=[0.7, 0.2, 0.1])
    width = len(str(n - 1))
    return Catalog(
        names=tuple(f"m{i:0{width}d}" for i in range(n)),
        size_bytes=tuple(int(s) for s in size_bytes),
        infer_s=tuple(float(x) for x in infer),
        load_s=tuple(float(x) for x in load_s),
        promote_s=tuple(float(x) for x in promote_s),
        fanout_max_workers=(config.fanout_max_workers,) * n,
        plans=tuple(str(p) for p in plans),
        pinned=frozenset(range(min(config.pinned, n))),  # rank order = index order at start
    )


def zipf_weights(n: int, exponent: float) -> np.ndarray:
    ranks = np.arange(1, n + 1, dtype=np.float64)
    weights: np.ndarray = ranks ** (-exponent)
    normalised: np.ndarray = weights / weights.sum()
    return normalised


def build_trace(config: ScenarioConfig) -> Trace:
    rng = np.random.default_rng([config.seed, 2])
    n, duration = config.models, config.duration_s
    weights = zipf_weights(n, config.zipf)
    half = duration / 2 if config.shift else duration
    # Phase 1: model i has popularity rank i. Phase 2: ranks permuted, except
    # that pinned models keep theirs (pinning is a bet on a stable head).
    perm = np.arange(n)
    if config.shift:
        fixed = min(config.pinned, n)
        perm = np.concatenate([np.arange(fixed), fixed + rng.permutation(n - fixed)])
    times_parts: list[np.ndarray] = []
    model_parts: list[np.ndarray] = []
    for start, end, mapping in ((0.0, half, np.arange(n)), (half, duration, perm)):
        if end <= start:
            continue
        count = rng.poisson(config.total_rate * (end - start))
        times_parts.append(rng.uniform(start, end, count))
        model_parts.append(mapping[rng.choice(n, size=count, p=weights)])
    bursts = rng.poisson(config.bursts_per_min * duration / 60.0)
    for _ in range(bursts):
        start = float(rng.uniform(0.0, duration))
        length = min(config.burst_s, duration - start)
        count = rng.poisson(config.burst_rate * length)
        times_parts.append(rng.uniform(start, start + length, count))
        model_parts.append(np.full(count, int(rng.integers(0, n))))
    times = np.concatenate(times_parts) if times_parts else np.zeros(0)
    models = np.concatenate(model_parts) if model_parts else np.zeros(0, dtype=np.int64)
    order = np.argsort(times, kind="stable")
    return Trace(times=times[order].tolist(), models=models[order].astype(int).tolist())
