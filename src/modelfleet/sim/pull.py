"""Pull-affinity: one queue per model; each worker's coordinator chooses the queues it
consumes with the real ``modelfleet.scheduling.decide``.

Three parties, each modelled on the code it stands for:

- **The broker** (``modelfleet.broker.embedded``, which follows RabbitMQ): a queue of
  ready messages per model; a consumer holds at most its prefetch window of unsettled
  deliveries; ready messages go round-robin to the consumers with room; a delivery is
  settled when its task gives its permit back; cancelling a consumer puts what it had
  not started back at the head of the queue. ``backlog`` counts ready messages only,
  not deliveries buffered at a consumer.
- **The gateway** (``modelfleet.gateway.service``): it publishes each request's task,
  announces demand for its model at once unless it did within
  ``announce_interval_s``, and every ``announce_interval_s`` announces again each
  model with requests still waiting for an answer. Workers hear an announcement
  ``announce_s`` (the broker's) later.
- **The coordinator** (``modelfleet.worker.coordinator``), per worker: a consumer loop
  per subscription takes a delivery, waits for a permit (one FIFO semaphore of
  ``permits``), starts the task, takes the next. The re-score loop re-scores every
  ``rescore_s`` x uniform(0.75, 1.25) with exact counts for every candidate queue (a
  tick), and at once (after a pause uniform(0, ``rescore_jitter_s``)) when woken: by an
  announcement for a model it does not consume while a permit is free (once per model
  until it is counted, and not for a queue last counted at its fan-out cap, as the
  coordinator's event listener takes them), or by a task finishing while its last
  snapshot saw work waiting; a woken re-score counts afresh only the queues announced
  since (the others keep their last counts, as in the coordinator). The ticks keep
  their own schedule, from the start of one to the next: a woken re-score does not put
  the next tick off, and one that is due when a re-score ends comes at once, without
  the pause (a woken re-score when it is due is the tick).
  A re-score costs time: one stats round trip per runtime (``stats_s``), one count
  per queue counted (the broker's ``count_s``), the decision's CPU
  (``decide_cpu_s`` + ``decide_cpu_per_queue_s`` per queue), then acting: a cold
  subscription first counts its queue afresh and skips it if the fan-out cap is
  reached meanwhile; each subscription costs the broker's ``subscribe_s``.
  ``Decision.prefetch`` sets the consumers' windows.

Observe and act are the coordinator's own code: the simulator gathers a
``scheduling.Observation`` (candidates from ``scheduling.candidates``: the models
announced within ``demand_window_s``, those consumed, resident or pinned; counts as
last counted; each runtime's loads, and models with a task running here that are not
on the device), turns it into the snapshot with ``scheduling.snapshot_of`` and
carries the decision out step by step with ``scheduling.actions_for``. Simulated
callers all have priority 0; a queue's plan still gives it its plan's priority.
"""

from __future__ import annotations

import math
import random
import sys
import zlib
from array import array
from collections import deque
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from functools import partial
from typing import cast

from modelfleet.scheduling import (
    Action,
    Observation,
    QueueFacts,
    ScoringSettings,
    actions_for,
    candidates,
    decide,
    decision_holds,
    keep_rank,
    snapshot_of,
)
from modelfleet.scheduling import work_waiting as scheduling_work_waiting
from modelfleet.scheduling.scoring import COLD_WINDOW_S
from modelfleet.sim.engine import Simulation
from modelfleet.sim.pull_state import PAUSING, RESCORING, WAITING, Consumer, Coordinator
from modelfleet.sim.starved import StarvedRanks
from modelfleet.sim.worker import CacheFactory, SimWorker, Task, gdsf_with_host, lru_device_only


