"""``modelfleet serve`` on its embedded broker: its dead letters are archived, listed
and replayed (through the gateway's HTTP API), as on RabbitMQ."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.procs import ROOT, serve
from tests.waiting import eventually_blocking


def dlq(db: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "modelfleet", "dlq", *args, "--db", str(db)],
                          cwd=ROOT, env=os.environ, capture_output=True, text=True, timeout=120)


def archived(db: Path) -> list[dict[str, object]]:
    listed = dlq(db, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    return [json.loads(line) for line in listed.stdout.splitlines() if line.strip()]


def test_serve_archives_its_dead_letters_and_they_replay_through_the_gateway(
        tmp_path: Path) -> None:
    db = tmp_path / "dlq.sqlite3"
    proc, base = serve(tmp_path, env={"MODELFLEET_DLQ_DB": str(db),
                                      "MODELFLEET_RUNTIME__PING_INTERVAL_S": "0.5",
                                      "MODELFLEET_WORKER__RESTART_BACKOFF_MAX_S": "0.5"})
    try:
        pill = httpx.post(f"{base}/v1/models/crasher/infer", content=b"CRASH",
                          headers={"content-type": "text/plain"}, timeout=90)
        assert pill.status_code == 500 and "dead-lettered" in pill.text
        records = eventually_blocking(  # archived in the background, as it arrives
            lambda: archived(db), 20, what="serve archiving its dead letter", every_s=0.2)
        [record] = records
        assert record["model_id"] == "crasher" and record["failure_class"] == "deterministic"
        request_id = str(record["request_id"])

        # From outside the process the embedded broker is unreachable: the error says how.
        refused = dlq(db, "replay", "--class", "deterministic", "--force", "--request-id",
                      request_id, "--broker", "memory")
        assert refused.returncode != 0 and "--gateway" in refused.stderr

        replayed = dlq(db, "replay", "--class", "deterministic", "--force", "--request-id",
                       request_id, "--gateway", base)
        # The pill crashes again (the replay is a real request): the outcome says so.
        assert "runtime_crashed" in replayed.stdout, replayed.stdout + replayed.stderr
        assert "1 replayed" in replayed.stdout
        shown = json.loads(dlq(db, "show", request_id).stdout)
        assert shown["replay_count"] == 1
    finally:
        proc.stop()
