"""Tenants, grants, API keys and usage rows, in the deployment's database.

The database is ``modelfleet.database``'s (``tenancy.db``, else its default location: a
file path or ``sqlite:///path`` is SQLite, ``postgresql://...`` is PostgreSQL); tables of
their own, next to the dead-letter archive's and the control orders'. Keys are stored as a
salted digest (``modelfleet.tenancy.keys``), never as given. Methods are synchronous and
thread-safe; async callers run them in a thread. Driver errors reach callers as
``TenancyStoreError`` and ``TenancyStoreUnavailable`` (translated in ``Database.run``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelfleet.database import Database, Names, default_location, open_database
from modelfleet.errors import ConfigError
from modelfleet.tenancy import TenancyStoreError, TenancyStoreUnavailable, keys
from modelfleet.tenancy.keys import Role

_SCHEMA = """
CREATE TABLE IF NOT EXISTS modelfleet_tenants (
  name TEXT PRIMARY KEY, plan TEXT NOT NULL, created_ms BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS modelfleet_grants (
  tenant TEXT NOT NULL, model TEXT NOT NULL, PRIMARY KEY (tenant, model));
CREATE TABLE IF NOT EXISTS modelfleet_api_keys (
  key_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, role TEXT NOT NULL, salt {blob} NOT NULL,
  digest {blob} NOT NULL, label TEXT NOT NULL, created_ms BIGINT NOT NULL,
  revoked_ms BIGINT);
CREATE TABLE IF NOT EXISTS modelfleet_usage (
  tenant TEXT NOT NULL, model TEXT NOT NULL, hour_ms BIGINT NOT NULL, outcome TEXT NOT NULL,
  requests BIGINT NOT NULL, predict_s DOUBLE PRECISION NOT NULL,
  load_s DOUBLE PRECISION NOT NULL, bytes_in BIGINT NOT NULL, bytes_out BIGINT NOT NULL,
  PRIMARY KEY (tenant, hour_ms, model, outcome))
"""
_USAGE_COLUMNS = ("tenant", "model", "hour_ms", "outcome", "requests", "predict_s", "load_s",
                  "bytes_in", "bytes_out")
_KEY_COLUMNS = "key_id, tenant, role, salt, digest, label, created_ms, revoked_ms"


@dataclass(frozen=True)
class Tenant:
    name: str
    plan: str
    grants: frozenset[str] = frozenset()  # other tenants' models it may use


@dataclass(frozen=True)
class KeyRecord:
    key_id: str
    tenant: str
    role: Role
    salt: bytes
    digest: bytes
    label: str
    created_ms: int
    revoked_ms: int | None

    @property
    def revoked(self) -> bool:
        return self.revoked_ms is not None


@dataclass(frozen=True)
class UsageRow:
    """What one tenant used of one model in one hour, for one outcome."""

    tenant: str
    model: str
    hour_ms: int  # the hour's start, epoch ms (UTC)
    outcome: str
    requests: int
    predict_s: float
    load_s: float
    bytes_in: int
    bytes_out: int


NAMES = Names("the tenants' store", TenancyStoreError, TenancyStoreUnavailable,
              "tenancy.db, $MODELFLEET_DLQ_DB, state_dir")


def store_location(configured: str = "", state_dir: Path | None = None) -> str:
    """``tenancy.db`` if set, else the deployment database's default location."""
    return configured or default_location(state_dir)


def open_store(location: str) -> TenantStore:
    """The store at ``location`` (a file, ``sqlite:///path`` or ``postgresql://``), its
    tables created if missing. ConfigError for an unknown URL; TenancyStoreUnavailable
    when it cannot be opened."""
    return TenantStore(open_database(location, NAMES))


def _now_ms() -> int:
    return int(time.time() * 1000)


class TenantStore:
    def __init__(self, database: Database) -> None:
        self._db = database
        self._q = database.mark
        database.create(_SCHEMA.format(blob=database.blob).split(";"),
                        "create the tenants' tables")

    @property
    def location(self) -> str:
        return self._db.where

    def close(self) -> None:
        self._db.close()

    def _all(self, what: str, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        with self._db.run(what) as db:
            return list(db.execute(sql.replace("?", self._q), tuple(params)).fetchall())

    def _do(self, what: str, sql: str, params: Sequence[Any] = ()) -> int:
        with self._db.run(what) as db:
            return int(db.execute(sql.replace("?", self._q), tuple(params)).rowcount)

    # -- tenants ---------------------------------------------------------------------------

    def set_tenant(self, name: str, plan: str | None = None) -> Tenant:
        """Create ``name`` (plan ``free`` unless given), or change its plan."""
        self._do(f"create tenant {name}",
                 "INSERT INTO modelfleet_tenants (name, plan, created_ms) VALUES (?, ?, ?) "
                 "ON CONFLICT (name) DO NOTHING", (name, plan or "free", _now_ms()))
        if plan is not None:
            self._do(f"set the plan of {name}",
                     "UPDATE modelfleet_tenants SET plan = ? WHERE name = ?", (plan, name))
        tenant = self.tenant(name)
        assert tenant is not None
        return tenant

    def tenant(self, name: str) -> Tenant | None:
        rows = self._all(f"read tenant {name}",
                         "SELECT plan FROM modelfleet_tenants WHERE name = ?", (name,))
        if not rows:
            return None
        grants = self._all(f"read the grants of {name}",
                           "SELECT model FROM modelfleet_grants WHERE tenant = ?", (name,))
        return Tenant(name, rows[0][0], frozenset(row[0] for row in grants))

    def tenants(self) -> list[Tenant]:
        names = self._all("list tenants", "SELECT name FROM modelfleet_tenants ORDER BY name")
        return [t for (name,) in names if (t := self.tenant(name)) is not None]

    def grant(self, tenant: str, model: str) -> None:
        """Let ``tenant`` use ``model`` (another tenant's)."""
        self.set_tenant(tenant)
        self._do(f"grant {model} to {tenant}",
                 "INSERT INTO modelfleet_grants (tenant, model) VALUES (?, ?) "
                 "ON CONFLICT (tenant, model) DO NOTHING", (tenant, model))

    def ungrant(self, tenant: str, model: str) -> bool:
        return self._do(f"withdraw {model} from {tenant}",
                        "DELETE FROM modelfleet_grants WHERE tenant = ? AND model = ?",
                        (tenant, model)) > 0

    # -- keys ------------------------------------------------------------------------------

    def create_key(self, tenant: str, role: Role, label: str = "",
                   plan: str | None = None) -> tuple[KeyRecord, str]:
        """A new key for ``tenant`` (created if missing): its record and the plain key,
        which is not kept anywhere and cannot be shown again."""
        if role not in keys.ROLES:
            raise ConfigError(f"role {role!r} is not one of {', '.join(keys.ROLES)}")
        self.set_tenant(tenant, plan)
        new = keys.generate()
        record = KeyRecord(new.key_id, tenant, role, new.salt, new.digest, label, _now_ms(),
                           None)
        self._do(f"store a key of {tenant}",
                 f"INSERT INTO modelfleet_api_keys ({_KEY_COLUMNS}) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                 (record.key_id, tenant, role, record.salt, record.digest, label,
                  record.created_ms, None))
        return record, new.token

    def key(self, key_id: str) -> KeyRecord | None:
        rows = self._all("read a key", f"SELECT {_KEY_COLUMNS} FROM modelfleet_api_keys "
                                       "WHERE key_id = ?", (key_id,))
        return _key(rows[0]) if rows else None

    def keys(self, tenant: str | None = None) -> list[KeyRecord]:
        sql = f"SELECT {_KEY_COLUMNS} FROM modelfleet_api_keys"
        params: tuple[str, ...] = ()
        if tenant is not None:
            sql, params = sql + " WHERE tenant = ?", (tenant,)
        return [_key(row) for row in self._all("list keys", sql + " ORDER BY created_ms",
                                               params)]

    def revoke(self, key_id: str) -> bool:
        """Revoke the key (True), or say it was not there or revoked already (False)."""
        return self._do("revoke a key", "UPDATE modelfleet_api_keys SET revoked_ms = ? "
                                        "WHERE key_id = ? AND revoked_ms IS NULL",
                        (_now_ms(), key_id)) > 0

    # -- usage -----------------------------------------------------------------------------

    def add_usage(self, rows: Iterable[UsageRow]) -> None:
        """Add ``rows`` to what is recorded (counts of one key are summed)."""
        columns = ", ".join(_USAGE_COLUMNS)
        sums = ", ".join(f"{c} = modelfleet_usage.{c} + excluded.{c}"
                         for c in _USAGE_COLUMNS[4:])
        sql = (f"INSERT INTO modelfleet_usage ({columns}) VALUES "
               f"({', '.join(self._q for _ in _USAGE_COLUMNS)}) "
               f"ON CONFLICT (tenant, hour_ms, model, outcome) DO UPDATE SET {sums}")
        batch = [(r.tenant, r.model, r.hour_ms, r.outcome, r.requests, r.predict_s, r.load_s,
                  r.bytes_in, r.bytes_out) for r in rows]
        if batch:
            with self._db.run("record usage") as db:
                db.cursor().executemany(sql, batch)

    def usage(self, tenant: str | None, since_ms: int, until_ms: int | None = None,
              model: str | None = None) -> list[UsageRow]:
        """Usage rows whose hour starts in [the hour of ``since_ms``, ``until_ms``),
        oldest first."""
        since_hour = since_ms - since_ms % 3_600_000
        clauses, params = ["hour_ms >= ?"], [since_hour]
        if until_ms is not None:
            clauses.append("hour_ms < ?")
            params.append(until_ms)
        for column, value in (("tenant", tenant), ("model", model)):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)  # type: ignore[arg-type]
        rows = self._all("read usage", f"SELECT {', '.join(_USAGE_COLUMNS)} FROM "
                         f"modelfleet_usage WHERE {' AND '.join(clauses)} "
                         "ORDER BY hour_ms, tenant, model, outcome", params)
        return [UsageRow(*row) for row in rows]


def _key(row: Sequence[Any]) -> KeyRecord:
    key_id, tenant, role, salt, digest, label, created_ms, revoked_ms = row
    return KeyRecord(key_id, tenant, role, bytes(salt), bytes(digest), label, created_ms,
                     revoked_ms)
