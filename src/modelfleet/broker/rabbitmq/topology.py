"""RabbitMQ topology for modelfleet: queue arguments, declare leases, replaceable channels.

Model queues and the dead-letter queue are durable *quorum* queues: replicated,
with a broker-side delivery count and delivery limit, which is what the Task
contract needs. Reply inboxes and event queues are *classic* by necessity: they
are exclusive to one connection (a gateway's inbox dies with its gateway), and
quorum queues cannot be exclusive or auto-delete.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aio_pika.abc import AbstractRobustChannel, AbstractRobustConnection

from modelfleet.errors import BrokerUnavailable
from modelfleet.settings import BrokerSettings

# Headers we write on dead letters we route ourselves (``Delivery.dead_letter``).
DEATH_REASON_HEADER = "x-modelfleet-death-reason"
DEATH_COUNT_HEADER = "x-modelfleet-delivery-count"
# Deliveries a task had before ``QueueKeeper.touch`` re-published it as a new message.
PRIOR_DELIVERIES_HEADER = "x-modelfleet-prior-deliveries"
# RabbitMQ's own headers.
DELIVERY_COUNT_HEADER = "x-delivery-count"  # quorum queues; absent or 0 on first delivery
FIRST_DEATH_REASON_HEADER = "x-first-death-reason"  # set when RabbitMQ dead-letters

# A lease must outlive the task it protects by this much: publish-to-broker latency,
# clock granularity, and the gap between our monotonic clock and RabbitMQ's timer.
LEASE_MARGIN_S = 5.0


def model_queue_arguments(settings: BrokerSettings, dead_letter_queue: str) -> dict[str, Any]:
    """Arguments of every model queue. Changing any of them for an existing queue makes
    RabbitMQ refuse the declare (PRECONDITION_FAILED), hence one function for all."""
    return {
        "x-queue-type": "quorum",
        # Explicit: RabbitMQ 4.x defaults to 20, 3.x to unlimited; the contract says ours.
        "x-delivery-limit": settings.delivery_limit,
        "x-expires": int(settings.queue_idle_expiry_s * 1000),
        # The default exchange routes by queue name straight to the dead-letter queue.
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": dead_letter_queue,
    }


def dead_letter_queue_arguments() -> dict[str, Any]:
    """The dead-letter queue: durable quorum, no expiry (it is an archive), no delivery
    limit (a DLQ consumer that keeps failing must not lose the evidence)."""
    return {"x-queue-type": "quorum"}


class QueueLeases:
    """Until when each model queue is sure to exist, as far as this process knows.

    RabbitMQ's ``x-expires`` on a quorum queue counts from the last ``basic.get`` or
    the last consumer leaving; publishing does NOT renew it, and neither does a
    re-declare (measured on 3.10: a re-declared queue still expires, with its
    messages, and the next declare silently creates an empty one). So before
    publishing a task we make sure the lease outlasts the task's deadline, and
    renew it (``QueueKeeper.touch``) when it might not. Pure bookkeeping, clock
    injected; a queue that vanished anyway is caught by the mandatory publish.

    The same leases count the live queues (``live``): those with a lease not yet run
    out, and those this process consumes (``hold``/``release``: a consumer keeps its
    queue alive, and its leaving starts a fresh lease). A lapsed lease is dropped
    (a heap of lease ends, O(log n) per renewal), so the table holds what is live,
    not every queue ever declared, and the next publish to it declares it again.
    """

    def __init__(self, expiry_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._expiry_s = expiry_s
        self._clock = clock
        self._lease_end: dict[str, float] = {}
        self._ends: list[tuple[float, str]] = []  # heap; entries a later renewal replaced linger
        self._held: dict[str, int] = {}

    def known(self, queue: str) -> bool:
        """Whether we declared it since the last reconnect (so its arguments match ours)
        and its lease has not lapsed since."""
        self._drop_lapsed()
        return queue in self._lease_end

    def needs_renewal(self, queue: str, task_remaining_s: float) -> bool:
        """True unless a renewal we made still covers ``task_remaining_s`` from now."""
        end = self._lease_end.get(queue)
        needed_until = self._clock() + max(task_remaining_s, 0.0) + LEASE_MARGIN_S
        return end is None or end < needed_until

    def renewed(self, queue: str, at: float) -> None:
        """Record a renewal that *started* at ``at`` (the server saw it after that)."""
        end = at + self._expiry_s
        self._lease_end[queue] = end
        heapq.heappush(self._ends, (end, queue))

    def hold(self, queue: str) -> None:
        """A consumer of this process opened on ``queue`` (declared, so it exists)."""
        self._held[queue] = self._held.get(queue, 0) + 1
        self.renewed(queue, self._clock())

    def release(self, queue: str) -> None:
        """That consumer left: the queue's expiry starts counting now."""
        left = self._held.get(queue, 0) - 1
        if left > 0:
            self._held[queue] = left
        else:
            self._held.pop(queue, None)
        self.renewed(queue, self._clock())

    def live(self) -> int:
        """Queues with a lease not yet run out, or a consumer in this process."""
        self._drop_lapsed()
        return len(self._lease_end)

    def _drop_lapsed(self) -> None:
        now = self._clock()
        ends = self._ends
        while ends and ends[0][0] <= now:
            end, queue = heapq.heappop(ends)
            if self._lease_end.get(queue) == end:
                if queue in self._held:
                    # Consumed: alive whatever the lease says; look again one expiry later.
                    self.renewed(queue, now)
                else:
                    del self._lease_end[queue]

    def now(self) -> float:
        return self._clock()

    def forget(self, queue: str) -> None:
        self._lease_end.pop(queue, None)

    def clear(self) -> None:
        """After a reconnect: nothing is known but the queues we consume (aio-pika
        declared those again before consuming)."""
        self._lease_end = {q: e for q, e in self._lease_end.items() if q in self._held}
        self._ends = [(e, q) for q, e in self._lease_end.items()]
        heapq.heapify(self._ends)

    def covers(self, task_remaining_s: float) -> bool:
        """Whether any lease can cover a task that lives this long (expiry long enough)."""
        return self._expiry_s >= task_remaining_s + LEASE_MARGIN_S


