"""The cold lanes, as one worker pulls them (issue 23).

Gateways put the first requests of models that no worker holds or pulls in a *cold
lane*, one queue per plan priority (``broker.cold_lane``), at most
``gateway.cold_lane_per_model`` of one model at a time. A worker pulls every lane while
it can take new work, so a free permit takes the next cold request straight away, where
a model's own queue would wait for a worker to notice it and decide to take it (an
announcement, a re-score, a subscription). A lane task this worker cannot run goes to
its model's own queue, announced, where the fleet's scoring finds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from modelfleet import metrics
from modelfleet.broker import Broker, Delivery, Subscription, cold_lane
from modelfleet.errors import BrokerUnavailable
from modelfleet.settings import Settings
from modelfleet.worker.consumer import Consumer, leave

log = logging.getLogger("modelfleet.worker")


class ColdLanes:
    """One worker's consumers on the cold lanes, their window, and what it passes on.

    The coordinator lends it three things: ``accepting(model_id)`` (would this worker
    run the model now?), ``start(delivery)`` (wait for a permit, then run the task:
    the coordinator's permits bound lane and queue work alike) and
    ``announce_queued(model_id)`` (tell the fleet a task waits in a model's queue).
    """

    def __init__(self, settings: Settings, broker: Broker, *,
                 accepting: Callable[[str], bool],
                 start: Callable[[Delivery], Awaitable[asyncio.Task[None]]],
                 announce_queued: Callable[[str], Awaitable[None]],
                 free_permits: Callable[[], int], load_slots: Callable[[], int]) -> None:
        self._settings = settings
        self._broker = broker
        self._accepting = accepting
        self._start = start
        self._announce_queued = announce_queued
        self._free_permits = free_permits
        self._load_slots = load_slots
        self._cap = settings.worker.permits
        self._lanes: dict[int, Consumer] = {}  # plan priority -> consumer on its lane
        self.in_flight = 0  # tasks from the lanes running here

    @property
    def priorities(self) -> list[int]:
        return sorted({0, *self._settings.scheduling.plan_priority.values()})

    async def keep(self, can_take_work: bool) -> None:
        """Pull every lane while this worker can take new work, else leave them; each
        lane's window follows ``window()``. Called at the end of every re-score."""
        if not (self._settings.worker.cold_lane and can_take_work):
            if self._lanes:
                await self.leave()
                log.info("left the cold lanes: this worker cannot take new work")
            return
        prefetch = self.window()
        for priority in self.priorities:
            consumer = self._lanes.get(priority)
            if consumer is not None and not consumer.task.done():
                # Grown at once (a free permit must not wait), shrunk only once halved: on
                # RabbitMQ each change starts a consumer anew (basic.qos applies to new ones).
                if prefetch > consumer.prefetch or prefetch <= consumer.prefetch // 2:
                    with contextlib.suppress(BrokerUnavailable):
                        await consumer.subscription.set_prefetch(prefetch)
                        consumer.prefetch = prefetch
                continue
            if consumer is not None:  # its stream ended (the broker closed it): afresh
                await leave(self._lanes.pop(priority))
            subscription = await self._broker.subscribe(cold_lane(priority), prefetch)
            consumer = Consumer(subscription, asyncio.create_task(
                self._consume(subscription), name=f"consume-cold-lane-{priority}"))
            consumer.prefetch = prefetch
            self._lanes[priority] = consumer
            log.info("pulling the cold lane of priority %d (prefetch %d)", priority, prefetch)

    def window(self) -> int:
        """How many unacked tasks each lane may hand this worker: a lane task holds its
        delivery until it is answered, so the window bounds the lane's tasks running
        here as well as those waiting. ``worker.cold_lane_prefetch`` if set; else the lane
        tasks running now plus the free permits (work-conserving: a free permit is never
        left idle while the lane has work), at least the shared runtimes' load slots, at
        most the permits. Re-set at each re-score (one call to the broker when it moves)."""
        fixed = self._settings.worker.cold_lane_prefetch
        if fixed:
            return fixed
        wanted = max(self._load_slots(), self.in_flight + self._free_permits())
        return max(1, min(self._cap, wanted))

    async def leave(self) -> None:
        lanes, self._lanes = self._lanes, {}
        await asyncio.gather(*(leave(consumer) for consumer in lanes.values()))

    async def _consume(self, subscription: Subscription) -> None:
        async for delivery in subscription:
            # Decided before any await: leaving the lanes cancels this loop, and a
            # delivery must then be passed on, started or released, never dropped
            # between the three (one kept here while the decision was in flight was
            # held unsettled until its caller's deadline: a 504 after 60 s).
            if not self._accepting(delivery.task.model_id):
                # Shielded: leaving the lanes (a runtime down: nothing is accepted, so all
                # that arrives is passed on) must not cut a pass-on short, which left its
                # delivery unsettled, held by a channel that then never closed, until its
                # caller's deadline (a bystander's 504 in the pill bench on RabbitMQ).
                await asyncio.shield(self._pass_on(delivery))
                continue
            task = await self._start(delivery)  # released if cancelled before it starts
            metrics.COLD_LANE_TASKS.inc()
            self.in_flight += 1
            task.add_done_callback(self._finished)

    def _finished(self, _: asyncio.Task[None]) -> None:
        self.in_flight -= 1

    async def _pass_on(self, delivery: Delivery) -> None:
        """A lane task this worker cannot run (a model its catalog does not know yet,
        one only other workers run, or one whose runtime takes nothing now) goes to its
        model's own queue, announced, where the fleet's scoring finds it."""
        with contextlib.suppress(BrokerUnavailable):
            await self._broker.republish(delivery.task)
            await delivery.ack()
            metrics.COLD_LANE_PASSED_ON.inc()
            await self._announce_queued(delivery.task.model_id)
