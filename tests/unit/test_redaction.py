"""What the log redaction takes out of a record, and what it leaves."""

from __future__ import annotations

import logging

import pytest

from modelfleet.redaction import RedactingFilter, redact, secure_logging

SIGNED = ("http://10.0.0.5:8000/v1/payloads/0f1e?expires=1796054665833"
          "&sig=5dea65024dc018f832af1f6186458a5d82b437d0ee1668c55f728a0275e066e5")


@pytest.mark.parametrize(("text", "gone", "kept"), [
    (f'HTTP Request: GET {SIGNED} "HTTP/1.1 200 OK"', "5dea6502", "/v1/payloads/0f1e"),
    (repr(b"\xa3url\xd9\x9e" + SIGNED.encode() + b"\xaasize_bytes"), "5dea6502", "size_bytes"),
    ("connecting to amqp://svc:pa55word@rabbit:5672/prod", "pa55word", "rabbit:5672/prod"),
    ("fetching https://bucket.s3/k?X-Amz-Signature=abc123&X-Amz-Credential=AKIA9",
     "abc123", "https://bucket.s3/k"),
    ("dsn token=t0ps3cret, user=joe", "t0ps3cret", "user=joe"),
])
def test_secrets_are_taken_out_and_the_rest_kept(text: str, gone: str, kept: str) -> None:
    clean = redact(text)
    assert gone not in clean and kept in clean, clean


def test_literal_secrets_go_also_percent_encoded() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "key %s and %s", ("k3y/v@lue",
                               "k3y%2Fv%40lue"), None)
    RedactingFilter(["k3y/v@lue"]).filter(record)
    assert record.getMessage() == "key *** and ***"


def test_tracebacks_are_redacted_too() -> None:
    try:
        raise RuntimeError(f"failed {SIGNED}")
    except RuntimeError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "boom", (), None)
        import sys

        record.exc_info = sys.exc_info()
    RedactingFilter().filter(record)
    assert record.exc_text and "RuntimeError" in record.exc_text
    assert "5dea6502" not in logging.Formatter().format(record)


def test_chatty_libraries_are_held_whatever_the_level() -> None:
    root = logging.getLogger()
    handler = logging.StreamHandler()
    root.addHandler(handler)
    try:
        logging.getLogger("httpx").setLevel(logging.DEBUG)
        secure_logging(["abcd1234"])
        secure_logging(["abcd1234"])  # idempotent: one filter per handler
        assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING
        assert logging.getLogger("aiormq").getEffectiveLevel() >= logging.INFO
        assert sum(isinstance(f, RedactingFilter) for f in handler.filters) == 1
    finally:
        root.removeHandler(handler)


def test_redact_url_hides_the_password_and_the_query_and_keeps_who_and_where() -> None:
    from modelfleet.redaction import redact_url

    assert redact_url("amqp://guest:s3cret@rabbit:5672/") == "amqp://guest:***@rabbit:5672/"
    assert redact_url("postgresql://me:pw@db/x?sslmode=require") == \
        "postgresql://me:***@db/x?***"
    assert redact_url("amqp://rabbit/") == "amqp://rabbit/"
    assert redact_url("memory") == "memory"
