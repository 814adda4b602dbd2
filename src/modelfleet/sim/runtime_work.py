"""What a simulated worker's runtimes do with a task, as ``ModelHost`` does it: the model
made ready on the task's runtime (a hit, a promotion from host memory, or a load in its
turn for a load slot, making room by eviction), then the predict, batched as the
runtime's ``Batcher`` batches (``batch_size``; one predict at a time per model and
runtime); and the worker's pooled budget and placement kept up every ``rescore_s``.

``RuntimeWork`` is a base of ``modelfleet.sim.engine.Simulation``, which holds the state
declared here and moves it through time; the event kinds the two share are here too.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol

from modelfleet.errors import NoCapacity
from modelfleet.sim.placement import Placement, SpreadPlacement
from modelfleet.sim.pool import apply_split, needs_room
from modelfleet.sim.scenario import Catalog, ScenarioConfig
from modelfleet.sim.worker import Batcher, SimRuntime, SimWorker, Task

(INFER_DONE, LOAD_DONE, PROMOTE_DONE, TICK, SAMPLE, RETRY, OPEN, CLOSE, CPU, CALL, ARRIVE,
 GIVE_UP) = range(12)
RETRY_S = 0.5  # how long a task waits before retrying after NoCapacity with no load to wait for


class RuntimeWork:
    """The runtimes' side of a task: ready the model, load, promote, batch, predict."""

    # State of the simulation (``Simulation.__init__``).
    config: ScenarioConfig
    catalog: Catalog
    now: float
    workers: list[SimWorker]
    placement: Placement
    _spread: SpreadPlacement | None
    hit: bytearray
    router: _FreeNotice
    load_times: list[float]
    promotion_times: list[float]

    # The simulation's own (``Simulation``).
    def schedule(self, at: float, kind: int, worker: SimWorker | None, payload: object) -> None:
        raise NotImplementedError

    def after(self, delay_s: float, call: Callable[[], None]) -> None:
        raise NotImplementedError

    def work(self, worker: SimWorker, cpu_s: float, done: Callable[[], None],
             thread: str | None = None, kind: str = "other") -> None:
        raise NotImplementedError

    def expired(self, task: Task) -> bool:
        raise NotImplementedError

    def time_out(self, task: Task) -> None:
        raise NotImplementedError

    def _release(self, worker: SimWorker, task: Task) -> None:
        raise NotImplementedError

    def _finish(self, worker: SimWorker, task: Task) -> None:
        raise NotImplementedError

    def _ensure(self, worker: SimWorker, task: Task) -> None:
        """The model of ``task`` ready on its runtime's device, then the predict."""
        if self.expired(task):
            self._release(worker, task)
            self.time_out(task)
            self.router.on_free(worker)
            return
        model = task[1]
        runtime = self.placement.runtime_of(worker, task)
        name = self.catalog.names[model]
        tier = runtime.cache.hit(name)
        if tier == "device":
            self.hit[task[0]] = 1
            self._predict(worker, runtime, task)
            return
        if tier == "host":
            waiting = runtime.promoting.get(model)
            if waiting is not None:
                waiting.append(task)
                return
            try:
                runtime.cache.reserve(name, self.catalog.size_bytes[model])
            except NoCapacity:
                self.schedule(self.now + RETRY_S, RETRY, worker, task)
                return
            runtime.cache_changes += 1
            runtime.promoting[model] = [task]
            worker.mark_busy(self.now, +1)
            self.schedule(self.now + self.catalog.promote_s[model], PROMOTE_DONE, worker,
                          (runtime, model))
            return
        waiting = runtime.loading.get(model)
        if waiting is not None:
            waiting.append(task)
            return
        runtime.loading[model] = [task]
        runtime.load_queue.append(model)
        self._kick_loader(worker, runtime)

    def _retry(self, worker: SimWorker, payload: object) -> None:
        if isinstance(payload, SimRuntime):  # the loader retries its head-of-line model
            self._kick_loader(worker, payload)
            return
        self._ensure(worker, payload)  # type: ignore[arg-type]

    def _kick_loader(self, worker: SimWorker, runtime: SimRuntime) -> None:
        cat = self.catalog
        while runtime.loads_running < runtime.loaders and runtime.load_queue:
            model = runtime.load_queue[0]
            if self.config.pooled_budget and needs_room(runtime, cat.size_bytes[model]):
                apply_split(worker, runtime, cat.size_bytes[model], self._evicted_by_pool)
                if self._spread is not None:  # the pool read every runtime to move them
                    self._spread.read(worker)
            try:
                evictions = runtime.cache.reserve(cat.names[model], cat.size_bytes[model])
            except NoCapacity:
                # The real runtime waits for a load holding room to finish; with none
                # in flight it would fail the load: retry later instead.
                if not runtime.loads_running:
                    self.schedule(self.now + RETRY_S, RETRY, worker, runtime)
                return
            runtime.cache_changes += 1
            runtime.load_queue.popleft()
            runtime.loads_running += 1
            worker.mark_busy(self.now, +1)
            # Evictions run first, on the runtime's loop, each unload collecting garbage
            # at most once per gc_interval_s (runtime.memory.CycleCollector); then the load
            # runs on a thread of its own.
            gc_s = self._collections(runtime, len(evictions)) * self.config.gc_s
            if worker.machine is not None:
                self.work(worker, gc_s, partial(self._load, worker, runtime, model),
                          runtime.name)
            else:
                self.schedule(self.now + gc_s + cat.load_s[model], LOAD_DONE, worker,
                              (runtime, model))

    def _load(self, worker: SimWorker, runtime: SimRuntime, model: int) -> None:
        """The load itself (its evictions done): on the runtime's thread when it holds
        the GIL there, else on a thread of its own."""
        thread = runtime.name if self.config.load_holds_gil else None
        runtime.load_started[model] = self.now
        self.work(worker, self.catalog.load_s[model],
                  lambda: self._load_done(worker, runtime, model), thread, kind="load")

    def _resync(self, worker: SimWorker) -> None:
        """The pool's periodic resync (``modelfleet.sim.pool``) and placement's review
        (``modelfleet.sim.placement``); a raised budget may let a load waiting for room
        start."""
        if self.config.pooled_budget:
            apply_split(worker, None, 0, self._evicted_by_pool)
        if self._spread is not None:
            self._spread.resync(worker, self.now, self._unload_replica)
        for runtime in worker.runtimes:
            self._kick_loader(worker, runtime)
        if self.now < self.config.duration_s + self.config.deadline_s:
            self.after(self.config.rescore_s, partial(self._resync, worker))

    def _unload_replica(self, runtime: SimRuntime, model_id: str) -> None:
        """A cooled replica's copy unloaded (``RuntimeSupervisor._carry_out``), unless a
        load of it is in flight there (the unload would find it loading)."""
        if runtime.cache.reservation(model_id) is None:
            if runtime.cache.remove(model_id):
                runtime.cache_changes += 1
                self._evicted_by_pool(runtime, 1)

    def _evicted_by_pool(self, runtime: SimRuntime, unloads: int) -> None:
        """A lowered budget's evictions, carried out on the runtime's loop (their gc)."""
        worker = next(w for w in self.workers if runtime in w.runtimes)
        gc_s = self._collections(runtime, unloads) * self.config.gc_s
        if gc_s > 0 and worker.machine is not None:
            self.work(worker, gc_s, lambda: None, runtime.name)

    def _collections(self, runtime: SimRuntime, unloads: int) -> int:
        """Full collections ``unloads`` unloads run now on ``runtime``."""
        if unloads <= 0:
            return 0
        if self.config.gc_interval_s <= 0:
            return unloads
        if self.now - runtime.collected_at >= self.config.gc_interval_s:
            runtime.collected_at = self.now
            return 1
        return 0

    def _predict(self, worker: SimWorker, runtime: SimRuntime, task: Task) -> None:
        if self.config.batch_size <= 0:  # no batcher: every task predicts on its own
            worker.mark_busy(self.now, +1)
            if worker.machine is not None:
                worker.machine.run(self.catalog.infer_s[task[1]],
                                   lambda: self._inference_done(worker, task), kind="predict")
            else:
                self.schedule(self.now + self.catalog.infer_s[task[1]], INFER_DONE, worker,
                              task)
            return
        batcher = runtime.batchers.get(task[1])
        if batcher is None:
            batcher = runtime.batchers[task[1]] = Batcher()
        batcher.waiting.append(task)
        if not batcher.running:
            self._next_batch(worker, batcher)

    def _next_batch(self, worker: SimWorker, batcher: Batcher) -> None:
        batch: list[Task] = []
        dropped = False
        while batcher.waiting and len(batch) < self.config.batch_size:
            task = batcher.waiting.popleft()
            if self.expired(task):
                self._release(worker, task)
                self.time_out(task)
                dropped = True
            else:
                batch.append(task)
        if not batch:
            batcher.running = False
            if dropped:
                self.router.on_free(worker)
            return
        batcher.running = True
        model = batch[0][1]
        cost = self.catalog.infer_s[model] + (len(batch) - 1) * self.catalog.infer_row_s[model]
        worker.mark_busy(self.now, +1)

        def done() -> None:
            worker.mark_busy(self.now, -1)
            for task in batch:
                self._inferred(worker, task)
            self._next_batch(worker, batcher)
        self.work(worker, cost, done, kind="predict")

    def _inference_done(self, worker: SimWorker, task: Task) -> None:
        worker.mark_busy(self.now, -1)
        self._inferred(worker, task)

    def _inferred(self, worker: SimWorker, task: Task) -> None:
        overhead = self.config.task_overhead_s
        if overhead > 0:
            self.after(overhead, lambda: self._finish(worker, task))
        else:
            self._finish(worker, task)

    def _ready(self, worker: SimWorker, runtime: SimRuntime, tasks: list[Task]) -> None:
        for task in tasks:
            if self.expired(task):
                self._release(worker, task)
                self.time_out(task)
            else:
                self._predict(worker, runtime, task)

    def _load_done(self, worker: SimWorker, runtime: SimRuntime, model: int) -> None:
        cat = self.catalog
        runtime.loads_running -= 1
        worker.mark_busy(self.now, -1)
        # The runtime times a load by the clock (ModelHost: measure_load in its thread),
        # and its cache ranks by what it timed: with the CPU modelled, how long the load
        # took beside everything else running; else its nominal seconds.
        started = runtime.load_started.pop(model, None)
        seconds = cat.load_s[model] if started is None else self.now - started
        runtime.cache.commit(cat.names[model], cat.measured_bytes[model], seconds,
                             "repository")
        runtime.cache_changes += 1
        self.load_times.append(self.now)
        self._ready(worker, runtime, runtime.loading.pop(model))
        self._kick_loader(worker, runtime)
        self.router.on_free(worker)

    def _promote_done(self, worker: SimWorker, runtime: SimRuntime, model: int) -> None:
        cat = self.catalog
        worker.mark_busy(self.now, -1)
        runtime.cache.commit(cat.names[model], cat.measured_bytes[model], cat.promote_s[model],
                             "host")
        runtime.cache_changes += 1
        self.promotion_times.append(self.now)
        self._ready(worker, runtime, runtime.promoting.pop(model))
        self.router.on_free(worker)


class _FreeNotice(Protocol):
    """What the runtimes tell the router: a permit or a load slot came free."""

    def on_free(self, worker: SimWorker) -> None: ...
