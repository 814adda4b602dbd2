"""A standalone worker's HTTP endpoints: /livez, /readyz, /metrics, /state."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelfleet.worker.coordinator import Coordinator


def create_health_app(coordinator: Coordinator) -> Starlette:
    async def livez(_: Request) -> JSONResponse:
        ok = coordinator.live
        return JSONResponse({"status": "ok" if ok else "wedged"}, status_code=200 if ok else 503)

    async def readyz(_: Request) -> JSONResponse:
        if coordinator.ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "state": coordinator.state()},
                            status_code=503)

    async def state(_: Request) -> JSONResponse:
        return JSONResponse(coordinator.state())

    async def prometheus(_: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[Route("/livez", livez), Route("/readyz", readyz),
                             Route("/state", state), Route("/metrics", prometheus)])
