"""Tenants: who calls (API keys bound to a tenant and a role), what each may reach,
how much (plans: rate and concurrency limits, priority, fan-out), and what each used.

    keys.py      API keys: made, parsed, hashed (the plain key is shown once, never kept)
    plans.py     built-in plans (free, pro, enterprise) and custom ones from a TOML file
    store.py     tenants, grants, keys and usage rows in the dead-letter archive's database
    access.py    who may reach what: roles, model ownership and grants (pure)
    limits.py    request-rate and concurrency limits: Redis (shared) or in-process
    usage.py     usage counted in memory per tenant, model, hour; flushed to the store
    settings.py  the ``tenancy`` section of the settings

Errors, each with its HTTP status (``modelfleet.errors``; the gateway's renderers read it):

    ModelfleetError
    ├── Unauthenticated      401  no key, a malformed, unknown or revoked key
    ├── Forbidden            403  a valid key whose role does not reach the route
    ├── RateLimited          429  the tenant's plan allows no more now (retry_after_s)
    └── TenancyStoreError    503  the key store failed a query (Retry-After: 1)
        └── TenancyStoreUnavailable   it cannot be opened or reached
"""

from __future__ import annotations

from modelfleet.errors import ModelfleetError


class Unauthenticated(ModelfleetError):
    """No usable API key came with the request."""

    code = "unauthenticated"
    status = 401
    # Basic too: a browser then asks for the key (as user name) for /dashboard.
    http_headers = {"WWW-Authenticate": 'Bearer realm="modelfleet", Basic realm="modelfleet"'}


class Forbidden(ModelfleetError):
    """The key is valid, but its role does not reach this route."""

    code = "forbidden"
    status = 403


class RateLimited(ModelfleetError):
    """The tenant's plan allows no more requests now; retry after ``retry_after_s``."""

    code = "rate_limited"
    status = 429

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = max(1, retry_after_s)


class TenancyStoreError(ModelfleetError):
    """The tenants' store failed a query; the message names the store."""

    code = "tenancy_store_error"
    status = 503
    retry_after_s = 1


class TenancyStoreUnavailable(TenancyStoreError):
    """The tenants' store cannot be opened or reached: check the path or the server."""

    code = "tenancy_store_unavailable"