class PullAffinity:
    """Pull-affinity with modelfleet's cache (GDSF, demoting to host memory); with
    ``device_only_lru`` it runs the push routers' cache instead (an ablation that
    isolates what the routing alone is worth)."""

    name = "pull-affinity"

    def __init__(self, settings: ScoringSettings | None = None, rng_seed: int = 0,
                 device_only_lru: bool = False) -> None:
        self.device_only_lru = device_only_lru
        if device_only_lru:
            self.name = "pull-affinity-lru"
        self.settings = settings if settings is not None else ScoringSettings()
        self.rng_seed = rng_seed
        self._sim: Simulation | None = None
        self._queues: list[deque[Task]] = []
        self._nonempty: set[int] = set()
        self._consumers: list[list[Consumer]] = []  # per model, in subscription order
        self._turn: list[int] = []
        self._coords: list[Coordinator] = []
        self._delivered: dict[int, Consumer] = {}  # request index -> the consumer it came by
        self._parked: dict[int, int] = {}  # model -> requests waiting for an answer
        self._announced: dict[int, float] = {}  # model -> last announcement (gateway)
        self._demand: dict[int, float] = {}  # model -> last announcement heard (workers)
        self._demand_log: deque[tuple[float, int]] = deque()
        # The models that entered or left _demand, in order, from position
        # _demand_moves_offset on (what no worker will read again is dropped:
        # _trim_demand_moves). A worker's last gathering notes the position it saw.
        self._demand_moves: list[int] = []
        self._demand_moves_offset = 0
        # Every announcement heard, in order, from position _heard_offset on (what no
        # worker will read again is dropped: _trim_heard). Positions count from the first.
        self._heard_log: list[int] = []
        self._heard_offset = 0
        self._heard_at: dict[int, int] = {}  # model -> its last position in the log
        self._heard_before = array("q")  # per entry of _heard_log: the model's previous one
        # Workers (by index) that folded what they heard (_fold_heard), in the order of
        # their last fold: their heard_upto never decreases along it.
        self._folded: dict[int, None] = {}
        self._names: tuple[str, ...] = ()
        self._facts: list[QueueFacts] = []  # per model: what its queue view carries
        # The same by model id, for every model: what an observation's facts are read
        # from (snapshot_of looks up only the counted ones, so the whole table serves).
        self._facts_by_name: dict[str, QueueFacts] = {}
        self._cap: list[int] = []  # per model: consumers at its fan-out cap (_heard)
        self._rank_priority: list[int] = []  # per model: snapshot_of's rank by priority
        # Per model, what a count of its queue says now: (ready, consumers), kept by
        # _dispatch, which every change of a queue or of its consumers goes through.
        self._qstate: list[tuple[int, int]] = []
        self._consumed: set[int] = set()  # models with a consumer
        self._capped: set[int] = set()  # ... as many as its fan-out cap (_cap)
        # Workers (by index) an announcement can wake: a permit free, and neither paused
        # before a re-score nor already due to re-score again when this one ends.
        self._wakeable: set[int] = set()
        self._announce_interval_s = 0.0
        self._announce_s = 0.0

    @property
    def sim(self) -> Simulation:
        assert self._sim is not None, "attach() first"
        return self._sim

    def cache_factory(self, device_budget_bytes: int, host_budget_bytes: int) -> CacheFactory:
        if self.device_only_lru:
            return lru_device_only(device_budget_bytes)
        return gdsf_with_host(device_budget_bytes, host_budget_bytes)

    def attach(self, sim: Simulation) -> None:
        self._sim = sim
        cfg = sim.config
        models = len(sim.catalog.names)
        self._names = sim.catalog.names
        self._queues = [deque() for _ in range(models)]
        self._consumers = [[] for _ in range(models)]
        self._turn = [0] * models
        self._qstate = [(0, 0)] * models
        self._announce_interval_s = cfg.announce_interval_s
        self._announce_s = cfg.broker_costs.announce_s
        cat = sim.catalog
        batch = max(1, cfg.batch_size)
        # Simulated callers all have the default priority (0); a queue's plan still
        # gives it its plan's priority (ScoringSettings.plan_priority), as on a worker.
        self._facts = [QueueFacts(cat.fanout_max_workers[m], cat.plans[m], m in cat.pinned,
                                  batch, f"runtime-{cat.runtime[m]}") for m in range(models)]
        self._facts_by_name = dict(zip(self._names, self._facts, strict=True))
        self._rank_priority = [-max(self.settings.priority(f.plan), f.priority)
                               for f in self._facts]
        # Per model, the consumers a count must show for an announcement not to wake a
        # worker (the coordinator's _at_cap): its fan-out cap; a pinned model has none,
        # nor any model in the wake_at_cap ablation.
        self._cap = [sys.maxsize if f.pinned or cfg.wake_at_cap else
                     self.settings.fanout_cap(f.fanout_max_workers, f.plan)
                     for f in self._facts]
        levels = [frozenset(m for m in range(models) if self._rank_priority[m] == level)
                  for level in sorted(set(self._rank_priority))]
        for worker in sim.workers:
            rng = random.Random(zlib.crc32(f"{self.rng_seed}/{worker.name}".encode()))
            coord = Coordinator(worker, rng, meter_since=cfg.warmup_s, meter_free=worker.permits)
            coord.ranks = StarvedRanks(worker.name, self.settings, self.rng_seed,
                                       self._rank_priority, self._names, levels)
            self._coords.append(coord)
            self._note_wakeable(coord)
            # Workers started together: each first tick somewhere in the first period.
            coord.generation += 1
            generation = coord.generation
            coord.tick_at = rng.uniform(0.0, cfg.rescore_s)
            sim.after(coord.tick_at, partial(self._timeout, coord, generation))
        sim.after(cfg.announce_interval_s, self._announce_waiting)

    def window_stats(self) -> tuple[float, int]:
        for coord in self._coords:
            self._meter(coord)
        return sum(c.idle_permit_s for c in self._coords), sum(c.rescores for c in self._coords)

    # --- the gateway ------------------------------------------------------------------------

    def on_arrival(self, task: Task) -> None:
        model = task[1]
        self._parked[model] = self._parked.get(model, 0) + 1
        self._queues[model].append(task)
        self._nonempty.add(model)
        self._dispatch(model)
        self._announce(model)

    def on_answered(self, index: int, model: int) -> None:
        left = self._parked.get(model, 0) - 1
        if left > 0:
            self._parked[model] = left
        else:
            self._parked.pop(model, None)

    def _announce(self, model: int) -> None:
        now = self.sim.now
        if now - self._announced.get(model, -1e9) < self._announce_interval_s:
            return
        self._announced[model] = now
        self.sim.after(self._announce_s, lambda: self._heard(model))

    def _announce_waiting(self) -> None:
        sim = self.sim
        for model in list(self._parked):
            self._announce(model)
        self._trim_heard()
        self._trim_demand_moves()
        if sim.now < sim.config.duration_s + sim.config.deadline_s:
            sim.after(sim.config.announce_interval_s, self._announce_waiting)

    def _heard(self, model: int) -> None:
        """Every worker's event listener gets a demand announcement, and takes it as the
        coordinator's ``_listen_events`` does: a model it does not pull, not already to be
        counted (``dirty``) and not last counted at its fan-out cap is to be counted
        afresh at the next re-score, and wakes it if a permit is free. Once per model
        until it is counted: gateways re-announce every model with a request waiting,
        and in a fleet most of them are other workers' to serve.

        A worker folds what it heard into ``dirty`` from the log when it next needs it
        (``_fold_heard``). Whether ``model`` is dirty already needs no fold: it is if it
        is in ``dirty``, or if it was heard since the worker's last fold and passed then,
        which it did if it passes now (nothing the test reads changed since that fold)."""
        now = self.sim.now
        if model not in self._demand:
            self._demand_moves.append(model)
        self._demand[model] = now
        self._demand_log.append((now, model))
        log = self._heard_log
        before = self._heard_at.get(model, -1)  # its previous entry in the log
        if self.sim.config.event_rescores:
            coords = self._coords
            # Those with a free permit, in worker order; one paused before a re-score, or
            # re-scoring and due to again, would not change (_wake): not asked. Nor one
            # that has not folded since the model's previous entry (before >= its
            # heard_upto, below): those that have are the last to fold (_folded's tail).
            # Under load few workers are wakeable and most have folded since: the shorter
            # of the two walks gives the same workers.
            wakeable = self._wakeable
            if before < 0:
                asked = sorted(wakeable)
            elif len(wakeable) < len(self._folded) // 4:
                asked = sorted(i for i in wakeable if coords[i].heard_upto > before)
            else:
                asked = []
                for index in reversed(self._folded):
                    if coords[index].heard_upto <= before:
                        break
                    if index in wakeable:
                        asked.append(index)
                asked.sort()
            for index in asked:
                coord = coords[index]
                if model in coord.consumers:
                    continue  # a held queue is counted anyway
                if before >= coord.heard_upto or model in coord.at_cap or (
                        before >= coord.dirty_from and model not in coord.not_taken):
                    continue  # to be counted already (if it passes now, it passed then)
                self._wake(coord)  # (before < heard_upto: in dirty iff before >= dirty_from)
        self._heard_at[model] = self._heard_offset + len(log)
        log.append(model)
        self._heard_before.append(before)

    def _fold_heard(self, coord: Coordinator) -> None:
        """Announcements heard since the last fold, each taken as ``_heard`` describes:
        those of models not pulled here and not last counted at their fan-out cap are
        dirty. Exact, not an approximation of taking each when heard: everything this
        reads (the consumers, the counts) is folded before it changes (``_subscribed``,
        ``_unsubscribe``, ``_count``, and ``_gather`` before a ``_set_count``), so it
        reads what was there when each was heard."""
        upto = coord.heard_upto
        end = self.heard_end()
        if upto == end:
            return
        coord.heard_upto = end
        folded = self._folded
        folded.pop(coord.worker.index, None)
        folded[coord.worker.index] = None  # the last to fold, at the end
        # Heard since upto: those held here or at the cap are not taken now; the others
        # are dirty, whatever they were. What was not taken stays so unless heard again
        # and taken; one not taken now stays dirty if it was already.
        # From the stretch heard when it is the shorter (a small fleet, where many
        # queues sit at their cap), else from those held or at the cap (a large one).
        not_taken = coord.not_taken
        if end - upto <= len(coord.consumers) + len(coord.at_cap) + len(not_taken):
            offset = self._heard_offset
            heard = set(self._heard_log[upto - offset:])
            taken = heard - coord.consumers.keys()
            taken -= coord.at_cap
            not_taken -= taken
            skipped: Iterable[int] = heard - taken
        else:
            heard_at = self._heard_at
            skip = coord.consumers.keys() | coord.at_cap
            not_taken = coord.not_taken = {m for m in not_taken
                                           if heard_at[m] < upto or m in skip}
            skipped = [m for m in skip if heard_at.get(m, -1) >= upto]
        for m in skipped:
            if not self._heard_within(m, coord.dirty_from, upto):
                not_taken.add(m)

    def _heard_within(self, model: int, start: int, end: int) -> bool:
        """Is an announcement of ``model`` in ``_heard_log[start:end]``?"""
        position = self._heard_at.get(model, -1)
        before, offset = self._heard_before, self._heard_offset
        while position >= end:
            position = before[position - offset]
        return position >= start

    def heard_end(self) -> int:
        """The position the next announcement heard takes in the log."""
        return self._heard_offset + len(self._heard_log)

    def _trim_heard(self) -> None:
        """Drop the announcements before every worker's ``dirty_from`` (no worker reads
        them again: a fold reads from its ``heard_upto``, a dirty set from its
        ``dirty_from``) once they are half the log: a fleet's gateways announce every
        model with a request waiting four times a second."""
        start = min((coord.dirty_from for coord in self._coords), default=0)
        drop = start - self._heard_offset
        if drop > len(self._heard_log) // 2:
            del self._heard_log[:drop]
            del self._heard_before[:drop]
            self._heard_offset = start

    def dirty(self, coord: Coordinator) -> set[int]:
        """The queues ``coord`` is to count afresh at its next woken re-score: heard since
        its last count (as folded), neither held here nor at the cap when heard."""
        offset = self._heard_offset
        # A woken re-score asks twice (what to count, then the counts): the models heard
        # up to the first ask are kept until the count, and only what came since is read.
        heard_upto, heard = coord.heard_cache
        if heard is None:
            heard = set(self._heard_log[coord.dirty_from - offset:coord.heard_upto - offset])
        elif heard_upto < coord.heard_upto:
            heard.update(self._heard_log[heard_upto - offset:coord.heard_upto - offset])
        coord.heard_cache = (coord.heard_upto, heard)
        return heard - coord.not_taken

    def _forget_dirty(self, coord: Coordinator) -> None:
        coord.dirty_from = coord.heard_upto
        coord.not_taken = set()
        coord.heard_cache = (0, None)

    # --- the broker -------------------------------------------------------------------------

    def _dispatch(self, model: int) -> None:
        queue = self._queues[model]
        consumers = self._consumers[model]
        while queue and consumers:
            open_ = [c for c in consumers if c.held < c.window]
            if not open_:
                break
            consumer = open_[self._turn[model] % len(open_)]
            self._turn[model] += 1
            task = queue.popleft()
            consumer.held += 1
            self._delivered[task[0]] = consumer
            consumer.buffer.append(task)
            if consumer.blocked is None:
                self._take(self._coords[consumer.owner], consumer)
        if not queue:
            self._nonempty.discard(model)
        self._qstate[model] = (len(queue), len(consumers))
        if len(consumers) >= self._cap[model]:
            self._capped.add(model)
        else:
            self._capped.discard(model)
        if consumers:
            self._consumed.add(model)
        else:
            self._consumed.discard(model)

    def _requeue_front(self, model: int, task: Task) -> None:
        self._delivered.pop(task[0], None)
        self._queues[model].appendleft(task)
        self._nonempty.add(model)

    # --- the coordinator: consuming -----------------------------------------------------------

    def _take(self, coord: Coordinator, consumer: Consumer) -> None:
        """The consume loop: take deliveries and start them while permits are free."""
        worker = coord.worker
        while consumer.blocked is None and consumer.buffer and not consumer.cancelled:
            task = consumer.buffer.popleft()
            if worker.in_flight < worker.permits and not coord.waiters:
                self._start(coord, task)
            else:
                consumer.blocked = task
                coord.waiters.append(consumer)

    def _start(self, coord: Coordinator, task: Task) -> None:
        self._meter(coord)
        coord.version += 1
        self.sim.start(coord.worker, task)
        coord.meter_free = coord.worker.free_permits
        self._note_wakeable(coord)

    def _note_wakeable(self, coord: Coordinator) -> None:
        """Keep ``_wakeable`` (announcements wake only workers with a free permit, and a
        wake changes nothing for one paused or already due to re-score again): called
        wherever a permit is taken (``_start``) or given back (``on_settled``) and
        wherever the re-score loop's state changes."""
        if coord.worker.in_flight < coord.worker.permits and (
                coord.state == WAITING or (coord.state == RESCORING and not coord.changed)):
            self._wakeable.add(coord.worker.index)
        else:
            self._wakeable.discard(coord.worker.index)

    def on_settled(self, worker: SimWorker, task: Task) -> None:
        coord = self._coords[worker.index]
        coord.version += 1  # its tasks (and what it served) changed
        self._note_wakeable(coord)
        self._meter(coord)
        coord.meter_free = worker.free_permits
        consumer = self._delivered.pop(task[0], None)
        if consumer is not None:
            consumer.held -= 1
            if not consumer.cancelled:
                self._dispatch(consumer.model)
        # The semaphore hands the permit to the longest waiter.
        while coord.waiters and worker.in_flight < worker.permits:
            waiter = coord.waiters.popleft()
            blocked, waiter.blocked = waiter.blocked, None
            if blocked is None or waiter.cancelled:
                continue
            self._start(coord, blocked)
            self._take(coord, waiter)
        if coord.untaken or coord.held_backlog:
            # A permit (and maybe a load slot) is free while work waits: elsewhere, or in
            # a held queue whose window may be too small for what waits there now.
            self._wake(coord)

    def on_free(self, worker: SimWorker) -> None:
        return None  # deliveries flow by the broker and the semaphore, not by polling

    def on_tick(self, worker: SimWorker) -> None:
        return None

    def _meter(self, coord: Coordinator) -> None:
        """Close the idle-permit stretch since the last observation (window only)."""
        cfg = self.sim.config
        now = min(self.sim.now, cfg.duration_s)
        start = max(coord.meter_since, cfg.warmup_s)
        if coord.waiting and coord.meter_free > 0 and now > start:
            coord.idle_permit_s += coord.meter_free * (now - start)
        coord.meter_since = max(coord.meter_since, now)

    # --- the coordinator: the re-score loop -----------------------------------------------------

    def _wake(self, coord: Coordinator) -> None:
        if not self.sim.config.event_rescores:
            return  # the ablation: re-score on the periodic tick only
        if coord.state == WAITING:
            coord.generation += 1  # the pending timeout no longer counts
            coord.state = PAUSING
            self._note_wakeable(coord)
            pause = coord.rng.uniform(0.0, self.sim.config.rescore_jitter_s)
            self.sim.after(pause, lambda: self._rescore(coord))
        elif coord.state == RESCORING:
            coord.changed = True  # seen when this re-score ends
            self._note_wakeable(coord)

    def _timeout(self, coord: Coordinator, generation: int) -> None:
        if generation == coord.generation and coord.state == WAITING:
            self._rescore(coord)

    def _rescore(self, coord: Coordinator) -> None:
        """One re-score: a tick (every candidate counted) if one is due, else woken."""
        sim = self.sim
        full = sim.now >= coord.tick_at
        if full:
            coord.tick_at = sim.now + sim.config.rescore_s * coord.rng.uniform(0.75, 1.25)
        coord.state = RESCORING
        coord.changed = False
        self._note_wakeable(coord)
        costs = sim.config.broker_costs
        count_all = full or sim.config.recount_on_wake
        count_s = costs.count_s * self._to_count(coord, count_all)
        if full or sim.now - coord.refreshed_at >= sim.config.residency_max_age_s:
            # The runtimes' stats, one round trip each (CPU on both ends), then the counts;
            # woken re-scores reuse stats a few milliseconds old.
            def counted() -> None:
                self._refresh(coord)
                sim.after(count_s, lambda: self._observed(coord, count_all))
            sim.work(coord.worker, sim.config.stats_s * len(coord.worker.runtimes), counted,
                     "serve")
        else:
            sim.after(count_s, lambda: self._observed(coord, count_all))

    def _refresh(self, coord: Coordinator) -> None:
        """What the runtimes' ``stats`` say: device, host, and loading per runtime. What
        did not change since the last stats keeps its objects (the decision's key
        compares them first by identity)."""
        runtimes = coord.worker.runtimes
        old_device, old_host, old_loading = coord.residency
        old_device_names, old_host_names = coord.residency_names
        # No reserve or commit on any runtime's cache since the last stats: the same ids.
        stamps = [runtime.cache_changes for runtime in runtimes]
        if stamps == coord.cache_stamps:
            device, host = old_device, old_host
            device_names, host_names = old_device_names, old_host_names
        else:
            coord.cache_stamps = stamps
            device, host, device_names, host_names = self._resident(coord)
        loading = [set(runtime.loading) for runtime in runtimes]
        if loading == old_loading:
            loading = old_loading
        if device is not old_device or host is not old_host or loading is not old_loading:
            coord.version += 1
        coord.residency = (device, host, loading)
        coord.residency_names = (device_names, host_names)
        coord.refreshed_at = self.sim.now

    def _resident(self, coord: Coordinator
                  ) -> tuple[set[int], set[int], frozenset[str], frozenset[str]]:
        """Device and host residents of the runtimes' caches (indices, then names); the
        last stats' objects where they did not change."""
        ids = [runtime.cache.resident_ids() for runtime in coord.worker.runtimes]
        if len(ids) == 1:
            device_names, host_names = ids[0]
        else:
            device_names = frozenset().union(*(d for d, _ in ids))
            host_names = frozenset().union(*(h for _, h in ids))
        old_device, old_host, _ = coord.residency
        old_device_names, old_host_names = coord.residency_names
        index_of = self.sim.index_of
        if device_names == old_device_names:
            device, device_names = old_device, old_device_names
        else:
            device = {index_of[n] for n in device_names}
        if host_names == old_host_names:
            host, host_names = old_host, old_host_names
        else:
            host = {index_of[n] for n in host_names}
        return device, host, device_names, host_names

    def _to_count(self, coord: Coordinator, full: bool) -> int:
        """How many queues this re-score counts (their cost; the counts come later)."""
        self._fold_heard(coord)
        if not full:
            return len(self.dirty(coord) | coord.held_backlog)
        self._expire_demand()
        extra = sum(1 for m in coord.consumers if m not in self._demand)
        return len(self._demand) + extra

    def _expire_demand(self) -> None:
        sim = self.sim
        horizon = sim.now - sim.config.demand_window_s
        log = self._demand_log
        while log and log[0][0] < horizon:
            seen, model = log.popleft()
            if self._demand.get(model) == seen:
                del self._demand[model]
                self._demand_moves.append(model)

    def _observed(self, coord: Coordinator, full: bool) -> None:
        sim = self.sim
        self._expire_demand()
        self._count(coord, full)
        now = sim.now
        window = math.floor(now / self.settings.noise_hold_s)
        recent = coord.worker.recent_cold
        last = coord.last_result
        # Nothing _gather reads changed since a decision that holds: the gathering, its
        # key and so the decision would be the same (no need to gather to know it).
        reuse = (coord.last_key is not None and last is not None
                 and self._gathering_stands(coord, window)
                 and not (recent and now - recent[0] >= COLD_WINDOW_S)
                 and self._last_holds(coord))
        if not reuse:
            counted = self._gather(coord)
            key = self._observed_key(coord, counted)
            coord.gathered = (coord.version, self._demand_moves_end(), window)
            # Nothing this worker observes changed since its last decision (within one
            # noise window, its recent cold subscriptions the same) but the instant, and
            # that decision holds at every later instant (scheduling.decision_holds):
            # decide again would give the same answer. Its CPU is still spent.
            reuse = key == coord.last_key and last is not None and self._last_holds(coord)
        if reuse:
            assert last is not None
            snapshot, decision, waiting, untaken, steps_for = last
        else:
            observation = self._observation_of(coord, counted)
            snapshot = snapshot_of(observation, self.settings, self.rng_seed)
            decision = decide(snapshot, self.settings, self.rng_seed)
            waiting = scheduling_work_waiting(snapshot, self.settings, True)
            untaken = waiting if sim.config.wake_on_held_backlog else \
                scheduling_work_waiting(snapshot, self.settings, False)
            steps_for = actions_for(decision, snapshot, self.settings)
            coord.last_key = key
            coord.last_holds = None  # asked only when an observation could reuse it
            coord.last_result = (snapshot, decision, waiting, untaken, steps_for)
            coord.worker.scores = dict(decision.scores)
        self._meter(coord)
        coord.waiting = waiting
        coord.untaken = untaken
        if not sim.config.recount_held_backlog:
            coord.held_backlog = set()
        elif coord.held_backlog_at != coord.version:
            # Only a change of the consumers or of a held queue's count changes it, and
            # each bumps the version: held queues are gathered, and a recount of a
            # gathered queue bumps it (_moves_gathering).
            coord.held_backlog = self._backlogged(coord, coord.consumers.keys())
            coord.held_backlog_at = coord.version
        coord.meter_free = coord.worker.free_permits
        now = sim.now
        if sim.config.warmup_s <= now <= sim.config.duration_s:
            coord.rescores += 1
        # The coordinator builds and scores a view of every candidate, not just these.
        # (rescore_cpu_per_model_s: a build whose re-score walked the whole catalog.)
        cpu_s = (sim.config.decide_cpu_s + sim.config.decide_cpu_per_queue_s
                 * self._candidate_count(coord)
                 + sim.config.rescore_cpu_per_model_s * len(self._names))
        steps = deque(steps_for)
        sim.work(coord.worker, cpu_s, lambda: self._act(coord, steps), "serve")

    def _gathering_stands(self, coord: Coordinator, window: int) -> bool:
        """Would ``_gather`` gather the same as last time? Yes if nothing it reads of this
        worker changed (``coord.version``), the noise window is the same, and no model
        that entered or left the demand since is one it reads: counted here, gathered
        last time, or loading or running here (``_gather`` asks the demand of no other)."""
        if coord.gathered is None:
            return False
        version, demand_at, gathered_window = coord.gathered
        if version != coord.version or gathered_window != window:
            return False
        moves = self._demand_moves
        start = demand_at - self._demand_moves_offset
        if start == len(moves):
            return True
        counts, gathered = coord.counts, coord.gathered_models
        running, seen_loading = coord.worker.running, coord.residency[2]
        for model in moves[start:]:
            if model in counts or model in gathered or model in running or any(
                    model in loading for loading in seen_loading):
                return False
        return True

    def _demand_moves_end(self) -> int:
        """The position the next model to enter or leave the demand takes."""
        return self._demand_moves_offset + len(self._demand_moves)

    def _trim_demand_moves(self) -> None:
        """Drop the demand's moves before every worker's last gathering (none reads
        them again) once they are half the list."""
        start = min((coord.gathered[1] for coord in self._coords if coord.gathered),
                    default=self._demand_moves_end())
        drop = start - self._demand_moves_offset
        if drop > len(self._demand_moves) // 2:
            del self._demand_moves[:drop]
            self._demand_moves_offset = start

    def _last_holds(self, coord: Coordinator) -> bool:
        """``scheduling.decision_holds`` of the last decision, asked once, when first
        needed: only a re-score whose observation is that decision's can reuse it."""
        if coord.last_holds is None:
            assert coord.last_result is not None
            snapshot, decision = coord.last_result[:2]
            coord.last_holds = decision_holds(snapshot, decision, self.settings,
                                              self.rng_seed)
        return coord.last_holds

    def _observed_key(self, coord: Coordinator, counted: dict[int, tuple[int, int]]
                      ) -> tuple[object, ...]:
        """What a decision depends on besides the instant: the observation's fields that
        change (the others are fixed per worker and model), by model index, the noise
        window, and how many tasks this worker has finished (``last_served`` is updated
        in place). Equal keys, equal observations (``_observation_of``) but for ``now``."""
        worker = coord.worker
        device, host, seen_loading = coord.residency
        return (math.floor(self.sim.now / self.settings.noise_hold_s), worker.served,
                counted, worker.subscriptions, device, host, seen_loading,
                dict(worker.running), tuple(worker.recent_cold), worker.free_permits,
                coord.windows.copy())

    def _own(self, coord: Coordinator) -> set[int]:
        """The candidates that are not there by demand alone: held, resident, pinned."""
        device, host, _ = coord.residency
        return candidates((), coord.consumers, device, host, self.sim.catalog.pinned)

    def _candidate_count(self, coord: Coordinator) -> int:
        """How many queues ``scheduling.candidates`` gives the coordinator (every runtime
        here takes work): those announced within the window, plus its own."""
        own = coord.own
        end = self._demand_moves_end()
        memo = coord.own_outside_demand
        if memo is not None and memo[0] is own and not self._moved_since(own, memo[1]):
            outside = memo[2]  # the same own candidates, none of them in or out since
        else:
            # set.difference takes a dict as it is (a lookup per own candidate).
            outside = len(own.difference(self._demand))
        coord.own_outside_demand = (own, end, outside)
        return len(self._demand) + outside

    def _moved_since(self, models: set[int], position: int) -> bool:
        """Did any of ``models`` enter or leave the demand from ``position`` on? (True if
        that stretch was trimmed.)"""
        start = position - self._demand_moves_offset
        if start < 0:
            return True
        return any(model in models for model in self._demand_moves[start:])

    @staticmethod
    def _backlogged(coord: Coordinator, models: AbstractSet[int]) -> set[int]:
        """Those of ``models`` last counted with a backlog."""
        found = models & coord.counts.keys()
        return found - coord.empty  # (set.__sub__ walks the smaller; -= walks empty)

    def _set_count(self, coord: Coordinator, model: int) -> tuple[int, int]:
        """Count ``model``'s queue now (the broker's answer) and keep it as last counted.
        The caller has folded what was heard (``_fold_heard``): it was heard by the
        counts before this one."""
        count = (len(self._queues[model]), len(self._consumers[model]))
        if coord.counts.get(model) != count:
            coord.version += 1
        coord.counts[model] = count
        if count[1] >= self._cap[model]:
            coord.at_cap.add(model)
        else:
            coord.at_cap.discard(model)
        if count[0] > 0:
            coord.empty.discard(model)
            if count[1] == 0:
                coord.fed.discard(model)
            else:
                coord.fed.add(model)
        else:
            coord.empty.add(model)
            coord.fed.discard(model)
        return count

    def _count(self, coord: Coordinator, full: bool) -> None:
        """The broker's counts, as the coordinator asks for them: every candidate at a
        tick (but an empty queue in demand only, which cannot change the decision), else
        what was announced since and the held queues last seen with a backlog."""
        if not coord.residency[2]:  # never asked yet
            self._refresh(coord)
        device, host, _ = coord.residency
        demand = self._demand
        if full:
            # Every candidate is counted now: what was folded into dirty before this
            # re-score began is forgotten, what was heard since is dirty (by the counts
            # it was heard with, so folded before they are replaced).
            self._forget_dirty(coord)
            self._fold_heard(coord)
            # What _set_count does per model, over the sets at once (_qstate, _nonempty,
            # _consumed and _capped say what a count says now): this runs per worker per
            # tick over every candidate.
            old = coord.counts
            own = candidates((), coord.consumers, device, host, self.sim.catalog.pinned)
            models = list(own)
            models.extend((self._nonempty & demand.keys()) - own)
            counts = coord.counts = dict(zip(models, map(self._qstate.__getitem__, models),
                                             strict=True))
            now_counted = counts.keys()
            coord.at_cap = now_counted & self._capped
            # The counted beyond own are all backlogged (of _nonempty).
            coord.empty = own - self._nonempty
            coord.fed = (now_counted & self._consumed) & self._nonempty
            # empty and fed follow from the counts: equal counts, nothing changed.
            if counts != old:
                coord.version += 1
            return
        self._fold_heard(coord)  # what was heard while the stats were asked, too
        # What _set_count does, over a set at once: this runs per worker per announcement.
        counted = self.dirty(coord) & demand.keys()
        counted.update(coord.held_backlog & coord.consumers.keys())  # held, last with backlog
        if not counted:  # nothing to count: the sets below stay as they are
            self._forget_dirty(coord)
            return
        models = list(counted)
        fresh = list(map(self._qstate.__getitem__, models))
        last = list(map(coord.counts.get, models))
        if fresh != last and self._moves_gathering(coord, models, last, fresh):
            coord.version += 1
        coord.counts.update(zip(models, fresh, strict=True))
        coord.at_cap -= counted
        coord.at_cap |= counted & self._capped
        waiting = counted & self._nonempty  # _nonempty: the queues not empty
        coord.empty |= counted
        coord.empty -= waiting
        coord.fed -= counted
        coord.fed |= waiting & self._consumed
        self._forget_dirty(coord)

    @staticmethod
    def _moves_gathering(coord: Coordinator, models: list[int],
                         last: list[tuple[int, int] | None],
                         fresh: list[tuple[int, int]]) -> bool:
        """Can these recounts (``models``, from ``last`` to ``fresh``) change what the
        next ``_gather`` gathers, so what it decides on? Only through a model it gathered
        last time, or, when it looked at cold queues (a loader had room), through a
        queue with a backlog before or after (what makes one cold, fed or starved, and
        ranks the starved). A queue that stays empty and was not gathered is not read
        (the other counts' changes, and the rest of what ``_gather`` reads, bump
        ``coord.version`` themselves)."""
        gathered = coord.gathered_models
        looked_cold = coord.gathered_cold
        for model, before, after in zip(models, last, fresh, strict=True):
            if before == after:
                continue
            if model in gathered:
                return True
            if looked_cold and (after[0] > 0 or (before is not None and before[0] > 0)):
                return True
        return False

    def observation(self, coord: Coordinator) -> Observation:
        """What this worker's coordinator knows now (``scheduling.Observation``): the
        counts of its candidates as last counted (one never counted is counted now, as
        the coordinator does), its runtimes' last stats, its tasks."""
        return self._observation_of(coord, self._gather(coord))

    def _gather(self, coord: Coordinator) -> dict[int, tuple[int, int]]:
        """The candidates' counts the observation carries, by model index.

        Of the candidates (scheduling.candidates), only those that can matter
        (scheduling.cannot_matter): held, warm here (device, host, pinned, loading) or
        last counted with a backlog. snapshot_of leaves the others out itself, so the
        snapshot is the same; this keeps the gathering O(what matters), not O(demand).
        A cold queue (not own, not loading here) on a runtime whose loader has no free
        slot cannot matter either (snapshot_of drops it): the loader's room is what
        worker_view makes of the stats' loading and the tasks running off the device.
        Nor can starved cold queues (nothing consumes them, as last counted) beyond a
        runtime's free slots: snapshot_of keeps the best ``room`` of them by scoring's
        own rank; so does this, from fewer views."""
        worker = coord.worker
        device, _, seen_loading = coord.residency
        counts = coord.counts
        demand = self._demand
        own = coord.own = self._own(coord)
        runtime_of = self.sim.catalog.runtime
        busy = [set(models) for models in seen_loading]
        for m in worker.running:
            if m not in device:
                busy[runtime_of[m]].add(m)
        room = [r.loaders - len(b) for r, b in zip(worker.runtimes, busy, strict=True)]
        gather = set(own)
        for models in busy:
            gather.update(m for m in models if m in demand or m in own)
        coord.gathered_cold = any(slots > 0 for slots in room)
        if coord.gathered_cold:
            cold = self._backlogged(coord, demand.keys())
            cold -= gather  # own, and loading here in demand
            for models in busy:
                cold -= models
            starved = cold - coord.fed
            cold &= coord.fed
            if len(room) == 1:
                gather |= cold
                self._claimable(coord, starved, room[0], gather)
            else:
                by_runtime: list[set[int]] = [set() for _ in room]
                for m in starved:
                    by_runtime[runtime_of[m]].add(m)
                gather.update(m for m in cold if room[runtime_of[m]] > 0)
                for slots, waiting in zip(room, by_runtime, strict=True):
                    if slots > 0:
                        self._claimable(coord, waiting, slots, gather)
        coord.gathered_models = gather
        gathered = list(gather)
        found = list(map(counts.get, gathered))
        counted: dict[int, tuple[int, int]]
        if None in found:
            self._fold_heard(coord)  # before _set_count changes the counts
            counted = {}
            for model, count in zip(gathered, found, strict=True):
                if count is None:
                    if model in demand:
                        continue  # in demand, never counted: an empty queue (see _count)
                    count = self._set_count(coord, model)
                counted[model] = count
        else:
            counted = dict(zip(gathered, cast(list[tuple[int, int]], found), strict=True))
        now = self.sim.now
        while worker.recent_cold and now - worker.recent_cold[0] >= COLD_WINDOW_S:
            worker.recent_cold.popleft()
            coord.version += 1
        return counted

    def _observation_of(self, coord: Coordinator, counted: dict[int, tuple[int, int]]
                        ) -> Observation:
        worker = coord.worker
        names = self._names
        facts_of = self._facts
        device, _, seen_loading = coord.residency
        runtimes = worker.runtimes
        # By name, in the order of counted (zip and map: this runs per decision).
        ids = map(names.__getitem__, counted)
        return Observation(
            self.sim.now, worker.name, dict(zip(ids, counted.values(), strict=True)),
            self._facts_by_name,  # every model's: snapshot_of reads the counted ones
            subscriptions=worker.subscriptions,  # the names of coord.consumers' models
            resident_device=coord.residency_names[0],
            resident_host=coord.residency_names[1],
            load_slots={r.name: r.loaders for r in runtimes},
            loading={r.name: frozenset(names[m] for m in models)
                     for r, models in zip(runtimes, seen_loading, strict=True)},
            loading_for_tasks={names[m]: facts_of[m].runtime for m in worker.running
                               if m not in device},
            running={names[m]: n for m, n in worker.running.items()},
            last_served=worker.last_served,
            recent_cold_subscribes=tuple(worker.recent_cold),
            free_permits=worker.free_permits, permits_cap=worker.permits,
            prefetch={names[m]: w for m, w in coord.windows.items()},
            outranked_by=self._outranked_by(coord, counted))

    def _outranked_by(self, coord: Coordinator, counted: dict[int, tuple[int, int]]
                      ) -> dict[str, int]:
        """Observation.outranked_by: per held queue over its cap, the other consumers
        ranked ahead of this worker (the simulated fleet knows them all at once)."""
        over: dict[str, int] = {}
        for model in coord.consumers:
            count, facts = counted.get(model), self._facts[model]
            if count is None or facts.pinned or count[1] <= self.settings.fanout_cap(
                    facts.fanout_max_workers, facts.plan):
                continue
            model_id = self._names[model]
            mine = keep_rank(coord.worker.name, model_id)
            over[model_id] = sum(
                1 for c in self._consumers[model] if c.owner != coord.worker.index
                and keep_rank(self._coords[c.owner].worker.name, model_id) < mine)
        return over

    def _claimable(self, coord: Coordinator, starved: set[int], slots: int,
                   gather: set[int]) -> None:
        """Add to ``gather`` the ``slots`` best of ``starved`` (all of them if no more)."""
        if len(starved) <= slots:
            gather |= starved
            return
        assert coord.ranks is not None
        gather.update(coord.ranks.best(starved, coord.counts, slots, self.sim.now))

    def _act(self, coord: Coordinator, steps: deque[Action]) -> None:
        """Carry ``scheduling.actions_for`` out step by step, each after what it waits for."""
        sim = self.sim
        costs = sim.config.broker_costs
        index_of = sim.index_of
        while steps:
            action = steps.popleft()
            model = index_of[action.model_id]
            if action.kind == "unsubscribe":
                self._unsubscribe(coord, model)
            elif action.kind == "prefetch":
                consumer = coord.consumers.get(model)
                if consumer is not None and consumer.window != action.window:
                    consumer.window = coord.windows[model] = action.window
                    coord.version += 1
                    self._dispatch(model)
            elif action.cold:
                # A fresh count first: another worker may have taken it since the snapshot.
                sim.after(costs.count_s, partial(self._cold, coord, model, action, steps))
                return
            else:
                sim.after(costs.subscribe_s, partial(self._subscribed, coord, model,
                                                     action.window, steps))
                return
        self._rescored(coord)

    def _cold(self, coord: Coordinator, model: int, action: Action,
              steps: deque[Action]) -> None:
        sim = self.sim
        if action.still_open(len(self._consumers[model])):
            coord.worker.recent_cold.append(sim.now)
            coord.version += 1
            sim.after(sim.config.broker_costs.subscribe_s,
                      lambda: self._subscribed(coord, model, action.window, steps))
        else:
            self._act(coord, steps)

    def _subscribed(self, coord: Coordinator, model: int, window: int,
                    steps: deque[Action]) -> None:
        if model not in coord.consumers:
            self._fold_heard(coord)  # heard while not held here: by the consumers then
            coord.version += 1
            consumer = Consumer(model, max(1, window), coord.worker.index)
            coord.consumers[model] = consumer
            coord.windows[model] = consumer.window
            coord.worker.subscriptions = coord.worker.subscriptions | {self._names[model]}
            self._consumers[model].append(consumer)
            self._dispatch(model)
        self._act(coord, steps)

    def _unsubscribe(self, coord: Coordinator, model: int) -> None:
        if model not in coord.consumers:
            return
        self._fold_heard(coord)  # heard while held here: by the consumers then
        consumer = coord.consumers.pop(model)
        del coord.windows[model]
        coord.version += 1
        coord.worker.subscriptions = coord.worker.subscriptions - {self._names[model]}
        consumer.cancelled = True
        self._consumers[model].remove(consumer)
        # The broker takes back what was never taken out of the buffer (each to the
        # head, as the embedded broker does), then the loop's own delivery goes back.
        while consumer.buffer:
            task = consumer.buffer.popleft()
            consumer.held -= 1
            self._requeue_front(model, task)
        if consumer.blocked is not None:
            task, consumer.blocked = consumer.blocked, None
            consumer.held -= 1
            self._requeue_front(model, task)
            coord.waiters.remove(consumer)
        self._dispatch(model)

    def _rescored(self, coord: Coordinator) -> None:
        sim = self.sim
        if sim.now >= coord.tick_at or coord.changed:
            # The tick came during the re-score (due now, no pause), or a wake did.
            coord.state = PAUSING
            self._note_wakeable(coord)
            pause = 0.0 if sim.now >= coord.tick_at else \
                coord.rng.uniform(0.0, sim.config.rescore_jitter_s)
            sim.after(pause, lambda: self._rescore(coord))
            return
        coord.state = WAITING
        self._note_wakeable(coord)
        coord.generation += 1
        generation = coord.generation
        if sim.now > sim.config.duration_s + sim.config.deadline_s:
            return
        sim.after(coord.tick_at - sim.now, lambda: self._timeout(coord, generation))

