"""The deployment's database: one connection layer for every store that keeps tables in it.

The dead-letter archive (``dlq.archive``), the tenants' store (``tenancy.store``) and the
control orders (``control.orders``) keep their tables in one database, named by one
location: a file path or ``sqlite:///path`` is SQLite (stdlib ``sqlite3``, WAL mode, the
default), ``postgresql://...`` is PostgreSQL (``psycopg`` 3, optional, for stores shared by
several machines). Each store opens its own ``Database`` here, naming its errors; the
drivers' exceptions are translated once, in ``Database.run``, and never leave this module.

Why a small layer of our own rather than SQLAlchemy Core: the stores need one connection
each, autocommit statements, two placeholder styles and two column-type spellings; that is
sixty lines here, where SQLAlchemy would add a dependency of 3 MB and a second way of
writing every statement we already test against both servers.

The default location belongs to the deployment, not to any one store:
``$MODELFLEET_DLQ_DB`` (its name is older than the other stores), else ``dlq.sqlite3`` in
the state directory (``state_dir``, ``$MODELFLEET_STATE_DIR``, ``~/.cache/modelfleet``).
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from modelfleet.errors import ConfigError, ModelfleetError
from modelfleet.redaction import redact_url

DB_ENV = "MODELFLEET_DLQ_DB"
STATE_DIR_ENV = "MODELFLEET_STATE_DIR"
DEFAULT_FILE = "dlq.sqlite3"
BUSY_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10
Dialect = Literal["sqlite", "postgres"]


def default_location(state_dir: Path | None = None) -> str:
    """``$MODELFLEET_DLQ_DB``, else ``dlq.sqlite3`` in ``state_dir`` (given, else
    ``$MODELFLEET_STATE_DIR``, else ``~/.cache/modelfleet``)."""
    configured = os.environ.get(DB_ENV)
    if configured:
        return configured
    if state_dir is None:
        state_dir = Path(os.environ.get(STATE_DIR_ENV) or Path.home() / ".cache" / "modelfleet")
    return str(Path(state_dir).expanduser() / DEFAULT_FILE)


@dataclass(frozen=True)
class Names:
    """What a store's database errors are called, and how its messages name it."""

    label: str  # "the dead-letter archive", "the tenants' store", ...
    error: type[ModelfleetError]  # a query failed
    unavailable: type[ModelfleetError]  # it cannot be opened or reached
    set_by: str = f"${DB_ENV}, state_dir"  # how a user names its location, for messages


def open_database(location: str, names: Names) -> Database:
    """One connection to the database at ``location``, its driver's errors raised as
    ``names.error`` / ``names.unavailable``. ConfigError for a URL we do not know;
    ``names.unavailable`` when it cannot be opened."""
    if location.startswith(("postgresql://", "postgres://")):
        return _Postgres(location, names)
    if location.startswith("sqlite://"):
        location = location.removeprefix("sqlite://")
        if not location.startswith("/"):
            raise ConfigError(f"an sqlite:// URL for {names.label} needs an absolute path "
                              "(sqlite:///var/lib/modelfleet.sqlite3); or pass a file path")
    elif "://" in location:
        raise ConfigError(f"{names.label}: {location.split('://')[0]}:// is not supported: "
                          "pass a file path (SQLite) or a postgresql:// URL")
    return _Sqlite(Path(location).expanduser(), names)


def psycopg() -> Any:
    """The psycopg 3 module, or ConfigError saying what to install."""
    try:
        import psycopg
    except ImportError as exc:
        raise ConfigError("a postgresql:// database needs psycopg 3: "
                          "pip install 'psycopg[binary]>=3.1'") from exc
    return psycopg


class Database:
    """One connection, used from any thread under a lock; the driver's errors translated
    once, in ``run``. ``mark`` is the placeholder, ``blob`` the bytes column type."""

    dialect: Dialect
    mark: str
    blob: str
    where: str  # where it is, fit for messages (no password)
    _names: Names
    _db: Any
    _lock: threading.Lock

    def _translate(self, exc: Exception, what: str) -> Exception | None:
        raise NotImplementedError

    @contextmanager
    def run(self, what: str) -> Iterator[Any]:
        """The connection, for one operation described by ``what`` (for messages)."""
        with self._lock:
            try:
                yield self._db
            except Exception as exc:
                ours = self._translate(exc, f"{what} in {self.where}")
                if ours is None:
                    raise
                raise ours from exc

    def create(self, statements: list[str], what: str) -> None:
        """Run schema statements (``CREATE ... IF NOT EXISTS``); close on failure."""
        try:
            with self.run(what) as db:
                for statement in statements:
                    db.execute(statement)
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        with self._lock:
            self._db.close()


class _Sqlite(Database):
    dialect: Dialect = "sqlite"
    mark = "?"
    blob = "BLOB"

    def __init__(self, path: Path, names: Names) -> None:
        self.where = str(path)
        self._names = names
        self._lock = threading.Lock()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: autocommit, every statement is its own transaction.
            self._db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, check_same_thread=False,
                                       isolation_level=None)
            # WAL and a busy timeout: one process writes while others read.
            self._db.execute("PRAGMA journal_mode=WAL")
        except (OSError, sqlite3.Error) as exc:
            raise names.unavailable(f"cannot open {names.label} {path}: {exc}; check the "
                                    f"path ({names.set_by}) and its permissions") from exc

    def _translate(self, exc: Exception, what: str) -> Exception | None:
        if isinstance(exc, sqlite3.OperationalError):
            # Locked past the busy timeout, disk full, file gone or unreadable.
            return self._names.unavailable(f"{what}: {exc}")
        if isinstance(exc, sqlite3.Error):
            return self._names.error(f"{what}: {exc} (is this file a modelfleet database?)")
        return None


class _Postgres(Database):
    dialect: Dialect = "postgres"
    mark = "%s"
    blob = "BYTEA"

    def __init__(self, url: str, names: Names) -> None:
        self._names = names
        self._psycopg = psycopg()
        self.where = redact_url(url)
        self._lock = threading.Lock()
        try:
            self._db = self._psycopg.connect(url, autocommit=True,
                                             connect_timeout=CONNECT_TIMEOUT_S)
        except self._psycopg.Error as exc:
            raise names.unavailable(
                f"cannot connect to {names.label} {self.where}: {exc}".strip()) from exc

    def _translate(self, exc: Exception, what: str) -> Exception | None:
        if isinstance(exc, self._psycopg.OperationalError):
            # Server gone, connection lost, out of resources: retrying later may work.
            return self._names.unavailable(f"{what}: {exc}".strip())
        if isinstance(exc, self._psycopg.Error):
            return self._names.error(f"{what}: {exc}".strip())
        return None
