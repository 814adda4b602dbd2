"""Pinned models: preloaded on every worker at start, and again after a runtime restarts.

A model marked ``[fanout] pinned = true`` is loaded without waiting for a request and
is never evicted (the runtime pins it in its cache). A runtime that restarts comes
back empty, so each re-score puts pinned models back where they are missing. A pin
that fails to load backs off (5 s, doubling, at most 5 min) instead of retrying at
every re-score; a new incarnation of the runtime starts the count afresh.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from modelfleet.errors import ModelfleetError
from modelfleet.repository import Catalog
from modelfleet.worker.supervisor import RuntimeSupervisor

log = logging.getLogger("modelfleet.worker")
_Attempt = tuple[str, str, int]  # (model id, runtime name, runtime incarnation)


class PinKeeper:
    def __init__(self, catalog: Catalog, supervisor: RuntimeSupervisor,
                 clock: Callable[[], float]) -> None:
        self._catalog = catalog
        self._supervisor = supervisor
        self._clock = clock
        self._failures: dict[_Attempt, int] = {}
        self._retry_at: dict[_Attempt, float] = {}

    @property
    def pinned(self) -> list[str]:
        return [e.model_id for e in self._catalog if e.manifest.fanout.pinned]

    async def keep(self, resident: frozenset[str] = frozenset()) -> None:
        """Load pinned models onto every ready runtime that lacks them."""
        for model_id in self.pinned:
            runtime = self._supervisor.runtime_for(model_id)
            target = runtime.runtime
            if target is None or not runtime.ready or model_id in resident \
                    or model_id in runtime.loading:
                continue
            attempt = (model_id, runtime.name, runtime.restarts)
            if self._clock() < self._retry_at.get(attempt, 0.0):
                continue
            try:
                await target.load(model_id, self._catalog.get(model_id).manifest.version,
                                  pinned=True)
            except ModelfleetError as exc:
                failures = self._failures.get(attempt, 0) + 1
                self._failures[attempt] = failures
                self._retry_at[attempt] = self._clock() + min(300.0, 5.0 * 2 ** failures)
                log.error("could not preload pinned model %s (try %d): %s", model_id,
                          failures, exc)
