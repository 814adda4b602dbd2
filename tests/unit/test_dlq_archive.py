"""Both archive backends, through the one ``Archive`` protocol.

SQLite always runs. PostgreSQL runs when psycopg is installed, against the server
at $MODELFLEET_TEST_POSTGRES (default postgresql://postgres@127.0.0.1:5432/test),
in a table of its own that is dropped afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from modelfleet.dlq.archive import Archive, ArchiveError, ArchiveUnavailable, open_archive
from modelfleet.dlq.records import DeadLetterRecord, Selection, archived
from modelfleet.errors import ConfigError
from modelfleet.messages import PayloadRef, Task

POSTGRES_URL = os.environ.get("MODELFLEET_TEST_POSTGRES",
                              "postgresql://postgres@127.0.0.1:5432/test")
HAVE_PSYCOPG = importlib.util.find_spec("psycopg") is not None


def make_task(request_id: str, model_id: str = "digits", data: bytes = b"\x89PNG\x00\xff") -> Task:
    return Task(request_id=request_id, model_id=model_id, version="3", deadline_ms=31_000,
                reply_to="inbox.gw1", payload=PayloadRef("inline", data, size_bytes=len(data)),
                content_type="image/png", enqueued_ms=1_000, tenant="acme", plan="pro",
                params={"threshold": "0.5"}, delivery_count=4)


def record(request_id: str, reason: str = "delivery_limit", model_id: str = "digits",
           at_ms: int = 10_000) -> DeadLetterRecord:
    return archived(make_task(request_id, model_id), reason, at_ms, None)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.skipif(
    not HAVE_PSYCOPG, reason="psycopg is not installed: pip install 'psycopg[binary]>=3.1' "
                             "to test the PostgreSQL archive"))])
def archive(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Archive]:
    if request.param == "sqlite":
        opened = open_archive(str(tmp_path / "dlq.sqlite3"))
        yield opened
        opened.close()
        return
    from modelfleet.dlq.archive.backend import SqlArchive

    pg = open_archive(POSTGRES_URL, table=f"dlq_test_{uuid.uuid4().hex[:12]}")
    assert isinstance(pg, SqlArchive)
    try:
        yield pg
    finally:
        pg.drop()
        pg.close()


def test_a_record_comes_back_as_stored(archive: Archive) -> None:
    stored = record("r1", "runtime_crashed: runtime shared-0 is gone: boom")
    archive.put(stored)
    back = archive.get("r1")
    assert back == stored
    assert back.task() == replace(make_task("r1"), delivery_count=0)
    assert (back.payload_inline, back.tenant, back.plan, back.timeout_ms) == \
        (b"\x89PNG\x00\xff", "acme", "pro", 30_000)
    assert archive.get("missing") is None


def test_put_upserts_by_request_id(archive: Archive) -> None:
    archive.put(record("r1", "delivery_limit"))
    archive.put(replace(record("r1", "delivery_limit"), deaths=2, failure_class="deterministic"))
    assert [(r.request_id, r.deaths, r.failure_class)
            for r in archive.select(Selection())] == [("r1", 2, "deterministic")]


def test_select_filters_orders_and_limits(archive: Archive) -> None:
    archive.put(record("c", "delivery_limit", "digits", at_ms=3))
    archive.put(record("a", "delivery_limit", "iris", at_ms=1))
    archive.put(record("b", "model_error: boom", "digits", at_ms=2))
    archive.put(record("d", "delivery_limit", "digits", at_ms=4))

    def ids(selection: Selection) -> list[str]:
        return [r.request_id for r in archive.select(selection)]

    assert ids(Selection()) == ["a", "b", "c", "d"]
    assert ids(Selection(failure_class="transient")) == ["a", "c", "d"]
    assert ids(Selection(failure_class="deterministic")) == ["b"]
    assert ids(Selection(model_id="digits", failure_class="transient")) == ["c", "d"]
    assert ids(Selection(request_ids=("d", "a", "zz"))) == ["a", "d"]
    assert ids(Selection(limit=2)) == ["a", "b"]
    archive.mark_replayed("c", 99)
    assert ids(Selection(failure_class="transient", never_replayed=True)) == ["a", "d"]


def test_mark_replayed_counts_and_remembers_when(archive: Archive) -> None:
    archive.put(record("r1"))
    archive.mark_replayed("r1", 1_234)
    archive.mark_replayed("r1", 5_678)
    back = archive.get("r1")
    assert back is not None
    assert (back.replay_count, back.replayed_at_ms) == (2, 5_678)


def test_signature_counts_group_identical_failures(archive: Archive) -> None:
    for i in range(3):
        archive.put(record(f"crash{i}", f"runtime_crashed: runtime shared-{i} is gone: x",
                           at_ms=100 + i))
    archive.put(record("other-model", "runtime_crashed: runtime shared-9 is gone: x", "iris"))
    archive.put(record("dl1", "delivery_limit"))
    counts = archive.signature_counts(Selection())
    assert [(c.count, c.failure_class, c.model_id, c.signature) for c in counts][:1] == [
        (3, "deterministic", "digits", "runtime_crashed: runtime shared-<n> is gone: x")]
    assert counts[0].rule == "poison-input"
    assert (counts[0].first_seen_ms, counts[0].last_seen_ms) == (100, 102)
    assert sorted((c.count, c.model_id, c.signature) for c in counts[1:]) == [
        (1, "digits", "delivery_limit"),
        (1, "iris", "runtime_crashed: runtime shared-<n> is gone: x")]
    transient = archive.signature_counts(Selection(failure_class="transient"))
    assert [(c.count, c.signature) for c in transient] == [(1, "delivery_limit")]


def test_the_archive_survives_reopening(tmp_path: Path) -> None:
    path = str(tmp_path / "nested" / "dir" / "dlq.sqlite3")
    first = open_archive(path)
    first.put(record("r1"))
    first.close()
    second = open_archive(f"sqlite://{path}")
    assert second.get("r1") == record("r1")
    second.close()


def test_sqlite_errors_become_archive_errors(tmp_path: Path) -> None:
    not_a_db = tmp_path / "notes.txt"
    not_a_db.write_text("this is not a database, just words that are long enough " * 20)
    with pytest.raises(ArchiveError, match=r"notes\.txt"):
        open_archive(str(not_a_db))
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ArchiveUnavailable, match="--db"):
        open_archive(str(blocker / "sub" / "dlq.sqlite3"))


@pytest.mark.parametrize(("location", "problem"), [
    ("redis://localhost/0", "not supported"),
    ("sqlite://relative.db", "absolute path"),
])
def test_unknown_archive_urls_are_config_errors(location: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        open_archive(location)


def test_table_names_must_be_plain_identifiers(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="identifier"):
        open_archive(str(tmp_path / "x.sqlite3"), table="t; DROP TABLE x")


@pytest.mark.skipif(not HAVE_PSYCOPG, reason="psycopg is not installed")
def test_an_unreachable_postgres_is_archive_unavailable_without_the_password() -> None:
    with pytest.raises(ArchiveUnavailable) as caught:
        open_archive("postgresql://mf:s3cret@127.0.0.1:1/test")
    assert "s3cret" not in str(caught.value)
    assert "127.0.0.1:1" in str(caught.value)
