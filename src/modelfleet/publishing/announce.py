"""The catalog change a publish tells the fleet, on the broker's event channel.

``{"kind": "catalog_changed", "origin", "model_id", "version"}``: every gateway and
worker that hears it (and did not publish it: ``origin`` names the process) scans its
repository at once instead of at its next ``repo_refresh_s``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CATALOG_CHANGED = "catalog_changed"


def catalog_changed(origin: str, model_id: str, version: str) -> dict[str, Any]:
    return {"kind": CATALOG_CHANGED, "origin": origin, "model_id": model_id,
            "version": version}


def is_foreign_change(event: Mapping[str, Any], origin: str) -> bool:
    """Is ``event`` a catalog change another process announced?"""
    return event.get("kind") == CATALOG_CHANGED and event.get("origin") != origin
