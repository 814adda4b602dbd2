"""``AmqpBroker``: the Broker protocol on RabbitMQ (3.10+), through aio-pika.

Topology (see ``amqp_topology`` for why each queue has the type it has):

- one durable quorum queue per model, ``queue_prefix + model_id``, declared on first
  publish or subscribe, expiring after ``queue_idle_expiry_s`` unused (5 min by default:
  the live queue count follows demand, see ``live_queues``), with an
  explicit delivery limit and the dead-letter queue as its dead-letter target.
  Publishing does not keep a quorum queue alive, so a publisher renews the lease
  of a queue its task waits in (``amqp_keeper``): no accepted task is lost to expiry
  as long as ``queue_idle_expiry_s`` exceeds the longest deadline (plus 5 s);
- the dead-letter queue (durable quorum, no expiry);
- one classic exclusive inbox per gateway, and one classic exclusive queue per
  ``events()`` iterator bound to the fanout exchange ``modelfleet.events``; both named
  under ``queue_prefix`` (``<prefix>_inbox.<uuid>``, ``<prefix>_events.<uuid>``: a model
  id cannot start with ``_``, so they never meet a model queue).

Every task is published with an AMQP ``expiration`` of the time left until its
deadline (a re-published copy too): a task nobody took in time leaves its queue by
itself instead of inflating the backlog that workers score. Quorum queues honour
per-message TTL from RabbitMQ 3.10 (checked at the head of the queue, also with no
consumer); what expires is dead-lettered like the rest, with reason ``expired``.

Connections: three robust connections per broker, one for the work (publishes,
consumers), one for counting (``queue_stats``' passive declares) and one for the
keeper (model queues' declares and lease renewals): RabbitMQ answers some failures
of those with a connection-level close, which then costs only counts or one
renewal, never the work in flight (``amqp_keeper``). The
*first* connect fails loudly (``BrokerUnavailable``, one line: URL without password,
cause); later drops are repaired in the background by aio-pika, which reopens every
channel, re-declares what was declared robustly and re-consumes, so subscriptions,
inboxes and event iterators resume by themselves. While disconnected, every call raises
``BrokerUnavailable`` at once instead of waiting; every RPC has a deadline
(``declare_timeout_s``, also used for publish confirms).

Why counting has a connection of its own: RabbitMQ answers a passive declare of a
missing queue by closing its channel, and aiormq frees that channel's number when the
close arrives, before its Close-Ok is written (and drops the Close-Ok when its write
buffer is full). A channel opened on the same connection in that moment takes the same
number, and RabbitMQ closes the whole connection ("second 'channel.open' seen"). On one
connection that took every consumer and publish with it (round 6's 5,000-model run: two
reconnects a minute, one 504); on the counting connection it costs one count.

Channels: one for publishing (confirms, mandatory, returns raise), one for model
queue declares and lease renewals, one per subscription, inbox and event iterator
(prefetch and consumer recovery are per channel); on the counting connection a few for
passive declares (``rabbitmq.stats``), each reopened after a 404 closed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import aio_pika
from aio_pika import DeliveryMode, ExchangeType, RobustConnection
from aio_pika.abc import (
    AbstractExchange,
    AbstractRobustChannel,
    AbstractRobustConnection,
)
from aiormq.exceptions import PublishError
from yarl import URL

from modelfleet.broker.base import DEAD_LETTER_QUEUE, QueueStats
from modelfleet.broker.live_queues import LiveQueueWatch
from modelfleet.broker.rabbitmq import codec
from modelfleet.broker.rabbitmq.consumers import AmqpSubscription, ReturnedUnstarted
from modelfleet.broker.rabbitmq.errors import rpc
from modelfleet.broker.rabbitmq.keeper import QueueKeeper
from modelfleet.broker.rabbitmq.listeners import AmqpInbox, EventListener
from modelfleet.broker.rabbitmq.side_connection import SideConnection
from modelfleet.broker.rabbitmq.stats import STATS_CHANNELS, passive_declare_all
from modelfleet.broker.rabbitmq.topology import (
    DEATH_COUNT_HEADER,
    DEATH_REASON_HEADER,
    LEASE_MARGIN_S,
    ChannelPool,
    QueueLeases,
    dead_letter_queue_arguments,
    model_queue_arguments,
)
from modelfleet.errors import BrokerError, BrokerUnavailable, ConfigError
from modelfleet.messages import (
    EncodedReply,
    Task,
    decode_task,
    encode_event,
    encode_task,
    now_ms,
)
from modelfleet.redaction import redact_url
from modelfleet.settings import BrokerSettings

log = logging.getLogger(__name__)

EVENTS_EXCHANGE = "modelfleet.events"
MSGPACK = "application/msgpack"


class _Returned(Exception):  # an internal signal: never leaves this module
    """RabbitMQ returned a mandatory message: no queue by that name."""


class _Stoppable(Protocol):
    def stop(self) -> None: ...


def _time_left_s(task: Task) -> float:
    """The task's AMQP expiration: the time left until its deadline (at least 1 ms, as
    RabbitMQ reads 0 as "deliver now or never")."""
    return max(0.001, (task.deadline_ms - now_ms()) / 1000)


class AmqpBroker:
    """The Broker protocol on RabbitMQ. Connect once, share it across the process.

    ``dead_letter_queue``, ``events_exchange`` and ``connection_name`` exist so that
    several deployments (or test runs) can share one vhost without seeing each
    other's dead letters and events; production leaves the defaults.
    """

    def __init__(self, settings: BrokerSettings, *, dead_letter_queue: str = DEAD_LETTER_QUEUE,
                 events_exchange: str = EVENTS_EXCHANGE, connection_name: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if URL(settings.url).scheme not in ("amqp", "amqps"):
            raise ConfigError(f"broker url {redact_url(settings.url)!r} is not amqp:// or amqps://")
        self._settings = settings
        self._url = redact_url(settings.url)
        self._dead_letter_queue = dead_letter_queue
        self._events_exchange_name = events_exchange
        self._connection_name = (
            connection_name or f"modelfleet {socket.gethostname()} pid {os.getpid()}")
        self._timeout_s = settings.declare_timeout_s
        self._leases = QueueLeases(settings.queue_idle_expiry_s, clock)
        self._watch = LiveQueueWatch(settings, self._leases.live, f"RabbitMQ at {self._url}")
        self._keeper = QueueKeeper(settings, dead_letter_queue, self._leases,
                                   self._republish_copy)
        self._warned_short_expiry = False
        # Tasks its consumers gave back unstarted: not counted as deliveries when they
        # come back (RabbitMQ 3.x counts them; consumers.ReturnedUnstarted).
        self._returned = ReturnedUnstarted()
        self._connection: AbstractRobustConnection | None = None
        self._counting: AbstractRobustConnection | None = None  # queue_stats' own
        self._counting_side: SideConnection | None = None
        self._keeper_side: SideConnection | None = None  # the keeper's own
        self._publisher: AbstractRobustChannel | None = None
        self._events_exchange: AbstractExchange | None = None
        self._stats: ChannelPool | None = None
        self._consumers: set[_Stoppable] = set()
        self._connected = False
        self._closed = False

    @property
    def connected(self) -> bool:
        return self._connected

    # -- lifecycle ---------------------------------------------------------------------

    async def connect(self) -> None:
        """Connect and declare the shared topology; BrokerUnavailable if that fails."""
        if self._closed:
            raise BrokerUnavailable("connect: this broker was closed; make a new one")
        if self._connection is not None:
            return
        opened: list[AbstractRobustConnection] = []
        try:
            for name in ("", " counts", " leases"):
                opened.append(await self._open_connection(
                    f"{self._connection_name}{name}".strip()))
        except BaseException:
            for each in opened:
                await each.close()
            raise
        connection, counting, leasing = opened
        try:
            async with rpc(f"declare topology on {self._url}", self._timeout_s):
                self._publisher = connection.channel(publisher_confirms=True,
                                                     on_return_raises=True)
                await self._publisher.initialize()
                # Declared robustly on the publishing channel: re-declared on every reconnect,
                # before any consumer channel could need them.
                await self._publisher.declare_queue(self._dead_letter_queue, durable=True,
                                                    arguments=dead_letter_queue_arguments())
                self._events_exchange = await self._publisher.declare_exchange(
                    self._events_exchange_name, ExchangeType.FANOUT, durable=True)
        except BaseException:
            for each in opened:
                await each.close()
            raise
        self._keeper.attach(leasing)
        self._stats = ChannelPool(counting, STATS_CHANNELS)
        self._watch.export()
        connection.close_callbacks.add(self._on_connection_lost)
        connection.reconnect_callbacks.add(self._on_reconnected)
        self._connection = connection
        self._counting = counting
        self._counting_side = SideConnection(counting, "counting", "counts fail until it "
                                             "is back", self._url, lambda: self._closed)
        self._keeper_side = SideConnection(leasing, "keeper's", "first publishes to a queue "
                                           "wait for it to be back", self._url,
                                           lambda: self._closed)
        self._connected = True

    async def _open_connection(self, name: str) -> AbstractRobustConnection:
        """A robust connection, connected; BrokerUnavailable (one line) if it cannot be."""
        settings = self._settings
        connection = RobustConnection(
            URL(settings.url),
            client_properties={"connection_name": name},
            # aio-pika retries at a fixed interval (first retry at once): the max backoff.
            reconnect_interval=settings.reconnect_max_backoff_s,
        )
        try:
            async with asyncio.timeout(settings.connect_timeout_s):
                await connection.connect(timeout=settings.connect_timeout_s)
        except Exception as exc:
            # Also stops aio-pika's reconnect loop, which would otherwise keep trying.
            with contextlib.suppress(Exception):
                await connection.close()
            cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            password = URL(settings.url).password
            if password:
                cause = cause.replace(password, "***")
            raise BrokerUnavailable(f"cannot connect to RabbitMQ at {self._url}: {cause}") from exc
        return connection

    def _on_connection_lost(self, _sender: object, exc: BaseException | None = None) -> None:
        # Also called for every failed reconnect attempt: log the transition only.
        if self._closed or not self._connected:
            return
        self._connected = False
        # A queue may expire or vanish while we cannot see it: check before trusting it.
        self._leases.clear()
        log.warning("lost the connection to RabbitMQ at %s (%r); reconnecting", self._url, exc)

    def _on_reconnected(self, _sender: object) -> None:
        # aio-pika calls this after every channel, queue and consumer was restored.
        self._connected = True
        log.info("reconnected to RabbitMQ at %s", self._url)

    async def close(self) -> None:
        """Stop every iterator, then close the connection.

        Settle or finish deliveries first: closing returns unacked ones to their queues
        (RabbitMQ counts that as a delivery).
        """
        if self._closed:
            return
        self._watch.unexport()
        # 1. From now on every call raises BrokerUnavailable and drops are not repaired.
        self._closed = True
        self._connected = False
        # 2. End subscription, inbox and event iterators so consumer loops return.
        for consumer in list(self._consumers):
            consumer.stop()
        # 3. Close the connections with all their channels.
        sides = (self._counting_side, self._keeper_side)
        for connection in (self._connection, *(side.connection for side in sides if side)):
            if connection is not None:
                with contextlib.suppress(Exception):
                    await connection.close()

    def _require(self, what: str) -> AbstractRobustConnection:
        """The connection, or BrokerUnavailable at once (never wait on an outage)."""
        if self._closed:
            raise BrokerUnavailable(f"{what}: the broker is closed")
        if self._connection is None:
            raise BrokerUnavailable(f"{what}: not connected yet (call connect() first)")
        if not self._connected:
            raise BrokerUnavailable(f"{what}: RabbitMQ at {self._url} is unreachable; "
                                    "reconnecting in the background")
        return self._connection

    def _require_counting(self, what: str) -> None:
        """Both connections up, or BrokerUnavailable at once: a count through a broker
        that cannot take work would mislead, and one whose counting connection is down
        cannot count."""
        self._require(what)
        if self._counting_side is not None and not self._counting_side.up:
            raise BrokerUnavailable(f"{what}: the counting connection to RabbitMQ at "
                                    f"{self._url} is down; reconnecting in the background")

    def _track(self, consumer: _Stoppable) -> None:
        self._consumers.add(consumer)

    def _untrack(self, consumer: _Stoppable) -> None:
        self._consumers.discard(consumer)

    # -- publishing --------------------------------------------------------------------

    def _queue_name(self, model_id: str) -> str:
        return self._settings.queue_prefix + model_id

    async def _publish(self, body: bytes, routing_key: str, what: str, *, persistent: bool,
                       headers: dict[str, Any] | None = None,
                       expiration_s: float | None = None,
                       content_encoding: str | None = None) -> None:
        """Publish through the default exchange, mandatory, and wait for the confirm.

        Raises ``_Returned`` when no queue has that name.
        """
        self._require(what)
        assert self._publisher is not None
        message = aio_pika.Message(
            body, headers=headers, content_type=MSGPACK, content_encoding=content_encoding,
            expiration=expiration_s,
            delivery_mode=DeliveryMode.PERSISTENT if persistent else DeliveryMode.NOT_PERSISTENT)
        async with rpc(what, self._timeout_s):
            try:
                await self._publisher.default_exchange.publish(message, routing_key,
                                                               mandatory=True)
            except PublishError as exc:
                raise _Returned(routing_key) from exc

    async def publish_task(self, task: Task, queue: str | None = None) -> None:
        """Durably enqueue ``task``: persistent, confirmed, onto a queue whose lease
        outlasts the task's deadline (its model's, or ``queue``: the cold lane)."""
        name = self._queue_name(queue or task.model_id)
        what = f"publish task {task.request_id} to {name}"
        self._require(what)
        remaining_s = (task.deadline_ms - now_ms()) / 1000
        if not self._leases.covers(remaining_s) and not self._warned_short_expiry:
            self._warned_short_expiry = True
            log.warning("queue_idle_expiry_s=%s does not cover a task deadline of %.0f s "
                        "plus %.0f s: an idle queue may expire with such a task in it; "
                        "raise the expiry", self._settings.queue_idle_expiry_s, remaining_s,
                        LEASE_MARGIN_S)
        declared = not self._leases.known(name)
        await self._keeper.ensure(name, remaining_s)
        if declared:
            self._watch.check()
        body = encode_task(task)
        try:
            await self._publish(body, name, what, persistent=True,
                                expiration_s=_time_left_s(task))
        except _Returned:
            # The queue vanished although our lease said otherwise (deleted by hand,
            # expired while we were away): declare it again and publish once more.
            self._leases.forget(name)
            await self._keeper.ensure(name, remaining_s)
            try:
                await self._publish(body, name, what, persistent=True,
                                    expiration_s=_time_left_s(task))
            except _Returned as exc:
                raise BrokerError(f"{what}: RabbitMQ returned it twice (queue deleted "
                                  "as soon as declared?)") from exc

    async def _republish_copy(self, body: bytes, queue: str, headers: dict[str, Any]) -> None:
        try:
            task: Task | None = decode_task(body)
        except Exception:  # not ours to judge here: the consumer dead-letters what it cannot read
            task = None
        try:
            await self._publish(body, queue, f"re-publish a task to {queue}", persistent=True,
                                headers=headers,
                                expiration_s=_time_left_s(task) if task is not None else None)
        except _Returned as exc:
            raise BrokerUnavailable(f"re-publish a task to {queue}: the queue vanished") from exc

    async def republish(self, task: Task) -> None:
        """A new message: RabbitMQ's delivery count starts again from zero."""
        await self.publish_task(task.with_delivery_count(0))

    async def publish_reply(self, address: str, reply: EncodedReply) -> bool:
        """True once RabbitMQ confirmed it; False when no inbox has that address.

        Transient: the inbox is not durable either, and dies with its gateway. Large
        replies are compressed on the way (``codec``).
        """
        if len(address.encode()) > 255:  # not a queue name AMQP can route to
            return False
        body, encoding = codec.pack(reply.data, self._settings.compress_threshold_bytes)
        try:
            await self._publish(body, address,
                                f"publish reply {reply.request_id} to {address}",
                                persistent=False, content_encoding=encoding)
        except _Returned:
            return False
        return True

    async def _publish_dead_letter(self, body: bytes, reason: str, delivery_count: int,
                                   source: str) -> None:
        headers = {DEATH_REASON_HEADER: reason, DEATH_COUNT_HEADER: delivery_count,
                   "x-modelfleet-source-queue": source}
        try:
            await self._publish(body, self._dead_letter_queue,
                                f"dead-letter a task from {source}", persistent=True,
                                headers=headers)
        except _Returned as exc:
            raise BrokerError(f"the dead-letter queue {self._dead_letter_queue} is missing"
                              ) from exc

    async def publish_event(self, event: dict[str, Any]) -> None:
        """Broadcast, transient, confirmed; nobody listening is not an error."""
        what = f"publish event {event.get('kind', '?')}"
        self._require(what)
        assert self._events_exchange is not None
        message = aio_pika.Message(encode_event(event), content_type=MSGPACK,
                                   delivery_mode=DeliveryMode.NOT_PERSISTENT)
        async with rpc(what, self._timeout_s):
            await self._events_exchange.publish(message, routing_key="", mandatory=False)

    # -- consuming ---------------------------------------------------------------------

    async def subscribe(self, model_id: str, prefetch: int) -> AmqpSubscription:
        name = self._queue_name(model_id)
        connection = self._require(f"subscribe to {name}")
        released = False

        def closed(sub: AmqpSubscription) -> None:
            nonlocal released
            self._untrack(sub)
            if not released:  # stop() may run twice (cancel, then the broker's close)
                released = True
                self._leases.release(name)

        sub = await AmqpSubscription.open(
            connection, arguments=model_queue_arguments(self._settings, self._dead_letter_queue),
            model_id=model_id, queue_name=name, prefetch=max(1, prefetch),
            timeout_s=self._timeout_s, publish_dead_letter=self._publish_dead_letter,
            delivery_limit=self._settings.delivery_limit, on_closed=closed,
            returned=self._returned)
        # A consumer keeps the queue alive, and its leaving renews the lease.
        self._leases.hold(name)
        self._watch.check()
        self._track(sub)
        return sub

    async def subscribe_dead_letters(self, prefetch: int) -> AmqpSubscription:
        connection = self._require("subscribe to the dead-letter queue")
        sub = await AmqpSubscription.open(
            connection, arguments=dead_letter_queue_arguments(), model_id="",
            queue_name=self._dead_letter_queue, prefetch=max(1, prefetch),
            timeout_s=self._timeout_s, publish_dead_letter=self._publish_dead_letter,
            dead_letters=True, delivery_limit=self._settings.delivery_limit,
            on_closed=self._untrack)
        self._track(sub)
        return sub

    async def open_inbox(self) -> AmqpInbox:
        connection = self._require("open a reply inbox")
        inbox = await AmqpInbox.open(connection, self._timeout_s, self._untrack,
                                     self._settings.queue_prefix)
        self._track(inbox)
        return inbox

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Events published after the first ``__anext__`` (that is when the queue gets
        bound; earlier ones are missed, as with the embedded broker) until close."""
        connection = self._require("listen to events")
        listener = await EventListener.open(connection, self._events_exchange_name,
                                            self._timeout_s, self._untrack,
                                            self._settings.queue_prefix)
        self._track(listener)
        try:
            async for event in listener:
                yield event
        finally:
            await listener.close()

    # -- inspection --------------------------------------------------------------------

    def live_queues(self) -> int:
        """Model queues this process declared or consumes whose lease has not run out
        (``QueueLeases.live``): a lower bound of the node's count, free to ask."""
        return self._leases.live()

    async def queue_stats(self, model_ids: list[str]) -> dict[str, QueueStats]:
        """Exact ready-message and consumer counts by passive declare (which, unlike a
        real declare, does not renew a queue's expiry); missing queues are left out.

        The declares go out on ``STATS_CHANNELS`` channels at once (AMQP answers one
        RPC per channel at a time, and a 404 closes the channel it happened on, so one
        channel cannot pipeline them): a count of n queues takes about n / 8 round trips.
        """
        self._require_counting("queue_stats")
        assert self._stats is not None
        found = await passive_declare_all(
            self._stats, [self._queue_name(m) for m in model_ids], self._require_counting,
            self._timeout_s)
        stats: dict[str, QueueStats] = {}
        for model_id in model_ids:
            counts = found.get(self._queue_name(model_id))
            if counts is not None:
                stats[model_id] = QueueStats(model_id, *counts)
        return stats
