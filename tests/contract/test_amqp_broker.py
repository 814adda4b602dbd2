"""What only the RabbitMQ broker has to prove: failing first connects, surviving a
dropped connection, renewing queue leases against RabbitMQ's own expiry timer,
refusing a queue declared with other arguments, and not leaking channels."""

from __future__ import annotations

import asyncio
import socket
import subprocess
from typing import Any

import aio_pika
import pytest
from yarl import URL

from modelfleet.broker import Broker, Delivery
from modelfleet.broker.rabbitmq.broker import AmqpBroker
from modelfleet.errors import BrokerError, BrokerUnavailable
from modelfleet.messages import EncodedReply, Reply
from modelfleet.settings import BrokerSettings
from tests.conftest import rabbitmq_url
from tests.contract.brokers import Collector, TcpProxy, make_task
from tests.contract.conftest import BrokerFactory
from tests.waiting import eventually

amqp_only = [pytest.mark.rabbitmq, pytest.mark.parametrize("broker_kind", ["amqp"])]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_first_connect_failure_is_one_clear_line_without_the_password() -> None:
    port = free_port()  # nothing listens there
    broker = AmqpBroker(BrokerSettings(url=f"amqp://guest:s3cret@127.0.0.1:{port}/"))

    with pytest.raises(BrokerUnavailable) as failure:
        async with asyncio.timeout(10):  # fails at once; the guard only keeps a bug from hanging
            await broker.connect()

    message = str(failure.value)
    assert f"127.0.0.1:{port}" in message
    assert "s3cret" not in message
    assert "\n" not in message
    assert broker.connected is False
    with pytest.raises(BrokerUnavailable):
        await broker.publish_task(make_task("m1"))


async def heard(listener: Collector[dict[str, Any]], broker: Broker) -> None:
    """Ping until ``listener`` hears one (it binds on its first __anext__, or reconnect)."""
    async with asyncio.timeout(15):
        while True:
            await broker.publish_event({"kind": "ping"})
            try:
                async with asyncio.timeout(0.2):
                    while (await listener.items.get())["kind"] != "ping":
                        pass
                    return
            except TimeoutError:
                continue


async def is_connected(broker: Broker, state: bool) -> bool:
    return broker.connected is state


@pytest.mark.rabbitmq
async def test_a_dropped_connection_fails_fast_then_everything_resumes(prefix: str) -> None:
    from tests.conftest import require_rabbitmq

    require_rabbitmq()
    upstream = URL(rabbitmq_url())
    proxy = TcpProxy(upstream.host or "127.0.0.1", upstream.port or 5672)
    await proxy.start()
    broker = AmqpBroker(
        BrokerSettings(url=str(upstream.with_port(proxy.port)), queue_prefix=prefix,
                       reconnect_max_backoff_s=0.2, declare_timeout_s=5),
        dead_letter_queue=prefix + "dead-letters", events_exchange=prefix + "events")
    await broker.connect()
    try:
        await _drop_and_resume(broker, proxy)
    finally:
        await broker.close()
        await proxy.stop()
        from tests.contract.brokers import delete_amqp_names

        await delete_amqp_names(prefix)


async def _drop_and_resume(broker: AmqpBroker, proxy: TcpProxy) -> None:
    sub = await broker.subscribe("m1", prefetch=1)
    deliveries: Collector[Delivery] = Collector(sub)
    doomed = await broker.subscribe("m2", prefetch=1)  # cancelled during the outage
    inbox = await broker.open_inbox()
    replies: Collector[Reply] = Collector(inbox)
    doomed_inbox = await broker.open_inbox()  # closed during the outage
    events: Collector[dict[str, Any]] = Collector(broker.events())
    await heard(events, broker)
    in_hand = make_task("m1")
    await broker.publish_task(in_hand)
    held = await deliveries.next()

    await proxy.cut()
    await eventually(lambda: is_connected(broker, False))

    # Every call fails at once rather than waiting for the connection.
    async with asyncio.timeout(1):
        with pytest.raises(BrokerUnavailable):
            await broker.publish_task(make_task("m1"))
        with pytest.raises(BrokerUnavailable):
            await broker.publish_reply(inbox.address, EncodedReply.of(Reply("r0", "ok")))
        with pytest.raises(BrokerUnavailable):
            await broker.publish_event({"kind": "ping"})
        with pytest.raises(BrokerUnavailable):
            await broker.queue_stats(["m1"])
        # The delivery in hand died with its channel; RabbitMQ will deliver it again.
        with pytest.raises(BrokerUnavailable):
            await held.ack()
        with pytest.raises(BrokerUnavailable):
            await sub.set_prefetch(2)
        await doomed.cancel()
        await doomed_inbox.close()

    await proxy.restore()
    await eventually(lambda: is_connected(broker, True), timeout_s=20)

    # The same subscription iterator resumes: first the task that was in hand, counted...
    again = await deliveries.next()
    assert again.task.request_id == in_hand.request_id
    assert again.task.delivery_count == 1
    await again.ack()
    # ...then new work.
    fresh = make_task("m1")
    await broker.publish_task(fresh)
    assert (await deliveries.next()).task == fresh
    # The inbox kept its address (tasks in queues still name it).
    reply = Reply("r1", "ok", body=b"after")
    assert await broker.publish_reply(inbox.address, EncodedReply.of(reply)) is True
    assert await replies.next() == reply
    # Events flow again; what was cancelled or closed while down stayed so.
    await heard(events, broker)
    stats = await broker.queue_stats(["m1", "m2"])
    assert (stats["m1"].consumers, stats["m2"].consumers) == (1, 0)
    assert await broker.publish_reply(doomed_inbox.address, EncodedReply.of(reply)) is False
    for collector in (deliveries, replies, events):
        await collector.stop()


