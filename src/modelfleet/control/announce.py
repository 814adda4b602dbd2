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


def announcement(worker_id: str, at: float, ready: bool, state: ControlState,
                 resident: Versions, failed: Versions,
                 pinned: Versions | None = None) -> dict[str, Any]:
    return {"kind": WORKER_CONTROL, "worker_id": worker_id, "at": at, "ready": ready,
            "control": state.wire(),
            "resident": {m: sorted(vs) for m, vs in resident.items() if vs},
            "failed": {m: sorted(vs) for m, vs in failed.items() if vs},
            "pinned": {m: sorted(vs) for m, vs in (pinned or {}).items() if vs}}


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
