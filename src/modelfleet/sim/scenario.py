"""The scenario: a model catalog and a workload, both drawn from one seed.

Every router is run on the same catalog and the same workload, so their numbers
differ only by the routing (and the cache policy that goes with it).

- Catalog ``lognormal`` (the fleet default): ``models`` models with log-normal
  sizes (most are small fine-tunes, a few are foundation-sized) and log-normal
  inference times that grow with size; a fan-out of ``fanout_max_workers`` each
  (the model.toml default) and a plan drawn from a free/pro/enterprise mix.
- Catalog ``peers``: bench/peers' generated catalog, byte for byte the same sizes
  (two-layer MLPs 64 -> H -> 10, artifact sizes log-uniform in 1-40 MiB from the
  bench's seed); load and predict times from bytes (see ``PEERS``).
- Open-loop workload (``clients`` = 0): Poisson arrivals at ``rate`` requests per
  second, the model of each drawn from a Zipf law over popularity ranks; at the
  middle of the run the ranks are permuted (yesterday's head becomes a random part
  of the tail). On top, bursts: at Poisson times a uniformly chosen model (so
  usually a tail model) receives ``burst_rate`` requests per second for a while.
- Closed-loop workload (``clients`` > 0): that many clients, each sending its next
  request the moment the answer to its previous one arrives, the model drawn by
  Zipf ``zipf`` per client from a fixed seed (the same sampler and seeds as
  bench/peers' load generator), until ``duration_s``.
"""

from __future__ import annotations

import bisect
import io
import itertools
import math
import random
import zlib
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from modelfleet.cache import POLICIES

MB = 1_000_000
MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class BrokerCosts:
    """What the control loop pays the broker, measured on this project's brokers."""

    count_s: float  # one queue's exact counts (a passive declare on RabbitMQ)
    subscribe_s: float  # a new consumer (basic.qos + basic.consume on RabbitMQ)
    announce_s: float  # a demand event from a gateway's publish to a worker's listener


