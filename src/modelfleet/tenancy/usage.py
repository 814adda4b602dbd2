"""Usage per tenant, model, hour and outcome: counted in memory, flushed to the store.

The request path only adds to a dict; a background task writes what accumulated every
``tenancy.usage_flush_s`` (in a thread: a slow database never stalls the event loop),
and ``close`` writes the rest at shutdown. A flush that fails keeps its rows for the
next one, so a database outage loses nothing while the process lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from modelfleet.errors import ModelfleetError
from modelfleet.tenancy.store import TenantStore, UsageRow

log = logging.getLogger("modelfleet.tenancy")
HOUR_MS = 3_600_000
Outcome = str  # ok | rejected | rate_limited | timeout | cancelled | failed


def outcome_of(status: int) -> Outcome:
    """The usage outcome of an HTTP status (what a bill or a dashboard groups by)."""
    if status < 400:
        return "ok"
    if status == 429:
        return "rate_limited"
    if status == 499:
        return "cancelled"
    if status == 504:
        return "timeout"
    return "rejected" if status < 500 else "failed"


@dataclass
class _Counts:
    requests: int = 0
    predict_s: float = 0.0
    load_s: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0


class UsageMeter:
    def __init__(self, store: TenantStore, flush_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._flush_s = flush_s
        self._clock = clock
        self._pending: dict[tuple[str, str, int, str], _Counts] = {}
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # one flush at a time

    def record(self, tenant: str, model: str, outcome: Outcome, predict_s: float = 0.0,
               load_s: float = 0.0, bytes_in: int = 0, bytes_out: int = 0) -> None:
        now_ms = int(self._clock() * 1000)
        key = (tenant, model, now_ms - now_ms % HOUR_MS, outcome)
        counts = self._pending.get(key)
        if counts is None:
            counts = self._pending[key] = _Counts()
        counts.requests += 1
        counts.predict_s += predict_s
        counts.load_s += load_s
        counts.bytes_in += bytes_in
        counts.bytes_out += bytes_out

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-flush")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._flush_s)
            await self.flush()

    async def flush(self) -> int:
        """Write what accumulated; the number of rows written (0 if it failed: kept)."""
        async with self._lock:
            taken, self._pending = self._pending, {}
            if not taken:
                return 0
            rows = [UsageRow(t, m, h, o, c.requests, c.predict_s, c.load_s, c.bytes_in,
                             c.bytes_out) for (t, m, h, o), c in taken.items()]
            try:
                await asyncio.to_thread(self._store.add_usage, rows)
            except ModelfleetError as exc:
                log.warning("usage: %d row(s) not written yet (%s); kept for the next flush",
                            len(rows), exc)
                for row in rows:  # back in, merged with what came meanwhile
                    self._merge(row)
                return 0
            return len(rows)

    def _merge(self, row: UsageRow) -> None:
        counts = self._pending.setdefault((row.tenant, row.model, row.hour_ms, row.outcome),
                                          _Counts())
        counts.requests += row.requests
        counts.predict_s += row.predict_s
        counts.load_s += row.load_s
        counts.bytes_in += row.bytes_in
        counts.bytes_out += row.bytes_out

    async def close(self) -> None:
        """Stop the periodic flush and write what is left."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush()
        if self._pending:
            log.error("usage: %d row(s) could not be written at shutdown", len(self._pending))
