"""Suspects run alone: attributing a runtime crash to the task that caused it.

When a runtime dies, every task in flight on it is handed back, the innocent with
the guilty: nobody knows which one killed it. If they were simply retried together,
a poison pill would keep taking its neighbours down with it, and they would reach
the delivery limit and be dead-lettered beside it. So a redelivered task (a
*suspect*) runs alone on its runtime: it waits for the tasks in flight there to
finish, and holds new ones back while it runs. An innocent suspect then succeeds; a
guilty one crashes the runtime with nothing else in flight, so only it is charged.
Suspects are rare (they exist only after a crash or a worker's death), so the cost
is a brief pause for one runtime, not a slower path for everyone.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterator

# How long a suspect from a crash lets suspects from no crash go first (see alone()).
MAX_YIELD_S = 1.0


class SuspectGate:
    """A readers-writer lock: ordinary tasks share the runtime, a suspect has it alone.

    Suspects waiting take precedence over new ordinary tasks, so a stream of
    ordinary traffic cannot keep a suspect waiting forever.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._shared = 0
        self._alone = False
        self._suspects_waiting = 0
        self._changed = asyncio.Condition()
        self._clock = clock
        # Waiting suspects, by arrival: (crashes it was in, when it came); see ``alone``.
        self._queue: dict[int, tuple[int, float]] = {}
        self._arrivals = itertools.count()

    def _first(self, key: int, now: float) -> bool:
        """Is the waiter ``key`` first in line at ``now``?"""
        def rank(k: int) -> tuple[int, int]:
            crashes, came = self._queue[k]
            return (0 if crashes == 0 or now - came >= MAX_YIELD_S else 1, k)
        return min(self._queue, key=rank) == key

    async def _wait_turn(self, key: int) -> None:
        """Wait, the condition held between checks, until the runtime is free and the
        waiter ``key`` is first in line.

        A waiter's rank changes with time alone (it stops yielding ``MAX_YIELD_S`` after it
        came), and nothing notifies then. Waiters woken together check one after the
        other, each at its own moment: one that checked just before its rank changed
        saw another ahead, and that other, checking just after, saw it ahead. Both
        would wait for a notify that may never come (the runtime idle, the queue full,
        until their deadlines). So a waiter that still yields checks again the moment
        it stops."""
        while True:
            wake_in: float | None = None
            if not self._alone and not self._shared:
                now = self._clock()
                if self._first(key, now):
                    return
                crashes, came = self._queue[key]
                if crashes and now - came < MAX_YIELD_S:
                    wake_in = came + MAX_YIELD_S - now
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wake_in):
                    await self._changed.wait()

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._alone and not self._suspects_waiting)
            self._shared += 1
        try:
            yield
        finally:
            async with self._changed:
                self._shared -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def alone(self, crashes: int = 0) -> AsyncIterator[None]:
        """Run alone. Among waiting suspects, those not yet in any crash (``crashes``: a
        model's innocents sent to quarantine with its queued pills) go before those
        handed back from one, which may be its pills, each costing a restart there;
        a suspect yields so for at most ``MAX_YIELD_S``; otherwise in arrival order."""
        async with self._changed:
            self._suspects_waiting += 1
            key = next(self._arrivals)
            self._queue[key] = (crashes, self._clock())
            try:
                await self._wait_turn(key)
            finally:
                self._suspects_waiting -= 1
                del self._queue[key]
                self._changed.notify_all()  # ordinary tasks held back for us may go now
            self._alone = True
        try:
            yield
        finally:
            async with self._changed:
                self._alone = False
                self._changed.notify_all()

    def slot(self, suspect: bool, crashes: int = 0
             ) -> contextlib.AbstractAsyncContextManager[None]:
        return self.alone(crashes) if suspect else self.shared()


class CrashWitness:
    """Which tasks were alone on a runtime: only a crash a task had to itself is evidence.

    A task is *alone* if no other task was in flight on the runtime at any moment of its
    call: it entered an idle runtime and nothing entered after it. The suspect gate
    makes that the case for every redelivered task.
    """

    def __init__(self) -> None:
        self._overlapped: dict[int, bool] = {}
        self._keys = itertools.count()

    @contextlib.contextmanager
    def on_runtime(self) -> Iterator[Callable[[], bool]]:
        """Held for one call; yields a check: "has it been alone so far?"."""
        key = next(self._keys)
        crowded = bool(self._overlapped)
        for other in self._overlapped:
            self._overlapped[other] = True
        self._overlapped[key] = crowded
        try:
            yield lambda: not self._overlapped[key]
        finally:
            del self._overlapped[key]
