"""The worker's cache counters, as its published state carries them to the gateways.

``Residency`` asks every runtime for its stats at each re-score; each answer goes
through ``CacheTally.observe``, which keeps, for the whole worker:

- loads by source since the worker started ("repository" and "disk": from storage;
  "host": a promotion from host memory, a copy and not a load), and evictions by
  action ("demote" to host memory, "drop");
- the last resident bytes and budgets per tier of each runtime;
- the 60 s windows behind ``modelfleet_model_loads_per_minute`` (storage loads only)
  and ``modelfleet_model_promotions_per_minute``.

The gateway turns the cumulative counters into loads per minute for the fleet page
(``gateway/loadrate.py``); counters, not rates, cross the wire so that a missed
state event loses nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from modelfleet import metrics

RATE_WINDOW_S = 60.0
PROMOTION = "host"  # the load source of a promotion from host memory


class LoadReport(Protocol):
    @property
    def source(self) -> str: ...


class StatsReport(Protocol):
    """What a runtime's stats answer tells of its cache (``ipc.protocol.RuntimeStats``)."""

    @property
    def device_used_bytes(self) -> int: ...
    @property
    def host_used_bytes(self) -> int: ...
    @property
    def device_budget_bytes(self) -> int: ...
    @property
    def host_budget_bytes(self) -> int: ...
    @property
    def loads(self) -> Iterable[LoadReport]: ...
    @property
    def evictions(self) -> Iterable[tuple[str, str]]: ...


class CacheTally:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._loads: dict[str, int] = {}
        self._evictions: dict[str, int] = {}
        self._bytes: dict[str, tuple[int, int, int, int]] = {}  # runtime -> used/budget
        self._load_times: deque[float] = deque()
        self._promotion_times: deque[float] = deque()

    def observe(self, runtime: str, stats: StatsReport) -> None:
        """Count one stats answer of ``runtime`` (its loads and evictions since its last)."""
        now = self._clock()
        self._bytes[runtime] = (stats.device_used_bytes, stats.host_used_bytes,
                                stats.device_budget_bytes, stats.host_budget_bytes)
        for load in stats.loads:
            self._loads[load.source] = self._loads.get(load.source, 0) + 1
            (self._promotion_times if load.source == PROMOTION else self._load_times).append(now)
        for action, _model_id in stats.evictions:
            self._evictions[action] = self._evictions.get(action, 0) + 1

    def forget(self, runtime: str) -> None:
        """``runtime`` is down or retired: what it held is gone (its counts stay)."""
        self._bytes.pop(runtime, None)

    def publish_rates(self) -> None:
        """Set the per-minute gauges: storage loads and promotions in the last 60 s."""
        horizon = self._clock() - RATE_WINDOW_S
        for times in (self._load_times, self._promotion_times):
            while times and times[0] < horizon:
                times.popleft()
        metrics.MODEL_LOAD_RATE.set(len(self._load_times))
        metrics.MODEL_PROMOTION_RATE.set(len(self._promotion_times))

    def summary(self) -> dict[str, Any]:
        """The fields this worker's ``worker_state`` event carries about its cache."""
        used = list(self._bytes.values())
        return {
            "resident_bytes": {"device": sum(u[0] for u in used),
                               "host": sum(u[1] for u in used)},
            "budget_bytes": {"device": sum(u[2] for u in used),
                             "host": sum(u[3] for u in used)},
            "loads": dict(self._loads),
            "evictions": dict(self._evictions),
        }
