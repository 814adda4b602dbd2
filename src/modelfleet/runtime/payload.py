"""Fetching a task's payload bytes inside the runtime.

Three places the bytes can be (``PayloadRef.kind``):

- ``inline``: in the task itself (small payloads).
- ``gateway``: held by the gateway that received the request, at a signed, expiring
  URL on that gateway (the URL came from our own broker, so it is trusted).
- ``url``: the caller's own URL. That is untrusted input, so the fetch is limited in
  size and time, follows no redirects, and refuses loopback, link-local, private and
  other non-global addresses unless ``runtime.url_fetch_allow`` names the host (or a
  network containing its address) *and the port*. The name is resolved once, every
  address it resolves to is checked, and the fetch connects to a checked address
  (the URL rewritten to it, the Host header and TLS SNI and certificate check still
  for the name): a DNS answer that changes between check and connect changes nothing.
  A refused or oversized fetch says nothing about what is there (no size, no body).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
from dataclasses import dataclass, field
from urllib.parse import SplitResult, urlsplit

import httpx

from modelfleet.errors import (
    DeadlineExceeded,
    PayloadFetchForbidden,
    PayloadTooLarge,
    PayloadUnavailable,
)
from modelfleet.messages import PayloadRef
from modelfleet.settings import RuntimeSettings, fetch_allow_entry

log = logging.getLogger("modelfleet.runtime")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

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


@dataclass(frozen=True)
class _Target:
    """Where a checked caller URL is fetched from: its addresses, in the resolver's
    order, each already judged; the name for Host, SNI and the certificate."""

    parts: SplitResult
    port: int
    addresses: list[IPAddress]
    extensions: dict[str, str] = field(default_factory=dict)

    def url_for(self, address: IPAddress) -> str:
        host = f"[{address}]" if address.version == 6 else str(address)
        netloc = f"{host}:{self.port}"
        if self.parts.username is not None:  # keep credentials the caller put in the URL
            netloc = self.parts.netloc.rpartition("@")[0] + "@" + netloc
        return self.parts._replace(netloc=netloc).geturl()

    @property
    def host_header(self) -> str:
        return self.parts.netloc.rpartition("@")[2]


def shown(url: str) -> str:
    """A URL fit for an error message or a log: no credentials, no query."""
    try:
        parts = urlsplit(url)
        return parts._replace(netloc=parts.netloc.rpartition("@")[2], query="",
                              fragment="").geturl()
    except ValueError:
        return "(a malformed URL)"


class PayloadFetcher:
    def __init__(self, settings: RuntimeSettings, verify: ssl.SSLContext | bool = True) -> None:
        self._settings = settings
        self._verify = verify
        # Made on first use: each loads the CA store (~15 ms), and most runtimes, a
        # restarted one above all, fetch nothing (their payloads come inline).
        self._gateway_client: httpx.AsyncClient | None = None
        self._callers_client: httpx.AsyncClient | None = None
        self._allowed_networks: list[tuple[IPNetwork, int]] = []
        self._allowed_hosts: set[tuple[str, int]] = set()
        for entry in settings.url_fetch_allow:
            host, port = fetch_allow_entry(entry)
            try:
                self._allowed_networks.append((ipaddress.ip_network(host, strict=False), port))
            except ValueError:
                self._allowed_hosts.add((host, port))

    @property
    def _client(self) -> httpx.AsyncClient:
        """For the gateway's copies of payloads: pooled."""
        if self._gateway_client is None:
            self._gateway_client = httpx.AsyncClient(follow_redirects=False, trust_env=False,
                                                     verify=self._verify)
        return self._gateway_client

    @property
    def _callers(self) -> httpx.AsyncClient:
        """For callers' URLs, fetched to an address, not a name: a pooled connection made
        (and its certificate checked) for one name must not carry another name's request
        to the same address. One connection per fetch."""
        if self._callers_client is None:
            self._callers_client = httpx.AsyncClient(
                follow_redirects=False, trust_env=False, verify=self._verify,
                limits=httpx.Limits(max_keepalive_connections=0))
        return self._callers_client

    async def close(self) -> None:
        for client in (self._gateway_client, self._callers_client):
            if client is not None:
                await client.aclose()

    async def fetch(self, ref: PayloadRef, timeout_s: float) -> tuple[bytes, str | None]:
        """The payload bytes, and the content type the source declared (for ``url``)."""
        if ref.kind == "inline":
            return ref.data, None
        if timeout_s <= 0:
            raise DeadlineExceeded("deadline passed before the payload was fetched")
        timeout_s = min(timeout_s, self._settings.url_fetch_timeout_s)
        if ref.kind == "gateway":
            return await self._get(self._client, ref.url, timeout_s, limit=None,
                                   what="the gateway's copy of the payload")
        try:
            async with asyncio.timeout(timeout_s):
                target = await self._check_destination(ref.url)
        except TimeoutError as exc:
            raise PayloadUnavailable(f"resolving the host of {shown(ref.url)} took longer "
                                     f"than {timeout_s:.1f}s") from exc
        what = shown(ref.url)
        for i, address in enumerate(target.addresses):
            try:
                return await self._get(self._callers, target.url_for(address), timeout_s,
                                       self._settings.url_fetch_max_bytes, what,
                                       headers={"host": target.host_header},
                                       extensions=target.extensions)
            except _Unreachable as exc:
                if i == len(target.addresses) - 1:
                    raise PayloadUnavailable(f"fetching {what} failed: {exc.cause}") from exc
        raise PayloadUnavailable(f"payload host of {what} has no address")  # not reached

    def _allowed(self, host: str, address: IPAddress, port: int) -> bool:
        return (host, port) in self._allowed_hosts or any(
            embedded_ipv4(address) in net and port == allowed_port
            for net, allowed_port in self._allowed_networks)

    async def _check_destination(self, url: str) -> _Target:
        try:
            parts = urlsplit(url)
            explicit = parts.port
        except ValueError as exc:
            raise PayloadFetchForbidden(f"payload URL is malformed: {exc}") from exc
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PayloadFetchForbidden(f"payload URL must be http(s)://host/...: {shown(url)!r}")
        host = parts.hostname.lower()
        port = explicit or (443 if parts.scheme == "https" else 80)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                                 type=socket.SOCK_STREAM)
        except OSError as exc:
            raise PayloadUnavailable(f"cannot resolve payload host {host!r}: {exc}") from exc
        addresses: list[IPAddress] = []
        for info in infos:
            address = ipaddress.ip_address(info[4][0])
            if address not in addresses:
                addresses.append(address)
        for address in addresses:
            if not self._allowed(host, address, port) and not is_public(address):
                # The caller reads this: which private address a name resolves to would
                # map the fleet's network for them. The operator's log keeps it (DEBUG).
                log.debug("payload URL host %r resolves to non-public address %s",
                          host, address)
                raise PayloadFetchForbidden(
                    f"payload URL host {host!r} is not allowed: it does not resolve to a "
                    f"public address (an operator may list '{host}:{port}' in "
                    f"runtime.url_fetch_allow)")
        if not addresses:
            raise PayloadUnavailable(f"cannot resolve payload host {host!r}: no address")
        is_name = not _is_ip_literal(host)
        extensions = {"sni_hostname": host} if parts.scheme == "https" and is_name else {}
        return _Target(parts, port, addresses, extensions)

    async def _get(self, client: httpx.AsyncClient, url: str, timeout_s: float,
                   limit: int | None, what: str,
                   headers: dict[str, str] | None = None,
                   extensions: dict[str, str] | None = None) -> tuple[bytes, str | None]:
        try:
            async with asyncio.timeout(timeout_s):
                async with client.stream("GET", url, timeout=timeout_s, headers=headers,
                                         extensions=extensions) as response:
                    if response.status_code in (403, 404, 410):
                        raise PayloadUnavailable(
                            f"fetching {what} got HTTP {response.status_code} "
                            "(expired, freed or never there)")
                    if response.status_code != 200:
                        raise PayloadUnavailable(f"fetching {what} got HTTP "
                                                 f"{response.status_code}")
                    declared = response.headers.get("content-length", "")
                    # The size of what is there is not ours to tell: only the limit.
                    too_large = PayloadTooLarge(f"{what} exceeds the limit of {limit} bytes")
                    if limit is not None and declared.isdigit() and int(declared) > limit:
                        raise too_large
                    chunks, size = [], 0
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if limit is not None and size > limit:
                            raise too_large
                        chunks.append(chunk)
                    ctype = response.headers.get("content-type")
                    return b"".join(chunks), ctype.split(";")[0].strip() if ctype else None
        except TimeoutError as exc:
            raise PayloadUnavailable(f"fetching {what} took longer than {timeout_s:.1f}s") from exc
        except httpx.ConnectError as exc:
            raise _Unreachable(repr(exc)) from exc
        except httpx.HTTPError as exc:
            raise PayloadUnavailable(f"fetching {what} failed: {exc!r}") from exc


class _Unreachable(Exception):  # internal: this address refused; the next may not
    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