class ChannelSlot:
    """One channel for RPCs that RabbitMQ answers by closing the channel.

    A passive declare of a missing queue (404) or a declare with other arguments
    (406) kills the channel it was sent on. Such RPCs go through a slot of their
    own, so the error cannot break publishes or consumers elsewhere; after one,
    ``discard`` drops the dead channel and the next ``get`` opens a fresh one.
    (A robust channel would also reopen itself, but in the background and only after
    the caller already saw the error, so the next RPC could still meet the dead one.)
    """

    def __init__(self, connection: AbstractRobustConnection, publisher_confirms: bool) -> None:
        self._connection = connection
        self._confirms = publisher_confirms
        self._channel: AbstractRobustChannel | None = None

    async def get(self) -> AbstractRobustChannel:
        if self._channel is None or self._channel.is_closed:
            try:
                channel = self._connection.channel(publisher_confirms=self._confirms)
                await channel.initialize()
            except RuntimeError as exc:
                # aio-pika's "Connection was not opened", or aiormq's "<Connection ...>
                # closed" when the connection is lost while the channel opens (seen: the
                # keeper's renewal failed a publish with it instead of retrying).
                raise BrokerUnavailable("open a channel: the connection to RabbitMQ is "
                                        "down; reconnecting in the background") from exc
            self._channel = channel
        return self._channel

    async def discard(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await close_for_good(channel)


class ChannelPool:
    """A few ``ChannelSlot``s shared by concurrent callers, one caller per slot at a time.

    AMQP answers one synchronous RPC per channel at a time: with one channel, a burst of
    declares (a gateway meeting hundreds of models it has not seen) or of passive
    declares (``queue_stats``) waits in line for round trips; with a few, they overlap.
    """

    def __init__(self, connection: AbstractRobustConnection, size: int) -> None:
        self.size = size
        self._free: asyncio.Queue[ChannelSlot] = asyncio.Queue()
        for _ in range(size):
            self._free.put_nowait(ChannelSlot(connection, publisher_confirms=False))

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[ChannelSlot]:
        slot = await self._free.get()
        try:
            yield slot
        finally:
            self._free.put_nowait(slot)


async def close_for_good(channel: AbstractRobustChannel, timeout_s: float = 5.0) -> None:
    """Close a robust channel so that aio-pika never restores it; best effort.

    Also for a channel already dead with its connection: without this, the reconnect
    would re-open it and re-declare and re-consume what it had.
    """
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout_s):
            await channel.close()
