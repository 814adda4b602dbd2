"""RabbitMQ at scale, on a private node (never the shared one): 1,500 model queues
declared by publishing, counted by the live-queue gauge, warned about near the limit,
and gone again after their idle expiry; a task published after that is not lost."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import REGISTRY

from modelfleet.broker import Delivery
from modelfleet.broker.rabbitmq.broker import AmqpBroker
from modelfleet.devtools.rabbit_node import RabbitNode
from modelfleet.settings import BrokerSettings
from tests.contract.brokers import Collector, make_task
from tests.private_rabbit import SHARED_PORT
from tests.waiting import eventually

pytestmark = pytest.mark.rabbitmq

QUEUES = 1_500
# Outlasts declaring them all: about 11 s on a quiet 2-core machine, 22 s in a CI run that
# shared the machine (at 20 s the first 200 had expired before they were counted).
EXPIRY_S = 45.0


def gauge() -> float | None:
    return REGISTRY.get_sample_value("modelfleet_broker_live_queues")


async def test_thousands_of_queues_follow_demand_on_a_private_node(
        private_rabbit: RabbitNode, caplog: pytest.LogCaptureFixture) -> None:
    assert private_rabbit.port != SHARED_PORT
    assert private_rabbit.resources().file_descriptor_limit > 3 * QUEUES + 1_000
    settings = BrokerSettings(url=private_rabbit.url, queue_idle_expiry_s=EXPIRY_S,
                              max_live_queues=QUEUES, live_queues_warn_fraction=0.8,
                              queue_prefix="scale.", dead_letter_queue="scale.dead-letters")
    broker = AmqpBroker(settings, dead_letter_queue=settings.dead_letter_queue)
    await broker.connect()
    try:
        models = [f"m{i:05d}" for i in range(QUEUES)]
        caplog.set_level(logging.WARNING, logger="modelfleet.broker")
        # Like gateways do: publishing declares each model's queue. Tasks die in 2 s.
        started = time.monotonic()
        for start in range(0, QUEUES, 100):
            await asyncio.gather(*(broker.publish_task(make_task(m, deadline_s=2))
                                   for m in models[start:start + 100]))
        declaring_s = time.monotonic() - started
        # The counts below hold only while the first queue's lease lasts.
        assert declaring_s < EXPIRY_S, (
            f"declaring {QUEUES} queues took {declaring_s:.1f} s, past their "
            f"{EXPIRY_S:.0f} s expiry: the machine is too busy for this test's premise")

        assert broker.live_queues() == QUEUES
        assert gauge() == QUEUES
        # (Its own queues: the session's node may hold other tests' meanwhile.)
        assert private_rabbit.queue_count("scale.") == QUEUES + 1  # and the dead-letter queue
        warnings = [r.getMessage() for r in caplog.records
                    if "live model queues" in r.getMessage()]
        assert len(warnings) == 1, warnings  # once, on crossing 80 % (1,200)
        # Publishes run 100 at a time: a few may land between the crossing and its check.
        assert 1_200 <= int(warnings[0].split()[0]) < 1_300, warnings
        assert "max_live_queues=1500" in warnings[0]
        # Counting a few hundred of them is exact (and answers for the missing, too).
        stats = await broker.queue_stats([*models[:300], "never-declared"])
        assert set(stats) == set(models[:300])

        # Nobody uses them: the process's count and the node both let them go.
        await eventually(lambda: broker.live_queues() == 0, timeout_s=EXPIRY_S + 5)
        assert gauge() == 0
        await eventually(lambda: private_rabbit.queue_count("scale.") == 1, timeout_s=30)

        # A task for a model whose queue expired is not lost: the queue comes back with it.
        task = make_task(models[7], deadline_s=30)
        await broker.publish_task(task)
        assert broker.live_queues() == 1
        sub = await broker.subscribe(models[7], prefetch=1)
        deliveries: Collector[Delivery] = Collector(sub)
        got = await deliveries.next()
        assert got.task == task
        await got.ack()
        await sub.cancel()
        await deliveries.stop()
    finally:
        await broker.close()
