"""Reading a request's body at the gateway, and noticing when its caller hangs up.

Shared by every route that takes a payload (/v1 and /v2 infer).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request
from starlette.requests import ClientDisconnect

from modelfleet.errors import ClientGone, PayloadTooLarge, RequestRejected

# The scope key under which the edge (``modelfleet.gateway.edge``) leaves the error it
# answered a body with while the app was still reading it (a chunk size that is no length
# or over the limit, a chunk h11 cannot parse): the app sees a disconnect, and raises this.
REFUSED_BODY = "modelfleet.refused_body"


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing (413) before reading past ``limit`` bytes; ClientGone if
    the caller hangs up before it is whole, or the edge's error if it refused the body
    (``REFUSED_BODY``)."""
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
        refused = request.scope.get(REFUSED_BODY)
        if isinstance(refused, RequestRejected):
            raise refused from None
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
