"""The archive's table and statements, written once for SQLite and PostgreSQL.

The two dialects differ here only in placeholders and column types; both support
``INSERT ... ON CONFLICT (request_id) DO UPDATE``, which is the upsert we need.
"""

from __future__ import annotations

from dataclasses import astuple, fields
from typing import Any, cast

from modelfleet.database import Dialect
from modelfleet.dlq.records import DeadLetterRecord, Selection, SignatureCount

# Column type per field kind, per dialect.
_TYPES: dict[Dialect, dict[str, str]] = {
    "sqlite": {"str": "TEXT NOT NULL", "int": "INTEGER NOT NULL", "bytes": "BLOB NOT NULL",
               "int | None": "INTEGER"},
    "postgres": {"str": "TEXT NOT NULL", "int": "BIGINT NOT NULL", "bytes": "BYTEA NOT NULL",
                 "int | None": "BIGINT"},
}

# One column per DeadLetterRecord field, in field order (rows are built with astuple).
_KINDS: dict[str, str] = {
    "request_id": "str", "model_id": "str", "version": "str", "tenant": "str", "plan": "str",
    "delivery_count": "int", "death_reason": "str", "signature": "str",
    "failure_class": "str", "rule": "str", "content_type": "str", "payload_kind": "str",
    "payload_inline": "bytes", "payload_url": "str", "payload_size_bytes": "int",
    "task_bytes": "bytes", "timeout_ms": "int", "first_seen_ms": "int", "last_seen_ms": "int",
    "deaths": "int", "replay_count": "int", "replayed_at_ms": "int | None",
}
COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(DeadLetterRecord))
if tuple(_KINDS) != COLUMNS:  # a field was added to the record but not here, or the reverse
    raise RuntimeError(f"archive columns {tuple(_KINDS)} do not match the record {COLUMNS}")


def _mark(dialect: Dialect) -> str:
    return "?" if dialect == "sqlite" else "%s"


def create_table(table: str, dialect: Dialect) -> list[str]:
    types = _TYPES[dialect]
    columns = ",\n  ".join(
        f"{name} {types[_KINDS[name]]}" + (" PRIMARY KEY" if name == "request_id" else "")
        for name in COLUMNS)
    return [
        f"CREATE TABLE IF NOT EXISTS {table} (\n  {columns}\n)",
        f"CREATE INDEX IF NOT EXISTS {table}_by_class ON {table} "
        "(failure_class, model_id, first_seen_ms)",
        f"CREATE INDEX IF NOT EXISTS {table}_by_signature ON {table} (signature)",
    ]


def upsert(table: str, dialect: Dialect) -> str:
    marks = ", ".join(_mark(dialect) for _ in COLUMNS)
    updates = ", ".join(f"{name} = excluded.{name}" for name in COLUMNS if name != "request_id")
    return (f"INSERT INTO {table} ({', '.join(COLUMNS)}) VALUES ({marks}) "
            f"ON CONFLICT (request_id) DO UPDATE SET {updates}")


def get(table: str, dialect: Dialect) -> str:
    return f"SELECT {', '.join(COLUMNS)} FROM {table} WHERE request_id = {_mark(dialect)}"


def mark_replayed(table: str, dialect: Dialect) -> str:
    mark = _mark(dialect)
    return (f"UPDATE {table} SET replay_count = replay_count + 1, replayed_at_ms = {mark} "
            f"WHERE request_id = {mark}")


def _where(selection: Selection, dialect: Dialect) -> tuple[str, list[Any]]:
    mark = _mark(dialect)
    clauses: list[str] = []
    params: list[Any] = []
    if selection.failure_class is not None:
        clauses.append(f"failure_class = {mark}")
        params.append(selection.failure_class)
    if selection.model_id is not None:
        clauses.append(f"model_id = {mark}")
        params.append(selection.model_id)
    if selection.request_ids:
        clauses.append(f"request_id IN ({', '.join(mark for _ in selection.request_ids)})")
        params.extend(selection.request_ids)
    if selection.never_replayed:
        clauses.append("replay_count = 0")
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), params


def _limit(selection: Selection) -> str:
    # An int from our own Selection, never user text: safe to inline.
    return f" LIMIT {int(selection.limit)}" if selection.limit is not None else ""


def select(table: str, selection: Selection, dialect: Dialect) -> tuple[str, list[Any]]:
    where, params = _where(selection, dialect)
    return (f"SELECT {', '.join(COLUMNS)} FROM {table}{where} "
            f"ORDER BY first_seen_ms, request_id{_limit(selection)}", params)


def signature_counts(table: str, selection: Selection,
                     dialect: Dialect) -> tuple[str, list[Any]]:
    where, params = _where(selection, dialect)
    return (f"SELECT signature, failure_class, MIN(rule), model_id, COUNT(*), "
            f"MIN(first_seen_ms), MAX(last_seen_ms) FROM {table}{where} "
            "GROUP BY failure_class, signature, model_id "
            f"ORDER BY COUNT(*) DESC, MAX(last_seen_ms) DESC{_limit(selection)}", params)


def to_row(record: DeadLetterRecord) -> tuple[Any, ...]:
    return astuple(record)


def from_row(row: tuple[Any, ...] | Any) -> DeadLetterRecord:
    values = dict(zip(COLUMNS, row, strict=True))
    for name, kind in _KINDS.items():
        if kind == "bytes":
            values[name] = bytes(values[name])  # memoryview from PostgreSQL
    return DeadLetterRecord(**values)


def count_from_row(row: tuple[Any, ...] | Any) -> SignatureCount:
    signature, failure_class, rule, model_id, count, first, last = row
    return SignatureCount(str(signature), cast(Any, failure_class), str(rule), str(model_id),
                          int(count), int(first), int(last))
