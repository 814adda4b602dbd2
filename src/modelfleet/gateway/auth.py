"""Who may call what at the gateway: one ASGI layer in front of every route.

Each request's path is classified (``classify``), so routes added anywhere in the app
are covered without their authors doing anything:

    open       /livez /readyz /v2/health/*, and the signed /v1/payloads/* URLs
    model      /v1/models/{m}..., /v2/models/{m}...: a key whose tenant may use m
               (owner, grant, or admin); others get the same 404 as a missing model.
               Inference there is admitted by the tenant's plan (429 + Retry-After),
               and metered (usage, per tenant, model and hour: the handler writes
               the row from the outcome it holds, gateway/exchange.py)
    catalog    GET /v1/models, GET /v2/models/stats: any key; the list shows only the
               models it may use
    control    /v2/repository/models/{m}/*: the operator role, on its own tenant's
               models (another tenant's model is the same 404 as a missing one); admin:
               any model. A load of a model that does not exist yet goes through where
               the key may publish it (the route publishes its files, or says 404)
    publish    PUT /v1/models/{m}/package: the operator role, on models its tenant may
               publish (``Principal.may_publish``; else the same 404); admin: any
    index      POST /v2/repository/index: the operator role; the index shows only its
               tenant's models (admin: all)
    admin      /v1/fleet*, /dashboard*: fleet-wide, every tenant's models in view
    operator   the rest of /v2/repository, /metrics (if configured)
    any key    everything else (docs, /v2 server metadata, unknown paths)

401 for no key or a bad one (``WWW-Authenticate: Bearer``, and Basic so that a browser
asks for the key as a user name), 403 for a role too low,
503 when the key store was never readable. The key is never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelfleet import metrics
from modelfleet.errors import ModelfleetError, ModelNotFound
from modelfleet.gateway.http import error_response, load_failed
from modelfleet.repository import Catalog
from modelfleet.settings import Settings
from modelfleet.tenancy import Forbidden, RateLimited, TenancyStoreError, Unauthenticated
from modelfleet.tenancy.access import CALLER, Principal
from modelfleet.tenancy.identity import Authenticator
from modelfleet.tenancy.keys import Role
from modelfleet.tenancy.limits import Limits, open_limits
from modelfleet.tenancy.plans import load_plans
from modelfleet.tenancy.store import TenantStore, open_store, store_location
from modelfleet.tenancy.usage import UsageMeter, outcome_of

log = logging.getLogger("modelfleet.gateway")

Kind = Literal["open", "model", "catalog", "control", "publish", "index", "admin",
               "operator", "key"]
_MODEL_PATH = re.compile(r"^/v[12]/models/([^/]+)(/.*)?$")
_CONTROL_PATH = re.compile(r"^/v2/repository/models/([^/]+)(/.*)?$")
_OPEN = frozenset({"/livez", "/readyz", "/v2/health/live", "/v2/health/ready"})
_ADMIN_PREFIXES = ("/v1/fleet", "/dashboard")
_ROLE_NEEDED: dict[str, Role] = {"operator": "operator", "index": "operator",
                                 "control": "operator", "publish": "operator",
                                 "admin": "admin"}


@dataclass(frozen=True)
class Route:
    kind: Kind
    model: str = ""
    infer: bool = False
    load: bool = False  # a control route's load: it may publish the model's first version


def classify(method: str, path: str, protect_metrics: bool = False) -> Route:
    """What a request for ``path`` needs (see the module docstring)."""
    path = path.rstrip("/") or "/"
    if path in _OPEN or path.startswith(("/v1/payloads/", "/v2/health/")):
        return Route("open")
    if path == "/metrics":
        return Route("operator" if protect_metrics else "open")
    if path.startswith(_ADMIN_PREFIXES):
        return Route("admin")
    control = _CONTROL_PATH.match(path)
    if control:
        return Route("control", control.group(1), load=control.group(2) == "/load")
    if path == "/v2/repository/index":
        return Route("index")
    if path.startswith("/v2/repository"):
        return Route("operator")
    if (path, method) in (("/v1/models", "GET"), ("/v2/models/stats", "GET")):
        return Route("catalog")
    match = _MODEL_PATH.match(path)
    if match and method == "PUT" and match.group(2) == "/package" and path.startswith("/v1/"):
        return Route("publish", match.group(1))
    if match:
        rest = match.group(2) or ""
        return Route("model", match.group(1), infer=method == "POST"
                     and rest.endswith("/infer"))
    return Route("key")


class _TenantLabels:
    """The tenant label value: itself for the first ``limit`` tenants, else "(other)"."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self._seen:
            return tenant
        if len(self._seen) < self._limit:
            self._seen.add(tenant)
            return tenant
        return "(other)"


