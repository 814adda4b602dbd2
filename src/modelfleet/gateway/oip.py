"""The Open Inference Protocol v2 (KServe V2) data plane on the gateway, beside /v1.

    GET  /v2                                    server metadata: name, version, extensions
    GET  /v2/health/live, /v2/health/ready      200, or 400 (the spec: 4xx means false)
    GET  /v2/models/{m}[/versions/{v}]          model metadata: versions, platform, tensors
    GET  /v2/models/{m}[/versions/{v}]/ready    200 when it can take v2 requests, else 400
    POST /v2/models/{m}[/versions/{v}]/infer    JSON tensors, or the binary tensor extension
    GET  /v2/models[/{m}[/versions/{v}]]/stats  the statistics extension (gateway/statistics.py)
    GET  /v2/models/{m}[/versions/{v}]/config   the model configuration extension
                                                (oip/model_config.py)

An infer request goes through ``GatewayService.infer`` like a /v1 request (held payload
for a large body, parking, deadline, cancel on hang-up, every error case): its body is
forwarded unchanged with the content type ``OIP_CONTENT_TYPE`` (and the JSON header's
length as a task parameter when binary parts follow it); the runtime decodes it against
the model's tensor signature (``modelfleet.model.tensors``). The gateway first checks
the request's JSON header against the signature, so a malformed request is refused
here before it takes a place in a queue. A body sent with ``Content-Encoding: gzip`` or
``deflate`` (tritonclient's ``request_compression_algorithm``) is inflated first, under
the body limit. The deadline is the ``timeout`` request
parameter (microseconds, as tritonclient sends it), else ``X-Request-Timeout``
(seconds), else the model's.

Outputs may ask for ``classification: k`` (the classification extension: the top k as
``"value:index[:label]"`` BYTES, labels from the output's ``labels`` file in model.toml).
A tensor parameter the server does not honour (shared memory, system or CUDA, or any
other) is a 400 naming it, never ignored.

Errors are ``{"error": "..."}``: 400 for a request the caller must change (the spec's
status for a failed request), 404 for an unknown model or version, and the /v1 status
of every other failure (413, 503 with Retry-After, 504, 500...). Paths under /v2 with no
route, and the auth layer's refusals there, answer in the same shape (gateway/http.py).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from modelfleet import __version__
from modelfleet.errors import ModelfleetError, RequestRejected
from modelfleet.gateway.body import disconnect_waiter, read_body
from modelfleet.gateway.encoding import inflate
from modelfleet.gateway.exchange import Ticket, answer_headers, exchange
from modelfleet.gateway.http import v2_error
from modelfleet.gateway.inflight import RequestGuard
from modelfleet.gateway.observe import RequestObserver
from modelfleet.gateway.resolve import Outcome, Resolved, timeout_header
from modelfleet.gateway.service import GatewayService
from modelfleet.gateway.statistics import empty_stats, model_stats
from modelfleet.oip import HEADER_LENGTH_PARAM, OIP_CONTENT_TYPE
from modelfleet.oip.codec import InferenceRequest, parse_header_length, parse_request
from modelfleet.oip.model_config import batched, model_config
from modelfleet.oip.signature import TensorSpec, check_request
from modelfleet.repository.manifest import Manifest
from modelfleet.tenancy.usage import UsageMeter

log = logging.getLogger("modelfleet.gateway")

# The extensions /v2 names, each one really served on this gateway: binary tensors,
# classification, statistics and model configuration here, the model repository
# extension by gateway/control.py. Not shared memory (its parameters are refused).
EXTENSIONS: list[str] = ["binary_tensor_data", "classification", "model_configuration",
                         "model_repository", "statistics"]
PLATFORM = "modelfleet_python"
HEADER_LENGTH = "Inference-Header-Content-Length"

ReadinessCheck = Callable[[], tuple[bool, str]]


def tensor_metadata(specs: tuple[TensorSpec, ...]) -> list[dict[str, Any]]:
    return [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in specs]


def model_metadata(manifest: Manifest, versions: list[str]) -> dict[str, Any]:
    return {"name": manifest.name, "versions": versions, "platform": PLATFORM,
            "inputs": tensor_metadata(manifest.inputs),
            "outputs": tensor_metadata(manifest.outputs)}


def deadline_request(parsed: InferenceRequest, header: float | None) -> float | None:
    """The caller's timeout in seconds: the ``timeout`` request parameter (microseconds),
    else the X-Request-Timeout header's (``header``, already in seconds)."""
    timeout_us = parsed.parameters.get("timeout")
    if timeout_us is None:
        return header
    if isinstance(timeout_us, bool) or not isinstance(timeout_us, int) or timeout_us <= 0:
        raise RequestRejected(f"the 'timeout' parameter is a positive whole number of "
                              f"microseconds, got {timeout_us!r}")
    return timeout_us / 1e6


