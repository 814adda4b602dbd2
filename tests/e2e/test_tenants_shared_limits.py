"""Tenants end to end, two gateways: one rate limit and one concurrency limit shared
through the real Redis (``.ci/redis-up``), usage from both adding up, a revoked key
refused by both, and no key in any log."""

from __future__ import annotations

import asyncio
import csv
import io
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.conftest import rabbitmq_url, require_rabbitmq, require_redis
from tests.e2e.tenancy import (
    assert_no_key_logged,
    banner,
    bearer,
    broker_names,
    cli,
    new_key,
    tenancy_env,
)
from tests.procs import Proc, gateway, worker
from tests.waiting import eventually_blocking

PLANS = """
[plans.metered]
requests_per_s = 8
burst = 8
max_concurrent = 0

[plans.narrow]
requests_per_s = 0
max_concurrent = 2
"""


@pytest.mark.rabbitmq
def test_two_gateways_share_one_rate_limit_and_one_concurrency_limit(
        tmp_path: Path, procs: list[Proc]) -> None:
    """A tenant hammering two gateways gets its plan's rate across both (within 10 %), 429
    with Retry-After beyond it, and at most its plan's requests in flight; usage from both
    gateways adds up; a revoked key stops working on both."""
    require_rabbitmq()
    require_redis()
    db = tmp_path / "tenants.sqlite3"
    plans = tmp_path / "plans.toml"
    plans.write_text(PLANS)
    env = {**tenancy_env(db), **broker_names(),
           "MODELFLEET_TENANCY__PLANS_FILE": str(plans)}
    procs.append(worker(tmp_path, rabbitmq_url(), env, "w1")[0])
    gateways = []
    for name in ("gw1", "gw2"):
        proc, base = gateway(tmp_path, rabbitmq_url(), env, name)
        procs.append(proc)
        gateways.append(base.replace(f"{proc.api_key}:@", ""))
    metered = new_key(db, "examples", plan="metered", plans_file=plans)
    narrow_tenant = f"narrow-{uuid.uuid4().hex[:6]}"
    narrow = new_key(db, narrow_tenant, plan="narrow", plans_file=plans)
    cli(db, "tenants", "grant", narrow_tenant, "slowload")
    assert banner(gateways[0], metered).status_code == 200  # the worker is warm for banner
    time.sleep(1.5)  # the bucket refills (8/s, burst 8)

    async def hammer(duration_s: float) -> tuple[list[httpx.Response], float]:
        answers: list[httpx.Response] = []
        async with httpx.AsyncClient(timeout=60, headers={
                **bearer(metered), "content-type": "text/plain"}) as client:
            started = time.monotonic()
            last = started

            async def loop(base: str) -> None:
                nonlocal last
                while time.monotonic() - started < duration_s:
                    last = time.monotonic()
                    answers.append(await client.post(f"{base}/v1/models/banner/infer",
                                                     content=b"hi"))

            await asyncio.gather(*(loop(gateways[i % 2]) for i in range(8)))
        return answers, last - started

    answers, elapsed_s = asyncio.run(hammer(5.0))
    statuses = [a.status_code for a in answers]
    assert set(statuses) <= {200, 429}, statuses
    admitted = statuses.count(200)
    expected = 8 + 8 * elapsed_s  # the burst, then the rate, across both gateways
    print(f"shared rate limit: {admitted} admitted of {len(answers)} in {elapsed_s:.2f}s "
          f"over two gateways; the plan allows {expected:.1f}")
    assert abs(admitted - expected) <= 0.1 * expected, (admitted, expected, len(answers))
    limited = next(a for a in answers if a.status_code == 429)
    assert int(limited.headers["retry-after"]) >= 1
    assert limited.json()["error"]["code"] == "rate_limited"

    async def concurrent() -> list[int]:
        async with httpx.AsyncClient(timeout=60, headers=bearer(narrow)) as client:
            calls = [client.post(f"{gateways[i % 2]}/v1/models/slowload/infer", json={"i": i},
                                 headers={"x-request-timeout": "50"}) for i in range(4)]
            return [r.status_code for r in await asyncio.gather(*calls)]

    assert sorted(asyncio.run(concurrent())) == [200, 200, 429, 429]

    # Revoked: both gateways refuse it within seconds.
    cli(db, "keys", "revoke", metered.split("_")[1])
    for base in gateways:
        eventually_blocking(lambda base=base: banner(base, metered).status_code == 401, 5)

    for proc in procs:
        proc.stop()  # each gateway flushes what it counted
    rows = list(csv.DictReader(io.StringIO(cli(db, "usage", "--tenant", "examples",
                                               "--model", "banner", "--since", "1h",
                                               "--csv"))))
    by_outcome: dict[str, int] = {}
    for row in rows:  # one row per hour: a run across an hour's end has two
        by_outcome[row["outcome"]] = by_outcome.get(row["outcome"], 0) + int(row["requests"])
    assert by_outcome["ok"] == admitted + 1  # both gateways' counts in one row
    assert by_outcome["rate_limited"] == statuses.count(429)
    assert_no_key_logged(procs, [metered, narrow])
