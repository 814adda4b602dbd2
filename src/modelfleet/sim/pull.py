"""Pull-affinity: one queue per model; each worker chooses the queues it consumes.

Every ``rescore_s`` (staggered across workers) a worker snapshots the queues
that matter to it (those with backlog, those it holds, those of models warm in
its cache) and its own state, and calls the real
``modelfleet.scheduling.choose_queues``. The broker hands a message to a
consumer of its queue that has a free permit (round-robin among them); a
worker that frees a permit pulls from its queues, best score first. A worker
takes a message for a model it would have to load only while its loader is
free: the worker never holds work it cannot start (the design's tiny prefetch).
"""

from __future__ import annotations

from collections import deque

from modelfleet.cache import CacheSnapshot
from modelfleet.scheduling import QueueView, ScoringSettings, WorkerView, choose_queues
from modelfleet.scheduling.scoring import COLD_WINDOW_S
from modelfleet.sim.engine import TICK, Simulation
from modelfleet.sim.scenario import ScenarioConfig
from modelfleet.sim.worker import (
    CacheFactory,
    SimWorker,
    Task,
    gdsf_with_host,
    lru_device_only,
)


class PullAffinity:
    """Pull-affinity with modelfleet's cache (GDSF, demoting to host memory); with
    ``device_only_lru`` it runs the push routers' cache instead (an ablation that
    isolates what the routing alone is worth)."""

    name = "pull-affinity"

    def __init__(self, settings: ScoringSettings | None = None, rng_seed: int = 0,
                 device_only_lru: bool = False) -> None:
        self.device_only_lru = device_only_lru
        if device_only_lru:
            self.name = "pull-affinity-lru"
        self.settings = settings if settings is not None else ScoringSettings()
        self.rng_seed = rng_seed
        self._sim: Simulation | None = None
        self._queues: list[deque[Task]] = []
        self._nonempty: set[int] = set()
        self._consumers: list[set[int]] = []
        self._held: list[set[int]] = []  # per worker: model indexes it consumes
        self._turn = 0

    @property
    def sim(self) -> Simulation:
        assert self._sim is not None, "attach() first"
        return self._sim

    def cache_factory(self, config: ScenarioConfig) -> CacheFactory:
        if self.device_only_lru:
            return lru_device_only(config.device_budget_bytes)
        return gdsf_with_host(config.device_budget_bytes, config.host_budget_bytes)

    def attach(self, sim: Simulation) -> None:
        self._sim = sim
        models = len(sim.catalog.names)
        self._queues = [deque() for _ in range(models)]
        self._consumers = [set() for _ in range(models)]
        self._held = [set() for _ in sim.workers]
        period = sim.config.rescore_s
        for worker in sim.workers:
            # Staggered: coordinators do not re-score in lockstep.
            sim.schedule(period * (worker.index + 0.5) / len(sim.workers), TICK, worker, None)

    # --- the broker -----------------------------------------------------------------------

    def on_arrival(self, task: Task) -> None:
        model = task[1]
        self._queues[model].append(task)
        self._nonempty.add(model)
        consumers = self._consumers[model]
        if not consumers:
            return
        ordered = sorted(consumers)
        start = self._turn % len(ordered)
        self._turn += 1
        workers = self.sim.workers
        for k in range(len(ordered)):
            worker = workers[ordered[(start + k) % len(ordered)]]
            self._drain(worker, model)
            if model not in self._nonempty:
                return

    def _can_take(self, worker: SimWorker, model: int) -> bool:
        if worker.in_flight >= worker.permits:
            return False
        if model in worker.loading or model in worker.promoting:
            return True
        return (worker.cache.tier_of(self.sim.catalog.names[model]) is not None
                or worker.loader_free)

    def _drain(self, worker: SimWorker, model: int) -> bool:
        """Hand ``worker`` what it can start from ``model``'s queue; True if it took any."""
        queue = self._queues[model]
        sim = self.sim
        took = False
        while queue and self._can_take(worker, model):
            task = queue.popleft()
            if sim.expired(task):  # dropped at dequeue: nobody is waiting
                sim.time_out(task)
            else:
                sim.start(worker, task)
                took = True
        if not queue:
            self._nonempty.discard(model)
        return took

    # --- the worker's side ----------------------------------------------------------------

    def on_free(self, worker: SimWorker) -> None:
        if worker.in_flight >= worker.permits:
            return
        held = self._held[worker.index]
        nonempty = self._nonempty
        if len(nonempty) < len(held):
            ready = [m for m in nonempty if m in held]
        else:
            ready = [m for m in held if m in nonempty]
        if not ready:
            return
        names = self.sim.catalog.names
        scores = worker.scores
        ready.sort(key=lambda m: (-scores.get(names[m], 0.0), m))
        for model in ready:
            self._drain(worker, model)
            if worker.in_flight >= worker.permits:
                return

    def on_tick(self, worker: SimWorker) -> None:
        sim = self.sim
        now = sim.now
        snapshot = worker.cache.snapshot()
        views = self._views(worker, snapshot)
        decision = choose_queues(views, self._worker_view(worker, snapshot),
                                 self.settings, now, self.rng_seed)
        held = self._held[worker.index]
        index_of = sim.index_of
        for name in decision.unsubscribe:
            model = index_of[name]
            self._consumers[model].discard(worker.index)
            held.discard(model)
        for name in decision.subscribe:
            model = index_of[name]
            self._consumers[model].add(worker.index)
            held.add(model)
        worker.recent_cold.extend(now for _ in decision.cold)
        worker.subscriptions = decision.apply(worker.subscriptions)
        worker.scores = dict(decision.scores)
        sim.schedule(now + sim.config.rescore_s, TICK, worker, None)
        self.on_free(worker)

    def _views(self, worker: SimWorker, snapshot: CacheSnapshot) -> list[QueueView]:
        """The queues that matter to ``worker``: with backlog, held, or warm here."""
        sim = self.sim
        cat = sim.catalog
        index_of = sim.index_of
        # While its loader is taken, this worker can take no cold queue (scoring's
        # loader-room rule), so those cannot change the decision: leave them out.
        if len(worker.loading) < self.settings.max_loads_for_cold:
            wanted = set(self._nonempty)
            wanted.update(self._held[worker.index])
        else:
            wanted = set(self._held[worker.index])
        wanted.update(index_of[name] for name in snapshot.device)
        wanted.update(index_of[name] for name in snapshot.host)
        wanted.update(worker.loading)
        views = []
        for model in wanted:
            queue = self._queues[model]
            while queue and sim.expired(queue[0]):  # the queue's message TTL
                sim.time_out(queue.popleft())
            if not queue:
                self._nonempty.discard(model)
            views.append(QueueView(cat.names[model], len(queue), len(self._consumers[model]),
                                   cat.fanout_max_workers[model], cat.plans[model],
                                   model in cat.pinned))
        return views

    def _worker_view(self, worker: SimWorker, snapshot: CacheSnapshot) -> WorkerView:
        now = self.sim.now
        names = self.sim.catalog.names
        while worker.recent_cold and now - worker.recent_cold[0] >= COLD_WINDOW_S:
            worker.recent_cold.popleft()
        return WorkerView(
            worker_id=worker.name,
            subscriptions=worker.subscriptions,
            resident_device=frozenset(snapshot.device),
            resident_host=frozenset(snapshot.host),
            last_served=worker.last_served,
            recent_cold_subscribes=tuple(worker.recent_cold),
            free_permits=worker.free_permits,
            permits_cap=worker.permits,
            loading=frozenset(names[m] for m in worker.loading),
        )
