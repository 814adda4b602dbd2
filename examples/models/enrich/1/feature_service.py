"""A tiny JSON feature store over HTTP, on its own event loop in a daemon thread.

It stands in for the remote feature store a real enrichment model would call. It
listens on 127.0.0.1 on an ephemeral port and answers::

    GET /features?entity=user-42  ->  200 {"account_age_days": ..., ...}
                                      404 {"error": "unknown entity 'x'"}

Every lookup sleeps ``latency_s`` first (a simulated network and database wait).
The server is asyncio, so that wait holds no thread and many lookups overlap;
``in_flight`` and ``max_in_flight`` count them, so a test can see the overlap
without timing anything.

The data is generated, not fetched: ``generate_features`` derives entity
``user-<n>`` (n = 0 .. 999) from a string-seeded ``random.Random``, identical in
every process and on every machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
from typing import Any
from urllib.parse import parse_qs, urlsplit

ENTITY_COUNT = 1000
COUNTRIES = ("DE", "FR", "NL", "PL", "SE", "ES", "IT")
MAX_HEADER_BYTES = 8192


def entity_features(n: int) -> dict[str, Any]:
    rng = random.Random(f"modelfleet-enrich-v1:user-{n}")
    orders = rng.randint(0, 40)
    return {
        "account_age_days": rng.randint(1, 3650),
        "orders_90d": orders,
        "returns_90d": rng.randint(0, orders // 3) if orders else 0,
        "avg_order_eur": round(rng.uniform(5.0, 250.0), 2),
        "country": rng.choice(COUNTRIES),
    }


def generate_features(count: int = ENTITY_COUNT) -> dict[str, dict[str, Any]]:
    """Features of ``user-0`` .. ``user-<count-1>``; the same on every call."""
    return {f"user-{n}": entity_features(n) for n in range(count)}


class FeatureService:
    """Serves ``features`` over HTTP on 127.0.0.1 until ``stop``."""

    def __init__(self, features: dict[str, dict[str, Any]], latency_s: float) -> None:
        self.features = features
        self.latency_s = latency_s
        self.port = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.served = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="enrich-feature-service")
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the thread and return once the port is listening."""
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._listen(), self._loop)
        self.port = future.result(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the listener and open connections, stop the loop, join the thread."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._loop.close()

    def reset_stats(self, timeout_s: float = 5.0) -> None:
        """Zero the counters (between test cases that share one service); returns once done."""
        asyncio.run_coroutine_threadsafe(self._reset_stats(), self._loop).result(timeout_s)

    async def _reset_stats(self) -> None:
        # On the service's loop, like every other change to the counters.
        self.max_in_flight = self.in_flight
        self.served = 0

    async def _listen(self) -> int:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def _close(self) -> None:
        # Stop accepting, then end the keep-alive connections still open.
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:  # HTTP/1.1 keep-alive: one request after another
                head = await reader.readuntil(b"\r\n\r\n")
                if len(head) > MAX_HEADER_BYTES:
                    break
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                headers = dict(
                    (k.strip().lower(), v.strip())
                    for k, _, v in (h.partition(":") for h in header_lines if h)
                )
                length = int(headers.get("content-length", "0") or 0)
                if length:
                    await reader.readexactly(length)
                status, body = await self._answer(request_line)
                writer.write(
                    f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\n\r\n".encode("latin-1") + body
                )
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
                ValueError):
            pass  # the client went away or sent garbage: drop the connection
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, request_line: str) -> tuple[str, bytes]:
        method, _, rest = request_line.partition(" ")
        target = rest.rpartition(" ")[0]
        url = urlsplit(target)
        if method != "GET" or url.path != "/features":
            return "404 Not Found", b'{"error": "try GET /features?entity=user-42"}'
        entity = parse_qs(url.query).get("entity", [""])[0]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.latency_s)  # the simulated lookup: holds no thread
        finally:
            self.in_flight -= 1
        self.served += 1
        features = self.features.get(entity)
        if features is None:
            return "404 Not Found", json.dumps({"error": f"unknown entity {entity!r}"}).encode()
        return "200 OK", json.dumps(features).encode()
