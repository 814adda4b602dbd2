"""Fetching a task's payload bytes inside the runtime.

Three places the bytes can be (``PayloadRef.kind``):

- ``inline``: in the task itself (small payloads).
- ``gateway``: held by the gateway that received the request, at a signed, expiring
  URL on that gateway (the URL came from our own broker, so it is trusted).
- ``url``: the caller's own URL. That is untrusted input, so the fetch is limited in
  size and time, follows no redirects, and refuses loopback, link-local, private and
  other non-global addresses unless ``runtime.url_fetch_allow`` names the host or a
  network containing it. (The name is resolved and checked before connecting; a DNS
  answer that changes between check and connect is outside what this guards.)
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urlsplit

import httpx

from modelfleet.errors import (
    DeadlineExceeded,
    PayloadFetchForbidden,
    PayloadTooLarge,
    PayloadUnavailable,
)
from modelfleet.messages import PayloadRef
from modelfleet.settings import RuntimeSettings

_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_NEVER_GLOBAL = (ipaddress.ip_network("::/96"),  # IPv4-compatible (deprecated)
                 ipaddress.ip_network("fec0::/10"))  # site-local (deprecated)


def embedded_ipv4(address: ipaddress.IPv4Address | ipaddress.IPv6Address
                  ) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, Teredo, NAT64), else itself.

    ``64:ff9b::a9fe:a9fe`` reaches 169.254.169.254 through a NAT64 gateway, yet Python
    calls it global; what matters is where the packets end up.
    """
    if isinstance(address, ipaddress.IPv4Address):
        return address
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if any(address in net for net in _NAT64):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address


def is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether packets to ``address`` leave for the internet (what it carries, too)."""
    if isinstance(address, ipaddress.IPv6Address) and any(address in n for n in _NEVER_GLOBAL):
        return False
    return embedded_ipv4(address).is_global


class PayloadFetcher:
    def __init__(self, settings: RuntimeSettings) -> None:
        self._settings = settings
        self._client = httpx.AsyncClient(follow_redirects=False, trust_env=False)
        self._allowed_networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self._allowed_hosts: set[str] = set()
        for entry in settings.url_fetch_allow:
            try:
                self._allowed_networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self._allowed_hosts.add(entry.lower())

    async def close(self) -> None:
        await self._client.aclose()

    async def fetch(self, ref: PayloadRef, timeout_s: float) -> tuple[bytes, str | None]:
        """The payload bytes, and the content type the source declared (for ``url``)."""
        if ref.kind == "inline":
            return ref.data, None
        if timeout_s <= 0:
            raise DeadlineExceeded("deadline passed before the payload was fetched")
        if ref.kind == "gateway":
            return await self._get(ref.url, min(timeout_s, self._settings.url_fetch_timeout_s),
                                   limit=None, what="the gateway's copy of the payload")
        await self._check_destination(ref.url)
        return await self._get(ref.url, min(timeout_s, self._settings.url_fetch_timeout_s),
                               limit=self._settings.url_fetch_max_bytes, what=ref.url)

    async def _check_destination(self, url: str) -> None:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise PayloadFetchForbidden(f"payload URL is malformed: {exc}") from exc
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PayloadFetchForbidden(f"payload URL must be http(s)://host/...: {url!r}")
        host = parts.hostname.lower()
        if host in self._allowed_hosts:
            return
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port or (443 if parts.scheme == "https" else 80),
                type=socket.SOCK_STREAM)
        except OSError as exc:
            raise PayloadUnavailable(f"cannot resolve payload host {host!r}: {exc}") from exc
        for info in infos:
            address = ipaddress.ip_address(info[4][0])
            if any(embedded_ipv4(address) in net for net in self._allowed_networks):
                continue
            if not is_public(address):
                raise PayloadFetchForbidden(
                    f"payload URL host {host!r} resolves to non-public address {address}; "
                    "list it in runtime.url_fetch_allow to permit it")

    async def _get(self, url: str, timeout_s: float, limit: int | None,
                   what: str) -> tuple[bytes, str | None]:
        try:
            async with asyncio.timeout(timeout_s):
                async with self._client.stream("GET", url, timeout=timeout_s) as response:
                    if response.status_code in (403, 404, 410):
                        raise PayloadUnavailable(
                            f"fetching {what} got HTTP {response.status_code} "
                            "(expired, freed or never there)")
                    if response.status_code != 200:
                        raise PayloadUnavailable(f"fetching {what} got HTTP "
                                                 f"{response.status_code}")
                    declared = response.headers.get("content-length")
                    if limit is not None and declared and int(declared) > limit:
                        raise PayloadTooLarge(f"{what} is {declared} bytes; the limit is {limit}")
                    chunks, size = [], 0
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if limit is not None and size > limit:
                            raise PayloadTooLarge(f"{what} exceeds the limit of {limit} bytes")
                        chunks.append(chunk)
                    ctype = response.headers.get("content-type")
                    return b"".join(chunks), ctype.split(";")[0].strip() if ctype else None
        except TimeoutError as exc:
            raise PayloadUnavailable(f"fetching {what} took longer than {timeout_s:.1f}s") from exc
        except httpx.HTTPError as exc:
            raise PayloadUnavailable(f"fetching {what} failed: {exc!r}") from exc
