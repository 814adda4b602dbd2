"""``SocketRuntime``: the coordinator's end of a runtime process's socket (see ``framing``).

Safe for concurrent calls. If the connection drops (the runtime died), every pending
and future call raises ``RuntimeCrashed``. A call that times out raises
``TimeoutError``: slow is not gone, and the caller decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

from modelfleet.errors import RuntimeCrashed, error_from_code
from modelfleet.ipc.flight import Flight, read_flight_record
from modelfleet.ipc.framing import Frame, pack_frame, read_frame
from modelfleet.ipc.protocol import (
    DeviceBudget,
    InferCall,
    Op,
    RuntimeHealth,
    RuntimeStats,
    budget_from_wire,
    health_from_wire,
    stats_from_wire,
)
from modelfleet.messages import EncodedReply


class SocketRuntime:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 name: str, flight_path: str | None = None) -> None:
        self._flight_path = flight_path  # its flight record (ipc/flight.py), if it keeps one
        self._record: Flight | None = None
        self._record_read = False
        self._reader = reader
        self._writer = writer
        self._name = name
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Frame]] = {}
        self._closed: str | None = None
        self._write_lock = asyncio.Lock()
        self._pump = asyncio.create_task(self._read_responses(), name=f"ipc-read-{name}")

    @classmethod
    async def connect(cls, socket_path: str, name: str, flight_path: str | None = None
                      ) -> SocketRuntime:
        reader, writer = await asyncio.open_unix_connection(socket_path, limit=2**20)
        return cls(reader, writer, name, flight_path)

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def crash_record(self) -> Flight | None:
        """Once the connection is gone: what its flight record says ran on the runtime's
        threads when it died (predicts and loads); None when unknown. Read once
        and kept, so that it outlives the file."""
        if self._closed is None or self._flight_path is None:
            return None
        if not self._record_read:
            self._record_read = True
            self._record = read_flight_record(self._flight_path)
        return self._record

    async def infer(self, call: InferCall, timeout_s: float | None = None) -> EncodedReply:
        frame = await self._call("infer", timeout_s, call.task, {
            "delivery_count": call.delivery_count, "accepts": list(call.accepts),
            "worker_id": call.worker_id, "queue_wait_ms": call.queue_wait_ms,
            "batching": dict(call.batching)})
        result = frame.header["result"]
        return EncodedReply(result["request_id"], result["status"], frame.body)

    async def load(self, model_id: str, version: str, pinned: bool = False,
                   timeout_s: float | None = None) -> None:
        await self._call("load", timeout_s, args={"model_id": model_id, "version": version,
                                                   "pinned": pinned})

    async def unload(self, model_id: str, timeout_s: float | None = None,
                     version: str | None = None) -> bool:
        frame = await self._call("unload", timeout_s, args={"model_id": model_id,
                                                             "version": version})
        return bool(frame.header["result"])

    async def unpin(self, model_id: str, version: str, timeout_s: float | None = None) -> None:
        await self._call("unpin", timeout_s, args={"model_id": model_id, "version": version})

    async def stats(self, timeout_s: float | None = None) -> RuntimeStats:
        return stats_from_wire((await self._call("stats", timeout_s)).header["result"])

    async def set_budgets(self, device_budget_bytes: int, host_budget_bytes: int | None = None,
                          timeout_s: float | None = None) -> None:
        await self._call("set_budgets", timeout_s, args={
            "device_budget_bytes": device_budget_bytes, "host_budget_bytes": host_budget_bytes})

    async def budget(self, timeout_s: float | None = None) -> DeviceBudget:
        return budget_from_wire((await self._call("budget", timeout_s)).header["result"])

    async def health(self, timeout_s: float | None = None) -> RuntimeHealth:
        return health_from_wire((await self._call("health", timeout_s)).header["result"])

    async def shutdown(self, timeout_s: float | None = None) -> None:
        await self._call("shutdown", timeout_s)

    async def cancel(self, request_id: str, timeout_s: float | None = None) -> bool:
        frame = await self._call("cancel", timeout_s, args={"request_id": request_id})
        return bool(frame.header["result"])

    async def _call(self, op: Op, timeout_s: float | None, body: bytes = b"",
                    args: dict[str, Any] | None = None) -> Frame:
        if self._closed is not None:
            raise RuntimeCrashed(f"runtime {self._name} is gone: {self._closed}")
        request_id = next(self._ids)
        future: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            async with self._write_lock:
                self._writer.write(pack_frame({"id": request_id, "op": op,
                                               "args": args or {}}, body))
                await self._writer.drain()
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise  # slow, not gone: the caller decides (TimeoutError is an OSError too)
        except (ConnectionError, OSError) as exc:
            # Our own future is answered by the raise below, not by _fail_all: nobody
            # would retrieve the exception set on it (asyncio logs that as an error).
            self._pending.pop(request_id, None)
            future.cancel()
            self._fail_all(f"connection lost: {exc!r}")
            raise RuntimeCrashed(f"runtime {self._name} is gone: {exc!r}") from exc
        finally:
            self._pending.pop(request_id, None)

    async def _read_responses(self) -> None:
        try:
            while True:
                frame = await read_frame(self._reader)
                future = self._pending.get(frame.header.get("id", -1))
                if future is None or future.done():
                    continue
                if frame.header.get("ok"):
                    future.set_result(frame)
                else:
                    future.set_exception(error_from_code(frame.header["code"],
                                                         frame.header["message"]))
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError) as exc:
            self._fail_all(f"connection closed ({type(exc).__name__})")

    def _fail_all(self, why: str) -> None:
        if self._closed is None:
            self._closed = why
        for future in self._pending.values():
            if not future.done():
                future.set_exception(RuntimeCrashed(f"runtime {self._name} is gone: {why}"))

    async def close(self) -> None:
        self._fail_all("closed by coordinator")
        self._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pump
        self._writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self._writer.wait_closed()
