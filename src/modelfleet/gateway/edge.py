"""The gateway's HTTP edge: connection limits, read timeouts, last-resort JSON answers.

uvicorn (h11) on its own holds a connection for as long as the caller likes while the
request's headers are incomplete (its keep-alive timer is disarmed by every byte), takes
as many connections as the kernel hands it, answers an over-limit request and a cancelled
one in plain text, and accepts Content-Length together with Transfer-Encoding. Here:

- ``EdgeProtocol`` (uvicorn's h11 protocol, subclassed) gives each connection
  ``header_read_timeout_s`` to deliver a request's headers, counted from when it opened
  or, on a kept-alive connection, from the first byte of its next request; it answers
  408 (JSON) and closes, or closes silently if not a byte came. A kept-alive connection
  with no request begun is idle: uvicorn closes it after ``keep_alive_timeout_s`` (75 s
  by default, longer than the idle expiry of common clients and proxies: httpx's 5 s,
  aiohttp's 15 s, an AWS load balancer's 60 s; with a server that closes first, a client
  reusing the connection in the same instant gets no answer, only a reset). A body still
  arriving ``BODY_GRACE_S`` after its body read timeout (the app's own ``RequestGuard``
  answers 408 at the timeout) has its connection closed: also when the app answered
  without reading it.
- A chunked body whose chunk size is no length (over 63 bits: 400) or takes the body
  past ``max_body_bytes`` (413) is answered as soon as the size line is read
  (``modelfleet.gateway.chunked``), not at the body read timeout; so is a chunk size
  h11 cannot parse (400). These answers, like every one written here once a request's
  head has been read, are in the error dialect of its path (/v2's ``{"error": ...}``),
  each a modelfleet error rendered by ``gateway/http.py`` with its own status.
- A connection beyond ``max_connections`` takes the place of the connection idle
  longest, if one is (closed as uvicorn closes an idle one at its keep-alive timeout);
  else it is refused at once: a JSON 503 ``too_many_connections`` (Retry-After: 1) as
  soon as its request's headers arrive, or after ``REFUSE_WAIT_S`` if they do not, then
  closed. (Not uvicorn's
  ``limit_concurrency``, which answers in plain text and only after the headers.)
- ``EdgeApp`` wraps the ASGI app: Content-Length with Transfer-Encoding is refused
  (400, closed: the framing that request smuggling relies on), and a request cancelled
  by the server before it answered still gets a JSON 503 ``shutting_down``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import H11Protocol

from modelfleet import metrics
from modelfleet.errors import ModelfleetError, RequestRejected
from modelfleet.gateway.body import REFUSED_BODY
from modelfleet.gateway.chunked import ChunkGuardedConnection, ChunkRefused
from modelfleet.gateway.corked import CorkedTransport
from modelfleet.gateway.http import (
    HeaderFieldsTooLarge,
    TooManyConnections,
    closing_error,
    raw_error,
)
from modelfleet.gateway.inflight import RequestTimeout, ShuttingDown

log = logging.getLogger("modelfleet.gateway")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# An over-limit connection whose headers do not come is answered after this long.
REFUSE_WAIT_S = 1.0
# The app answers a slow body with 408 at body_read_timeout_s; the connection of a body
# still arriving this much later is closed (by then, the app has long answered).
BODY_GRACE_S = 5.0


@dataclass(frozen=True)
class EdgeLimits:
    header_read_timeout_s: float
    body_read_timeout_s: float
    max_connections: int
    max_body_bytes: int = 20 * 1024 * 1024


async def _send_error(scope: Scope, receive: Receive, send: Send,
                      error: ModelfleetError) -> None:
    """``error`` answered in the dialect of the request's path; the connection closed."""
    await closing_error(error, scope.get("path", ""))(scope, receive, send)


_TOO_MANY = "this gateway has too many open connections; retry in a moment"


async def _refuse(scope: Scope, receive: Receive, send: Send) -> None:
    """The app of a connection over the limit."""
    await _send_error(scope, receive, send, TooManyConnections(_TOO_MANY))


