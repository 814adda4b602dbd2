"""Keys, plans and the tenants' store (SQLite, and PostgreSQL at $MODELFLEET_TEST_POSTGRES)."""

from __future__ import annotations

import os
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelfleet.errors import ConfigError
from modelfleet.tenancy import TenancyStoreError, TenancyStoreUnavailable, Unauthenticated, keys
from modelfleet.tenancy.plans import BUILTIN, load_plans
from modelfleet.tenancy.store import TenantStore, UsageRow, open_store

POSTGRES_URL = os.environ.get("MODELFLEET_TEST_POSTGRES",
                              "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TenantStore]:
    opened = open_store(str(tmp_path / "t.sqlite3") if request.param == "sqlite"
                        else POSTGRES_URL)
    yield opened
    opened.close()


def tenant_name() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"  # PostgreSQL's tables are shared by test runs


# -- keys --------------------------------------------------------------------------------

def test_a_key_parses_back_to_its_id_and_matches_only_its_own_digest() -> None:
    new = keys.generate()
    key_id, secret = keys.parse(new.token)
    assert key_id == new.key_id and new.token.startswith("mfk_")
    assert keys.matches(new.salt, new.digest, secret)
    assert not keys.matches(new.salt, new.digest, secret[:-1] + ("A" if secret[-1] != "A"
                                                                 else "B"))
    other = keys.generate()
    assert other.salt != new.salt and other.digest != new.digest
    assert keys.PATTERN.search(f"said {new.token} there")


def test_a_key_in_a_log_line_keeps_its_id_and_loses_its_secret() -> None:
    from modelfleet.redaction import redact

    new = keys.generate()
    clean = redact(f"caller sent {new.token}; url http://{new.token}:@127.0.0.1:8000/v1")
    secret = new.token.split("_", 2)[2]  # the secret itself may hold "_"
    assert secret not in clean and new.token[-20:] not in clean
    assert f"mfk_{new.key_id}_***" in clean


@pytest.mark.parametrize("token", ["", "mfk_", "sk-live-123", "mfk_0123456789ab_short",
                                   "mfk_0123456789AB_" + "a" * 43])
def test_a_malformed_key_is_unauthenticated(token: str) -> None:
    with pytest.raises(Unauthenticated, match="malformed"):
        keys.parse(token)


# -- plans -------------------------------------------------------------------------------

def test_a_plans_file_adds_plans_and_replaces_built_in_ones(tmp_path: Path) -> None:
    path = tmp_path / "plans.toml"
    path.write_text("[plans.team]\nrequests_per_s = 20\nburst = 40\nmax_concurrent = 8\n"
                    "priority = 1\nfanout_multiplier = 1.5\n[plans.free]\nrequests_per_s = 1\n")
    plans = load_plans(path)
    assert plans["team"].requests_per_s == 20 and plans["team"].priority == 1
    assert plans["free"].requests_per_s == 1 and plans["pro"] == BUILTIN["pro"]


@pytest.mark.parametrize(("text", "problem"), [
    ("[plans.x]\nrequests_per_s = -1\n", "plans.x: field 'requests_per_s'"),
    ("[plans.x]\nspeed = 3\n", "plans.x: field 'speed'"),
    ("[other]\na = 1\n", "only \\[plans.<name>\\] tables"),
    ("[plans\n", "not valid TOML"),
])
def test_a_bad_plans_file_is_a_config_error_naming_the_problem(tmp_path: Path, text: str,
                                                               problem: str) -> None:
    path = tmp_path / "plans.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=problem):
        load_plans(path)


def test_a_missing_plans_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the plans file"):
        load_plans(tmp_path / "nope.toml")


# -- store -------------------------------------------------------------------------------

def test_a_key_is_stored_as_a_digest_never_as_given(tmp_path: Path) -> None:
    path = tmp_path / "t.sqlite3"
    store = open_store(str(path))
    _, token = store.create_key("acme", "caller")
    store.close()
    raw = path.read_bytes() + (path.with_name(path.name + "-wal").read_bytes()
                               if path.with_name(path.name + "-wal").exists() else b"")
    _, secret = keys.parse(token)
    assert secret.encode() not in raw and token.encode() not in raw


def test_keys_tenants_and_grants_round_trip(store: TenantStore) -> None:
    name = tenant_name()
    record, _ = store.create_key(name, "operator", "ci", plan="pro")
    assert store.key(record.key_id) == record
    assert record.role == "operator" and not record.revoked
    tenant = store.tenant(name)
    assert tenant is not None and tenant.plan == "pro" and tenant.grants == frozenset()
    store.grant(name, "other-model")
    assert store.tenant(name).grants == {"other-model"}  # type: ignore[union-attr]
    assert store.ungrant(name, "other-model") and not store.ungrant(name, "other-model")
    assert [k.key_id for k in store.keys(name)] == [record.key_id]
    # A second key does not change the plan unless asked to.
    store.create_key(name, "caller")
    assert store.tenant(name).plan == "pro"  # type: ignore[union-attr]
    assert store.set_tenant(name, "enterprise").plan == "enterprise"


def test_revoking_marks_the_key_once(store: TenantStore) -> None:
    record, _ = store.create_key(tenant_name(), "caller")
    assert store.revoke(record.key_id)
    assert not store.revoke(record.key_id)
    again = store.key(record.key_id)
    assert again is not None and again.revoked


def test_an_unknown_role_is_refused(store: TenantStore) -> None:
    with pytest.raises(ConfigError, match="role 'root'"):
        store.create_key(tenant_name(), "root")  # type: ignore[arg-type]


def test_usage_rows_of_one_key_are_summed_and_selected_by_hour(store: TenantStore) -> None:
    name, hour = tenant_name(), 3_600_000 * 400_000
    row = UsageRow(name, "m", hour, "ok", 2, 0.5, 1.0, 100, 200)
    store.add_usage([row, row, UsageRow(name, "m", hour + 3_600_000, "rate_limited", 1, 0, 0,
                                        0, 0)])
    rows = store.usage(name, since_ms=hour + 5)  # rounded down to its hour
    assert rows[0] == UsageRow(name, "m", hour, "ok", 4, 1.0, 2.0, 200, 400)
    assert [r.outcome for r in rows] == ["ok", "rate_limited"]
    assert store.usage(name, since_ms=hour, until_ms=hour + 1) == rows[:1]
    assert store.usage(name, since_ms=hour + 3_600_000) == rows[1:]
    assert store.usage(tenant_name(), since_ms=0) == []


def test_an_unreachable_store_is_unavailable_without_the_password() -> None:
    with pytest.raises(TenancyStoreUnavailable) as caught:
        open_store("postgresql://mf:s3cret@127.0.0.1:1/test")
    assert "s3cret" not in str(caught.value)


def test_a_file_that_is_not_a_database_is_a_store_error(tmp_path: Path) -> None:
    path = tmp_path / "junk.sqlite3"
    path.write_bytes(b"not a database" * 100)
    with pytest.raises(TenancyStoreError):
        open_store(str(path))


def test_unknown_store_urls_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="mysql:// is not supported"):
        open_store("mysql://x/y")
    with pytest.raises(ConfigError, match="absolute path"):
        open_store("sqlite://relative.db")


def test_the_store_shares_the_dead_letter_archives_file(tmp_path: Path) -> None:
    from modelfleet.dlq.archive import open_archive

    path = str(tmp_path / "shared.sqlite3")
    archive = open_archive(path)
    store = open_store(path)
    store.create_key("acme", "caller")
    archive.close()
    store.close()
    with sqlite3.connect(path) as db:
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master "
                                               "WHERE type = 'table'")}
    assert {"modelfleet_dead_letters", "modelfleet_api_keys", "modelfleet_usage"} <= tables