def unready_reasons(service: GatewayService, readiness: list[ReadinessCheck]) -> list[str]:
    """Why the gateway cannot take work now (the reasons /readyz gives)."""
    reasons = ["shutting down"] if service.requests.draining else []
    if not service.broker.connected:
        reasons.append("broker not connected")
    for check in readiness:
        ok, why = check()
        if not ok:
            reasons.append(why)
    return reasons


def model_unready_reasons(service: GatewayService, readiness: list[ReadinessCheck],
                          model: str, version: str | None) -> list[str]:
    """Why ``model`` cannot take v2 requests now; ``ModelNotFound`` for no such model."""
    manifest = service.control.route_of(service.catalog.get(model), version)
    reasons = unready_reasons(service, readiness)
    if not service.control.available(model):
        reasons.append(f"model '{model}' was unloaded by an operator")
    if not manifest.has_signature:
        reasons.append(f"model '{model}' declares no tensor signature: only /v1 serves it")
    return reasons


def resolve_v2(service: GatewayService, model: str, version: str | None,
               ticket: Ticket) -> Resolved:
    """The request resolved once (``ticket.resolved``; the deadline the model's until
    the body's ``timeout`` parameter or the caller's header says otherwise), refused
    unless its version declares tensors."""
    resolved = ticket.resolved = service.resolve(model, version, None, ticket.caller)
    manifest = resolved.manifest
    if not manifest.has_signature:
        raise RequestRejected(
            f"model '{model}' declares no tensor signature ([[inputs]] and "
            f"[[outputs]] in its model.toml), so /v2 cannot decode tensors for "
            f"it: call POST /v1/models/{model}/infer")
    return resolved


async def infer_v2(service: GatewayService, ticket: Ticket, body: bytes,
                   header_length: int | None, timeout_s: Callable[[], float | None],
                   disconnected: Callable[[], Awaitable[None]] | None) -> Outcome:
    """A resolved v2 request's body checked against the model's signature, then through
    the fleet (HTTP and gRPC alike). ``timeout_s``: the caller's timeout outside the body
    (the X-Request-Timeout header, a gRPC deadline), read only when the body has none."""
    resolved = ticket.resolved
    assert resolved is not None, "resolve_v2 first"
    manifest = resolved.manifest
    parsed = parse_request(body, header_length)
    check_request(parsed, manifest.inputs, manifest.outputs, manifest.name)
    first = parsed.inputs[0].shape
    asked = deadline_request(parsed, None)
    resolved = ticket.resolved = replace(
        service.with_timeout(resolved, timeout_s() if asked is None else asked),
        batch_size=first[0] if first and batched(manifest) else 1)
    params = {} if header_length is None else {HEADER_LENGTH_PARAM: str(header_length)}
    return await service.infer(resolved, body, OIP_CONTENT_TYPE, params,
                               disconnected=disconnected)