@pytest.mark.rabbitmq
@pytest.mark.parametrize("broker_kind", ["amqp"])
async def test_a_waiting_task_renews_its_queue_lease(make_broker: BrokerFactory) -> None:
    """Deterministic against RabbitMQ's timer: quorum queues check expiry on a ~5 s tick,
    so an unrenewed 8 s lease is surely gone 13.1 s after its last use, while one renewed
    at 7 s lives at least until 15 s. We look at 14 s. (Tasks expire at their deadline
    now, so each deadline outlives the moment we look at it.)"""
    loop = asyncio.get_running_loop()
    broker = await make_broker(queue_idle_expiry_s=8)
    start = loop.time()
    await broker.publish_task(make_task("m1", deadline_s=5))
    sub = await broker.subscribe("m1", prefetch=1)
    deliveries: Collector[Delivery] = Collector(sub)
    await (await deliveries.next()).ack()
    await sub.cancel()
    await deliveries.stop()

    await asyncio.sleep(start + 7 - loop.time())
    task = make_task("m1", deadline_s=10)  # alive at 14 s; the lease it renews is the test
    await broker.publish_task(task)
    await asyncio.sleep(start + 14 - loop.time())

    assert (await broker.queue_stats(["m1"]))["m1"].backlog == 1


@pytest.mark.rabbitmq
@pytest.mark.parametrize("broker_kind", ["amqp"])
async def test_renewing_a_busy_queue_keeps_every_task_and_its_count(
        make_broker: BrokerFactory) -> None:
    """A second gateway's first publish renews the lease of a queue with a task waiting
    in it: the waiting task is re-published, and still dies after exactly four deliveries."""
    gateway_a, worker, gateway_b = [await make_broker() for _ in range(3)]
    waiting = make_task("m1")
    await gateway_a.publish_task(waiting)
    sub = await worker.subscribe("m1", prefetch=1)
    deliveries: Collector[Delivery] = Collector(sub)
    failed = await deliveries.next()
    await sub.cancel()  # first, so the failed task is not handed straight back to us
    await failed.reject(requeue=True)  # failed once, now waiting with nobody consuming
    await deliveries.stop()

    later = make_task("m1")
    await gateway_b.publish_task(later)  # renews the lease: takes `waiting`, re-publishes it

    assert (await gateway_b.queue_stats(["m1"]))["m1"].backlog == 2
    sub = await worker.subscribe("m1", prefetch=2)
    deliveries = Collector(sub)
    first, second = await deliveries.take(2)
    assert {first.task.request_id: first.task.delivery_count,
            second.task.request_id: second.task.delivery_count} == {
        waiting.request_id: 1, later.request_id: 0}
    await (first if first.task == later else second).ack()
    # The re-published task keeps failing: deliveries 1, 2, 3, then the dead-letter queue.
    again = first if first.task.request_id == waiting.request_id else second
    for expected in (1, 2, 3):
        assert again.task.delivery_count == expected
        await again.reject(requeue=True)
        if expected < 3:
            again = await deliveries.next()
    dead = await worker.subscribe_dead_letters(prefetch=1)
    dead_letters: Collector[Delivery] = Collector(dead)
    letter = await dead_letters.next()
    assert (letter.task.request_id, letter.death_reason, letter.task.delivery_count) == (
        waiting.request_id, "delivery_limit", 4)
    assert deliveries.items.empty()
    await letter.ack()
    for s, c in ((sub, deliveries), (dead, dead_letters)):
        await s.cancel()
        await c.stop()


