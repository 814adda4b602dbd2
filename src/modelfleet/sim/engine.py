"""The discrete-event engine: one heap of events, workers that load and infer, a router.

What a worker does with a task is the same under every router:

- it holds one permit from start to finish (at most ``permits`` at once);
- its per-task work outside the model (HTTP, broker, IPC, reply) runs first: the
  worker's loop's share (``serve_cpu_s``) then its runtime's loop's (``runtime_cpu_s``);
  the client's own share (``client_cpu_s``) runs before the request is sent;
- the model runs on the runtime its placement gives it (``modelfleet.sim.placement``:
  the worker's own ``worker/spread.py``, or ``crc32(model id) % runtimes_per_worker``;
  each runtime its own cache, load slots and batchers);
- a model on that runtime's device runs at once (a cache hit); with ``batch_size``
  it joins the model's batcher: one predict at a time per model and runtime, over
  whatever waited meanwhile (up to ``batch_size`` inputs);
- a model in host memory is promoted first (a PCIe copy; no loader needed);
- any other model waits for a load slot (``loaders`` per runtime, FIFO); every
  task for a model already loading waits on that same load; a load that finds no
  room waits for another load on its runtime to finish (as the real runtime does);
- the reply reaches the caller ``task_overhead_s`` after the inference (hops and
  wake-ups that are not CPU);
- a task whose deadline has passed is dropped when it would start, when its load
  finishes or when it would join a batch, and counts as a timeout (latency = the
  deadline).

With ``cores`` > 0 each worker is a machine of that many CPUs (``modelfleet.sim.cpu``)
and the per-task work, the predicts and the loads are CPU jobs that share them; with
``cores`` = 0 they take their nominal time whatever else runs.

The caches are real ``modelfleet.cache.ModelCache`` objects on the simulation's
virtual clock; evictions they return are carried out instantly (freeing memory is
milliseconds next to a load).

Workloads: an open-loop trace (arrival times fixed in advance), or ``clients``
closed-loop clients, each sending its next request when the previous answer
arrives (or when it gives up on it at the deadline).
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol, cast

from modelfleet.sim.cpu import Machine
from modelfleet.sim.placement import HashPlacement, Placement, SpreadPlacement
from modelfleet.sim.runtime_work import (
    ARRIVE,
    CALL,
    CLOSE,
    CPU,
    GIVE_UP,
    INFER_DONE,
    LOAD_DONE,
    OPEN,
    PROMOTE_DONE,
    RETRY,
    SAMPLE,
    TICK,
    RuntimeWork,
)
from modelfleet.sim.scenario import (
    Catalog,
    ScenarioConfig,
    Trace,
    ZipfSampler,
    client_samplers,
    device_budget_bytes,
)
from modelfleet.sim.worker import CacheFactory, SimRuntime, SimWorker, Task

DRAIN_RECURSION_LIMIT = 200_000  # see Simulation.run

Event = tuple[float, int, int, "SimWorker | None", object]


class Router(Protocol):
    """How tasks reach workers. Push routers pick a worker on arrival; pull lets workers pick."""

    name: str

    def cache_factory(self, device_budget_bytes: int, host_budget_bytes: int) -> CacheFactory:
        ...

    def attach(self, sim: Simulation) -> None:
        """Called once, after the workers exist and before the first arrival."""

    def on_arrival(self, task: Task) -> None: ...

    def on_settled(self, worker: SimWorker, task: Task) -> None:
        """``task`` gave its permit back on ``worker`` (answered, or dropped as expired)."""

    def on_answered(self, index: int, model: int) -> None:
        """Request ``index`` got its answer (or its timeout) at the gateway."""

    def on_free(self, worker: SimWorker) -> None:
        """``worker`` gained a free permit or loader: give it work if there is some."""

    def on_tick(self, worker: SimWorker) -> None:
        """A ``TICK`` event the router scheduled for ``worker`` fired."""

    def window_stats(self) -> tuple[float, int]:
        """(idle permit-seconds while work waited, decisions taken) over the window."""


@dataclass(frozen=True, slots=True)
class SimResult:
    """Raw outcome of one router on one workload; ``modelfleet.sim.report`` summarises it."""

    router: str
    warmup_s: float  # requests, loads and busy time before this are not counted
    duration_s: float
    deadline_s: float
    latency_s: list[float]  # of the requests that arrived after warmup_s (and before the end)
    hits: int
    timeouts: int
    load_times: list[float]  # when each full load finished (all of them)
    promotions: int
    busy_fraction: float
    sample_times: list[float]
    resident_models: list[int]  # device-resident models, fleet-wide, at sample_times
    answered_in_window: int = 0  # answers (not timeouts) completed between warm-up and end
    cpu_utilisation: float = 0.0  # of the workers' CPUs over the window (0: not modelled)
    cpu_by_thread: dict[str, float] = field(default_factory=dict)  # CPU-s in the window
    idle_permit_s: float = 0.0  # pull: permit-seconds free while work this worker could run waited
    rescores: int = 0  # pull: decisions taken, fleet-wide, over the window
    closed_loop: bool = False


class Simulation(RuntimeWork):
    """The clock, the heap of events, the clients and the router; what a worker's
    runtimes do with a task is ``RuntimeWork``'s."""

    router: Router

    def __init__(self, config: ScenarioConfig, catalog: Catalog, trace: Trace, router: Router,
                 progress: Callable[[int], None] | None = None) -> None:
        config.check()
        self.config = config
        self.catalog = catalog
        self.trace = trace
        self.router = router
        self.now = 0.0
        self.index_of = {name: i for i, name in enumerate(catalog.names)}
        self._heap: list[Event] = []
        self._seq = itertools.count()
        self._progress = progress
        self.device_budget_bytes = device_budget_bytes(config, catalog)
        factory = router.cache_factory(self.device_budget_bytes, config.host_budget_bytes)
        self.workers = []
        for i in range(config.workers):
            runtimes = [SimRuntime(r, f"runtime-{r}", factory(self.clock), config.loaders)
                        for r in range(config.runtimes_per_worker)]
            worker = SimWorker(i, f"w{i:04d}", runtimes, config.permits)
            if config.cores > 0:
                worker.machine = Machine(config.cores, self.clock, self._cpu_timer(worker))
            self.workers.append(worker)
        self.placement: Placement = HashPlacement(catalog)
        self._spread: SpreadPlacement | None = None
        if config.placement == "spread" and config.runtimes_per_worker > 1:
            self.placement = self._spread = SpreadPlacement(
                catalog, self.workers, max(1, config.permits // config.runtimes_per_worker),
                config.replica_keep_s, self.device_budget_bytes * config.runtimes_per_worker,
                self.clock)
        self._preload_pinned()
        self.closed_loop = config.clients > 0
        n = len(trace)
        self.arrival: list[float] = list(trace.times)
        self.request_model: list[int] = list(trace.models)
        self.latency: list[float] = [math.nan] * n
        self.hit = bytearray(n)
        self.timed_out = bytearray(n)
        self.answered_at: list[float] = [math.nan] * n
        self._client_of: list[int] = []
        self._samplers: list[ZipfSampler | None] = client_samplers(config)
        self.promotion_times: list[float] = []
        self.load_times: list[float] = []
        self.sample_times: list[float] = []
        self.resident: list[int] = []
        self._busy_at_open = 0.0
        self._busy_fraction = 0.0
        self._cpu_at_open = 0.0
        self._cpu_utilisation = 0.0
        self._cpu_by_at_open: dict[str, float] = {}
        self._cpu_by_thread: dict[str, float] = {}

    def clock(self) -> float:
        return self.now

    def schedule(self, at: float, kind: int, worker: SimWorker | None, payload: object) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), kind, worker, payload))

    def after(self, delay_s: float, call: Callable[[], None]) -> None:
        """Call ``call()`` ``delay_s`` from now (at once, without an event, if 0)."""
        if delay_s <= 0:
            call()
        else:
            heapq.heappush(self._heap, (self.now + delay_s, next(self._seq), CALL, None, call))

    def work(self, worker: SimWorker, cpu_s: float, done: Callable[[], None],
             thread: str | None = None, kind: str = "other") -> None:
        """``cpu_s`` of CPU work on ``worker``'s machine, on ``thread`` (an event loop's
        name; None: a thread of its own, accounted as ``kind``), then ``done()``; with no
        CPU model it simply takes ``cpu_s``."""
        if worker.machine is not None:
            worker.machine.run(cpu_s, done, thread if self.config.loop_threads else None, kind)
        else:
            self.after(cpu_s, done)

    def _cpu_timer(self, worker: SimWorker) -> Callable[[float, int], None]:
        def schedule(at: float, generation: int) -> None:
            self.schedule(at, CPU, worker, generation)
        return schedule

    # --- the run ---------------------------------------------------------------------

    def run(self) -> SimResult:
        cfg = self.config
        horizon = cfg.duration_s + cfg.deadline_s  # let the last requests finish or time out
        self.router.attach(self)
        self.schedule(0.0, SAMPLE, None, None)
        self.schedule(min(cfg.warmup_s, cfg.duration_s), OPEN, None, None)
        self.schedule(cfg.duration_s, CLOSE, None, None)
        for client in range(cfg.clients):
            self.schedule(0.0, ARRIVE, None, client)
        if (cfg.pooled_budget or self._spread is not None) and cfg.runtimes_per_worker > 1:
            for worker in self.workers:
                self.after(cfg.rescore_s, partial(self._resync, worker))
        # A task found expired when it starts gives its permit back at once, and the pull
        # router hands that permit to the next delivery, which may have expired too: a
        # queue of expired tasks drains by recursion (start, release, settle, dispatch,
        # start ...), a few frames per task, and a 10,000-worker-scale backlog passes the
        # default limit of 1,000 frames. The run raises the limit, not the order of events
        # (Python-to-Python calls take no C stack since 3.11).
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, DRAIN_RECURSION_LIMIT))
        # Nor does the run stop for the cyclic garbage collector: the events make next to
        # no cyclic garbage (a few thousand objects over a default run), while its
        # collections walk the run's millions of live objects (10 % of the CPU at 10,000
        # x 200). Reference counting frees the rest as before; the order of events is
        # untouched.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._events(horizon)
        finally:
            sys.setrecursionlimit(limit)
            if collecting:
                gc.enable()
        return self._result()

    def _events(self, horizon: float) -> None:
        """Take the arrivals and the events in time order until ``horizon``."""
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
                self._send((i, models[i], arrival))
                i += 1
                if self._progress is not None and i % 1000 == 0:
                    self._progress(1000)
            else:
                break
        if self._progress is not None:
            self._progress(count % 1000)

    def _dispatch(self, kind: int, worker: SimWorker | None, payload: object) -> None:
        if kind == INFER_DONE:
            assert worker is not None
            self._inference_done(worker, payload)  # type: ignore[arg-type]
        elif kind == CALL:
            payload()  # type: ignore[operator]
        elif kind == CPU:
            assert worker is not None and worker.machine is not None
            worker.machine.on_timer(payload)  # type: ignore[arg-type]
        elif kind == LOAD_DONE:
            assert worker is not None
            runtime, model = cast(tuple[SimRuntime, int], payload)
            self._load_done(worker, runtime, model)
        elif kind == PROMOTE_DONE:
            assert worker is not None
            runtime, model = cast(tuple[SimRuntime, int], payload)
            self._promote_done(worker, runtime, model)
        elif kind == TICK:
            assert worker is not None
            self.router.on_tick(worker)
        elif kind == ARRIVE:
            self._client_sends(payload)  # type: ignore[arg-type]
        elif kind == GIVE_UP:
            self._give_up(payload)  # type: ignore[arg-type]
        elif kind == RETRY:
            assert worker is not None
            self._retry(worker, payload)
        elif kind == SAMPLE:
            self._sample()
        elif kind == OPEN:
            self._busy_at_open = sum(w.busy_until(self.now) for w in self.workers)
            self._cpu_at_open = sum(w.machine.cpu_used() for w in self.workers if w.machine)
            self._cpu_by_at_open = self._cpu_by()
        elif kind == CLOSE:
            span = len(self.workers) * (self.now - min(self.config.warmup_s, self.now))
            busy = sum(w.busy_until(self.now) for w in self.workers) - self._busy_at_open
            self._busy_fraction = busy / span if span > 0 else 0.0
            if self.config.cores > 0 and span > 0:
                used = sum(w.machine.cpu_used() for w in self.workers if w.machine)
                self._cpu_utilisation = (used - self._cpu_at_open) / (span * self.config.cores)
                self._cpu_by_thread = {k: round(v - self._cpu_by_at_open.get(k, 0.0), 6)
                                       for k, v in self._cpu_by().items()}

    def _cpu_by(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for worker in self.workers:
            if worker.machine is not None:
                for name, seconds in worker.machine.cpu_by_thread().items():
                    total[name] = total.get(name, 0.0) + seconds
        return total

    # --- closed-loop clients -----------------------------------------------------------

    def _client_sends(self, client: int) -> None:
        if self.now >= self.config.duration_s:
            return
        sampler = self._samplers[client]
        model = sampler() if sampler is not None else self.config.only_model
        index = len(self.arrival)
        self.arrival.append(self.now)
        self.request_model.append(model)
        self.latency.append(math.nan)
        self.hit.append(0)
        self.timed_out.append(0)
        self.answered_at.append(math.nan)
        self._client_of.append(client)
        self.schedule(self.now + self.config.deadline_s, GIVE_UP, None, index)
        self._send((index, model, self.now))

    def _send(self, task: Task) -> None:
        """The client's own work on the request (on the first worker's machine, where
        bench/peers' load generator runs), then it reaches the gateway."""
        cpu_s = self.config.client_cpu_s
        if cpu_s > 0:
            self.work(self.workers[0], cpu_s, lambda: self.router.on_arrival(task), "client")
        else:
            self.router.on_arrival(task)

    def _give_up(self, index: int) -> None:
        """A closed-loop client's timeout: it stops waiting and sends its next request."""
        if math.isnan(self.latency[index]):
            self.latency[index] = self.config.deadline_s
            self.timed_out[index] = 1
            self.router.on_answered(index, self.request_model[index])
            self._client_sends(self._client_of[index])

    def _answered(self, index: int, latency_s: float, timed_out: bool) -> None:
        if not math.isnan(self.latency[index]):
            return  # its caller already gave up
        self.latency[index] = latency_s
        if timed_out:
            self.timed_out[index] = 1
        else:
            self.answered_at[index] = self.now
        self.router.on_answered(index, self.request_model[index])
        if self.closed_loop:
            self._client_sends(self._client_of[index])

    # --- what a worker does with a task ---------------------------------------------

    def expired(self, task: Task) -> bool:
        return self.now - task[2] >= self.config.deadline_s

    def time_out(self, task: Task) -> None:
        """A task dropped at its deadline: the caller got a timeout after deadline_s."""
        self._answered(task[0], self.config.deadline_s, True)

    def start(self, worker: SimWorker, task: Task) -> None:
        """Start ``task`` on ``worker``, which must have a free permit."""
        worker.in_flight += 1
        model = task[1]
        worker.running[model] = worker.running.get(model, 0) + 1
        if self.expired(task):
            self._release(worker, task)
            self.time_out(task)
            return
        cfg = self.config
        runtime = self.placement.take(worker, task).name
        if cfg.serve_cpu_s > 0 or cfg.runtime_cpu_s > 0:
            # The task's work in the worker's loop, then in its runtime's loop.
            self.work(worker, cfg.serve_cpu_s, lambda: self.work(
                worker, cfg.runtime_cpu_s, lambda: self._ensure(worker, task), runtime),
                "serve")
        else:
            self._ensure(worker, task)

    def _release(self, worker: SimWorker, task: Task) -> None:
        """``task`` gives its permit back."""
        worker.in_flight -= 1
        self.placement.done(worker, task)
        model = task[1]
        left = worker.running[model] - 1
        if left:
            worker.running[model] = left
        else:
            del worker.running[model]
        self.router.on_settled(worker, task)

    def _finish(self, worker: SimWorker, task: Task) -> None:
        worker.last_served[self.catalog.names[task[1]]] = self.now
        worker.served += 1
        self._release(worker, task)
        if self.expired(task):  # finished, but the gateway answered the caller at the deadline
            self.time_out(task)
        else:
            self._answered(task[0], self.now - task[2], False)
        self.router.on_free(worker)

    # --- bookkeeping -------------------------------------------------------------------

    def _preload_pinned(self) -> None:
        cat = self.catalog
        for worker in self.workers:
            for model in sorted(cat.pinned):
                name = cat.names[model]
                runtime = worker.runtimes[self.placement.home(worker, model)]
                runtime.cache.reserve(name, cat.size_bytes[model], pinned=True)
                runtime.cache.commit(name, cat.measured_bytes[model], cat.load_s[model],
                                     "repository")
                runtime.cache_changes += 1

    def _sample(self) -> None:
        self.sample_times.append(self.now)
        self.resident.append(sum(len(r.cache.snapshot().device)
                                 for w in self.workers for r in w.runtimes))
        if self.now + self.config.sample_s <= self.config.duration_s:
            self.schedule(self.now + self.config.sample_s, SAMPLE, None, None)

    def _result(self) -> SimResult:
        cfg = self.config
        times = self.arrival
        end = cfg.duration_s
        measured = [i for i in range(len(times)) if cfg.warmup_s <= times[i] < end] \
            if self.closed_loop else [i for i in range(len(times)) if times[i] >= cfg.warmup_s]
        # A request with no reply by the end of the run timed out.
        latency = [cfg.deadline_s if math.isnan(self.latency[i]) else self.latency[i]
                   for i in measured]
        timeouts = sum(1 for i in measured if self.timed_out[i] or math.isnan(self.latency[i]))
        answered = sum(1 for t in self.answered_at if cfg.warmup_s <= t <= end)
        idle, rescores = self.router.window_stats()
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
            answered_in_window=answered,
            cpu_utilisation=self._cpu_utilisation,
            cpu_by_thread=self._cpu_by_thread,
            idle_permit_s=idle,
            rescores=rescores,
            closed_loop=self.closed_loop,
        )