class TenantGate:
    """The parts the auth layer asks: identity, limits, usage, model ownership."""

    def __init__(self, authenticator: Authenticator, limits: Limits, meter: UsageMeter,
                 owner_of: Callable[[str], str | None], protect_metrics: bool,
                 lease_s: float, tenant_labels: int) -> None:
        self.authenticator = authenticator
        self.limits = limits
        self.meter = meter
        self.owner_of = owner_of
        self.protect_metrics = protect_metrics
        self.lease_s = lease_s
        self.label = _TenantLabels(tenant_labels)


def _owner_lookup(catalog: Catalog) -> Callable[[str], str | None]:
    def owner(model: str) -> str | None:
        try:
            return catalog.get(model).manifest.tenant
        except ModelNotFound:
            return None

    return owner


def auth_enabled(settings: Settings, embedded: bool) -> bool:
    """``tenancy.auth``; ``auto`` is on for a gateway, and for ``serve`` unless it
    listens on loopback only (one machine's own users: see README, "Auth")."""
    mode = settings.tenancy.auth
    if mode != "auto":
        return mode == "on"
    host = settings.gateway.host
    loopback = host == "localhost" or host.startswith("127.") or host == "::1"
    return not (embedded and loopback)


@contextlib.asynccontextmanager
async def tenant_gate(settings: Settings, catalog: Catalog, embedded: bool
                      ) -> AsyncIterator[TenantGate | None]:
    """The gate for this gateway (None when auth is off), its usage flushed on exit.

    ``embedded`` (``serve``): limits are kept in this process (it is the only gateway).
    """
    tenancy = settings.tenancy
    if not auth_enabled(settings, embedded):
        log.warning("auth is OFF: anyone who reaches http://%s:%d may call every model "
                    "and the operator routes (tenancy.auth=%s%s)", settings.gateway.host,
                    settings.gateway.port, tenancy.auth,
                    "; serve on loopback" if tenancy.auth == "auto" else "")
        yield None
        return
    plans = load_plans(tenancy.plans_file)
    store: TenantStore = open_store(store_location(tenancy.db, settings.state_dir))
    try:
        if not await asyncio.to_thread(store.keys):
            log.warning("auth on and no API key exists yet: make one with 'modelfleet keys "
                        "create --tenant NAME [--role admin] --db %s'", store.location)
        limits = open_limits("memory" if embedded else tenancy.redis_url, tenancy.redis_prefix)
        meter = UsageMeter(store, tenancy.usage_flush_s)
        lease_s = settings.gateway.max_timeout_s + settings.gateway.body_read_timeout_s
        gate = TenantGate(Authenticator(store, plans, tenancy.cache_ttl_s), limits, meter,
                          _owner_lookup(catalog), tenancy.protect_metrics, lease_s,
                          tenancy.metric_tenants_max)
        log.info("auth on: keys and usage in %s; limits %s", store.location,
                 "in this process" if embedded else "shared through Redis")
        meter.start()
        try:
            yield gate
        finally:  # after the HTTP server stopped: what was counted is written
            await meter.close()
            await limits.close()
    finally:
        store.close()


