"""The dead-letter archive in one SQLite file (stdlib ``sqlite3``): the default.

WAL mode and a busy timeout let ``modelfleet dlq archive`` keep writing while
``list`` and ``replay`` run in other processes. One connection per archive, used
from any thread under a lock.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from modelfleet.dlq.archive import (
    DEFAULT_TABLE,
    ArchiveError,
    ArchiveUnavailable,
    check_table_name,
)
from modelfleet.dlq.archive.backend import SqlArchive

BUSY_TIMEOUT_S = 10.0


class SqliteArchive(SqlArchive):
    _dialect = "sqlite"

    def __init__(self, path: Path, table: str = DEFAULT_TABLE) -> None:
        self._path = path
        self._table = check_table_name(table)
        self._lock = threading.Lock()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: autocommit, every statement is its own transaction.
            self._db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, check_same_thread=False,
                                       isolation_level=None)
        except (OSError, sqlite3.Error) as exc:
            raise ArchiveUnavailable(f"cannot open the dead-letter archive {path}: {exc}; "
                                     "check the path (--db, $MODELFLEET_DLQ_DB) and its "
                                     "permissions") from exc
        self._create_table("PRAGMA journal_mode=WAL")

    @property
    def location(self) -> str:
        return str(self._path)

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Serialise access, and turn sqlite3's errors into ours (the boundary)."""
        with self._lock:
            try:
                yield
            except sqlite3.OperationalError as exc:
                # Locked past the busy timeout, disk full, file gone or unreadable.
                raise ArchiveUnavailable(f"{what} in {self._path}: {exc}") from exc
            except sqlite3.Error as exc:
                raise ArchiveError(f"{what} in {self._path}: {exc} (is this file a "
                                   "modelfleet dead-letter archive?)") from exc

    def close(self) -> None:
        with self._lock:
            self._db.close()
