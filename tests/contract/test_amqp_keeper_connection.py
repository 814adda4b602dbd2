"""The keeper's connection of its own: RabbitMQ closing it costs no publish and no work.

RabbitMQ answers a ``basic.get`` it cannot carry out with a connection-level error
(seen on a loaded node: ``INTERNAL_ERROR ... noproc`` on a lease renewal a moment
after the queue's declare). The keeper declares model queues and renews their leases
on a connection of its own, so such a close (here: an operator's ``close_connection``,
the same close from the client's side) leaves the work's connection, its consumers and
its publishes alone, and a renewal it interrupted is made again once the keeper's
connection is back. On the session's private node: the test declares a few hundred
quorum queues.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from modelfleet.broker import Delivery
from modelfleet.broker.rabbitmq.broker import AmqpBroker
from modelfleet.devtools.rabbit_node import RabbitNode
from modelfleet.errors import BrokerUnavailable
from modelfleet.settings import BrokerSettings
from tests.contract.brokers import Collector, make_task
from tests.waiting import eventually

pytestmark = pytest.mark.rabbitmq


def close_connection_named(node: RabbitNode, name: str) -> None:
    listing = node.ctl("list_connections", "pid", "client_properties")
    pids = [line.split("\t")[0] for line in listing.splitlines()
            if f'"connection_name","{name}"' in line]
    assert len(pids) == 1, (name, listing)
    node.ctl("close_connection", pids[0], "closed by the test")


async def test_losing_the_keepers_connection_costs_no_publish_and_no_work(
        private_rabbit: RabbitNode, caplog: pytest.LogCaptureFixture) -> None:
    prefix = f"keeper{uuid.uuid4().hex[:8]}."
    settings = BrokerSettings(url=private_rabbit.url, queue_prefix=prefix,
                              queue_idle_expiry_s=120, reconnect_max_backoff_s=0.5)
    name = f"keeper-test {prefix}"
    broker = AmqpBroker(settings, dead_letter_queue=prefix + "dead-letters",
                        events_exchange=prefix + "events", connection_name=name)
    await broker.connect()
    caplog.set_level(logging.INFO, logger="modelfleet.broker")
    try:
        steady = await broker.subscribe("steady", prefetch=1)
        deliveries: Collector[Delivery] = Collector(steady)
        published: list[str] = []
        failures: list[BrokerUnavailable] = []
        stop = asyncio.Event()

        async def publish_to_new_models() -> None:
            # Each first publish to a model declares its queue and renews its lease:
            # the keeper's connection is busy the whole time.
            while not stop.is_set() and len(published) < 400:
                model_id = f"m{len(published) + len(failures):04d}"
                try:
                    await broker.publish_task(make_task(model_id, deadline_s=60))
                except BrokerUnavailable as exc:
                    failures.append(exc)
                else:
                    published.append(model_id)

        publisher = asyncio.create_task(publish_to_new_models())
        await eventually(lambda: len(published) >= 20, 30, what="first declares")
        await asyncio.to_thread(close_connection_named, private_rabbit, f"{name} leases")
        at_close = len(published)
        await eventually(lambda: len(published) >= at_close + 30 or publisher.done(), 60,
                         what="declares after the close", state=lambda: failures)
        stop.set()
        await publisher

        assert failures == []
        said = [r.getMessage() for r in caplog.records if r.name.startswith("modelfleet")]
        assert any("lost the keeper's connection" in line for line in said)
        # The work's connection never dropped: no reconnect, and its consumer carries on.
        assert broker.connected
        assert not any("lost the connection to RabbitMQ" in line for line in said)
        task = make_task("steady")
        await broker.publish_task(task)
        got = await deliveries.next()
        assert got.task == task
        await got.ack()
        # Every task published is in its queue: none was lost with the connection.
        stats = await broker.queue_stats(published)
        assert sorted(m for m, s in stats.items() if s.backlog == 1) == sorted(published)
        await steady.cancel()
        await deliveries.stop()
    finally:
        await broker.close()
