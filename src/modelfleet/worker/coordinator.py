"""The worker coordinator: chooses queues, holds permits, runs tasks on runtimes, replies.

One asyncio process per worker. Its loops:

- *events*: gateways announce demand per model (``{"kind": "demand"}``); that set,
  plus this worker's subscriptions, resident and pinned models, is the candidate list.
- *rescore* (every ``rescore_interval_s``, and at once when a runtime changes state):
  exact backlog and consumer counts for the candidates (``Broker.queue_stats``), the
  runtimes' residency, then ``scheduling.choose_queues`` (pure) decides what to
  subscribe to and drop. Queues whose runtime is down are dropped at once: a worker
  whose backend is down must not keep pulling.
- *state*: publishes this worker's state (``{"kind": "worker_state"}``) for
  gateways' ``/v1/fleet`` and for the other workers.
- one *consume* task per subscription: take a delivery, take a permit, run it.

Why queue discovery works this way (demand announcements + exact counts): the
RabbitMQ management API is off by default on Debian's package, lists 2,000 queues in
0.2-0.5 s and reports counts several seconds stale; the event-exchange plugin is off
by default too and says a queue exists, not what is waiting in it. Gateways already
know exactly which models have requests waiting, so they announce it on a fanout
event (once per model per second while requests wait, so a worker that starts late
learns of a backlog within a second), and workers ask for exact counts for just those
candidates (a passive declare, ~0.6 ms each, on a channel of its own because a
missing queue closes the channel). It works identically on the embedded broker, and
its cost grows with the models in demand, not with the catalog.

A task is acked only after its reply is published (at-least-once). Expired tasks are
acked and dropped unrun. A task whose runtime crashed under it goes back to the
broker (``reject(requeue=True)``), or to the dead-letter queue once it has used up
its deliveries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
import zlib
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from modelfleet import metrics
from modelfleet.broker import Broker, Delivery, QueueStats, Subscription
from modelfleet.errors import BrokerUnavailable, ModelfleetError, RuntimeCrashed
from modelfleet.ipc.protocol import InferCall
from modelfleet.messages import EncodedReply, Reply, Task, now_ms
from modelfleet.repository import Catalog
from modelfleet.scheduling import Decision, QueueView, Snapshot, WorkerView, decide, work_waiting
from modelfleet.settings import Settings
from modelfleet.worker.control import ControlAgent
from modelfleet.worker.gate import CrashWitness, SuspectGate
from modelfleet.worker.idle import IdleMeter
from modelfleet.worker.pinning import PinKeeper
from modelfleet.worker.placement import RuntimePlacement
from modelfleet.worker.residency import Residency
from modelfleet.worker.supervisor import RuntimeSupervisor, SupervisedRuntime
from modelfleet.worker.tasklog import TaskLog

log = logging.getLogger("modelfleet.worker")

RESIDENCY_MAX_AGE_S = 0.02


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class _Consumer:
    def __init__(self, subscription: Subscription, task: asyncio.Task[None]) -> None:
        self.subscription = subscription
        self.task = task
        self.prefetch = 0


class Coordinator:
    def __init__(self, settings: Settings, broker: Broker, catalog: Catalog,
                 supervisor: RuntimeSupervisor, clock: Callable[[], float] = time.time) -> None:
        self._settings = settings
        self._broker = broker
        self._catalog = catalog
        self._supervisor = supervisor
        self._clock = clock
        self.worker_id = settings.worker.worker_id or default_worker_id()
        self._cap = settings.worker.permits
        self._permits = asyncio.Semaphore(self._cap)
        self._in_flight: set[asyncio.Task[None]] = set()
        self._consumers: dict[str, _Consumer] = {}
        self._demand: dict[str, float] = {}
        self._last_served: dict[str, float] = {}
        self._cold_subscribes: deque[float] = deque(maxlen=256)
        self._gates: dict[str, SuspectGate] = {}  # runtime name -> its gate
        self._witnesses: dict[str, CrashWitness] = {}  # runtime name -> who ran alone
        self._deadlines: dict[str, asyncio.Timeout] = {}  # request id -> its running deadline
        self._cancelled: dict[str, float] = {}  # request ids whose callers hung up -> when
        self._pinning: asyncio.Task[None] | None = None
        self._residency = Residency(clock)
        # The control API's orders (unload, pin), rolling versions: see worker/control.py.
        self.control = ControlAgent(settings, broker, catalog, RuntimePlacement(
            settings, catalog, supervisor, self._residency), self.worker_id,
            lambda: self.ready, clock)
        self._pins = PinKeeper(catalog, supervisor, clock, self.control)
        self._isolated_since: dict[str, float] = {}  # model id -> when its runtime was seen
        self._running: Counter[str] = Counter()  # model id -> tasks in flight here
        self._task_log = TaskLog(self.worker_id, settings.log_format)
        self._counts: dict[str, QueueStats] = {}  # candidate queues as last counted
        self._dirty: set[str] = set()  # queues to count afresh at the next re-score
        self._idle = IdleMeter(self._cap, time.monotonic)
        self._untaken_work = False  # it saw tasks waiting in queues this worker does not pull
        self._held_backlog: set[str] = set()  # held queues it saw tasks waiting in
        self._refreshed_at = -1e9
        self._loops: list[asyncio.Task[None]] = []
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
        await asyncio.gather(*(self._unsubscribe(m) for m in list(self._consumers)))
        # 3. Drain: in-flight tasks finish and reply, or are handed back after the timeout.
        if self._in_flight:
            await asyncio.wait(self._in_flight, timeout=self._settings.worker.drain_timeout_s)
        leftover = list(self._in_flight)
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
        unloaded = set(self._running) - device
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
            "accepting_cold_work": self.ready and self._loader_free(),
            "subscriptions": sorted(self._consumers),
            "resident": {"device": device, "host": host},
            "loading": self.loading,
            "permits_in_use": len(self._in_flight),
            "permits_cap": self._cap,
            **self._residency.tally.summary(),  # bytes per tier, loads by source, evictions
            "runtimes": [{"name": r.name, "state": r.state, "restarts": r.restarts}
                         for r in self._supervisor.all()],
        }

    # -- loops -----------------------------------------------------------------------
    def _wake(self) -> None:
        """Re-score now rather than at the next tick."""
        self._supervisor.changed.set()

    async def _listen_events(self) -> None:
        while True:
            try:
                async for event in self._broker.events():
                    if event.get("kind") == "cancel":
                        self._cancel(event.get("request_id"))
                        continue
                    model_id = event.get("model_id")
                    if event.get("kind") != "demand" or not isinstance(model_id, str) \
                            or model_id not in self._catalog:
                        continue
                    self._demand[model_id] = self._clock()
                    if model_id not in self._consumers and model_id not in self._dirty \
                            and not self._at_cap(model_id):
                        # Work this worker does not pull may be waiting: count it afresh,
                        # and decide now if a permit is free to take it. Once per model
                        # until it is counted, and not for a queue just seen at its
                        # fan-out cap: gateways re-announce every model with a request in
                        # flight, and in a fleet most of them are others' to serve.
                        self._dirty.add(model_id)
                        if len(self._in_flight) < self._cap:
                            self._wake()
            except BrokerUnavailable:
                pass
            await asyncio.sleep(self._settings.broker.reconnect_max_backoff_s / 5)

    def _at_cap(self, model_id: str) -> bool:
        """Did the last count see this queue with as many consumers as its fan-out cap?"""
        counted = self._counts.get(model_id)
        if counted is None or model_id not in self._catalog:
            return False
        manifest = self._catalog.get(model_id).manifest
        if manifest.fanout.pinned:
            return False
        cap = self._settings.scheduling.fanout_cap(manifest.fanout.max_workers, manifest.plan)
        return counted.consumers >= cap

    def _cancel(self, request_id: object) -> None:
        """The caller hung up: its task ends as if its deadline had passed.

        A task running here has its deadline moved to now (a runtime call under way is
        abandoned, like at a deadline); one not delivered yet is remembered, and dropped
        unrun when it arrives.
        """
        if not isinstance(request_id, str):
            return
        now = self._clock()
        self._cancelled[request_id] = now
        horizon = now - self._settings.gateway.max_timeout_s
        while self._cancelled and next(iter(self._cancelled.values())) < horizon:
            self._cancelled.pop(next(iter(self._cancelled)))
        timeout = self._deadlines.get(request_id)
        if timeout is not None:
            timeout.reschedule(asyncio.get_running_loop().time())

    async def _rescore_loop(self) -> None:
        """Re-score every tick, and at once when woken: demand for a queue this worker does
        not pull, a runtime's state change, or a task ending while work waits."""
        interval = self._settings.worker.rescore_interval_s
        full = True
        while True:
            self._supervisor.changed.clear()  # before: a wake during the re-score counts
            try:
                await self._rescore(full)
            except BrokerUnavailable as exc:
                log.warning("rescore skipped: %s", exc)
            except Exception:
                log.exception("rescore failed")
            # Each tick a little longer or shorter, so that workers started together drift
            # apart instead of re-scoring in lockstep and taking the same queue at once.
            full = False
            try:
                await asyncio.wait_for(self._supervisor.changed.wait(),
                                       interval * self._jitter.uniform(0.75, 1.25))
            except TimeoutError:
                full = True
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
        await self._act(decision, snapshot)

    async def _observe(self, full: bool) -> Snapshot | None:
        """The snapshot ``decide`` needs: the candidate queues' counts and this worker.

        ``full``: exact counts for every candidate (each tick). Otherwise (woken by an
        event) only for queues newly in demand and those never counted, the rest as
        counted at the last tick: a wake must be cheap, since it comes with demand.
        """
        if full or time.monotonic() - self._refreshed_at >= RESIDENCY_MAX_AGE_S:
            # Residency takes a stats call to every runtime: woken re-scores (many a
            # second under load) reuse one that is a few milliseconds old.
            await self._residency.refresh(self._supervisor.all())
            self._refreshed_at = time.monotonic()
        now = self._clock()
        window = self._settings.worker.demand_window_s
        for model_id, seen in list(self._demand.items()):
            if now - seen > window:
                del self._demand[model_id]
        device = self._residency.models("device")
        host = self._residency.models("host")
        if self._pins.pinned and not (self._pinning and not self._pinning.done()):
            # A restarted runtime comes back empty: pinned models go back on it.
            self._pinning = asyncio.create_task(self._pins.keep(self._residency.versions()[1]))
        serviceable = {m for m in self._catalog_ids() if self._runtime_accepting(m)}
        candidates = (set(self._demand) | set(self._consumers) | device | host
                      | set(self._pins.pinned)) & serviceable
        for model_id in set(self._counts) - candidates:
            del self._counts[model_id]
            with contextlib.suppress(KeyError):  # a gauge nobody updates would go stale
                metrics.QUEUE_BACKLOG.remove(model_id)
        # Woken: count afresh what was announced, never counted, or held with a backlog
        # (its window is sized to what waits there).
        ask = candidates if full else (self._dirty | self._held_backlog
                                       | (candidates - set(self._counts)))
        self._dirty.clear()
        if ask:
            self._counts.update(await self._broker.queue_stats(sorted(ask & candidates)))
        queues = []
        runtime_of: dict[str, SupervisedRuntime] = {}
        for model_id in sorted(candidates):
            qs = self._counts.get(model_id)
            if qs is None or model_id not in self._catalog:  # gone while we asked
                continue
            manifest = self._catalog.get(model_id).manifest
            runtime = runtime_of[model_id] = self._supervisor.runtime_for(model_id)
            metrics.QUEUE_BACKLOG.labels(model_id).set(qs.backlog)
            queues.append(QueueView(model_id, qs.backlog, qs.consumers,
                                    manifest.fanout.max_workers, manifest.plan,
                                    manifest.fanout.pinned,
                                    manifest.batching.max_batch_size, runtime.name))
        # A model with a task running here but not resident yet is being loaded for it.
        loading = {r.name: set(self._residency.loading(r.name)) for r in self._supervisor.all()}
        for model_id in set(self._running) - device:
            if model_id in runtime_of:
                loading.setdefault(runtime_of[model_id].name, set()).add(model_id)
        slots = self._settings.runtime.max_concurrent_loads
        worker = WorkerView(
            self.worker_id, frozenset(self._consumers), device, host,
            dict(self._last_served), tuple(self._cold_subscribes),
            self._cap - len(self._in_flight), self._cap,
            frozenset().union(*loading.values()),
            loader_room={name: slots - len(models) for name, models in loading.items()},
            running=dict(self._running),
            prefetch={m: c.prefetch for m, c in self._consumers.items()})
        snapshot = Snapshot(now, tuple(queues), worker)
        self._idle.observe(free_permits=worker.free_permits,
                           waiting=work_waiting(snapshot, self._settings.scheduling))
        self._untaken_work = work_waiting(snapshot, self._settings.scheduling, held_too=False)
        self._held_backlog = {q.model_id for q in queues
                              if q.backlog > 0 and q.model_id in self._consumers}
        return snapshot

    async def _act(self, decision: Decision, snapshot: Snapshot) -> None:
        now = snapshot.now
        device = snapshot.worker.resident_device
        for model_id in decision.unsubscribe:
            metrics.SUBSCRIBE_EVENTS.labels("unsubscribe", "warm" if model_id in device
                                            else "cold").inc()
            await self._unsubscribe(model_id)
        for model_id in sorted(decision.subscribe):
            cold = model_id in decision.cold
            if cold and model_id not in await self._still_open(frozenset({model_id}),
                                                               list(snapshot.queues)):
                continue
            if cold:
                self._cold_subscribes.append(now)
            metrics.SUBSCRIBE_EVENTS.labels("subscribe", "cold" if cold else "warm").inc()
            await self._subscribe(model_id, decision.prefetch.get(model_id, 1))
        for model_id, window in decision.prefetch.items():
            consumer = self._consumers.get(model_id)
            if consumer is not None and consumer.prefetch != window:
                with contextlib.suppress(BrokerUnavailable):
                    await consumer.subscription.set_prefetch(window)
                    consumer.prefetch = window
        await self._retire_idle_runtimes(now)
        metrics.SUBSCRIPTIONS.set(len(self._consumers))

    async def _retire_idle_runtimes(self, now: float) -> None:
        """An isolated model's own runtime holds a process and its memory: stop it when idle."""
        idle_s = self._settings.worker.isolated_idle_stop_s
        pinned = set(self._pins.pinned)
        for model_id, runtime in self._supervisor.dedicated().items():
            if model_id in pinned or model_id in self._running or model_id in runtime.loading:
                continue
            last_used = max(self._last_served.get(model_id, 0.0),
                            self._isolated_since.setdefault(model_id, now),
                            self._demand.get(model_id, 0.0))
            if now - last_used < idle_s:
                continue
            await self._unsubscribe(model_id)
            if model_id in self._running:  # a delivery got in while we unsubscribed
                continue
            log.info("stopping the runtime of %s: idle for %.0fs", model_id, now - last_used)
            await self._supervisor.retire(model_id)
            self._isolated_since.pop(model_id, None)

    async def _still_open(self, cold: frozenset[str], queues: list[QueueView]) -> set[str]:
        """Cold queues that still have room under their fan-out cap, by a fresh count.

        Another worker may have taken the queue since the snapshot; a cold load is
        expensive enough to be worth one more exact count (~1 ms) first.
        """
        if not cold:
            return set()
        fresh = await self._broker.queue_stats(sorted(cold))
        views = {q.model_id: q for q in queues}
        open_ = set()
        for model_id in cold:
            view, stats = views.get(model_id), fresh.get(model_id)
            if view is None or stats is None:
                continue
            cap = self._settings.scheduling.fanout_cap(view.fanout_max_workers, view.plan)
            if view.pinned or stats.consumers < cap:
                open_.add(model_id)
        return open_

    def _runtime_accepting(self, model_id: str) -> bool:
        """Pull this model's queue? Isolated models' runtimes start only once in demand."""
        if self._catalog.get(model_id).manifest.isolated and model_id not in self._demand \
                and model_id not in self._consumers:
            return False
        return self._supervisor.runtime_for(model_id).accepting

    def _catalog_ids(self) -> list[str]:
        return [entry.model_id for entry in self._catalog]

    async def _subscribe(self, model_id: str, prefetch: int) -> None:
        if model_id in self._consumers or self._stopping:
            return
        subscription = await self._broker.subscribe(model_id, prefetch)
        consumer = _Consumer(subscription, asyncio.create_task(
            self._consume(subscription), name=f"consume-{model_id}"))
        consumer.prefetch = prefetch
        self._consumers[model_id] = consumer
        log.info("subscribed to %s (prefetch %d)", model_id, prefetch)

    async def _unsubscribe(self, model_id: str) -> None:
        consumer = self._consumers.pop(model_id, None)
        if consumer is None:
            return
        with contextlib.suppress(BrokerUnavailable):
            await consumer.subscription.cancel()
        consumer.task.cancel()
        await asyncio.wait({consumer.task})  # not `await`: our own cancellation stays ours
        log.info("unsubscribed from %s", model_id)

    # -- running tasks -------------------------------------------------------------
    async def _consume(self, subscription: Subscription) -> None:
        async for delivery in subscription:
            try:
                await self._permits.acquire()
            except asyncio.CancelledError:
                # Unsubscribed while this task waited for a permit: it was never started.
                with contextlib.suppress(BrokerUnavailable, RuntimeError):
                    await delivery.release()
                raise
            task = asyncio.create_task(self._run(delivery))
            self._in_flight.add(task)
            metrics.PERMITS_IN_USE.set(len(self._in_flight))
            self._idle.observe(free_permits=self._cap - len(self._in_flight))
            task.add_done_callback(self._finished)

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

    async def _run(self, delivery: Delivery) -> None:
        task = delivery.task
        received_ms = now_ms()
        self._running[task.model_id] += 1
        try:
            if task.expired(received_ms) or task.request_id in self._cancelled:
                self._count_dropped(task)
                await delivery.ack()
                return
            refusal = self.control.refusal(task.model_id)
            if refusal is not None:  # queued before an operator unloaded it
                await self._settle_with_failure(delivery, refusal)
                return
            runtime = self._supervisor.runtime_for(task.model_id)
            if not await runtime.wait_settled((task.deadline_ms - now_ms()) / 1000):
                # Its runtime is (re)starting and the deadline passed meanwhile: nobody waits.
                metrics.EXPIRED_TASKS.labels(task.model_id).inc()
                await delivery.ack()
                return
            if runtime.failure is not None:  # cannot start (e.g. its environment won't build)
                runtime.request_retry()
                await self._settle_with_failure(delivery, runtime.failure)
                return
            try:
                async with asyncio.timeout(max(0.0, (task.deadline_ms - now_ms()) / 1000)) \
                        as deadline:
                    self._deadlines[task.request_id] = deadline
                    if task.request_id in self._cancelled:  # hung up while it waited
                        deadline.reschedule(asyncio.get_running_loop().time())
                    reply = await self._run_on(runtime, delivery, queue_wait_ms=max(
                        0, received_ms - task.enqueued_ms))
            except TimeoutError:
                self._count_dropped(task)
                await delivery.ack()
                return
            except _Crashed as crashed:
                # Stop pulling this runtime's queues first, so the task handed back goes to
                # another worker or waits for the restart instead of bouncing straight back.
                await self._stop_pulling(runtime)
                await self._hand_back(delivery, crashed.error, crashed.alone)
                return
            self._last_served[task.model_id] = self._clock()
            if task.expired():
                # Its caller's deadline passed while it ran (the runtime may have said so
                # itself, at the same instant): nobody waits for a reply any more.
                self._count_dropped(task)
                await delivery.ack()
                return
            await self._reply_and_ack(delivery, reply)
            metrics.TASKS.labels(task.model_id, reply.status).inc()
            self._task_log.settled(task, reply)
        except BrokerUnavailable as exc:
            # Could not even hand it back: its channel is gone with the connection, and
            # the broker redelivers it (a reply sent already makes that a duplicate).
            log.warning("task %s for %s: %s; the broker redelivers it", task.request_id,
                        task.model_id, exc)
        except ModelfleetError as exc:
            # The runtime could not run it and said why: the caller hears it, the task is done.
            await self._settle_with_failure(delivery, exc)
        except Exception as exc:
            # A bug of ours. Settle the task anyway, where someone will look at it.
            log.exception("task %s for %s failed in the worker", task.request_id, task.model_id)
            with contextlib.suppress(BrokerUnavailable, RuntimeError):
                await self._broker.publish_reply(task.reply_to, EncodedReply.of(Reply.failure(
                    task.request_id, ModelfleetError(f"worker error: {exc!r}"),
                    worker_id=self.worker_id)))
                await delivery.dead_letter(f"worker_error: {exc!r}")
        except asyncio.CancelledError:
            with contextlib.suppress(BrokerUnavailable, RuntimeError):
                await delivery.reject(requeue=True)  # drained past the timeout: hand it back
            raise
        finally:
            self._deadlines.pop(task.request_id, None)
            self._running[task.model_id] -= 1
            if not self._running[task.model_id]:
                del self._running[task.model_id]

    def _count_dropped(self, task: Task) -> None:
        self._task_log.dropped(task, "client_disconnected" if task.request_id in self._cancelled
                               else "deadline_exceeded")
        if task.request_id in self._cancelled:
            metrics.CANCELLED_TASKS.labels(task.model_id).inc()
        else:
            metrics.EXPIRED_TASKS.labels(task.model_id).inc()

    async def _settle_with_failure(self, delivery: Delivery, error: ModelfleetError) -> None:
        task = delivery.task
        reply = EncodedReply.of(Reply.failure(task.request_id, error, worker_id=self.worker_id))
        await self._reply_and_ack(delivery, reply)
        metrics.TASKS.labels(task.model_id, "error").inc()
        self._task_log.settled(task, reply)

    async def _reply_and_ack(self, delivery: Delivery, reply: EncodedReply) -> None:
        """Send the reply, then ack: through a broker reconnect, never left unsettled.

        While the connection is down (or not yet known to be back: a restored consumer
        can deliver before the connection says so), the reply is retried until the
        task's deadline; after it nobody waits, and the task is only acked. The ack is
        tried once: a delivery whose channel died with the old connection cannot be
        acked, and the broker redelivers it (the gateway ignores a duplicate reply).
        A task held this way keeps its permit, so the worker takes no more work than it
        can settle.
        """
        task = delivery.task
        await self._through_reconnects(
            task, "reply", lambda: self._broker.publish_reply(task.reply_to, reply))
        try:
            await delivery.ack()
        except BrokerUnavailable as exc:
            log.info("task %s answered; its ack was lost with the connection (%s): the "
                     "broker redelivers it, and the duplicate reply is ignored",
                     task.request_id, exc)

    async def _through_reconnects(self, task: Task, what: str,
                                  send: Callable[[], Awaitable[object]]) -> bool:
        """``send`` until the broker takes it, retrying until ``task``'s deadline.

        True once sent; False when the deadline passed first (nobody waits any more).
        """
        pause = 0.05
        while True:
            try:
                await send()
                return True
            except BrokerUnavailable as exc:
                if task.expired():
                    log.info("%s for %s dropped: the broker was down until its deadline "
                             "(%s)", what, task.request_id, exc)
                    return False
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1.0)

    async def _stop_pulling(self, runtime: SupervisedRuntime) -> None:
        affected = [m for m in self._consumers if self._supervisor.runtime_for(m) is runtime]
        for model_id in affected:
            await self._unsubscribe(model_id)
        if affected:
            log.warning("runtime %s is down: stopped pulling %s", runtime.name,
                        ", ".join(affected))

    async def _run_on(self, runtime: SupervisedRuntime, delivery: Delivery,
                      queue_wait_ms: float) -> EncodedReply:
        """Run the task on its runtime once the runtime is up and the gate lets it in.

        A redelivered task may be the one that crashed a runtime: it runs alone (the
        suspect gate). A task whose runtime went down while it waited for its turn never
        ran there: it waits for the restart and goes in then, without being charged a
        delivery for a crash it had no part in (three crashes in a row otherwise
        dead-letter an innocent task that was only queued behind a poison pill).
        """
        task = delivery.task
        gate = self._gates.setdefault(runtime.name, SuspectGate())
        witness = self._witnesses.setdefault(runtime.name, CrashWitness())
        while True:
            async with gate.slot(suspect=task.suspect):
                if runtime.ready and runtime.runtime is not None:
                    with witness.on_runtime() as alone:
                        try:
                            return await self._infer(runtime, delivery, queue_wait_ms)
                        except RuntimeCrashed as exc:
                            raise _Crashed(exc, alone()) from exc
            await runtime.wait_settled(float("inf"))  # bounded by the task's deadline
            if runtime.failure is not None and not runtime.ready:
                runtime.request_retry()
                raise runtime.failure
            await asyncio.sleep(0.01)  # settled but not yet handed a client: a moment

    async def _infer(self, runtime: SupervisedRuntime, delivery: Delivery,
                     queue_wait_ms: float) -> EncodedReply:
        """The task's bytes go to the runtime as the broker gave them; its reply comes
        back encoded, stamped with what this worker adds, and is passed on as bytes."""
        task = delivery.task
        target = runtime.runtime
        if target is None or not runtime.ready:
            raise RuntimeCrashed(f"runtime {runtime.name} is not ready")
        manifest = self._catalog.get(task.model_id).manifest
        remaining_s = max(0.0, (task.deadline_ms - now_ms()) / 1000)
        call = InferCall(delivery.body, task.delivery_count, tuple(manifest.accepts),
                         self.worker_id, queue_wait_ms)
        try:
            return await target.infer(
                call, timeout_s=remaining_s + self._settings.runtime.ping_timeout_s)
        except TimeoutError as exc:
            raise RuntimeCrashed(f"runtime {runtime.name} did not answer in time") from exc
        except RuntimeCrashed:
            runtime.connection_lost()  # before the gate lets the next task in
            raise

    async def _hand_back(self, delivery: Delivery, exc: RuntimeCrashed, alone: bool) -> None:
        """A runtime crashed with this task in flight: charge it only if it was alone.

        The task goes back to its queue as a new message carrying its crash evidence
        (published and confirmed before the old one is acked), so the broker's own
        delivery count, which also counts consumers that went away, decides nothing
        here. A task is dead-lettered, and its caller answered at once, when it has
        crashed a runtime alone more than ``broker.delivery_limit`` times: that is
        evidence, and the dead letter is classified deterministic. A task that keeps
        sharing crashes (the suspect gate makes that rare) is dead-lettered after twice
        as many, as transient.
        """
        task = delivery.task
        limit = self._settings.broker.delivery_limit
        evidence = replace(task, crashes=task.crashes + 1,
                           crashes_alone=task.crashes_alone + (1 if alone else 0))
        if evidence.crashes_alone > limit or evidence.crashes > 2 * limit + 1:
            if evidence.crashes_alone > limit:
                reason = (f"crashed its runtime alone on each of {evidence.crashes_alone} "
                          f"deliveries: {exc}")
            else:
                reason = (f"was on {evidence.crashes} runtimes that crashed, never alone "
                          f"on one: {exc}")
            failure = EncodedReply.of(replace(
                Reply.failure(task.request_id, exc, worker_id=self.worker_id),
                error_message=f"model '{task.model_id}': {reason}; dead-lettered"))
            metrics.DEAD_LETTERED.labels(task.model_id, "runtime_crashed").inc()
            self._task_log.handed_back(task, "dead_lettered")
            await self._through_reconnects(
                task, "reply", lambda: self._broker.publish_reply(task.reply_to, failure))
            await delivery.dead_letter(f"runtime_crashed: {reason}")
            return
        metrics.REDELIVERED.labels(task.model_id).inc()
        self._task_log.handed_back(task, "runtime_crashed")
        # Sent, or past its deadline with nobody waiting: either way this copy is done.
        await self._through_reconnects(task, "hand-back",
                                       lambda: self._broker.republish(evidence))
        await delivery.ack()


class _Crashed(Exception):
    """A runtime crash under a task, and whether the task was alone on the runtime."""

    def __init__(self, error: RuntimeCrashed, alone: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.alone = alone
