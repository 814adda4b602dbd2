"""Exponential backoff, written once: pauses that start small, double, and stop growing.

Every retry loop in modelfleet (a task's reply through broker reconnects, a crashed
runtime's restarts) takes its pauses from a ``Backoff``; what a loop retries, and until
when, stays with the loop.
"""

from __future__ import annotations

import asyncio


class Backoff:
    """Pauses of ``first_s``, then twice the last, at most ``max_s``; ``reset`` after a
    success starts again from ``first_s``."""

    def __init__(self, first_s: float, max_s: float) -> None:
        if first_s <= 0 or max_s < first_s:
            raise ValueError(f"a backoff needs 0 < first_s <= max_s, not {first_s}, {max_s}")
        self.first_s = first_s
        self.max_s = max_s
        self._next = first_s

    def next(self) -> float:
        """The pause to take now (and the next one doubles)."""
        pause = self._next
        self._next = min(self._next * 2, self.max_s)
        return pause

    def reset(self) -> None:
        self._next = self.first_s

    async def sleep(self) -> float:
        """Sleep the next pause; returns it."""
        pause = self.next()
        await asyncio.sleep(pause)
        return pause