# Measured on the bench machine through the project's own brokers (bench/sim_vs_measured.py
# --measure-costs): RabbitMQ on loopback (aio-pika, round 1's VM), the embedded broker
# in-process (round 14's VM; only the peers scenarios use it).
BROKERS: dict[str, BrokerCosts] = {
    "rabbitmq": BrokerCosts(count_s=0.00036, subscribe_s=0.0031, announce_s=0.0012),
    "embedded": BrokerCosts(count_s=0.0000006, subscribe_s=0.0000035, announce_s=0.000013),
}


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
    catalog: str = "lognormal"  # "lognormal" | "peers" (bench/peers' generated MLPs)
    size_median_mb: float = 300.0
    size_sigma: float = 1.0
    size_min_mb: float = 20.0
    size_max_mb: float = 8_000.0
    infer_median_ms: float = 30.0
    infer_sigma: float = 0.5
    device_gib: float = 8.0  # per runtime
    device_fraction: float = 0.0  # > 0: device budget per runtime = this share of the catalog
    host_gib: float = 8.0  # per runtime
    load_fixed_s: float = 2.0
    load_mb_per_s: float = 150.0  # registry fetch + deserialisation
    pcie_gb_per_s: float = 12.0  # host -> device copy (a promotion)
    permits: int = 8  # concurrent tasks per worker (inference slots)
    loaders: int = 2  # concurrent model loads per runtime (RuntimeSettings.max_concurrent_loads)
    runtimes_per_worker: int = 1  # shared runtimes; a model runs on crc32(id) % this
    batch_size: int = 0  # 0: tasks of one model run side by side; n: one batch of <= n at once
    deadline_s: float = 30.0
    fanout_max_workers: int = 2
    pinned: int = 0  # the most popular models, preloaded on every worker, never evicted
    clients: int = 0  # > 0: closed-loop clients instead of the Poisson trace
    only_model: int = -1  # >= 0: every request is for this popularity rank (a warm test)
    # The machine: CPUs per worker shared by the threads that do the per-task work, the
    # predicts, the loads and the decisions (modelfleet.sim.cpu).
    cores: float = 0.0  # 0: not modelled (every activity takes its nominal time)
    client_cpu_s: float = 0.0  # CPU per request of the client (the load generator's loop)
    serve_cpu_s: float = 0.0  # ... of the gateway + broker + coordinator loop, per task
    runtime_cpu_s: float = 0.0  # ... of the runtime's loop per task, outside the predict
    task_overhead_s: float = 0.002  # latency per task outside the model that is not CPU
    gc_s: float = 0.0186  # one full gc.collect() in a runtime (what an eviction may run)
    gc_interval_s: float = 1.0  # a runtime collects at most this often (0: every eviction)
    load_holds_gil: bool = False  # a load's CPU competes with its runtime's loop (one GIL)
    loop_threads: bool = True  # an event loop is one thread (False: every job its own)
    predict_fixed_s: float = 0.0  # peers catalog: predict = fixed + MB * (a + rows * b)
    predict_s_per_mb: float = 0.0
    predict_row_s_per_mb: float = 0.0
    artifact_min_bytes: int = 1 << 20  # peers catalog: artifact sizes log-uniform in these
    artifact_max_bytes: int = 40 << 20
    # The control loop (pull-affinity): what the coordinator and the gateways wait for.
    broker: str = "rabbitmq"  # "rabbitmq" | "embedded": the costs in BROKERS
    rescore_s: float = 1.0  # periodic re-score, each tick x uniform(0.75, 1.25)
    rescore_jitter_s: float = 0.01  # pause before a re-score woken by an event
    event_rescores: bool = True  # woken by announcements and task ends (False: ticks only)
    recount_held_backlog: bool = True  # woken re-scores recount held queues seen with backlog
    recount_on_wake: bool = False  # an ablation: woken re-scores count every candidate too
    # An ablation: an announcement of a queue last counted at its fan-out cap wakes the
    # worker and is counted afresh (the coordinator's event listener skips it).
    wake_at_cap: bool = False
    announce_interval_s: float = 0.25  # demand announced at once, then at most this often
    # The cold lane (modelfleet.sim.lane; gateway.cold_lane_per_model): requests of a model
    # no worker pulls go to a lane every worker takes from with a free permit, at most this
    # many of one model at a time. 0: no lane (the fleet scenario's default, which was
    # calibrated and tabled before the lane existed and keeps its outputs).
    cold_lane_per_model: int = 0
    state_interval_s: float = 1.0  # a worker publishes its state (what it pulls) this often
    # One device budget per worker, moved between its runtimes (modelfleet.sim.pool;
    # worker/pool.py): False, a fixed budget per runtime (the fleet scenario's default).
    pooled_budget: bool = False
    # Which runtime of a worker runs a model (modelfleet.sim.placement): "spread", the
    # worker's own worker/spread.py (by load and free share, hot models replicated, a
    # replica kept replica_keep_s after it cools), or "hash", crc32(model id) % runtimes
    # for the run. The same with one runtime per worker.
    placement: str = "hash"
    # The runtimes' eviction policy under pull-affinity: runtime.eviction_policy, the
    # build's default (W-TinyLFU). The push routers keep their device-only LRU.
    eviction_policy: str = "tinylfu"
    replica_keep_s: float = 10.0  # worker.replica_keep_s
    demand_window_s: float = 60.0  # how long an announcement keeps a queue a candidate
    stats_s: float = 0.00016  # a runtime's stats round trip (CPU), per runtime per re-score
    residency_max_age_s: float = 0.02  # woken re-scores reuse residency this fresh (0: never)
    wake_on_held_backlog: bool = False  # also wake on a task's end for backlog in held queues
    decide_cpu_s: float = 0.0002  # coordinator CPU of one decision (snapshot + decide)
    decide_cpu_per_queue_s: float = 0.00001
    # CPU per catalog model per re-score: a loop whose cost grows with the catalog, as the
    # coordinator's did before issue 23 (pinned/loaded sets over every model). 0: none.
    rescore_cpu_per_model_s: float = 0.0
    sample_s: float = 10.0  # time-series resolution of the plot

    @property
    def total_rate(self) -> float:
        return self.rate if self.rate is not None else self.rate_per_worker * self.workers

    @property
    def device_budget_bytes(self) -> int:
        """Per runtime (``device_fraction`` is resolved against the catalog by the engine)."""
        return int(self.device_gib * GiB)

    @property
    def host_budget_bytes(self) -> int:
        return int(self.host_gib * GiB)

    @property
    def broker_costs(self) -> BrokerCosts:
        try:
            return BROKERS[self.broker]
        except KeyError:
            raise ValueError(f"unknown broker {self.broker!r}; "
                             f"choose from {', '.join(BROKERS)}") from None

    def check(self) -> None:
        """Refuse contradictory settings (ValueError)."""
        self.broker_costs  # noqa: B018 (raises for an unknown broker)
        if self.catalog not in CATALOGS:
            raise ValueError(f"unknown catalog {self.catalog!r}; choose from "
                             f"{', '.join(CATALOGS)}")
        if self.runtimes_per_worker < 1 or self.permits < 1 or self.loaders < 1:
            raise ValueError("runtimes_per_worker, permits and loaders must be >= 1")
        if self.clients < 0 or self.cores < 0 or self.batch_size < 0:
            raise ValueError("clients, cores and batch_size must be >= 0")
        if self.placement not in ("hash", "spread"):
            raise ValueError(f"unknown placement {self.placement!r}; choose hash or spread")
        if self.eviction_policy not in POLICIES:
            raise ValueError(f"unknown eviction_policy {self.eviction_policy!r}; choose from "
                             f"{', '.join(POLICIES)}")
        if self.only_model >= self.models:
            raise ValueError(f"only_model {self.only_model} is not a rank below {self.models}")


