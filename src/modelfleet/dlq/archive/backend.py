"""What both archive backends share: the queries, run through a backend's guard.

A backend (``SqliteArchive``, ``PostgresArchive``) opens its connection and supplies
``_guard`` (serialise access, translate its driver's errors once, at this boundary);
everything else is the same SQL in two dialects (``modelfleet.dlq.archive.statements``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from modelfleet.dlq.archive import statements as sql
from modelfleet.dlq.records import DeadLetterRecord, Selection, SignatureCount

_T = TypeVar("_T")


class SqlArchive:
    _table: str
    _dialect: sql.Dialect
    _db: Any

    def _guard(self, what: str) -> AbstractContextManager[None]:
        raise NotImplementedError

    def _create_table(self, *prelude: str) -> None:
        """Create the table if needed (after ``prelude`` statements); close on failure."""
        try:
            with self._guard("create the archive table"):
                for statement in [*prelude, *sql.create_table(self._table, self._dialect)]:
                    self._db.execute(statement)
        except Exception:
            self._db.close()
            raise

    def _run(self, what: str, body: Callable[[Any], _T]) -> _T:
        with self._guard(what):
            return body(self._db)

    def get(self, request_id: str) -> DeadLetterRecord | None:
        row = self._run(f"read {request_id}", lambda db: db.execute(
            sql.get(self._table, self._dialect), (request_id,)).fetchone())
        return None if row is None else sql.from_row(row)

    def put(self, record: DeadLetterRecord) -> None:
        self._run(f"store {record.request_id}", lambda db: db.execute(
            sql.upsert(self._table, self._dialect), sql.to_row(record)))

    def select(self, selection: Selection) -> list[DeadLetterRecord]:
        query, params = sql.select(self._table, selection, self._dialect)
        rows: list[Any] = self._run("list dead letters",
                                    lambda db: db.execute(query, params).fetchall())
        return [sql.from_row(row) for row in rows]

    def signature_counts(self, selection: Selection) -> list[SignatureCount]:
        query, params = sql.signature_counts(self._table, selection, self._dialect)
        rows: list[Any] = self._run("count signatures",
                                    lambda db: db.execute(query, params).fetchall())
        return [sql.count_from_row(row) for row in rows]

    def mark_replayed(self, request_id: str, at_ms: int) -> None:
        self._run(f"mark {request_id} replayed", lambda db: db.execute(
            sql.mark_replayed(self._table, self._dialect), (at_ms, request_id)))

