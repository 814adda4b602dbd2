"""Faults together: three poison pills at once, in the middle of innocent traffic.

A runtime crash hands back every task in flight on it, the innocent with the guilty.
Crash evidence is counted per task, and only a crash the task caused alone counts: so
the three pills each end in the dead-letter queue as deterministic, their callers get
500 ``runtime_crashed`` well before their deadlines, and every innocent request (for
other models on the same runtime, and for the pills' own model) is answered.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx

from tests.e2e.test_chaos import IRIS, broker, dlq  # noqa: F401  (fixture)
from tests.procs import metric_sum, serve
from tests.waiting import eventually_blocking

PILLS = 3


def test_three_poison_pills_at_once_cost_three_requests(
        tmp_path: Path, broker: tuple[str, dict[str, str]]) -> None:  # noqa: F811
    url, names = broker
    proc, base = serve(tmp_path, broker=url, env={
        "MODELFLEET_RUNTIME__PING_INTERVAL_S": "0.5",
        "MODELFLEET_WORKER__RESTART_BACKOFF_MAX_S": "0.5", **names})
    try:
        async def scenario() -> tuple[list[httpx.Response], list[httpx.Response], float]:
            async with httpx.AsyncClient(timeout=90) as client:
                await client.post(f"{base}/v1/models/iris/infer", json=IRIS)  # warm
                started = time.monotonic()
                pills = [asyncio.ensure_future(client.post(
                    f"{base}/v1/models/crasher/infer", content=b"CRASH",
                    headers={"content-type": "text/plain", "x-request-timeout": "90"}))
                    for _ in range(PILLS)]
                innocent: list[httpx.Response] = []

                async def neighbour(model: str) -> None:
                    while not all(p.done() for p in pills):
                        if model == "iris":
                            sent = client.post(f"{base}/v1/models/iris/infer", json=IRIS,
                                               headers={"x-request-timeout": "60"})
                        else:
                            sent = client.post(f"{base}/v1/models/crasher/infer",
                                               content=b"hello",
                                               headers={"content-type": "text/plain",
                                                        "x-request-timeout": "60"})
                        innocent.append(await sent)
                        await asyncio.sleep(0.05)

                await asyncio.gather(*pills, neighbour("iris"), neighbour("iris"),
                                     neighbour("crasher"))
                return [p.result() for p in pills], innocent, time.monotonic() - started

        pills, innocent, elapsed = asyncio.run(scenario())
        for pill in pills:
            assert pill.status_code == 500, pill.text
            assert pill.json()["error"]["code"] == "runtime_crashed"
            assert "dead-lettered" in pill.json()["error"]["message"]
        assert elapsed < 60, f"pill callers waited {elapsed:.0f}s: not prompt"
        bad = [(r.status_code, r.text) for r in innocent if r.status_code != 200]
        assert innocent and not bad, bad
        assert metric_sum(base, "modelfleet_worker_dead_lettered_total", model="crasher") \
            == PILLS
        assert metric_sum(base, "modelfleet_worker_dead_lettered_total", model="iris") == 0
        # The first crash, shared by all three (and their neighbours), counted for none
        # of them; each then crashed the quarantine runtime alone, once.
        eventually_blocking(lambda: metric_sum(base, "modelfleet_runtime_restarts_total")
                 >= 1 + PILLS)
    finally:
        proc.stop()
    if url != "memory":  # archived from RabbitMQ's dead-letter queue: all deterministic
        archived = dlq(tmp_path, url, names, "archive", "--once")
        assert archived.returncode == 0, archived.stderr
        listed = dlq(tmp_path, url, names, "list", "--json")
        records = [json.loads(line) for line in listed.stdout.splitlines() if line.strip()]
        assert sorted(r["model_id"] for r in records) == ["crasher"] * PILLS
        assert {r["failure_class"] for r in records} == {"deterministic"}
