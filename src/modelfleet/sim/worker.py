"""One simulated worker: a real ``ModelCache``, permits, a loader, and its bookkeeping.

The worker is plain state; :mod:`modelfleet.sim.engine` moves it through time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from modelfleet.cache import GdsfPolicy, LruPolicy, ModelCache

# A task is (request index, model index, arrival time).
Task = tuple[int, int, float]


@dataclass(eq=False, slots=True)
class SimWorker:
    """State of one worker. ``in_flight`` tasks hold permits (at most ``permits``)."""

    index: int
    name: str
    cache: ModelCache
    permits: int
    loaders: int
    in_flight: int = 0
    local: deque[Task] = field(default_factory=deque)  # push routers: accepted, not started
    load_queue: deque[int] = field(default_factory=deque)  # models waiting for a loader
    loads_running: int = 0
    loading: dict[int, list[Task]] = field(default_factory=dict)  # model -> tasks waiting
    promoting: dict[int, list[Task]] = field(default_factory=dict)
    # Busy-time accounting: anything running (an inference, a load, a promotion).
    active: int = 0
    busy_since: float = 0.0
    busy_s: float = 0.0
    # Pull-affinity state (unused by push routers).
    subscriptions: frozenset[str] = frozenset()
    last_served: dict[str, float] = field(default_factory=dict)
    recent_cold: deque[float] = field(default_factory=deque)
    scores: dict[str, float] = field(default_factory=dict)

    @property
    def free_permits(self) -> int:
        return self.permits - self.in_flight

    @property
    def loader_free(self) -> bool:
        return self.loads_running + len(self.load_queue) < self.loaders

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


def lru_device_only(device_budget_bytes: int) -> CacheFactory:
    """What people run today: device memory only, least recently used goes first."""
    def build(clock: Callable[[], float]) -> ModelCache:
        return ModelCache(device_budget_bytes, 0, LruPolicy(), clock=clock)
    return build


def gdsf_with_host(device_budget_bytes: int, host_budget_bytes: int) -> CacheFactory:
    """modelfleet's default: size- and cost-aware eviction, demoting to host memory."""
    def build(clock: Callable[[], float]) -> ModelCache:
        return ModelCache(device_budget_bytes, host_budget_bytes, GdsfPolicy(),
                          host_policy=GdsfPolicy(), clock=clock)
    return build
