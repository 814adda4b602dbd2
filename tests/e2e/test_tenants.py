"""Tenants end to end: API keys and roles on both brokers, revocation without a restart,
one rate limit shared by two gateways, usage exported as CSV, and no key in any log.

Keys are made the way a user makes them (``modelfleet keys create``, its entry called
in this process) in the store the processes read; limits are shared through the real
Redis (``.ci/redis-up``)."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from modelfleet.cli import main
from tests.conftest import rabbitmq_url, require_rabbitmq, require_redis
from tests.procs import Proc, gateway, metric_sum, serve, worker
from tests.waiting import eventually_blocking

POSTGRES_URL = os.environ.get("MODELFLEET_TEST_POSTGRES",
                              "postgresql://postgres@127.0.0.1:5432/test")


def cli(db: Path | str, *args: str) -> str:
    """Run ``modelfleet <args> --db db``; its stdout (it must succeed).

    The command's own entry (``modelfleet.cli.main``) in this process: each call started
    a Python and imported modelfleet (~0.7 s of CPU; this module makes ~60 calls, the
    usage polls among them). ``tests/unit/test_cli_help.py`` starts the commands."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*args, "--db", str(db)])
    assert code == 0, err.getvalue()
    return out.getvalue().strip()


def new_key(db: Path | str, tenant: str, role: str = "caller", plan: str | None = None,
            plans_file: Path | None = None) -> str:
    extra = ["--plan", plan] if plan else []
    extra += ["--plans-file", str(plans_file)] if plans_file else []
    return cli(db, "keys", "create", "--tenant", tenant, "--role", role, *extra)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def banner(base: str, key: str | None, **kwargs: object) -> httpx.Response:
    headers = {"content-type": "text/plain", **(bearer(key) if key else {})}
    return httpx.post(f"{base}/v1/models/banner/infer", content=b"hi", headers=headers,
                      timeout=60, **kwargs)  # type: ignore[arg-type]


def tenancy_env(db: Path | str) -> dict[str, str]:
    return {"MODELFLEET_TENANCY__DB": str(db), "MODELFLEET_TENANCY__CACHE_TTL_S": "1",
            "MODELFLEET_TENANCY__USAGE_FLUSH_S": "0.5",
            "MODELFLEET_TENANCY__REDIS_PREFIX": f"test-{uuid.uuid4().hex[:8]}:",
            "MODELFLEET_LOG_LEVEL": "debug"}


def broker_names() -> dict[str, str]:
    tag = f"tn{uuid.uuid4().hex[:8]}"
    return {"MODELFLEET_BROKER__QUEUE_PREFIX": f"{tag}.",
            "MODELFLEET_BROKER__EVENTS_EXCHANGE": f"{tag}.events",
            "MODELFLEET_BROKER__DEAD_LETTER_QUEUE": f"{tag}.dead-letters"}


def assert_no_key_logged(procs: list[Proc], keys: list[str]) -> None:
    for proc in procs:
        log = proc.log()
        assert " DEBUG " in log, "the processes must log at DEBUG for this check"
        for key in keys:
            secret = key.split("_", 2)[2]
            assert secret not in log, f"{proc.args[0]} logged a key:\n" \
                f"{log[max(0, log.find(secret) - 300):log.find(secret) + 300]}"


@pytest.fixture
def postgres_schema() -> Iterator[str]:
    """A PostgreSQL URL whose tables live in a schema of this test's own (dropped after)."""
    import psycopg

    schema = f"tn_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as db:
        db.execute(f"CREATE SCHEMA {schema}")
    try:
        yield f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as db:
            db.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.mark.parametrize("deployment", [
    "serve", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
    pytest.param("rabbitmq+postgres", marks=pytest.mark.rabbitmq)])
