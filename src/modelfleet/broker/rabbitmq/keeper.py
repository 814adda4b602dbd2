"""``QueueKeeper``: declares model queues and keeps them alive while tasks wait in them.

A quorum queue with ``x-expires`` is deleted, messages and all, once nobody has
consumed from it or ``basic.get`` it for the expiry period; publishing and
re-declaring do not count (RabbitMQ 3.10, measured). A gateway that publishes a
task into a queue nobody consumes must therefore renew the lease itself, or the
task can vanish before its deadline. Renewing = one ``basic.get``:

- the queue is empty: the get renews the lease and has no other effect;
- it is not: the get took the head task. We publish it again as a new message
  (confirmed, carrying its delivery count in a header so the count and the
  delivery limit stay exact) and then ack the original. Returning it with a
  nack instead would count as a failed delivery on RabbitMQ < 4.3, and enough
  gateways touching a cold queue could dead-letter a task never processed.
  The task moves to the back of its queue; that is the whole cost.

A declare that reports a consumer on the queue needs no get: a consumed queue cannot
expire, and its lease starts afresh when the last consumer leaves.

Renewals are rare: on the first publish of this process to a queue, and when the
lease we last saw no longer covers a task's deadline (with the default 5 min
expiry and 2 min deadlines, about once every 3 minutes per busy queue and gateway).

The keeper works on a connection of its own. RabbitMQ answers a ``basic.get`` it
cannot carry out with a connection-level error: on a loaded node, a get on a quorum
queue a moment after its declare once met ``INTERNAL_ERROR ... noproc`` (the queue's
process not there), and on the connection that carries the work that cost every
publish and consumer of the process a reconnect (requests answered 503). On its own
connection it costs one renewal, tried again once the connection is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aio_pika.abc import AbstractRobustConnection
from aiormq.exceptions import ChannelClosed, ChannelNotFoundEntity, ChannelPreconditionFailed

from modelfleet.broker.rabbitmq.errors import rpc
from modelfleet.broker.rabbitmq.topology import (
    DELIVERY_COUNT_HEADER,
    PRIOR_DELIVERIES_HEADER,
    ChannelPool,
    ChannelSlot,
    QueueLeases,
    model_queue_arguments,
)
from modelfleet.errors import BrokerError, BrokerUnavailable
from modelfleet.settings import BrokerSettings

log = logging.getLogger("modelfleet.broker")

# Channels for declares and renewals: a burst of first publishes to new models overlaps
# its round trips (a quorum queue's creation costs the node ~10 ms of work).
KEEPER_CHANNELS = 4

# (body, queue name, headers) -> published to that queue, persistent and confirmed.
Republisher = Callable[[bytes, str, dict[str, Any]], Awaitable[None]]


def _header_int(headers: dict[str, Any], key: str) -> int:
    value = headers.get(key, 0)
    return value if isinstance(value, int) else 0


class QueueKeeper:
    """Declares model queues on first use and renews their leases before they lapse."""

    def __init__(self, settings: BrokerSettings, dead_letter_queue: str,
                 leases: QueueLeases, republish: Republisher) -> None:
        self._arguments = model_queue_arguments(settings, dead_letter_queue)
        self._timeout_s = settings.declare_timeout_s
        self._leases = leases
        self._republish = republish
        self._connection: AbstractRobustConnection | None = None
        self._pool: ChannelPool | None = None
        self._pending: dict[str, asyncio.Future[None]] = {}

    def attach(self, connection: AbstractRobustConnection) -> None:
        """Work on ``connection``, the keeper's own (see the module docstring)."""
        self._connection = connection
        # Channels of its own (a 404 or 406 closes the channel it happens on), several so
        # that a burst of new models is declared in overlapping round trips.
        self._pool = ChannelPool(connection, KEEPER_CHANNELS)

    async def ensure(self, queue: str, task_remaining_s: float) -> None:
        """Return once ``queue`` exists with our arguments and will outlive the task."""
        if not self._leases.needs_renewal(queue, task_remaining_s):
            return
        pending = self._pending.get(queue)
        if pending is None:
            # Concurrent publishers to one queue share one renewal (a burst on a cold
            # model must not become a burst of RPCs).
            pending = asyncio.ensure_future(self._renew(queue))
            self._pending[queue] = pending
            pending.add_done_callback(lambda _: self._pending.pop(queue, None))
            # Retrieved here too, so an exception nobody awaited is not reported as lost.
            pending.add_done_callback(lambda f: f.cancelled() or f.exception())
        # Shielded: one cancelled publisher must not cancel the renewal others wait for.
        await asyncio.shield(pending)

    async def _renew(self, queue: str) -> None:
        """Renew once; if the keeper's connection was lost meanwhile, once more when it
        is back (within the declare timeout), so a connection-level error RabbitMQ
        raised on one renewal costs no publish."""
        try:
            await self._renew_once(queue)
        except BrokerUnavailable as exc:
            if not await self._reconnected():
                raise
            log.info("renewing the lease of %s again on the keeper's new connection "
                     "(%s)", queue, exc)
            await self._renew_once(queue)

    async def _reconnected(self) -> bool:
        """True once the keeper's connection is up again after a loss (False: it was
        never lost, or is not back within the declare timeout)."""
        connection = self._connection
        if connection is None or connection.is_closed:
            return False
        transport = connection.transport
        if connection.connected.is_set() and transport is not None \
                and not transport.connection.is_closed:
            return False  # up all along: the error was not the connection's
        try:
            async with asyncio.timeout(self._timeout_s):
                await connection.connected.wait()
        except TimeoutError:
            return False
        return True

    async def _renew_once(self, queue: str) -> None:
        assert self._pool is not None
        started = self._leases.now()
        async with self._pool.slot() as slot:
            consumed = False
            if not self._leases.known(queue):
                # First use since (re)connecting, or since its lease lapsed: a declare
                # creates it (with a fresh lease) or checks an existing one's arguments.
                consumed = await self._declare(slot, queue)
            if not consumed:
                await self._touch(slot, queue)
        self._leases.renewed(queue, started)

    async def _declare(self, slot: ChannelSlot, queue: str) -> bool:
        """Declare ``queue``; True when it has a consumer (so it cannot expire now)."""
        async with rpc(f"declare queue {queue}", self._timeout_s):
            channel = await slot.get()
            try:
                declared = await channel.declare_queue(queue, durable=True,
                                                       arguments=self._arguments, robust=False)
            except ChannelPreconditionFailed as exc:
                await slot.discard()
                raise BrokerError(
                    f"declare queue {queue}: it exists with other arguments ({exc}); keep "
                    "delivery_limit/queue_idle_expiry_s as they were or delete the queue"
                ) from exc
            except ChannelClosed:
                await slot.discard()
                raise
        return bool(declared.declaration_result.consumer_count)

    async def _touch(self, slot: ChannelSlot, queue: str) -> None:
        """Renew the queue's lease with a ``basic.get`` (see the module docstring)."""
        async with rpc(f"renew the lease of queue {queue}", self._timeout_s):
            channel = await slot.get()
            handle = await channel.get_queue(queue, ensure=False)
            try:
                message = await handle.get(no_ack=False, fail=False, timeout=None)
            except ChannelNotFoundEntity:
                # Gone since we declared it (expired, deleted): a declare makes a new one.
                await slot.discard()
                message = None
                await self._declare(slot, queue)
            except ChannelClosed:
                await slot.discard()
                raise
        if message is None:
            return
        headers = dict(message.headers or {})
        prior = (_header_int(headers, PRIOR_DELIVERIES_HEADER)
                 + _header_int(headers, DELIVERY_COUNT_HEADER))
        try:
            await self._republish(message.body, queue, {PRIOR_DELIVERIES_HEADER: prior})
        except BaseException:
            # Not re-published: hand the original back (a channel close would, too).
            with contextlib.suppress(Exception):
                await message.nack(requeue=True)
            raise
        async with rpc(f"ack the re-published head of {queue}", self._timeout_s):
            await message.ack()
