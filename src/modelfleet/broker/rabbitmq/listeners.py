"""The broadcast and reply side of ``AmqpBroker``: gateway inboxes and event listeners.

Both are classic queues, exclusive to our connection (quorum queues cannot be
exclusive), consumed with auto-ack into a buffer that the async iterator reads.
Declared robustly, so after a reconnect aio-pika re-declares, re-binds and
re-consumes them under the same names, and the same iterators resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from aio_pika.abc import (
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustChannel,
    AbstractRobustConnection,
)

from modelfleet.broker.rabbitmq import codec
from modelfleet.broker.rabbitmq.errors import rpc
from modelfleet.broker.rabbitmq.topology import close_for_good
from modelfleet.errors import BrokerError
from modelfleet.messages import Reply, decode_event, decode_reply

log = logging.getLogger(__name__)

EVENT_BUFFER = 1024  # per listener; a slow listener loses the oldest events (as in memory)


class AmqpInbox:
    """A gateway's reply queue: classic, exclusive to our connection, auto-delete.

    Named by us (``<queue_prefix>_inbox.<uuid>``) rather than by the server, so that after a
    reconnect aio-pika re-declares it under the *same* name and the reply address that
    rides in tasks already queued stays valid. Replies published while we were
    disconnected are returned to their publisher (``publish_reply`` -> False).
    Consumed with auto-ack: the queue dies with the gateway, so there is nothing to
    redeliver to.
    """

    def __init__(self, channel: AbstractRobustChannel, address: str, timeout_s: float,
                 on_closed: Callable[[AmqpInbox], None]) -> None:
        self._channel = channel
        self._address = address
        self._timeout_s = timeout_s
        self._on_closed = on_closed
        self._queue: AbstractQueue | None = None
        self._tag = ""
        self._replies: asyncio.Queue[Reply | None] = asyncio.Queue()

    @classmethod
    async def open(cls, connection: AbstractRobustConnection, timeout_s: float,
                   on_closed: Callable[[AmqpInbox], None], prefix: str) -> AmqpInbox:
        channel = connection.channel(publisher_confirms=False)
        inbox = cls(channel, f"{prefix}_inbox.{uuid.uuid4().hex}", timeout_s, on_closed)
        try:
            async with rpc("open a reply inbox", timeout_s):
                await channel.initialize()
                inbox._queue = await channel.declare_queue(
                    inbox._address, exclusive=True, auto_delete=True)
                inbox._tag = await inbox._queue.consume(inbox._on_message, no_ack=True)
        except BaseException:
            await close_for_good(channel)
            raise
        return inbox

    @property
    def address(self) -> str:
        return self._address

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        try:
            self._replies.put_nowait(decode_reply(
                codec.unpack(message.body, message.content_encoding)))
        except Exception:
            log.exception("undecodable reply on %s dropped", self._address)

    async def __aiter__(self) -> AsyncIterator[Reply]:
        while True:
            reply = await self._replies.get()
            if reply is None:
                self._replies.put_nowait(None)
                return
            yield reply

    def stop(self) -> None:
        self._replies.put_nowait(None)
        self._on_closed(self)

    async def close(self) -> None:
        """Delete the queue (later replies are returned to their publishers) and end iteration."""
        self.stop()
        if not self._channel.is_closed and self._queue is not None:
            # BrokerError too: the auto-delete may beat our delete (a 404 on some versions).
            with contextlib.suppress(BrokerError):
                async with rpc(f"close inbox {self._address}", self._timeout_s):
                    # Our consumer first (else RabbitMQ cancels it and aiormq logs that),
                    # then the queue, explicitly: auto-delete happens after the fact, and a
                    # reply published in between would be taken as delivered.
                    await self._queue.cancel(self._tag)
                    await self._queue.delete(if_unused=False, if_empty=False)
        # Also when disconnected (the queue died with the connection): never restore it.
        await close_for_good(self._channel, self._timeout_s)


class EventListener:
    """One ``events()`` iterator: an exclusive auto-delete classic queue bound to the
    fanout exchange, consumed with auto-ack into a bounded buffer."""

    def __init__(self, channel: AbstractRobustChannel, queue_name: str, timeout_s: float,
                 on_closed: Callable[[EventListener], None]) -> None:
        self._channel = channel
        self.queue_name = queue_name
        self._timeout_s = timeout_s
        self._on_closed = on_closed
        self._events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(EVENT_BUFFER)

    @classmethod
    async def open(cls, connection: AbstractRobustConnection, exchange: str, timeout_s: float,
                   on_closed: Callable[[EventListener], None], prefix: str) -> EventListener:
        channel = connection.channel(publisher_confirms=False)
        listener = cls(channel, f"{prefix}_events.{uuid.uuid4().hex}", timeout_s, on_closed)
        try:
            async with rpc("listen to events", timeout_s):
                await channel.initialize()
                queue = await channel.declare_queue(
                    listener.queue_name, exclusive=True, auto_delete=True)
                await queue.bind(exchange, routing_key="")
                await queue.consume(listener._on_message, no_ack=True)
        except BaseException:
            await close_for_good(channel)
            raise
        return listener

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        try:
            event = decode_event(message.body)
        except Exception:
            log.warning("undecodable event dropped", exc_info=True)
            return
        if self._events.full():
            self._events.get_nowait()  # a slow listener loses the oldest event, not the newest
        self._events.put_nowait(event)

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            event = await self._events.get()
            if event is None:
                return
            yield event

    def stop(self) -> None:
        if self._events.full():
            self._events.get_nowait()
        self._events.put_nowait(None)
        self._on_closed(self)

    async def close(self) -> None:
        self._on_closed(self)
        # The queue is exclusive and auto-delete: closing the channel cancels the consumer
        # and RabbitMQ deletes it (or it died with the connection already).
        await close_for_good(self._channel, self._timeout_s)
