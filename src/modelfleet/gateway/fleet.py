"""The gateway's view of the worker fleet, built from workers' state events."""

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
        self.load_rates = LoadRateRing()

    def observe(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        worker_id = str(event.get("worker_id", ""))
        if kind == "worker_state" and worker_id:
            self._workers[worker_id] = (self._clock(), event)
            self.load_rates.observe(worker_id, event, self._clock())
        elif kind == "worker_gone":
            self._workers.pop(worker_id, None)
            self.load_rates.forget(worker_id)
        elif kind == "demand" and isinstance(event.get("model_id"), str):
            self._demand[event["model_id"]] = self._clock()

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
                del self._workers[worker_id]
                self.load_rates.forget(worker_id)
        return [dict(state, last_seen_s_ago=round(now - seen, 3))
                for seen, state in self._workers.values()]

    def warm_models(self) -> dict[str, list[str]]:
        """model id -> ids of live workers holding it (device or host tier)."""
        warm: dict[str, list[str]] = {}
        for state in self.workers():
            resident = state.get("resident", {})
            for model_id in {*resident.get("device", []), *resident.get("host", [])}:
                warm.setdefault(model_id, []).append(state["worker_id"])
        return warm

    def has_gpu_worker(self) -> bool:
        """Does a live worker have a CUDA device (``worker.gpus``), to run ``device = "cuda"``?"""
        return any(int(state.get("gpus") or 0) > 0 for state in self.workers())
