"""The embedded broker: real queues in this process, same contract as RabbitMQ.

Semantics follow RabbitMQ quorum queues, so code tested here behaves the same there:
a delivery count absent (0) on first delivery and incremented on each requeue;
``delivery_limit`` requeues, then the task is dead-lettered with reason
``delivery_limit``; per-consumer prefetch windows with round-robin dispatch; model
queues that expire after ``queue_idle_expiry_s`` with no messages, no consumers
and no use (unlike RabbitMQ, a queue holding messages never expires here).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from modelfleet import metrics
from modelfleet.broker.base import DEAD_LETTER_QUEUE, QueueStats
from modelfleet.broker.live_queues import LiveQueueWatch
from modelfleet.errors import BrokerUnavailable
from modelfleet.messages import EncodedReply, Reply, Task, encode_task
from modelfleet.settings import BrokerSettings

_EVENT_BUFFER = 1024
log = logging.getLogger("modelfleet.broker")


@dataclass
class _Message:
    task: Task
    delivery_count: int = 0
    death_reason: str = ""


class _Queue:
    def __init__(self, name: str, model_id: str, clock: Callable[[], float]) -> None:
        self.name = name
        self.model_id = model_id
        self.ready: deque[_Message] = deque()
        self.consumers: list[MemorySubscription] = []
        self.unacked = 0
        self._clock = clock
        self.last_used = clock()
        self._turn = itertools.count()

    def touch(self) -> None:
        self.last_used = self._clock()

    def idle_for(self) -> float:
        if self.ready or self.consumers or self.unacked:
            return 0.0
        return self._clock() - self.last_used

    def dispatch(self) -> None:
        """Hand ready messages to consumers with room in their prefetch window, in turn."""
        while self.ready:
            open_ = [c for c in self.consumers if c.has_room()]
            if not open_:
                return
            consumer = open_[next(self._turn) % len(open_)]
            message = self.ready.popleft()
            self.unacked += 1
            consumer.hand(message)


class MemoryDelivery:
    def __init__(self, broker: MemoryBroker, queue: _Queue, sub: MemorySubscription,
                 message: _Message) -> None:
        self._broker = broker
        self._queue = queue
        self._sub = sub
        self._message = message
        self._settled = False

    @property
    def task(self) -> Task:
        return self._message.task.with_delivery_count(self._message.delivery_count)

    @property
    def body(self) -> bytes:
        return encode_task(self._message.task)

    @property
    def death_reason(self) -> str:
        return self._message.death_reason

    def _settle(self) -> None:
        if self._settled:
            raise RuntimeError("delivery already settled")
        self._settled = True
        self._queue.unacked -= 1
        self._sub.settled()
        self._queue.touch()

    async def ack(self) -> None:
        self._settle()
        self._queue.dispatch()

    async def reject(self, requeue: bool) -> None:
        self._settle()
        if requeue:
            self._broker.requeue(self._queue, self._message)
        self._queue.dispatch()

    async def release(self) -> None:
        self._settle()
        self._queue.ready.appendleft(self._message)  # never started: not counted
        self._queue.dispatch()

    async def dead_letter(self, reason: str) -> None:
        self._settle()
        self._broker.to_dead_letters(self._message, reason)
        self._queue.dispatch()


class MemorySubscription:
    def __init__(self, broker: MemoryBroker, queue: _Queue, prefetch: int) -> None:
        self._broker = broker
        self._queue = queue
        self._prefetch = max(1, prefetch)
        self._held = 0  # handed to us, not yet settled
        self._buffer: asyncio.Queue[_Message | None] = asyncio.Queue()
        self._cancelled = False

    @property
    def model_id(self) -> str:
        return self._queue.model_id

    def has_room(self) -> bool:
        return not self._cancelled and self._held < self._prefetch

    def hand(self, message: _Message) -> None:
        self._held += 1
        self._buffer.put_nowait(message)

    def settled(self) -> None:
        self._held -= 1

    async def __aiter__(self) -> AsyncIterator[MemoryDelivery]:
        while True:
            message = await self._buffer.get()
            if message is None:
                return
            yield MemoryDelivery(self._broker, self._queue, self, message)

    async def set_prefetch(self, prefetch: int) -> None:
        self._prefetch = max(1, prefetch)
        self._queue.dispatch()

    async def cancel(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        with contextlib.suppress(ValueError):
            self._queue.consumers.remove(self)
        # Messages handed to us but never taken out of the buffer go back, uncounted.
        while not self._buffer.empty():
            message = self._buffer.get_nowait()
            if message is not None:
                self._held -= 1
                self._queue.unacked -= 1
                self._queue.ready.appendleft(message)
        self._buffer.put_nowait(None)
        self._queue.touch()
        self._queue.dispatch()


class MemoryInbox:
    def __init__(self, broker: MemoryBroker, address: str) -> None:
        self._broker = broker
        self._address = address
        self._replies: asyncio.Queue[EncodedReply | None] = asyncio.Queue()

    @property
    def address(self) -> str:
        return self._address

    def put(self, reply: EncodedReply) -> None:
        self._replies.put_nowait(reply)

    async def __aiter__(self) -> AsyncIterator[Reply]:
        while True:
            reply = await self._replies.get()
            if reply is None:
                return
            try:
                decoded = reply.decode()
            except Exception:
                log.exception("undecodable reply on %s dropped", self._address)
                continue
            yield decoded

    async def close(self) -> None:
        self._broker.inboxes.pop(self._address, None)
        self._replies.put_nowait(None)


class MemoryBroker:
    """An in-process broker for one machine. Not shared across processes."""

    def __init__(self, settings: BrokerSettings, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self._settings = settings
        self._clock = clock
        self._queues: dict[str, _Queue] = {}
        self.inboxes: dict[str, MemoryInbox] = {}
        self._listeners: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self._connected = False
        self._sweeper: asyncio.Task[None] | None = None
        self._watch = LiveQueueWatch(settings, self.live_queues, "the embedded broker")

    @property
    def connected(self) -> bool:
        return self._connected

    async def connect(self) -> None:
        self._connected = True
        self._watch.export()
        self._sweeper = asyncio.create_task(self._expire_idle_queues(), name="memory-broker-expiry")

    async def close(self) -> None:
        self._connected = False
        self._watch.unexport()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for listener in self._listeners:
            while listener.full():  # room for the end marker, even behind a slow listener
                listener.get_nowait()
            listener.put_nowait(None)
        for inbox in list(self.inboxes.values()):
            await inbox.close()

    def _check(self) -> None:
        if not self._connected:
            raise BrokerUnavailable("embedded broker is not running")

    def _queue(self, model_id: str) -> _Queue:
        name = self._settings.queue_prefix + model_id
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = _Queue(name, model_id, self._clock)
            self._watch.check()
        return queue

    def live_queues(self) -> int:
        """Model queues that exist now (exact: they all live in this process)."""
        return len(self._queues) - (DEAD_LETTER_QUEUE in self._queues)

    async def publish_task(self, task: Task, queue: str | None = None) -> None:
        self._check()
        target = self._queue(queue or task.model_id)
        target.touch()
        target.ready.append(_Message(task))
        target.dispatch()

    def requeue(self, queue: _Queue, message: _Message) -> None:
        message.delivery_count += 1
        if message.delivery_count > self._settings.delivery_limit:
            self.to_dead_letters(message, "delivery_limit")
        else:
            queue.ready.appendleft(message)

    def to_dead_letters(self, message: _Message, reason: str) -> None:
        dlq = self._dead_letter_queue()
        if len(dlq.ready) >= self._settings.dead_letter_max:
            # Nobody archives them (or not fast enough): bounded, the oldest go first.
            dropped = dlq.ready.popleft()
            metrics.DEAD_LETTERS_DROPPED.inc()
            log.warning("embedded dead-letter queue full (%d): dropped %s (%s)",
                        self._settings.dead_letter_max, dropped.task.request_id,
                        dropped.death_reason)
        dlq.ready.append(_Message(message.task, message.delivery_count, reason))
        dlq.dispatch()

    def _dead_letter_queue(self) -> _Queue:
        queue = self._queues.get(DEAD_LETTER_QUEUE)
        if queue is None:
            queue = self._queues[DEAD_LETTER_QUEUE] = _Queue(DEAD_LETTER_QUEUE, "", self._clock)
        return queue

    async def subscribe(self, model_id: str, prefetch: int) -> MemorySubscription:
        self._check()
        return self._attach(self._queue(model_id), prefetch)

    async def subscribe_dead_letters(self, prefetch: int) -> MemorySubscription:
        self._check()
        return self._attach(self._dead_letter_queue(), prefetch)

    def _attach(self, queue: _Queue, prefetch: int) -> MemorySubscription:
        sub = MemorySubscription(self, queue, prefetch)
        queue.consumers.append(sub)
        queue.touch()
        queue.dispatch()
        return sub

    async def republish(self, task: Task) -> None:
        await self.publish_task(task.with_delivery_count(0))

    async def open_inbox(self) -> MemoryInbox:
        self._check()
        inbox = MemoryInbox(self, f"inbox.{uuid.uuid4().hex}")
        self.inboxes[inbox.address] = inbox
        return inbox

    async def publish_reply(self, address: str, reply: EncodedReply) -> bool:
        self._check()
        inbox = self.inboxes.get(address)
        if inbox is None:
            return False
        inbox.put(reply)
        return True

    async def queue_stats(self, model_ids: list[str]) -> dict[str, QueueStats]:
        self._check()
        stats = {}
        for model_id in model_ids:
            queue = self._queues.get(self._settings.queue_prefix + model_id)
            if queue is not None:
                stats[model_id] = QueueStats(model_id, len(queue.ready), len(queue.consumers))
        return stats

    async def publish_event(self, event: dict[str, Any]) -> None:
        self._check()
        for listener in self._listeners:
            if listener.full():
                listener.get_nowait()  # a slow listener loses the oldest event, not the newest
            listener.put_nowait(event)

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        listener: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(_EVENT_BUFFER)
        self._listeners.add(listener)
        try:
            while True:
                event = await listener.get()
                if event is None:
                    return
                yield event
        finally:
            self._listeners.discard(listener)

    async def _expire_idle_queues(self) -> None:
        expiry = self._settings.queue_idle_expiry_s
        while True:
            await asyncio.sleep(min(expiry / 4, 5.0))
            for name, queue in list(self._queues.items()):
                if name != DEAD_LETTER_QUEUE and queue.idle_for() >= expiry:
                    del self._queues[name]
