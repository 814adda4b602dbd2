"""Which model queues a worker consumes: a pure function of a snapshot.

Only the worker knows what is warm in its memory, so each worker chooses its
own queues (routing is inverted: nobody pushes work at a worker). Every second
or so the coordinator takes a snapshot of the live queues and of itself and
calls :func:`choose_queues`; the simulator calls the same function.

Score of a queue = warmth + pressure + stickiness + noise:

- warmth: resident on this worker's device > in its host memory; pinned
  models are preloaded everywhere and count as device-warm;
- pressure: backlog per consumer, counting this worker as one (what each
  consumer would face if this worker joined), through log1p;
- stickiness: served here recently, decaying linearly over a window;
- noise: uniform per (worker, queue), derived from a hash of the seed, the ids
  and the current hold window, so it is pure and held fixed for the window.

Guardrails, each a rule below: the starvation override, hysteresis, the cold
subscription rate limit, the fan-out cap, and the subscription cap.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from typing import Any

from modelfleet.scheduling.settings import ScoringSettings
from modelfleet.scheduling.views import Decision, QueueView, Reason, WorkerView

COLD_WINDOW_S = 60.0  # the rate limit counts cold subscriptions over the last minute

_Scored = tuple[float, str]


def held_uniform(rng_seed: int, worker_id: str, model_id: str, bucket: int, salt: str) -> float:
    """A uniform number in [0, 1) fixed by its arguments (no hidden state, no salted hash).

    A pure function of its arguments, so it is memoised (bounded): a worker re-scoring
    many times within one noise window asks the same (worker, queue, window) again."""
    return _held_uniform(rng_seed, worker_id, bucket, salt, model_id)


@functools.lru_cache(maxsize=1 << 16)
def _held_uniform(rng_seed: int, worker_id: str, bucket: int, salt: str, model_id: str) -> float:
    return _fresh_uniform(rng_seed, worker_id, bucket, salt, model_id)


@functools.lru_cache(maxsize=1 << 12)
def _prefix(rng_seed: int, worker_id: str, bucket: int, salt: str) -> Any:
    """The hash of everything but the model id, fed once per (worker, window, salt): the
    caller hashes a copy of it (never this one) on with the model id, the same digest as
    hashing it all at once."""
    return hashlib.blake2b(f"{rng_seed}\x1f{worker_id}\x1f{bucket}\x1f{salt}\x1f".encode(),
                           digest_size=8)


# Scoring's noise by model id, one table per (seed, worker, noise window), filled as
# asked: a worker scores the same queues many times within a window, and a lookup by
# model id alone is cheaper than held_uniform's memo. Only the tables of the newest
# window seen and the one before it are kept (and never more than _NOISE_TABLES_MAX).
_NOISE_TABLES_MAX = 1 << 14
_noise_tables: dict[tuple[int, str, int], dict[str, float]] = {}
_newest_noise_bucket: list[int] = [-(1 << 62)]


def _noise_table(rng_seed: int, worker_id: str, bucket: int) -> dict[str, float]:
    """The table of ``held_uniform(rng_seed, worker_id, model_id, bucket, "noise")`` by
    model id for this worker and window, as far as it has been asked."""
    key = (rng_seed, worker_id, bucket)
    table = _noise_tables.get(key)
    if table is not None:
        return table
    if bucket > _newest_noise_bucket[0]:
        _newest_noise_bucket[0] = bucket
        for old in [k for k in _noise_tables if k[2] < bucket - 1]:
            del _noise_tables[old]
    if len(_noise_tables) >= _NOISE_TABLES_MAX:
        _noise_tables.clear()
    table = _noise_tables[key] = {}
    return table


def _fresh_uniform(rng_seed: int, worker_id: str, bucket: int, salt: str,
                   model_id: str) -> float:
    """``held_uniform``, hashed afresh (for callers that keep the values themselves)."""
    digest = _prefix(rng_seed, worker_id, bucket, salt).copy()
    digest.update(model_id.encode())
    return int.from_bytes(digest.digest(), "big") / 2.0**64


class QueueScorer:
    """Scores queues for one worker at one instant. Built once per decision: the
    settings are read once, not once per queue (the noise is ``held_uniform``'s)."""

    __slots__ = (
        "_bucket",
        "_device",
        "_device_w",
        "_host",
        "_host_w",
        "_loading",
        "_noise_amplitude",
        "_noise_of",
        "_now",
        "_pinned_w",
        "_pressure_scale",
        "_pressure_w",
        "_rng_seed",
        "_served",
        "_starvation",
        "_sticky_w",
        "_sticky_window",
        "_subscriptions",
        "_worker_id",
    )

    def __init__(self, worker: WorkerView, settings: ScoringSettings, now: float,
                 rng_seed: int) -> None:
        self._now = now
        self._device = worker.resident_device
        self._host = worker.resident_host
        self._loading = worker.loading
        self._subscriptions = worker.subscriptions
        self._served = worker.last_served
        self._device_w = settings.device_warmth_weight
        self._host_w = settings.host_warmth_weight
        self._pinned_w = settings.pinned_warmth_weight
        self._pressure_w = settings.pressure_weight
        self._pressure_scale = settings.pressure_scale
        self._sticky_w = settings.stickiness_weight
        self._sticky_window = settings.stickiness_window_s
        self._starvation = settings.starvation_score
        self._noise_amplitude = settings.noise_amplitude
        self._bucket = math.floor(now / settings.noise_hold_s)
        self._rng_seed = rng_seed
        self._worker_id = worker.worker_id
        self._noise_of = _noise_table(rng_seed, worker.worker_id, self._bucket)

    def warmth(self, queue: QueueView) -> float:
        """Device tier over host tier; pinned or loading here count as device-warm; else 0."""
        model_id = queue.model_id
        if model_id in self._device or model_id in self._loading:
            tier = self._device_w
        elif model_id in self._host:
            tier = self._host_w
        else:
            tier = 0.0
        return max(tier, self._pinned_w) if queue.pinned else tier

    def backlog_per_consumer(self, queue: QueueView) -> float:
        """Backlog divided among the consumers, counting this worker as one of them."""
        held = queue.model_id in self._subscriptions
        others = queue.consumers - 1 if held else queue.consumers
        return queue.backlog / (max(others, 0) + 1)

    def pressure(self, queue: QueueView) -> float:
        if queue.backlog <= 0:
            return 0.0
        return self._pressure_w * math.log1p(self.backlog_per_consumer(queue)
                                             / self._pressure_scale)

    def stickiness(self, queue: QueueView) -> float:
        served = self._served.get(queue.model_id)
        if served is None:
            return 0.0
        age = max(self._now - served, 0.0)
        return self._sticky_w * max(0.0, 1.0 - age / self._sticky_window)

    def noise(self, model_id: str) -> float:
        if self._noise_amplitude == 0:
            return 0.0
        return self._noise_amplitude * (2.0 * self._uniform(model_id) - 1.0)

    def _uniform(self, model_id: str) -> float:
        """``held_uniform`` of the noise for ``model_id`` (kept in this window's table)."""
        u = self._noise_of.get(model_id)
        if u is None:
            u = self._noise_of[model_id] = _fresh_uniform(
                self._rng_seed, self._worker_id, self._bucket, "noise", model_id)
        return u

    def fresh_noise(self, model_id: str) -> float:
        """``noise(model_id)``, hashed afresh, not through ``held_uniform``'s memo: for a
        caller that keeps each queue's noise for the window itself (the simulator ranks
        tens of thousands of starved queues per worker and window, far past the memo,
        whose bookkeeping then costs more than the hash)."""
        if self._noise_amplitude == 0:
            return 0.0
        u = _fresh_uniform(self._rng_seed, self._worker_id, self._bucket, "noise", model_id)
        return self._noise_amplitude * (2.0 * u - 1.0)

    def score(self, queue: QueueView, warmth: float) -> float:
        """The score of ``queue`` given its ``warmth`` (the starvation override included).

        ``pressure(queue) + noise(model_id)``, then ``stickiness``: the same operations
        in the same order, written out (this runs per queue per decision)."""
        model_id = queue.model_id
        backlog = queue.backlog
        if backlog <= 0:
            pressure = 0.0
        else:
            others = queue.consumers - 1 if model_id in self._subscriptions else queue.consumers
            pressure = self._pressure_w * math.log1p(backlog / (max(others, 0) + 1)
                                                     / self._pressure_scale)
        if self._noise_amplitude == 0:
            noise = 0.0
        else:
            # _uniform, its hit written out (this runs per queue per decision).
            u = self._noise_of.get(model_id)
            if u is None:
                u = self._uniform(model_id)
            noise = self._noise_amplitude * (2.0 * u - 1.0)
        base = pressure + noise
        if backlog > 0 and queue.consumers == 0:
            return self._starvation + base
        served = self._served.get(model_id)
        if served is None:
            stickiness = 0.0
        else:
            # stickiness(), with max() written as the comparison it makes (the same floats).
            age = self._now - served
            age = 0.0 if 0.0 > age else age  # max(age, 0.0)
            left = 1.0 - age / self._sticky_window
            stickiness = self._sticky_w * (left if left > 0.0 else 0.0)  # max(0.0, left)
        return warmth + stickiness + base


    def starving_score(self, backlog: int, noise: float) -> float:
        """``score`` of a starving queue this worker does not hold (``backlog`` > 0 waiting,
        no consumer anywhere), given its ``noise(model_id)``: the same operations in the
        same order, for a caller that ranks many such queues and keeps each one's noise
        for the window (the simulator's coordinator, ranking starved cold queues)."""
        pressure = self._pressure_w * math.log1p(backlog / 1 / self._pressure_scale)
        return self._starvation + (pressure + noise)


def noise(settings: ScoringSettings, rng_seed: int, worker_id: str, model_id: str,
          now: float) -> float:
    """The noise term of (worker, queue): in [-amplitude, amplitude), fixed per hold window."""
    return QueueScorer(WorkerView(worker_id), settings, now, rng_seed).noise(model_id)


def is_starving(queue: QueueView) -> bool:
    """Messages waiting and no consumer anywhere."""
    return queue.backlog > 0 and queue.consumers == 0


def _steps_back(queue: QueueView, cap: int, worker_id: str, rng_seed: int,
                bucket: int) -> bool:
    """Does this worker leave a queue it holds with more consumers than ``cap``?

    When it knows who else consumes the queue, it leaves if ``cap`` or more of them
    outrank it (``ranks.keep_rank``): two workers that took a cap-1 queue in the same instant
    agree which one keeps it, so the queue is never left with nobody (which would let a
    third worker take it, cold). Knowing nothing of the others, it leaves with the share
    of consumers over the cap, drawn afresh each noise window."""
    if queue.outranked_by is not None:
        return queue.outranked_by >= cap
    shed = (queue.consumers - cap) / queue.consumers
    return held_uniform(rng_seed, worker_id, queue.model_id, bucket, "shed") < shed


def score_queue(queue: QueueView, worker: WorkerView, settings: ScoringSettings, now: float,
                rng_seed: int) -> float:
    """The score of one queue for one worker (the starvation override included)."""
    scorer = QueueScorer(worker, settings, now, rng_seed)
    return scorer.score(queue, scorer.warmth(queue))


def cold_budget(worker: WorkerView, settings: ScoringSettings, now: float) -> int:
    """Cold subscriptions this worker may still make in the current minute."""
    recent = sum(1 for t in worker.recent_cold_subscribes if now - t < COLD_WINDOW_S)
    return max(settings.cold_subscribes_per_minute - recent, 0)


def choose_queues(queues: Sequence[QueueView], worker: WorkerView, settings: ScoringSettings,
                  now: float, rng_seed: int) -> Decision:
    """Decide which queues this worker starts and stops consuming. Pure.

    ``queues`` must include every queue this worker holds; a held queue missing
    from it has expired and is dropped. Pulling is *work-conserving*: the rate
    limit and hysteresis stop a busy worker from thrashing, they never keep a
    worker with free permits away from tasks that wait. Rules, in order of
    precedence:

    1. Starvation: a queue with messages and no consumer scores
       ``starvation_score``. Cold starved queues are claimed while the runtime
       that would load them has a free load slot (each claim takes one), and
       they bypass the cold rate limit: the rate limit exists to stop a
       stampede onto a queue others already serve, and a starved queue stops
       being starved for everyone the moment one worker takes it. Gating on
       the loader does not starve it: the first worker whose loader frees up
       takes it (the coordinator re-scores when a load or a task ends while
       work waits), and on a worker whose loader is busy it would only have
       waited behind that load.
    2. Fan-out cap: no new subscription to a queue with ``cap`` consumers;
       a held queue with more than ``cap`` consumers is dropped with
       probability excess/consumers (a coin held fixed per noise window), so
       workers that raced past the cap converge back to it without
       coordinating and without all leaving at once. Pinned queues are exempt.
    3. Idle-cold: a queue with no backlog for a model not resident here is not
       worth a new subscription. A held one is dropped too, unless this worker
       is its only consumer, has a free permit and served it within the
       stickiness window: then the next task for it starts here at once
       instead of waiting for a demand announcement and a re-score, and no
       other worker's warmth is competed with.
    4. Hysteresis: take at ``subscribe_threshold``, drop below ``drop_threshold``.
    5. Idle join: a queue below the bar but under its fan-out cap, with at
       least ``idle_join_backlog`` tasks waiting per consumer, is taken by a
       worker that has a free permit (its consumers are full, or the tasks
       would not wait), exempt from the cold rate limit.
    6. Cold capacity and rate limit: new cold subscriptions need a free load
       slot on their runtime; those taken under pressure also need a free
       permit and fit the per-minute budget. When slots or permits are scarce,
       queues of a higher priority are taken first, then the higher score: the
       priority of the queue's plan (``ScoringSettings.plan_priority``) or of its
       recent callers' plans (``QueueView.priority``), whichever is higher.
    7. Subscription cap: the ``max_subscriptions`` best scores survive.
    """
    scores: dict[str, float] = {}
    reasons: dict[str, Reason] = {}
    kept: list[_Scored] = []
    take_warm: list[_Scored] = []
    take_cold: list[_Scored] = []
    take_starving: list[_Scored] = []
    idle_join: set[str] = set()
    unsubscribe: set[str] = set()
    bucket = math.floor(now / settings.noise_hold_s)
    scorer = QueueScorer(worker, settings, now, rng_seed)
    caps: dict[tuple[int, str], int] = {}  # settings.fanout_cap, per (fan-out, plan)

    def cap_of(queue: QueueView) -> int | None:
        """The queue's fan-out cap (None: pinned), asked only where a rule reads it."""
        if queue.pinned:
            return None
        cap_key = (queue.fanout_max_workers, queue.plan)
        cap = caps.get(cap_key)
        if cap is None:
            cap = caps[cap_key] = settings.fanout_cap(*cap_key)
        return cap

    cold_views: dict[str, QueueView] = {}  # what _admit_cold ranks: starved or cold takes
    subscriptions = worker.subscriptions
    # QueueScorer.warmth, inlined (this loop runs per queue per decision).
    device, loading, host = worker.resident_device, worker.loading, worker.resident_host
    device_w, host_w = settings.device_warmth_weight, settings.host_warmth_weight
    pinned_w = settings.pinned_warmth_weight
    score_of = scorer.score
    drop_threshold = settings.drop_threshold

    for queue in queues:
        model_id = queue.model_id
        held = model_id in subscriptions
        if model_id in device or model_id in loading:
            heat = device_w
        elif model_id in host:
            heat = host_w
        else:
            heat = 0.0
        if queue.pinned:
            heat = max(heat, pinned_w)
        score = score_of(queue, heat)
        scores[model_id] = score
        warm = heat > 0

        if held:
            # A cap is at least 1: a queue with one consumer (this worker) is not over it.
            if queue.consumers > 1:
                cap = cap_of(queue)
                if cap is not None and queue.consumers > cap and _steps_back(
                        queue, cap, worker.worker_id, rng_seed, bucket):
                    unsubscribe.add(model_id)
                    reasons[model_id] = "over-cap"
                    continue
            if queue.backlog == 0 and not warm and not _worth_keeping_idle(queue, worker,
                                                                            scorer):
                unsubscribe.add(model_id)
                reasons[model_id] = "idle-cold"
            elif score < drop_threshold:
                unsubscribe.add(model_id)
                reasons[model_id] = "dropped"
            else:
                kept.append((score, model_id))
                reasons[model_id] = "warm" if warm else "pressure"
            continue

        if is_starving(queue):
            if warm:
                take_warm.append((score, model_id))
            else:
                take_starving.append((score, model_id))
                cold_views[model_id] = queue
            reasons[model_id] = "starving"
        elif queue.backlog == 0 and not warm:
            reasons[model_id] = "idle-cold"
        elif queue.consumers > 0 and (cap := cap_of(queue)) is not None \
                and queue.consumers >= cap:
            reasons[model_id] = "fanout-cap"
        elif score < settings.subscribe_threshold:
            if (worker.free_permits > 0 and queue.backlog > 0
                    and scorer.backlog_per_consumer(queue) >= settings.idle_join_backlog):
                if warm:
                    take_warm.append((score, model_id))
                else:
                    take_cold.append((score, model_id))
                    cold_views[model_id] = queue
                idle_join.add(model_id)
                reasons[model_id] = "idle-join"
            else:
                reasons[model_id] = "below-threshold"
        elif warm:
            take_warm.append((score, model_id))
            reasons[model_id] = "warm"
        else:
            take_cold.append((score, model_id))
            cold_views[model_id] = queue
            reasons[model_id] = "pressure"

    for model_id in worker.subscriptions:
        if model_id not in scores:
            unsubscribe.add(model_id)
            reasons[model_id] = "gone"

    # Only the cold candidates' runtimes and priorities are asked for (_admit_cold).
    runtime_of = {model_id: queue.runtime for model_id, queue in cold_views.items()}
    priority_of = {model_id: max(settings.priority(queue.plan), queue.priority)
                   for model_id, queue in cold_views.items()}
    cold = _admit_cold(take_starving, take_cold, idle_join, runtime_of, priority_of, worker,
                       settings, now, reasons)
    chosen = kept + take_warm + [(scores[m], m) for m in cold]
    if len(chosen) > settings.max_subscriptions:  # else every one is kept: order moot
        chosen.sort(key=lambda item: (-item[0], item[1]))
    for _, model_id in chosen[settings.max_subscriptions:]:
        reasons[model_id] = "max-subscriptions"
        if model_id in worker.subscriptions:
            unsubscribe.add(model_id)
    if len(chosen) > settings.max_subscriptions:
        final = {model_id for _, model_id in chosen[: settings.max_subscriptions]}
        subscribe = frozenset(final - worker.subscriptions)
    else:  # every one is kept: the takes are the new ones (kept ones are all held)
        subscribe = frozenset([model_id for _, model_id in take_warm] + cold)
    return Decision(
        subscribe=subscribe,
        unsubscribe=frozenset(unsubscribe),
        scores=scores,
        reasons=reasons,
        cold=frozenset(cold) & subscribe,
    )


def _worth_keeping_idle(queue: QueueView, worker: WorkerView, scorer: QueueScorer) -> bool:
    """A held, idle queue of a model not resident here that is cheap and useful to keep."""
    return queue.consumers <= 1 and worker.free_permits > 0 and scorer.stickiness(queue) > 0


def loader_room(worker: WorkerView, settings: ScoringSettings) -> dict[str, int]:
    """Free load slots per runtime of ``worker`` (one shared loader when it does not say)."""
    if worker.loader_room is None:
        return {"": max(settings.max_loads_for_cold - len(worker.loading), 0)}
    return {name: max(room, 0) for name, room in worker.loader_room.items()}


def _admit_cold(starving: list[_Scored], pressured: list[_Scored], idle_join: set[str],
                runtime_of: dict[str, str], priority_of: dict[str, int], worker: WorkerView,
                settings: ScoringSettings, now: float, reasons: dict[str, Reason]) -> list[str]:
    """The cold queues this worker takes now: starved first, then the rest; within each,
    the higher plan priority first, then the higher score.

    Each takes a load slot of its runtime; starved ones need nothing else. The rest
    need a free permit each, and those taken under pressure fit the minute's budget
    (idle joins do not: the worker would otherwise sit idle while tasks wait).
    """
    room = loader_room(worker, settings)
    shared = worker.loader_room is None

    def slot_for(model_id: str) -> str:
        return "" if shared else runtime_of.get(model_id, "")

    def rank(item: _Scored) -> tuple[int, float, str]:
        return -priority_of.get(item[1], 0), -item[0], item[1]

    admitted: list[str] = []
    starving.sort(key=rank)
    for _, model_id in starving:
        slot = slot_for(model_id)
        if room.get(slot, 0) > 0:
            admitted.append(model_id)
            room[slot] -= 1
        else:
            reasons[model_id] = "no-capacity"

    if not pressured:
        return admitted
    budget = cold_budget(worker, settings, now)
    permits = worker.free_permits
    pressured.sort(key=rank)
    for _, model_id in pressured:
        slot = slot_for(model_id)
        if permits <= 0 or room.get(slot, 0) <= 0:
            reasons[model_id] = "no-capacity"
        elif budget <= 0 and model_id not in idle_join:
            reasons[model_id] = "rate-limited"
        else:
            admitted.append(model_id)
            if model_id not in idle_join:
                budget -= 1
            permits -= 1
            room[slot] -= 1
    return admitted
