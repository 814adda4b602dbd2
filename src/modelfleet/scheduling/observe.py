"""Observe: the snapshot ``decide`` gets, built from what a worker knows. Pure.

The worker coordinator (``worker/coordinator.py``) gathers an :class:`Observation` from
the broker's counts, its runtimes' stats, the demand it heard and its own tasks; the
simulator (``sim/pull.py``) gathers the same from its models. Both turn it into a
:class:`~modelfleet.scheduling.step.Snapshot` with :func:`snapshot_of`, so what the
simulator predicts is decided on what the worker would see.

Cost: O(counted candidates + running tasks), never O(catalog): the caller gathers
counts only for :func:`candidates`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import TypeVar

from modelfleet.scheduling.scoring import QueueScorer
from modelfleet.scheduling.settings import ScoringSettings
from modelfleet.scheduling.step import Snapshot
from modelfleet.scheduling.views import QueueView, WorkerView

_Id = TypeVar("_Id", bound=Hashable)  # a model id, or the simulator's model index


@dataclass(frozen=True, slots=True)
class QueueFacts:
    """What the catalog and the demand say of one model's queue (the broker says the rest)."""

    fanout_max_workers: int = 2
    plan: str = "free"
    pinned: bool = False  # by its manifest or an operator, and not unloaded
    batch_size: int = 1
    runtime: str = ""  # the runtime of this worker that would run it
    priority: int = 0  # the highest plan priority among its recent callers


@dataclass(frozen=True, slots=True)
class Observation:
    """Everything one worker knows at ``now`` that its decision depends on."""

    now: float
    worker_id: str
    # Candidates as last counted: model id -> (ready messages, consumers). A candidate
    # missing here has no queue (or was never counted) and is left out.
    counts: Mapping[str, tuple[int, int]]
    facts: Mapping[str, QueueFacts]  # one per counted candidate
    subscriptions: frozenset[str] = frozenset()
    resident_device: frozenset[str] = frozenset()
    resident_host: frozenset[str] = frozenset()
    # Per runtime of this worker: its load slots, and what its stats said it was loading.
    load_slots: Mapping[str, int] = field(default_factory=dict)
    loading: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # Models with a task running here and not on the device: being loaded for it, on
    # this runtime (before the runtime's next stats say so).
    loading_for_tasks: Mapping[str, str] = field(default_factory=dict)
    running: Mapping[str, int] = field(default_factory=dict)
    last_served: Mapping[str, float] = field(default_factory=dict)
    recent_cold_subscribes: tuple[float, ...] = ()
    free_permits: int = 1
    permits_cap: int = 1
    prefetch: Mapping[str, int] = field(default_factory=dict)
    # Held queues over their fan-out cap -> how many of the other consumers this worker
    # knows of outrank it to keep the queue (QueueView.outranked_by); a held queue over
    # its cap missing here steps back at random.
    outranked_by: Mapping[str, int] = field(default_factory=dict)


def candidates(demand: Iterable[_Id], subscriptions: Iterable[_Id], device: Iterable[_Id],
               host: Iterable[_Id], pinned: Iterable[_Id]) -> set[_Id]:
    """The queues a worker counts and scores: announced within the demand window, held,
    resident here (either tier), or pinned. Each caller then keeps those whose runtime
    can take work now."""
    found = set(demand)
    found.update(subscriptions)
    found.update(device)
    found.update(host)
    found.update(pinned)
    return found


def cannot_matter(backlog: int, held: bool, warm: bool) -> bool:
    """A queue not held, not warm here (device, host, loading, pinned), with nothing
    waiting: no rule of scoring takes it, and no task of it waits. ``snapshot_of``
    leaves it out; a caller may skip gathering its facts."""
    return not held and not warm and backlog <= 0


