"""RabbitMQ only: a task lives in its queue no longer than its deadline, and every name a
broker declares lies under the deployment's queue prefix."""

from __future__ import annotations

import asyncio

import pytest

from modelfleet.broker import Delivery
from modelfleet.broker.rabbitmq.broker import AmqpBroker
from modelfleet.broker.rabbitmq.listeners import EventListener
from modelfleet.messages import now_ms
from tests.contract.brokers import Collector, make_task
from tests.contract.conftest import BrokerFactory
from tests.waiting import eventually

pytestmark = [pytest.mark.rabbitmq, pytest.mark.parametrize("broker_kind", ["amqp"])]


async def _backlog(broker: AmqpBroker, model_id: str) -> int:
    return (await broker.queue_stats([model_id]))[model_id].backlog


async def test_a_task_past_its_deadline_is_dropped_by_rabbitmq_not_delivered(
        make_broker: BrokerFactory) -> None:
    broker = await make_broker()
    assert isinstance(broker, AmqpBroker)
    dead = make_task("m1", deadline_s=1)
    alive = make_task("m1", deadline_s=60)
    await broker.publish_task(dead)
    await broker.publish_task(alive)

    # Nobody consumes: RabbitMQ's own timer takes the expired head out of the backlog.
    await eventually(lambda: _is(broker, "m1", 1), timeout_s=20)
    sub = await broker.subscribe("m1", prefetch=2)
    deliveries: Collector[Delivery] = Collector(sub)
    first = await deliveries.next()
    assert first.task.request_id == alive.request_id
    await first.ack()
    # It went where RabbitMQ sends what expires: the dead-letter queue, reason "expired".
    letters = await broker.subscribe_dead_letters(prefetch=1)
    dead_letters: Collector[Delivery] = Collector(letters)
    letter = await dead_letters.next()
    assert (letter.task.request_id, letter.death_reason) == (dead.request_id, "expired")
    await letter.ack()
    for s, c in ((sub, deliveries), (letters, dead_letters)):
        await s.cancel()
        await c.stop()


async def _is(broker: AmqpBroker, model_id: str, backlog: int) -> bool:
    return await _backlog(broker, model_id) == backlog


async def test_a_task_re_published_by_a_lease_renewal_keeps_its_deadline(
        make_broker: BrokerFactory) -> None:
    """A second gateway's first publish renews the queue's lease by taking the waiting
    task and publishing it again; the copy must expire when the original would have."""
    first_gateway, second_gateway, worker = [await make_broker() for _ in range(3)]
    assert isinstance(worker, AmqpBroker)
    short = make_task("m1", deadline_s=2)
    await first_gateway.publish_task(short)
    later = make_task("m1", deadline_s=60)
    await second_gateway.publish_task(later)  # renews: `short` is taken and re-published
    assert await _backlog(worker, "m1") == 2

    await asyncio.sleep(max(0.0, (short.deadline_ms - now_ms()) / 1000) + 1)  # it is dead
    sub = await worker.subscribe("m1", prefetch=2)  # room for both, were both alive
    deliveries: Collector[Delivery] = Collector(sub)
    only = await deliveries.next()
    assert only.task.request_id == later.request_id
    await only.ack()
    await eventually(lambda: _is(worker, "m1", 0))
    assert deliveries.items.empty()
    await sub.cancel()
    await deliveries.stop()


async def test_inboxes_and_event_queues_are_named_under_the_prefix(
        make_broker: BrokerFactory, prefix: str) -> None:
    broker = await make_broker()
    assert isinstance(broker, AmqpBroker)
    inbox = await broker.open_inbox()
    assert inbox.address.startswith(prefix), inbox.address
    events = broker.events()
    listening = asyncio.ensure_future(anext(events))
    await eventually(lambda: _has_listener(broker))
    names = [c.queue_name for c in broker._consumers if isinstance(c, EventListener)]
    assert names and all(name.startswith(prefix) for name in names), names
    listening.cancel()
    await inbox.close()


async def _has_listener(broker: AmqpBroker) -> bool:
    # Internals on purpose: an event queue's name is not part of the public API.
    return any(isinstance(c, EventListener) for c in broker._consumers)
