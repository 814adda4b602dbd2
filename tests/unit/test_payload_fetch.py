"""PayloadFetcher: the caller's URL is untrusted input; the gateway's URL is not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from modelfleet.errors import (
    DeadlineExceeded,
    PayloadFetchForbidden,
    PayloadTooLarge,
    PayloadUnavailable,
)
from modelfleet.messages import PayloadRef
from modelfleet.runtime.payload import PayloadFetcher
from modelfleet.settings import RuntimeSettings


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    request = (await reader.readuntil(b"\r\n\r\n")).decode()
    path = request.split()[1]
    if path == "/slow":
        await asyncio.sleep(5)
    if path == "/redirect":
        head = "HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:1/\r\nContent-Length: 0\r\n\r\n"
        writer.write(head.encode())
    elif path == "/big":
        body = b"x" * 5000
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    elif path == "/big-chunked":
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(5):
            writer.write(b"3e8\r\n" + b"y" * 1000 + b"\r\n")
        writer.write(b"0\r\n\r\n")
    else:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: image/png; q=1\r\n"
                     b"Content-Length: 4\r\n\r\nPNG!")
    await writer.drain()
    writer.close()


@pytest.fixture
async def origin() -> AsyncIterator[str]:
    server = await asyncio.start_server(_serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}"


def fetcher(*allow: str, max_bytes: int = 4096, timeout_s: float = 1.0) -> PayloadFetcher:
    return PayloadFetcher(RuntimeSettings(url_fetch_allow=allow, url_fetch_max_bytes=max_bytes,
                                          url_fetch_timeout_s=timeout_s))


async def test_inline_bytes_need_no_fetch() -> None:
    f = fetcher()
    assert await f.fetch(PayloadRef("inline", data=b"abc"), 1) == (b"abc", None)
    await f.close()


async def test_loopback_is_refused_unless_allowed(origin: str) -> None:
    f = fetcher()
    with pytest.raises(PayloadFetchForbidden, match=r"is not allowed"):
        await f.fetch(PayloadRef("url", url=f"{origin}/img"), 5)
    # A name that resolves to a private address: refused without saying which address
    # (a caller could map internal DNS with it).
    by_name = origin.replace("127.0.0.1", "localhost")
    with pytest.raises(PayloadFetchForbidden, match=r"'localhost' is not allowed") as info:
        await f.fetch(PayloadRef("url", url=f"{by_name}/img"), 5)
    assert "127." not in info.value.message and "::1" not in info.value.message
    await f.close()
    allowed = fetcher(f"127.0.0.0/8:{origin.rpartition(':')[2]}")
    assert await allowed.fetch(PayloadRef("url", url=f"{origin}/img"), 5) == (b"PNG!",
                                                                              "image/png")
    await allowed.close()


@pytest.mark.parametrize("url", ["ftp://example.com/x", "file:///etc/passwd", "http:///x",
                                 "http://169.254.169.254/latest/meta-data",
                                 "http://[::1]/x", "http://10.0.0.1/x"])
async def test_other_schemes_and_private_ranges_are_refused(url: str) -> None:
    f = fetcher()
    with pytest.raises(PayloadFetchForbidden):
        await f.fetch(PayloadRef("url", url=url), 5)
    await f.close()


@pytest.mark.parametrize("path", ["/big", "/big-chunked"])
async def test_size_limit(origin: str, path: str) -> None:
    f = fetcher(f"127.0.0.1:{origin.rpartition(':')[2]}")
    with pytest.raises(PayloadTooLarge):
        await f.fetch(PayloadRef("url", url=origin + path), 5)
    await f.close()


async def test_time_limit_and_no_redirects(origin: str) -> None:
    f = fetcher(f"127.0.0.1:{origin.rpartition(':')[2]}", timeout_s=0.3)
    with pytest.raises(PayloadUnavailable, match="longer than"):
        await f.fetch(PayloadRef("url", url=f"{origin}/slow"), 5)
    with pytest.raises(PayloadUnavailable, match="302"):
        await f.fetch(PayloadRef("url", url=f"{origin}/redirect"), 5)
    with pytest.raises(DeadlineExceeded):
        await f.fetch(PayloadRef("url", url=f"{origin}/img"), 0)
    await f.close()


@pytest.mark.parametrize(("carried", "inner"), [
    ("::ffff:127.0.0.1", "127.0.0.1"),
    ("64:ff9b::a9fe:a9fe", "169.254.169.254"),
    ("2002:7f00:1::1", "127.0.0.1"),
    ("64:ff9b:1::a9fe:a9fe", "169.254.169.254"),
])
def test_ipv6_addresses_carrying_ipv4_are_judged_by_it(carried: str, inner: str) -> None:
    import ipaddress

    from modelfleet.runtime.payload import embedded_ipv4

    assert embedded_ipv4(ipaddress.ip_address(carried)) == ipaddress.ip_address(inner)
    assert not embedded_ipv4(ipaddress.ip_address(carried)).is_global


async def test_malformed_url_is_forbidden_not_a_crash() -> None:
    f = fetcher()
    for url in ("http://x:99999/", "http://[::1/"):
        with pytest.raises(PayloadFetchForbidden, match="malformed"):
            await f.fetch(PayloadRef("url", url=url), 5)
    await f.close()


@pytest.mark.parametrize("address", ["::a9fe:a9fe", "fec0::1", "64:ff9b:1::a9fe:a9fe",
                                     "10.1.2.3", "::1"])
def test_non_public_addresses(address: str) -> None:
    import ipaddress

    from modelfleet.runtime.payload import is_public

    assert not is_public(ipaddress.ip_address(address))
    assert is_public(ipaddress.ip_address("93.184.215.14"))