# -- bench/peers -------------------------------------------------------------------------

PEERS_SEED = 20240601  # bench/peers/catalog.py SEED
PEERS_MODELS = 50
PEERS_MIN_BYTES = 1 * MiB
PEERS_MAX_BYTES = 40 * MiB
MLP_IN, MLP_OUT = 64, 10
PACKAGE_EXTRA_BYTES = 5_000  # handler.py + mlp.py + model.toml next to the artifact


def mlp_weight_bytes(hidden: int) -> int:
    """float32 bytes of a 64 -> hidden -> 10 MLP (bench/peers/mlp.py ``weight_bytes``)."""
    return 4 * (MLP_IN * hidden + hidden + hidden * MLP_OUT + MLP_OUT)


def _npz_overhead() -> int:
    """Bytes an uncompressed ``np.savez`` of the four weights adds to their data."""
    out = io.BytesIO()
    np.savez(out, W1=np.zeros((MLP_IN, 1), np.float32), b1=np.zeros(1, np.float32),
             W2=np.zeros((1, MLP_OUT), np.float32), b2=np.zeros(MLP_OUT, np.float32))
    return len(out.getvalue()) - mlp_weight_bytes(1)


def peers_artifact_bytes(n: int = PEERS_MODELS, seed: int = PEERS_SEED,
                         min_bytes: int = PEERS_MIN_BYTES,
                         max_bytes: int = PEERS_MAX_BYTES) -> list[int]:
    """The sizes of bench/peers' ``weights.npz`` files, in rank order (model-00 first).

    The same draw as ``bench/peers/catalog.py``: log-uniform targets, the hidden width
    whose weights come closest, then the bytes ``np.savez`` writes for them.
    """
    rng = np.random.default_rng(seed)
    logs = rng.uniform(math.log(min_bytes), math.log(max_bytes), size=n)
    per_unit = 4 * (MLP_IN + 1 + MLP_OUT)
    overhead = _npz_overhead()
    sizes = []
    for log_size in logs:
        target = int(math.exp(log_size))
        hidden = max(1, round((target - 4 * MLP_OUT) / per_unit))
        sizes.append(mlp_weight_bytes(hidden) + overhead)
    return sizes


