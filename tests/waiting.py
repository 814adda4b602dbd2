"""Waiting for a state that nothing announces: the one polling helper of the suite.

``eventually`` (in a coroutine) and ``eventually_blocking`` (in a plain test or a thread)
call ``check`` until it returns something truthy and return that value, or fail with
an AssertionError naming ``what`` once ``timeout_s`` has passed. ``check`` may be a
plain function or, for ``eventually``, a coroutine function. ``state``, if given, is
called when the wait fails and its answer added to the message: what the test saw at
the last look (a queue's counts, a process's log).

Poll only for what tells nobody when it happens: another process's log or state, a
server's own timers (a queue expiring on RabbitMQ), a file. Where the code under test
sets an event or answers a call, await that instead. A timeout here is a bound for a
failing test, never a measurement: passing tests return as soon as the state holds.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

T = TypeVar("T")


def _failed(what: str, timeout_s: float, state: Callable[[], object] | None
            ) -> AssertionError:
    seen = "" if state is None else f"; at the last look: {state()}"
    return AssertionError(f"{what} did not hold within {timeout_s:g} s{seen}")


@overload
async def eventually(check: Callable[[], Awaitable[T]], timeout_s: float = 30.0, *,
                     what: str = "the condition", every_s: float = 0.05,
                     state: Callable[[], object] | None = None) -> T: ...


@overload
async def eventually(check: Callable[[], T], timeout_s: float = 30.0, *,
                     what: str = "the condition", every_s: float = 0.05,
                     state: Callable[[], object] | None = None) -> T: ...


async def eventually(check: Callable[[], T | Awaitable[T]], timeout_s: float = 30.0, *,
                     what: str = "the condition", every_s: float = 0.05,
                     state: Callable[[], object] | None = None) -> T:
    """Await until ``check()`` is truthy; returns its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            try:
                value = await asyncio.wait_for(value, max(deadline - time.monotonic(), every_s))
            except TimeoutError as exc:  # a check still running at the deadline
                raise _failed(what, timeout_s, state) from exc
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise _failed(what, timeout_s, state)
        await asyncio.sleep(every_s)


def eventually_blocking(check: Callable[[], T], timeout_s: float = 60.0, *,
                        what: str = "the condition", every_s: float = 0.1,
                        state: Callable[[], object] | None = None) -> T:
    """Block until ``check()`` is truthy; returns its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _failed(what, timeout_s, state)
        time.sleep(every_s)
