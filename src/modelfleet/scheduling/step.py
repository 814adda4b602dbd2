"""One decision of a worker: observe -> decide -> act, with the middle step pure.

The worker coordinator observes the broker and its runtimes into a :class:`Snapshot`,
calls :func:`decide`, and carries the :class:`Decision` out (subscribe, unsubscribe,
resize prefetch windows). The simulator builds the same snapshot from its own state
and calls the same function, so what it predicts is what the worker decides.
"""

from __future__ import annotations

import math
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
        # _window, written out with conditional expressions rather than max() and min()
        # (this runs per held queue per decision; the same integers).
        runs = running.get(model_id, 0)
        waiting = runs + queue.backlog
        wanted = share if share > waiting else waiting  # max(share, waiting)
        limit = runs + free
        wanted = limit if wanted > limit else wanted  # min(wanted, limit)
        least = queue.batch_size if queue.batch_size > 1 else 1  # max(1, batch_size)
        wanted = least if least > wanted else wanted  # max(least, wanted)
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


def decision_holds(snapshot: Snapshot, decision: Decision, settings: ScoringSettings,
                   rng_seed: int) -> bool:
    """Does ``decide(snapshot, settings, rng_seed)``, which gave ``decision``, give it at
    every later instant of the same noise window too?

    True when ``decide`` on the same snapshot at any later ``now`` of the same noise
    window (``noise_hold_s``), while the worker's recent cold subscriptions all still
    count (``cold_budget``), takes and drops the same queues with the same windows:
    what a caller that re-scores an unchanged snapshot may reuse. Only ``now`` moves
    then, and within a noise window it moves one term of a score, stickiness, which
    only decays: a score can only fall, and no lower than it is at the window's end.
    So, by the rule ``choose_queues`` applied to each queue (``decision.reasons``):
    a queue that is starved (scored without stickiness), has no stickiness left, or
    whose rule does not read its score (fan-out cap, over the cap, idle-cold, below
    the bar, dropped: a falling score stays there) holds; one taken or kept holds if
    its score at the window's end still meets the bar (and a held idle queue kept by
    its stickiness still has some), unless it is a cold take ranked by score against
    others while some were refused for capacity or the minute's budget.
    Conservative: anything else, or a snapshot larger than ``max_subscriptions``
    (the cap compares scores), says False. The scores the decision reports for
    debugging do move; the decision does not.
    """
    if len(snapshot.queues) > settings.max_subscriptions:
        return False
    worker = snapshot.worker
    served = worker.last_served
    if not served or settings.stickiness_weight == 0:
        return True
    now = snapshot.now
    window = settings.stickiness_window_s
    reasons = decision.reasons
    refused: bool | None = None  # were cold takes refused for capacity? (asked lazily)
    late: QueueScorer | None = None  # scores as at the noise window's end (or lower)
    scorer: QueueScorer | None = None  # warmth
    amplitude = settings.noise_amplitude
    for queue in snapshot.queues:
        at = served.get(queue.model_id)
        if at is None or now - at >= window:
            continue  # no stickiness now, nor later: it only decays
        if queue.backlog > 0 and queue.consumers == 0:
            continue  # starved: scored without stickiness
        reason = reasons.get(queue.model_id)
        if reason in ("fanout-cap", "over-cap", "idle-cold", "below-threshold", "dropped"):
            # No score read, or one that can only fall further below its bar. (A held
            # idle-cold queue with stickiness left was not worth keeping for reasons
            # that do not move: other consumers, or no free permit.)
            continue
        if reason not in ("warm", "pressure", "idle-join"):
            return False  # refused for capacity or budget: its rank may move
        if scorer is None:
            scorer = QueueScorer(worker, settings, now, rng_seed)
        heat = scorer.warmth(queue)
        held = queue.model_id in worker.subscriptions
        if heat > 0 and heat - amplitude >= (settings.drop_threshold if held
                                             else settings.subscribe_threshold):
            continue  # warm by more than the noise: no score of it can fall under its bar
        if late is None:
            late = _late_scorer(snapshot, settings, rng_seed)
        if held:
            if queue.backlog == 0 and heat <= 0 and late.stickiness(queue) <= 0:
                return False  # kept idle by its stickiness, which lapses
            if late.score(queue, heat) < settings.drop_threshold:
                return False
            continue
        if reason != "idle-join" and late.score(queue, heat) < settings.subscribe_threshold:
            return False
        if heat <= 0:
            if refused is None:
                refused = any(r in ("no-capacity", "rate-limited") and not (
                    q.backlog > 0 and q.consumers == 0)
                    for q in snapshot.queues for r in (reasons.get(q.model_id),))
            if refused:
                return False  # ranked by score against cold takes that were refused
    return True


def _late_scorer(snapshot: Snapshot, settings: ScoringSettings, rng_seed: int) -> QueueScorer:
    """A scorer of this noise window whose stickiness is what it will be at the window's
    end, a microsecond to spare (rounding): no lower score is reached within the window."""
    worker = snapshot.worker
    now = snapshot.now
    hold = settings.noise_hold_s
    shift = (math.floor(now / hold) + 1) * hold - now + 1e-6
    served = worker.last_served
    aged = {q.model_id: served[q.model_id] - shift for q in snapshot.queues
            if q.model_id in served}
    view = WorkerView(worker.worker_id, worker.subscriptions, worker.resident_device,
                      worker.resident_host, aged, loading=worker.loading)
    return QueueScorer(view, settings, now, rng_seed)