# The bench/peers scenario: `modelfleet sim --scenario peers`. Every number is either the
# bench's setting or a measurement named in bench/README_sim.md ("Calibration, round 14"),
# taken on the VM the held rows were measured on; the per-task CPU and overhead come
# from the *warm* rows and a --probe of the build, never from the zipf row.
PEERS: dict[str, Any] = {
    "catalog": "peers",
    "models": PEERS_MODELS,
    "zipf": 1.0,
    "workers": 1,
    "runtimes_per_worker": 2,
    "permits": 16,
    "loaders": 2,
    "device_fraction": 0.16,
    "host_gib": 0.0,
    "batch_size": 16,
    "clients": 32,
    "warmup_s": 5.0,
    "duration_s": 50.0,
    "deadline_s": 30.0,
    "shift": False,
    "bursts_per_min": 0.0,
    "broker": "embedded",
    "fanout_max_workers": 2,
    "sample_s": 1.0,
    # The gateway's cold lane (gateway.cold_lane_per_model, its default) and the worker's
    # state period (worker.state_interval_s): the build's defaults.
    "cold_lane_per_model": 4,
    "state_interval_s": 1.0,
    # The worker's placement and its pooled budget (worker/spread.py, worker/pool.py):
    # the build's, on by default there.
    "placement": "spread",
    "pooled_budget": True,
    # A load in a real runtime process serving this catalog under this budget (handler
    # import, np.load, sizing, the unload it makes room with), CPU from the kernel's
    # accounting; a full gc there (gc.freeze() at start-up made it 2 ms); predicts of the
    # MLPs on one numpy thread (their fixed part fits below 0: none); a runtime's stats
    # round trip (bench/sim_vs_measured.py --measure-costs, round 14).
    "load_fixed_s": 0.0044,
    "load_mb_per_s": 1324.0,
    "gc_s": 0.0021,
    "predict_fixed_s": 0.0,
    "predict_s_per_mb": 0.0000477,
    "predict_row_s_per_mb": 0.0000081,
    "stats_s": 0.00014,
    # ``decide`` measures 1 us per queue (+ 7 us) here; round 1 added a quarter for the
    # views (8 -> 10 us per queue) and had 0.2 ms fixed on a VM 3.3x slower per CPU second.
    "decide_cpu_s": 0.00006,
    "decide_cpu_per_queue_s": 0.0000013,
    # CPU per warm request in each process: a --probe of this build at warm-c32 (the
    # kernel's per-thread accounting; the runtimes' summed, less the sim's predicts, the
    # gateway's less the sim's decisions: --calibrate). The machine: the VM's 2 CPUs,
    # otherwise idle while the bench ran (not fitted: --calibrate's warm-c32 bisection
    # finds no figure, since the real warm-c32 spreads its one model over both runtimes,
    # a replica the sim does not make). No per-task latency outside the CPU: the sim's
    # warm-c1 p50 (3.7 ms) is already above the bench's (2.9 ms).
    "client_cpu_s": 0.000223,
    "serve_cpu_s": 0.000871,
    "runtime_cpu_s": 0.001475,
    "cores": 2.0,
    "task_overhead_s": 0.0,
    # Much of a load runs Python (zipfile, the handler's import, sizing) under the
    # runtime's GIL: it competes with that runtime's loop, not beside it.
    "load_holds_gil": True,
}

# bench/peers at catalog scale (issue 23): 5,000 MLPs of 20 KB-1 MB, the rest as ``peers``.
PEERS_5000: dict[str, Any] = {
    **PEERS,
    "models": 5_000,
    "artifact_min_bytes": 20_000,
    "artifact_max_bytes": 1_000_000,
    # A full gc in a runtime holding what this budget holds (about 800 of these models,
    # 31,600 objects): 8.6 ms (bench/README_sim.md, "Calibration, round 14").
    "gc_s": 0.0086,
}

SCENARIOS: dict[str, dict[str, Any]] = {"fleet": {}, "peers": PEERS, "peers-5000": PEERS_5000}
"""Named presets for ``--scenario``: field values on top of ``ScenarioConfig``'s defaults."""


