"""Inference requests in flight at the gateway: their read deadline, and the drain.

Each request runs inside a ``RequestGuard``, an ``asyncio.timeout`` whose deadline moves
with the phase: while the body is read it is ``gateway.body_read_timeout_s`` from the
start of the read (the whole body, not the gap between two chunks: a caller trickling a
byte a second must not hold a request open forever); while the request waits for its
reply there is none here (the request's own deadline applies, in the service).

At shutdown, ``drain`` refuses new requests (``ShuttingDown``: 503 with Retry-After),
waits up to ``gateway.drain_timeout_s`` for the requests in flight, then moves every
remaining deadline to *now*: each ends at once with ``ShuttingDown``, a JSON answer
written by the gateway itself. Left alone, uvicorn's graceful-shutdown timeout would
cancel them, and uvicorn answers a cancelled request with a plain-text 500.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

from modelfleet.errors import ModelfleetError, RequestRejected


class ShuttingDown(ModelfleetError):
    """This gateway is shutting down: the caller should retry (on another gateway)."""

    code = "shutting_down"
    status = 503
    retry_after_s = 1
    closes_connection = True


class RequestTimeout(RequestRejected):
    """The caller did not send its request (headers or body) in time."""

    code = "request_timeout"
    status = 408
    closes_connection = True  # the caller was too slow to be kept


# After the cut-off, how long the requests cut off get to write their answers.
ANSWER_GRACE_S = 5.0


class RequestGuard:
    """The deadline of one request in flight; ``RequestsInFlight.track`` makes them."""

    def __init__(self, scope: asyncio.Timeout) -> None:
        self._scope = scope
        self._read_s = 0.0
        self.cut_off = False

    @contextlib.contextmanager
    def reading(self, timeout_s: float) -> Iterator[None]:
        """Within the block, the request must end within ``timeout_s`` (RequestTimeout)."""
        self._read_s = timeout_s
        if not self.cut_off:
            self._scope.reschedule(asyncio.get_running_loop().time() + timeout_s)
        try:
            yield
        finally:
            if not self.cut_off and not self._scope.expired():
                self._scope.reschedule(None)

    def cut(self) -> None:
        """End the request now with ShuttingDown."""
        self.cut_off = True
        if not self._scope.expired():  # else it is ending already
            self._scope.reschedule(asyncio.get_running_loop().time())

    @property
    def timeout_message(self) -> str:
        return (f"the request body did not arrive within {self._read_s:g} s "
                "(gateway.body_read_timeout_s); send it faster, or send a URL to fetch it from")


class RequestsInFlight:
    def __init__(self) -> None:
        self._guards: set[RequestGuard] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False

    def __len__(self) -> int:
        return len(self._guards)

    @contextlib.asynccontextmanager
    async def track(self) -> AsyncIterator[RequestGuard]:
        """Run one request under a guard; raises ShuttingDown when draining or cut off,
        RequestTimeout when a ``guard.reading`` block overran."""
        if self.draining:
            raise ShuttingDown("this gateway is shutting down; retry the request")
        scope = asyncio.timeout(None)
        guard = RequestGuard(scope)
        self._guards.add(guard)
        self._idle.clear()
        try:
            async with scope:
                yield guard
        except TimeoutError as exc:
            if not scope.expired():
                raise  # someone else's timeout
            if guard.cut_off:
                raise ShuttingDown("this gateway shut down before the answer was ready; "
                                   "retry the request") from exc
            raise RequestTimeout(guard.timeout_message) from exc
        finally:
            self._guards.discard(guard)
            if not self._guards:
                self._idle.set()

    async def drain(self, timeout_s: float, hurry: asyncio.Event | None = None) -> int:
        """Refuse new requests, wait for those in flight up to ``timeout_s`` (or until
        ``hurry`` is set), then cut the rest off. Returns how many were cut off."""
        self.draining = True
        waits = [asyncio.ensure_future(self._idle.wait())]
        if hurry is not None:
            waits.append(asyncio.ensure_future(hurry.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        remaining = list(self._guards)
        for guard in remaining:
            guard.cut()
        if remaining:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ANSWER_GRACE_S):
                    await self._idle.wait()
        return len(remaining)
