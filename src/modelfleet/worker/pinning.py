"""Pinned models: preloaded on every worker at start, and again after a runtime restarts.

A model marked ``[fanout] pinned = true`` (or pinned by an operator, through the
control API) is loaded without waiting for a request and is never evicted (the
runtime pins it in its cache). A runtime that restarts comes back empty, so each
re-score puts pinned models back where they are missing. A pin that fails to load
backs off (5 s, doubling, at most 5 min) instead of retrying at every re-score; a new
incarnation of the runtime starts the count afresh.

Pins follow versions: which versions of a pinned model to keep is the policy's answer
(the control agent's: the route's version and the one rolling in), and each is
checked by itself, so a new version is preloaded while the old one is still resident.
The old version is unpinned when the route leaves it, and released after its drain
(``worker/control.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from modelfleet.control.pins import PinnedIndex
from modelfleet.control.versions import Versions
from modelfleet.errors import ModelfleetError
from modelfleet.repository import Catalog
from modelfleet.worker.supervisor import RuntimeSupervisor

log = logging.getLogger("modelfleet.worker")
_Attempt = tuple[str, str, int]  # (model "id@version", runtime name, runtime incarnation)


class PinPolicy(Protocol):
    """Which models are pinned, and which of their versions to keep loaded."""

    def pinned(self, model_id: str) -> bool: ...

    def pinned_ids(self) -> frozenset[str]:
        """Every pinned model; cheap to ask often (kept, not walked for)."""
        ...

    def pin_versions(self, model_id: str) -> list[str]: ...

    def load_failed(self, model_id: str, version: str, error: ModelfleetError) -> None: ...

    def loaded_ok(self, model_id: str, version: str) -> None: ...


class ManifestPins:
    """The repository's word alone: ``[fanout] pinned``, the newest version."""

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog
        self._index = PinnedIndex(catalog)

    def pinned(self, model_id: str) -> bool:
        return self._catalog.get(model_id).manifest.fanout.pinned

    def pinned_ids(self) -> frozenset[str]:
        return self._index.by_manifest()

    def pin_versions(self, model_id: str) -> list[str]:
        return [self._catalog.get(model_id).manifest.version]

    def load_failed(self, model_id: str, version: str, error: ModelfleetError) -> None:
        pass

    def loaded_ok(self, model_id: str, version: str) -> None:
        pass


class PinKeeper:
    def __init__(self, catalog: Catalog, supervisor: RuntimeSupervisor,
                 clock: Callable[[], float], policy: PinPolicy | None = None) -> None:
        self._catalog = catalog
        self._supervisor = supervisor
        self._clock = clock
        self._policy = policy or ManifestPins(catalog)
        self._failures: dict[_Attempt, int] = {}
        self._retry_at: dict[_Attempt, float] = {}

    @property
    def pinned(self) -> frozenset[str]:
        """The pinned models: kept by the policy as the catalog and the orders change,
        so asking at every re-score costs nothing like a walk of the catalog."""
        return self._policy.pinned_ids()

    async def keep(self, pinned_here: Versions | None = None) -> None:
        """Load each pinned version, pinned, onto its ready runtime where it is not.

        ``pinned_here``: the versions this worker's runtimes hold pinned, by model.
        """
        held = pinned_here or {}
        for model_id in sorted(self.pinned):
            runtime = self._supervisor.runtime_for(model_id)
            target = runtime.runtime
            if target is None or not runtime.ready or model_id in runtime.loading:
                continue
            for version in self._policy.pin_versions(model_id):
                if version in held.get(model_id, frozenset()):
                    continue
                attempt = (f"{model_id}@{version}", runtime.name, runtime.restarts)
                if self._clock() < self._retry_at.get(attempt, 0.0):
                    continue
                try:
                    await self._supervisor.prepare(runtime, model_id)  # the pool's room
                    await target.load(model_id, version, pinned=True)
                except ModelfleetError as exc:
                    self._policy.load_failed(model_id, version, exc)
                    failures = self._failures.get(attempt, 0) + 1
                    self._failures[attempt] = failures
                    self._retry_at[attempt] = self._clock() + min(300.0, 5.0 * 2 ** failures)
                    log.error("could not preload pinned model %s v%s (try %d): %s", model_id,
                              version, failures, exc)
                else:
                    self._policy.loaded_ok(model_id, version)
