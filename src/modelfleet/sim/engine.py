"""The discrete-event engine: one heap of events, workers that load and infer, a router.

What a worker does with a task is the same under every router:

- it holds one permit from start to finish (at most ``permits`` at once);
- a model on the device runs at once (a cache hit);
- a model in host memory is promoted first (a PCIe copy; no loader needed);
- any other model waits for a loader (``loaders`` per worker, FIFO); every
  task for a model already loading waits on that same load;
- a task whose deadline has passed is dropped when it would start or when its
  load finishes, and counts as a timeout (latency = the deadline).

The caches are real ``modelfleet.cache.ModelCache`` objects on the
simulation's virtual clock; evictions they return are carried out instantly
(freeing memory is milliseconds next to a load).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from modelfleet.errors import NoCapacity
from modelfleet.sim.scenario import Catalog, ScenarioConfig, Trace
from modelfleet.sim.worker import CacheFactory, SimWorker, Task

INFER_DONE, LOAD_DONE, PROMOTE_DONE, TICK, SAMPLE, RETRY, OPEN, CLOSE = range(8)
RETRY_S = 0.5  # how long a task waits before retrying after NoCapacity

Event = tuple[float, int, int, "SimWorker | None", object]


class Router(Protocol):
    """How tasks reach workers. Push routers pick a worker on arrival; pull lets workers pick."""

    name: str

    def cache_factory(self, config: ScenarioConfig) -> CacheFactory: ...

    def attach(self, sim: Simulation) -> None:
        """Called once, after the workers exist and before the first arrival."""

    def on_arrival(self, task: Task) -> None: ...

    def on_free(self, worker: SimWorker) -> None:
        """``worker`` gained a free permit or loader: give it work if there is some."""

    def on_tick(self, worker: SimWorker) -> None:
        """A ``TICK`` event the router scheduled for ``worker`` fired."""


@dataclass(frozen=True, slots=True)
class SimResult:
    """Raw outcome of one router on one trace; ``modelfleet.sim.report`` summarises it."""

    router: str
    warmup_s: float  # requests, loads and busy time before this are not counted
    duration_s: float
    deadline_s: float
    latency_s: list[float]  # of the requests that arrived after warmup_s
    hits: int
    timeouts: int
    load_times: list[float]  # when each full load finished (all of them)
    promotions: int
    busy_fraction: float
    sample_times: list[float]
    resident_models: list[int]  # device-resident models, fleet-wide, at sample_times


class Simulation:
    def __init__(self, config: ScenarioConfig, catalog: Catalog, trace: Trace, router: Router,
                 progress: Callable[[int], None] | None = None) -> None:
        self.config = config
        self.catalog = catalog
        self.trace = trace
        self.router = router
        self.now = 0.0
        self.index_of = {name: i for i, name in enumerate(catalog.names)}
        self._heap: list[Event] = []
        self._seq = itertools.count()
        self._progress = progress
        factory = router.cache_factory(config)
        self.workers = [
            SimWorker(i, f"w{i:04d}", factory(self.clock), config.permits, config.loaders)
            for i in range(config.workers)
        ]
        self._preload_pinned()
        self.latency: list[float] = [math.nan] * len(trace)
        self.hit = bytearray(len(trace))
        self.timed_out = bytearray(len(trace))
        self.promotion_times: list[float] = []
        self.load_times: list[float] = []
        self.sample_times: list[float] = []
        self.resident: list[int] = []
        self._busy_at_open = 0.0
        self._busy_fraction = 0.0

    def clock(self) -> float:
        return self.now

    def schedule(self, at: float, kind: int, worker: SimWorker | None, payload: object) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), kind, worker, payload))

    # --- the run ---------------------------------------------------------------------

    def run(self) -> SimResult:
        cfg = self.config
        horizon = cfg.duration_s + cfg.deadline_s  # let the last requests finish or time out
        self.router.attach(self)
        self.schedule(0.0, SAMPLE, None, None)
        self.schedule(min(cfg.warmup_s, cfg.duration_s), OPEN, None, None)
        self.schedule(cfg.duration_s, CLOSE, None, None)
        times, models = self.trace.times, self.trace.models
        count, i = len(times), 0
        heap = self._heap
        while True:
            arrival = times[i] if i < count else math.inf
            if heap and heap[0][0] <= arrival:
                at, _, kind, worker, payload = heapq.heappop(heap)
                if at > horizon:
                    break
                self.now = at
                self._dispatch(kind, worker, payload)
            elif i < count:
                self.now = arrival
                self.router.on_arrival((i, models[i], arrival))
                i += 1
                if self._progress is not None and i % 1000 == 0:
                    self._progress(1000)
            else:
                break
        if self._progress is not None:
            self._progress(count % 1000)
        return self._result()

    def _dispatch(self, kind: int, worker: SimWorker | None, payload: object) -> None:
        if kind == INFER_DONE:
            assert worker is not None
            self._inference_done(worker, payload)  # type: ignore[arg-type]
        elif kind == LOAD_DONE:
            assert worker is not None
            self._load_done(worker, payload)  # type: ignore[arg-type]
        elif kind == PROMOTE_DONE:
            assert worker is not None
            self._promote_done(worker, payload)  # type: ignore[arg-type]
        elif kind == TICK:
            assert worker is not None
            self.router.on_tick(worker)
        elif kind == RETRY:
            assert worker is not None
            self._retry(worker, payload)
        elif kind == SAMPLE:
            self._sample()
        elif kind == OPEN:
            self._busy_at_open = sum(w.busy_until(self.now) for w in self.workers)
        elif kind == CLOSE:
            span = len(self.workers) * (self.now - min(self.config.warmup_s, self.now))
            busy = sum(w.busy_until(self.now) for w in self.workers) - self._busy_at_open
            self._busy_fraction = busy / span if span > 0 else 0.0

    # --- what a worker does with a task ---------------------------------------------

    def expired(self, task: Task) -> bool:
        return self.now - task[2] >= self.config.deadline_s

    def time_out(self, task: Task) -> None:
        """A task dropped at its deadline: the caller got a timeout after deadline_s."""
        self.latency[task[0]] = self.config.deadline_s
        self.timed_out[task[0]] = 1

    def start(self, worker: SimWorker, task: Task) -> None:
        """Start ``task`` on ``worker``, which must have a free permit."""
        worker.in_flight += 1
        if self.expired(task):
            worker.in_flight -= 1
            self.time_out(task)
            return
        model = task[1]
        name = self.catalog.names[model]
        tier = worker.cache.hit(name)
        if tier == "device":
            self.hit[task[0]] = 1
            self._infer(worker, task)
            return
        if tier == "host":
            waiting = worker.promoting.get(model)
            if waiting is not None:
                waiting.append(task)
                return
            try:
                worker.cache.reserve(name, self.catalog.size_bytes[model])
            except NoCapacity:
                self.schedule(self.now + RETRY_S, RETRY, worker, task)
                return
            worker.promoting[model] = [task]
            worker.mark_busy(self.now, +1)
            self.schedule(self.now + self.catalog.promote_s[model], PROMOTE_DONE, worker, model)
            return
        waiting = worker.loading.get(model)
        if waiting is not None:
            waiting.append(task)
            return
        worker.loading[model] = [task]
        worker.load_queue.append(model)
        self._kick_loader(worker)

    def _retry(self, worker: SimWorker, payload: object) -> None:
        if payload is None:  # the loader retries its head-of-line model
            self._kick_loader(worker)
            return
        worker.in_flight -= 1
        self.start(worker, payload)  # type: ignore[arg-type]

    def _kick_loader(self, worker: SimWorker) -> None:
        while worker.loads_running < worker.loaders and worker.load_queue:
            model = worker.load_queue[0]
            try:
                worker.cache.reserve(self.catalog.names[model], self.catalog.size_bytes[model])
            except NoCapacity:
                self.schedule(self.now + RETRY_S, RETRY, worker, None)
                return
            worker.load_queue.popleft()
            worker.loads_running += 1
            worker.mark_busy(self.now, +1)
            self.schedule(self.now + self.catalog.load_s[model], LOAD_DONE, worker, model)

    def _infer(self, worker: SimWorker, task: Task) -> None:
        worker.mark_busy(self.now, +1)
        self.schedule(self.now + self.catalog.infer_s[task[1]], INFER_DONE, worker, task)

    def _ready(self, worker: SimWorker, tasks: list[Task]) -> None:
        for task in tasks:
            if self.expired(task):
                worker.in_flight -= 1
                self.time_out(task)
            else:
                self._infer(worker, task)

    def _inference_done(self, worker: SimWorker, task: Task) -> None:
        worker.mark_busy(self.now, -1)
        worker.in_flight -= 1
        if self.expired(task):  # finished, but the gateway answered the caller at the deadline
            self.time_out(task)
        else:
            self.latency[task[0]] = self.now - task[2]
        worker.last_served[self.catalog.names[task[1]]] = self.now
        self.router.on_free(worker)

    def _load_done(self, worker: SimWorker, model: int) -> None:
        cat = self.catalog
        worker.loads_running -= 1
        worker.mark_busy(self.now, -1)
        worker.cache.commit(cat.names[model], cat.size_bytes[model], cat.load_s[model],
                            "repository")
        self.load_times.append(self.now)
        self._ready(worker, worker.loading.pop(model))
        self._kick_loader(worker)
        self.router.on_free(worker)

    def _promote_done(self, worker: SimWorker, model: int) -> None:
        cat = self.catalog
        worker.mark_busy(self.now, -1)
        worker.cache.commit(cat.names[model], cat.size_bytes[model], cat.promote_s[model], "host")
        self.promotion_times.append(self.now)
        self._ready(worker, worker.promoting.pop(model))
        self.router.on_free(worker)

    # --- bookkeeping -------------------------------------------------------------------

    def _preload_pinned(self) -> None:
        cat = self.catalog
        for worker in self.workers:
            for model in sorted(cat.pinned):
                name = cat.names[model]
                worker.cache.reserve(name, cat.size_bytes[model], pinned=True)
                worker.cache.commit(name, cat.size_bytes[model], cat.load_s[model], "repository")

    def _sample(self) -> None:
        self.sample_times.append(self.now)
        self.resident.append(sum(len(w.cache.snapshot().device) for w in self.workers))
        if self.now + self.config.sample_s <= self.config.duration_s:
            self.schedule(self.now + self.config.sample_s, SAMPLE, None, None)

    def _result(self) -> SimResult:
        cfg = self.config
        times = self.trace.times
        measured = [i for i in range(len(times)) if times[i] >= cfg.warmup_s]
        # A request with no reply by the end of the run timed out.
        latency = [cfg.deadline_s if math.isnan(self.latency[i]) else self.latency[i]
                   for i in measured]
        timeouts = sum(1 for i in measured if self.timed_out[i] or math.isnan(self.latency[i]))
        return SimResult(
            router=self.router.name,
            warmup_s=cfg.warmup_s,
            duration_s=cfg.duration_s,
            deadline_s=cfg.deadline_s,
            latency_s=latency,
            hits=sum(self.hit[i] for i in measured),
            timeouts=timeouts,
            load_times=self.load_times,
            promotions=sum(1 for t in self.promotion_times if cfg.warmup_s <= t <= cfg.duration_s),
            busy_fraction=self._busy_fraction,
            sample_times=self.sample_times,
            resident_models=self.resident,
        )
