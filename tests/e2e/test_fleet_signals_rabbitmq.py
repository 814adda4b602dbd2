"""The autoscaling signals over a real RabbitMQ: two gateways and a worker as separate
processes. Requests held up behind a slow load wait in the model's queue; both
gateways (only one of which took them) report the same fleet-wide backlog and desired
workers, from the worker's published state and RabbitMQ's exact counts; only the one
holding the requests reports their age."""

from __future__ import annotations

import asyncio
import re
import uuid
from pathlib import Path

import httpx
import pytest

from modelfleet.broker import COLD_LANE
from tests.conftest import own_deployment, rabbitmq_url, require_rabbitmq
from tests.procs import Proc, gateway, worker
from tests.waiting import eventually_blocking

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(240)]
HELD = 4


def gauge(base: str, name: str, **labels: str) -> float | None:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{.*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            return float(match.group(2))
    return None


def test_every_gateway_reports_the_fleets_backlog_and_desired_workers(
        tmp_path: Path, procs: list[Proc]) -> None:
    require_rabbitmq()
    # slowload's load is held until the counts were read (the release file), at most 25 s
    # (the requests' default 30 s deadline outlasts it).
    release = tmp_path / "release"
    env = {**own_deployment(f"e2e{uuid.uuid4().hex[:8]}"),
           "MODELFLEET_WORKER__PERMITS": "1", "MODELFLEET_EXAMPLE_SLOWLOAD_S": "25",
           "MODELFLEET_EXAMPLE_SLOWLOAD_RELEASE": str(release),
           "MODELFLEET_WORKER__STATE_INTERVAL_S": "0.5"}
    bases = []
    for name in ("gw-a", "gw-b"):
        proc, base = gateway(tmp_path, rabbitmq_url(), env, name)
        procs.append(proc)
        bases.append(base)
    proc, _ = worker(tmp_path, rabbitmq_url(), env, "w1")
    procs.append(proc)
    taker, other = bases

    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=90) as client:
            return list(await asyncio.gather(*[
                client.post(f"{taker}/v1/models/slowload/infer", json={"n": i})
                for i in range(HELD)]))

    loop = asyncio.new_event_loop()
    held = loop.create_task(send())
    try:
        loop.run_until_complete(asyncio.sleep(0.5))

        def backlog_seen() -> bool:
            # All four sent, one taken (its permit in use), three in the queue: as both
            # gateways see it.
            for base in bases:
                totals = httpx.get(f"{base}/v1/fleet/summary", timeout=10).json()["totals"]
                if (totals["backlog"], totals["permits_in_use"]) != (HELD - 1, 1):
                    return False
            return gauge(taker, "modelfleet_gateway_parked_requests") == HELD

        loop.run_until_complete(asyncio.to_thread(
            eventually_blocking, backlog_seen, 90, what="the backlog at both gateways",
            every_s=0.3, state=lambda: [
                (httpx.get(f"{b}/v1/fleet/summary", timeout=10).json()["totals"],
                 gauge(b, "modelfleet_gateway_parked_requests")) for b in bases]))
        for base in bases:
            # One worker, and nobody held slowload: all four took the cold lane, whose
            # backlog has a label of its own (nobody can tell whose its tasks are).
            assert gauge(base, "modelfleet_fleet_backlog", model=COLD_LANE) == HELD - 1
            summary = httpx.get(f"{base}/v1/fleet/summary", timeout=10).json()
            totals = summary["totals"]
            assert (totals["workers"], totals["permits_in_use"], totals["permits_cap"]) == \
                (1, 1, 1)
            assert totals["backlog"] == HELD - 1
            # ceil((1 in use + 3 waiting) / (1 permit x 0.8))
            assert totals["desired_workers"] == 5
            assert gauge(base, "modelfleet_fleet_desired_workers") == 5
            assert gauge(base, "modelfleet_fleet_permit_utilization") == 1
        assert (gauge(taker, "modelfleet_fleet_oldest_waiting_seconds", model="slowload")
                or 0) > 0
        assert gauge(other, "modelfleet_fleet_oldest_waiting_seconds", model="slowload") \
            is None
        release.touch()  # read: let the load end
        answers = loop.run_until_complete(held)
    finally:
        if not held.done():
            held.cancel()
            loop.run_until_complete(asyncio.gather(held, return_exceptions=True))
        loop.close()
    assert [a.status_code for a in answers] == [200] * HELD
    eventually_blocking(lambda: all(
        gauge(b, "modelfleet_fleet_total_backlog") == 0
        and gauge(b, "modelfleet_fleet_desired_workers") == 0 for b in bases),
        90, what="the backlog drained at both gateways", every_s=0.3)
