"""The ``Archive`` protocol: where dead letters are kept, and which one a URL names.

Two implementations: ``sqlite.SqliteArchive`` (stdlib ``sqlite3``, the default, one
file) and ``postgres.PostgresArchive`` (``psycopg`` 3, for a fleet whose archivers
run on several machines). Both upsert by request id and raise only the errors
below; a database library's own exceptions never leave them.

Methods are synchronous and thread-safe: async callers run them in a thread
(``asyncio.to_thread``) so that a slow database never stalls a broker connection.

    ModelfleetError
    ├── ArchiveError          a query failed, or the table is not ours
    │   └── ArchiveUnavailable   the archive cannot be opened or reached
    └── ConfigError
        └── ReplayRefused     (replay.py) a replay the rules forbid
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from modelfleet.dlq.records import DeadLetterRecord, Selection, SignatureCount
from modelfleet.errors import ConfigError, ModelfleetError

DB_ENV = "MODELFLEET_DLQ_DB"
DEFAULT_TABLE = "modelfleet_dead_letters"


class ArchiveError(ModelfleetError):
    """The dead-letter archive failed a query; the message names the archive."""

    code = "archive_error"


class ArchiveUnavailable(ArchiveError):
    """The archive cannot be opened or reached: check the path, permissions or server."""

    code = "archive_unavailable"


class Archive(Protocol):
    @property
    def location(self) -> str:
        """Where it is, fit for messages (no password)."""
        ...

    def get(self, request_id: str) -> DeadLetterRecord | None: ...

    def put(self, record: DeadLetterRecord) -> None:
        """Insert, or replace the record with the same request id."""
        ...

    def select(self, selection: Selection) -> list[DeadLetterRecord]:
        """Matching records, oldest first-seen first, at most ``selection.limit``."""
        ...

    def signature_counts(self, selection: Selection) -> list[SignatureCount]:
        """Matching records grouped by (class, signature, model), largest group first."""
        ...

    def mark_replayed(self, request_id: str, at_ms: int) -> None:
        """Count one replay of ``request_id`` and remember when."""
        ...

    def close(self) -> None: ...


def default_location() -> str:
    """``$MODELFLEET_DLQ_DB``, else ``~/.cache/modelfleet/dlq.sqlite3`` (the state dir)."""
    return os.environ.get(DB_ENV) or str(Path.home() / ".cache" / "modelfleet" / "dlq.sqlite3")


def open_archive(location: str, table: str = DEFAULT_TABLE) -> Archive:
    """A file path or ``sqlite:///path`` gives SQLite; ``postgresql://...`` gives PostgreSQL.

    Creates the table if it is missing. Raises ConfigError for a URL we do not know,
    ArchiveUnavailable when the archive cannot be opened.
    """
    if location.startswith(("postgresql://", "postgres://")):
        from modelfleet.dlq.archive.postgres import PostgresArchive

        return PostgresArchive(location, table)
    if location.startswith("sqlite://"):
        location = location.removeprefix("sqlite://")
        if not location.startswith("/"):
            raise ConfigError("an sqlite:// archive URL needs an absolute path "
                              "(sqlite:///var/lib/dlq.sqlite3); or pass a plain file path")
    elif "://" in location:
        raise ConfigError(f"archive {location.split('://')[0]}:// is not supported: pass a "
                          "file path (SQLite) or a postgresql:// URL")
    from modelfleet.dlq.archive.sqlite import SqliteArchive

    return SqliteArchive(Path(location).expanduser(), table)


def check_table_name(table: str) -> str:
    """Table names are interpolated into SQL, so only plain identifiers are accepted."""
    if not table.isidentifier() or not table.isascii() or len(table) > 63:
        raise ConfigError(f"archive table name {table!r} is not a plain identifier")
    return table
