"""The payload-URL guard: allow-list entries name a port, the fetch goes to the address
that was checked, and a refused or oversized fetch says nothing about what is there."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import ValidationError

from modelfleet.errors import PayloadFetchForbidden, PayloadTooLarge
from modelfleet.messages import PayloadRef
from modelfleet.runtime.payload import PayloadFetcher
from modelfleet.settings import RuntimeSettings


class Origin:
    """A loopback HTTP server that records the Host header of each request."""

    def __init__(self, body: bytes = b"PNG!") -> None:
        self.body = body
        self.hosts: list[str] = []
        self.port = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.lower() == "host":
                self.hosts.append(value.strip())
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"
                     + f"Content-Length: {len(self.body)}\r\n\r\n".encode() + self.body)
        await writer.drain()
        writer.close()


@pytest.fixture
async def origin() -> AsyncIterator[Origin]:
    o = Origin()
    server = await asyncio.start_server(o.serve, "127.0.0.1", 0)
    o.port = server.sockets[0].getsockname()[1]
    async with server:
        yield o


@pytest.fixture
async def big_origin() -> AsyncIterator[Origin]:
    o = Origin(b"m" * 123457)
    server = await asyncio.start_server(o.serve, "127.0.0.1", 0)
    o.port = server.sockets[0].getsockname()[1]
    async with server:
        yield o


def fetcher(*allow: str, max_bytes: int = 4096) -> PayloadFetcher:
    return PayloadFetcher(RuntimeSettings(url_fetch_allow=allow, url_fetch_max_bytes=max_bytes,
                                          url_fetch_timeout_s=5))


@pytest.mark.parametrize("entry", ["127.0.0.1", "files.internal", "10.0.0.0/8", "::1",
                                   "fd00::/8", "127.0.0.1:", "127.0.0.1:http",
                                   "127.0.0.1:70000", "[::1]", "files.internal:0"])
def test_an_entry_without_a_port_is_a_clear_setting_error(entry: str) -> None:
    with pytest.raises(ValidationError) as failure:
        RuntimeSettings(url_fetch_allow=(entry,))
    message = str(failure.value)
    assert entry in message and "port" in message


@pytest.mark.parametrize("entry", ["127.0.0.1:8080", "files.internal:443", "10.0.0.0/8:80",
                                   "[::1]:8080", "[fd00::/8]:443", "Files.Internal:8443"])
def test_host_or_network_with_a_port_is_accepted(entry: str) -> None:
    assert RuntimeSettings(url_fetch_allow=(entry,)).url_fetch_allow == (entry,)


async def test_an_allowed_host_is_allowed_on_its_port_only(origin: Origin) -> None:
    other = await asyncio.start_server(origin.serve, "127.0.0.1", 0)
    other_port = other.sockets[0].getsockname()[1]
    for allow in (f"127.0.0.1:{origin.port}", f"127.0.0.0/8:{origin.port}",
                  f"localhost:{origin.port}"):
        f = fetcher(allow)
        try:
            host = allow.split(":")[0] if allow.startswith("localhost") else "127.0.0.1"
            assert await f.fetch(PayloadRef("url", url=f"http://{host}:{origin.port}/x"),
                                 5) == (b"PNG!", "image/png")
            with pytest.raises(PayloadFetchForbidden, match="url_fetch_allow"):
                await f.fetch(PayloadRef("url", url=f"http://{host}:{other_port}/x"), 5)
        finally:
            await f.close()
    other.close()


async def test_a_refused_or_oversized_fetch_does_not_tell_the_size(big_origin: Origin) -> None:
    f = fetcher(f"127.0.0.1:{big_origin.port}", max_bytes=1000)
    try:
        with pytest.raises(PayloadTooLarge) as failure:
            await f.fetch(PayloadRef("url", url=f"http://127.0.0.1:{big_origin.port}/x"), 5)
        assert "123457" not in str(failure.value) and "1000" in str(failure.value)
    finally:
        await f.close()


async def test_the_fetch_connects_to_the_address_that_was_checked(
        origin: Origin, monkeypatch: pytest.MonkeyPatch) -> None:
    """DNS rebinding: the name answers an allowed address when checked, another one after.
    The fetch must go to the checked address, naming the host in its Host header."""
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo
    answers = iter(["127.0.0.1"])  # checked; every later answer is the "rebound" one

    async def rebinding(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "payload.example":
            address = next(answers, "127.0.0.2")  # nothing listens there
            return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "",
                     (address, int(port)))]
        return await real(host, port, *args, **kwargs)

    monkeypatch.setattr(loop, "getaddrinfo", rebinding)
    f = fetcher(f"127.0.0.1:{origin.port}")
    try:
        body, ctype = await f.fetch(
            PayloadRef("url", url=f"http://payload.example:{origin.port}/img.png"), 5)
    finally:
        await f.close()
    assert (body, ctype) == (b"PNG!", "image/png")
    assert origin.hosts == [f"payload.example:{origin.port}"]


async def test_every_address_a_name_resolves_to_is_checked(
        origin: Origin, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    loop = asyncio.get_running_loop()

    async def two(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (a, int(port)))
                for a in ("127.0.0.1", "10.1.2.3")]

    monkeypatch.setattr(loop, "getaddrinfo", two)
    f = fetcher(f"127.0.0.1:{origin.port}")  # the first address is allowed, the second not
    caplog.set_level(logging.DEBUG, logger="modelfleet.runtime")
    try:
        with pytest.raises(PayloadFetchForbidden, match=r"'mixed.example' is not allowed") \
                as info:
            await f.fetch(PayloadRef("url", url=f"http://mixed.example:{origin.port}/x"), 5)
    finally:
        await f.close()
    assert origin.hosts == []
    # The caller is not told which address; the operator's DEBUG log is.
    assert "10.1.2.3" not in info.value.message
    assert "resolves to non-public address 10.1.2.3" in caplog.text


@pytest.fixture
def certificate(tmp_path: Any) -> tuple[str, str]:
    """A self-signed certificate for payload.example (cert path, key path)."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", key, "-out", cert, "-subj", "/CN=payload.example",
                    "-addext", "subjectAltName=DNS:payload.example"],
                   check=True, capture_output=True)
    return cert, key


async def test_tls_is_checked_against_the_name_not_the_address(
        certificate: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Connecting to the checked address keeps SNI and certificate checks on the name."""
    import ssl

    from modelfleet.errors import PayloadUnavailable

    cert, key = certificate
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    names: list[str | None] = []
    served.sni_callback = lambda _sock, name, _ctx: names.append(name)  # type: ignore
    origin = Origin()
    server = await asyncio.start_server(origin.serve, "127.0.0.1", 0, ssl=served)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()

    async def loopback(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "",
                 ("127.0.0.1", int(port)))]

    monkeypatch.setattr(loop, "getaddrinfo", loopback)
    trusted = ssl.create_default_context(cafile=cert)
    allow = (f"payload.example:{port}", f"other.example:{port}")
    f = PayloadFetcher(RuntimeSettings(url_fetch_allow=allow, url_fetch_timeout_s=5),
                       verify=trusted)
    try:
        assert await f.fetch(PayloadRef("url", url=f"https://payload.example:{port}/x"),
                             5) == (b"PNG!", "image/png")
        with pytest.raises(PayloadUnavailable, match=r"CERTIFICATE_VERIFY_FAILED|certificate"):
            await f.fetch(PayloadRef("url", url=f"https://other.example:{port}/x"), 5)
    finally:
        await f.close()
        server.close()
    assert names[0] == "payload.example" and "other.example" in names
    assert origin.hosts == [f"payload.example:{port}"]
