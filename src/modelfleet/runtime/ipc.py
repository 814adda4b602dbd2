"""Runtime IPC: length-prefixed msgpack frames over a local (Unix) socket.

A frame is a 4-byte big-endian length, then a msgpack map. Requests are
``{"id": n, "op": name, "args": {...}}``; responses are ``{"id": n, "ok": true,
"result": ...}`` or ``{"id": n, "ok": false, "code": ..., "message": ...}``. Many
requests are in flight on one connection at once; responses come in any order.

Ops (the whole surface): ``load``, ``evict``, ``infer``, ``health``, ``stats``,
``shutdown``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any, Literal

import msgpack

from modelfleet.errors import ModelfleetError, RuntimeCrashed, error_from_code

Op = Literal["load", "evict", "infer", "health", "stats", "shutdown"]
MAX_FRAME_BYTES = 512 * 1024 * 1024


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    header = await reader.readexactly(4)
    size = int.from_bytes(header, "big")
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"IPC frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    frame = msgpack.unpackb(await reader.readexactly(size), raw=False)
    if not isinstance(frame, dict):
        raise ValueError("IPC frame is not a map")
    return frame


def pack_frame(message: dict[str, Any]) -> bytes:
    data: bytes = msgpack.packb(message, use_bin_type=True)
    return len(data).to_bytes(4, "big") + data


class RuntimeClient:
    """The coordinator's end of one runtime's socket. Safe for concurrent calls.

    If the connection drops (the runtime died), every pending and future call raises
    ``RuntimeCrashed``.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 name: str) -> None:
        self._reader = reader
        self._writer = writer
        self._name = name
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._closed: str | None = None
        self._write_lock = asyncio.Lock()
        self._pump = asyncio.create_task(self._read_responses(), name=f"ipc-read-{name}")

    @classmethod
    async def connect(cls, socket_path: str, name: str) -> RuntimeClient:
        reader, writer = await asyncio.open_unix_connection(socket_path, limit=2**20)
        return cls(reader, writer, name)

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def call(self, op: Op, timeout_s: float | None = None, **args: Any) -> Any:
        if self._closed is not None:
            raise RuntimeCrashed(f"runtime {self._name} is gone: {self._closed}")
        request_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            async with self._write_lock:
                self._writer.write(pack_frame({"id": request_id, "op": op, "args": args}))
                await self._writer.drain()
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise  # slow, not gone: the caller decides (TimeoutError is an OSError too)
        except (ConnectionError, OSError) as exc:
            self._fail_all(f"connection lost: {exc!r}")
            raise RuntimeCrashed(f"runtime {self._name} is gone: {exc!r}") from exc
        finally:
            self._pending.pop(request_id, None)

    async def _read_responses(self) -> None:
        try:
            while True:
                frame = await read_frame(self._reader)
                future = self._pending.get(frame.get("id", -1))
                if future is None or future.done():
                    continue
                if frame.get("ok"):
                    future.set_result(frame.get("result"))
                else:
                    future.set_exception(error_from_code(frame["code"], frame["message"]))
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


def error_response(request_id: int, error: ModelfleetError) -> dict[str, Any]:
    return {"id": request_id, "ok": False, "code": error.code, "message": error.message}
