"""Reading a request's body at the gateway, and noticing when its caller hangs up.

Shared by every route that takes a payload (/v1 and /v2 infer).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request
from starlette.requests import ClientDisconnect

from modelfleet.errors import ClientGone, PayloadTooLarge


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing (413) before reading past ``limit`` bytes; ClientGone if
    the caller hangs up before it is whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"payload is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"payload exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone(f"the caller hung up during the upload, after {size} of "
                         f"{declared or 'an unknown number of'} bytes") from None
    return b"".join(chunks)


def disconnect_waiter(request: Request) -> Callable[[], Awaitable[None]]:
    """A coroutine function that returns when the caller hangs up."""
    async def wait() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    return wait
