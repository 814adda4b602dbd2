"""Learn what a load costs, per source, from the loads we measured.

A load's duration is modelled per source as ``fixed_s + seconds_per_byte * size``:
the fixed part is what every load pays whatever its size (opening the artifact,
deserialising, building the module, allocating on the device); the per-byte part
is bandwidth. Both are fitted by exponentially weighted least squares over recent
loads (recent loads weigh more, so a slower disk or a busier network shows up
within a few dozen loads). Until a source has been seen with two different sizes,
its estimate is the default line scaled to match what was observed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from modelfleet.cache.types import LoadSource

_MB = 1_000_000.0

DEFAULT_COSTS: Mapping[LoadSource, tuple[float, float]] = {
    # source: (fixed seconds, seconds per byte). Deliberately rough; they only
    # rank models until the first real measurements arrive.
    "repository": (0.5, 1.0 / (100 * _MB)),  # remote object store: ~100 MB/s
    "disk": (0.1, 1.0 / (500 * _MB)),  # local NVMe plus deserialisation
    "host": (0.005, 1.0 / (10_000 * _MB)),  # pinned host -> device copy
}

_MIN_COST_S = 1e-6  # a load is never free; keeps cost/size ratios positive


@dataclass(slots=True)
class _Fit:
    """Exponentially weighted running means and co-moments of (size, seconds).

    Sizes are held in MB so the squared terms stay well inside float range.
    """

    weight: float = 0.0
    mean_x: float = 0.0
    mean_y: float = 0.0
    var_xx: float = 0.0  # weighted sum of squared deviations of x
    cov_xy: float = 0.0

    def add(self, x: float, y: float, decay: float) -> None:
        # West's weighted incremental update with forgetting: numerically stable.
        self.weight = self.weight * decay + 1.0
        self.var_xx *= decay
        self.cov_xy *= decay
        dx = x - self.mean_x
        self.mean_x += dx / self.weight
        self.mean_y += (y - self.mean_y) / self.weight
        self.var_xx += dx * (x - self.mean_x)
        self.cov_xy += dx * (y - self.mean_y)


class LoadCostModel:
    """Estimated seconds to load ``size_bytes`` from a ``LoadSource``.

    ``half_life_loads``: after this many newer loads from the same source, an
    observation weighs half as much. ``defaults`` overrides ``DEFAULT_COSTS``
    per source as ``(fixed_s, seconds_per_byte)``.
    """

    def __init__(
        self,
        half_life_loads: float = 32.0,
        defaults: Mapping[LoadSource, tuple[float, float]] | None = None,
    ) -> None:
        if half_life_loads <= 0:
            raise ValueError(f"half_life_loads must be > 0, got {half_life_loads}")
        self._decay = 0.5 ** (1.0 / half_life_loads)
        self._defaults: dict[LoadSource, tuple[float, float]] = dict(DEFAULT_COSTS)
        if defaults:
            self._defaults.update(defaults)
        self._fits: dict[LoadSource, _Fit] = {}
        self._model_s: dict[str, float] = {}  # smoothed full loads, by model id
        self._model_source: dict[str, LoadSource] = {}

    def observe(
        self, source: LoadSource, size_bytes: int, seconds: float, model_id: str | None = None
    ) -> None:
        """Record one measured load (of ``model_id`` if given). Negative or
        non-finite durations are ignored."""
        if not (seconds >= 0.0 and seconds != float("inf")) or size_bytes < 0:
            return
        fit = self._fits.setdefault(source, _Fit())
        fit.add(size_bytes / _MB, seconds, self._decay)
        if model_id is not None and source != "host":  # a promotion is no reload
            # Halfway to the new value: one load that waited on a busy disk
            # should not make a model look precious for the rest of its life.
            previous = self._model_s.get(model_id, seconds)
            self._model_s[model_id] = 0.5 * previous + 0.5 * seconds
            self._model_source[model_id] = source

    def reload_cost(self, model_id: str, size_bytes: int) -> float:
        """Seconds to load ``model_id`` again from where it came from: its own
        measured full loads if any (models differ beyond their size: formats,
        layer counts), else ``estimate`` for a repository fetch."""
        measured = self._model_s.get(model_id)
        if measured is not None:
            return max(_MIN_COST_S, measured)
        return self.estimate(self._model_source.get(model_id, "repository"), size_bytes)

    def line(self, source: LoadSource) -> tuple[float, float]:
        """The current ``(fixed_s, seconds_per_byte)`` for ``source``."""
        fixed_s, per_byte = self._defaults[source]
        fit = self._fits.get(source)
        if fit is None or fit.weight == 0.0:
            return fixed_s, per_byte
        per_mb = per_byte * _MB
        # Enough spread in sizes to separate the fixed part from bandwidth?
        spread = fit.var_xx / fit.weight
        if spread > 1e-6 * max(1.0, fit.mean_x**2) and fit.weight >= 2.0:
            slope = fit.cov_xy / fit.var_xx
            intercept = fit.mean_y - slope * fit.mean_x
            if slope < 0.0:  # noise: size does not matter here, all fixed
                slope, intercept = 0.0, fit.mean_y
            elif intercept < 0.0:  # noise: no measurable fixed part
                slope, intercept = fit.mean_y / fit.mean_x if fit.mean_x > 0 else 0.0, 0.0
            return intercept, slope / _MB
        # One size only: keep the default shape, scaled to what we measured.
        default_at_mean = fixed_s + per_mb * fit.mean_x
        scale = fit.mean_y / default_at_mean if default_at_mean > 0 else 1.0
        return fixed_s * scale, per_byte * scale

    def estimate(self, source: LoadSource, size_bytes: int) -> float:
        """Expected seconds to load ``size_bytes`` from ``source`` (always > 0)."""
        fixed_s, per_byte = self.line(source)
        return max(_MIN_COST_S, fixed_s + per_byte * max(0, size_bytes))

    def observations(self, source: LoadSource) -> float:
        """Effective (decayed) number of observations for ``source``."""
        fit = self._fits.get(source)
        return fit.weight if fit is not None else 0.0
