"""A crash stays with its cause: poison pills crash the quarantine runtime, not the
shared one their bystanders need.

Three ``crasher`` pills and innocent crasher requests go out at once while clients
loop on iris and banner with those models' own deadlines (their ``timeout_s``, no
longer header). The pills share one crash of the shared runtime (nobody can tell a
pill before it crashes anything); its flight record names crasher, so the iris and
banner tasks in flight then go back cleared and run again on the restarted runtime,
while crasher's tasks, the pills still queued among them, run on the standing
quarantine runtime, alone, where one crash each proves a pill: the pills get 500
``runtime_crashed`` within seconds, the shared runtime is not restarted again, no
innocent crasher request is charged with a crash, and every bystander after the pills
is answered 200 within its deadline.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.test_chaos import IRIS, broker  # noqa: F401  (fixture)
from tests.procs import metric_sum, serve
from tests.waiting import eventually, eventually_blocking

PILLS = 3
INNOCENTS = 6  # crasher requests that are not pills, sent with them
REQUESTS: dict[str, dict[str, Any]] = {
    "iris": {"json": IRIS},
    "banner": {"content": b"hi", "headers": {"content-type": "text/plain"}}}


def _runtimes(base: str) -> dict[str, dict[str, Any]]:
    workers = httpx.get(f"{base}/v1/fleet").json()["workers"]
    return {r["name"]: r for r in workers[0]["runtimes"]}


def test_pills_crash_the_quarantine_runtime_and_bystanders_keep_their_deadlines(
        tmp_path: Path, broker: tuple[str, dict[str, str]]) -> None:  # noqa: F811
    url, names = broker
    proc, base = serve(tmp_path, broker=url, env={
        "MODELFLEET_RUNTIME__PING_INTERVAL_S": "0.5",
        "MODELFLEET_WORKER__RESTART_BACKOFF_MAX_S": "0.5", **names})
    try:
        async def scenario() -> tuple[list[httpx.Response], list[float],
                                      list[tuple[str, float, httpx.Response]], float,
                                      list[httpx.Response]]:
            async with httpx.AsyncClient(timeout=30) as client:
                for model, body in REQUESTS.items():
                    warm = await client.post(f"{base}/v1/models/{model}/infer", **body)
                    assert warm.status_code == 200, warm.text
                # It stands from the start (worker.quarantine_standing), unused.
                assert _runtimes(base)["quarantine"]["restarts"] == 0
                bystanders: list[tuple[str, float, httpx.Response]] = []
                stop = asyncio.Event()

                async def bystander(model: str) -> None:
                    while not stop.is_set():  # no deadline header: the model's timeout_s
                        at = time.monotonic()
                        sent = await client.post(f"{base}/v1/models/{model}/infer",
                                                 **REQUESTS[model])
                        bystanders.append((model, at, sent))
                        await asyncio.sleep(0.02)

                async def pill() -> tuple[httpx.Response, float]:
                    started = time.monotonic()
                    answer = await client.post(
                        f"{base}/v1/models/crasher/infer", content=b"CRASH",
                        headers={"content-type": "text/plain", "x-request-timeout": "30"})
                    return answer, time.monotonic() - started

                async def innocent() -> httpx.Response:  # crasher's own timeout_s
                    return await client.post(f"{base}/v1/models/crasher/infer",
                                             content=b"hello",
                                             headers={"content-type": "text/plain"})

                loops = [asyncio.ensure_future(bystander(m))
                         for m in ("iris", "iris", "iris", "banner", "banner")]
                await asyncio.sleep(0.5)
                innocents = asyncio.gather(*(innocent() for _ in range(INNOCENTS)))
                pills = await asyncio.gather(*(pill() for _ in range(PILLS)))
                answered = time.monotonic()
                # Bystanders after the pills, too: 6 s of them, and at least three sent
                # and answered per model (an iris caller caught in the shared crash may
                # wait out iris's reload first, most of 10 s with both cores busy).
                await asyncio.sleep(6)
                await eventually(lambda: all(
                    sum(1 for m, at, _ in bystanders if m == model and at >= answered) >= 3
                    for model in ("iris", "banner")), 40,
                    what="three bystanders of each model sent after the pills")
                stop.set()
                await asyncio.gather(*loops)
                return ([p for p, _ in pills], [t for _, t in pills], bystanders, answered,
                        await innocents)

        pills, waited, bystanders, answered, innocents = asyncio.run(scenario())
        for answer in pills:
            assert answer.status_code == 500, answer.text
            assert answer.json()["error"]["code"] == "runtime_crashed"
            assert "quarantine" in answer.json()["error"]["message"]
        assert max(waited) < 15, f"pill callers waited {waited}"
        # Once the pills are answered, nothing of them touches the shared runtime any
        # more: every bystander from then on is answered 200 within its own deadline.
        # (Those caught in the shared runtime's one crash mostly are too, but not always
        # on a loaded two-core box: iris's reload there, a new interpreter importing
        # scikit-learn, took 7-9 s of its 10 s; docs/failure.md.)
        after = [(m, r) for m, at, r in bystanders if at >= answered]
        bad = [(m, r.status_code, r.text) for m, r in after if r.status_code != 200]
        assert not bad, bad
        assert {m for m, _ in after} == {"iris", "banner"}
        # The crasher requests that were no pills are never charged with the pills'
        # crashes (no 500, no dead letter). Each is answered within crasher's timeout_s
        # nearly always, not always: one waits in quarantine behind a pill whose crash
        # there costs a restart (2-3 s on a loaded two-core box; docs/failure.md).
        assert {r.status_code for r in innocents} <= {200, 504}, [r.text for r in innocents]
        runtimes = _runtimes(base)
        # One crash of the shared runtime, the pills' first delivery, shared by all
        # three; every later one was in quarantine.
        assert runtimes["runtime-0"]["restarts"] <= 1, runtimes
        assert runtimes["quarantine"]["restarts"] >= PILLS, runtimes
        assert metric_sum(base, "modelfleet_worker_dead_lettered_total", model="crasher") \
            == PILLS
        assert metric_sum(base, "modelfleet_worker_dead_lettered_total", model="iris") == 0
        assert metric_sum(base, "modelfleet_worker_dead_lettered_total", model="banner") == 0
    finally:
        proc.stop()


def test_quarantine_runtime_stops_when_unused(tmp_path: Path) -> None:
    proc, base = serve(tmp_path, env={
        "MODELFLEET_RUNTIME__PING_INTERVAL_S": "0.5",
        "MODELFLEET_WORKER__QUARANTINE_STANDING": "false",  # started on demand
        "MODELFLEET_WORKER__QUARANTINE_IDLE_S": "2",
        "MODELFLEET_WORKER__STATE_INTERVAL_S": "0.2"})
    try:
        answer = httpx.post(f"{base}/v1/models/crasher/infer", content=b"CRASH", timeout=30,
                            headers={"content-type": "text/plain"})
        assert answer.status_code == 500, answer.text
        assert "quarantine" in answer.json()["error"]["message"]
        # /v1/fleet shows the worker's last state event (every state_interval_s): the
        # answer can come before the event that names the quarantine runtime.
        eventually_blocking(lambda: "quarantine" in _runtimes(base), timeout_s=5)
        eventually_blocking(lambda: "quarantine" not in _runtimes(base), timeout_s=20)
        assert _runtimes(base)["runtime-0"]["restarts"] == 1
        echo = httpx.post(f"{base}/v1/models/crasher/infer", content=b"hello", timeout=30,
                          headers={"content-type": "text/plain"})
        assert echo.status_code == 200, echo.text
    finally:
        proc.stop()
