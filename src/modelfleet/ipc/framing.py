"""Runtime IPC framing: length-prefixed msgpack frames over a local (Unix) socket.

A frame is a 4-byte big-endian length, then a msgpack map. Requests are
``{"id": n, "op": name, "args": {...}}``; responses are ``{"id": n, "ok": true,
"result": ...}`` or ``{"id": n, "ok": false, "code": ..., "message": ...}``. Many
requests are in flight on one connection at once; responses come in any order.
The ops are named in ``modelfleet.ipc.protocol``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack

from modelfleet.errors import ModelfleetError

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



def error_response(request_id: int, error: ModelfleetError) -> dict[str, Any]:
    return {"id": request_id, "ok": False, "code": error.code, "message": error.message}
