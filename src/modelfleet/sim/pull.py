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

The parts, one module each: the state (``pull_state``), the announcements heard and
what each worker takes of them (``pull_heard``), counting and gathering for a re-score
(``pull_gather``), carrying a decision out (``pull_act``); this module joins them.
"""

from __future__ import annotations

import math
import random
import sys
import zlib
from array import array
from collections import deque
from collections.abc import Mapping
from functools import partial

from modelfleet.scheduling import (
    Observation,
    QueueFacts,
    ScoringSettings,
    actions_for,
    decide,
    decision_holds,
    snapshot_of,
)
from modelfleet.scheduling import work_waiting as scheduling_work_waiting
from modelfleet.scheduling.scoring import COLD_WINDOW_S
from modelfleet.sim.engine import Simulation
from modelfleet.sim.lane import LANE, ColdLane
from modelfleet.sim.placement import PlacedFacts, SpreadPlacement
from modelfleet.sim.pull_act import PullActing
from modelfleet.sim.pull_state import PAUSING, RESCORING, WAITING, Consumer, Coordinator
from modelfleet.sim.starved import StarvedRanks
from modelfleet.sim.wakeable import WakeableWorkers
from modelfleet.sim.worker import CacheFactory, SimWorker, Task, lru_device_only, with_host


class PullAffinity(PullActing):
    """Pull-affinity with modelfleet's cache (GDSF, demoting to host memory); with
    ``device_only_lru`` it runs the push routers' cache instead (an ablation that
    isolates what the routing alone is worth)."""

    name = "pull-affinity"

    def __init__(self, settings: ScoringSettings | None = None, rng_seed: int = 0,
                 device_only_lru: bool = False, eviction_policy: str = "tinylfu") -> None:
        self.device_only_lru = device_only_lru
        self.eviction_policy = eviction_policy  # the runtimes' (runtime.eviction_policy)
        if device_only_lru:
            self.name = "pull-affinity-lru"
        self.settings = settings if settings is not None else ScoringSettings()
        self.rng_seed = rng_seed
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
        self._names: tuple[str, ...] = ()
        self._facts: list[QueueFacts] = []  # per model: what its queue view carries
        # The same by model id, for every model: what an observation's facts are read
        # from (snapshot_of looks up only the counted ones, so the whole table serves).
        self._facts_by_name: dict[str, QueueFacts] = {}
        # Per worker, with spread placement: its facts, each on its model's home now.
        self._placed_facts: list[PlacedFacts] = []
        self._cap: list[int] = []  # per model: consumers at its fan-out cap (_heard)
        self._fanout_caps: list[int] = []  # per model: its fan-out cap (pinned: none)
        self._rank_priority: list[int] = []  # per model: snapshot_of's rank by priority
        # Per model, what a count of its queue says now: (ready, consumers), kept by
        # _dispatch, which every change of a queue or of its consumers goes through.
        self._qstate: list[tuple[int, int]] = []
        # Per model in _demand with a backlog (in _nonempty), its _qstate: what a tick's
        # count of the backlogged candidates says, kept as each changes (_dispatch, and
        # a model entering or leaving the demand) for every worker to copy.
        self._backlog_in_demand: dict[int, tuple[int, int]] = {}
        self._consumed: set[int] = set()  # models with a consumer
        self._capped: set[int] = set()  # ... as many as its fan-out cap (_cap)
        # Workers (by index) an announcement can wake: a permit free, and neither paused
        # before a re-score nor already due to re-score again when this one ends; kept in
        # the order of how far each has folded what it heard (_heard asks a tail of them).
        self._wakeable = WakeableWorkers()
        self._announce_interval_s = 0.0
        self._announce_s = 0.0
        self._lane: ColdLane | None = None  # the cold lane (cold_lane_per_model > 0)
        # With the lane: the models whose own queue was ever published to (exists; the
        # broker's idle expiry, minutes, is longer than a run). Without it every model a
        # worker holds came from its queue.
        self._queued: set[int] = set()

    def cache_factory(self, device_budget_bytes: int, host_budget_bytes: int) -> CacheFactory:
        if self.device_only_lru:
            return lru_device_only(device_budget_bytes)
        return with_host(self.eviction_policy, device_budget_bytes, host_budget_bytes)

    def attach(self, sim: Simulation) -> None:
        self.sim = sim
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
        if isinstance(sim.placement, SpreadPlacement):
            self._placed_facts = [
                PlacedFacts(self._facts, sim.index_of, sim.placement.homes(worker),
                            len(worker.runtimes)) for worker in sim.workers]
        self._rank_priority = [-max(self.settings.priority(f.plan), f.priority)
                               for f in self._facts]
        # Per model, the consumers a count must show for an announcement not to wake a
        # worker (the coordinator's _at_cap): its fan-out cap; a pinned model has none,
        # nor any model in the wake_at_cap ablation.
        self._cap = [sys.maxsize if f.pinned or cfg.wake_at_cap else
                     self.settings.fanout_cap(f.fanout_max_workers, f.plan)
                     for f in self._facts]
        self._fanout_caps = [sys.maxsize if f.pinned else
                             self.settings.fanout_cap(f.fanout_max_workers, f.plan)
                             for f in self._facts]
        levels = [frozenset(m for m in range(models) if self._rank_priority[m] == level)
                  for level in sorted(set(self._rank_priority))]
        for worker in sim.workers:
            rng = random.Random(zlib.crc32(f"{self.rng_seed}/{worker.name}".encode()))
            coord = Coordinator(worker, rng, meter_since=cfg.warmup_s, meter_free=worker.permits)
            coord.load_slots = {r.name: r.loaders for r in worker.runtimes}
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
        if cfg.cold_lane_per_model > 0:
            self._lane = ColdLane(self, cfg.cold_lane_per_model)

    def window_stats(self) -> tuple[float, int]:
        for coord in self._coords:
            self._meter(coord)
        return sum(c.idle_permit_s for c in self._coords), sum(c.rescores for c in self._coords)

    # --- the gateway ------------------------------------------------------------------------

    def on_arrival(self, task: Task) -> None:
        model = task[1]
        self._parked[model] = self._parked.get(model, 0) + 1
        if self._lane is not None and self._lane.takes(model):
            self._lane.send(task)  # in no model's queue: nothing to announce
            return
        self._queues[model].append(task)
        if self._lane is not None:
            self._queued.add(model)
        self._nonempty.add(model)
        self._dispatch(model)
        self._announce(model)

    def on_answered(self, index: int, model: int) -> None:
        if self._lane is not None:
            self._lane.answered(index, model)
        left = self._parked.get(model, 0) - 1
        if left > 0:
            self._parked[model] = left
        else:
            self._parked.pop(model, None)

    def _announce(self, model: int) -> None:
        now = self.sim.now
        if now - self._announced.get(model, -1e9) < self._announce_interval_s:
            return
        if self._lane is not None and \
                self._parked.get(model, 0) <= self._lane.waiting.get(model, 0):
            return  # all of them in the cold lane
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
        state = self._qstate[model] = (len(queue), len(consumers))
        if not queue:
            self._nonempty.discard(model)
            self._backlog_in_demand.pop(model, None)
        elif model in self._demand:
            self._backlog_in_demand[model] = state
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
        if self._lane is not None:
            self._lane.started(coord, task)
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
            self._wakeable.add(coord.worker.index, coord.heard_upto)
        else:
            self._wakeable.discard(coord.worker.index)

    def on_settled(self, worker: SimWorker, task: Task) -> None:
        coord = self._coords[worker.index]
        coord.version += 1  # its tasks (and what it served) changed
        self._note_wakeable(coord)
        self._meter(coord)
        coord.meter_free = worker.free_permits
        consumer = self._delivered.pop(task[0], None)
        if consumer is not None and consumer.model == LANE:
            assert self._lane is not None
            self._lane.settled(worker, consumer, task)
        elif consumer is not None:
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

    def _to_count(self, coord: Coordinator, full: bool) -> int:
        """How many queues this re-score counts (their cost; the counts come later)."""
        self._fold_heard(coord)
        if not full:
            dirty = self.dirty(coord)
            held = coord.held_backlog
            return len(dirty | held) if held else len(dirty)
        self._expire_demand()
        extra = sum(1 for m in coord.consumers if m not in self._demand)
        return len(self._demand) + extra

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
            # Work waiting outside the held queues is work waiting: none at all, none there.
            untaken = waiting if sim.config.wake_on_held_backlog else \
                waiting and scheduling_work_waiting(snapshot, self.settings, False)
            steps_for = actions_for(decision, snapshot, self.settings)
            coord.last_key = key
            coord.last_holds = None  # asked only when an observation could reuse it
            coord.last_result = (snapshot, decision, waiting, untaken, steps_for)
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

    def _last_holds(self, coord: Coordinator) -> bool:
        """``scheduling.decision_holds`` of the last decision, asked once, when first
        needed: only a re-score whose observation is that decision's can reuse it."""
        if coord.last_holds is None:
            assert coord.last_result is not None
            snapshot, decision = coord.last_result[:2]
            coord.last_holds = decision_holds(snapshot, decision, self.settings,
                                              self.rng_seed)
        return coord.last_holds

    def observation(self, coord: Coordinator) -> Observation:
        """What this worker's coordinator knows now (``scheduling.Observation``): the
        counts of its candidates as last counted (one never counted is counted now, as
        the coordinator does), its runtimes' last stats, its tasks."""
        return self._observation_of(coord, self._gather(coord))

    def _observation_of(self, coord: Coordinator, counted: dict[int, tuple[int, int]]
                        ) -> Observation:
        worker = coord.worker
        names = self._names
        facts: Mapping[str, QueueFacts] = \
            self._placed_facts[worker.index] if self._placed_facts else self._facts_by_name
        device, _, seen_loading = coord.residency
        runtimes = worker.runtimes
        # By name, in the order of counted (zip and map: this runs per decision).
        ids = map(names.__getitem__, counted)
        # What changes less often than a decision is taken is kept by name with the
        # objects it was named from: those are replaced, never changed in place
        # (coord.windows; the stats' loading, _refresh).
        by_name = coord.by_name
        if by_name is None or by_name[0] is not seen_loading or by_name[1] is not coord.windows:
            by_name = coord.by_name = (
                seen_loading, coord.windows,
                {r.name: frozenset(names[m] for m in models)
                 for r, models in zip(runtimes, seen_loading, strict=True)},
                {names[m]: w for m, w in coord.windows.items()})
        return Observation(
            self.sim.now, worker.name, dict(zip(ids, counted.values(), strict=True)),
            facts,  # every model's: snapshot_of reads the counted ones
            subscriptions=worker.subscriptions,  # the names of coord.consumers' models
            resident_device=coord.residency_names[0],
            resident_host=coord.residency_names[1],
            load_slots=coord.load_slots,
            loading=by_name[2],
            loading_for_tasks={names[m]: facts[names[m]].runtime for m in worker.running
                               if m not in device},
            running={names[m]: n for m, n in worker.running.items()},
            last_served=worker.last_served,
            recent_cold_subscribes=tuple(worker.recent_cold),
            free_permits=worker.free_permits, permits_cap=worker.permits,
            prefetch=by_name[3],
            outranked_by=self._outranked_by(coord, counted))

    def _rescored(self, coord: Coordinator) -> None:
        sim = self.sim
        if self._lane is not None:
            self._lane.keep(coord)
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

