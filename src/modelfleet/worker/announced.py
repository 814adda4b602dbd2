"""Queue counts from what the fleet announces, so that counting does not cost a broker
round trip per queue (issue 23).

Gateways announce each model with requests waiting (``{"kind": "demand"}``) every
``gateway.demand_announce_interval_s`` while they wait, with how many wait there
(``waiting``) and which gateway says so (``gateway``); workers announce what they
consume (``{"kind": "worker_state"}``, ``subscriptions``) every
``worker.state_interval_s``. From those a worker estimates a queue's backlog (what
the gateways say waits: an upper bound, since it counts tasks already running) and
its consumers (the workers that said they consume it) without asking the broker, on
RabbitMQ one passive declare (~0.6 ms) per queue.

A gateway re-announces every model with requests waiting at each interval, so one
that has not announced a model for ``fresh_s`` has nothing waiting for it: its word
counts as 0 until ``forget_s`` (the demand window) has passed, and then as nothing.

An estimate is only a filter: the coordinator counts exactly what it holds, what is
resident or pinned here, every queue it is about to take (before taking it), and
every candidate now and then (``EXACT_EVERY_S`` in the coordinator), in case an
announcement was lost. A model no gateway announced a count for (a gateway that does
not send one) has no estimate and is counted exactly.

The gateways' counts leave out what a worker put in a model's queue: a task handed back
after a crash, or a cold-lane task passed on (its gateway counts it in the cold lane).
Such a put-back is announced without a count, marked ``requeued``; the model is counted
exactly for the next ``forget_s`` after it, whatever the gateways say (a pill bench run
had a pill passed on from the cold lane wait 30 s in a queue its gateway said was empty).

Cost: O(1) per event (a worker's state costs what changed in its subscriptions),
O(gateways announcing it) per estimate.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from modelfleet.scheduling import keep_rank


class AnnouncedCounts:
    def __init__(self, fresh_s: float, forget_s: float, peer_stale_s: float,
                 worker_id: str) -> None:
        self._fresh_s = fresh_s  # a gateway silent this long has nothing waiting
        self._forget_s = forget_s  # ... and after this long says nothing at all
        self._peer_stale_s = peer_stale_s
        self._worker_id = worker_id
        self._waiting: dict[str, dict[str, tuple[int, float]]] = {}  # model -> gateway ->
        self._peers: dict[str, tuple[float, frozenset[str]]] = {}  # worker -> (at, subs)
        self._holders: dict[str, set[str]] = {}  # model -> the peers that consume it
        # Peers whose last state had a permit free and a load slot (a cold take's
        # competitors), and peers with a CUDA device.
        self._free: set[str] = set()
        self._gpu: set[str] = set()
        self._exact_until: dict[str, float] = {}  # model -> counted exactly until (requeued)

    def observe(self, event: dict[str, Any], now: float) -> None:
        """Take one fleet event (any kind; those that say nothing of counts are ignored)."""
        kind = event.get("kind")
        if kind == "demand":
            model_id, waiting, gateway = (event.get("model_id"), event.get("waiting"),
                                          event.get("gateway"))
            if event.get("requeued") is True and isinstance(model_id, str):
                self._exact_until[model_id] = now + self._forget_s
            if isinstance(model_id, str) and isinstance(gateway, str) \
                    and isinstance(waiting, int) and not isinstance(waiting, bool) \
                    and waiting >= 0:
                self._waiting.setdefault(model_id, {})[gateway] = (waiting, now)
        elif kind == "worker_state":
            worker_id, subscriptions = event.get("worker_id"), event.get("subscriptions")
            if isinstance(worker_id, str) and worker_id != self._worker_id \
                    and isinstance(subscriptions, list):
                self._set_peer(worker_id, now,
                               frozenset(s for s in subscriptions if isinstance(s, str)))
                in_use, cap = event.get("permits_in_use"), event.get("permits_cap")
                busy = ((isinstance(in_use, int) and isinstance(cap, int) and in_use >= cap)
                        or event.get("accepting_cold_work") is False)
                gpus = event.get("gpus")
                has_gpu = isinstance(gpus, int) and gpus > 0
                for peers, member in ((self._free, not busy), (self._gpu, has_gpu)):
                    if member:
                        peers.add(worker_id)
                    else:
                        peers.discard(worker_id)
        elif kind == "worker_gone":
            worker_id = event.get("worker_id")
            if isinstance(worker_id, str):
                self._drop_peer(worker_id)

    def estimate(self, model_id: str, now: float) -> tuple[int, int] | None:
        """(backlog, consumers) as announced, this worker not consuming it; None: no
        gateway announced a count for it lately, or a worker put a task back in its queue
        lately (count it exactly)."""
        until = self._exact_until.get(model_id)
        if until is not None:
            if now < until:
                return None
            del self._exact_until[model_id]
        said = self._waiting.get(model_id)
        if not said:
            return None
        waiting = 0
        for gateway, (count, at) in list(said.items()):
            age = now - at
            if age > self._forget_s:
                del said[gateway]
            elif age <= self._fresh_s:
                waiting += count
        if not said:
            del self._waiting[model_id]
            return None
        return waiting, len(self._holders.get(model_id, ()))

    def outranked_by(self, model_id: str) -> int:
        """How many of the peers that said they consume ``model_id`` rank ahead of this
        worker to keep its queue (``scheduling.keep_rank``): O(those peers)."""
        mine = keep_rank(self._worker_id, model_id)
        return sum(1 for peer in self._holders.get(model_id, ())
                   if keep_rank(peer, model_id) < mine)

    def free_ahead(self, model_id: str, cuda_only: bool = False) -> int:
        """How many peers free to take a cold queue (a permit and a load slot free, by
        their last state; for a CUDA-only model, with a GPU) rank ahead of this worker for
        ``model_id`` (``scheduling.keep_rank``): whose turn to take it comes first.
        O(free peers)."""
        mine = keep_rank(self._worker_id, model_id)
        return sum(1 for peer in self._free if keep_rank(peer, model_id) < mine
                   and (not cuda_only or peer in self._gpu))

    def expire_peers(self, now: float) -> None:
        """Forget workers not heard from lately (O(workers), once per re-score)."""
        for worker_id in [w for w, (at, _) in self._peers.items()
                          if now - at > self._peer_stale_s]:
            self._drop_peer(worker_id)

    def forget(self, model_ids: Iterable[str]) -> None:
        for model_id in model_ids:
            self._waiting.pop(model_id, None)
            self._exact_until.pop(model_id, None)

    def _set_peer(self, worker_id: str, now: float, subscriptions: frozenset[str]) -> None:
        _, before = self._peers.get(worker_id, (now, frozenset()))
        for model_id in before - subscriptions:
            self._discount(model_id, worker_id)
        for model_id in subscriptions - before:
            self._holders.setdefault(model_id, set()).add(worker_id)
        self._peers[worker_id] = (now, subscriptions)

    def _drop_peer(self, worker_id: str) -> None:
        _, before = self._peers.pop(worker_id, (0.0, frozenset()))
        self._free.discard(worker_id)
        self._gpu.discard(worker_id)
        for model_id in before:
            self._discount(model_id, worker_id)

    def _discount(self, model_id: str, worker_id: str) -> None:
        holders = self._holders.get(model_id)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[model_id]
