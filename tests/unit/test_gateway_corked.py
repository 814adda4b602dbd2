"""A response's head and body leave the gateway in one send (gateway/corked.py): the
edge's protocol (uvicorn's h11, subclassed) over a real socket that counts its sends."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from uvicorn.config import Config
from uvicorn.server import ServerState

from modelfleet.gateway.edge import EdgeLimits, edge_protocol


class CountingSocket(socket.socket):
    """A real socket that counts the sends asyncio makes on it."""

    sends = 0

    def send(self, data: Any, *args: Any) -> int:
        type(self).sends += 1
        return super().send(data, *args)


async def answer(scope: Any, receive: Any, send: Any) -> None:
    body = b'{"streamed": true}' if scope["path"] == "/stream" else b'{"ok": true}'
    headers = [(b"content-type", b"application/json")]
    if scope["path"] != "/stream":
        headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    if scope["path"] == "/stream":  # a streamed body: two chunks, then the end
        await send({"type": "http.response.body", "body": body[:5], "more_body": True})
        await asyncio.sleep(0.05)
        await send({"type": "http.response.body", "body": body[5:], "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.body", "body": body})


async def exchange(requests: bytes, until: bytes) -> tuple[bytes, int]:
    config = Config(answer, lifespan="off", log_config=None)
    config.load()
    protocol = edge_protocol(EdgeLimits(header_read_timeout_s=5, body_read_timeout_s=5,
                                        max_connections=10))
    ours, theirs = socket.socketpair()
    counted = CountingSocket(ours.family, ours.type, fileno=ours.detach())
    CountingSocket.sends = 0
    loop = asyncio.get_running_loop()
    state = ServerState()
    transport, _ = await loop.connect_accepted_socket(
        lambda: protocol(config=config, server_state=state, app_state={}), sock=counted)
    reader, writer = await asyncio.open_connection(sock=theirs)
    writer.write(requests)
    received = b""
    while received.count(until) < requests.count(b"HTTP/1.1"):
        received += await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    transport.close()
    return received, CountingSocket.sends


async def test_a_response_is_one_send() -> None:
    received, sends = await exchange(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n", b'{"ok": true}')
    assert received.startswith(b"HTTP/1.1 200 OK\r\n") and received.endswith(b'{"ok": true}')
    assert sends == 1  # uvicorn alone: two (the head, then the body)


async def test_keep_alive_responses_are_one_send_each() -> None:
    request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    received, sends = await exchange(request * 3, b'{"ok": true}')
    assert received.count(b"HTTP/1.1 200 OK") == 3
    assert sends == 3


async def test_a_streamed_body_still_goes_out_as_it_is_written() -> None:
    received, sends = await exchange(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n", b"0\r\n\r\n")
    assert b'{"str' in received and b'eamed": true}' in received
    assert received.endswith(b"0\r\n\r\n")  # the chunked body's end
    assert sends >= 2  # the first chunk was not held back until the end