class AuthMiddleware:
    """The ASGI layer (``app.add_middleware(AuthMiddleware, gate=...)``)."""

    def __init__(self, app: ASGIApp, gate: TenantGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = classify(scope["method"], scope["path"], self.gate.protect_metrics)
        if route.kind == "open":
            await self.app(scope, receive, send)
            return
        try:
            principal = await self._admit(route, _header(scope, b"authorization"))
        except (Unauthenticated, Forbidden, ModelNotFound, TenancyStoreError) as exc:
            refusal: ModelfleetError = exc
            if isinstance(exc, ModelNotFound) and route.kind == "control" \
                    and scope["path"].rstrip("/").endswith("/load"):
                refusal = load_failed(route.model, exc)  # worded as a missing model's is
            await self._refuse(refusal, scope, receive, send)
            return
        if route.kind == "catalog" and principal.role != "admin":
            await self._filtered(scope, receive, send, lambda name: principal.may_use(
                name, self.gate.owner_of(name)))
        elif route.kind == "index" and principal.role != "admin":
            await self._filtered(scope, receive, send, lambda name: principal.may_control(
                self.gate.owner_of(name)))
        elif route.infer:
            await self._metered(route.model, principal, scope, receive, send)
        elif route.kind in ("control", "publish"):  # publishing checks who may, again
            caller = CALLER.set(principal)
            try:
                await self.app(scope, receive, send)
            finally:
                CALLER.reset(caller)
        else:
            await self.app(scope, receive, send)

    async def _admit(self, route: Route, authorization: str | None) -> Principal:
        principal = await self.gate.authenticator.principal(authorization)
        needed = _ROLE_NEEDED.get(route.kind)
        if needed is not None and not principal.has_role(needed):
            raise Forbidden(f"this route needs the {needed} role; the key has role "
                            f"'{principal.role}'")
        owner = self.gate.owner_of(route.model) if route.model else None
        if route.kind == "control" and not principal.may_control(owner) and not (
                route.load and owner is None and principal.may_publish(route.model, None)):
            # Another tenant's model looks like none at all: its name does not leak.
            raise ModelNotFound(f"no model named '{route.model}' (GET /v1/models lists them)")
        if route.kind == "publish" and not principal.may_publish(route.model, owner):
            raise ModelNotFound(f"no model named '{route.model}' (GET /v1/models lists them)")
        if route.kind == "model" and not principal.may_use(route.model, owner):
            # The catalog's own words: a model of another tenant looks like none at all.
            raise ModelNotFound(f"no model named '{route.model}' (GET /v1/models lists them)")
        return principal

    async def _refuse(self, exc: ModelfleetError, scope: Scope, receive: Receive,
                      send: Send) -> None:
        response = error_response(exc, scope.get("path", ""))  # the error's own status
        metrics.AUTH_REFUSALS.labels(str(response.status_code)).inc()
        await response(scope, receive, send)

    async def _metered(self, model: str, principal: Principal, scope: Scope,
                       receive: Receive, send: Send) -> None:
        """Admit by plan, run, and count the tenant's request by the status it got. Its
        usage row is the handler's to write (gateway/exchange.py), from the outcome it
        holds: only a refusal here, which never reaches the handler, is metered here."""
        tenant = principal.tenant.name
        label = self.gate.label(tenant)
        try:
            release = await self.gate.limits.admit(tenant, principal.plan, self.gate.lease_s)
        except RateLimited as exc:
            metrics.TENANT_REQUESTS.labels(label, "rate_limited").inc()
            if self.gate.owner_of(model) is not None:
                self.gate.meter.record(tenant, model, "rate_limited")
            await self._refuse(exc, scope, receive, send)
            return
        status = 499  # never answered: the caller went away

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        caller = CALLER.set(principal)
        try:
            await self.app(scope, receive, sending)
        finally:
            CALLER.reset(caller)
            await release()
            metrics.TENANT_REQUESTS.labels(label, outcome_of(status)).inc()

    async def _filtered(self, scope: Scope, receive: Receive, send: Send,
                        keep: Callable[[str], bool]) -> None:
        """A listing with only the models ``keep`` says yes to: the catalog
        (``{"models": [{"name": ...}]}``), the statistics (``{"model_stats": [...]}``) or
        the repository index (a list of ``{"name": ...}``)."""
        start: Message | None = None
        chunks: list[bytes] = []

        async def hold(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, hold)
        assert start is not None
        body = b"".join(chunks)
        if start["status"] == 200:
            listing: Any = json.loads(body)
            body = json.dumps(_kept(listing, keep)).encode()
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _kept(listing: Any, keep: Callable[[str], bool]) -> Any:
    """``listing`` with only the rows whose model ``keep`` says yes to."""
    def rows(items: list[Any]) -> list[Any]:
        return [row for row in items if isinstance(row, dict) and keep(str(row.get("name")))]

    if isinstance(listing, list):
        return rows(listing)
    if isinstance(listing, dict):
        return {k: rows(v) if k in ("models", "model_stats") and isinstance(v, list) else v
                for k, v in listing.items()}
    return listing


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def guarded(app: Any, gate: TenantGate | None) -> Any:
    """``app`` (a FastAPI app, not started yet) behind the auth layer, if ``gate``."""
    if gate is not None:
        app.add_middleware(AuthMiddleware, gate=gate)
    return app