def test_keys_and_roles_end_to_end(tmp_path: Path, procs: list[Proc], deployment: str,
                                   request: pytest.FixtureRequest) -> None:
    """Who reaches what: 401 without a usable key, 404 (like a missing model) for another
    tenant's model until granted, 403 on operator routes for a caller; revocation takes
    effect within seconds; usage is exported; no key reaches a log. The store is SQLite,
    or PostgreSQL."""
    db: Path | str = tmp_path / "tenants.sqlite3"
    if deployment.endswith("postgres"):
        db = request.getfixturevalue("postgres_schema")
    env = tenancy_env(db)
    if deployment == "serve":
        proc, base = serve(tmp_path, env={**env, "MODELFLEET_TENANCY__AUTH": "on",
                                          "MODELFLEET_DLQ_DB": str(db)})
        procs.append(proc)
    else:
        require_rabbitmq()
        require_redis()
        env.update(broker_names())
        procs.append(worker(tmp_path, rabbitmq_url(), env, "w1")[0])
        proc, base = gateway(tmp_path, rabbitmq_url(), env, "gw")
        procs.append(proc)
        base = base.replace(f"{proc.api_key}:@", "")  # this test sends its own keys
    owner = new_key(db, "examples", plan="pro")
    outsider = new_key(db, f"outsider-{uuid.uuid4().hex[:6]}")
    outsider_tenant = cli(db, "keys", "list").splitlines()[-1].split()[1]
    operator = new_key(db, "ops", role="operator")

    # Probes stay open; everything else needs a key.
    for path in ("/livez", "/readyz", "/v2/health/ready"):
        assert httpx.get(f"{base}{path}").status_code == 200, path
    refused = banner(base, None)
    assert refused.status_code == 401 and "Bearer" in refused.headers["www-authenticate"]
    assert refused.json()["error"]["code"] == "unauthenticated"
    assert banner(base, "mfk_0123456789ab_" + "x" * 43).status_code == 401
    assert httpx.get(f"{base}/v1/models").status_code == 401

    # The owner's tenant reaches its model, by Bearer or as Basic credentials (curl -u).
    assert banner(base, owner).status_code == 200
    assert banner(base, None, auth=(owner, "")).status_code == 200
    assert httpx.post(f"{base}/v2/models/iris/infer", headers=bearer(owner), timeout=60, json={
        "inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32",
                    "data": [5.1, 3.5, 1.4, 0.2]}]}).status_code == 200

    # Another tenant's model looks like no model at all, in every route family.
    missing = httpx.post(f"{base}/v1/models/no-such-model/infer", content=b"hi",
                         headers={"content-type": "text/plain", **bearer(outsider)})
    hidden = banner(base, outsider)
    assert hidden.status_code == missing.status_code == 404
    assert hidden.json()["error"]["code"] == missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{base}/v1/models/banner", headers=bearer(outsider)).status_code == 404
    assert httpx.get(f"{base}/v2/models/iris", headers=bearer(outsider)).status_code == 404
    assert httpx.get(f"{base}/v1/models", headers=bearer(outsider)).json() == {
        "models": [], "next_cursor": None}
    listed = {m["name"] for m in httpx.get(f"{base}/v1/models", headers=bearer(owner)).json()[
        "models"]}
    assert {"banner", "iris"} <= listed

    # A grant takes effect without a restart.
    cli(db, "tenants", "grant", outsider_tenant, "banner")
    eventually_blocking(lambda: banner(base, outsider).status_code == 200, 10)
    assert {m["name"] for m in httpx.get(f"{base}/v1/models", headers=bearer(outsider)).json()[
        "models"]} == {"banner"}

    # The control API needs the operator role (and acts on the operator's own tenant's
    # models: tests/e2e/test_control_tenancy.py); the fleet-wide views, the admin role.
    as_caller = httpx.post(f"{base}/v2/repository/index", headers=bearer(owner), json={})
    assert as_caller.status_code == 403, as_caller.text
    assert "operator role" in as_caller.json()["error"]  # /v2: the protocol's shape
    as_operator = httpx.post(f"{base}/v2/repository/index", headers=bearer(operator), json={})
    assert as_operator.status_code == 200 and as_operator.json() == [], as_operator.text
    for path in ("/v1/fleet", "/dashboard"):
        for key in (owner, operator):
            refused = httpx.get(f"{base}{path}", headers=bearer(key))
            assert refused.status_code == 403, (path, refused.text)
            assert refused.json()["error"]["code"] == "forbidden"
    # ...and an operator is not a tenant's caller.
    assert banner(base, operator).status_code == 404

    # Revocation: refused within seconds, by the same process, with no restart.
    assert all(banner(base, owner).status_code == 200 for _ in range(3))
    owner_ok = 2 + 3  # banner calls of the owner answered 200 (Bearer, Basic, these three)
    key_id = owner.split("_")[1]
    cli(db, "keys", "revoke", f"mfk_{key_id}")
    answered: list[int] = []  # the owner's calls while the revocation spreads

    def refused() -> bool:
        answered.append(banner(base, owner).status_code)
        return answered[-1] == 401

    started = time.monotonic()
    eventually_blocking(refused, 5, what="the revoked key refused")
    took_s = time.monotonic() - started
    owner_ok += answered.count(200)  # answered before the gateway saw it: metered too
    assert banner(base, owner).json()["error"]["message"].endswith("was revoked")
    assert "revoked" in cli(db, "keys", "list")
    assert took_s < 5

    # Usage: the owner's successful calls, flushed by the running process, as CSV.
    def exported() -> list[dict[str, str]]:
        text = cli(db, "usage", "--tenant", "examples", "--since", "1h", "--csv")
        return list(csv.DictReader(io.StringIO(text)))

    def owner_rows_complete() -> bool:
        rows = exported()
        ok = sum(int(r["requests"]) for r in rows if r["model"] == "banner"
                 and r["outcome"] == "ok")
        return ok == owner_ok and any(r["model"] == "iris" for r in rows)

    eventually_blocking(owner_rows_complete, 10)
    # A name that is no model makes no usage row, whoever sends it (an admin reaches any).
    admin = new_key(db, "ops", role="admin")
    assert httpx.post(f"{base}/v1/models/no-such-model/infer", content=b"hi", timeout=60,
                      headers={"content-type": "text/plain", **bearer(admin)}).status_code == 404
    assert banner(base, admin).status_code == 200  # flushed with it, or after it
    def ops_rows() -> list[dict[str, str]]:
        text = cli(db, "usage", "--tenant", "ops", "--since", "1h", "--csv")
        return list(csv.DictReader(io.StringIO(text)))

    eventually_blocking(lambda: any(r["model"] == "banner" for r in ops_rows()), 10)
    assert {r["model"] for r in ops_rows()} == {"banner"}
    # Metrics carry the tenant (the first ones seen; bounded); they name tenants and models,
    # so with auth on /metrics needs the operator role too.
    assert httpx.get(f"{base}/metrics").status_code == 401
    assert httpx.get(f"{base}/metrics", headers=bearer(new_key(db, "ops"))).status_code == 403
    scrape = base.replace("http://", f"http://{operator}:@")
    assert metric_sum(scrape, "modelfleet_tenant_requests_total", tenant="examples",
                      outcome="ok") == owner_ok + 1  # and the iris call
    assert metric_sum(scrape, "modelfleet_gateway_auth_refusals_total", status="401") >= 3
    rows = [r for r in exported() if r["model"] == "banner" and r["outcome"] == "ok"]
    assert sum(int(r["bytes_in"]) for r in rows) == 2 * owner_ok  # b"hi" each
    assert sum(int(r["bytes_out"]) for r in rows) > 0
    assert sum(float(r["predict_s"]) for r in rows) > 0

    proc.stop()
    assert_no_key_logged(procs, [owner, outsider, operator])


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
