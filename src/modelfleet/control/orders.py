"""Operators' orders kept in the deployment's database, so that they outlive the fleet.

Without it the orders (``ControlState``) live only in the gateways' and workers'
memory and are lost when all of them restart at once. A gateway writes each order it
gives here (``put``: per model and field, the newest wins, as in ``ControlState``, so
several gateways may share one database and a superseded order is overwritten), and
reads them all back at start-up (``wire``) before it announces them to the fleet.

The database is the one the tenants' store and the dead-letter archive use
(``tenancy.db``, else ``$MODELFLEET_DLQ_DB``, else ``~/.cache/modelfleet/dlq.sqlite3``;
SQLite or PostgreSQL), opened through ``modelfleet.database``; the table
``modelfleet_control_orders`` is created on open. Values are stored as JSON. Methods
are synchronous and thread-safe; async callers run them in a thread. Driver errors
become ``OrderStoreError`` / ``OrderStoreUnavailable`` here, once.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from modelfleet.control.state import FIELDS, ControlState
from modelfleet.database import Names, open_database
from modelfleet.errors import ModelfleetError

TABLE = "modelfleet_control_orders"
_SCHEMA = f"""CREATE TABLE IF NOT EXISTS {TABLE} (
  model TEXT NOT NULL, field TEXT NOT NULL, value TEXT NOT NULL,
  at DOUBLE PRECISION NOT NULL, origin TEXT NOT NULL, PRIMARY KEY (model, field))"""
# Last writer wins, like ControlState.set: an older order never overwrites a newer one.
_PUT = (f"INSERT INTO {TABLE} (model, field, value, at, origin) VALUES (?, ?, ?, ?, ?) "
        "ON CONFLICT (model, field) DO UPDATE SET value = excluded.value, "
        "at = excluded.at, origin = excluded.origin "
        f"WHERE excluded.at > {TABLE}.at OR "
        f"(excluded.at = {TABLE}.at AND excluded.origin > {TABLE}.origin)")


class OrderStoreError(ModelfleetError):
    """The control orders' database failed a query; the message names it."""

    code = "order_store_error"


class OrderStoreUnavailable(OrderStoreError):
    """The control orders' database cannot be opened or reached."""

    code = "order_store_unavailable"
    status = 503
    retry_after_s = 1


class OrderBook(Protocol):
    """Where a gateway keeps the orders it gave (``OrderStore``)."""

    @property
    def location(self) -> str: ...

    def put(self, model_id: str, state: ControlState) -> None:
        """Keep every order ``state`` holds for ``model_id`` (unless a newer one is kept)."""
        ...

    def wire(self) -> dict[str, dict[str, list[Any]]]:
        """Every order kept, as ``ControlState.wire()`` shapes them (for ``merge``)."""
        ...


class OrderStore:
    def __init__(self, location: str) -> None:
        self._db = open_database(location, Names(
            "the control orders' database", OrderStoreError, OrderStoreUnavailable,
            "tenancy.db, $MODELFLEET_DLQ_DB, state_dir"))
        self._q = self._db.mark
        self._db.create([_SCHEMA], "create the control orders' table")

    @property
    def location(self) -> str:
        return self._db.where

    def close(self) -> None:
        self._db.close()

    def put(self, model_id: str, state: ControlState) -> None:
        rows = [(model_id, field, json.dumps(value), revision.at, revision.origin)
                for field, (value, revision) in state.orders_of(model_id).items()]
        if rows:
            with self._db.run(f"keep the orders for {model_id}") as db:
                db.cursor().executemany(_PUT.replace("?", self._q), rows)

    def wire(self) -> dict[str, dict[str, list[Any]]]:
        with self._db.run("read the control orders") as db:
            rows = db.execute(f"SELECT model, field, value, at, origin FROM {TABLE}").fetchall()
        orders: dict[str, dict[str, list[Any]]] = {}
        for model_id, field, value, at, origin in rows:
            if field in FIELDS:  # a newer release's field: not ours to apply
                orders.setdefault(model_id, {})[field] = [_value(value), float(at), origin]
        return orders


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None  # ControlState.merge skips what is not well formed
