"""Chunk sizes of a chunked request body, bounded as each size line is read (h11 alone;
the gateway's answers on a real socket are in tests/e2e/test_gateway_faults.py)."""

from __future__ import annotations

import h11
import pytest

from modelfleet.errors import PayloadTooLarge, RequestRejected
from modelfleet.gateway.chunked import ChunkGuardedConnection, ChunkRefused

HEAD = (b"POST /v1/models/banner/infer HTTP/1.1\r\nHost: x\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n")


def events(conn: h11.Connection, data: bytes) -> list[object]:
    conn.receive_data(data)
    seen: list[object] = []
    while (event := conn.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
        seen.append(event)
    return seen


def refusal(data: bytes, limit: int = 1000, *, split: int | None = None) -> RequestRejected:
    conn = ChunkGuardedConnection(16 * 1024, limit)
    with pytest.raises(ChunkRefused) as refused:
        if split is None:
            events(conn, data)
        else:
            events(conn, data[:split])
            events(conn, data[split:])
    return refused.value.error


def test_a_size_no_length_holds_is_refused_when_its_line_is_read() -> None:
    """h11 takes 20 hex digits and would wait for 2**80 bytes: refused with no data."""
    error = refusal(HEAD + b"FFFFFFFFFFFFFFFFFFFF\r\n")
    assert type(error) is RequestRejected and error.code == "bad_request"
    assert "0xffffffffffffffffffff" in error.message and "not a length" in error.message


def test_a_size_line_arriving_apart_from_the_head_is_checked_too() -> None:
    error = refusal(HEAD + b"8000000000000000\r\nabc", split=len(HEAD) + 3)
    assert error.code == "bad_request"


def test_a_chunk_past_the_body_limit_is_413_before_its_data() -> None:
    error = refusal(HEAD + b"3E9\r\n", limit=1000)  # 1,001 bytes declared
    assert isinstance(error, PayloadTooLarge) and "1001" in error.message


def test_chunks_adding_up_past_the_limit_are_413_at_the_one_that_crosses_it() -> None:
    conn = ChunkGuardedConnection(16 * 1024, 10)
    seen = events(conn, HEAD + b"6\r\nabcdef\r\n")
    assert [type(e) for e in seen] == [h11.Request, h11.Data]
    with pytest.raises(ChunkRefused) as refused:
        events(conn, b"5\r\n")
    assert refused.value.error.code == "payload_too_large"


def test_a_body_within_the_limit_and_the_next_request_pass() -> None:
    conn = ChunkGuardedConnection(16 * 1024, 10)
    seen = events(conn, HEAD + b"5\r\nhello\r\n5\r\nworld\r\n0\r\n\r\n")
    assert [type(e) for e in seen] == [h11.Request, h11.Data, h11.Data, h11.EndOfMessage]
    conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
    conn.send(h11.EndOfMessage())
    conn.start_next_cycle()
    again = events(conn, HEAD + b"A\r\n0123456789\r\n0\r\n\r\n")  # each body its own count
    assert [type(e) for e in again] == [h11.Request, h11.Data, h11.EndOfMessage]


def test_a_content_length_body_is_left_to_the_app() -> None:
    conn = ChunkGuardedConnection(16 * 1024, 10)
    seen = events(conn, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
    assert [type(e) for e in seen] == [h11.Request, h11.Data, h11.EndOfMessage]
