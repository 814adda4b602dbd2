"""From an ``Authorization`` header to a ``Principal``, with a short cache.

A gateway reads a key's row and its tenant's row from the store at most once per
``tenancy.cache_ttl_s`` (in a thread), so revoking a key or changing a plan takes
effect on every gateway within that long, without a restart, and the database is not
read on every request. While the store cannot be reached, what was read last is used
(logged once); with nothing read yet, the request fails (503), never opens.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import re
import time
from collections.abc import Callable
from typing import TypeVar

from modelfleet.tenancy import TenancyStoreUnavailable, Unauthenticated, keys
from modelfleet.tenancy.access import Principal
from modelfleet.tenancy.plans import BUILTIN, Plan
from modelfleet.tenancy.store import KeyRecord, Tenant, TenantStore

log = logging.getLogger("modelfleet.tenancy")
_T = TypeVar("_T")


def token_of(authorization: str | None) -> str:
    """The API key in an ``Authorization`` header: ``Bearer KEY``, or Basic credentials
    with the key as user name or password (``curl -u KEY:``). Unauthenticated if none."""
    if not authorization:
        raise Unauthenticated("an API key is needed: send 'Authorization: Bearer <key>' "
                              "(make one with 'modelfleet keys create')")
    # Any whitespace ends the scheme ("Bearer\tKEY" too), and an unsupported scheme is
    # named only when it looks like one: the rest of a header may be the key itself.
    scheme, value = [*re.split(r"\s+", authorization.strip(), maxsplit=1), ""][:2]
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            user, _, password = base64.b64decode(value.strip(), validate=True).decode(
                ).partition(":")
        except (binascii.Error, UnicodeDecodeError):
            raise Unauthenticated("the Basic credentials are not valid base64") from None
        return user if user.startswith(keys.PREFIX) else password
    named = f" {scheme!r}" if _SCHEME.fullmatch(scheme) else ""
    raise Unauthenticated(f"the Authorization scheme{named} is not supported: use "
                          "'Bearer <key>'")


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9-]{0,19}")  # Bearer, Basic, Digest, Negotiate...


class _Cached:
    """A value read from the store, and when it stops being trusted."""

    __slots__ = ("until", "value")

    def __init__(self, value: object, until: float) -> None:
        self.value = value
        self.until = until


class Authenticator:
    def __init__(self, store: TenantStore, plans: dict[str, Plan], ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._plans = plans
        self._ttl_s = ttl_s
        self._clock = clock
        self._cache: dict[str, _Cached] = {}
        self._store_down = False
        self._unknown_plans: set[str] = set()

    async def principal(self, authorization: str | None) -> Principal:
        """Who sent this header; Unauthenticated for a missing, malformed, unknown or
        revoked key; TenancyStoreUnavailable when the store was never readable."""
        key_id, secret = keys.parse(token_of(authorization))
        record: KeyRecord | None = await self._read(f"key:{key_id}", self._store.key, key_id)
        if record is None or not keys.matches(record.salt, record.digest, secret):
            raise Unauthenticated("the API key is not known (mistyped, or made for another "
                                  "deployment's store)")
        if record.revoked:
            raise Unauthenticated(f"the API key {keys.prefix_of(key_id)} was revoked")
        tenant: Tenant | None = await self._read(f"tenant:{record.tenant}", self._store.tenant,
                                                 record.tenant)
        if tenant is None:
            raise Unauthenticated(f"the tenant of key {keys.prefix_of(key_id)} no longer "
                                  "exists")
        return Principal(key_id, record.role, tenant, self.plan(tenant.plan))

    def plan(self, name: str) -> Plan:
        plan = self._plans.get(name)
        if plan is not None:
            return plan
        if name not in self._unknown_plans:
            self._unknown_plans.add(name)
            log.warning("tenancy: plan %r is in no plans file; its tenants get plan 'free'",
                        name)
        return BUILTIN["free"]

    async def _read(self, cache_key: str, read: Callable[[str], _T], arg: str) -> _T:
        now = self._clock()
        cached = self._cache.get(cache_key)
        if cached is not None and cached.until > now:
            return cached.value  # type: ignore[return-value]
        try:
            value = await asyncio.to_thread(read, arg)
        except TenancyStoreUnavailable as exc:
            if not self._store_down:
                self._store_down = True
                log.warning("tenancy: the store cannot be read (%s); using what was read "
                            "last", exc)
            if cached is None:
                raise
            return cached.value  # type: ignore[return-value]
        self._store_down = False
        if len(self._cache) > 100_000:  # bounded: a flood of unknown key ids
            self._cache.clear()
        self._cache[cache_key] = _Cached(value, now + self._ttl_s)
        return value
