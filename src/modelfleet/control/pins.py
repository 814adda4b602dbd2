"""Which models are pinned, kept up to date as the catalog and the orders change.

A model is pinned by its manifest (``[fanout] pinned``) or by an operator's pin, and
not while an operator's unload holds. The worker asks at every re-score; walking the
catalog each time made a re-score cost O(catalog). The set is rebuilt only when the
catalog's ``generation`` or the orders' ``revision`` moved: the manifests' part once
per catalog change, the orders' part over the models that have orders.
"""

from __future__ import annotations

from modelfleet.control.state import ControlState
from modelfleet.repository import Catalog


class PinnedIndex:
    def __init__(self, catalog: Catalog, state: ControlState | None = None) -> None:
        self._catalog = catalog
        self._state = state if state is not None else ControlState()
        self._manifest_at = -1
        self._by_manifest: frozenset[str] = frozenset()
        self._at: tuple[int, int] = (-1, -1)
        self._pinned: frozenset[str] = frozenset()

    def by_manifest(self) -> frozenset[str]:
        """Models whose newest manifest says ``[fanout] pinned = true``."""
        if self._manifest_at != self._catalog.generation:
            self._by_manifest = frozenset(e.model_id for e in self._catalog
                                          if e.manifest.fanout.pinned)
            self._manifest_at = self._catalog.generation
        return self._by_manifest

    def pinned(self, model_id: str) -> bool:
        """Pinned by its manifest or an operator, and not unloaded (one model)."""
        if model_id not in self._catalog or not self._state.loaded(model_id):
            return False
        return self._state.pinned(model_id, self._catalog.get(model_id).manifest.fanout.pinned)

    def ids(self) -> frozenset[str]:
        """Every pinned model (as :meth:`pinned` says of each), rebuilt only on a change."""
        at = (self._catalog.generation, self._state.revision)
        if at != self._at:
            ordered = set(self._state.models())
            self._pinned = frozenset((self.by_manifest() - ordered)
                                     | {m for m in ordered if self.pinned(m)})
            self._at = at
        return self._pinned
