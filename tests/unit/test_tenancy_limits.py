"""Rate and concurrency limits (in-process and on a real Redis), usage buffering, and the
key cache that makes revocation take effect without a restart."""

from __future__ import annotations

import asyncio
import base64
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelfleet.tenancy import RateLimited, TenancyStoreUnavailable, Unauthenticated
from modelfleet.tenancy.identity import Authenticator, token_of
from modelfleet.tenancy.limits import LocalLimits, RedisLimits
from modelfleet.tenancy.plans import BUILTIN, Plan
from modelfleet.tenancy.store import UsageRow, open_store
from modelfleet.tenancy.usage import UsageMeter, outcome_of
from tests.conftest import require_redis

REDIS_URL = os.environ.get("MODELFLEET_TEST_REDIS", "redis://127.0.0.1:6379/0")
PLAN = Plan(name="t", requests_per_s=10, burst=5, max_concurrent=3)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- in-process --------------------------------------------------------------------------

async def test_local_rate_allows_the_burst_then_the_rate_with_a_retry_after() -> None:
    clock = Clock()
    limits = LocalLimits(clock)
    plan = Plan(name="t", requests_per_s=2, burst=3, max_concurrent=0)
    for _ in range(3):
        await limits.admit("a", plan, 30)
    with pytest.raises(RateLimited, match="rate of 2 requests/s") as caught:
        await limits.admit("a", plan, 30)
    assert caught.value.retry_after_s == 1
    await limits.admit("b", plan, 30)  # tenants do not share a bucket
    clock.now += 0.5  # one emission interval: one more
    await limits.admit("a", plan, 30)
    with pytest.raises(RateLimited):
        await limits.admit("a", plan, 30)


async def test_local_concurrency_counts_leases_until_released_or_expired() -> None:
    clock = Clock()
    limits = LocalLimits(clock)
    plan = Plan(name="t", requests_per_s=0, burst=1, max_concurrent=2)
    first = await limits.admit("a", plan, 30)
    await limits.admit("a", plan, 30)
    with pytest.raises(RateLimited, match="2 requests in flight"):
        await limits.admit("a", plan, 30)
    await first()
    await limits.admit("a", plan, 30)
    clock.now += 31  # a gateway that died holding leases: they run out
    await limits.admit("a", plan, 30)
    await limits.admit("a", plan, 30)


# -- Redis -------------------------------------------------------------------------------

async def test_two_redis_limiters_share_one_bucket_and_one_lease_set() -> None:
    require_redis()
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    one, two = RedisLimits(REDIS_URL, prefix), RedisLimits(REDIS_URL, prefix)
    try:
        plan = Plan(name="t", requests_per_s=0.001, burst=4, max_concurrent=0)
        admitted = 0
        for limits in (one, two, one, two, one, two):
            try:
                await limits.admit("acme", plan, 30)
                admitted += 1
            except RateLimited as exc:
                assert exc.retry_after_s >= 1
        assert admitted == 4  # the burst, across both
        conc = Plan(name="c", requests_per_s=0, burst=1, max_concurrent=2)
        release = await one.admit("acme", conc, 30)
        await two.admit("acme", conc, 30)
        with pytest.raises(RateLimited, match="in flight"):
            await one.admit("acme", conc, 30)
        await release()
        await two.admit("acme", conc, 30)
    finally:
        await one.close()
        await two.close()


async def test_an_unreachable_redis_falls_back_to_limits_in_this_process(
        caplog: pytest.LogCaptureFixture) -> None:
    limits = RedisLimits("redis://127.0.0.1:1/0", "x:")
    try:
        plan = Plan(name="t", requests_per_s=1, burst=2, max_concurrent=0)
        await limits.admit("a", plan, 30)
        await limits.admit("a", plan, 30)
        with pytest.raises(RateLimited):
            await limits.admit("a", plan, 30)
    finally:
        await limits.close()
    assert sum("Redis unreachable" in r.message for r in caplog.records) == 1


# -- usage -------------------------------------------------------------------------------

def test_outcomes_of_statuses() -> None:
    assert [outcome_of(s) for s in (200, 404, 429, 499, 500, 503, 504)] == [
        "ok", "rejected", "rate_limited", "cancelled", "failed", "failed", "timeout"]


async def test_usage_is_buffered_by_hour_and_written_at_flush(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "u.sqlite3"))
    clock = Clock()
    clock.now = 3600 * 500 + 10
    meter = UsageMeter(store, flush_s=3600, clock=clock)
    meter.record("acme", "m", "ok", 0.25, 1.5, 10, 20)
    meter.record("acme", "m", "ok", 0.25, 0.0, 10, 20)
    clock.now += 3600
    meter.record("acme", "m", "rate_limited")
    assert store.usage("acme", 0) == []  # nothing written on the request path
    assert await meter.flush() == 2
    hour = 3600 * 500 * 1000
    assert store.usage("acme", 0) == [
        UsageRow("acme", "m", hour, "ok", 2, 0.5, 1.5, 20, 40),
        UsageRow("acme", "m", hour + 3_600_000, "rate_limited", 1, 0.0, 0.0, 0, 0)]
    assert await meter.flush() == 0
    store.close()


