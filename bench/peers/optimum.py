"""The static optimum of bytes loaded per request: what the best fixed resident set loads.

Given a trace's request count per model, the models' sizes and a memory budget, the best
*static* choice keeps resident the set of models that saves the most bytes, within the
budget less one reservation for a miss (the largest model's bytes: a miss must have room
to load into). Every request for a model outside that set counts as one load of its bytes
(the reservation is reused miss after miss; consecutive requests for the same cold model
are not merged, so this is the static policy's cost, not a lower bound for every policy).
Each requested model is loaded at least once (its first request), unless it is in
``warm`` (requested during the warm-up, so it may be resident when the window opens);
``compulsory=False`` counts every resident model as preloaded for free. With 50 models and
thousands of requests that changes little; with 5,000 models and a trace of a few
thousand requests it is much of the cost, and without it the optimum would be about 0
(every model the trace touches fits).

Keeping model ``i`` saves ``(count_i - 1) * size_i`` bytes (``count_i * size_i`` when
warm or preloaded) at a cost of ``size_i`` bytes of budget: a 0/1 knapsack whose value per byte
is the count of its repeat requests. Solved three ways:

- ``greedy``: by count, most requested first, each model kept if it still fits;
- ``dp``: the knapsack by dynamic programming over the budget in units (sizes rounded *up*
  to a unit, so its answer is feasible; exact when the unit is one byte);
- the LP relaxation (greedy with the last model taken fractionally): a bound no static
  set beats.

``bytes_per_request`` is the better of greedy and dp (feasible, so an upper bound on the
optimum), ``bound_bytes_per_request`` the LP bound (a lower bound): the true static
optimum lies between them. Standard library and numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

DP_CELLS = 20_000  # budget units of the dynamic programme, at most
DP_WORK = 40_000_000  # models x units, at most


@dataclass(frozen=True)
class StaticOptimum:
    budget_bytes: int
    reserve_bytes: int
    requests: int
    total_bytes_requested: int  # what loading on every request would read
    loaded_bytes: int  # of the best resident set found
    bound_loaded_bytes: float  # LP relaxation: no static set loads less
    method: str  # "dp" or "greedy": which found the best set
    dp_unit_bytes: int | None
    resident_bytes: int
    resident: frozenset[str] = field(repr=False)

    @property
    def bytes_per_request(self) -> float | None:
        return self.loaded_bytes / self.requests if self.requests else None

    @property
    def bound_bytes_per_request(self) -> float | None:
        return self.bound_loaded_bytes / self.requests if self.requests else None

    def as_dict(self) -> dict[str, object]:
        return {"budget_bytes": self.budget_bytes, "reserve_bytes": self.reserve_bytes,
                "capacity_bytes": max(0, self.budget_bytes - self.reserve_bytes),
                "requests": self.requests, "total_bytes_requested": self.total_bytes_requested,
                "loaded_bytes": self.loaded_bytes,
                "bytes_per_request": _r(self.bytes_per_request),
                "bound_bytes_per_request": _r(self.bound_bytes_per_request),
                "method": self.method, "dp_unit_bytes": self.dp_unit_bytes,
                "resident_models": len(self.resident),
                "resident_bytes": self.resident_bytes}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def static_optimum(counts: Mapping[str, int], sizes: Mapping[str, int], budget_bytes: int,
                   reserve_bytes: int | None = None, compulsory: bool = True,
                   warm: Collection[str] = ()) -> StaticOptimum:
    """The best static resident set for ``counts`` (requests per model) within
    ``budget_bytes`` less ``reserve_bytes`` (default: the largest model in ``sizes``);
    ``compulsory``: every requested model's first request loads it, but those in ``warm``."""
    missing = [m for m in counts if m not in sizes]
    if missing:
        raise KeyError(f"no size for requested model(s) {missing[:5]}")
    if budget_bytes < 0:
        raise ValueError("budget_bytes must be >= 0")
    reserve = max(sizes.values(), default=0) if reserve_bytes is None else reserve_bytes
    capacity = max(0, budget_bytes - reserve)
    requested = [(m, int(c), int(sizes[m])) for m, c in counts.items() if c > 0]
    requests = sum(c for _, c, _ in requested)
    total = sum(c * s for _, c, s in requested)
    warm = frozenset(warm)

    def first(model: str) -> int:
        return 1 if compulsory and model not in warm else 0
    # (model, requests whose load residency saves, size): worth keeping only when > 0.
    items = sorted(((m, c - first(m), s) for m, c, s in requested if c > first(m)),
                   key=lambda t: (-t[1], t[2], t[0]))

    greedy: set[str] = set()
    room = capacity
    for name, _, size in items:
        if size <= room:
            greedy.add(name)
            room -= size
    best, method = greedy, "greedy"
    saved = _saved(items, greedy)

    dp_set, unit = _knapsack(items, capacity)
    if dp_set is not None and _saved(items, dp_set) > saved:
        best, method, saved = dp_set, "dp", _saved(items, dp_set)

    bound_saved, room = 0.0, float(capacity)
    for _, count, size in items:  # value per byte = count: fractional greedy is the LP
        if room <= 0:
            break
        take = min(1.0, room / size) if size else 1.0
        bound_saved += take * count * size
        room -= take * size
    return StaticOptimum(budget_bytes, reserve, requests, total, total - saved,
                         total - bound_saved, method, unit,
                         sum(int(sizes[m]) for m in best), frozenset(best))


def _saved(items: list[tuple[str, int, int]], chosen: set[str]) -> int:
    return sum(c * s for name, c, s in items if name in chosen)


def _knapsack(items: list[tuple[str, int, int]],
              capacity: int) -> tuple[set[str] | None, int | None]:
    """0/1 knapsack over the budget in units (sizes rounded up): the chosen set and unit."""
    if not items or capacity <= 0:
        return (set() if items or capacity <= 0 else None), None
    cells = min(DP_CELLS, capacity, max(1, DP_WORK // len(items)))
    unit = math.ceil(capacity / cells)
    slots = capacity // unit
    value = np.zeros(slots + 1, dtype=np.float64)
    took = np.zeros((len(items), slots + 1), dtype=np.bool_)
    for i, (_, count, size) in enumerate(items):
        w = math.ceil(size / unit) if size else 0
        if w > slots:
            continue
        gain = float(count) * size
        if w == 0:
            value += gain
            took[i, :] = True
            continue
        candidate = value[:-w] + gain
        better = candidate > value[w:]
        took[i, w:] = better
        value[w:] = np.where(better, candidate, value[w:])
    chosen: set[str] = set()
    slot = slots
    for i in range(len(items) - 1, -1, -1):
        if took[i, slot]:
            name, _, size = items[i]
            chosen.add(name)
            slot -= math.ceil(size / unit) if size else 0
    return chosen, unit
