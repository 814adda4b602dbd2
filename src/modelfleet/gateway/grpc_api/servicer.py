"""``inference.GRPCInferenceService`` on the gateway: the Open Inference Protocol over gRPC.

Each RPC goes through what its HTTP route uses, so both dialects answer alike:

- ServerLive, ServerReady: the gateway's liveness and readiness (as /v2/health/*);
- ServerMetadata, ModelMetadata, ModelReady: gateway/oip.py's metadata;
- ModelInfer: ``oip.infer_v2`` through ``GatewayService.infer`` (parking, the deadline:
  the call's own gRPC deadline or the ``timeout`` parameter, cancel when the caller
  goes, every error case), counted and logged like an HTTP request;
- ModelStatistics: the fleet-wide statistics (gateway/statistics.py);
- ModelConfig: oip/model_config.py;
- RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload: the control plane, as
  /v2/repository (``control.run_load``: a load's ``file:`` parameters, bytes here,
  publish a package first, where the gateway publishes).

With auth on, the API key travels in the ``authorization`` metadata (``Bearer <key>``),
as on HTTP: health is open, a model's RPCs need a key that may use the model (another
tenant's model is NOT_FOUND, like a missing one), the repository RPCs the operator role;
inference is admitted by the tenant's plan limits and metered; an operator acts on its
own tenant's models only (the index lists them alone), an administrator on all. A modelfleet error
becomes the gRPC status its HTTP status maps to (``grpc_status``), with its message; but
a load whose files make no package is INTERNAL, as Triton answers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import json_format

from modelfleet import __version__, metrics
from modelfleet.errors import ModelfleetError, ModelNotFound
from modelfleet.gateway.auth import TenantGate
from modelfleet.gateway.control import run_load
from modelfleet.gateway.exchange import Ticket, record_exchange
from modelfleet.gateway.grpc_api import inference_pb2 as pb
from modelfleet.gateway.grpc_api.tensors import parameter_value, request_body, response_message
from modelfleet.gateway.http import load_failed, v2_message, v2_status
from modelfleet.gateway.observe import RequestObserver
from modelfleet.gateway.oip import (
    EXTENSIONS,
    infer_v2,
    model_metadata,
    model_unready_reasons,
    resolve_v2,
    unready_reasons,
)
from modelfleet.gateway.service import GatewayService
from modelfleet.gateway.statistics import empty_stats, model_stats
from modelfleet.oip.model_config import model_config
from modelfleet.publishing.publisher import Publisher
from modelfleet.tenancy import Forbidden
from modelfleet.tenancy.access import CALLER, Principal
from modelfleet.tenancy.usage import outcome_of

SERVICE = "inference.GRPCInferenceService"
ReadinessCheck = Callable[[], tuple[bool, str]]

_GRPC_BY_HTTP = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                 403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
                 408: grpc.StatusCode.DEADLINE_EXCEEDED,
                 413: grpc.StatusCode.RESOURCE_EXHAUSTED, 415: grpc.StatusCode.INVALID_ARGUMENT,
                 422: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                 499: grpc.StatusCode.CANCELLED, 503: grpc.StatusCode.UNAVAILABLE,
                 504: grpc.StatusCode.DEADLINE_EXCEEDED, 507: grpc.StatusCode.RESOURCE_EXHAUSTED}


def grpc_status(error: ModelfleetError) -> grpc.StatusCode:
    """The gRPC dialect's status of ``error``: the code of the status /v2 gives it, but
    for a load's files that make no package: INTERNAL, as Triton answers it
    (errors.PackageNotPolled)."""
    if error.code == "package_not_polled":
        return grpc.StatusCode.INTERNAL
    return _GRPC_BY_HTTP.get(v2_status(error), grpc.StatusCode.INTERNAL)


class InferenceServicer:
    def __init__(self, service: GatewayService, readiness: list[ReadinessCheck],
                 liveness: list[Callable[[], bool]], gate: TenantGate | None,
                 publisher: Publisher | None = None) -> None:
        self._service = service
        self._publisher = publisher
        self._readiness = readiness
        self._liveness = liveness
        self._gate = gate
        self._observer = RequestObserver(service.settings.log_format)

    # -- access --------------------------------------------------------------------
    async def _principal(self, context: grpc.aio.ServicerContext) -> Principal | None:
        if self._gate is None:
            return None
        metadata = dict(context.invocation_metadata() or ())
        value = metadata.get("authorization")
        return await self._gate.authenticator.principal(
            value if isinstance(value, str) else None)

    async def _operator(self, context: grpc.aio.ServicerContext) -> Principal | None:
        principal = await self._principal(context)
        if principal is not None and not principal.has_role("operator"):
            raise Forbidden(f"this call needs the operator role; the key has role "
                            f"'{principal.role}'")
        return principal

    async def _control(self, context: grpc.aio.ServicerContext, model: str
                       ) -> Principal | None:
        """The operator role, on its own tenant's models (admin: any)."""
        principal = await self._operator(context)
        if principal is not None and self._gate is not None and \
                not principal.may_control(self._gate.owner_of(model)):
            raise ModelNotFound(f"no model named '{model}' (GET /v1/models lists them)")
        return principal

    async def _model(self, context: grpc.aio.ServicerContext, model: str) -> Principal | None:
        principal = await self._principal(context)
        if principal is not None and self._gate is not None and \
                not principal.may_use(model, self._gate.owner_of(model)):
            raise ModelNotFound(f"no model named '{model}' (GET /v1/models lists them)")
        return principal

    # -- health and metadata -------------------------------------------------------
    async def server_live(self, _: pb.ServerLiveRequest, __: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self._service.live
                                     and all(check() for check in self._liveness))

    async def server_ready(self, _: pb.ServerReadyRequest, __: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=not unready_reasons(self._service,
                                                                self._readiness))

    async def server_metadata(self, _: pb.ServerMetadataRequest, context: Any
                              ) -> pb.ServerMetadataResponse:
        await self._principal(context)
        return pb.ServerMetadataResponse(name="modelfleet", version=__version__,
                                         extensions=EXTENSIONS)

    async def model_metadata(self, request: pb.ModelMetadataRequest, context: Any
                             ) -> pb.ModelMetadataResponse:
        await self._model(context, request.name)
        version = request.version or None
        entry = self._service.catalog.get(request.name)
        manifest = self._service.control.route_of(entry, version)
        versions = [m.version for m in entry.versions] if version is None else [version]
        response = pb.ModelMetadataResponse()
        json_format.ParseDict(model_metadata(manifest, versions), response)
        return response

    async def model_ready(self, request: pb.ModelReadyRequest, context: Any
                          ) -> pb.ModelReadyResponse:
        await self._model(context, request.name)
        try:
            reasons = model_unready_reasons(self._service, self._readiness, request.name,
                                            request.version or None)
        except ModelNotFound:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=not reasons)

    async def model_config(self, request: pb.ModelConfigRequest, context: Any
                           ) -> pb.ModelConfigResponse:
        await self._model(context, request.name)
        entry = self._service.catalog.get(request.name)
        manifest = self._service.control.route_of(entry, request.version or None)
        config = pb.ModelConfig()
        json_format.ParseDict(model_config(manifest, entry.policy), config,
                              ignore_unknown_fields=True)
        return pb.ModelConfigResponse(config=config)

    async def model_statistics(self, request: pb.ModelStatisticsRequest, context: Any
                               ) -> pb.ModelStatisticsResponse:
        if not request.name:
            principal = await self._principal(context)
            counted = self._service.statistics.fleet()
            if principal is not None and self._gate is not None:
                owner_of = self._gate.owner_of
                counted = {k: v for k, v in counted.items()
                           if principal.may_use(k[0], owner_of(k[0]))}
            body = model_stats(counted)
        else:
            await self._model(context, request.name)
            entry = self._service.catalog.get(request.name)
            version = request.version or None
            versions = [m.version for m in entry.versions] if version is None \
                else [entry.version(version).version]
            body = model_stats({**empty_stats(request.name, versions),
                                **self._service.statistics.fleet(request.name, version)})
        for one in body["model_stats"]:
            one.pop("memory_usage", None)
        response = pb.ModelStatisticsResponse()
        json_format.ParseDict(body, response, ignore_unknown_fields=True)
        return response

    # -- the model repository --------------------------------------------------------
    async def repository_index(self, request: pb.RepositoryIndexRequest, context: Any
                               ) -> pb.RepositoryIndexResponse:
        principal = await self._operator(context)
        # The whole index: the protocol has no paging fields (HTTP pages it: gateway/pages.py).
        rows, _ = self._service.control.index(ready_only=request.ready)
        if principal is not None and self._gate is not None:
            owner_of = self._gate.owner_of
            rows = [row for row in rows if principal.may_control(owner_of(row["name"]))]
        return pb.RepositoryIndexResponse(models=[
            pb.RepositoryIndexResponse.ModelIndex(
                name=row["name"], version=str(row.get("version", "")),
                state=str(row.get("state", "")), reason=str(row.get("reason", "")))
            for row in rows])

    async def repository_model_load(self, request: pb.RepositoryModelLoadRequest,
                                    context: Any) -> pb.RepositoryModelLoadResponse:
        model = request.model_name
        principal = await self._operator(context)
        if principal is not None and self._gate is not None:
            # As on HTTP (gateway/auth.py): its own tenant's models, or a new one the key
            # may publish (the load's files do, or it is not found).
            owner = self._gate.owner_of(model)
            if not principal.may_control(owner) and not (
                    owner is None and principal.may_publish(model, None)):
                raise load_failed(model, ModelNotFound(
                    f"no model named '{model}' (GET /v1/models lists them)"))
        token = CALLER.set(principal)  # the publisher checks the package's tenant by it
        try:
            await self._load(request)
        except ModelfleetError as exc:
            raise load_failed(model, exc) from None
        finally:
            CALLER.reset(token)
        return pb.RepositoryModelLoadResponse()

    async def _load(self, request: pb.RepositoryModelLoadRequest) -> None:
        params = {name: parameter_value(value) for name, value in request.parameters.items()}
        if isinstance(params.get("config"), bytes):
            params["config"] = params["config"].decode("utf-8", "replace")
        await run_load(self._service, self._publisher, request.model_name, params)

    async def repository_model_unload(self, request: pb.RepositoryModelUnloadRequest,
                                      context: Any) -> pb.RepositoryModelUnloadResponse:
        await self._control(context, request.model_name)
        await self._service.control.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # -- inference -----------------------------------------------------------------
    async def model_infer(self, request: pb.ModelInferRequest,
                          context: grpc.aio.ServicerContext) -> pb.ModelInferResponse:
        service, model = self._service, request.model_name
        version = request.model_version or None
        started = time.perf_counter()
        status, code = 500, "internal_error"
        ticket = Ticket(None)
        try:
            principal = ticket.caller = await self._model(context, model)
            async with self._admitted(principal, model) as seen:
                async with service.requests.track():
                    resolve_v2(service, model, version, ticket)  # resolved once
                    body, header_length = request_body(request)
                    seen.bytes_in = len(body)
                    left = context.time_remaining()  # the call's own deadline, if any
                    outcome = await infer_v2(
                        service, ticket, body, header_length,
                        lambda: None if left is None else max(left, 0.001),
                        _hang_up(context))
                ticket.reply = outcome.reply
                failure = outcome.error
                if failure is not None:
                    raise failure
                status, code = 200, "ok"
                seen.status, seen.timings_ms = 200, dict(outcome.timings_ms)
                seen.bytes_out = len(outcome.body)
                return response_message(outcome.body, outcome.header_length)
        except ModelfleetError as exc:
            status, code = v2_status(exc), exc.code
            raise
        finally:
            resolved = ticket.resolved
            known = resolved is not None or model in service.catalog
            record_exchange(service, self._observer, model if known else "(unknown)",
                            resolved.version if resolved is not None else version or "",
                            status, code, ticket.reply, started,
                            resolved.batch_size if resolved is not None else 1,
                            resolved.request_id if resolved is not None else "")

    @contextlib.asynccontextmanager
    async def _admitted(self, principal: Principal | None, model: str) -> Any:
        """The tenant's plan limits around one inference, and its usage counted after."""
        seen = _Usage()
        if principal is None or self._gate is None:
            yield seen
            return
        gate, tenant = self._gate, principal.tenant.name
        label = gate.label(tenant)
        try:
            release = await gate.limits.admit(tenant, principal.plan, gate.lease_s)
        except ModelfleetError:
            metrics.TENANT_REQUESTS.labels(label, "rate_limited").inc()
            gate.meter.record(tenant, model, "rate_limited")
            raise
        token = CALLER.set(principal)
        try:
            yield seen
        except ModelfleetError as exc:
            seen.status = v2_status(exc)
            raise
        finally:
            CALLER.reset(token)
            await release()
            outcome = outcome_of(seen.status)
            metrics.TENANT_REQUESTS.labels(label, outcome).inc()
            gate.meter.record(tenant, model, outcome, seen.timings_ms.get("predict", 0) / 1000,
                              seen.timings_ms.get("model_load", 0) / 1000, seen.bytes_in,
                              seen.bytes_out)

    def handlers(self) -> grpc.GenericRpcHandler:
        """The service's methods under the protocol's name, each through ``_translated``."""
        methods: dict[str, tuple[Callable[..., Awaitable[Any]], Any, Any]] = {
            "ServerLive": (self.server_live, pb.ServerLiveRequest, pb.ServerLiveResponse),
            "ServerReady": (self.server_ready, pb.ServerReadyRequest, pb.ServerReadyResponse),
            "ServerMetadata": (self.server_metadata, pb.ServerMetadataRequest,
                               pb.ServerMetadataResponse),
            "ModelMetadata": (self.model_metadata, pb.ModelMetadataRequest,
                              pb.ModelMetadataResponse),
            "ModelReady": (self.model_ready, pb.ModelReadyRequest, pb.ModelReadyResponse),
            "ModelInfer": (self.model_infer, pb.ModelInferRequest, pb.ModelInferResponse),
            "ModelConfig": (self.model_config, pb.ModelConfigRequest, pb.ModelConfigResponse),
            "ModelStatistics": (self.model_statistics, pb.ModelStatisticsRequest,
                                pb.ModelStatisticsResponse),
            "RepositoryIndex": (self.repository_index, pb.RepositoryIndexRequest,
                                pb.RepositoryIndexResponse),
            "RepositoryModelLoad": (self.repository_model_load, pb.RepositoryModelLoadRequest,
                                    pb.RepositoryModelLoadResponse),
            "RepositoryModelUnload": (self.repository_model_unload,
                                      pb.RepositoryModelUnloadRequest,
                                      pb.RepositoryModelUnloadResponse),
        }
        return grpc.method_handlers_generic_handler(SERVICE, {
            name: grpc.unary_unary_rpc_method_handler(
                _translated(method), request_deserializer=request.FromString,
                response_serializer=response.SerializeToString)
            for name, (method, request, response) in methods.items()})


class _Usage:
    def __init__(self) -> None:
        self.status = 499  # never answered: the caller went away
        self.timings_ms: dict[str, float] = {}
        self.bytes_in = 0
        self.bytes_out = 0


def _translated(method: Callable[[Any, Any], Awaitable[Any]]
                ) -> Callable[[Any, Any], Awaitable[Any]]:
    """A modelfleet error as the gRPC status its HTTP status maps to (the one place)."""
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(request, context)
        except ModelfleetError as exc:
            await context.abort(grpc_status(exc), v2_message(exc))
    return call


def _hang_up(context: grpc.aio.ServicerContext) -> Callable[[], Awaitable[None]]:
    """An awaitable that returns when the caller cancels the call (or its deadline ends
    it): the fleet then cancels its task, as for an HTTP caller that hangs up."""
    gone = asyncio.Event()

    def done(_: object) -> None:
        if context.cancelled():
            gone.set()

    context.add_done_callback(done)

    async def wait() -> None:
        await gone.wait()

    return wait