def scenario(name: str, **overrides: Any) -> ScenarioConfig:
    """A preset (``SCENARIOS``) with ``overrides`` on top."""
    try:
        preset = SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; choose from "
                         f"{', '.join(SCENARIOS)}") from None
    known = {f.name for f in fields(ScenarioConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"unknown scenario field(s): {', '.join(sorted(unknown))}")
    return replace(ScenarioConfig(), **{**preset, **overrides})


# -- the catalog ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Catalog:
    """The models, indexed 0..n-1 in popularity rank. ``names[i]`` is the model id the
    cache and scoring see."""

    names: tuple[str, ...]
    size_bytes: tuple[int, ...]  # what a load reserves (the manifest's estimate)
    measured_bytes: tuple[int, ...]  # what the cache commits once loaded
    infer_s: tuple[float, ...]  # one input alone
    infer_row_s: tuple[float, ...]  # each further input of a batch
    load_s: tuple[float, ...]  # a full load from the registry
    promote_s: tuple[float, ...]  # a copy from host memory to the device
    fanout_max_workers: tuple[int, ...]
    plans: tuple[str, ...]
    pinned: frozenset[int]
    runtime: tuple[int, ...]  # which of a worker's runtimes runs it (crc32 of the id)

    @property
    def total_bytes(self) -> int:
        return sum(self.size_bytes)


def runtime_index(model_id: str, runtimes: int) -> int:
    """``RuntimeSupervisor.runtime_for``: a stable choice per model among the shared runtimes."""
    return zlib.crc32(model_id.encode()) % runtimes


def build_catalog(config: ScenarioConfig) -> Catalog:
    config.check()
    return CATALOGS[config.catalog](config)


def _lognormal_catalog(config: ScenarioConfig) -> Catalog:
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
    names = tuple(f"m{i:0{width}d}" for i in range(n))
    sizes = tuple(int(s) for s in size_bytes)
    return Catalog(
        names=names,
        size_bytes=sizes,
        measured_bytes=sizes,
        infer_s=tuple(float(x) for x in infer),
        infer_row_s=(0.0,) * n,
        load_s=tuple(float(x) for x in load_s),
        promote_s=tuple(float(x) for x in promote_s),
        fanout_max_workers=(config.fanout_max_workers,) * n,
        plans=tuple(str(p) for p in plans),
        pinned=frozenset(range(min(config.pinned, n))),  # rank order = index order at start
        runtime=tuple(runtime_index(name, config.runtimes_per_worker) for name in names),
    )


def _peers_catalog(config: ScenarioConfig) -> Catalog:
    """bench/peers' catalog: ``model-NN`` by rank, the bench's artifact sizes."""
    sizes = peers_artifact_bytes(config.models, PEERS_SEED, config.artifact_min_bytes,
                                 config.artifact_max_bytes)
    width = max(2, len(str(config.models - 1)))
    names = tuple(f"model-{rank:0{width}d}" for rank in range(config.models))
    mb = [s / MB for s in sizes]
    n = config.models
    return Catalog(
        names=names,
        size_bytes=tuple(sizes),
        measured_bytes=tuple(s + PACKAGE_EXTRA_BYTES for s in sizes),
        infer_s=tuple(config.predict_fixed_s + m * (config.predict_s_per_mb
                                                    + config.predict_row_s_per_mb)
                      for m in mb),
        infer_row_s=tuple(m * config.predict_row_s_per_mb for m in mb),
        load_s=tuple(config.load_fixed_s + m / config.load_mb_per_s for m in mb),
        promote_s=tuple(m / (config.pcie_gb_per_s * 1000.0) for m in mb),
        fanout_max_workers=(config.fanout_max_workers,) * n,
        plans=("free",) * n,
        pinned=frozenset(range(min(config.pinned, n))),
        runtime=tuple(runtime_index(name, config.runtimes_per_worker) for name in names),
    )


CATALOGS = {"lognormal": _lognormal_catalog, "peers": _peers_catalog}


def device_budget_bytes(config: ScenarioConfig, catalog: Catalog) -> int:
    """Device memory per runtime: a share of the catalog, or ``device_gib``."""
    if config.device_fraction > 0:
        return int(catalog.total_bytes * config.device_fraction)
    return config.device_budget_bytes


# -- the workload --------------------------------------------------------------------------


def zipf_weights(n: int, exponent: float) -> np.ndarray:
    ranks = np.arange(1, n + 1, dtype=np.float64)
    weights: np.ndarray = ranks ** (-exponent)
    normalised: np.ndarray = weights / weights.sum()
    return normalised


@dataclass(frozen=True, slots=True)
class Trace:
    """Requests in arrival order: ``times[i]`` seconds, for model ``models[i]``.

    Empty for a closed-loop workload: its arrivals depend on the answers."""

    times: list[float]
    models: list[int]

    def __len__(self) -> int:
        return len(self.times)


def build_trace(config: ScenarioConfig) -> Trace:
    if config.clients > 0:
        return Trace([], [])
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
        chosen = (np.full(count, config.only_model) if config.only_model >= 0
                  else rng.choice(n, size=count, p=weights))
        model_parts.append(mapping[chosen])
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


class ZipfSampler:
    """Ranks 0..n-1 with P(k) proportional to 1 / (k + 1) ** s: the same sampler and the
    same stream as bench/peers' load generator (``stats.Zipf``) for the same seed."""

    def __init__(self, n: int, s: float, seed: int) -> None:
        weights = [1.0 / (k + 1) ** s for k in range(n)]
        total = sum(weights)
        self._cdf = list(itertools.accumulate(w / total for w in weights))
        self._cdf[-1] = 1.0
        self._rng = random.Random(seed)

    def __call__(self) -> int:
        return bisect.bisect_right(self._cdf, self._rng.random())


def client_samplers(config: ScenarioConfig) -> list[ZipfSampler | None]:
    """One model sampler per closed-loop client (None: ``only_model``), seeded as the
    bench's load generator seeds its clients (``seed * 1000 + index``)."""
    if config.only_model >= 0:
        return [None] * config.clients
    return [ZipfSampler(config.models, config.zipf, config.seed * 1000 + i)
            for i in range(config.clients)]
