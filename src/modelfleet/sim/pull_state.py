"""The state pull-affinity's simulator keeps per subscription and per worker: what the
broker knows of a consumer, and what a worker's coordinator knows and is doing
(``modelfleet.sim.pull`` runs them)."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from modelfleet.scheduling import Action, Decision, Snapshot
from modelfleet.sim.starved import StarvedRanks
from modelfleet.sim.worker import SimWorker, Task

# The re-score loop's states.
WAITING, PAUSING, RESCORING = range(3)


@dataclass(eq=False, slots=True)
class Consumer:
    """One subscription: the broker's side (window, unsettled) and the consume loop's."""

    model: int
    window: int
    owner: int  # the worker's index
    held: int = 0  # delivered, not settled: buffered, blocked on the semaphore, or running
    buffer: deque[Task] = field(default_factory=deque)
    blocked: Task | None = None  # the delivery its loop holds while waiting for a permit
    cancelled: bool = False


@dataclass(eq=False, slots=True)
class Coordinator:
    worker: SimWorker
    rng: random.Random
    consumers: dict[int, Consumer] = field(default_factory=dict)
    # Each held queue's window, in the order of consumers (kept with them: read per
    # re-score). Replaced on every change, never changed in place: a decision's key and
    # by_name keep the object.
    windows: dict[int, int] = field(default_factory=dict)
    load_slots: dict[str, int] = field(default_factory=dict)  # per runtime (fixed)
    # (the stats' loading, windows, and the two by name) as the last observation had them.
    by_name: tuple[list[set[int]], dict[int, int], dict[str, frozenset[str]],
                   dict[str, int]] | None = None
    waiters: deque[Consumer] = field(default_factory=deque)  # the permit semaphore's FIFO
    counts: dict[int, tuple[int, int]] = field(default_factory=dict)  # as last counted
    # Of counts, kept as the few exceptions (a fleet's worker counts tens of thousands of
    # backlogged queues, nearly all of them starved): those last counted with no backlog,
    # and those with a backlog and a consumer. The backlogged are the counts' others;
    # the starved (a backlog, no consumer anywhere), those of them not fed.
    empty: set[int] = field(default_factory=set)
    fed: set[int] = field(default_factory=set)
    at_cap: set[int] = field(default_factory=set)  # those of counts at their fan-out cap
    # The queues to count afresh at the next woken re-score (PullAffinity.dirty): the
    # models heard from dirty_from to heard_upto in PullAffinity._heard_log, but those in
    # not_taken (held here or at the cap whenever heard). Kept as a stretch of the shared
    # log, not a set of its own: the gateways re-announce every model with a request
    # waiting, so a set would hold most of those models per worker.
    dirty_from: int = 0
    not_taken: set[int] = field(default_factory=set)
    # The models heard from dirty_from to a position, while a woken re-score runs (None:
    # not asked since the last count).
    heard_cache: tuple[int, set[int] | None] = (0, None)
    heard_upto: int = 0  # announcements (PullAffinity._heard_log) folded so far
    held_backlog: set[int] = field(default_factory=set)  # held queues last seen with backlog
    held_backlog_at: int = -1  # the version held_backlog was found at
    changed: bool = False
    state: int = WAITING
    generation: int = 0  # invalidates a pending timeout when a wake comes first
    tick_at: float = 0.0  # when the next tick (a re-score counting every candidate) is due
    waiting: bool = False  # did the last snapshot see work waiting (scheduling.work_waiting)?
    untaken: bool = False  # ... in queues this worker does not consume (wakes on a task's end)
    refreshed_at: float = -1e9  # the runtimes' stats last asked
    residency: tuple[set[int], set[int], list[set[int]]] = (set(), set(), [])
    residency_names: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())
    # Each runtime's SimRuntime.cache_changes when its cache's ids were last asked.
    cache_stamps: list[int] = field(default_factory=list)
    # The last decision and what it was decided on (PullAffinity._observed_key).
    last_key: tuple[object, ...] | None = None
    last_result: tuple[Snapshot, Decision, bool, bool, tuple[Action, ...]] | None = None
    # Does that decision hold at every later instant of its noise window
    # (scheduling.decision_holds)? None: not asked yet (PullAffinity._last_holds).
    last_holds: bool | None = None
    # Idle-permit meter (modelfleet.worker.idle.IdleMeter), over the measured window.
    meter_since: float = 0.0
    meter_free: int = 0
    idle_permit_s: float = 0.0
    rescores: int = 0
    ranks: StarvedRanks | None = None  # its ranks of starved cold queues (set by attach)
    own: set[int] = field(default_factory=set)  # its own candidates, as last gathered
    # (worker.subscriptions, device, host, queues made, own) when own was last found
    # (_own; queues made: PullAffinity._queued's size, with the cold lane).
    own_of: tuple[frozenset[str], set[int], set[int], int, set[int]] | None = None
    # (own, PullAffinity._demand_moves_end(), how many of own are not in the demand).
    own_outside_demand: tuple[set[int], int, int] | None = None
    # Bumped by every change of what _gather and _observed_key read of this worker (its
    # counts, tasks, consumers and windows, residency, cold subscriptions): with the
    # noise window and the demand's models the same, the last gathering still stands.
    version: int = 0
    # The worker's placement moves (Placement.moves) as last seen: a move bumps version.
    placement_moves: int = 0
    # (version, PullAffinity._demand_moves_end(), noise window) at the last gathering.
    gathered: tuple[int, int, int] | None = None
    # What that gathering took: the models (counted or not), and whether it looked at
    # cold queues (a loader had room). A recount moves it only through these
    # (PullAffinity._moves_gathering).
    gathered_models: set[int] = field(default_factory=set)
    gathered_cold: bool = False
