"""What a RabbitMQ node holds per live model queue: descriptors and memory, measured.

Starts a private RabbitMQ node (``modelfleet.devtools.rabbit_node``: its own ports, data
and a raised descriptor limit; never the machine's shared node), then declares model
queues exactly as modelfleet does (durable quorum, the same arguments) in steps, and
after each step prints the node's open descriptors (the beam process's, from /proc),
its Erlang memory and its RSS. Then it lets the queues expire and measures again.

    .venv/bin/python bench/broker_footprint.py [--steps 0,1000,2000] [--expiry-s 60]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aio_pika

from modelfleet.broker.rabbitmq.topology import model_queue_arguments
from modelfleet.devtools.rabbit_node import NodeResources, RabbitNode
from modelfleet.settings import BrokerSettings

MiB = 1024 * 1024


def row(label: str, queues: int, res: NodeResources, declare_s: float | None) -> str:
    took = f"{declare_s:6.1f}" if declare_s is not None else "     -"
    return (f"| {label:<16} | {queues:>6,} | {res.file_descriptors:>6,} | "
            f"{res.handles_used:>5,}/{res.file_descriptor_limit:<6,} | "
            f"{res.memory_bytes / MiB:>8.0f} | {res.rss_bytes / MiB:>7.0f} | {took} |")


async def declare(url: str, names: list[str], arguments: dict[str, object],
                  messages: int) -> float:
    """Declare ``names`` on 8 channels at once, and pass ``messages`` 1 KB messages through
    each (published, then taken and acked: the queue's Raft log is written); seconds."""
    started = time.monotonic()
    connection = await aio_pika.connect(url, timeout=30)
    async with connection:
        channels = [await connection.channel() for _ in range(8)]

        async def run(channel: aio_pika.abc.AbstractChannel, part: list[str]) -> None:
            for name in part:
                queue = await channel.declare_queue(name, durable=True, arguments=arguments)
                for _ in range(messages):
                    await channel.default_exchange.publish(aio_pika.Message(b"x" * 1024), name)
                for _ in range(messages):
                    message = await queue.get(fail=False)
                    if message is not None:
                        await message.ack()

        await asyncio.gather(*(run(c, names[i::8]) for i, c in enumerate(channels)))
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="0,1000,2000",
                        help="live model queues to measure at, ascending")
    parser.add_argument("--expiry-s", type=float, default=60,
                        help="queue_idle_expiry_s of the declared queues")
    parser.add_argument("--fd-limit", type=int, default=20_000)
    parser.add_argument("--messages", type=int, default=1,
                        help="messages passed through each queue after declaring it")
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    arguments = model_queue_arguments(
        BrokerSettings(queue_idle_expiry_s=args.expiry_s), "modelfleet.dead-letters")
    with tempfile.TemporaryDirectory(prefix="mf-rabbit-") as tmp, \
            RabbitNode.started(Path(tmp), fd_limit=args.fd_limit) as node:
        print(f"private node {node.node_name} on port {node.port}, "
              f"ulimit -n {args.fd_limit}, {args.messages} message(s) through each queue")
        print("| state            | queues | fds    | handles/limit | erlang MB | RSS MB "
              "| declare s |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        declared = 0
        for target in steps:
            took = None
            if target > declared:
                names = [f"model.m{i:06d}" for i in range(declared, target)]
                took = asyncio.run(declare(node.url, names, arguments, args.messages))
                declared = target
            time.sleep(3)  # let Ra settle its logs
            print(row("declared", node.queue_count(), node.resources(), took), flush=True)
        # The queues expire by themselves (nobody uses them): what is given back.
        deadline = time.monotonic() + args.expiry_s + 120
        while node.queue_count() > 0 and time.monotonic() < deadline:
            time.sleep(2)
        time.sleep(3)
        print(row("after expiry", node.queue_count(), node.resources(), None), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
