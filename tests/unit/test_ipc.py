"""The runtime seam in one process: frames, and SocketRuntime against the real SocketServer.

The server side is the runtime process's own code (``SocketServer`` over a
``RuntimeService``) listening on a real Unix socket; only the process is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from modelfleet.errors import ModelNotFound, RuntimeCrashed
from modelfleet.ipc.framing import MAX_FRAME_BYTES, pack_frame, read_frame
from modelfleet.ipc.protocol import InferCall
from modelfleet.ipc.socket_runtime import SocketRuntime
from modelfleet.messages import PayloadRef, Task, decode_reply, encode_task, now_ms
from modelfleet.runtime.server import RuntimeService, SocketServer
from modelfleet.settings import Settings
from tests.procs import EXAMPLES
from tests.waiting import eventually


def reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_a_frame_carries_its_body_untouched() -> None:
    body = bytes(range(256)) * 10
    frame = await read_frame(reader_of(pack_frame({"id": 7, "op": "infer"}, body)))
    assert frame.header == {"id": 7, "op": "infer"} and frame.body == body
    empty = await read_frame(reader_of(pack_frame({"id": 8})))
    assert empty.body == b""


@pytest.mark.parametrize("raw, problem", [
    ((MAX_FRAME_BYTES + 1).to_bytes(4, "big") + (1).to_bytes(4, "big"), "exceeds"),
    ((10).to_bytes(4, "big") + (50).to_bytes(4, "big") + b"\x80" * 6, "overruns"),
    ((5).to_bytes(4, "big") + (1).to_bytes(4, "big") + b"\x01", "not a map"),
])
async def test_malformed_frames_are_refused(raw: bytes, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        await read_frame(reader_of(raw))


async def test_a_truncated_frame_is_an_incomplete_read() -> None:
    whole = pack_frame({"id": 1}, b"x" * 100)
    with pytest.raises(asyncio.IncompleteReadError):
        await read_frame(reader_of(whole[:-10]))


@contextlib.asynccontextmanager
async def served() -> AsyncIterator[tuple[SocketRuntime, RuntimeService, asyncio.Task[None]]]:
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "rt.sock")
        service = RuntimeService(Settings(repo=str(EXAMPLES), state_dir=Path(folder)))
        server = asyncio.create_task(SocketServer(service, "rt").serve(path))
        await eventually(lambda: os.path.exists(path),
                         2, what="the runtime's socket made", every_s=0.01)
        runtime = await SocketRuntime.connect(path, "rt")
        try:
            yield runtime, service, server
        finally:
            await runtime.close()
            service.stopping.set()
            await asyncio.wait_for(server, 10)


def iris_task() -> bytes:
    body = b'{"features": [5.1, 3.5, 1.4, 0.2]}'
    return encode_task(Task("r1", "iris", "1", now_ms() + 30_000, "inbox.x",
                            PayloadRef("inline", data=body, size_bytes=len(body)),
                            "application/json", now_ms()))


async def test_socket_runtime_round_trip_with_typed_results() -> None:
    async with served() as (runtime, _, _):
        health = await runtime.health(timeout_s=5)
        assert health.pid > 0 and health.loading == ()
        reply = await runtime.infer(InferCall(iris_task(), 0, ("application/json",), "w9",
                                              4.0), timeout_s=30)
        assert (reply.request_id, reply.status) == ("r1", "ok")
        decoded = decode_reply(reply.data)
        assert decoded.worker_id == "w9" and decoded.timings_ms["queue_wait"] == 4.0
        assert b"setosa" in decoded.body
        stats = await runtime.stats(timeout_s=5)
        assert stats.device == ("iris",) and [load.model_id for load in stats.loads] == ["iris"]
        assert stats.device_used_bytes > 0
        assert await runtime.unload("iris", timeout_s=5) is True
        assert (await runtime.stats(timeout_s=5)).device == ()
        assert await runtime.unload("iris", timeout_s=5) is False


async def test_errors_come_back_as_their_own_types() -> None:
    async with served() as (runtime, _, _):
        with pytest.raises(ModelNotFound):
            await runtime.load("no-such-model", "1", timeout_s=10)
        await runtime.load("iris", "1", pinned=True, timeout_s=30)  # the connection is fine
        assert (await runtime.stats(timeout_s=5)).pinned == ("iris",)


async def test_calls_in_flight_fail_when_the_runtime_goes_away() -> None:
    async with served() as (runtime, service, server):
        slow = asyncio.create_task(runtime.load("slowload", "1", timeout_s=30))
        await asyncio.sleep(0.3)  # the load (3 s) is under way
        service.stopping.set()  # the runtime stops serving and closes its socket
        await asyncio.wait_for(server, 10)
        with pytest.raises(RuntimeCrashed):
            await asyncio.wait_for(slow, 10)
        assert runtime.closed
        with pytest.raises(RuntimeCrashed):
            await runtime.health(timeout_s=1)


async def test_the_budget_op_reads_the_device_budget_over_the_socket() -> None:
    """What the worker's pool calls after moving a budget: a read that drains no stats."""
    async with served() as (runtime, _, _):
        await runtime.load("iris", "1", timeout_s=30)
        read = await runtime.budget(timeout_s=5)
        assert read.device == ("iris",) and 0 < read.used_bytes <= read.budget_bytes
        assert read.reserved_bytes == 0 and read.pinned_bytes == 0
        assert [load.model_id for load in (await runtime.stats(timeout_s=5)).loads] == ["iris"]
        await runtime.set_budgets(read.used_bytes - 1, timeout_s=5)
        moved = await runtime.budget(timeout_s=5)
        assert (moved.device, moved.used_bytes, moved.budget_bytes) == \
            ((), 0, read.used_bytes - 1)


async def test_a_call_that_finds_the_connection_gone_leaves_no_unretrieved_error() -> None:
    """Writing to a runtime that died: the call raises RuntimeCrashed, and no future is
    left holding an exception nobody retrieves (asyncio logs each one as an ERROR)."""
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    ours, theirs = socket.socketpair()
    try:
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        runtime = SocketRuntime(reader, writer, "rt")
        theirs.close()  # the runtime's end is gone before our write
        crashed = False
        try:  # (not pytest.raises: its traceback would keep the call's frames alive)
            await runtime.health(timeout_s=5)
        except RuntimeCrashed:
            crashed = True
        assert crashed and runtime.closed
        await runtime.close()
        del runtime, reader, writer  # what still refers to the failed call's frames
        for _ in range(2):  # the future, then what its callbacks held
            gc.collect()
            await asyncio.sleep(0.05)
        assert not [c for c in unhandled if "never retrieved" in str(c.get("message"))], \
            unhandled
    finally:
        loop.set_exception_handler(None)
        theirs.close()
