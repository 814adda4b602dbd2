"""``modelfleet dlq`` in-process: what it prints and which exit code it picks.

No broker is needed here (the broker-using paths are in tests/e2e/test_dlq_cli.py);
the archive is a SQLite file seeded directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelfleet.dlq.archive import open_archive
from modelfleet.dlq.cli import main
from modelfleet.dlq.records import Selection, archived
from modelfleet.messages import PayloadRef, Task

UNREACHABLE = "amqp://guest:guest@127.0.0.1:1/"


def task(request_id: str, model_id: str = "digits") -> Task:
    return Task(request_id=request_id, model_id=model_id, version="2", deadline_ms=31_000,
                reply_to="inbox.gw", payload=PayloadRef("inline", b"PNGDATA", size_bytes=7),
                content_type="image/png", enqueued_ms=1_000, tenant="acme", delivery_count=4)


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "dlq.sqlite3")
    archive = open_archive(path)
    for request_id, model_id, reason, at_ms in [
        ("t1", "digits", "delivery_limit", 1_000),
        ("t2", "iris", "delivery_limit", 2_000),
        ("d1", "digits", "runtime_crashed: runtime shared-0 is gone: connection closed", 3_000),
        ("d2", "digits", "runtime_crashed: runtime shared-4 is gone: connection closed", 4_000),
    ]:
        archive.put(archived(task(request_id, model_id), reason, at_ms, None))
    archive.close()
    return path


def test_the_embedded_broker_is_refused_with_a_reason(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      db: str) -> None:
    monkeypatch.delenv("MODELFLEET_BROKER", raising=False)
    for argv in (["archive", "--once", "--db", db], ["replay", "--class", "transient",
                                                     "--broker", "memory", "--db", db]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "'memory' is the embedded broker" in err
        assert "nothing to consume" in err and "--broker amqp://" in err


def test_list_prints_a_table_and_filters(capsys: pytest.CaptureFixture[str], db: str) -> None:
    assert main(["list", "--db", db]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["REQUEST_ID", "MODEL", "CLASS", "RULE", "DELIVERIES",
                                "FIRST_SEEN", "REPLAYS", "SIGNATURE"]
    assert [line.split()[0] for line in lines[1:]] == ["t1", "t2", "d1", "d2"]
    assert lines[1].split()[1:7] == ["digits@2", "transient", "consumer-died", "4",
                                     "1970-01-01T00:00:01Z", "0"]
    assert main(["list", "--db", db, "--class", "transient", "--model", "iris"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == ["t2"]


def test_list_json_lines_carry_every_field_but_the_raw_bytes(
        capsys: pytest.CaptureFixture[str], db: str) -> None:
    assert main(["list", "--db", db, "--json", "--class", "deterministic", "--limit", "1"]) == 0
    [line] = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert record["request_id"] == "d1"
    assert record["failure_class"] == "deterministic" and record["rule"] == "poison-input"
    assert record["tenant"] == "acme" and record["payload_kind"] == "inline"
    assert record["payload_inline_bytes"] == 7 and "task_bytes" not in record


def test_list_by_signature_groups_identical_failures(capsys: pytest.CaptureFixture[str],
                                                     db: str) -> None:
    assert main(["list", "--db", db, "--by-signature", "--json"]) == 0
    groups = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (groups[0]["count"], groups[0]["signature"]) == (
        2, "runtime_crashed: runtime shared-<n> is gone: connection lost")
    assert sorted((g["count"], g["model_id"]) for g in groups[1:]) == [(1, "digits"),
                                                                       (1, "iris")]
    assert main(["list", "--db", db, "--by-signature"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:4] == [
        "2", "deterministic", "poison-input", "digits"]


def test_show_prints_the_record_and_writes_its_payload(capsys: pytest.CaptureFixture[str],
                                                       db: str, tmp_path: Path) -> None:
    out = tmp_path / "payload.png"
    assert main(["show", "d1", "--db", db, "--payload-out", str(out)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["death_reason"].startswith("runtime_crashed: runtime shared-0")
    assert shown["task"]["deadline_ms"] == 31_000
    assert out.read_bytes() == b"PNGDATA"
    assert main(["show", "nope", "--db", db]) == 1


def test_deterministic_replay_is_refused_before_any_connection(
        capsys: pytest.CaptureFixture[str], db: str) -> None:
    argv = ["replay", "--class", "deterministic", "--broker", UNREACHABLE, "--db", db]
    assert main(argv) == 2
    assert "never replayed automatically" in capsys.readouterr().err
    assert main([*argv, "--force"]) == 2
    assert "--request-id" in capsys.readouterr().err


def test_dry_run_lists_what_would_be_replayed_and_replays_nothing(
        capsys: pytest.CaptureFixture[str], db: str) -> None:
    assert main(["replay", "--class", "transient", "--dry-run", "--db", db,
                 "--broker", UNREACHABLE]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [["would", "replay"]] * 2
    assert [line.split()[2] for line in lines] == ["t1", "t2"]
    assert main(["replay", "--class", "deterministic", "--force", "--request-id", "d2",
                 "--request-id", "t1", "--dry-run", "--db", db, "--broker", UNREACHABLE]) == 0
    out = capsys.readouterr().out
    assert "skipped   t1  (is transient, not deterministic)" in out
    assert "would replay  d2" in out
    archive = open_archive(db)
    assert {r.replay_count for r in archive.select(Selection())} == {0}
    archive.close()


def test_an_unreachable_broker_exits_3(capsys: pytest.CaptureFixture[str], db: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELFLEET_BROKER__CONNECT_TIMEOUT_S", "1")
    assert main(["replay", "--class", "transient", "--broker", UNREACHABLE, "--db", db]) == 3
    assert "cannot reach the broker" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["list", "--db", "redis://x/0"], 2, "not supported"),
    (["replay", "--db", "x.sqlite3"], 2, "--class"),
    (["list", "--limit", "0"], 2, "not a positive number"),
    (["archive", "--broker", UNREACHABLE], 2, None),  # a bad env setting, below
])
def test_usage_and_configuration_errors_exit_2(
        argv: list[str], code: int, message: str | None, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MODELFLEET_DLQ_DB", str(tmp_path / "d.sqlite3"))
    monkeypatch.setenv("MODELFLEET_BROKER__DELIVERY_LIMIT", "-1")
    assert main(argv) == code
    err = capsys.readouterr().err
    assert (message or "broker.delivery_limit") in err


def test_an_archive_that_cannot_be_opened_exits_4(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["list", "--db", str(blocker / "dlq.sqlite3")]) == 4
    assert "cannot open the dead-letter archive" in capsys.readouterr().err
