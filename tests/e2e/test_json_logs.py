"""``MODELFLEET_LOG_FORMAT=json`` on a real ``modelfleet serve``: every log line is a JSON
object; each request leaves one gateway line and one worker line with the same request
id, model, version, worker, status and phase timings, and neither shows the payload."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tests.procs import serve

SECRET_FEATURES = "[5.123456, 3.5, 1.4, 0.2]"


def test_one_request_line_and_one_task_line_per_request(tmp_path: Path) -> None:
    proc, base = serve(tmp_path, env={"MODELFLEET_LOG_FORMAT": "json"})
    try:
        ok = httpx.post(f"{base}/v1/models/iris/infer", timeout=60,
                        content=f'{{"features": {SECRET_FEATURES}}}',
                        headers={"content-type": "application/json"})
        bad = httpx.post(f"{base}/v1/models/iris/infer", content=b'{"features": "x"}',
                         headers={"content-type": "application/json"}, timeout=60)
        missing = httpx.post(f"{base}/v1/models/no-such-model/infer", content=b"{}",
                             headers={"content-type": "application/json"}, timeout=60)
    finally:
        proc.stop()
    assert (ok.status_code, bad.status_code, missing.status_code) == (200, 422, 404)
    lines = [line for line in proc.log().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    requests = [r for r in records if r.get("event") == "request"]
    tasks = {r["request_id"]: r for r in records if r.get("event") == "task"}
    assert [(r["model"], r["status"], r["outcome"]) for r in requests] == [
        ("iris", 200, "ok"), ("iris", 422, "invalid_input"), ("(unknown)", 404,
                                                              "model_not_found")]
    answered = requests[0]
    assert answered["version"] == "1" and answered["worker"]
    assert {"queue_wait", "predict", "total"} <= set(answered["timings_ms"])
    task = tasks[answered["request_id"]]
    assert (task["model"], task["version"], task["worker"], task["status"]) == \
        ("iris", "1", answered["worker"], "ok")
    assert "predict" in task["timings_ms"]
    failed = tasks[requests[1]["request_id"]]
    assert (failed["status"], failed["error_code"]) == ("error", "invalid_input")
    # A failure reply still carries the worker's phases to the gateway's line.
    assert requests[1]["worker"] == failed["worker"]
    assert "queue_wait" in requests[1]["timings_ms"]
    assert requests[2]["request_id"] == ""  # refused before it was parked: no task
    assert "5.123456" not in proc.log()
