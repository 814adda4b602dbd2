"""Operators' overrides of model.toml settings, applied to a catalog as the orders arrive.

A load with a config gives a ``config`` order (``control.state``); every gateway and
worker that keeps a ``ControlState`` serves the model with it from the moment its copy
takes the order, whichever way it came (the command itself, a worker's gossip, the
orders a gateway read back from the database at start-up).
"""

from __future__ import annotations

from modelfleet.control.state import ControlState, Field
from modelfleet.repository import Catalog
from modelfleet.repository.overrides import ConfigOverride


def follow_configs(state: ControlState, catalog: Catalog) -> None:
    """Keep ``catalog``'s overrides as ``state``'s ``config`` orders say, from now on."""

    def taken(model_id: str, field: Field, value: bool | str) -> None:
        if field == "config":
            catalog.configure(model_id, ConfigOverride.from_json(str(value)))

    state.watch(taken)
