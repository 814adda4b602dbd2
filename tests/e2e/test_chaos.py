"""Chaos with real processes: runtimes killed mid-request, hung loads, poison pills.

In each, every accepted request is answered or gets 504 at its deadline, the
numbers show up in metrics, and the fleet recovers with no manual step.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import rabbitmq_url, require_rabbitmq
from tests.procs import ROOT, metric_sum, serve
from tests.waiting import eventually_blocking

IRIS = {"features": [5.1, 3.5, 1.4, 0.2]}


@pytest.fixture(params=["memory", pytest.param("amqp", marks=pytest.mark.rabbitmq)])
def broker(request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, str]]]:
    """The embedded broker, or RabbitMQ with names of this test's own."""
    if request.param == "memory":
        yield "memory", {}
        return
    require_rabbitmq()
    tag = f"chaos{uuid.uuid4().hex[:8]}"
    yield rabbitmq_url(), {"MODELFLEET_BROKER__QUEUE_PREFIX": f"{tag}.",
                           "MODELFLEET_BROKER__EVENTS_EXCHANGE": f"{tag}.events",
                           "MODELFLEET_BROKER__DEAD_LETTER_QUEUE": f"{tag}.dead-letters"}


def test_runtime_killed_mid_request_is_handed_back_and_answered(
        tmp_path: Path, broker: tuple[str, dict[str, str]]) -> None:
    url, names = broker
    proc, base = serve(tmp_path, broker=url,
                       env={"MODELFLEET_RUNTIME__PING_INTERVAL_S": "0.5", **names})
    try:
        async def scenario() -> httpx.Response:
            async with httpx.AsyncClient(timeout=60) as client:
                pending = asyncio.ensure_future(client.post(
                    f"{base}/v1/models/slowload/infer", json={"v": 1},
                    headers={"x-request-timeout": "45"}))
                # slowload takes 3 s to load: kill its runtime in the middle of it.
                for _ in range(100):
                    fleet = (await client.get(f"{base}/v1/fleet")).json()["workers"]
                    if fleet and fleet[0]["permits_in_use"]:
                        break
                    await asyncio.sleep(0.1)
                victims = proc.runtimes()
                assert victims
                for victim in victims:
                    os.kill(victim.pid, signal.SIGKILL)
                return await pending

        response = asyncio.run(scenario())
        assert response.status_code == 200, response.text
        assert response.json() == {"echo": {"v": 1}}
        assert metric_sum(base, "modelfleet_runtime_restarts_total") >= 1
        assert metric_sum(base, "modelfleet_worker_tasks_handed_back_total",
                          model="slowload") >= 1
        assert httpx.post(f"{base}/v1/models/iris/infer", json=IRIS,
                          timeout=30).status_code == 200
    finally:
        proc.stop()


def test_hung_load_gets_504_then_the_runtime_is_replaced(
        tmp_path: Path, broker: tuple[str, dict[str, str]]) -> None:
    url, names = broker
    proc, base = serve(tmp_path, broker=url, env={**names,
        "MODELFLEET_EXAMPLE_SLOWLOAD_S": "600",  # never finishes within the test
        # Hung past this. The replacement runtime's model at the end is banner, pure
        # Python, whose load stays far within it even with both cores busy (iris, with
        # sklearn's import, once took over 3 s there: a load past the timeout is "hung"
        # too, and its runtime replaced under it).
        "MODELFLEET_RUNTIME__LOAD_TIMEOUT_S": "3",
        "MODELFLEET_RUNTIME__PING_INTERVAL_S": "0.5",
    })
    try:
        hung = httpx.post(f"{base}/v1/models/slowload/infer", json={"v": 1},
                          headers={"x-request-timeout": "2"}, timeout=30)
        assert hung.status_code == 504
        assert hung.json()["error"]["code"] == "deadline_exceeded"
        # /livez stays healthy while the load hangs: liveness is not the load's business.
        assert httpx.get(f"{base}/livez").status_code == 200
        eventually_blocking(lambda: metric_sum(base, "modelfleet_runtime_restarts_total",
                                    reason="load_hung") >= 1)
        # The task came back after the restart with its deadline gone: dropped unrun.
        eventually_blocking(lambda: metric_sum(base, "modelfleet_worker_expired_tasks_total",
                                    model="slowload") >= 1)
        ok = httpx.post(f"{base}/v1/models/banner/infer", content=b"still here", timeout=30,
                        headers={"content-type": "text/plain"})
        assert ok.status_code == 200, ok.text
        assert "still here" in ok.text
    finally:
        proc.stop()


