"""One decision of a worker: observe -> decide -> act, with the middle step pure.

The worker coordinator observes the broker and its runtimes into a :class:`Snapshot`,
calls :func:`decide`, and carries the :class:`Decision` out (subscribe, unsubscribe,
resize prefetch windows). The simulator builds the same snapshot from its own state
and calls the same function, so what it predicts is what the worker decides.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelfleet.scheduling.scoring import QueueScorer, choose_queues, is_starving, loader_room
from modelfleet.scheduling.settings import ScoringSettings
from modelfleet.scheduling.views import Decision, QueueView, WorkerView


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one worker sees at ``now``: the queues that matter to it, and itself.

    ``queues`` holds every queue the worker consumes and every queue it could take
    (announced demand, resident or pinned models) whose runtime can run it now.
    """

    now: float
    queues: tuple[QueueView, ...]
    worker: WorkerView


def decide(snapshot: Snapshot, settings: ScoringSettings, rng_seed: int) -> Decision:
    """Which queues to take and drop, and the prefetch window of each held queue. Pure."""
    decision = choose_queues(snapshot.queues, snapshot.worker, settings, snapshot.now, rng_seed)
    held = decision.apply(snapshot.worker.subscriptions)
    queues = {q.model_id: q for q in snapshot.queues}
    windows: dict[str, int] = {}
    worker = snapshot.worker
    running = worker.running
    prefetch = worker.prefetch
    share = _share(worker, len(held))
    free = worker.free_permits
    for model_id in sorted(held):
        queue = queues.get(model_id)
        if queue is None:
            continue
        wanted = _window(running.get(model_id, 0), queue, share, free)
        current = prefetch.get(model_id)
        # Grow at once (a window smaller than what waits idles free permits); shrink only
        # once it halves, so that the window does not follow every task's start and end.
        if current is None or wanted > current or wanted * 2 <= current:
            windows[model_id] = wanted
    return Decision(decision.subscribe, decision.unsubscribe, decision.scores, decision.reasons,
                    decision.cold, windows)


def prefetch_window(queue: QueueView, worker: WorkerView, held: int) -> int:
    """How many unsettled tasks of ``queue`` this worker may hold at once.

    At least the model's batch size (a batch must be able to form) and a fair share of
    the permits (one hot model can fill an otherwise idle worker); more while tasks wait
    (what runs here plus what waits, so a burst is not fed one broker round trip at a
    time), but never more than runs here plus the permits free now: work this worker
    could not start stays in the queue, visible to other workers and the autoscaler.
    The permit semaphore, not the window, bounds what starts.

    A window grows as soon as more waits, and shrinks only when it halves (see
    :func:`decide`): on RabbitMQ a change costs a new consumer.
    """
    return _window(worker.running.get(queue.model_id, 0), queue, _share(worker, held),
                   worker.free_permits)


def _share(worker: WorkerView, held: int) -> int:
    """A fair share of the permits among ``held`` queues (rounded up)."""
    return -(-worker.permits_cap // max(1, held))


def _window(running: int, queue: QueueView, share: int, free: int) -> int:
    """:func:`prefetch_window` from its parts (``decide`` computes the share once)."""
    wanted = max(share, running + queue.backlog)
    return max(1, queue.batch_size, min(wanted, running + free))


def work_waiting(snapshot: Snapshot, settings: ScoringSettings, held_too: bool = True) -> bool:
    """Is a task waiting that this worker could start now? (held, starved, under its cap)

    A task for a model this worker would have to load counts only while the runtime
    that would load it has a free load slot: a worker whose loader is full cannot start
    it any sooner by taking it. While such a task waits and a permit is free, the permit
    idles: what ``modelfleet_worker_idle_permit_seconds_while_backlog_total`` integrates.
    ``held_too=False``: only in queues this worker does not consume (what a new
    decision could change; held queues deliver by themselves as permits free up).
    """
    worker = snapshot.worker
    room = loader_room(worker, settings)
    warm = worker.resident_device | worker.resident_host | worker.loading
    for queue in snapshot.queues:
        if queue.backlog <= 0:
            continue
        if queue.model_id not in warm and not queue.pinned and room.get(
                "" if worker.loader_room is None else queue.runtime, 0) <= 0:
            continue  # it would wait for the loader here as well as in its queue
        if queue.model_id in worker.subscriptions:
            if held_too:
                return True
            continue
        if is_starving(queue) or queue.pinned:
            return True
        if queue.consumers < settings.fanout_cap(queue.fanout_max_workers, queue.plan):
            return True
    return False


def decision_holds(snapshot: Snapshot, settings: ScoringSettings) -> bool:
    """Does :func:`decide` give this snapshot's decision at every later instant too?

    True when ``decide`` on the same snapshot at any later ``now`` of the same noise
    window (``noise_hold_s``), while the worker's recent cold subscriptions all still
    count (``cold_budget``), takes and drops the same queues with the same windows:
    what a caller that re-scores an unchanged snapshot may reuse. Only ``now`` moves
    then, and within a noise window it moves one term of a score, stickiness, which
    only decays. Conservative: False as soon as a decaying stickiness could move a
    comparison ``choose_queues`` makes, that is when a queue that is not starved (a
    starved queue's score has no stickiness) has stickiness left now and is either not
    warm here (its score meets the bars, and stickiness keeps an idle held queue) or
    warm but not by a margin (warmth less the noise amplitude below a bar), or when
    the snapshot is larger than ``max_subscriptions`` (the cap compares scores).
    The scores the decision reports for debugging do move; the decision does not.
    """
    if len(snapshot.queues) > settings.max_subscriptions:
        return False
    worker = snapshot.worker
    served = worker.last_served
    if not served or settings.stickiness_weight == 0:
        return True
    now = snapshot.now
    window = settings.stickiness_window_s
    bar = max(settings.subscribe_threshold, settings.drop_threshold)
    amplitude = settings.noise_amplitude
    scorer: QueueScorer | None = None
    for queue in snapshot.queues:
        at = served.get(queue.model_id)
        if at is None or now - at >= window:
            continue  # no stickiness now, nor later: it only decays
        if queue.backlog > 0 and queue.consumers == 0:
            continue  # starved: scored without stickiness
        if scorer is None:
            scorer = QueueScorer(worker, settings, now, 0)
        heat = scorer.warmth(queue)
        if heat > 0 and heat - amplitude >= bar:
            continue  # warm by more than any bar: no score of it can cross one
        return False
    return True
