"""The values that cross the cache's API: tiers, sources, eviction actions, snapshots.

All frozen: a caller may keep them, log them or send them elsewhere without the
cache's state changing under it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Tier = Literal["device", "host"]
"""Where a model's weights live: on the accelerator ("device") or in host RAM ("host")."""

LoadSource = Literal["repository", "disk", "host"]
"""Where a load read its bytes from: the model repository (remote or local root),
the worker's local disk cache, or a host-memory copy (a promotion)."""

EvictionAction = Literal["demote", "drop"]
"""``demote``: move the weights from device to host memory (keep them warm).
``drop``: free them; the next use reloads from disk or the repository."""


@dataclass(frozen=True, slots=True)
class Eviction:
    """One action the caller must carry out, in list order, before the load it made room for.

    ``from_tier`` is where the model is now. A ``demote`` always goes device -> host.
    ``reason`` is a short human sentence for logs (not a metric label: it may vary).
    """

    model_id: str
    size_bytes: int
    action: EvictionAction
    from_tier: Tier
    reason: str


@dataclass(frozen=True, slots=True)
class Reservation:
    """A device reservation for a load in flight (between ``reserve`` and ``commit``/``release``).

    ``promotion`` is True when the model is being copied up from host memory
    (commit it with ``source="host"``); its host copy stays counted until then.
    """

    model_id: str
    size_bytes: int
    pinned: bool
    promotion: bool
    started_at_s: float


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """A consistent, immutable view of a ``ModelCache`` at ``taken_at_s`` (its clock).

    ``device_used_bytes``/``host_used_bytes`` count resident models only;
    ``device_reserved_bytes`` counts loads in flight. Invariants:
    ``device_used_bytes + device_reserved_bytes <= device_budget_bytes`` and
    ``host_used_bytes <= host_budget_bytes``.
    """

    taken_at_s: float
    device_budget_bytes: int
    host_budget_bytes: int
    device: Mapping[str, int]
    """Resident on device: model id -> bytes."""
    host: Mapping[str, int]
    """Resident in host memory: model id -> bytes (includes models being promoted)."""
    reserved: Mapping[str, Reservation]
    """Loads in flight onto the device."""
    pinned: frozenset[str]
    device_used_bytes: int
    device_reserved_bytes: int
    host_used_bytes: int
    loads_by_source: Mapping[str, int] = field(default_factory=dict)
    """Committed loads so far, by ``LoadSource`` (the health signal is their rate)."""
    demotions: int = 0
    drops: int = 0
