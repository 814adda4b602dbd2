"""The model control API's shared parts: orders, commands, the version route (all pure;
``control.orders``, which keeps the orders in the deployment's database, is not, and is
imported by its users only).

The gateway (``gateway/control.py``, ``gateway/control_plane.py``) and the worker
(``worker/control.py``) both import this package and nothing of each other.
"""

from __future__ import annotations

from modelfleet.control.announce import (
    CONTROL_ORDERS,
    WORKER_CONTROL,
    announcement,
    holdings_of,
    orders_announcement,
)
from modelfleet.control.commands import Command, Result
from modelfleet.control.settings import ControlSettings
from modelfleet.control.state import ControlState, Revision, RevisionClock
from modelfleet.control.versions import Holdings, ModelView, Plan, Warm, plan, route

__all__ = [
    "CONTROL_ORDERS",
    "WORKER_CONTROL",
    "Command",
    "ControlSettings",
    "ControlState",
    "Holdings",
    "ModelView",
    "Plan",
    "Result",
    "Revision",
    "RevisionClock",
    "Warm",
    "announcement",
    "holdings_of",
    "orders_announcement",
    "plan",
    "route",
]
