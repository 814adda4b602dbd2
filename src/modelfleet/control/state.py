"""Operators' orders about models (loaded or not, pinned or not, which version routes).

The control API's state lives nowhere in particular: every gateway and every worker
keeps a ``ControlState`` and they converge by gossip over the broker's events. Each
field of each model is a last-writer-wins register: an order carries the time it was
given and the gateway that took it, and the newest order wins however often and in
whatever order the copies arrive. Workers re-announce their copy every second
(``{"kind": "worker_control"}``), so a gateway or worker started after an order
learns it from the fleet. Gateways also keep the orders they give in the
deployment's database (``control.orders``), read them back at start-up and tell
them again (``{"kind": "control_orders"}``) to any worker whose announcement lacks
one, so the orders survive every worker and gateway restarting at once.

Ties (same time, same gateway) cannot happen for two different orders: a gateway
stamps its orders with a strictly increasing clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

# config: the override of the model's model.toml settings that the last load gave, as
# ``repository.overrides.ConfigOverride.to_json`` writes it ("": model.toml's own).
Field = Literal["loaded", "pinned", "version", "config"]
FIELDS: tuple[Field, ...] = get_args(Field)
_TYPES: dict[Field, type] = {"loaded": bool, "pinned": bool, "version": str, "config": str}
Watcher = Callable[[str, Field, bool | str], None]


@dataclass(frozen=True, order=True)
class Revision:
    """When an order was given, and by which gateway (the tie-break)."""

    at: float
    origin: str


@dataclass(frozen=True)
class Order:
    value: bool | str
    revision: Revision


class ControlState:
    """Per model, per field, the newest order seen."""

    def __init__(self) -> None:
        self._orders: dict[str, dict[Field, Order]] = {}
        self.revision = 0  # moves at every order taken (``control.pins`` caches by it)
        self._watchers: list[Watcher] = []

    def watch(self, watcher: Watcher) -> None:
        """Call ``watcher(model, field, value)`` with every order that changes the state
        (however it arrived: a command, a gossiped copy, the database)."""
        self._watchers.append(watcher)

    def set(self, model_id: str, field: Field, value: bool | str, revision: Revision) -> bool:
        """Take an order unless a newer one for the same field is known; True if it changed."""
        if not isinstance(value, _TYPES[field]):
            raise TypeError(f"control field {field!r} takes a {_TYPES[field].__name__}, "
                            f"got {value!r}")
        fields = self._orders.setdefault(model_id, {})
        known = fields.get(field)
        if known is not None and known.revision >= revision:
            return False
        fields[field] = Order(value, revision)
        self.revision += 1
        for watcher in self._watchers:
            watcher(model_id, field, value)
        return True

    def loaded(self, model_id: str) -> bool:
        """False after an unload, until the next load."""
        order = self._orders.get(model_id, {}).get("loaded")
        return True if order is None else bool(order.value)

    def pinned(self, model_id: str, default: bool) -> bool:
        """The last pin/unpin order, else ``default`` (the manifest's ``[fanout] pinned``)."""
        order = self._orders.get(model_id, {}).get("pinned")
        return default if order is None else bool(order.value)

    def version(self, model_id: str) -> str | None:
        """The version an operator's load put on the unversioned route, if any."""
        order = self._orders.get(model_id, {}).get("version")
        return str(order.value) if order is not None and order.value else None

    def config(self, model_id: str) -> str:
        """The override of model.toml's settings the last load gave ("": none)."""
        order = self._orders.get(model_id, {}).get("config")
        return str(order.value) if order is not None else ""

    def orders_of(self, model_id: str) -> dict[Field, tuple[bool | str, Revision]]:
        """The orders known for one model, by field (what ``control.orders`` keeps)."""
        return {field: (order.value, order.revision)
                for field, order in self._orders.get(model_id, {}).items()}

    def newer_than(self, wire: object) -> bool:
        """Does this state hold an order that the ``wire()`` copy lacks, or has older?

        A gateway asks of each worker's announcement: a worker that restarted (or
        missed an order) is told the orders again (``control_orders``).
        """
        if not self._orders:
            return False
        other = wire if isinstance(wire, Mapping) else {}
        for model_id, fields in self._orders.items():
            theirs = other.get(model_id)
            for field, order in fields.items():
                known = _parse(field, theirs.get(field)) if isinstance(theirs, Mapping) \
                    else None
                if known is None or known.revision < order.revision:
                    return True
        return False

    def models(self) -> Iterator[str]:
        return iter(sorted(self._orders))

    def wire(self) -> dict[str, dict[str, list[Any]]]:
        """The whole state as msgpack-able data: ``{model: {field: [value, at, origin]}}``."""
        return {model: {field: [order.value, order.revision.at, order.revision.origin]
                        for field, order in fields.items()}
                for model, fields in self._orders.items()}

    def merge(self, wire: object) -> list[str]:
        """Take every newer order of a ``wire()`` copy; returns the models that changed.

        Entries that are not well formed are skipped (a copy from a newer or broken
        peer must not stop this one from taking the rest).
        """
        changed: list[str] = []
        if not isinstance(wire, Mapping):
            return changed
        for model_id, fields in wire.items():
            if not isinstance(model_id, str) or not isinstance(fields, Mapping):
                continue
            for field, entry in fields.items():
                order = _parse(field, entry)
                if order is not None and self.set(model_id, field, order.value, order.revision) \
                        and model_id not in changed:
                    changed.append(model_id)
        return changed


def _parse(field: object, entry: object) -> Order | None:
    if field not in FIELDS or not isinstance(entry, list | tuple) or len(entry) != 3:
        return None
    value, at, origin = entry
    if not isinstance(value, bool | str) or not isinstance(value, _TYPES[field]) \
            or isinstance(at, bool) or not isinstance(at, int | float) \
            or not isinstance(origin, str):
        return None
    return Order(value, Revision(float(at), origin))


class RevisionClock:
    """Stamps one gateway's orders: wall-clock time, strictly increasing."""

    def __init__(self, origin: str, clock: Callable[[], float] = time.time) -> None:
        self.origin = origin
        self._clock = clock
        self._last = 0.0

    def next(self) -> Revision:
        at = max(self._clock(), self._last + 1e-6)
        self._last = at
        return Revision(at, self.origin)
