"""The consuming side of ``AmqpBroker``: subscriptions to model queues (and to the
dead-letter queue) and the deliveries they hand out.

Each consumer owns one robust channel and one ``asyncio.Queue`` fed by an aio-pika
callback; its async iterator reads that buffer. Across a reconnect aio-pika reopens
the channel, re-declares the queue and re-consumes with the same callback, so the
same iterator keeps yielding (we do not use aio-pika's own queue iterator: its
buffer is private, and we must drop the deliveries that died with the old channel
and return the prefetched ones on ``cancel``).

A message still in the buffer when its channel died is skipped: RabbitMQ has
already put it back (counted) and will deliver it again on the new channel.
A delivery handed out before the drop can no longer be settled: ``ack`` etc. raise
``BrokerUnavailable`` and RabbitMQ redelivers the task (at-least-once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aio_pika.abc import (
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustChannel,
    AbstractRobustConnection,
)
from aiormq.exceptions import ChannelInvalidStateError

from modelfleet.broker.rabbitmq.errors import rpc, translated
from modelfleet.broker.rabbitmq.topology import (
    DEATH_COUNT_HEADER,
    DEATH_REASON_HEADER,
    DELIVERY_COUNT_HEADER,
    FIRST_DEATH_REASON_HEADER,
    PRIOR_DELIVERIES_HEADER,
    close_for_good,
)
from modelfleet.errors import BrokerError, BrokerUnavailable
from modelfleet.messages import Task, decode_task

log = logging.getLogger(__name__)

# (body, reason, delivery count, source queue) -> published to the dead-letter queue.
DeadLetterPublisher = Callable[[bytes, str, int, str], Awaitable[None]]


def _header_int(headers: dict[str, Any], key: str) -> int:
    value = headers.get(key, 0)
    return value if isinstance(value, int) else 0


def _is_stale(message: AbstractIncomingMessage) -> bool:
    """Whether the channel this message came on is gone (so RabbitMQ took it back)."""
    try:
        message.channel  # noqa: B018 -- the property raises once the channel is closed
    except ChannelInvalidStateError:
        return True
    return False


class ReturnedUnstarted:
    """Request ids this process gave back unstarted (nack requeue), and how often.

    RabbitMQ 3.x counts every return toward a message's ``x-delivery-count``, so a task
    prefetched by a consumer that was cancelled (a runtime down, a queue dropped) came
    back "redelivered", a suspect (``Task.suspect``) sent to run alone in quarantine,
    though it never reached a runtime; the embedded broker and RabbitMQ 4.3+ do not
    count such a return. When it comes back to this process, its count is lowered by
    the returns counted here, so both brokers report the same. Bounded: the oldest ids
    are forgotten first (a task comes back within its deadline or never).
    """

    def __init__(self, capacity: int = 10_000) -> None:
        self._returned: dict[str, int] = {}
        self._capacity = capacity

    def returned(self, request_id: str) -> None:
        self._returned[request_id] = self._returned.pop(request_id, 0) + 1
        while len(self._returned) > self._capacity:
            self._returned.pop(next(iter(self._returned)))

    def returned_body(self, body: bytes) -> None:
        with contextlib.suppress(Exception):  # not a task: nothing to remember
            self.returned(decode_task(body).request_id)

    def deliveries(self, request_id: str, count: int) -> int:
        """``count`` less the returns of ``request_id`` counted here (forgotten then)."""
        return max(0, count - self._returned.pop(request_id, 0)) if self._returned else count


class AmqpDelivery:
    """One task handed out by an ``AmqpSubscription``. Settle it exactly once."""

    def __init__(self, sub: AmqpSubscription, message: AbstractIncomingMessage, task: Task,
                 death_reason: str) -> None:
        self._sub = sub
        self._message = message
        self._task = task
        self._death_reason = death_reason
        self._settled = False

    @property
    def task(self) -> Task:
        return self._task

    @property
    def body(self) -> bytes:
        return self._message.body

    @property
    def death_reason(self) -> str:
        return self._death_reason

    @property
    def stale(self) -> bool:
        """Its channel is gone: it can no longer be settled, and RabbitMQ took it back."""
        return _is_stale(self._message)

    def _begin(self) -> None:
        if self._settled:
            raise RuntimeError("delivery already settled")
        self._settled = True

    def _what(self, verb: str) -> str:
        return (f"{verb} task {self._task.request_id} from {self._sub.queue_name} "
                "(if its channel is gone, RabbitMQ redelivers it)")

    async def ack(self) -> None:
        self._begin()
        try:
            with translated(self._what("ack")):
                await self._message.ack()
        finally:
            self._sub.settled(self)

    async def reject(self, requeue: bool) -> None:
        """``requeue=True``: basic.reject, which counts toward the delivery limit on every
        RabbitMQ version (4.3+ counts reject but not nack). ``requeue=False`` drops the
        task: we ack it, because a basic.reject without requeue would dead-letter it
        (model queues have a dead-letter exchange), and "drop" is what the contract says."""
        self._begin()
        try:
            with translated(self._what("reject")):
                if requeue:
                    await self._message.reject(requeue=True)
                else:
                    await self._message.ack()
        finally:
            self._sub.settled(self)

    async def release(self) -> None:
        """basic.nack(requeue=True): RabbitMQ 4.3+ does not count it; 3.x counts it."""
        self._begin()
        try:
            with translated(self._what("release")):
                await self._message.nack(requeue=True)
            self._sub.returned.returned(self._task.request_id)
        finally:
            self._sub.settled(self)

    async def dead_letter(self, reason: str) -> None:
        """Publish the task to the dead-letter queue with ``reason`` (confirmed), then ack.

        A crash between the two leaves a duplicate, never a loss. If the publish fails
        the delivery stays unsettled, so the caller may retry or reject it.
        """
        self._begin()
        try:
            await self._sub.publish_dead_letter(self._message.body, reason,
                                                self._task.delivery_count, self._sub.queue_name)
        except BaseException:
            self._settled = False
            raise
        try:
            with translated(self._what("ack dead-lettered")):
                await self._message.ack()
        finally:
            self._sub.settled(self)


class AmqpSubscription:
    """A consumer on one model queue (or the dead-letter queue), on a channel of its own."""

    def __init__(self, *, model_id: str, queue_name: str, channel: AbstractRobustChannel,
                 prefetch: int, timeout_s: float, publish_dead_letter: DeadLetterPublisher,
                 delivery_limit: int, dead_letters: bool = False,
                 on_closed: Callable[[AmqpSubscription], None] = lambda _: None,
                 returned: ReturnedUnstarted | None = None) -> None:
        self._model_id = model_id
        self.returned = returned or ReturnedUnstarted()  # the broker's, shared by its consumers
        self.queue_name = queue_name
        self._channel = channel
        self._queue: AbstractQueue | None = None
        self._tag = ""
        self._prefetch = prefetch
        self._timeout_s = timeout_s
        self.publish_dead_letter = publish_dead_letter
        self._dead_letters = dead_letters
        self._delivery_limit = delivery_limit
        self._on_closed = on_closed
        self._buffer: asyncio.Queue[AbstractIncomingMessage | None] = asyncio.Queue()
        self._held: set[AmqpDelivery] = set()
        self._cancelled = False
        self._closing: asyncio.Future[None] | None = None

    @classmethod
    async def open(cls, connection: AbstractRobustConnection, *, arguments: dict[str, Any],
                   **kwargs: Any) -> AmqpSubscription:
        """Open a channel, set its prefetch, declare the queue and start consuming.

        The queue is declared *robustly*: after a reconnect aio-pika re-declares it and
        re-consumes, with the prefetch set here.
        """
        channel = connection.channel(publisher_confirms=False)
        sub = cls(channel=channel, **kwargs)
        try:
            async with rpc(f"subscribe to {sub.queue_name}", sub._timeout_s):
                await channel.initialize()
                await channel.set_qos(prefetch_count=sub._prefetch)
                sub._queue = await channel.declare_queue(sub.queue_name, durable=True,
                                                         arguments=arguments)
                sub._tag = await sub._queue.consume(sub._on_message)
        except BaseException:
            await close_for_good(channel)
            raise
        return sub

    @property
    def model_id(self) -> str:
        return self._model_id

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        if self._cancelled:
            # Arrived between our basic.cancel and its cancel-ok: give it straight back.
            with contextlib.suppress(Exception):
                await message.nack(requeue=True)
                self.returned.returned_body(message.body)
            return
        self._buffer.put_nowait(message)

    def _read_headers(self, message: AbstractIncomingMessage) -> tuple[int, str]:
        """(delivery count, death reason) of a message, from RabbitMQ's headers and ours."""
        headers = dict(message.headers or {})
        count = _header_int(headers, DELIVERY_COUNT_HEADER)
        if not self._dead_letters:
            # A task that QueueKeeper.touch re-published carries its earlier deliveries.
            return count + _header_int(headers, PRIOR_DELIVERIES_HEADER), ""
        reason = str(headers.get(DEATH_REASON_HEADER) or "")
        if reason:
            return count + _header_int(headers, DEATH_COUNT_HEADER), reason
        reason = str(headers.get(FIRST_DEATH_REASON_HEADER) or "")
        if reason == "delivery_limit":
            # RabbitMQ restarts x-delivery-count in the DLQ; at death the task had been
            # delivered limit+1 times, which is what the embedded broker reports.
            count += self._delivery_limit + 1
        return count, reason

    async def __aiter__(self) -> AsyncIterator[AmqpDelivery]:
        while True:
            message = await self._buffer.get()
            if message is None:
                self._buffer.put_nowait(None)  # every iterator of this subscription ends
                return
            if _is_stale(message):
                continue
            count, reason = self._read_headers(message)
            try:
                task = decode_task(message.body, count)
                if count and not self._dead_letters:
                    task = task.with_delivery_count(
                        self.returned.deliveries(task.request_id, count))
            except Exception:
                # Not a Task: nobody can process it. basic.reject without requeue sends it
                # to the dead-letter queue (reason 'rejected') from a model queue.
                log.exception("undecodable message on %s rejected", self.queue_name)
                with contextlib.suppress(Exception):
                    await message.reject(requeue=False)
                continue
            if not self._dead_letters and count > self._delivery_limit:
                # Only a re-published copy gets here (RabbitMQ's own limit restarted with
                # it): enforce the limit ourselves, as RabbitMQ would have.
                await self._dead_letter_over_limit(message, count)
                continue
            delivery = AmqpDelivery(self, message, task, reason)
            self._held.add(delivery)
            yield delivery

    async def _dead_letter_over_limit(self, message: AbstractIncomingMessage, count: int) -> None:
        try:
            await self.publish_dead_letter(message.body, "delivery_limit", count, self.queue_name)
            with translated(f"ack a dead-lettered task on {self.queue_name}"):
                await message.ack()
        except BrokerError:
            # Mostly a dropped connection, which hands the message back by itself.
            log.warning("could not dead-letter an over-limit task on %s; it stays unacked "
                        "until its channel closes", self.queue_name, exc_info=True)

    def settled(self, delivery: AmqpDelivery) -> None:
        self._held.discard(delivery)
        if self._cancelled:
            self._close_when_idle()

    async def set_prefetch(self, prefetch: int) -> None:
        """Change the window for deliveries from now on.

        RabbitMQ applies basic.qos only to consumers started after it, so we start a new
        consumer with the new window, then cancel the old one. Deliveries the old one
        already handed out stay valid and are not counted in the new window, so right
        after a *decrease* the consumer may briefly hold old + new; the worker's permits
        bound the work it starts.
        """
        prefetch = max(1, prefetch)
        if prefetch == self._prefetch or self._cancelled or self._queue is None:
            return
        if self._channel.is_closed:  # disconnected: say so now rather than at the timeout
            raise BrokerUnavailable(f"set prefetch on {self.queue_name}: not connected")
        async with rpc(f"set prefetch on {self.queue_name}", self._timeout_s):
            await self._channel.set_qos(prefetch_count=prefetch)
            old, self._tag = self._tag, await self._queue.consume(self._on_message)
            await self._queue.cancel(old)
        self._prefetch = prefetch

    async def cancel(self) -> None:
        """Stop receiving; hand back what was prefetched but not yet taken out of the iterator.

        Those messages are returned with basic.nack(requeue=True). RabbitMQ 4.3+ does not
        count a nack toward the delivery limit (the embedded broker doesn't either); 3.x
        counts every return, so there each such message gains one delivery. The window is
        tiny (the prefetch), and the alternative (keeping them) would strand them until
        the channel closes. Deliveries already handed out stay settleable: the channel
        closes once they all are.
        """
        if self._cancelled:
            return
        self._cancelled = True
        if self._channel.is_closed:
            # Disconnected: the consumer died with the channel. Closing the robust channel
            # on purpose keeps aio-pika from restoring it (and the consumer) on reconnect;
            # what it had handed out is stale already.
            await close_for_good(self._channel)
        elif self._queue is not None:
            # aio-pika forgets the consumer before the RPC, so a reconnect won't restore it
            # even if the RPC fails half-way.
            with contextlib.suppress(BrokerUnavailable):
                async with rpc(f"cancel consumer on {self.queue_name}", self._timeout_s):
                    await self._queue.cancel(self._tag)
        while not self._buffer.empty():
            message = self._buffer.get_nowait()
            if message is not None and not _is_stale(message):
                with contextlib.suppress(Exception):
                    await message.nack(requeue=True)
                    self.returned.returned_body(message.body)
        self.stop()
        self._close_when_idle()

    def stop(self) -> None:
        """End iteration now (the broker is closing); no RPCs."""
        self._buffer.put_nowait(None)
        self._on_closed(self)

    def _close_when_idle(self) -> None:
        """Close the channel once no live delivery needs it (closing returns unacked ones)."""
        if self._channel.is_closed or self._closing is not None:
            return
        if any(not delivery.stale for delivery in self._held):
            return
        self._closing = asyncio.ensure_future(close_for_good(self._channel))
