"""The gateway's HTTP API (FastAPI on uvicorn).

    POST /v1/models/{model}/infer      the body is the payload; answer is the result
    GET  /v1/models, /v1/models/{model} the catalog, a page at a time (gateway/pages.py)
    GET  /v1/fleet                      live workers' states
    GET  /v1/fleet/summary, /dashboard  the live fleet page and its data (gateway/dashboard.py)
    GET  /v1/payloads/{request_id}      signed, expiring: runtimes fetch large payloads
    PUT  /v1/models/{model}/package     publish a version: a tar/zip of the package
                                        (gateway/publish.py)
    GET  /livez /readyz /metrics        probes and Prometheus metrics
    /v2/...                             Open Inference Protocol v2 (gateway/oip.py)

Every /v1 error is ``{"error": {"code": ..., "message": ...}}`` with its status; every /v2
one is the protocol's ``{"error": "..."}`` (``gateway/http.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from modelfleet import __version__, metrics
from modelfleet.errors import ModelfleetError, RequestRejected
from modelfleet.gateway.body import disconnect_waiter as _disconnect_waiter
from modelfleet.gateway.body import read_body as _read_body
from modelfleet.gateway.control import control_router
from modelfleet.gateway.dashboard import dashboard_router
from modelfleet.gateway.encoding import inflate
from modelfleet.gateway.exchange import Ticket, answer_headers, exchange
from modelfleet.gateway.fleet_summary import FleetSummary
from modelfleet.gateway.http import (
    HTTPError,
    MethodNotAllowed,
    NoRoute,
    PayloadGone,
    PayloadURLRefused,
    error_response,
    v1_error,
    with_status,
)
from modelfleet.gateway.inflight import RequestGuard
from modelfleet.gateway.observe import RequestObserver
from modelfleet.gateway.oip import oip_router
from modelfleet.gateway.pages import decode_cursor, encode_cursor, page_limit
from modelfleet.gateway.publish import publish_router
from modelfleet.gateway.resolve import Outcome, timeout_header
from modelfleet.gateway.service import GatewayService
from modelfleet.labels import ModelLabels
from modelfleet.publishing.publisher import Publisher
from modelfleet.repository.manifest import CONTENT_TYPES
from modelfleet.tenancy.usage import UsageMeter

log = logging.getLogger("modelfleet.gateway")
ReadinessCheck = Callable[[], tuple[bool, str]]

_INFER_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {ctype: {"schema": {"type": "string", "format": "binary"}}
                    for ctype in CONTENT_TYPES},
    },
    "parameters": [{"name": "X-Request-Timeout", "in": "header", "required": False,
                    "schema": {"type": "number"}}],
}


def create_app(service: GatewayService, readiness: list[ReadinessCheck] | None = None,
               liveness: list[Callable[[], bool]] | None = None,
               publisher: Publisher | None = None, meter: UsageMeter | None = None
               ) -> FastAPI:
    """The app; ``meter``: with auth on, where inference usage is counted (the auth
    layer's, ``TenantGate.meter``)."""
    app = FastAPI(title="modelfleet gateway", version=__version__)
    checks = readiness or []
    alive = liveness or []
    limit = service.settings.gateway.max_body_bytes
    body_timeout_s = service.settings.gateway.body_read_timeout_s
    observer = RequestObserver(service.settings.log_format,
                               ModelLabels(service.settings.metrics_models))
    fleet_summary = FleetSummary(service.settings, service.broker, service.fleet, service.parked)
    app.include_router(dashboard_router(fleet_summary))  # /dashboard, /v1/fleet/summary

    # Errors raised outside a route's own handling: in the dialect of the path (/v1, /v2).
    @app.exception_handler(ModelfleetError)
    async def _domain_error(request: Request, exc: ModelfleetError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        error: ModelfleetError
        if exc.status_code == 404:
            error = NoRoute(f"no route {where}")
        elif exc.status_code == 405:
            error = MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}")
        else:
            error = with_status(HTTPError(str(exc.detail)), exc.status_code)
        if exc.headers:  # e.g. Allow on a 405
            error = with_status(error, error.status, exc.headers)
        return error_response(error, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return error_response(ModelfleetError(f"internal error: {type(exc).__name__}"),
                              request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(RequestRejected(str(exc.errors()[0].get("msg", "invalid request"))),
                              request.url.path)

    @app.post("/v1/models/{model}/infer", openapi_extra=_INFER_OPENAPI,
              responses={404: {}, 413: {}, 415: {}, 422: {}, 503: {}, 504: {}})
    async def infer(model: str, request: Request) -> Response:
        return await _infer(model, None, request)

    @app.post("/v1/models/{model}/versions/{version}/infer", openapi_extra=_INFER_OPENAPI,
              responses={404: {}, 413: {}, 415: {}, 422: {}, 503: {}, 504: {}})
    async def infer_version(model: str, version: str, request: Request) -> Response:
        return await _infer(model, version, request)

    async def _infer(model: str, version: str | None, request: Request) -> Response:
        async def run(guard: RequestGuard, ticket: Ticket) -> Outcome:
            # Resolved once: the version this request gets (a rollout may hold the route
            # back) is the one its task, log line, statistics and usage name.
            resolved = ticket.resolved = service.resolve(
                model, version, timeout_header(request.headers.get("x-request-timeout")),
                ticket.caller)
            with guard.reading(body_timeout_s):
                body = await _read_body(request, limit)
            ticket.bytes_in = len(body)
            # gzip or deflate, inflated under the same limit as on /v2 (a bomb is a 413).
            body = inflate(body, request.headers.get("content-encoding", ""), limit)
            content_type = request.headers.get("content-type", "").split(";")[0].strip()
            params = {k: v for k, v in request.query_params.items()}
            return await service.infer(resolved, body, content_type.lower(), params,
                                       disconnected=_disconnect_waiter(request))

        def respond(outcome: Outcome) -> Response:
            return Response(outcome.body, media_type=outcome.content_type,
                            headers=answer_headers(outcome))

        return await exchange(service, observer, model, version, "request", run, respond,
                              v1_error, lambda message: v1_error(ModelfleetError(message)),
                              meter)

    @app.get("/v1/payloads/{request_id}", include_in_schema=False)
    async def payload(request_id: str, expires: str = "", sig: str = "") -> Response:
        try:
            entry = service.payloads.fetch(request_id, expires, sig)
        except PermissionError as exc:
            metrics.PAYLOAD_FETCHES.labels("forbidden").inc()
            return v1_error(PayloadURLRefused(f"payload URL refused: {exc}"))
        if entry is None:
            metrics.PAYLOAD_FETCHES.labels("gone").inc()
            return v1_error(PayloadGone("payload already answered or expired"))
        metrics.PAYLOAD_FETCHES.labels("ok").inc()
        return Response(entry.data, media_type=entry.content_type)

    @app.get("/v1/models")
    async def list_models(limit: str | None = None, cursor: str | None = None
                          ) -> dict[str, Any]:
        """One page of the catalog, in model id order; ``next_cursor`` fetches the next
        (null after the last)."""
        entries, last = service.catalog.page(decode_cursor(cursor), page_limit(limit))
        return {"models": [_describe(entry, service.fleet.warm_on(entry.model_id))
                           for entry in entries],
                "next_cursor": encode_cursor(last)}

    @app.get("/v1/models/{model}")
    async def get_model(model: str) -> dict[str, Any]:
        return _describe(service.catalog.get(model), service.fleet.warm_on(model))

    @app.get("/v1/fleet")
    async def fleet() -> dict[str, Any]:
        return {"workers": service.fleet.workers()}

    @app.get("/livez")
    async def livez() -> JSONResponse:
        ok = service.live and all(check() for check in alive)
        return JSONResponse({"status": "ok" if ok else "wedged"}, status_code=200 if ok else 503)

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        reasons = ["shutting down"] if service.requests.draining else []
        if not service.broker.connected:
            reasons.append("broker not connected")
        for check in checks:
            ok, why = check()
            if not ok:
                reasons.append(why)
        if reasons:
            return JSONResponse({"status": "not ready", "reasons": reasons}, status_code=503,
                                headers={"Retry-After": "1"})
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        await fleet_summary.get()  # the fleet gauges, at most a second old
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    if publisher is not None:  # PUT /v1/models/{m}/package
        app.include_router(publish_router(publisher))
    # /v2/repository: load (with files: publish), unload, pin
    app.include_router(control_router(service, publisher))
    app.include_router(oip_router(service, checks, alive, observer, meter))  # /v2: OIP data plane
    return app


def _describe(entry: Any, warm_on: list[str]) -> dict[str, Any]:
    manifest = entry.manifest
    return {
        "name": manifest.name,
        "versions": [m.version for m in entry.versions],
        "latest_version": manifest.version,
        "description": manifest.description,
        "accepts": list(manifest.accepts),
        "device": manifest.device,
        "size_estimate_bytes": manifest.memory_estimate_bytes,
        "timeout_s": manifest.timeout_s,
        "batching": manifest.batching.model_dump(),
        "fanout": manifest.fanout.model_dump(),
        "warm": bool(warm_on),
        "warm_on": warm_on,
    }
