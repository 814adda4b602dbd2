"""Consume the dead-letter queue into the archive: store first, then ack (at-least-once).

A dead letter acked before it is stored could be lost by a crash in between; one
stored but not acked is delivered again, and ``records.archived`` recognises it, so
storing twice changes nothing. If the archive fails, the archiver stops with the
delivery unsettled: the broker keeps it, and a restarted archiver gets it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from modelfleet.broker.base import Broker, Delivery, Subscription
from modelfleet.dlq.archive import Archive
from modelfleet.dlq.records import DeadLetterRecord, archived
from modelfleet.errors import BrokerUnavailable
from modelfleet.messages import now_ms

log = logging.getLogger(__name__)

PREFETCH = 16  # enough to keep the archive busy; a tiny share of a big DLQ
STOP_DRAIN_S = 5.0  # after cancelling, how long a delivery already on its way may take


@dataclass
class ArchiveStats:
    archived: int = 0  # new records, or new deaths of a replayed one
    duplicates: int = 0  # deaths already stored (a redelivery after a crash)


async def _next(iterator: AsyncIterator[Delivery]) -> Delivery | None:
    try:
        return await anext(iterator)
    except StopAsyncIteration:
        return None


async def archive_dead_letters(
    broker: Broker, archive: Archive, stop: asyncio.Event, *, idle_s: float | None = None,
    prefetch: int = PREFETCH, clock_ms: Callable[[], int] = now_ms,
    on_record: Callable[[DeadLetterRecord, bool], None] = lambda record, new: None,
) -> ArchiveStats:
    """Archive dead letters until ``stop`` is set or, with ``idle_s``, until none has
    arrived for that long (``modelfleet dlq archive --once``: drain what is there).

    ``on_record(record, new)`` is told about each one after it was stored and acked.
    Raises ArchiveError (the delivery in hand stays unsettled) or BrokerUnavailable.
    """
    stats = ArchiveStats()
    subscription = await broker.subscribe_dead_letters(prefetch)
    iterator = aiter(subscription)
    stopping = asyncio.ensure_future(stop.wait())
    pending: asyncio.Future[Delivery | None] | None = None
    try:
        while not stop.is_set():
            pending = asyncio.ensure_future(_next(iterator))
            await asyncio.wait({pending, stopping}, timeout=idle_s,
                               return_when=asyncio.FIRST_COMPLETED)
            if not pending.done():
                break  # asked to stop, or idle
            delivery, pending = pending.result(), None
            if delivery is None:
                return stats  # the subscription ended (the broker closed)
            await _store(delivery, archive, stats, clock_ms, on_record)
        # Shutting down, in order:
        # 1. stop accepting: the broker takes back what was prefetched but not handed out;
        await _cancel(subscription)
        # 2. finish what is in hand: a delivery may have reached us meanwhile;
        if pending is not None:
            with contextlib.suppress(TimeoutError):
                delivery = await asyncio.wait_for(asyncio.shield(pending), STOP_DRAIN_S)
                if delivery is not None:
                    await _store(delivery, archive, stats, clock_ms, on_record)
        return stats
    finally:
        # 3. leave nothing running; the caller closes the broker and then the archive.
        stopping.cancel()
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending
        await _cancel(subscription)


async def _cancel(subscription: Subscription) -> None:
    with contextlib.suppress(BrokerUnavailable):
        await subscription.cancel()


async def _store(delivery: Delivery, archive: Archive, stats: ArchiveStats,
                 clock_ms: Callable[[], int],
                 on_record: Callable[[DeadLetterRecord, bool], None]) -> None:
    task = delivery.task
    previous = await asyncio.to_thread(archive.get, task.request_id)
    record = archived(task, delivery.death_reason, clock_ms(), previous)
    new = record is not previous
    if new:
        await asyncio.to_thread(archive.put, record)
    try:
        await delivery.ack()
    except BrokerUnavailable as exc:
        # Stored, so nothing is lost: the broker redelivers it and we see a duplicate.
        log.warning("dead letter %s stored but not acked (%s); it will come again",
                    task.request_id, exc)
    if new:
        stats.archived += 1
    else:
        stats.duplicates += 1
    on_record(record, new)