def oip_router(service: GatewayService, readiness: list[ReadinessCheck],
               liveness: list[Callable[[], bool]], observer: RequestObserver,
               meter: UsageMeter | None = None) -> APIRouter:
    router = APIRouter(tags=["Open Inference Protocol v2"])
    limit = service.settings.gateway.max_body_bytes
    body_timeout_s = service.settings.gateway.body_read_timeout_s

    def not_ready() -> list[str]:
        return unready_reasons(service, readiness)

    @router.get("/v2")
    async def server_metadata() -> dict[str, Any]:
        return {"name": "modelfleet", "version": __version__, "extensions": list(EXTENSIONS)}

    @router.get("/v2/health/live")
    async def live() -> JSONResponse:
        ok = service.live and all(check() for check in liveness)
        return JSONResponse({"live": ok}, status_code=200 if ok else 400)

    @router.get("/v2/health/ready")
    async def ready() -> JSONResponse:
        reasons = not_ready()
        if reasons:
            return JSONResponse({"ready": False, "reasons": reasons}, status_code=400,
                                headers={"Retry-After": "1"})
        return JSONResponse({"ready": True})

    def metadata(model: str, version: str | None) -> JSONResponse:
        try:
            entry = service.catalog.get(model)
            manifest = service.control.route_of(entry, version)
        except ModelfleetError as exc:
            return v2_error(exc)
        versions = [m.version for m in entry.versions] if version is None else [version]
        return JSONResponse(model_metadata(manifest, versions))

    # Before /v2/models/{model}: "stats" is this route's, not a model's name.
    @router.get("/v2/models/stats")
    async def all_stats() -> JSONResponse:
        return JSONResponse(model_stats(service.statistics.fleet()))

    def stats(model: str, version: str | None) -> JSONResponse:
        try:
            entry = service.catalog.get(model)
            versions = [m.version for m in entry.versions] if version is None \
                else [entry.version(version).version]
        except ModelfleetError as exc:
            return v2_error(exc)
        counted = service.statistics.fleet(model, version)
        return JSONResponse(model_stats({**empty_stats(model, versions), **counted}))

    @router.get("/v2/models/{model}/stats")
    async def get_model_stats(model: str) -> JSONResponse:
        return stats(model, None)

    @router.get("/v2/models/{model}/versions/{version}/stats")
    async def get_version_stats(model: str, version: str) -> JSONResponse:
        return stats(model, version)

    def config(model: str, version: str | None) -> JSONResponse:
        try:
            entry = service.catalog.get(model)
            manifest = service.control.route_of(entry, version)
        except ModelfleetError as exc:
            return v2_error(exc)
        return JSONResponse(model_config(manifest, entry.policy))

    @router.get("/v2/models/{model}/config")
    async def get_config(model: str) -> JSONResponse:
        return config(model, None)

    @router.get("/v2/models/{model}/versions/{version}/config")
    async def get_version_config(model: str, version: str) -> JSONResponse:
        return config(model, version)

    @router.get("/v2/models/{model}")
    async def get_model(model: str) -> JSONResponse:
        return metadata(model, None)

    @router.get("/v2/models/{model}/versions/{version}")
    async def get_model_version(model: str, version: str) -> JSONResponse:
        return metadata(model, version)

    def model_ready(model: str, version: str | None) -> JSONResponse:
        try:
            reasons = model_unready_reasons(service, readiness, model, version)
        except ModelfleetError as exc:
            return v2_error(exc)
        if reasons:
            return JSONResponse({"name": model, "ready": False, "reasons": reasons},
                                status_code=400)
        return JSONResponse({"name": model, "ready": True})

    @router.get("/v2/models/{model}/ready")
    async def get_ready(model: str) -> JSONResponse:
        return model_ready(model, None)

    @router.get("/v2/models/{model}/versions/{version}/ready")
    async def get_version_ready(model: str, version: str) -> JSONResponse:
        return model_ready(model, version)

    @router.post("/v2/models/{model}/infer")
    async def infer(model: str, request: Request) -> Response:
        return await _infer(model, None, request)

    @router.post("/v2/models/{model}/versions/{version}/infer")
    async def infer_version(model: str, version: str, request: Request) -> Response:
        return await _infer(model, version, request)

    async def _infer(model: str, version: str | None, request: Request) -> Response:
        async def run(guard: RequestGuard, ticket: Ticket) -> Outcome:
            header_length = parse_header_length(request.headers.get(HEADER_LENGTH))
            resolve_v2(service, model, version, ticket)
            with guard.reading(body_timeout_s):
                body = await read_body(request, limit)
            ticket.bytes_in = len(body)
            body = inflate(body, request.headers.get("content-encoding", ""), limit)
            return await infer_v2(
                service, ticket, body, header_length,
                lambda: timeout_header(request.headers.get("x-request-timeout")),
                disconnect_waiter(request))

        def respond(outcome: Outcome) -> Response:
            headers = answer_headers(outcome)
            if outcome.header_length is None:
                return Response(outcome.body, media_type="application/json", headers=headers)
            headers[HEADER_LENGTH] = str(outcome.header_length)
            return Response(outcome.body, media_type="application/octet-stream",
                            headers=headers)

        return await exchange(service, observer, model, version, "v2 request", run, respond,
                              v2_error, lambda message: v2_error(ModelfleetError(message)),
                              meter)

    return router
