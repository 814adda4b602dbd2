"""Exact queue counts from RabbitMQ by passive declare, several channels at once.

A passive ``queue.declare`` is the one AMQP way to learn a queue's ready-message and
consumer counts, and it costs a round trip. AMQP answers one synchronous RPC per
channel at a time, so a single channel cannot pipeline them; worse, a passive declare
of a queue that does not exist (404) closes the channel it was sent on, and every
declare queued behind it on that channel would fail too. So the names are spread
over a few channels of their own (``ChannelPool``), each asking one name at a time:
a 404 costs only its own channel, reopened for the next name. Counting n queues takes
about n / ``STATS_CHANNELS`` round trips in a row instead of n: what matters across a
network, where a round trip costs more than the CPU of a declare. On loopback CPU is
what bounds it, and asking through aiormq's own channel (no aio-pika Queue object per
answer) halved that (see README "The broker at scale" for the measurements).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiormq.exceptions import ChannelClosed, ChannelNotFoundEntity

from modelfleet.broker.rabbitmq.errors import rpc
from modelfleet.broker.rabbitmq.topology import ChannelPool, ChannelSlot

# Channels for passive declares: round trips in flight at once per count.
STATS_CHANNELS = 8


async def passive_declare_all(pool: ChannelPool, names: list[str],
                              require: Callable[[str], object], timeout_s: float
                              ) -> dict[str, tuple[int, int]]:
    """``{name: (ready messages, consumers)}`` for each of ``names`` that exists, asked on
    every channel of ``pool`` at once.

    ``require(what)`` raises BrokerUnavailable when the connection is down; it is asked
    before each declare, so an outage fails the count at once.
    """
    found: dict[str, tuple[int, int]] = {}
    pending = iter(dict.fromkeys(names))  # each name once, shared by the workers below

    async def work() -> None:
        async with pool.slot() as slot:
            for name in pending:
                require(f"queue_stats({name})")
                counts = await _passive_declare(slot, name, timeout_s)
                if counts is not None:
                    found[name] = counts

    tasks = [asyncio.ensure_future(work()) for _ in range(min(len(names), pool.size))]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return found


async def _passive_declare(slot: ChannelSlot, name: str, timeout_s: float
                           ) -> tuple[int, int] | None:
    async with rpc(f"queue_stats({name})", timeout_s):
        channel = await slot.get()
        # aiormq's own channel: aio-pika would build a Queue object per answer, which
        # doubled the client's CPU per count (measured, README "The broker at scale").
        underlay = await channel.get_underlay_channel()
        try:
            result = await underlay.queue_declare(name, passive=True)
        except ChannelNotFoundEntity:
            await slot.discard()
            return None
        except ChannelClosed:
            await slot.discard()
            raise
    return result.message_count or 0, result.consumer_count or 0
