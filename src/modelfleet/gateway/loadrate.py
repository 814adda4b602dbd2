"""Loads per minute against resident models, per worker and fleet-wide, over the last minutes.

The health signal of a long-tail fleet is its model-load rate set against how many
models it holds: a fleet that looks healthy by residency can be thrashing. Workers
publish cumulative counters in their ``worker_state`` events (loads by source since
they started, see ``worker/cachestats.py``); this ring samples them every ``step_s``
and turns the differences into loads per minute (those in the minute up to each
sample), keeping loads from storage (repository or the worker's disk cache) apart from
promotions out of host memory (a copy, not a load).

A worker whose counters went down restarted: its new counts are all new. A worker
first seen in a sample has no rate there (its earlier counts are not of this window).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

RATE_WINDOW_S = 60.0
STORAGE_SOURCES = ("repository", "disk")
PROMOTION_SOURCE = "host"


@dataclass(frozen=True)
class WorkerCounts:
    storage_loads: int
    promotions: int
    resident_device: int
    resident_host: int

    @classmethod
    def of(cls, state: dict[str, Any]) -> WorkerCounts:
        loads = state.get("loads") or {}
        resident = state.get("resident") or {}
        return cls(sum(int(loads.get(s, 0)) for s in STORAGE_SOURCES),
                   int(loads.get(PROMOTION_SOURCE, 0)),
                   len(resident.get("device", [])), len(resident.get("host", [])))


@dataclass(frozen=True)
class Sample:
    at: float  # epoch seconds
    workers: dict[str, WorkerCounts]


class LoadRateRing:
    """Samples of every live worker's counters, one per ``step_s``, ``window_s`` long."""

    def __init__(self, step_s: float = 2.0, window_s: float = 600.0) -> None:
        self._step_s = step_s
        self._samples: deque[Sample] = deque(maxlen=max(2, int(window_s / step_s) + 1))
        self._latest: dict[str, WorkerCounts] = {}

    def observe(self, worker_id: str, state: dict[str, Any], now: float) -> None:
        self._latest[worker_id] = WorkerCounts.of(state)
        self.sample(now)

    def forget(self, worker_id: str) -> None:
        self._latest.pop(worker_id, None)

    def sample(self, now: float, live: set[str] | None = None) -> None:
        """Take a sample if the last one is ``step_s`` old (``live``: drop the others)."""
        if live is not None:
            for gone in set(self._latest) - live:
                del self._latest[gone]
        if self._samples and now - self._samples[-1].at < self._step_s:
            return
        self._samples.append(Sample(now, dict(self._latest)))

    def series(self, workers_shown: Collection[str] | None = None) -> dict[str, Any]:
        """Points over the window: at each sample after the first, per worker and for the
        fleet, resident models (device, host), and loads from storage and promotions from
        host memory since the sample before (counts, and per minute).

        ``workers_shown``: the workers whose own series the points carry (all: None). A
        page polling every two seconds asks for the fleet and at most one worker: every
        worker's ten minutes would be megabytes a poll in a large fleet.
        """
        points: list[dict[str, Any]] = []
        recent: deque[tuple[float, dict[str, tuple[int, int]]]] = deque()  # the last minute
        for before, after in pairwise(self._samples):
            workers: dict[str, dict[str, float]] = {}
            for worker_id, now in after.workers.items():
                then = before.workers.get(worker_id)
                loads = _delta(then.storage_loads if then else None, now.storage_loads)
                promotions = _delta(then.promotions if then else None, now.promotions)
                workers[worker_id] = {
                    "resident_device": now.resident_device,
                    "resident_host": now.resident_host,
                    "loads": loads, "promotions": promotions,  # since the sample before
                }
            # Per minute: what happened in the minute up to this sample (the same count
            # as the workers' modelfleet_model_loads_per_minute).
            recent.append((after.at, {w: (int(c["loads"]), int(c["promotions"]))
                                      for w, c in workers.items()}))
            while recent[0][0] <= after.at - RATE_WINDOW_S:
                recent.popleft()
            for worker_id, counts in workers.items():
                counts["loads_per_min"] = sum(step.get(worker_id, (0, 0))[0]
                                              for _, step in recent)
                counts["promotions_per_min"] = sum(step.get(worker_id, (0, 0))[1]
                                                   for _, step in recent)
            fleet = {key: sum(w[key] for w in workers.values())
                     for key in ("resident_device", "resident_host", "loads", "promotions",
                                 "loads_per_min", "promotions_per_min")}
            points.append({"at": round(after.at, 3),
                           "fleet": {k: round(v, 2) for k, v in fleet.items()},
                           "workers": {w: {k: round(v, 2) for k, v in counts.items()}
                                       for w, counts in workers.items()
                                       if workers_shown is None or w in workers_shown}})
        return {"step_s": self._step_s, "points": points}


def _delta(then: int | None, now: int) -> int:
    if then is None:
        return 0  # first seen here: its earlier counts are not of this window
    return now - then if now >= then else now  # went down: restarted, all new
