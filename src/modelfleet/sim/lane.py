"""The cold lane, as the simulator runs it: the gateway's choice of the lane
(``modelfleet.gateway.service.GatewayService._lane``), the broker's lane queue, and each
worker's consumer on it (``modelfleet.worker.cold_lanes.ColdLanes``).

- **The gateway** sends a request to the lane, instead of its model's queue, when no
  live worker pulls the model (by the workers' last states: their subscriptions and the
  models their runtimes load, published every ``state_interval_s`` and heard the
  broker's ``announce_s`` later), and fewer of its requests wait in the lane than
  ``cold_lane_per_model``. In a fleet of one worker that is all; in a larger fleet a
  model some worker holds (its last state's device and host tiers, or a lane request
  it just answered) takes its own queue, and the limit is also the model's fan-out cap.
  A request sent to the lane is not announced: only what waits in a model's queue is.
- **The broker** keeps one lane (every simulated caller has priority 0) and hands it
  round-robin to the lane consumers with room in their windows, as a model's queue.
- **A worker** consumes the lane from its start (its first re-score; its runtimes are
  always up here, so it always accepts): each delivery waits for a permit on the same FIFO
  semaphore as the model queues' deliveries. Its window is re-set at the end of every
  re-score to the lane tasks running here plus the free permits, at least the runtimes'
  load slots, at most the permits; grown at once, shrunk only once halved.

``cold_lane_per_model`` = 0 (the fleet scenario's default) leaves the lane out.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING

from modelfleet.sim.pull_state import Consumer, Coordinator
from modelfleet.sim.worker import SimWorker, Task

if TYPE_CHECKING:
    from modelfleet.sim.pull import PullAffinity

LANE = -1  # the ``model`` of a consumer on the lane


class ColdLane:
    def __init__(self, router: PullAffinity, per_model: int) -> None:
        sim = router.sim
        self._router = router
        self._sim = sim
        self._per_model = per_model
        self._caps = [min(per_model, cap) for cap in router._fanout_caps]
        self._queue: deque[Task] = deque()
        self._consumers: list[Consumer] = []
        self._by_worker: dict[int, Consumer] = {}
        self._turn = 0
        self._requests: set[int] = set()  # requests sent to the lane, not answered yet
        self.waiting: dict[int, int] = {}  # model -> how many of those (the gateway's count)
        self._running = [0] * len(sim.workers)  # lane tasks holding a permit, per worker
        # The gateway's view of the workers, from their last states.
        self._heard: set[int] = set()  # workers whose state it has heard
        self._pulled: list[frozenset[int]] = [frozenset()] * len(sim.workers)
        self._pulled_by: Counter[int] = Counter()  # model -> workers pulling or loading it
        self._held: list[set[int]] = [set() for _ in sim.workers]
        self._held_by: Counter[int] = Counter()
        self._load_slots = [sum(r.loaders for r in w.runtimes) for w in sim.workers]
        for worker in sim.workers:
            self._publish_state(worker)
        for coord in router._coords:  # a worker's first re-score, at its start, pulls it
            self.keep(coord)

    # --- the gateway ------------------------------------------------------------------------

    def takes(self, model: int) -> bool:
        """Does the gateway send this request to the lane (``GatewayService._lane``)?"""
        if self._pulled_by[model]:
            return False
        limit = self._per_model
        if len(self._heard) != 1:  # one worker: holding and the fan-out cap are moot
            if self._held_by[model]:
                return False
            limit = self._caps[model]
        return self.waiting.get(model, 0) < limit

    def send(self, task: Task) -> None:
        model = task[1]
        self._requests.add(task[0])
        self.waiting[model] = self.waiting.get(model, 0) + 1
        self._queue.append(task)
        self.dispatch()

    def answered(self, index: int, model: int) -> None:
        if index in self._requests:
            self._requests.discard(index)
            left = self.waiting[model] - 1
            if left:
                self.waiting[model] = left
            else:
                del self.waiting[model]

    def _publish_state(self, worker: SimWorker) -> None:
        """The worker's state (``Coordinator.state``), heard by the gateway a broker's
        event later; the next one ``state_interval_s`` on."""
        pulled = frozenset(self._router._coords[worker.index].consumers).union(
            *(r.loading for r in worker.runtimes))
        held: set[int] = set()
        if len(self._sim.workers) > 1:
            index_of = self._sim.index_of
            for runtime in worker.runtimes:
                device, host = runtime.cache.resident_ids()
                held.update(index_of[name] for name in (*device, *host))
        announce_s = self._sim.config.broker_costs.announce_s
        self._sim.after(announce_s, lambda: self._state_heard(worker.index, pulled, held))
        if self._sim.now < self._sim.config.duration_s + self._sim.config.deadline_s:
            self._sim.after(self._sim.config.state_interval_s,
                            lambda: self._publish_state(worker))

    def _state_heard(self, index: int, pulled: frozenset[int], held: set[int]) -> None:
        self._heard.add(index)
        self._pulled_by.subtract(self._pulled[index])
        self._pulled_by.update(pulled)
        self._pulled[index] = pulled
        self._held_by.subtract(self._held[index])
        self._held_by.update(held)
        self._held[index] = held

    def served(self, worker: SimWorker, task: Task) -> None:
        """A lane task answered by ``worker``: it holds the model now, until its next
        state says otherwise (``FleetView.served``)."""
        if len(self._sim.workers) > 1 and not self._sim.expired(task) \
                and task[1] not in self._held[worker.index]:
            self._held[worker.index].add(task[1])
            self._held_by[task[1]] += 1

    # --- the broker -------------------------------------------------------------------------

    def dispatch(self) -> None:
        """Hand the lane's tasks round-robin to the consumers with room."""
        queue, router = self._queue, self._router
        while queue and self._consumers:
            open_ = [c for c in self._consumers if c.held < c.window]
            if not open_:
                return
            consumer = open_[self._turn % len(open_)]
            self._turn += 1
            task = queue.popleft()
            consumer.held += 1
            router._delivered[task[0]] = consumer
            consumer.buffer.append(task)
            if consumer.blocked is None:
                router._take(router._coords[consumer.owner], consumer)

    # --- the worker -------------------------------------------------------------------------

    def keep(self, coord: Coordinator) -> None:
        """End of a re-score (``ColdLanes.keep``): pull the lane, its window re-set."""
        worker = coord.worker
        index = worker.index
        wanted = max(self._load_slots[index], self._running[index] + worker.free_permits)
        window = max(1, min(worker.permits, wanted))
        consumer = self._by_worker.get(index)
        if consumer is None:
            consumer = self._by_worker[index] = Consumer(LANE, window, index)
            self._consumers.append(consumer)
        elif window > consumer.window or window <= consumer.window // 2:
            consumer.window = window
        else:
            return
        self.dispatch()

    def started(self, coord: Coordinator, task: Task) -> None:
        """``task`` takes a permit on ``coord``'s worker (counted if it came by the lane)."""
        consumer = self._router._delivered.get(task[0])
        if consumer is not None and consumer.model == LANE:
            self._running[coord.worker.index] += 1

    def settled(self, worker: SimWorker, consumer: Consumer, task: Task) -> None:
        """A lane task gave its permit back: its delivery is settled."""
        consumer.held -= 1
        self._running[worker.index] -= 1
        self.served(worker, task)
        self.dispatch()