async def test_a_failed_flush_keeps_its_rows_for_the_next(tmp_path: Path) -> None:
    path = tmp_path / "u.sqlite3"
    store = open_store(str(path))
    meter = UsageMeter(store, flush_s=3600)
    meter.record("acme", "m", "ok", bytes_in=5)
    lock = open_store(str(path))._db  # a second connection holding the write lock
    with lock.run("hold") as db:
        db.execute("PRAGMA busy_timeout = 0")
        db.execute("BEGIN EXCLUSIVE")
        store._db._db.execute("PRAGMA busy_timeout = 0")
        assert await meter.flush() == 0
        meter.record("acme", "m", "ok", bytes_in=5)
        db.execute("COMMIT")
    await meter.close()  # the final flush writes both
    assert store.usage("acme", 0)[0].requests == 2
    assert store.usage("acme", 0)[0].bytes_in == 10


# -- identity ----------------------------------------------------------------------------

def test_the_key_comes_from_bearer_or_basic_credentials() -> None:
    import base64

    assert token_of("Bearer mfk_x") == "mfk_x"
    assert token_of("Basic " + base64.b64encode(b"mfk_x:").decode()) == "mfk_x"
    assert token_of("Basic " + base64.b64encode(b"user:mfk_y").decode()) == "mfk_y"
    for bad in (None, "", "Token abc", "Basic !!!"):
        with pytest.raises(Unauthenticated):
            token_of(bad)
    assert token_of("Bearer\tmfk_x") == "mfk_x"  # any whitespace after the scheme


@pytest.mark.parametrize("header", ["mfk_0123456789ab_SECRETSECRETSECRETSECRETSECRETSECRETSECRET",
                                    "Bearer:mfk_0123456789ab_SECRETSECRETSECRETSECRETSECRETSECRE",
                                    "Token\u00a0mfk_0123456789ab_SECRETSECRETSECRETSECRETSECRET"])
def test_a_refused_header_never_repeats_the_key(header: str) -> None:
    with pytest.raises(Unauthenticated) as info:
        token_of(header)
    assert "SECRET" not in info.value.message and "mfk_" not in info.value.message


async def test_a_revoked_key_stops_working_once_the_cache_expires(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "k.sqlite3"))
    clock = Clock()
    auth = Authenticator(store, dict(BUILTIN), ttl_s=2, clock=clock)
    record, token = store.create_key("acme", "caller", plan="pro")
    principal = await auth.principal(f"Bearer {token}")
    assert principal.tenant.name == "acme" and principal.plan.name == "pro"
    store.revoke(record.key_id)
    await auth.principal(f"Bearer {token}")  # still cached
    clock.now += 2.1
    with pytest.raises(Unauthenticated, match="revoked"):
        await auth.principal(f"Bearer {token}")
    store.close()


async def test_a_wrong_secret_for_a_known_id_is_refused(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "k.sqlite3"))
    auth = Authenticator(store, dict(BUILTIN), ttl_s=2)
    _, token = store.create_key("acme", "admin")
    forged = token[:-4] + ("aaaa" if not token.endswith("aaaa") else "bbbb")
    with pytest.raises(Unauthenticated, match="not known"):
        await auth.principal(f"Bearer {forged}")
    store.close()


async def test_a_store_gone_after_a_read_keeps_serving_what_was_read() -> None:
    import psycopg

    postgres = os.environ.get("MODELFLEET_TEST_POSTGRES",
                              "postgresql://postgres@127.0.0.1:5432/test")
    clock = Clock()
    store = open_store(postgres)
    _, token = store.create_key(f"t-{uuid.uuid4().hex[:8]}", "caller", plan="custom-unknown")
    auth = Authenticator(store, dict(BUILTIN), ttl_s=1, clock=clock)
    assert (await auth.principal(f"Bearer {token}")).plan.name == "free"  # unknown plan
    with psycopg.connect(postgres, autocommit=True) as admin:  # the server drops the store
        admin.execute("SELECT pg_terminate_backend(%s)", (store._db._db.info.backend_pid,))
    clock.now += 5
    principal = await auth.principal(f"Bearer {token}")  # what was read last
    assert principal.tenant.name.startswith("t-")
    fresh = Authenticator(store, dict(BUILTIN), ttl_s=1)  # nothing read yet: refused
    with pytest.raises(TenancyStoreUnavailable):
        await fresh.principal(f"Bearer {token}")
    store.close()



@pytest.fixture(scope="module")
def fuzz_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Authenticator]:
    store = open_store(str(tmp_path_factory.mktemp("fuzz") / "k.sqlite3"))
    store.create_key("acme", "caller")
    yield Authenticator(store, dict(BUILTIN), ttl_s=60)
    store.close()


@settings(max_examples=200, deadline=None)
@given(header=st.one_of(
    st.text(max_size=120),
    st.builds(lambda s: f"Bearer {s}", st.text(max_size=80)),
    st.builds(lambda b: "Basic " + base64.b64encode(b).decode(), st.binary(max_size=80)),
    st.builds(lambda s: f"Bearer mfk_{s}", st.text(alphabet="0123456789abcdef_-xyzXYZ",
                                                    max_size=70))))
def test_any_authorization_header_is_a_principal_or_unauthenticated(
        fuzz_auth: Authenticator, header: str) -> None:
    """Bad input gets a clear 401 (Unauthenticated), never another error."""
    async def check() -> None:
        try:
            await fuzz_auth.principal(header)
        except Unauthenticated as exc:
            assert exc.message

    asyncio.run(check())