def test_poison_pill_is_dead_lettered_and_others_keep_serving(
        tmp_path: Path, broker: tuple[str, dict[str, str]]) -> None:
    url, names = broker
    proc, base = serve(tmp_path, broker=url, env={
        "MODELFLEET_RUNTIME__PING_INTERVAL_S": "0.5",
        "MODELFLEET_WORKER__RESTART_BACKOFF_MAX_S": "0.5", **names})
    try:
        async def scenario() -> tuple[httpx.Response, list[httpx.Response]]:
            async with httpx.AsyncClient(timeout=60) as client:
                poison = asyncio.ensure_future(client.post(
                    f"{base}/v1/models/crasher/infer", content=b"CRASH",
                    headers={"content-type": "text/plain", "x-request-timeout": "60"}))
                others = []
                while not poison.done():
                    others.append(await client.post(f"{base}/v1/models/iris/infer",
                                                    json=IRIS))
                    await asyncio.sleep(0.2)
                return await poison, others

        poison, others = asyncio.run(scenario())
        assert poison.status_code == 500
        error = poison.json()["error"]
        assert error["code"] == "runtime_crashed"
        assert "dead-lettered" in error["message"] and "crasher" in error["message"]
        # Its first crash is on the shared runtime; redelivered, it is a suspect and runs
        # in quarantine, alone, where one crash dead-letters it: 2 crashes in all.
        assert metric_sum(base, "modelfleet_worker_dead_lettered_total", model="crasher") == 1
        # (The supervisor counts a restart when it has reaped the process, which can come a
        # moment after the coordinator saw the connection drop and answered the caller.)
        eventually_blocking(lambda: metric_sum(base, "modelfleet_runtime_restarts_total") >= 2)
        time.sleep(1)
        assert metric_sum(base, "modelfleet_runtime_restarts_total") == 2
        # Every request for another model was answered (some waited out a restart).
        assert others and all(r.status_code == 200 for r in others)
        fine = httpx.post(f"{base}/v1/models/crasher/infer", content=b"hello",
                          headers={"content-type": "text/plain"}, timeout=30)
        assert fine.status_code == 200 and fine.json() == {"echo": "hello"}
    finally:
        proc.stop()
    if url != "memory":  # the dead letter went to RabbitMQ's dead-letter queue: archive it
        archived = dlq(tmp_path, url, names, "archive", "--once")
        assert archived.returncode == 0, archived.stderr
        listed = dlq(tmp_path, url, names, "list", "--json")
        records = [json.loads(line) for line in listed.stdout.splitlines() if line.strip()]
        crashers = [r for r in records if r["model_id"] == "crasher"]
        assert len(crashers) == 1
        assert crashers[0]["failure_class"] == "deterministic"
        assert "runtime_crashed" in crashers[0]["death_reason"]


def dlq(tmp_path: Path, url: str, names: dict[str, str], *args: str
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "modelfleet", "dlq", *args, "--broker", url,
                           "--db", str(tmp_path / "dlq.sqlite3")] if args[0] == "archive" else
                          [sys.executable, "-m", "modelfleet", "dlq", *args,
                           "--db", str(tmp_path / "dlq.sqlite3")],
                          env={**os.environ, **names}, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
