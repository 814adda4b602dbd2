"""Request-rate and concurrency limits per tenant, from its plan.

Rate: GCRA (a token bucket kept as one timestamp, the "theoretical arrival time"):
``burst`` requests at once, then ``requests_per_s`` sustained. Concurrency: the
tenant's requests in flight, each a lease that ends when its answer is written (or,
for a gateway that died holding it, when the lease runs out).

``RedisLimits``: both in one Lua script per admission, on Redis's own clock, so every
gateway that shares the Redis sees the same bucket and the same leases (one round trip
a request). ``LocalLimits``: the same rules in this process, for ``serve`` (the only
gateway there) and while Redis cannot be reached (then each gateway limits alone, and
says so in its log, once per outage).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from modelfleet.tenancy import RateLimited
from modelfleet.tenancy.plans import Plan

log = logging.getLogger("modelfleet.tenancy")
Release = Callable[[], Awaitable[None]]


class Limits(Protocol):
    async def admit(self, tenant: str, plan: Plan, lease_s: float) -> Release:
        """Admit one request of ``tenant`` (RateLimited if its plan allows none now); the
        returned function ends its concurrency lease, at the latest ``lease_s`` from now."""
        ...

    async def close(self) -> None: ...


def _refused(tenant: str, plan: Plan, why: int, retry_ms: float) -> RateLimited:
    retry_s = max(1, math.ceil(retry_ms / 1000))
    if why == 2:
        return RateLimited(f"tenant '{tenant}' has {plan.max_concurrent} requests in flight, "
                           f"the most its plan '{plan.name}' allows; retry after {retry_s}s",
                           retry_s)
    return RateLimited(f"tenant '{tenant}' is over its plan '{plan.name}' rate of "
                       f"{plan.requests_per_s:g} requests/s (burst {plan.burst}); retry "
                       f"after {retry_s}s", retry_s)


class LocalLimits:
    """The rules in this process only. ``clock`` returns seconds (monotonic)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tat_ms: dict[str, float] = {}
        self._leases: dict[str, dict[str, float]] = {}

    def check(self, tenant: str, plan: Plan, lease_s: float) -> str:
        """Admit, returning the lease id, or raise RateLimited. Synchronous, atomic."""
        now_ms = self._clock() * 1000
        leases = self._leases.setdefault(tenant, {})
        for lease, expiry in list(leases.items()):
            if expiry <= now_ms:
                del leases[lease]
        if plan.max_concurrent and len(leases) >= plan.max_concurrent:
            raise _refused(tenant, plan, 2, 1000)
        if plan.requests_per_s:
            emission_ms = 1000 / plan.requests_per_s
            tat = max(self._tat_ms.get(tenant, now_ms), now_ms) + emission_ms
            allow_at = tat - emission_ms * plan.burst
            if allow_at > now_ms:
                raise _refused(tenant, plan, 1, allow_at - now_ms)
            self._tat_ms[tenant] = tat
        lease = uuid.uuid4().hex
        if plan.max_concurrent:  # (at most max_concurrent are held: pruning stays cheap)
            leases[lease] = now_ms + lease_s * 1000
        return lease

    async def admit(self, tenant: str, plan: Plan, lease_s: float) -> Release:
        lease = self.check(tenant, plan, lease_s)

        async def release() -> None:
            self._leases.get(tenant, {}).pop(lease, None)

        return release

    async def close(self) -> None:
        return None


# KEYS: rate key, leases key. ARGV: emission ms, burst, max concurrent, lease ms, lease id.
# Returns {1, 0, 0} admitted; {0, retry ms, why} refused (why: 1 rate, 2 concurrency).
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local emission, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local most, lease_ms = tonumber(ARGV[3]), tonumber(ARGV[4])
if most > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= most then return {0, 1000, 2} end
end
local tat = nil
if emission > 0 then
  tat = math.max(tonumber(redis.call('GET', KEYS[1]) or now), now) + emission
  local allow_at = tat - emission * burst
  if allow_at > now then return {0, math.ceil(allow_at - now), 1} end
  redis.call('SET', KEYS[1], tostring(tat), 'PX', math.ceil(tat - now) + 1000)
end
if most > 0 then
  redis.call('ZADD', KEYS[2], now + lease_ms, ARGV[5])
  redis.call('PEXPIRE', KEYS[2], lease_ms + 1000)
end
return {1, 0, 0}
"""


class RedisLimits:
    """The rules on a Redis shared by every gateway; ``LocalLimits`` while it is down."""

    def __init__(self, url: str, prefix: str, client: Any = None) -> None:
        import redis.asyncio as aioredis

        self._errors: tuple[type[Exception], ...] = (aioredis.RedisError, OSError)
        self._redis = client or aioredis.Redis.from_url(url, socket_timeout=1,
                                                        socket_connect_timeout=1)
        self._admit = self._redis.register_script(_ADMIT)
        self._prefix = prefix
        self._fallback = LocalLimits()
        self._down = False

    async def admit(self, tenant: str, plan: Plan, lease_s: float) -> Release:
        lease = uuid.uuid4().hex
        rate_key = f"{self._prefix}rate:{tenant}"
        leases_key = f"{self._prefix}inflight:{tenant}"
        emission_ms = 1000 / plan.requests_per_s if plan.requests_per_s else 0
        try:
            admitted, retry_ms, why = await self._admit(
                keys=[rate_key, leases_key],
                args=[emission_ms, plan.burst, plan.max_concurrent, int(lease_s * 1000), lease])
        except self._errors as exc:
            if not self._down:
                self._down = True
                log.warning("limits: Redis unreachable (%s); each gateway limits tenants "
                            "alone until it is back", type(exc).__name__)
            return await self._fallback.admit(tenant, plan, lease_s)
        if self._down:
            self._down = False
            log.info("limits: Redis reachable again; limits are shared again")
        if not admitted:
            raise _refused(tenant, plan, int(why), float(retry_ms))

        async def release() -> None:
            if plan.max_concurrent:
                try:
                    await self._redis.zrem(leases_key, lease)
                except self._errors:
                    pass  # the lease runs out by itself

        return release

    async def close(self) -> None:
        await self._redis.aclose()


def open_limits(redis_url: str, prefix: str) -> Limits:
    """``memory``: this process only; else a Redis URL."""
    if redis_url in ("", "memory"):
        return LocalLimits()
    return RedisLimits(redis_url, prefix)
