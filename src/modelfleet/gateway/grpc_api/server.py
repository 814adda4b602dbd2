"""The gateway's gRPC server: started beside HTTP when ``gateway.grpc_port`` is set."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from modelfleet.errors import ConfigError
from modelfleet.gateway.auth import TenantGate
from modelfleet.gateway.grpc_api.servicer import InferenceServicer, ReadinessCheck
from modelfleet.gateway.service import GatewayService
from modelfleet.publishing.publisher import Publisher

log = logging.getLogger("modelfleet.gateway")


@contextlib.asynccontextmanager
async def grpc_server(service: GatewayService, gate: TenantGate | None,
                      readiness: list[ReadinessCheck] | None = None,
                      liveness: list[Callable[[], bool]] | None = None,
                      publisher: Publisher | None = None) -> AsyncIterator[int | None]:
    """Serve ``inference.GRPCInferenceService`` while the block runs; yields the bound port
    (None when gRPC is off). ``publisher``: what a load's ``file:`` parameters publish
    through (HTTP's), None where the repository takes no writes. Stopped with the drain's
    grace: calls in flight finish."""
    gw = service.settings.gateway
    if gw.grpc_port is None:
        yield None
        return
    limit = gw.grpc_max_message_bytes
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                      ("grpc.max_send_message_length", limit)])
    server.add_generic_rpc_handlers((InferenceServicer(
        service, readiness or [], liveness or [], gate, publisher).handlers(),))
    host = f"[{gw.host}]" if ":" in gw.host else gw.host
    try:
        port = server.add_insecure_port(f"{host}:{gw.grpc_port}")
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen for gRPC on {host}:{gw.grpc_port}: {exc}") from exc
    await server.start()
    log.info("gRPC (Open Inference Protocol) on %s:%d", gw.host, port)
    try:
        yield port
    finally:
        await server.stop(gw.drain_timeout_s)
