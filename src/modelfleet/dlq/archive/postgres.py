"""The dead-letter archive in PostgreSQL (``psycopg`` 3), for archivers on several machines.

``psycopg`` is optional: importing this module without it is fine, opening an
archive raises ConfigError saying what to install. One connection per archive,
in autocommit mode (every statement is its own transaction), used under a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from modelfleet.dlq.archive import (
    DEFAULT_TABLE,
    ArchiveError,
    ArchiveUnavailable,
    check_table_name,
)
from modelfleet.dlq.archive.backend import SqlArchive
from modelfleet.errors import ConfigError
from modelfleet.redaction import redact_url

CONNECT_TIMEOUT_S = 10


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError as exc:
        raise ConfigError("a postgresql:// dead-letter archive needs psycopg 3: "
                          "pip install 'psycopg[binary]>=3.1'") from exc
    return psycopg


class PostgresArchive(SqlArchive):
    _dialect = "postgres"

    def __init__(self, url: str, table: str = DEFAULT_TABLE) -> None:
        self._psycopg = _psycopg()
        self._where = redact_url(url)
        self._table = check_table_name(table)
        self._lock = threading.Lock()
        try:
            self._db: Any = self._psycopg.connect(url, autocommit=True,
                                                  connect_timeout=CONNECT_TIMEOUT_S)
        except self._psycopg.Error as exc:
            raise ArchiveUnavailable(f"cannot connect to the dead-letter archive {self._where}: "
                                     f"{exc}".strip()) from exc
        self._create_table()

    @property
    def location(self) -> str:
        return f"{self._where} (table {self._table})"

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Serialise access, and turn psycopg's errors into ours (the boundary)."""
        with self._lock:
            try:
                yield
            except self._psycopg.OperationalError as exc:
                # Server gone, connection lost, out of resources: retrying later may work.
                raise ArchiveUnavailable(f"{what} in {self._where}: {exc}".strip()) from exc
            except self._psycopg.Error as exc:
                raise ArchiveError(f"{what} in {self._where}: {exc}".strip()) from exc

    def drop(self) -> None:
        """Drop the table (tests, and tearing a deployment down)."""
        self._run(f"drop {self._table}", lambda db: db.execute(
            f"DROP TABLE IF EXISTS {self._table}"))

    def close(self) -> None:
        with self._lock:
            self._db.close()
