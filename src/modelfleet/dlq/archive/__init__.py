"""The ``Archive`` protocol: where dead letters are kept, and which one a URL names.

One implementation, ``backend.SqlArchive``, over the deployment's database
(``modelfleet.database``: SQLite, the default, one file; or PostgreSQL, for a fleet whose
archivers run on several machines). It upserts by request id and raises only the errors
below; a database library's own exceptions never leave it.

Methods are synchronous and thread-safe: async callers run them in a thread
(``asyncio.to_thread``) so that a slow database never stalls a broker connection.

    ModelfleetError
    ├── ArchiveError          a query failed, or the table is not ours
    │   └── ArchiveUnavailable   the archive cannot be opened or reached
    └── ConfigError
        └── ReplayRefused     (replay.py) a replay the rules forbid
"""

from __future__ import annotations

from typing import Protocol

from modelfleet.database import Names, open_database
from modelfleet.dlq.records import DeadLetterRecord, Selection, SignatureCount
from modelfleet.errors import ConfigError, ModelfleetError

DEFAULT_TABLE = "modelfleet_dead_letters"


class ArchiveError(ModelfleetError):
    """The dead-letter archive failed a query; the message names the archive."""

    code = "archive_error"


class ArchiveUnavailable(ArchiveError):
    """The archive cannot be opened or reached: check the path, permissions or server."""

    code = "archive_unavailable"
    status = 503
    retry_after_s = 1


NAMES = Names("the dead-letter archive", ArchiveError, ArchiveUnavailable,
              "--db, $MODELFLEET_DLQ_DB, state_dir")


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


def open_archive(location: str, table: str = DEFAULT_TABLE) -> Archive:
    """The archive at ``location`` (a file path, ``sqlite:///path`` or ``postgresql://...``;
    see ``modelfleet.database``), its table created if missing. Raises ConfigError for a
    URL we do not know, ArchiveUnavailable when the archive cannot be opened."""
    from modelfleet.dlq.archive.backend import SqlArchive

    table = check_table_name(table)
    return SqlArchive(open_database(location, NAMES), table)


def check_table_name(table: str) -> str:
    """Table names are interpolated into SQL, so only plain identifiers are accepted."""
    if not table.isidentifier() or not table.isascii() or len(table) > 63:
        raise ConfigError(f"archive table name {table!r} is not a plain identifier")
    return table
