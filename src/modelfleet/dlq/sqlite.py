"""The dead-letter archive in one SQLite file (stdlib ``sqlite3``): the default.

WAL mode and a busy timeout let ``modelfleet dlq archive`` keep writing while
``list`` and ``replay`` run in other processes. One connection per archive, used
from any thread under a lock.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from modelfleet.dlq import sql
from modelfleet.dlq.archive import (
    DEFAULT_TABLE,
    ArchiveError,
    ArchiveUnavailable,
    check_table_name,
)
from modelfleet.dlq.records import DeadLetterRecord, Selection, SignatureCount

_T = TypeVar("_T")
BUSY_TIMEOUT_S = 10.0


class SqliteArchive:
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
        try:
            with self._guard("create the archive table"):
                self._db.execute("PRAGMA journal_mode=WAL")
                for statement in sql.create_table(self._table, "sqlite"):
                    self._db.execute(statement)
        except ArchiveError:
            self._db.close()
            raise

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

    def _run(self, what: str, body: Callable[[sqlite3.Connection], _T]) -> _T:
        with self._guard(what):
            return body(self._db)

    def get(self, request_id: str) -> DeadLetterRecord | None:
        row = self._run(f"read {request_id}", lambda db: db.execute(
            sql.get(self._table, "sqlite"), (request_id,)).fetchone())
        return None if row is None else sql.from_row(row)

    def put(self, record: DeadLetterRecord) -> None:
        self._run(f"store {record.request_id}", lambda db: db.execute(
            sql.upsert(self._table, "sqlite"), sql.to_row(record)))

    def select(self, selection: Selection) -> list[DeadLetterRecord]:
        query, params = sql.select(self._table, selection, "sqlite")
        rows = self._run("list dead letters", lambda db: db.execute(query, params).fetchall())
        return [sql.from_row(row) for row in rows]

    def signature_counts(self, selection: Selection) -> list[SignatureCount]:
        query, params = sql.signature_counts(self._table, selection, "sqlite")
        rows = self._run("count signatures", lambda db: db.execute(query, params).fetchall())
        return [sql.count_from_row(row) for row in rows]

    def mark_replayed(self, request_id: str, at_ms: int) -> None:
        self._run(f"mark {request_id} replayed", lambda db: db.execute(
            sql.mark_replayed(self._table, "sqlite"), (at_ms, request_id)))

    def close(self) -> None:
        with self._lock:
            self._db.close()
