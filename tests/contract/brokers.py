"""What the broker contract tests share: a task with every field set, a background
collector for async iterators, a poll for server-side timers, RabbitMQ cleanup."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any, Generic, TypeVar

import aio_pika

from modelfleet.broker import cold_lane
from modelfleet.messages import PayloadRef, Task, now_ms
from tests.conftest import rabbitmq_url

MODEL_IDS = ("m1", "m2", "m3")  # the only model ids tests use; teardown deletes their queues
T = TypeVar("T")


async def delete_amqp_names(prefix: str) -> None:
    """Best effort: what a test declared under ``prefix`` (expiry would get it later)."""
    with contextlib.suppress(Exception):
        connection = await aio_pika.connect(rabbitmq_url(), timeout=5)
        async with connection:
            channel = await connection.channel()
            names = [*MODEL_IDS, *(cold_lane(p) for p in (0, 1, 2)), "dead-letters"]
            for name in [prefix + m for m in names]:
                await channel.queue_delete(name)
            await channel.exchange_delete(prefix + "events")


def make_task(model_id: str = "m1", *, request_id: str = "", deadline_s: float = 60,
              **overrides: Any) -> Task:
    """A task with every field set to something other than its default."""
    fields: dict[str, Any] = {
        "request_id": request_id or uuid.uuid4().hex,
        "model_id": model_id,
        "version": "3",
        "deadline_ms": now_ms() + int(deadline_s * 1000),
        "reply_to": "inbox.somewhere",
        "payload": PayloadRef("inline", data=b"\x00\xffpayload", url="", size_bytes=9),
        "content_type": "image/png",
        "enqueued_ms": now_ms(),
        "tenant": "acme",
        "plan": "pro",
        "params": {"top_k": "5", "lang": "fr"},
    }
    fields.update(overrides)
    return Task(**fields)


class Collector(Generic[T]):
    """Drains an async iterator in the background so tests can await items one by one."""

    def __init__(self, iterable: Any) -> None:
        self.items: asyncio.Queue[T] = asyncio.Queue()
        self.ended = asyncio.Event()
        self._task = asyncio.create_task(self._drain(iterable))

    async def _drain(self, iterable: Any) -> None:
        try:
            async for item in iterable:
                self.items.put_nowait(item)
        finally:
            self.ended.set()

    async def next(self, timeout_s: float = 10) -> T:
        async with asyncio.timeout(timeout_s):
            return await self.items.get()

    async def take(self, n: int, timeout_s: float = 10) -> list[T]:
        return [await self.next(timeout_s) for _ in range(n)]

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task


class TcpProxy:
    """A TCP relay in front of RabbitMQ whose link the test can cut and restore.

    Cutting closes both sides of every relayed connection (RabbitMQ sees its client
    go, so it requeues unacked messages and drops exclusive queues) and refuses new
    ones until ``restore``: to the client, exactly a RabbitMQ that went down.
    """

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer),
                             return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.transport.abort()
            self._writers.discard(writer)

    async def cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()  # stop accepting first, so nothing slips in while we cut
        for writer in list(self._writers):
            writer.transport.abort()
        if server is not None:
            await server.wait_closed()

    async def restore(self) -> None:
        await self.start()  # same port: the client reconnects to the address it knows

    async def stop(self) -> None:
        await self.cut()
