"""The worker coordinator: chooses queues and holds permits; ``tasks.TaskRunner`` runs them.

One asyncio process per worker. Its loops:

- *events*: gateways announce demand per model (``{"kind": "demand"}``); that set,
  plus this worker's subscriptions, resident and pinned models, is the candidate list.
- *rescore* (every ``rescore_interval_s``, and at once when a runtime changes state):
  backlog and consumer counts for the candidates, the runtimes' residency, then
  ``scheduling``: ``snapshot_of`` (observe), ``decide`` (what to subscribe to and
  drop), ``actions_for`` (the steps), the same code the simulator runs. Queues whose
  runtime is down are dropped at once: a worker whose backend is down must not keep
  pulling. A re-score costs O(candidates): nothing in it walks the catalog.
- *state*: publishes this worker's state (``{"kind": "worker_state"}``) for
  gateways' ``/v1/fleet`` and for the other workers.
- one *consume* task per subscription: take a delivery, take a permit, run it.

Which queues it counts, and how (the broker's counts or the fleet's announcements), is
``worker/queue_counts.py``.

What happens to one delivered task (settlement, deadlines, the suspect gate, the
crash hand-back) is ``worker/tasks.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import socket
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Any

from modelfleet import metrics
from modelfleet.broker import Broker, Delivery, Subscription
from modelfleet.errors import BrokerUnavailable
from modelfleet.repository import Catalog
from modelfleet.scheduling import (
    Action,
    Decision,
    Observation,
    QueueFacts,
    Snapshot,
    actions_for,
    candidates,
    cannot_matter,
    decide,
    snapshot_of,
    take_turn,
    work_waiting,
)
from modelfleet.scheduling.demand import DemandPriority
from modelfleet.settings import Settings
from modelfleet.worker.announced import AnnouncedCounts
from modelfleet.worker.cold_lanes import ColdLanes
from modelfleet.worker.consumer import Consumer, leave
from modelfleet.worker.control import ControlAgent
from modelfleet.worker.idle import IdleMeter
from modelfleet.worker.pinning import PinKeeper
from modelfleet.worker.placement import RuntimePlacement
from modelfleet.worker.queue_counts import QueueCounts
from modelfleet.worker.residency import Residency
from modelfleet.worker.supervised_runtime import SupervisedRuntime
from modelfleet.worker.supervisor import RuntimeSupervisor
from modelfleet.worker.tasklog import TaskLog
from modelfleet.worker.tasks import TaskRunner

log = logging.getLogger("modelfleet.worker")

RESIDENCY_MAX_AGE_S = 0.02


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Coordinator:
    def __init__(self, settings: Settings, broker: Broker, catalog: Catalog,
                 supervisor: RuntimeSupervisor, clock: Callable[[], float] = time.time,
                 refresh_catalog: Callable[[], Awaitable[object]] | None = None) -> None:
        self._settings = settings
        self._broker = broker
        self._catalog = catalog
        self._supervisor = supervisor
        self._clock = clock
        self.worker_id = settings.worker.worker_id or default_worker_id()
        self._cap = settings.worker.permits
        self._permits = asyncio.Semaphore(self._cap)
        self._in_flight: set[asyncio.Task[None]] = set()
        self._suspects: set[asyncio.Task[None]] = set()  # on their way to quarantine: no permit
        self._consumers: dict[str, Consumer] = {}
        # model id -> when its demand was last heard, oldest first: expiry pops the front
        # instead of scanning every model in demand at every re-score.
        self._demand: OrderedDict[str, float] = OrderedDict()
        self._demand_priority = DemandPriority(settings.worker.demand_window_s)  # issue 14
        self._cold_subscribes: deque[float] = deque(maxlen=256)
        self._pinning: asyncio.Task[None] | None = None
        self._residency = Residency(clock)
        # The control API's orders (unload, pin), rolling versions: see worker/control.py.
        self.control = ControlAgent(settings, broker, catalog, RuntimePlacement(
            settings, catalog, supervisor, self._residency), self.worker_id,
            lambda: self.ready, clock, refresh_catalog)
        self._pins = PinKeeper(catalog, supervisor, clock, self.control)
        self._isolated_since: dict[str, float] = {}  # model id -> when its runtime was seen
        self._tasks = TaskRunner(settings, broker, catalog, supervisor, self.worker_id,
                                 self.control, TaskLog(self.worker_id, settings.log_format),
                                 self._stop_pulling, clock)
        self._lanes = ColdLanes(
            settings, broker, accepting=self._runtime_accepting, start=self._start_lane_task,
            announce_queued=self._tasks.announce_queued,
            free_permits=lambda: self._cap - len(self._in_flight),
            load_slots=lambda: settings.runtime.max_concurrent_loads
            * len(self._supervisor.shared))
        # What the fleet's announcements say (worker/announced.py), and the candidate
        # queues' counts: the broker's, or estimates from those announcements.
        self._announced = AnnouncedCounts(3 * settings.gateway.demand_announce_interval_s,
                                          settings.worker.demand_window_s,
                                          3 * settings.worker.state_interval_s,
                                          self.worker_id)
        self._queues = QueueCounts(broker, self._announced)
        # The last observation (now, candidates, device, host, pinned or loading here),
        # for a second decision on exact counts.
        self._observed: tuple[float, set[str], frozenset[str], frozenset[str],
                              frozenset[str]] | None = None
        self._turns: dict[str, float] = {}  # cold takes waiting their turn -> when it comes
        self._idle = IdleMeter(self._cap, time.monotonic)
        self._untaken_work = False  # it saw tasks waiting in queues this worker does not pull
        self._held_backlog: set[str] = set()  # held queues it saw tasks waiting in
        self._refreshed_at = -1e9
        self._loops: list[asyncio.Task[None]] = []
        # Who else hears the fleet's events through this worker's one subscription
        # (e.g. the catalog refresher, for a gateway's publish).
        self.event_observers: list[Callable[[dict[str, Any]], None]] = []
        self._stopping = False
        self._seed = zlib.crc32(self.worker_id.encode())
        self._jitter = random.Random(self._seed)

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        metrics.PERMITS_CAP.set(self._cap)
        await self._supervisor.start()
        await self._pins.keep()
        await self.control.start()
        self._loops = [
            asyncio.create_task(self._listen_events(), name="worker-events"),
            asyncio.create_task(self._rescore_loop(), name="worker-rescore"),
            asyncio.create_task(self._state_loop(), name="worker-state"),
        ]

    async def stop(self) -> None:
        """Stop pulling, let in-flight tasks finish (up to the drain timeout), then stop."""
        self._stopping = True
        # 1. Stop deciding: no rescore may subscribe anew behind our back.
        background = [*self._loops, *([self._pinning] if self._pinning else [])]
        for loop in background:
            loop.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await self.control.stop()
        # 2. Stop taking new work: cancel every consumer (unstarted deliveries go back).
        await asyncio.gather(self._lanes.leave(),
                             *(self._unsubscribe(m) for m in list(self._consumers)))
        # 3. Drain: in-flight tasks finish and reply, or are handed back after the timeout.
        running = self._in_flight | self._suspects
        if running:
            await asyncio.wait(running, timeout=self._settings.worker.drain_timeout_s)
        leftover = [t for t in running if not t.done()]
        for task in leftover:
            task.cancel()
        await asyncio.gather(*leftover, return_exceptions=True)
        # 4. Tell the fleet we are gone, then stop the runtimes.
        with contextlib.suppress(BrokerUnavailable):
            await self._broker.publish_event({"kind": "worker_gone", "worker_id": self.worker_id})
        await self._supervisor.stop()

    # -- health --------------------------------------------------------------------
    @property
    def live(self) -> bool:
        return not self._stopping and all(not loop.done() for loop in self._loops)

    @property
    def ready(self) -> bool:
        """Can this worker take new work now?"""
        return (not self._stopping and self._broker.connected
                and any(r.ready for r in self._supervisor.shared))

    @property
    def loading(self) -> list[str]:
        return sorted({m for r in self._supervisor.all() for m in r.loading})

    def _loader_free(self) -> bool:
        """Has some shared runtime a free load slot now?

        A model with a task running here and not resident is being loaded for it, even
        before the runtime's next report says so.
        """
        device = self._residency.models("device")
        unloaded = self._tasks.running_placed() - device
        slots = self._settings.runtime.max_concurrent_loads
        for runtime in self._supervisor.shared:
            loading = set(runtime.loading) | {
                m for m in unloaded if self._supervisor.runtime_for(m) is runtime}
            if len(loading) < slots:
                return True
        return False

    def state(self) -> dict[str, Any]:
        device = sorted(self._residency.models("device"))
        host = sorted(self._residency.models("host"))
        return {
            "kind": "worker_state",
            "worker_id": self.worker_id,
            "at": self._clock(),
            "ready": self.ready,
            "gpus": self._settings.worker.gpus,  # the gateway's 503 for CUDA-only models
            "accepting_cold_work": self.ready and self._loader_free(),
            "subscriptions": sorted(self._consumers),
            "resident": {"device": device, "host": host},
            "loading": self.loading,
            "permits_in_use": len(self._in_flight),
            "permits_cap": self._cap,
            **self._residency.tally.summary(),  # bytes per tier, loads by source, evictions
            "runtimes": [{"name": r.name, "state": r.state, "restarts": r.restarts,
                          "spare": r.spare}
                         for r in self._supervisor.all()],
        }

    # -- loops -----------------------------------------------------------------------
    def _wake(self) -> None:
        """Re-score now rather than at the next tick."""
        self._supervisor.changed.set()

    async def _listen_events(self) -> None:
        """The worker's one subscription to the fleet's events, fanned out here: control
        orders and peers' holdings to the control agent, gateways' announcements to the
        counts, cancels to the task runner, demand to the re-score."""
        while True:
            try:
                async for event in self._broker.events():
                    self.control.observe(event)
                    for observe in self.event_observers:
                        observe(event)
                    self._announced.observe(event, self._clock())
                    if event.get("kind") == "cancel":
                        self._cancel(event.get("request_id"))
                        continue
                    model_id = event.get("model_id")
                    if event.get("kind") != "demand" or not isinstance(model_id, str):
                        continue
                    self._queues.demand_heard(model_id)
                    if model_id not in self._catalog:
                        continue
                    self._note_demand(model_id)
                    self._demand_priority.note(model_id, event.get("priority"), self._clock())
                    if model_id not in self._consumers and not self._queues.marked(model_id) \
                            and not self._at_cap(model_id):
                        # Work this worker does not pull may be waiting: count it afresh,
                        # and decide now if a permit is free to take it. Once per model
                        # until it is counted, and not for a queue just seen at its
                        # fan-out cap: gateways re-announce every model with a request in
                        # flight, and in a fleet most of them are others' to serve.
                        self._queues.mark(model_id)
                        if len(self._in_flight) < self._cap:
                            self._wake()
            except BrokerUnavailable:
                pass
            self._queues.events_lost()
            await asyncio.sleep(self._settings.broker.reconnect_max_backoff_s / 5)

    def _note_demand(self, model_id: str) -> None:
        self._demand[model_id] = self._clock()
        self._demand.move_to_end(model_id)

    def _expire_demand(self, now: float) -> None:
        """Forget demand older than the window: O(what expires), oldest first."""
        horizon = now - self._settings.worker.demand_window_s
        demand = self._demand
        while demand:
            model_id, seen = next(iter(demand.items()))
            if seen >= horizon:
                break
            del demand[model_id]

    def _at_cap(self, model_id: str) -> bool:
        """Did the last count see this queue with as many consumers as its fan-out cap?"""
        counted = self._queues.get(model_id)
        if counted is None or model_id not in self._catalog:
            return False
        manifest = self._catalog.get(model_id).manifest
        if self.control.pinned(model_id):  # the manifest's pin, or an operator's
            return False
        cap = self._settings.scheduling.fanout_cap(manifest.fanout.max_workers, manifest.plan)
        return counted.consumers >= cap

    def _cancel(self, request_id: object) -> None:
        """The caller hung up: its task ends as if its deadline had passed."""
        if isinstance(request_id, str):
            self._tasks.cancel(request_id)

    async def _rescore_loop(self) -> None:
        """Re-score every tick, and at once when woken: demand for a queue this worker does
        not pull, a runtime's state change, or a task ending while work waits.

        The ticks keep their own schedule: a woken re-score does not put the next one
        off. A woken re-score counts only what changed, and the listener does not wake
        for a queue last counted at its fan-out cap (``_at_cap``), so only a tick tells
        this worker that such a queue's consumers left; a worker woken more often than
        its period would otherwise never tick, never count it again, and leave its tasks
        waiting however long (nor would its exact counts, ``EXACT_EVERY_S``, come)."""
        interval = self._settings.worker.rescore_interval_s
        tick_at = -math.inf  # monotonic: when the next full re-score is due
        while True:
            self._supervisor.changed.clear()  # before: a wake during the re-score counts
            full = time.monotonic() >= tick_at
            if full:
                # Each tick a little longer or shorter, so that workers started together
                # drift apart instead of re-scoring in lockstep and taking the same queue.
                tick_at = time.monotonic() + interval * self._jitter.uniform(0.75, 1.25)
            try:
                await self._rescore(full)
            except BrokerUnavailable as exc:
                log.warning("rescore skipped: %s", exc)
            except Exception:
                log.exception("rescore failed")
            until_tick_s = tick_at - time.monotonic()
            if until_tick_s <= 0:
                continue  # the tick came during the re-score: it is due now
            try:
                await asyncio.wait_for(self._supervisor.changed.wait(), until_tick_s)
            except TimeoutError:
                pass
            else:
                # Woken by an event every worker may have seen at once (an announcement):
                # a short random pause spreads the fleet's reactions, and the fresh count
                # before a cold subscription lets a later worker see the first one's claim.
                # It also bounds how often a busy worker re-scores (wakes coalesce).
                await asyncio.sleep(self._jitter.uniform(0, self._settings.worker
                                                         .rescore_jitter_s))

    async def _state_loop(self) -> None:
        while True:
            with contextlib.suppress(BrokerUnavailable):
                await self._broker.publish_event(self.state())
            await asyncio.sleep(self._settings.worker.state_interval_s)

    # -- choosing queues: observe -> decide -> act -----------------------------------
    async def _rescore(self, full: bool = True) -> None:
        if self._stopping:
            return
        snapshot = await self._observe(full)
        if snapshot is None:
            return
        decision = decide(snapshot, self._settings.scheduling, self._seed)
        recount = self._queues.estimated(decision.subscribe)
        if recount:
            # Taken on announced counts: count them exactly and decide again, so that
            # what is taken is taken on the broker's word.
            await self._queues.count_exactly(recount)
            snapshot = self._snapshot()
            decision = decide(snapshot, self._settings.scheduling, self._seed)
        await self._act(decision, snapshot)

    async def _observe(self, full: bool) -> Snapshot | None:
        """The snapshot ``decide`` needs: the candidate queues' counts and this worker.

        ``full``: counts for every candidate (each tick). Otherwise (woken by an event)
        only for queues newly in demand and those never counted, the rest as counted at
        the last tick: a wake must be cheap, since it comes with demand. Either way a
        queue the fleet's announcements say enough of is estimated, not asked of the
        broker (``_estimate``), and one announced with nothing waiting, not held and not
        warm here, is no candidate at all (it cannot change the decision).
        """
        if full or time.monotonic() - self._refreshed_at >= RESIDENCY_MAX_AGE_S:
            # Residency takes a stats call to every runtime: woken re-scores (many a
            # second under load) reuse one that is a few milliseconds old.
            await self._residency.refresh(self._supervisor.placed())
            self._refreshed_at = time.monotonic()
        now = self._clock()
        self._expire_demand(now)
        self._announced.expire_peers(now)
        device = self._residency.models("device")
        host = self._residency.models("host")
        pinned = self._pins.pinned
        if pinned and not (self._pinning and not self._pinning.done()):
            # A restarted runtime comes back empty: pinned models go back on it.
            self._pinning = asyncio.create_task(self._pins.keep(self._residency.versions()[1]))
        loading = frozenset().union(*(self._residency.loading(r.name)
                                      for r in self._supervisor.placed()))
        here = device | host | pinned | loading
        exact = self._queues.exact_due(full)

        def busy_here(model_id: str) -> bool:  # held, warm or running here: counted exactly
            return model_id in self._consumers or model_id in here \
                or model_id in self._tasks.running

        # O(candidates): each is looked up by itself, never the whole catalog.
        wanted = {m for m in candidates(self._demand, self._consumers, device, host, pinned)
                  if (exact or busy_here(m) or not self._queues.announced_idle(m, now))
                  and self._runtime_accepting(m)}
        self._queues.keep_only(wanted)
        ask = self._queues.to_ask(wanted, full, self._held_backlog)
        if not exact:
            ask -= self._queues.estimate(ask, now, busy_here)
        # Not a queue the broker said is missing, until a demand event names it: at
        # thousands of models most resident ones have none (README "The broker at scale").
        await self._queues.refresh(ask)
        self._observed = (now, wanted, device, host, pinned | loading)
        return self._snapshot()

    def _snapshot(self) -> Snapshot:
        """The snapshot of the last observation, with the counts as they are now."""
        assert self._observed is not None
        snapshot = snapshot_of(self._observation(*self._observed),
                               self._settings.scheduling, self._seed)
        self._idle.observe(free_permits=snapshot.worker.free_permits,
                           waiting=work_waiting(snapshot, self._settings.scheduling))
        self._untaken_work = work_waiting(snapshot, self._settings.scheduling, held_too=False)
        self._held_backlog = {q.model_id for q in snapshot.queues
                              if q.backlog > 0 and q.model_id in self._consumers}
        return snapshot

    def _observation(self, now: float, wanted: set[str], device: frozenset[str],
                     host: frozenset[str], also_warm: frozenset[str]) -> Observation:
        """What this worker knows now, for ``scheduling.snapshot_of``: O(candidates)."""
        counts: dict[str, tuple[int, int]] = {}
        facts: dict[str, QueueFacts] = {}
        outranked_by: dict[str, int] = {}  # held and over the cap
        running = self._tasks.running
        scheduling = self._settings.scheduling
        for model_id in wanted:
            qs = self._queues.get(model_id)
            if qs is None or model_id not in self._catalog:  # gone while we asked
                continue
            if cannot_matter(qs.backlog, model_id in self._consumers,
                             model_id in device or model_id in host or model_id in also_warm
                             or model_id in running):
                continue  # snapshot_of would leave it out: its facts are not needed
            manifest = self._catalog.get(model_id).manifest
            counts[model_id] = (qs.backlog, qs.consumers)
            pinned = self.control.pinned(model_id)
            facts[model_id] = QueueFacts(
                manifest.fanout.max_workers, manifest.plan, pinned,
                manifest.batching.max_batch_size,
                self._supervisor.runtime_for(model_id).name,
                self._demand_priority.of(model_id, now))
            if model_id in self._consumers and not pinned and qs.consumers > \
                    scheduling.fanout_cap(manifest.fanout.max_workers, manifest.plan):
                outranked_by[model_id] = self._announced.outranked_by(model_id)
        slots = self._settings.runtime.max_concurrent_loads
        runtimes = self._supervisor.placed()
        return Observation(
            now, self.worker_id, counts, facts, frozenset(self._consumers), device, host,
            load_slots={r.name: slots for r in runtimes},
            loading={r.name: self._residency.loading(r.name) for r in runtimes},
            # A model with a task running here but not resident yet is being loaded for it.
            loading_for_tasks={m: self._supervisor.runtime_for(m).name
                               for m in self._tasks.running_placed() if m not in device},
            running=dict(self._tasks.running), last_served=dict(self._tasks.last_served),
            recent_cold_subscribes=tuple(self._cold_subscribes),
            free_permits=self._cap - len(self._in_flight), permits_cap=self._cap,
            prefetch={m: c.prefetch for m, c in self._consumers.items()},
            outranked_by=outranked_by)

    async def _act(self, decision: Decision, snapshot: Snapshot) -> None:
        """Carry out ``scheduling.actions_for``: the steps the simulator takes too."""
        now = snapshot.now
        for model_id in [m for m in self._turns if m not in decision.subscribe]:
            del self._turns[model_id]  # no longer worth taking: its wait is over
        for action in actions_for(decision, snapshot, self._settings.scheduling):
            model_id = action.model_id
            if action.kind == "unsubscribe":
                metrics.SUBSCRIBE_EVENTS.labels("unsubscribe", "cold" if action.cold
                                                else "warm").inc()
                await self._unsubscribe(model_id, decision.reasons.get(model_id, ""))
            elif action.kind == "subscribe":
                if action.cold and not (self._my_turn(action, now)
                                        and await self._still_open(action)):
                    continue
                if action.cold:
                    self._cold_subscribes.append(now)
                metrics.SUBSCRIBE_EVENTS.labels("subscribe", "cold" if action.cold
                                                else "warm").inc()
                await self._subscribe(model_id, action.window,
                                      decision.reasons.get(model_id, ""))
            else:
                consumer = self._consumers.get(model_id)
                if consumer is not None and consumer.prefetch != action.window:
                    with contextlib.suppress(BrokerUnavailable):
                        await consumer.subscription.set_prefetch(action.window)
                        consumer.prefetch = action.window
        await self._retire_idle_runtimes(now)
        await self._lanes.keep(self.ready and not self._stopping)
        metrics.SUBSCRIPTIONS.set(len(self._consumers))

    async def _retire_idle_runtimes(self, now: float) -> None:
        """An isolated model's own runtime holds a process and its memory: stop it when idle."""
        idle_s = self._settings.worker.isolated_idle_stop_s
        pinned = self._pins.pinned
        for model_id, runtime in self._supervisor.dedicated().items():
            if model_id in pinned or model_id in self._tasks.running or model_id in runtime.loading:
                continue
            last_used = max(self._tasks.last_served.get(model_id, 0.0),
                            self._isolated_since.setdefault(model_id, now),
                            self._demand.get(model_id, 0.0))
            if now - last_used < idle_s:
                continue
            await self._unsubscribe(model_id)
            if model_id in self._tasks.running:  # a delivery got in while we unsubscribed
                continue
            log.info("stopping the runtime of %s: idle for %.0fs", model_id, now - last_used)
            await self._supervisor.retire(model_id)
            self._isolated_since.pop(model_id, None)
        await self._supervisor.retire_quarantine()  # once unused for quarantine_idle_s

    def _my_turn(self, action: Action, now: float) -> bool:
        """Is it this worker's turn to take a cold capped queue (``scheduling.take_turn``)?
        If not, the turn is noted and a re-score woken when it comes."""
        turn_s = self._settings.worker.cold_take_turn_s
        if action.cap is None or turn_s <= 0:
            return True
        model_id = action.model_id
        due = self._turns.get(model_id)
        if due is None:
            cuda_only = model_id in self._catalog \
                and self._catalog.get(model_id).manifest.device == "cuda"
            turn = take_turn(self._announced.free_ahead(model_id, cuda_only), action.cap)
            if turn == 0:
                return True
            self._turns[model_id] = now + turn * turn_s
            asyncio.get_running_loop().call_later(turn * turn_s, self._wake)
            return False
        if now < due:
            return False
        del self._turns[model_id]
        return True

    async def _still_open(self, action: Action) -> bool:
        """Is a cold queue still under its fan-out cap, by a fresh count (~1 ms)?

        Another worker may have taken the queue since the snapshot; a cold load is
        expensive enough to be worth one more exact count first.
        """
        stats = await self._queues.confirm(action.model_id)
        return stats is not None and action.still_open(stats.consumers)

    def _runtime_accepting(self, model_id: str) -> bool:
        """Pull this model's queue? Isolated models' runtimes start only once in demand."""
        if model_id not in self._catalog:
            return False
        if self._catalog.get(model_id).manifest.device == "cuda" \
                and not self._settings.worker.gpus:
            return False  # a CPU worker never pulls a CUDA-only model
        if self._catalog.get(model_id).manifest.isolated and model_id not in self._demand \
                and model_id not in self._consumers:
            return False
        if self._supervisor.quarantines(model_id, suspect=False):
            # Its tasks run on the quarantine runtime a while (it crashed one): pulled
            # while that one takes work, whatever the state of the shared runtime it
            # crashed (its pills still queued go to quarantine, not to the restart).
            return self._supervisor.quarantine_accepting()
        return self._supervisor.runtime_for(model_id).accepting

    async def _subscribe(self, model_id: str, prefetch: int, reason: str = "") -> None:
        if model_id in self._consumers or self._stopping:
            return
        subscription = await self._broker.subscribe(model_id, prefetch)
        consumer = Consumer(subscription, asyncio.create_task(
            self._consume(subscription), name=f"consume-{model_id}"))
        consumer.prefetch = prefetch
        self._consumers[model_id] = consumer
        log.info("subscribed to %s (prefetch %d%s)", model_id, prefetch,
                 f", {reason}" if reason else "")

    async def _unsubscribe(self, model_id: str, reason: str = "") -> None:
        consumer = self._consumers.pop(model_id, None)
        if consumer is None:
            return
        await leave(consumer)
        log.info("unsubscribed from %s%s", model_id, f" ({reason})" if reason else "")

    # -- running tasks -------------------------------------------------------------
    async def _consume(self, subscription: Subscription) -> None:
        async for delivery in subscription:
            await self._start(delivery)

    async def _start(self, delivery: Delivery) -> asyncio.Task[None]:
        """Wait for a permit, then run the delivery's task (a model queue's or a lane's);
        suspect work goes to quarantine without one (``_run_suspect``)."""
        if self._supervisor.quarantines(delivery.task.model_id, delivery.task.suspect):
            return self._run_suspect(delivery)
        try:
            await self._permits.acquire()
        except asyncio.CancelledError:
            # Unsubscribed while this task waited for a permit: it was never started.
            with contextlib.suppress(BrokerUnavailable, RuntimeError):
                await delivery.release()
            raise
        task = asyncio.create_task(self._tasks.run(delivery))
        self._in_flight.add(task)
        metrics.PERMITS_IN_USE.set(len(self._in_flight))
        self._idle.observe(free_permits=self._cap - len(self._in_flight))
        task.add_done_callback(self._finished)
        return task

    async def _start_lane_task(self, delivery: Delivery) -> asyncio.Task[None]:
        """A cold lane's task: its model will be resident here, so a candidate at the
        next re-scores, but its own queue exists only if a task was published there,
        and every such publish is announced. Without demand heard for it, its queue is
        presumed missing (``QueueCounts.presume_missing``) rather than asked for: on
        RabbitMQ each ask of a missing queue is a passive declare answered by closing a
        channel, once for nearly every model a lane brings at 5,000 models."""
        model_id = delivery.task.model_id
        if model_id not in self._demand:
            self._queues.presume_missing(model_id)
        return await self._start(delivery)

    def _run_suspect(self, delivery: Delivery) -> asyncio.Task[None]:
        """Suspect work runs on the quarantine runtime one task at a time (the suspect
        gate), bounded by its deadline and by the prefetch windows: it waits its turn
        there without a permit, which the shared runtimes' models need meanwhile (three
        pills and their model's innocents otherwise hold the permits while each pill's
        crash restarts the quarantine runtime)."""
        task = asyncio.create_task(self._tasks.run(delivery))
        self._suspects.add(task)
        task.add_done_callback(self._suspect_finished)
        return task

    def _suspect_finished(self, task: asyncio.Task[None]) -> None:
        self._suspects.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task runner failed", exc_info=task.exception())

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        self._permits.release()
        metrics.PERMITS_IN_USE.set(len(self._in_flight))
        self._idle.observe(free_permits=self._cap - len(self._in_flight))
        if self._untaken_work or self._held_backlog:
            # A permit (and maybe a load slot) is free while work waits: elsewhere, or
            # in a held queue whose window may be too small for what waits there now.
            self._wake()
        if not task.cancelled() and task.exception() is not None:
            log.error("task runner failed", exc_info=task.exception())

    async def _stop_pulling(self, runtime: SupervisedRuntime) -> None:
        affected = [m for m in self._consumers if self._supervisor.runtime_for(m) is runtime
                    and not self._supervisor.quarantines(m, suspect=False)]
        for model_id in affected:
            await self._unsubscribe(model_id)
        if affected:
            log.warning("runtime %s is down: stopped pulling %s", runtime.name,
                        ", ".join(affected))
