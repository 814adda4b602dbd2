"""The dead-letter archive over the deployment's database (``modelfleet.database``).

The connection, its lock and the translation of driver errors are the database's
(``Database.run``); here is only the archive's SQL, the same in both dialects but for
placeholders and column types (``modelfleet.dlq.archive.statements``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from modelfleet.database import Database, Dialect
from modelfleet.dlq.archive import statements as sql
from modelfleet.dlq.records import DeadLetterRecord, Selection, SignatureCount

_T = TypeVar("_T")


class SqlArchive:
    def __init__(self, database: Database, table: str) -> None:
        self._database = database
        self._table = table  # checked by open_archive: a plain identifier
        self._dialect: Dialect = database.dialect
        database.create(sql.create_table(table, self._dialect), "create the archive table")

    @property
    def location(self) -> str:
        where = self._database.where
        return where if self._dialect == "sqlite" else f"{where} (table {self._table})"

    def close(self) -> None:
        self._database.close()

    def drop(self) -> None:
        """Drop the table (tests, and tearing a deployment down)."""
        self._run(f"drop {self._table}", lambda db: db.execute(
            f"DROP TABLE IF EXISTS {self._table}"))

    def _run(self, what: str, body: Callable[[Any], _T]) -> _T:
        with self._database.run(what) as db:
            return body(db)

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

