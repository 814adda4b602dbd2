"""Tenants, grants, API keys and usage rows, in the dead-letter archive's database.

One location names the database for both (``tenancy.db``, else ``$MODELFLEET_DLQ_DB``,
else ``~/.cache/modelfleet/dlq.sqlite3``): a file path or ``sqlite:///path`` is SQLite,
``postgresql://...`` is PostgreSQL (``psycopg`` 3). Tables of their own, next to the
archive's. Keys are stored as a salted digest (``modelfleet.tenancy.keys``), never as
given. Methods are synchronous and thread-safe; async callers run them in a thread.
Driver errors are translated here, once, into ``TenancyStoreError`` and
``TenancyStoreUnavailable``.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelfleet.dlq.archive import default_location
from modelfleet.errors import ConfigError, ModelfleetError
from modelfleet.redaction import redact_url
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


def store_location(configured: str = "") -> str:
    """``tenancy.db`` if set, else the dead-letter archive's location."""
    return configured or default_location()


def open_store(location: str) -> TenantStore:
    """The store at ``location`` (a file, ``sqlite:///path`` or ``postgresql://``), its
    tables created if missing. ConfigError for an unknown URL; TenancyStoreUnavailable
    when it cannot be opened."""
    return TenantStore(open_database(location))


def open_database(location: str, label: str = "the tenants' store",
                  error: type[ModelfleetError] = TenancyStoreError,
                  unavailable: type[ModelfleetError] = TenancyStoreUnavailable) -> _Database:
    """One connection to the deployment's database at ``location`` (a file,
    ``sqlite:///path`` or ``postgresql://``), its driver's errors translated into
    ``error`` and ``unavailable`` (messages name ``label``). ConfigError for an unknown
    URL; ``unavailable`` when it cannot be opened. Other stores that keep their tables in
    this database (``control.orders``) open it here too."""
    names = _Names(label, error, unavailable)
    if location.startswith(("postgresql://", "postgres://")):
        return _Postgres(location, names)
    if location.startswith("sqlite://"):
        location = location.removeprefix("sqlite://")
        if not location.startswith("/"):
            raise ConfigError("an sqlite:// store URL needs an absolute path "
                              "(sqlite:///var/lib/modelfleet.sqlite3); or pass a file path")
    elif "://" in location:
        raise ConfigError(f"store {location.split('://')[0]}:// is not supported: pass a "
                          "file path (SQLite) or a postgresql:// URL")
    return _Sqlite(Path(location).expanduser(), names)


@dataclass(frozen=True)
class _Names:
    """What a database's errors are called, and how its messages name it."""

    label: str
    error: type[ModelfleetError]
    unavailable: type[ModelfleetError]


class _Database:
    """One connection, used under a lock; the driver's errors translated once."""

    mark = "?"
    blob = "BLOB"
    where = ""
    _db: Any
    _lock: threading.Lock

    def _translate(self, exc: Exception, what: str) -> Exception | None:
        raise NotImplementedError

    @contextmanager
    def run(self, what: str) -> Iterator[Any]:
        with self._lock:
            try:
                yield self._db
            except Exception as exc:
                ours = self._translate(exc, f"{what} in {self.where}")
                if ours is None:
                    raise
                raise ours from exc

    def close(self) -> None:
        with self._lock:
            self._db.close()


class _Sqlite(_Database):
    def __init__(self, path: Path, names: _Names) -> None:
        self.where = str(path)
        self._names = names
        self._lock = threading.Lock()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, timeout=10, check_same_thread=False,
                                       isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
        except (OSError, sqlite3.Error) as exc:
            raise names.unavailable(f"cannot open {names.label} {path}: {exc}; check the "
                                    "path (tenancy.db, $MODELFLEET_DLQ_DB) and its "
                                    "permissions") from exc

    def _translate(self, exc: Exception, what: str) -> Exception | None:
        if isinstance(exc, sqlite3.OperationalError):
            return self._names.unavailable(f"{what}: {exc}")
        if isinstance(exc, sqlite3.Error):
            return self._names.error(f"{what}: {exc}")
        return None


class _Postgres(_Database):
    mark = "%s"
    blob = "BYTEA"

    def __init__(self, url: str, names: _Names) -> None:
        from modelfleet.dlq.archive.postgres import _psycopg

        self._names = names
        self._psycopg = _psycopg()
        self.where = redact_url(url)
        self._lock = threading.Lock()
        try:
            self._db = self._psycopg.connect(url, autocommit=True, connect_timeout=10)
        except self._psycopg.Error as exc:
            raise names.unavailable(
                f"cannot connect to {names.label} {self.where}: {exc}".strip()) from exc

    def _translate(self, exc: Exception, what: str) -> Exception | None:
        if isinstance(exc, self._psycopg.OperationalError):
            return self._names.unavailable(f"{what}: {exc}".strip())
        if isinstance(exc, self._psycopg.Error):
            return self._names.error(f"{what}: {exc}".strip())
        return None


def _now_ms() -> int:
    return int(time.time() * 1000)


class TenantStore:
    def __init__(self, database: _Database) -> None:
        self._db = database
        self._q = database.mark
        try:
            with database.run("create the tenants' tables") as db:
                for statement in _SCHEMA.format(blob=database.blob).split(";"):
                    db.execute(statement)
        except Exception:
            database.close()
            raise

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
