"""A caller that hangs up cancels its task, through the same path as a passed deadline.

The gateway publishes a cancel event; a worker drops the task unrun if it has not
started (or abandons the runtime call under way, as at a deadline) and counts it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from tests.procs import metric_sum, serve, write_package
from tests.waiting import eventually_blocking


def wait_for_metric(base: str, name: str, at_least: float, **labels: str) -> None:
    eventually_blocking(lambda: metric_sum(base, name, **labels) >= at_least, 20,
                        what=f"{name}{labels} at {at_least:g} or more",
                        state=lambda: f"it stayed at {metric_sum(base, name, **labels)}")


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


SLOW_PREPROCESS = '''
    import asyncio
    import os
    from pathlib import Path

    from modelfleet import Model, Request


    class SlowPreprocess(Model):
        async def preprocess(self, request: Request) -> str:
            await asyncio.sleep(3)
            return request.text()

        def predict(self, batch: list[str]) -> list[dict[str, str]]:
            marker = Path(os.environ["PREDICT_MARKER"])
            with marker.open("a") as out:
                out.writelines(f"{text}\\n" for text in batch)
            return [{"echo": text} for text in batch]
'''


def test_a_caller_that_hangs_up_during_preprocess_leaves_no_predict_behind(
        tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_package(repo, "slowprep", """
        name = "slowprep"
        version = "1"
        entrypoint = "handler:SlowPreprocess"
        accepts = ["text/plain"]
        device = "cpu"
        memory_estimate_mb = 1
        timeout_s = 30
        """, SLOW_PREPROCESS)
    marker = tmp_path / "predicted.txt"
    proc, base = serve(tmp_path, repo=repo, env={"PREDICT_MARKER": str(marker)})
    try:
        text = {"content-type": "text/plain"}
        warm = httpx.post(f"{base}/v1/models/slowprep/infer", content=b"warm", headers=text,
                          timeout=30)
        assert warm.status_code == 200, warm.text
        assert marker.read_text() == "warm\n"
        try:  # hangs up 1 s into its 3 s preprocess
            httpx.post(f"{base}/v1/models/slowprep/infer", content=b"abandoned",
                       headers=text, timeout=1.0)
            raise AssertionError("answered before its 3 s preprocess")
        except httpx.TimeoutException:
            pass
        wait_for_metric(base, "modelfleet_worker_cancelled_tasks_total", 1, model="slowprep")
        # The permit is back as soon as the runtime dropped the task...
        assert metric_sum(base, "modelfleet_worker_permits_in_use") == 0
        # ...and its preprocess was stopped: no predict ran for it, now or later.
        time.sleep(3)
        assert marker.read_text() == "warm\n"
        assert "its caller hung up; dropped" in proc.log()
        after = httpx.post(f"{base}/v1/models/slowprep/infer", content=b"next", headers=text,
                           timeout=30)
        assert after.status_code == 200 and after.json() == {"echo": "next"}
    finally:
        proc.stop()