@pytest.mark.rabbitmq
@pytest.mark.parametrize("broker_kind", ["amqp"])
async def test_a_queue_with_other_arguments_is_a_clear_broker_error(
        make_broker: BrokerFactory) -> None:
    first = await make_broker(delivery_limit=3)
    await first.publish_task(make_task("m1"))
    changed = await make_broker(delivery_limit=5)

    with pytest.raises(BrokerError, match="other arguments") as failure:
        await changed.publish_task(make_task("m1"))

    assert not isinstance(failure.value, BrokerUnavailable)  # an operator must act
    await changed.publish_task(make_task("m2"))  # the broker itself is fine


@pytest.mark.rabbitmq
@pytest.mark.parametrize("broker_kind", ["amqp"])
async def test_an_undecodable_message_is_dead_lettered_and_consumption_goes_on(
        make_broker: BrokerFactory, prefix: str) -> None:
    broker = await make_broker()
    sub = await broker.subscribe("m1", prefetch=1)
    deliveries: Collector[Delivery] = Collector(sub)
    async with await aio_pika.connect(rabbitmq_url()) as connection:
        channel = await connection.channel()
        await channel.default_exchange.publish(aio_pika.Message(b"\xc1 not msgpack"),
                                               routing_key=prefix + "m1")
        task = make_task("m1")
        await broker.publish_task(task)

        assert (await deliveries.next()).task == task
        dead = await channel.get_queue(prefix + "dead-letters")
        letter = await dead.get(timeout=5)
        assert letter.body == b"\xc1 not msgpack"
        assert letter.headers["x-first-death-reason"] == "rejected"
        await letter.ack()
    await deliveries.stop()


@pytest.mark.rabbitmq
@pytest.mark.parametrize("broker_kind", ["amqp"])
async def test_asking_about_missing_queues_leaks_no_channel(make_broker: BrokerFactory) -> None:
    broker = await make_broker()
    assert isinstance(broker, AmqpBroker)
    await broker.queue_stats(["m3"])
    before = open_channels(broker)

    for _ in range(30):
        assert await broker.queue_stats(["m3", "m2"]) == {}
    await asyncio.sleep(0.5)  # room for any background channel restore to show up

    assert open_channels(broker) <= before


def open_channels(broker: AmqpBroker) -> int:
    # Internals on purpose: the leak would be invisible through the public API.
    total = 0
    for connection in (broker._connection, broker._counting):
        assert connection is not None and connection.transport is not None
        total += len(connection.transport.connection.channels)
    return total


def close_connection_named(name: str) -> None:
    """What an operator (or RabbitMQ itself, on a protocol error) does: close one client
    connection on the server, by its ``connection_name``."""
    listing = subprocess.run(["rabbitmqctl", "-q", "list_connections", "pid",
                              "client_properties"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    pids = [line.split("\t")[0] for line in listing.splitlines()
            if f'"connection_name","{name}"' in line]
    assert len(pids) == 1, (name, len(pids))
    subprocess.run(["rabbitmqctl", "-q", "close_connection", pids[0], "closed by the test"],
                   capture_output=True, timeout=60, check=True)


@pytest.mark.rabbitmq
@pytest.mark.parametrize("broker_kind", ["amqp"])
async def test_losing_the_counting_connection_costs_counts_only(
        make_broker: BrokerFactory, prefix: str) -> None:
    """Counting (passive declares, which RabbitMQ answers for a missing queue by closing
    the channel) has a connection of its own: when RabbitMQ closes it (round 6: a channel
    number reused while a 404's close was in flight), consumers and publishes carry on
    without a reconnect, counts fail fast meanwhile, and counting comes back by itself."""
    broker = await make_broker()
    assert isinstance(broker, AmqpBroker)
    sub = await broker.subscribe("m1", prefetch=1)
    deliveries: Collector[Delivery] = Collector(sub)
    assert await broker.queue_stats(["m2"]) == {}  # a 404: closes a counting channel only

    await asyncio.to_thread(close_connection_named, f"modelfleet-test {prefix} counts")
    first = make_task("m1")
    await broker.publish_task(first)
    got = await deliveries.next()
    assert got.task == first
    await got.ack()
    assert broker.connected  # the work's connection never dropped

    async def counting_again() -> bool:
        try:
            return (await broker.queue_stats(["m1"]))["m1"].consumers == 1
        except BrokerUnavailable:  # at once, while the counting connection reconnects
            return False

    await eventually(counting_again, 20, what="counting back")
    second = make_task("m1")
    await broker.publish_task(second)
    got = await deliveries.next()
    assert got.task == second
    await got.ack()
    await sub.cancel()
    await deliveries.stop()
