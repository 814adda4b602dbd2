"""Bounded ``model`` label values: a long-tail catalog must not become a long-tail scrape.

Prometheus keeps one series per label set; with thousands of models, a ``model`` label
on every histogram bucket would multiply the scrape by the catalog. Two rules keep it
bounded:

- histograms and counters (``ModelLabels``): the first ``limit`` models seen get their
  own label, every later one is counted under ``model="other"``. A series once created
  keeps its meaning for the life of the process (a label that moved between models
  would make ``rate()`` lie).
- gauges recomputed from a fresh view (``top_n``): the ``limit`` largest values keep
  their label, the rest are summed (or combined) into ``model="other"``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

OTHER = "other"
DEFAULT_LIMIT = 20


class ModelLabels:
    """The label value for a model: itself for the first ``limit`` models, else "other"."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit  # set once at start-up (Settings.metrics_models)
        self._admitted: set[str] = set()

    def __call__(self, model_id: str) -> str:
        if model_id in self._admitted:
            return model_id
        if len(self._admitted) < self.limit and model_id != OTHER:
            self._admitted.add(model_id)
            return model_id
        return OTHER

    def __len__(self) -> int:
        """How many models have their own label so far."""
        return len(self._admitted)


def top_n(values: Mapping[str, float], limit: int = DEFAULT_LIMIT,
          combine: Callable[[Iterable[float]], float] = sum) -> dict[str, float]:
    """The ``limit`` largest values by model, and the rest combined under "other".

    "other" is present (0 when nothing is left over) so that a gauge's "other" series
    never goes stale when the tail empties.
    """
    ranked = sorted(values.items(), key=lambda item: (-item[1], item[0]))
    kept = dict(ranked[:limit])
    rest = [value for _, value in ranked[limit:]]
    kept[OTHER] = combine(rest) if rest else 0.0
    return kept
