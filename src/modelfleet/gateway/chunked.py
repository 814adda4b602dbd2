"""The chunk sizes of a chunked request body, bounded as each size line is read.

h11 takes a chunk size of up to 20 hex digits (``FFFFFFFFFFFFFFFFFFFF`` is 2**80 - 1
bytes) and then waits for that many bytes: a caller that declares such a chunk and stops
would hold its request until the body read timeout. ``ChunkGuardedConnection`` is h11's
server connection that refuses the body as soon as the size line has been parsed:

- a size no 63-bit length holds: 400 ``bad_request`` (no such body exists; Go's and
  Node's servers refuse it the same way);
- a chunk that takes the body past ``max_body_bytes``: 413 ``payload_too_large``, as a
  Content-Length over the limit is.

A size line h11 cannot parse at all is its own ``RemoteProtocolError`` (400) already.
"""

from __future__ import annotations

from typing import Any

import h11

from modelfleet.errors import PayloadTooLarge, RequestRejected

# The largest length a signed 64-bit integer holds: any chunk beyond it is malformed.
MAX_CHUNK_SIZE = 2**63 - 1


class ChunkRefused(Exception):
    """A chunked body refused for its declared size, with the error to answer."""

    def __init__(self, error: RequestRejected) -> None:
        super().__init__(error.message)
        self.error = error


class ChunkGuardedConnection(h11.Connection):
    """h11's server side of a connection whose ``next_event`` raises ``ChunkRefused`` for
    a chunk size over the bounds above (the module docstring)."""

    def __init__(self, max_incomplete_event_size: int, max_body_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size)
        self._max_body_bytes = max_body_bytes
        self._body_bytes = 0  # of the request being read, so far
        self._chunk_bytes = 0  # of the chunk being read, so far

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request):
            self._body_bytes = self._chunk_bytes = 0
        elif isinstance(event, h11.Data):
            self._body_bytes += len(event.data)
            self._chunk_bytes = 0 if event.chunk_end else self._chunk_bytes + len(event.data)
        if self.their_state is h11.SEND_BODY:
            self._check(self._rest_of_chunk())
        return event

    def _rest_of_chunk(self) -> int:
        """The bytes of the chunk being read that have not arrived yet (0 between chunks
        and for a body framed by Content-Length). h11 parses the size line and waits
        for the data in one step, and keeps the count only on its reader."""
        return int(getattr(self._reader, "_bytes_in_chunk", 0))

    def _check(self, rest: int) -> None:
        size = self._chunk_bytes + rest
        if size > MAX_CHUNK_SIZE:
            raise ChunkRefused(RequestRejected(
                f"malformed HTTP request: a chunk size of {size:#x} bytes is not a length"))
        declared = self._body_bytes + rest
        if declared > self._max_body_bytes:
            raise ChunkRefused(PayloadTooLarge(
                f"the chunked payload declares at least {declared} bytes; "
                f"the limit is {self._max_body_bytes}"))
