"""When a test is about to hit its timeout: what every asyncio task is waiting on.

pytest-timeout dumps the threads' stacks when a test runs out of time; a hung async test
shows only its main thread idle in the event loop, which says nothing of which coroutine
waits for what. A few seconds before the timeout this plugin prints, to stderr, the
stack of every task of every running event loop (``asyncio.Task.print_stack``), so a
hang seen once in CI can be read from its log.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
from collections.abc import Iterator

import pytest

AHEAD_S = 5.0  # printed this long before the test's timeout


def _timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    try:
        return float(item.config.getini("timeout") or 0)
    except (ValueError, TypeError):
        return 0.0


def report_tasks(name: str) -> None:
    """Print every running loop's tasks and where each one waits (best effort)."""
    out = sys.stderr
    print(f"\n--- {name}: asyncio tasks {AHEAD_S:.0f}s before the timeout ---", file=out)
    loops = [o for o in gc.get_objects()
             if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()]
    for loop in loops:
        for _ in range(3):  # the set can change under us: the loop is still running
            try:
                tasks = list(asyncio.all_tasks(loop))
                break
            except RuntimeError:
                continue
        else:
            continue
        print(f"loop {loop!r}: {len(tasks)} task(s)", file=out)
        for task in tasks:
            try:
                print(f"{task.get_name()}:", file=out)
                for line in _awaiting(task.get_coro()):
                    print(f"    {line}", file=out)
            except Exception as exc:  # a frame finished under us
                print(f"    {exc!r}", file=out)
    print("--- end of asyncio tasks ---", file=out, flush=True)


def _awaiting(coro: object) -> list[str]:
    """Where a coroutine waits, outermost first: each awaited coroutine or generator's
    frame (``Task.print_stack`` shows only the task's own)."""
    lines = []
    while coro is not None and len(lines) < 40:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) \
            or getattr(coro, "ag_frame", None)
        if frame is not None:
            lines.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) \
            or getattr(coro, "ag_await", None)
    if coro is not None:
        lines.append(repr(coro))
    return lines


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    timeout_s = _timeout_of(item)
    timer = None
    if timeout_s > AHEAD_S * 2:
        timer = threading.Timer(timeout_s - AHEAD_S, report_tasks, args=(item.nodeid,))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
