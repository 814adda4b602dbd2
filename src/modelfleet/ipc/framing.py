"""Runtime IPC framing: a small msgpack header and an opaque body, over a local (Unix) socket.

A frame is a 4-byte big-endian length of the rest, a 4-byte length of the header,
the header (a msgpack map), then the body: bytes passed through untouched. Requests'
headers are ``{"id": n, "op": name, "args": {...}}``; responses' are ``{"id": n,
"ok": true, "result": ...}`` or ``{"id": n, "ok": false, "code": ..., "message":
...}``. An ``infer`` carries the task's bytes as its body and gets the encoded reply
back as the response's body, so neither is encoded again on this hop: the header is
the only thing packed here. Many requests are in flight on one connection at once;
responses come in any order. The ops are named in ``modelfleet.ipc.protocol``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgpack

from modelfleet.errors import ModelfleetError

MAX_FRAME_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class Frame:
    header: dict[str, Any]
    body: bytes = b""


async def read_frame(reader: asyncio.StreamReader) -> Frame:
    lengths = await reader.readexactly(8)
    size = int.from_bytes(lengths[:4], "big")
    header_size = int.from_bytes(lengths[4:], "big")
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"IPC frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    if header_size + 4 > size:
        raise ValueError(f"IPC frame header of {header_size} bytes overruns its frame")
    data = await reader.readexactly(size - 4)
    header = msgpack.unpackb(data[:header_size], raw=False)
    if not isinstance(header, dict):
        raise ValueError("IPC frame header is not a map")
    return Frame(header, data[header_size:])


def pack_frame(header: dict[str, Any], body: bytes = b"") -> bytes:
    packed: bytes = msgpack.packb(header, use_bin_type=True)
    size = 4 + len(packed) + len(body)
    return b"".join((size.to_bytes(4, "big"), len(packed).to_bytes(4, "big"), packed, body))


def error_header(request_id: int, error: ModelfleetError) -> dict[str, Any]:
    return {"id": request_id, "ok": False, "code": error.code, "message": error.message}
