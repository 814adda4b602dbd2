"""The gateway's view of the worker fleet, built from workers' state events.

Per-model questions (``warm_on``, ``held_anywhere``) are answered from indexes kept as
events arrive (model -> workers holding it; model -> workers pulling or loading it), so
a request costs O(workers holding that model), never a walk of every worker's lists.
The indexes and whether a worker is live are the gateway's one ``WorkerRegistry``,
which the control plane's index of what workers announce shares.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from modelfleet.gateway.loadrate import LoadRateRing

DEMAND_WINDOW_S = 60.0  # a model announced this recently is in demand somewhere


class FleetView:
    """Workers' states, over the gateway's ``WorkerRegistry`` (its own one, made from
    ``stale_after_s`` and ``clock``, when none is given)."""

    def __init__(self, stale_after_s: float = 10.0, clock: Callable[[], float] = time.time,
                 registry: WorkerRegistry | None = None) -> None:
        self.registry = registry if registry is not None else \
            WorkerRegistry(stale_after_s, clock)
        self._clock = self.registry.clock
        self._states: dict[str, dict[str, Any]] = {}
        self._demand: dict[str, float] = {}  # model id -> last announcement (any gateway)
        self._warm = self.registry.index()  # model -> workers holding it (device or host)
        self._pulled = self.registry.index()  # model -> workers pulling its queue or loading it
        self.load_rates = LoadRateRing()
        self.registry.on_forget(self._forget)

    def observe(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        worker_id = str(event.get("worker_id", ""))
        if kind == "worker_state" and worker_id:
            self.registry.heard(worker_id)
            self._states[worker_id] = event
            self._warm.put(worker_id, _held(event))
            self._pulled.put(worker_id, _pulled(event))
            self.load_rates.observe(worker_id, event, self._clock())
        elif kind == "worker_gone":
            self.registry.forget(worker_id)
        elif kind == "demand" and isinstance(event.get("model_id"), str):
            self._demand[event["model_id"]] = self._clock()

    def _forget(self, worker_id: str) -> None:
        """The registry forgot ``worker_id`` (gone, or silent): its state goes too."""
        self._states.pop(worker_id, None)
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
        self.registry.prune()
        return [dict(state, last_seen_s_ago=round(self.registry.seen_s_ago(worker_id), 3))
                for worker_id, state in self._states.items()]

    def warm_on(self, model_id: str) -> list[str]:
        """Ids of live workers holding ``model_id`` (device or host tier), sorted."""
        return self._warm.live(model_id)

    def served(self, worker_id: str, model_id: str) -> None:
        """``worker_id`` just answered a request of ``model_id`` from the cold lane: it
        holds the model now, until its next state says otherwise."""
        self._warm.add(worker_id, model_id)

    def held_anywhere(self, model_id: str) -> bool:
        """Does a live worker hold ``model_id``, pull its queue or load it? (False: its
        next request is cold everywhere, and goes to the cold lane.)"""
        return self._warm.any_live(model_id) or self._pulled.any_live(model_id)

    def single_worker(self) -> bool:
        """Is exactly one worker live (the fleet of `serve`, or of a one-worker deployment)?"""
        return sum(1 for worker_id in self._states if self.registry.live(worker_id)) == 1

    def pulled_anywhere(self, model_id: str) -> bool:
        """Does a live worker pull ``model_id``'s queue or load it now?"""
        return self._pulled.any_live(model_id)

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


class WorkerRegistry:
    """The gateway's one registry of workers: when each was last heard, one staleness
    rule for all that asks (a worker is live while heard within ``stale_after_s``, by
    any event of its own: its state or its control announcement), and the model ->
    workers indexes kept from what they announce (``index``).

    ``FleetView`` (workers' states: what they hold, pull and load) and ``ControlPlane``
    (their control announcements: versions resident, failed, pinned) share one. A
    worker that goes (``worker_gone``) or falls silent leaves every index, and each
    ``on_forget`` callback drops what its owner kept of it."""

    def __init__(self, stale_after_s: float, clock: Callable[[], float] = time.time) -> None:
        self.stale_after_s = stale_after_s
        self.clock = clock
        self._seen: dict[str, float] = {}
        self._indexes: list[ModelIndex] = []
        self._forgetters: list[Callable[[str], None]] = []

    def index(self) -> ModelIndex:
        """A new model -> workers index whose workers leave it when they are forgotten."""
        index = ModelIndex(self)
        self._indexes.append(index)
        return index

    def on_forget(self, callback: Callable[[str], None]) -> None:
        self._forgetters.append(callback)

    def heard(self, worker_id: str) -> None:
        self._seen[worker_id] = self.clock()

    def seen_s_ago(self, worker_id: str) -> float:
        return self.clock() - self._seen.get(worker_id, -float("inf"))

    def live(self, worker_id: str) -> bool:
        return self.seen_s_ago(worker_id) <= self.stale_after_s

    def forget(self, worker_id: str) -> None:
        self._seen.pop(worker_id, None)
        for index in self._indexes:
            index.put(worker_id, frozenset())
        for forget in self._forgetters:
            forget(worker_id)

    def prune(self) -> None:
        """Forget every worker silent for longer than ``stale_after_s``."""
        horizon = self.clock() - self.stale_after_s
        for worker_id in [w for w, seen in self._seen.items() if seen < horizon]:
            self.forget(worker_id)


class ModelIndex:
    """model id -> the workers whose latest announcement names it, kept in step with
    each worker's announcement in O(models that changed on that worker)."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self._registry = registry
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

    def live(self, model_id: str) -> list[str]:
        """The live workers naming ``model_id``, sorted: O(those workers)."""
        return sorted(w for w in self._by_model.get(model_id, ()) if self._registry.live(w))

    def any_live(self, model_id: str) -> bool:
        return any(self._registry.live(w) for w in self._by_model.get(model_id, ()))

    def all(self) -> dict[str, list[str]]:
        return {model_id: sorted(holders) for model_id, holders in self._by_model.items()}
