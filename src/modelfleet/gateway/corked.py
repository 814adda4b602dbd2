"""A connection's writes of one response go out as one send.

uvicorn writes a response's head and its body with two ``transport.write`` calls, so a
small answer left in two TCP segments: two ``sendto`` calls in the gateway and two
wake-ups of the caller, for every request (seen with strace). ``CorkedTransport`` holds
what is written until the response is complete (the edge flushes it from
``on_response_complete``) or, for a streamed body, until the event loop's next turn, and
sends it as one write. Everything else is the wrapped transport's.
"""

from __future__ import annotations

import asyncio
from typing import Any


class CorkedTransport:
    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._pending:  # a streamed body goes out at the loop's next turn
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def flush(self) -> None:
        """Send what is held, as one write."""
        if self._pending:
            data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
            self._pending.clear()
            self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()  # what was answered still goes out, before the close
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
