"""What a worker holds per queue it pulls: the subscription and the task draining it."""

from __future__ import annotations

import asyncio
import contextlib

from modelfleet.broker import Subscription
from modelfleet.errors import BrokerUnavailable


class Consumer:
    def __init__(self, subscription: Subscription, task: asyncio.Task[None]) -> None:
        self.subscription = subscription
        self.task = task
        self.prefetch = 0


async def leave(consumer: Consumer) -> None:
    """Cancel the subscription (unstarted deliveries go back), then its draining task."""
    with contextlib.suppress(BrokerUnavailable):
        await consumer.subscription.cancel()
    consumer.task.cancel()
    await asyncio.wait({consumer.task})  # not `await`: our own cancellation stays ours
