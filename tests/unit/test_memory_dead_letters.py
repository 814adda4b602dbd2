"""The embedded broker's dead-letter queue is bounded: the oldest letters go first."""

from __future__ import annotations

from modelfleet import metrics
from modelfleet.broker.embedded import MemoryBroker
from modelfleet.messages import PayloadRef, Task, now_ms
from modelfleet.settings import BrokerSettings


def task(request_id: str) -> Task:
    return Task(request_id, "m", "1", now_ms() + 60_000, "nowhere", PayloadRef("inline", b"x"),
                "text/plain", now_ms())


async def test_a_full_embedded_dead_letter_queue_drops_its_oldest_letter() -> None:
    broker = MemoryBroker(BrokerSettings(dead_letter_max=2))
    await broker.connect()
    dropped_before = metrics.DEAD_LETTERS_DROPPED._value.get()
    for request_id in ("a", "b", "c"):
        await broker.publish_task(task(request_id))
        subscription = await broker.subscribe("m", prefetch=1)
        delivery = await anext(aiter(subscription))
        await delivery.dead_letter(f"bad input {request_id}")
        await subscription.cancel()
    letters = await broker.subscribe_dead_letters(prefetch=10)
    received = aiter(letters)
    kept = [(await anext(received)).task.request_id for _ in range(2)]
    assert kept == ["b", "c"]
    assert metrics.DEAD_LETTERS_DROPPED._value.get() == dropped_before + 1
    await broker.close()
