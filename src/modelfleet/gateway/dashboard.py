"""The live fleet page: ``GET /dashboard`` and the JSON it polls, ``GET /v1/fleet/summary``.

The page is three static files shipped in the package (``gateway/static/``: no build
step, no CDN): it fetches the summary every two seconds and draws the fleet, the
queues and the load-rate panel (resident models against loads per minute, per worker
and fleet-wide, storage loads and promotions from host memory apart). Its routes stay
under ``/dashboard`` and ``/v1/fleet`` so that an operator-only rule can name them.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from modelfleet.gateway.fleet_summary import FleetSummary
from modelfleet.gateway.http import NoRoute, v1_error

_MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8"}
_STATIC = resources.files("modelfleet.gateway") / "static"


def _asset(name: str) -> Response:
    suffix = name[name.rfind("."):] if "." in name else ""
    entry = _STATIC / name
    if suffix not in _MEDIA_TYPES or "/" in name or not entry.is_file():
        return v1_error(NoRoute(f"no route GET /dashboard/{name}"))
    return Response(entry.read_bytes(), media_type=_MEDIA_TYPES[suffix],
                    headers={"Cache-Control": "no-cache"})


def dashboard_router(summary: FleetSummary) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/fleet/summary")
    async def fleet_summary(worker: str | None = None) -> dict[str, Any]:
        """Workers, queues, totals and the fleet's load-rate series, as the page shows
        them; ``?worker=ID`` adds that worker's own series."""
        return await summary.get(worker)

    @router.get("/dashboard", include_in_schema=False)
    async def page() -> Response:
        return _asset("dashboard.html")

    @router.get("/dashboard/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        return _asset(name)

    return router
