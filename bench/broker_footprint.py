"""What a RabbitMQ node holds per live model queue, and what counting them costs, measured.

Starts a private RabbitMQ node (``modelfleet.devtools.rabbit_node``: its own ports, data
and a raised descriptor limit; never the machine's shared node). Then, in steps, makes
model queues live the way gateways do (``AmqpBroker.publish_task`` of a short-lived
task to each new model: declare, lease renewal, confirmed publish) and after each step
prints the node's open descriptors (the beam process's, from /proc), the file handles
RabbitMQ counts against its limit, its Erlang memory and RSS, how long the step's
publishes took, and how long one ``queue_stats`` over every live queue and over 200
missing ones takes, against the same counts made one by one on one channel (as
``queue_stats`` did before). Then it lets the queues expire and measures again.

    .venv/bin/python bench/broker_footprint.py [--steps 0,1000,2000] [--expiry-s 120]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aio_pika
from aiormq.exceptions import ChannelNotFoundEntity

from modelfleet.broker.rabbitmq.broker import AmqpBroker
from modelfleet.devtools.rabbit_node import NodeResources, RabbitNode
from modelfleet.messages import PayloadRef, Task, now_ms
from modelfleet.settings import BrokerSettings

MiB = 1024 * 1024
MISSING = 200  # names that do not exist, counted at each step


def task(model_id: str, deadline_s: float) -> Task:
    return Task(request_id=f"r-{model_id}-{now_ms()}", model_id=model_id, version="1",
                deadline_ms=now_ms() + int(deadline_s * 1000), reply_to="inbox.nobody",
                payload=PayloadRef("inline", data=b"x" * 1024, url="", size_bytes=1024),
                content_type="application/json", enqueued_ms=now_ms())


def row(label: str, queues: int, res: NodeResources, publish_s: float | None,
        stats_s: tuple[float, ...] | None) -> str:
    took = f"{publish_s:.1f}" if publish_s is not None else "-"
    counted = (" | ".join(f"{s:.2f}" for s in stats_s) if stats_s is not None
               else "- | - | - | -")
    return (f"| {label} | {queues:,} | {res.file_descriptors:,} | "
            f"{res.handles_used:,} / {res.file_descriptor_limit:,} | "
            f"{res.memory_bytes / MiB:.0f} | {res.rss_bytes / MiB:.0f} | {took} | {counted} |")


async def publish_new(broker: AmqpBroker, models: list[str], deadline_s: float) -> float:
    """One task to each model, 100 at a time (a gateway's concurrency); seconds."""
    started = time.monotonic()
    for i in range(0, len(models), 100):
        await asyncio.gather(*(broker.publish_task(task(m, deadline_s))
                               for m in models[i:i + 100]))
    return time.monotonic() - started


async def one_by_one(url: str, names: list[str]) -> float:
    """The count as ``queue_stats`` made it before: one channel, one passive declare at a
    time, a fresh channel after each 404; seconds."""
    started = time.monotonic()
    connection = await aio_pika.connect(url, timeout=30)
    async with connection:
        channel = await connection.channel()
        for name in names:
            try:
                await channel.declare_queue(name, passive=True)
            except ChannelNotFoundEntity:
                channel = await connection.channel()
    return time.monotonic() - started


async def count(broker: AmqpBroker, url: str, live: list[str], repeats: int = 3
                ) -> tuple[float, ...]:
    """Median seconds of: one queue_stats over ``live``, then over ``MISSING`` names that
    do not exist; and the same two counts made one by one on one channel. Alternated,
    ``repeats`` times each, so that a noisy neighbour hits both ways alike."""
    missing = [f"missing-{i}" for i in range(MISSING)]
    prefix = BrokerSettings().queue_prefix
    times: list[list[float]] = [[], [], [], []]
    for _ in range(repeats):
        started = time.monotonic()
        found = await broker.queue_stats(live)
        times[0].append(time.monotonic() - started)
        assert len(found) == len(live), (len(found), len(live))
        times[2].append(await one_by_one(url, [prefix + m for m in live]))
        started = time.monotonic()
        assert await broker.queue_stats(missing) == {}
        times[1].append(time.monotonic() - started)
        times[3].append(await one_by_one(url, [prefix + m for m in missing]))
    return tuple(statistics.median(t) for t in times)


def broker_settings(url: str, expiry_s: float = 60) -> BrokerSettings:
    return BrokerSettings(url=url, queue_idle_expiry_s=expiry_s)


async def run(node: RabbitNode, steps: list[int], expiry_s: float) -> None:
    broker = AmqpBroker(broker_settings(node.url, expiry_s))
    await broker.connect()
    try:
        models: list[str] = []
        for target in steps:
            publish_s = None
            if target > len(models):
                new = [f"m{i:06d}" for i in range(len(models), target)]
                publish_s = await publish_new(broker, new, deadline_s=2)
                models += new
            await asyncio.sleep(3)  # let Ra settle its logs
            # The node's own listing includes the dead-letter queue.
            queues, resources = node.queue_count() - 1, node.resources()
            stats_s = await count(broker, node.url, models) if models else None
            print(row("live", queues, resources, publish_s, stats_s), flush=True)
    finally:
        await broker.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="0,1000,2000",
                        help="live model queues to measure at, ascending")
    parser.add_argument("--expiry-s", type=float, default=120,
                        help="queue_idle_expiry_s: long enough to outlast the steps")
    parser.add_argument("--fd-limit", type=int, default=20_000)
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    with tempfile.TemporaryDirectory(prefix="mf-rabbit-") as tmp, \
            RabbitNode.started(Path(tmp), fd_limit=args.fd_limit) as node:
        print(f"private RabbitMQ node {node.node_name} on port {node.port}, "
              f"ulimit -n {args.fd_limit}, queue_idle_expiry_s={args.expiry_s:g}")
        print("| state | model queues | open fds | handles / limit | Erlang MB | RSS MB "
              f"| publish s | count live s | count {MISSING} missing s | one by one: live s "
              f"| {MISSING} missing s |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        asyncio.run(run(node, steps, args.expiry_s))
        # Nobody uses them: they expire by themselves. What is given back?
        deadline = time.monotonic() + args.expiry_s + 120
        while node.queue_count() > 1 and time.monotonic() < deadline:
            time.sleep(2)
        time.sleep(3)
        print(row("after expiry", node.queue_count() - 1, node.resources(), None, None),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