class EdgeProtocol(H11Protocol):
    """uvicorn's h11 protocol with read timeouts and a connection limit (``EdgeLimits``);
    make a bound subclass with ``edge_protocol``."""

    limits: ClassVar[EdgeLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._phase = ""  # "head", "body", "refused" or "" (nothing timed)
        self._refused = False
        self._idle_since: float | None = None  # kept alive, no request begun: since when
        # uvicorn's connection, with chunk sizes bounded (no request has been read yet).
        head_limit = self.config.h11_max_incomplete_event_size
        self.conn = ChunkGuardedConnection(
            DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if head_limit is None else head_limit,
            self.limits.max_body_bytes)

    # -- the connection's lifetime --------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Every write from here on (uvicorn's and ours) goes through the cork: a
        # response's head and body leave in one send (gateway/corked.py).
        self.transport = CorkedTransport(transport, self.loop)  # type: ignore[assignment]
        metrics.OPEN_CONNECTIONS.set(len(self.connections))
        if len(self.connections) > self.limits.max_connections and not self._evict_idle():
            self._refused = True
            metrics.CONNECTIONS_REFUSED.inc()
            self.app = _refuse  # answered as soon as its request's headers arrive...
            self._arm("refused", min(REFUSE_WAIT_S, self.limits.header_read_timeout_s))
        else:
            self._arm("head", self.limits.header_read_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
        metrics.OPEN_CONNECTIONS.set(len(self.connections))

    def data_received(self, data: bytes) -> None:
        self._idle_since = None
        super().data_received(data)
        self._follow()

    def handle_events(self) -> None:
        try:
            super().handle_events()
        except ChunkRefused as refused:
            self._answer_request_and_close(refused.error)

    def on_response_complete(self) -> None:
        self.transport.flush()  # type: ignore[attr-defined]  # the whole answer, one send
        super().on_response_complete()
        self._follow()

    def _follow(self) -> None:
        """Time the phase the connection is in now: a request's head, its body, or none."""
        if self._refused or self.transport.is_closing():
            return
        theirs = self.conn.their_state
        if theirs is h11.IDLE and self.conn.our_state is h11.IDLE:
            if self.conn.trailing_data[0] or self.cycle is None:
                # A request's head begun, or none yet on a new connection.
                phase, timeout_s = "head", self.limits.header_read_timeout_s
            else:  # kept alive between requests: uvicorn's keep-alive timer is running
                phase, timeout_s = "", 0.0
                if self._idle_since is None:
                    self._idle_since = self.loop.time()
        elif theirs is h11.SEND_BODY:
            phase, timeout_s = "body", self.limits.body_read_timeout_s + BODY_GRACE_S
        else:
            phase, timeout_s = "", 0.0
        if phase != self._phase:
            self._disarm()
            if phase:
                self._arm(phase, timeout_s)

    def _evict_idle(self) -> bool:
        """Close the connection idle longest (not this one) to make room; False if none is
        idle. O(open connections), and only when they are over the cap."""
        idle = [c for c in self.connections
                if isinstance(c, EdgeProtocol) and c is not self and c._idle_since is not None
                and not c.transport.is_closing()]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c._idle_since or 0.0)
        oldest._idle_since = None
        oldest.timeout_keep_alive_handler()  # as its keep-alive timeout would
        metrics.IDLE_CONNECTIONS_CLOSED.inc()
        return True

    def _arm(self, phase: str, timeout_s: float) -> None:
        self._phase = phase
        self._timer = self.loop.call_later(timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._phase = ""

    def _expired(self) -> None:
        phase, self._timer, self._phase = self._phase, None, ""
        if self.transport.is_closing():
            return
        if phase == "refused":
            if self.cycle is None:  # no request came: answer for it
                self._answer_and_close(raw_error(TooManyConnections(_TOO_MANY)))
            return
        if phase == "head":
            pending, _ = self.conn.trailing_data
            if not pending:  # idle between requests: nothing to answer
                self.transport.close()
                return
            metrics.READ_TIMEOUTS.labels("header").inc()
            self._answer_and_close(raw_error(RequestTimeout(
                f"the request's headers did not arrive within "
                f"{self.limits.header_read_timeout_s:g} s (gateway.header_read_timeout_s)")))
            return
        # "body": still arriving well after the app answered (or should have) 408.
        metrics.READ_TIMEOUTS.labels("body").inc()
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            cycle.disconnected = True  # the app's own answer, if it comes, goes nowhere
            cycle.message_event.set()
            self._answer_and_close(raw_error(RequestTimeout(
                "the request body did not arrive in time (gateway.body_read_timeout_s)"),
                cycle.scope["path"]))
        else:
            self.transport.close()

    def _answer_and_close(self, answer: bytes) -> None:
        self.transport.write(answer)
        self.transport.close()

    def _answer_request_and_close(self, error: RequestRejected) -> None:
        """Answer the request being read (its head parsed, its body not yet whole) in its
        path's dialect, or a head that could not be parsed in /v1's; close either way.
        The app, still reading, is told why (``REFUSED_BODY``: it counts and logs the
        refusal, not a hang-up) and its own answer goes nowhere; if it has begun
        answering already, the connection is only closed."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.scope[REFUSED_BODY] = error  # type: ignore[literal-required]
            cycle.disconnected = True
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.close()
                return
            self._answer_and_close(raw_error(error, cycle.scope["path"]))
            return
        self._answer_and_close(raw_error(error))

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (its head, over max_header_bytes, or a chunk of its
        body): JSON 400, at once."""
        self._answer_request_and_close(RequestRejected(f"malformed HTTP request: {msg}"))


def edge_protocol(limits: EdgeLimits) -> type[EdgeProtocol]:
    """``EdgeProtocol`` bound to ``limits``: uvicorn makes one per connection."""
    return type("BoundEdgeProtocol", (EdgeProtocol,), {"limits": limits})


class EdgeApp:
    """The outermost ASGI layer of the gateway (see the module docstring)."""

    def __init__(self, app: ASGIApp, max_header_bytes: int = 16 * 1024,
                 max_headers: int = 100) -> None:
        self._app = app
        self._max_header_bytes = max_header_bytes
        self._max_headers = max_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        headers = scope["headers"]
        size = sum(len(name) + len(value) + 4 for name, value in headers)  # ": " and CRLF
        if len(headers) > self._max_headers or size > self._max_header_bytes:
            # However the head arrived (in one read or many: uvicorn bounds only a head
            # still incomplete), the same limit and the protocol's status for it.
            await _send_error(scope, receive, send, HeaderFieldsTooLarge(
                f"the request has {len(headers)} header fields of {size} bytes; "
                f"at most {self._max_headers} fields and "
                f"{self._max_header_bytes} bytes (gateway.max_header_bytes)"))
            return
        names = {name for name, _ in headers}
        if b"transfer-encoding" in names and b"content-length" in names:
            await _send_error(scope, receive, send, RequestRejected(
                "a request with both Content-Length and Transfer-Encoding is refused: its "
                "length is ambiguous"))
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._app(scope, receive, tracked)
        except asyncio.CancelledError:
            # Only the server's shutdown cancels a request (after the drain cut off what
            # was waiting, so this is a last resort). Answer in JSON, and end normally:
            # re-raising would make uvicorn log a traceback and answer text.
            if started:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            await _send_error(scope, receive, send, ShuttingDown(
                "this gateway shut down before the answer was ready; retry"))
