"""JSON logs: one object per line, the request's fields, no secrets; phase histograms for
every outcome with bounded model labels."""

from __future__ import annotations

import io
import json
import logging
import re

from prometheus_client import generate_latest

from modelfleet.gateway.observe import RequestObserver, RequestRecord
from modelfleet.labels import ModelLabels
from modelfleet.logformat import JsonFormatter, configure_logging
from modelfleet.messages import Reply
from modelfleet.redaction import RedactingFilter


def captured(logger: logging.Logger) -> tuple[io.StringIO, logging.Handler]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RedactingFilter(["hunter2-secret"]))
    logger.addHandler(handler)
    return out, handler


def test_a_json_line_carries_fields_and_no_secret() -> None:
    logger = logging.getLogger("test.jsonlines")
    logger.setLevel(logging.INFO)
    out, handler = captured(logger)
    try:
        logger.info("fetched http://gw:8000/v1/payloads/r1?expires=9&sig=abc with hunter2-secret",
                    extra={"fields": {"request_id": "r1", "note": "password=swordfish",
                                      "timings_ms": {"predict": 1.5}}})
        logger.info("second")
    finally:
        logger.removeHandler(handler)
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["level"] == "info" and first["logger"] == "test.jsonlines"
    assert first["request_id"] == "r1" and first["timings_ms"] == {"predict": 1.5}
    assert "sig=abc" not in first["message"] and "hunter2-secret" not in first["message"]
    assert first["note"] == "password=***"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["ts"])
    assert second["message"] == "second"


def test_configure_logging_switches_the_root_handler() -> None:
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    try:
        configure_logging("warning", "json")
        (handler,) = root.handlers
        assert isinstance(handler.formatter, JsonFormatter) and root.level == logging.WARNING
        configure_logging("info", "text")
        (handler,) = root.handlers
        assert not isinstance(handler.formatter, JsonFormatter)
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in before:
            root.addHandler(h)
        root.setLevel(level)


def sample(name: str, **labels: str) -> float:
    total = 0.0
    for line in generate_latest().decode().splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{.*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def test_every_outcome_is_observed_with_model_and_outcome_and_one_json_line() -> None:
    logger = logging.getLogger("modelfleet.requests")
    out, handler = captured(logger)
    logger.setLevel(logging.INFO)
    observer = RequestObserver("json", ModelLabels(limit=1))
    failed_before = sample("modelfleet_phase_seconds_count", model="obs-a", phase="predict",
                           outcome="model_error")
    late_before = sample("modelfleet_phase_seconds_count", model="other", phase="total",
                         outcome="deadline_exceeded")
    try:
        reply = Reply("r1", "error", error_code="model_error", worker_id="w7",
                      timings_ms={"queue_wait": 2.0, "predict": 30.0})
        observer.record(RequestRecord("r1", "obs-a", "2", 500, "model_error", 0.05, reply))
        observer.record(RequestRecord("r2", "obs-b", "1", 504, "deadline_exceeded", 1.0))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    assert sample("modelfleet_phase_seconds_count", model="obs-a", phase="predict",
                  outcome="model_error") == failed_before + 1
    # A second model beyond the limit of one is counted as "other".
    assert sample("modelfleet_phase_seconds_count", model="other", phase="total",
                  outcome="deadline_exceeded") == late_before + 1
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert {k: first[k] for k in ("request_id", "model", "version", "worker", "status",
                                  "outcome")} == {"request_id": "r1", "model": "obs-a",
                                                  "version": "2", "worker": "w7",
                                                  "status": 500, "outcome": "model_error"}
    assert first["timings_ms"] == {"queue_wait": 2.0, "predict": 30.0, "total": 50.0}
    assert second["model"] == "obs-b" and second["worker"] == "" and second["status"] == 504
    # The gateway's request counter and histogram take the same bounded labels.
    assert (observer.label("obs-a"), observer.label("obs-c")) == ("obs-a", "other")
