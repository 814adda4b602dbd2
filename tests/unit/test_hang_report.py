"""The test rig's hang report: what a hung async test's tasks wait on, read from its log."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.hang_report import report_tasks


async def test_the_report_names_each_task_and_the_await_it_is_stuck_in(
        capsys: pytest.CaptureFixture[str]) -> None:
    never = asyncio.Event()

    async def stuck_on_an_event() -> None:
        await never.wait()

    task = asyncio.create_task(stuck_on_an_event(), name="stuck-task")
    await asyncio.sleep(0)  # it runs up to its wait
    reporter = threading.Thread(target=report_tasks, args=("a test",))  # as the timer does
    reporter.start()
    await asyncio.to_thread(reporter.join)
    task.cancel()
    err = capsys.readouterr().err
    stuck = err[err.index("stuck-task:"):]
    assert "in stuck_on_an_event" in stuck
    assert "asyncio/locks.py" in stuck.splitlines()[2]  # down to Event.wait itself
