"""The gateway's view of the worker fleet, built from workers' state events.

Per-model questions (``warm_on``, ``held_anywhere``) are answered from indexes kept as
events arrive (model -> workers holding it; model -> workers pulling or loading it), so
a request costs O(workers holding that model), never a walk of every worker's lists.
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
        self._warm = _ModelIndex()  # model -> workers holding it (device or host tier)
        self._pulled = _ModelIndex()  # model -> workers subscribed to its queue or loading it
        self.load_rates = LoadRateRing()

    def observe(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        worker_id = str(event.get("worker_id", ""))
        if kind == "worker_state" and worker_id:
            self._workers[worker_id] = (self._clock(), event)
            self._warm.put(worker_id, _held(event))
            self._pulled.put(worker_id, _pulled(event))
            self.load_rates.observe(worker_id, event, self._clock())
        elif kind == "worker_gone":
            self._forget(worker_id)
        elif kind == "demand" and isinstance(event.get("model_id"), str):
            self._demand[event["model_id"]] = self._clock()

    def _forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        self._warm.put(worker_id, frozenset())
        self._pulled.put(worker_id, frozenset())
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
        return sorted(w for w in self._warm.workers(model_id) if self._live(w))

    def served(self, worker_id: str, model_id: str) -> None:
        """``worker_id`` just answered a request of ``model_id`` from the cold lane: it
        holds the model now, until its next state says otherwise."""
        self._warm.add(worker_id, model_id)

    def held_anywhere(self, model_id: str) -> bool:
        """Does a live worker hold ``model_id``, pull its queue or load it? (False: its
        next request is cold everywhere, and goes to the cold lane.)"""
        return any(self._live(w) for w in self._warm.workers(model_id)) or \
            any(self._live(w) for w in self._pulled.workers(model_id))

    def single_worker(self) -> bool:
        """Is exactly one worker live (the fleet of `serve`, or of a one-worker deployment)?"""
        now = self._clock()
        return sum(1 for seen, _ in self._workers.values()
                   if now - seen <= self._stale_after_s) == 1

    def pulled_anywhere(self, model_id: str) -> bool:
        """Does a live worker pull ``model_id``'s queue or load it now?"""
        return any(self._live(w) for w in self._pulled.workers(model_id))

    def _live(self, worker_id: str) -> bool:
        seen = self._workers.get(worker_id, (-float("inf"), None))[0]
        return self._clock() - seen <= self._stale_after_s

    def warm_models(self) -> dict[str, list[str]]:
        """model id -> ids of live workers holding it (device or host tier); the whole
        fleet's map (per model, ``warm_on`` is the cheap question)."""
        self.workers()  # silent workers age out of the index too
        return self._warm.all()

    def has_gpu_worker(self) -> bool:
        """Does a live worker have a CUDA device (``worker.gpus``), to run ``device = "cuda"``?"""
        return any(int(state.get("gpus") or 0) > 0 for state in self.workers())


def _held(event: dict[str, Any]) -> frozenset[str]:
    resident = event.get("resident") or {}
    if not isinstance(resident, dict):
        return frozenset()
    return frozenset(m for tier in ("device", "host") for m in resident.get(tier) or ()
                     if isinstance(m, str))


def _pulled(event: dict[str, Any]) -> frozenset[str]:
    names = [*(event.get("subscriptions") or ()), *(event.get("loading") or ())]
    return frozenset(m for m in names if isinstance(m, str))


class _ModelIndex:
    """model id -> the workers whose latest state names it, kept in step with each
    worker's announcement in O(models that changed on that worker)."""

    def __init__(self) -> None:
        self._by_worker: dict[str, frozenset[str]] = {}
        self._by_model: dict[str, set[str]] = {}

    def put(self, worker_id: str, models: frozenset[str]) -> None:
        before = self._by_worker.get(worker_id, frozenset())
        if models == before:
            return
        for model_id in before - models:
            holders = self._by_model.get(model_id)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._by_model[model_id]
        for model_id in models - before:
            self._by_model.setdefault(model_id, set()).add(worker_id)
        if models:
            self._by_worker[worker_id] = models
        else:
            self._by_worker.pop(worker_id, None)

    def add(self, worker_id: str, model_id: str) -> None:
        self._by_worker[worker_id] = self._by_worker.get(worker_id, frozenset()) | {model_id}
        self._by_model.setdefault(model_id, set()).add(worker_id)

    def workers(self, model_id: str) -> set[str]:
        return self._by_model.get(model_id, set())

    def all(self) -> dict[str, list[str]]:
        return {model_id: sorted(holders) for model_id, holders in self._by_model.items()}
