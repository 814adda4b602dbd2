"""One simulated worker: permits, runtimes (each a real ``ModelCache`` with its own
loaders and batchers), a machine's CPUs, and its bookkeeping.

The worker is plain state; :mod:`modelfleet.sim.engine` moves it through time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from modelfleet.cache import POLICIES, LruPolicy, ModelCache
from modelfleet.sim.cpu import Machine

# A task is (request index, model index, arrival time).
Task = tuple[int, int, float]


@dataclass(eq=False, slots=True)
class Batcher:
    """``modelfleet.model.pipeline.Batcher`` for one model on one runtime: one predict
    at a time over at most ``batch_size`` inputs, the next batch formed from whatever
    waited meanwhile (``max_delay_ms`` = 0)."""

    waiting: deque[Task] = field(default_factory=deque)
    running: bool = False


@dataclass(eq=False, slots=True)
class SimRuntime:
    """One runtime process of a worker: its cache, its load slots, its batchers."""

    index: int
    name: str
    cache: ModelCache
    loaders: int
    load_queue: deque[int] = field(default_factory=deque)  # models waiting for a load slot
    loads_running: int = 0
    loading: dict[int, list[Task]] = field(default_factory=dict)  # model -> tasks waiting
    load_started: dict[int, float] = field(default_factory=dict)  # model -> when its load began
    promoting: dict[int, list[Task]] = field(default_factory=dict)
    batchers: dict[int, Batcher] = field(default_factory=dict)
    collected_at: float = -1e9  # the last full gc this runtime ran
    # Bumped by every reserve and commit on its cache (the only calls that move models
    # between tiers): equal stamps, the same models resident (PullAffinity._refresh).
    cache_changes: int = 0

    @property
    def loader_free(self) -> bool:
        return self.loads_running + len(self.load_queue) < self.loaders


@dataclass(eq=False, slots=True)
class SimWorker:
    """State of one worker. ``in_flight`` tasks hold permits (at most ``permits``)."""

    index: int
    name: str
    runtimes: list[SimRuntime]
    permits: int
    machine: Machine | None = None  # None: CPU not modelled
    in_flight: int = 0
    running: dict[int, int] = field(default_factory=dict)  # model -> tasks holding permits
    local: deque[Task] = field(default_factory=deque)  # push routers: accepted, not started
    # Busy-time accounting: anything running (an inference, a load, a promotion).
    active: int = 0
    busy_since: float = 0.0
    busy_s: float = 0.0
    # Pull-affinity state (unused by push routers).
    subscriptions: frozenset[str] = frozenset()
    last_served: dict[str, float] = field(default_factory=dict)
    served: int = 0  # tasks finished (last_served changes in place: this says it did)
    recent_cold: deque[float] = field(default_factory=deque)

    @property
    def cache(self) -> ModelCache:
        """The first runtime's cache (the only one unless ``runtimes_per_worker`` > 1)."""
        return self.runtimes[0].cache

    @property
    def free_permits(self) -> int:
        return self.permits - self.in_flight

    @property
    def loading(self) -> dict[int, list[Task]]:
        """Models being loaded on any runtime (or waiting for a load slot)."""
        if len(self.runtimes) == 1:
            return self.runtimes[0].loading
        merged: dict[int, list[Task]] = {}
        for runtime in self.runtimes:
            merged.update(runtime.loading)
        return merged

    def mark_busy(self, now: float, delta: int) -> None:
        if self.active == 0 and delta > 0:
            self.busy_since = now
        self.active += delta
        if self.active == 0:
            self.busy_s += now - self.busy_since

    def busy_until(self, now: float) -> float:
        """Busy seconds so far, counting a busy stretch still open at ``now``."""
        return self.busy_s + (now - self.busy_since if self.active else 0.0)


CacheFactory = Callable[[Callable[[], float]], ModelCache]
CacheFactoryFor = Callable[[int, int], CacheFactory]
"""Given (device budget, host budget) per runtime, a factory of caches."""


def lru_device_only(device_budget_bytes: int) -> CacheFactory:
    """What people run today: device memory only, least recently used goes first."""
    def build(clock: Callable[[], float]) -> ModelCache:
        return ModelCache(device_budget_bytes, 0, LruPolicy(), clock=clock)
    return build


def with_host(policy: str, device_budget_bytes: int, host_budget_bytes: int) -> CacheFactory:
    """A modelfleet runtime's cache: the eviction ``policy`` the runtime is set to
    (``runtime.eviction_policy``, a name in ``modelfleet.cache.POLICIES``) on both tiers,
    demoting to host memory, as ``ModelHost`` builds it."""
    make = POLICIES.get(policy)
    if make is None:
        raise ValueError(f"unknown eviction policy {policy!r}; choose from {', '.join(POLICIES)}")

    def build(clock: Callable[[], float]) -> ModelCache:
        return ModelCache(device_budget_bytes, host_budget_bytes, make(), host_policy=make(),
                          clock=clock)
    return build
