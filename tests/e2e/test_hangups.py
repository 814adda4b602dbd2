"""A caller that hangs up cancels its task, through the same path as a passed deadline.

The gateway publishes a cancel event; a worker drops the task unrun if it has not
started (or abandons the runtime call under way, as at a deadline) and counts it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from tests.procs import metric_sum, serve


def wait_for_metric(base: str, name: str, at_least: float, **labels: str) -> float:
    deadline = time.monotonic() + 20
    while (value := metric_sum(base, name, **labels)) < at_least:
        assert time.monotonic() < deadline, f"{name}{labels} stayed at {value}"
        time.sleep(0.1)
    return value


def test_a_caller_that_hangs_up_cancels_its_queued_task(tmp_path: Path) -> None:
    # One permit: the second request waits in the worker while the first (a 3 s load) runs.
    proc, base = serve(tmp_path, env={"MODELFLEET_WORKER__PERMITS": "1"})
    try:
        async def scenario() -> httpx.Response:
            async with httpx.AsyncClient(timeout=60) as patient:
                first = asyncio.ensure_future(patient.post(
                    f"{base}/v1/models/slowload/infer", json={"v": 1}))
                await asyncio.sleep(0.5)
                async with httpx.AsyncClient(timeout=1.0) as impatient:
                    try:
                        await impatient.post(f"{base}/v1/models/slowload/infer",
                                             json={"v": 2})
                        raise AssertionError("the second request was answered at once")
                    except httpx.TimeoutException:
                        pass  # hung up while waiting
                return await first

        first = asyncio.run(scenario())
        assert first.status_code == 200 and first.json() == {"echo": {"v": 1}}
        wait_for_metric(base, "modelfleet_gateway_client_disconnects_total", 1)
        wait_for_metric(base, "modelfleet_worker_cancelled_tasks_total", 1, model="slowload")
        # The hung-up task never ran: only the first was answered by the model.
        assert metric_sum(base, "modelfleet_worker_tasks_total", model="slowload") == 1
    finally:
        proc.stop()


def test_a_caller_that_hangs_up_mid_load_frees_the_worker(tmp_path: Path) -> None:
    proc, base = serve(tmp_path)
    try:
        try:
            httpx.post(f"{base}/v1/models/slowload/infer", json={"v": 1}, timeout=1.0)
            raise AssertionError("answered before its 3 s load")
        except httpx.TimeoutException:
            pass
        wait_for_metric(base, "modelfleet_worker_cancelled_tasks_total", 1, model="slowload")
        assert metric_sum(base, "modelfleet_worker_permits_in_use") == 0
        assert metric_sum(base, "modelfleet_worker_expired_tasks_total", model="slowload") == 0
    finally:
        proc.stop()
