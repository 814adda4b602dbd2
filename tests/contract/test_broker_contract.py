"""The Broker contract: every test runs against the embedded broker and RabbitMQ.

What a gateway or worker may rely on whichever broker it talks to. RabbitMQ-only
behaviour (reconnects, refused first connects, expiry timing) is in test_amqp_broker.py.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from modelfleet.broker import Broker, Delivery, QueueStats, cold_lane
from modelfleet.errors import BrokerUnavailable
from modelfleet.messages import EncodedReply, Reply
from tests.contract.brokers import Collector, make_task
from tests.contract.conftest import BrokerFactory
from tests.waiting import eventually


async def backlog(broker: Broker, model_id: str) -> int:
    stats: QueueStats = (await broker.queue_stats([model_id]))[model_id]
    return stats.backlog


async def test_round_trip_preserves_every_task_field(broker: Broker) -> None:
    task = make_task("m1")
    await broker.publish_task(task)
    sub = await broker.subscribe("m1", prefetch=1)
    deliveries: Collector[Delivery] = Collector(sub)

    delivery = await deliveries.next()

    assert delivery.task == task  # delivery_count 0 included
    assert delivery.death_reason == ""
    await delivery.ack()
    assert await backlog(broker, "m1") == 0
    await sub.cancel()
    await deliveries.stop()


async def test_a_cold_lane_carries_tasks_of_any_model_and_hands_back_to_their_own(
        broker: Broker) -> None:
    """The cold lane is a queue of its own: tasks of several models wait there in order,
    none in their models' queues; one given back (``republish``) goes to its model's."""
    lane = cold_lane(0)
    tasks = [make_task("m1"), make_task("m2")]
    for task in tasks:
        await broker.publish_task(task, lane)
    stats = await broker.queue_stats(["m1", "m2", lane])
    assert stats[lane].backlog == 2 and "m1" not in stats and "m2" not in stats
    sub = await broker.subscribe(lane, prefetch=2)
    deliveries: Collector[Delivery] = Collector(sub)
    first, second = await deliveries.take(2)
    assert [first.task, second.task] == tasks
    await broker.republish(second.task)
    await first.ack()
    await second.ack()
    assert await backlog(broker, lane) == 0
    assert await backlog(broker, "m2") == 1
    assert (await broker.queue_stats([cold_lane(2)])) == {}  # one lane per priority
    await sub.cancel()
    await deliveries.stop()


async def test_prefetch_window_is_respected(broker: Broker) -> None:
    for _ in range(5):
        await broker.publish_task(make_task("m1"))
    sub = await broker.subscribe("m1", prefetch=2)
    deliveries: Collector[Delivery] = Collector(sub)

    first, second = await deliveries.take(2)
    # Exactly two handed out: the other three are still ready in the queue.
    assert await backlog(broker, "m1") == 3
    assert deliveries.items.empty()

    await first.ack()
    third = await deliveries.next()
    assert await backlog(broker, "m1") == 2

    await sub.set_prefetch(4)  # a wider window hands out more at once
    more = await deliveries.take(2)
    assert await backlog(broker, "m1") == 0
    for delivery in (second, third, *more):
        await delivery.ack()
    await sub.cancel()
    await deliveries.stop()


async def test_two_consumers_share_a_queue(broker: Broker) -> None:
    sub_a = await broker.subscribe("m1", prefetch=1)
    sub_b = await broker.subscribe("m1", prefetch=1)
    a: Collector[Delivery] = Collector(sub_a)
    b: Collector[Delivery] = Collector(sub_b)
    assert (await broker.queue_stats(["m1"]))["m1"].consumers == 2
    tasks = [make_task("m1"), make_task("m1")]
    for task in tasks:
        await broker.publish_task(task)

    # With a window of one each and no ack yet, each consumer holds one of the two.
    got_a, got_b = await a.next(), await b.next()

    assert {got_a.task.request_id, got_b.task.request_id} == {t.request_id for t in tasks}
    for delivery in (got_a, got_b):
        await delivery.ack()
    for sub, collector in ((sub_a, a), (sub_b, b)):
        await sub.cancel()
        await collector.stop()


async def test_requeues_count_then_dead_letter_after_the_limit(broker: Broker) -> None:
    task = make_task("m1")
    await broker.publish_task(task)
    sub = await broker.subscribe("m1", prefetch=1)
    deliveries: Collector[Delivery] = Collector(sub)
    dead = await broker.subscribe_dead_letters(prefetch=1)
    dead_letters: Collector[Delivery] = Collector(dead)

    # delivery_limit=3: four deliveries (counts 0..3), each failed with a requeue.
    for expected in range(4):
        delivery = await deliveries.next()
        assert delivery.task.delivery_count == expected
        await delivery.reject(requeue=True)

    letter = await dead_letters.next()
    assert letter.task.request_id == task.request_id
    assert letter.death_reason == "delivery_limit"
    assert letter.task.delivery_count == 4  # the limit, plus the delivery that broke it
    await letter.ack()
    assert await backlog(broker, "m1") == 0
    assert deliveries.items.empty()
    for s, c in ((sub, deliveries), (dead, dead_letters)):
        await s.cancel()
        await c.stop()


async def test_explicit_dead_letter_keeps_the_reason(broker: Broker) -> None:
    task = make_task("m1")
    await broker.publish_task(task)
    sub = await broker.subscribe("m1", prefetch=1)
    deliveries: Collector[Delivery] = Collector(sub)
    delivery = await deliveries.next()
    await delivery.reject(requeue=True)
    delivery = await deliveries.next()

    await delivery.dead_letter("invalid input: not a PNG")

    dead = await broker.subscribe_dead_letters(prefetch=1)
    dead_letters: Collector[Delivery] = Collector(dead)
    letter = await dead_letters.next()
    assert letter.death_reason == "invalid input: not a PNG"
    assert letter.task == task.with_delivery_count(1)
    assert await backlog(broker, "m1") == 0

    # Republished, it starts again with a fresh delivery count.
    await broker.republish(letter.task)
    await letter.ack()
    again = await deliveries.next()
    assert again.task == task
    await again.ack()
    for s, c in ((sub, deliveries), (dead, dead_letters)):
        await s.cancel()
        await c.stop()


async def test_reject_without_requeue_drops_the_task(broker: Broker) -> None:
    dropped, kept = make_task("m1"), make_task("m1")
    await broker.publish_task(dropped)
    sub = await broker.subscribe("m1", prefetch=1)
    deliveries: Collector[Delivery] = Collector(sub)
    delivery = await deliveries.next()
    assert delivery.task.request_id == dropped.request_id

    await delivery.reject(requeue=False)

    # Neither back in its queue nor in the dead-letter queue, whose first letter is `kept`.
    assert await backlog(broker, "m1") == 0
    await broker.publish_task(kept)
    delivery = await deliveries.next()
    await delivery.dead_letter("marker")
    dead = await broker.subscribe_dead_letters(prefetch=1)
    dead_letters: Collector[Delivery] = Collector(dead)
    letter = await dead_letters.next()
    assert letter.task.request_id == kept.request_id
    await letter.ack()
    for s, c in ((sub, deliveries), (dead, dead_letters)):
        await s.cancel()
        await c.stop()


async def test_settling_twice_is_an_error(broker: Broker) -> None:
    await broker.publish_task(make_task("m1"))
    sub = await broker.subscribe("m1", prefetch=1)
    deliveries: Collector[Delivery] = Collector(sub)
    delivery = await deliveries.next()
    await delivery.ack()
    with pytest.raises(RuntimeError):
        await delivery.ack()
    await sub.cancel()
    await deliveries.stop()


async def test_cancel_returns_prefetched_tasks_and_keeps_handed_out_ones_settleable(
        broker: Broker) -> None:
    tasks = [make_task("m1") for _ in range(3)]
    for task in tasks:
        await broker.publish_task(task)
    sub = await broker.subscribe("m1", prefetch=3)
    iterator = aiter(sub)
    taken = await asyncio.wait_for(anext(iterator), 10)

    await sub.cancel()

    with pytest.raises(StopAsyncIteration):  # a cancelled subscription's iterator ends
        await asyncio.wait_for(anext(iterator), 10)
    # The two never taken out are back in the queue, for the next consumer.
    await eventually(lambda: _backlog_is(broker, "m1", 2))
    other = await broker.subscribe("m1", prefetch=3)
    deliveries: Collector[Delivery] = Collector(other)
    returned = await deliveries.take(2)
    assert {d.task.request_id for d in returned} == {t.request_id for t in tasks[1:]}
    # RabbitMQ 3.x counts a return as a delivery; the broker that returned them does not.
    assert all(d.task.delivery_count == 0 for d in returned)
    await taken.ack()  # still settleable after cancel
    for delivery in returned:
        await delivery.ack()
    assert await backlog(broker, "m1") == 0
    await other.cancel()
    await deliveries.stop()


async def _backlog_is(broker: Broker, model_id: str, n: int) -> bool:
    return await backlog(broker, model_id) == n


async def test_inbox_round_trip(broker: Broker) -> None:
    inbox = await broker.open_inbox()
    replies: Collector[Reply] = Collector(inbox)
    reply = Reply("r1", "ok", body=b"\x01\x02", content_type="application/octet-stream",
                  timings_ms={"predict": 1.5}, worker_id="w1", cold=True)

    assert await broker.publish_reply(inbox.address, EncodedReply.of(reply)) is True

    assert await replies.next() == reply
    await inbox.close()
    await asyncio.wait_for(replies.ended.wait(), 10)  # closing ends its iterator


async def test_reply_to_a_missing_or_closed_inbox_is_refused(broker: Broker) -> None:
    reply = EncodedReply.of(Reply("r1", "ok"))
    assert await broker.publish_reply("modelfleet.inbox.nobody", reply) is False
    inbox = await broker.open_inbox()
    await inbox.close()
    assert await broker.publish_reply(inbox.address, reply) is False
    # Refusals leave the broker usable.
    other = await broker.open_inbox()
    assert await broker.publish_reply(other.address, reply) is True
    await other.close()


async def test_queue_stats_are_exact_and_leave_missing_queues_out(broker: Broker) -> None:
    for _ in range(3):
        await broker.publish_task(make_task("m1"))
    subs = [await broker.subscribe("m2", prefetch=1) for _ in range(2)]

    # The missing queue first: on RabbitMQ it kills the channel it was asked on.
    stats = await broker.queue_stats(["m3", "m1", "m2"])

    assert set(stats) == {"m1", "m2"}
    assert (stats["m1"].backlog, stats["m1"].consumers) == (3, 0)
    assert (stats["m2"].backlog, stats["m2"].consumers) == (0, 2)
    # ...and the broker works as before.
    assert await broker.queue_stats(["m3"]) == {}
    await broker.publish_task(make_task("m1"))
    assert (await broker.queue_stats(["m1", "m3"]))["m1"].backlog == 4
    for sub in subs:
        await sub.cancel()


async def test_events_fan_out_to_every_listener(broker: Broker) -> None:
    listeners: list[Collector[dict[str, Any]]] = [Collector(broker.events()) for _ in range(2)]
    # A listener binds on its first __anext__; events before that may be missed, so
    # ping until both hear one.
    for listener in listeners:
        async with asyncio.timeout(10):
            while True:
                await broker.publish_event({"kind": "ping"})
                try:
                    async with asyncio.timeout(0.2):
                        if (await listener.items.get())["kind"] == "ping":
                            break
                except TimeoutError:
                    continue
    event = {"kind": "worker_state", "worker": "w1", "models": ["m1"], "load": 0.5}

    await broker.publish_event(event)

    for listener in listeners:
        async with asyncio.timeout(10):
            while (got := await listener.items.get())["kind"] == "ping":
                pass
        assert got == event
        await listener.stop()


async def test_an_idle_queue_expires(make_broker: BrokerFactory) -> None:
    broker = await make_broker(queue_idle_expiry_s=1)
    sub = await broker.subscribe("m1", prefetch=1)  # declares it
    assert "m1" in await broker.queue_stats(["m1"])
    await sub.cancel()

    # RabbitMQ checks quorum queue expiry on a ~5 s tick; asking does not renew it.
    await eventually(lambda: _missing(broker, "m1"), timeout_s=20, every_s=0.5)


async def _missing(broker: Broker, model_id: str) -> bool:
    return model_id not in await broker.queue_stats([model_id])


async def test_publishing_after_idleness_loses_no_task(make_broker: BrokerFactory) -> None:
    expiry_s = 2.0
    broker = await make_broker(queue_idle_expiry_s=expiry_s)
    await broker.publish_task(make_task("m1"))
    sub = await broker.subscribe("m1", prefetch=1)
    deliveries: Collector[Delivery] = Collector(sub)
    await (await deliveries.next()).ack()
    await sub.cancel()
    await deliveries.stop()

    # Idle, but not long enough to expire; then a task that will outlive the queue's
    # first lease. Publishing does not renew a RabbitMQ lease: the broker must. (RabbitMQ
    # checks expiry on a ~5 s tick, so this catches a missing renewal only sometimes;
    # test_amqp_broker.py has the slow, deterministic version.)
    await asyncio.sleep(expiry_s * 0.75)
    # Its deadline outlives the first lease by far more than a subscribe takes on a busy
    # machine (it had 0.5 s, and a CI run beside a simulator took longer: TimeoutError).
    task = make_task("m1", deadline_s=expiry_s * 2)
    await broker.publish_task(task)
    await asyncio.sleep(expiry_s * 0.5)  # past the first lease

    sub = await broker.subscribe("m1", prefetch=1)
    deliveries = Collector(sub)
    assert (await deliveries.next()).task == task
    await sub.cancel()
    await deliveries.stop()


async def test_a_task_for_an_expired_queue_brings_it_back_and_is_delivered(
        make_broker: BrokerFactory) -> None:
    broker = await make_broker(queue_idle_expiry_s=1)
    sub = await broker.subscribe("m1", prefetch=1)  # declares it
    assert broker.live_queues() == 1
    await sub.cancel()
    await eventually(lambda: _missing(broker, "m1"), timeout_s=20, every_s=0.5)
    # The process's own count followed: its lease ran out (RabbitMQ) or it saw it go.
    assert broker.live_queues() == 0

    task = make_task("m1", deadline_s=30)
    await broker.publish_task(task)

    assert broker.live_queues() == 1
    assert (await broker.queue_stats(["m1"]))["m1"].backlog == 1
    sub = await broker.subscribe("m1", prefetch=1)
    deliveries: Collector[Delivery] = Collector(sub)
    delivered = await deliveries.next()
    assert delivered.task == task
    await delivered.ack()
    await sub.cancel()
    await deliveries.stop()


async def test_a_closed_broker_refuses_work(broker: Broker) -> None:
    await broker.close()
    assert broker.connected is False
    with pytest.raises(BrokerUnavailable):
        await broker.publish_task(make_task("m1"))
    with pytest.raises(BrokerUnavailable):
        await broker.publish_event({"kind": "ping"})
    with pytest.raises(BrokerUnavailable):
        await broker.publish_reply("modelfleet.inbox.x",
                                   EncodedReply.of(Reply(uuid.uuid4().hex, "ok")))


async def test_a_released_task_comes_back(broker: Broker) -> None:
    """release(): a task never started goes back for another try (uncounted where allowed)."""
    task = make_task("m1")
    await broker.publish_task(task)
    sub = await broker.subscribe("m1", prefetch=1)
    deliveries: Collector[Delivery] = Collector(sub)
    first = await deliveries.next()
    await first.release()
    again = await deliveries.next()
    assert again.task.request_id == task.request_id
    # Not counted: RabbitMQ 3.x counts the return, and the broker takes it off again (a
    # task that never started is no suspect: it would run alone in quarantine).
    assert again.task.delivery_count == 0
    await again.ack()
    await sub.cancel()
    await deliveries.stop()
