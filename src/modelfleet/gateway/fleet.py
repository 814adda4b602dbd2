"""The gateway's view of the worker fleet, built from workers' state events.

Per-model questions (``warm_on``) are answered from an index kept as events arrive
(model -> workers holding it), so a request costs O(workers holding that model), never
a walk of every worker's resident list.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from modelfleet.gateway.loadrate import LoadRateRing

DEMAND_WINDOW_S = 60.0  # a model announced this recently is in demand somewhere


class FleetView:
    def __init__(self, stale_after_s: float, clock: Callable[[], float] = time.time) -> None:
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._workers: dict[str, tuple[float, dict[str, Any]]] = {}
        self._demand: dict[str, float] = {}  # model id -> last announcement (any gateway)
        self._resident: dict[str, frozenset[str]] = {}  # worker -> models it holds
        self._warm: dict[str, set[str]] = {}  # model -> workers holding it
        self.load_rates = LoadRateRing()

    def observe(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        worker_id = str(event.get("worker_id", ""))
        if kind == "worker_state" and worker_id:
            self._workers[worker_id] = (self._clock(), event)
            self._index(worker_id, _held(event))
            self.load_rates.observe(worker_id, event, self._clock())
        elif kind == "worker_gone":
            self._forget(worker_id)
        elif kind == "demand" and isinstance(event.get("model_id"), str):
            self._demand[event["model_id"]] = self._clock()

    def _index(self, worker_id: str, held: frozenset[str]) -> None:
        """Keep ``_warm`` in step: O(models that changed on this worker)."""
        before = self._resident.get(worker_id, frozenset())
        if held == before:
            return
        for model_id in before - held:
            holders = self._warm.get(model_id)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._warm[model_id]
        for model_id in held - before:
            self._warm.setdefault(model_id, set()).add(worker_id)
        self._resident[worker_id] = held

    def _forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        self._index(worker_id, frozenset())
        self._resident.pop(worker_id, None)
        self.load_rates.forget(worker_id)

    def sample_load_rates(self) -> None:
        """A load-rate sample now (if one is due), of the live workers only."""
        live = {str(state["worker_id"]) for state in self.workers()}
        self.load_rates.sample(self._clock(), live)

    def in_demand(self) -> set[str]:
        """Models any gateway announced demand for in the last minute."""
        horizon = self._clock() - DEMAND_WINDOW_S
        for model_id, seen in list(self._demand.items()):
            if seen < horizon:
                del self._demand[model_id]
        return set(self._demand)

    def workers(self) -> list[dict[str, Any]]:
        """Live workers' latest states; workers silent for too long age out."""
        now = self._clock()
        for worker_id, (seen, _) in list(self._workers.items()):
            if now - seen > self._stale_after_s:
                self._forget(worker_id)
        return [dict(state, last_seen_s_ago=round(now - seen, 3))
                for seen, state in self._workers.values()]

    def warm_on(self, model_id: str) -> list[str]:
        """Ids of live workers holding ``model_id`` (device or host tier), sorted."""
        now = self._clock()
        live = []
        for worker_id in self._warm.get(model_id, ()):
            seen = self._workers.get(worker_id, (-float("inf"), None))[0]
            if now - seen <= self._stale_after_s:
                live.append(worker_id)
        return sorted(live)

    def warm_models(self) -> dict[str, list[str]]:
        """model id -> ids of live workers holding it (device or host tier); the whole
        fleet's map (per model, ``warm_on`` is the cheap question)."""
        self.workers()  # silent workers age out of the index too
        return {model_id: sorted(holders) for model_id, holders in self._warm.items()}

    def has_gpu_worker(self) -> bool:
        """Does a live worker have a CUDA device (``worker.gpus``), to run ``device = "cuda"``?"""
        return any(int(state.get("gpus") or 0) > 0 for state in self.workers())


def _held(event: dict[str, Any]) -> frozenset[str]:
    resident = event.get("resident") or {}
    if not isinstance(resident, dict):
        return frozenset()
    return frozenset(m for tier in ("device", "host") for m in resident.get(tier) or ()
                     if isinstance(m, str))