def worker_view(obs: Observation) -> WorkerView:
    loading: Mapping[str, AbstractSet[str]] = obs.loading
    if obs.loading_for_tasks:  # else the stats' loading as it is (read, not changed)
        with_tasks = {name: set(models) for name, models in obs.loading.items()}
        for model_id, runtime in obs.loading_for_tasks.items():
            with_tasks.setdefault(runtime, set()).add(model_id)
        loading = with_tasks
    return WorkerView(
        obs.worker_id, obs.subscriptions, obs.resident_device, obs.resident_host,
        obs.last_served, obs.recent_cold_subscribes, obs.free_permits, obs.permits_cap,
        frozenset().union(*loading.values()),
        loader_room={name: slots - len(loading.get(name, ()))
                     for name, slots in obs.load_slots.items()},
        running=obs.running, prefetch=obs.prefetch)


_VIEWS_MAX = 1 << 15
# Views already built, by (model id, backlog, consumers), each with the facts it was built
# from: a worker re-scoring many times a second sees mostly the same counts again. A view
# is a pure function of those and its facts, so a hit is the view that would be built.
_views: dict[tuple[str, int, int], tuple[QueueFacts, QueueView]] = {}
_by_model_id = attrgetter("model_id")


def _view(model_id: str, backlog: int, consumers: int, facts: QueueFacts) -> QueueView:
    key = (model_id, backlog, consumers)
    known = _views.get(key)
    if known is not None and (known[0] is facts or known[0] == facts):
        return known[1]
    view = QueueView(model_id, backlog, consumers, facts.fanout_max_workers, facts.plan,
                     facts.pinned, facts.batch_size, facts.runtime, facts.priority)
    if len(_views) >= _VIEWS_MAX:
        _views.clear()
    _views[key] = (facts, view)
    return view


def snapshot_of(obs: Observation, settings: ScoringSettings, rng_seed: int) -> Snapshot:
    """The snapshot of ``obs``, sorted by model id, without the queues that cannot change
    the decision nor :func:`~modelfleet.scheduling.work_waiting`'s answer:

    - not held, not warm here (device, host, loading, pinned) and nothing waiting;
    - not held, not warm, on a runtime whose loader has no free slot (scoring admits a
      cold queue only with a slot, and ``work_waiting`` skips it too);
    - starved and cold beyond the free slots of its runtime: scoring admits starved
      cold queues by priority, then score, one per slot; those past the slots could
      only ever be "no-capacity", and the ones kept already make work wait.
    """
    worker = worker_view(obs)
    room = worker.loader_room or {}
    # Warm here: on the device, in host memory or loading (asked of each, not of their
    # union: most counted queues are held, and need not ask).
    device, host, loading = worker.resident_device, worker.resident_host, worker.loading
    queues: list[QueueView] = []
    starving: dict[str, list[QueueView]] = {}
    subscriptions = worker.subscriptions
    facts_of = obs.facts
    outranked_by = obs.outranked_by
    views = _views
    for model_id, (backlog, consumers) in obs.counts.items():
        facts = facts_of.get(model_id)
        if facts is None:
            continue
        held = model_id in subscriptions
        cold = not held and not facts.pinned and model_id not in device \
            and model_id not in host and model_id not in loading
        # cannot_matter(backlog, held, not cold), inlined: this loop is the hot path.
        if (cold and backlog <= 0) or (cold and room.get(facts.runtime, 0) <= 0):
            continue
        # _view, its hit written out (this loop is the hot path).
        known = views.get((model_id, backlog, consumers))
        if known is not None and (known[0] is facts or known[0] == facts):
            view = known[1]
        else:
            view = _view(model_id, backlog, consumers, facts)
        if held and outranked_by:
            ahead = outranked_by.get(model_id)
            if ahead is not None:
                view = replace(view, outranked_by=ahead)
        if cold and consumers == 0:
            starving.setdefault(facts.runtime, []).append(view)
        else:
            queues.append(view)
    if starving:
        scorer = QueueScorer(worker, settings, obs.now, rng_seed)

        def rank(queue: QueueView) -> tuple[int, float, str]:  # scoring's _admit_cold
            return (-max(settings.priority(queue.plan), queue.priority),
                    -scorer.score(queue, 0.0), queue.model_id)

        for runtime, waiting in starving.items():
            slots = room.get(runtime, 0)
            if len(waiting) > slots:
                waiting.sort(key=rank)
                del waiting[slots:]
            queues.extend(waiting)
    queues.sort(key=_by_model_id)
    return Snapshot(obs.now, tuple(queues), worker)
