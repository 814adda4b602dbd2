"""Tenants end to end: API keys and roles on both brokers, revocation without a restart,
usage exported as CSV, and no key in any log (one rate limit shared by two gateways:
test_tenants_shared_limits.py).

Keys are made the way a user makes them (``modelfleet keys create``, its entry called
in this process: tests/e2e/tenancy.py) in the store the processes read."""

from __future__ import annotations

import csv
import io
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import rabbitmq_url, require_rabbitmq, require_redis
from tests.e2e.tenancy import (
    POSTGRES_URL,
    assert_no_key_logged,
    banner,
    bearer,
    broker_names,
    cli,
    new_key,
    tenancy_env,
)
from tests.procs import Proc, gateway, metric_sum, serve, worker
from tests.waiting import eventually_blocking


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
