"""A worker's re-announcement: its copy of the orders, and the versions it holds.

``{"kind": "worker_control", "worker_id", "at", "ready", "control": ControlState.wire(),
"resident": {model: [versions]}, "failed": {model: [versions]}, "pinned": {model:
[versions]}}``, published every ``control.announce_interval_s`` by each worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from modelfleet.control.state import ControlState
from modelfleet.control.versions import Holdings, Versions

WORKER_CONTROL = "worker_control"
# A gateway's copy of the orders, told to the fleet at its start-up and whenever a
# worker's announcement lacks one: ``{"kind": "control_orders", "origin", "control"}``.
CONTROL_ORDERS = "control_orders"


def announcement(worker_id: str, at: float, ready: bool, state: ControlState,
                 resident: Versions, failed: Versions,
                 pinned: Versions | None = None) -> dict[str, Any]:
    return {"kind": WORKER_CONTROL, "worker_id": worker_id, "at": at, "ready": ready,
            "control": state.wire(),
            "resident": {m: sorted(vs) for m, vs in resident.items() if vs},
            "failed": {m: sorted(vs) for m, vs in failed.items() if vs},
            "pinned": {m: sorted(vs) for m, vs in (pinned or {}).items() if vs}}


def orders_announcement(origin: str, state: ControlState) -> dict[str, Any]:
    return {"kind": CONTROL_ORDERS, "origin": origin, "control": state.wire()}


def holdings_of(event: Mapping[str, Any]) -> Holdings | None:
    """The holdings a ``worker_control`` event announces; None if it is not one."""
    worker_id = event.get("worker_id")
    if event.get("kind") != WORKER_CONTROL or not isinstance(worker_id, str) or not worker_id:
        return None
    return Holdings(worker_id, _versions(event.get("resident")), _versions(event.get("failed")),
                    _versions(event.get("pinned")))


def _versions(value: object) -> dict[str, frozenset[str]]:
    if not isinstance(value, Mapping):
        return {}
    return {m: frozenset(v for v in vs if isinstance(v, str))
            for m, vs in value.items() if isinstance(m, str) and isinstance(vs, list)}
