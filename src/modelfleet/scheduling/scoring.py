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

import hashlib
import math
from collections.abc import Sequence

from modelfleet.scheduling.settings import ScoringSettings
from modelfleet.scheduling.views import Decision, QueueView, Reason, WorkerView

COLD_WINDOW_S = 60.0  # the rate limit counts cold subscriptions over the last minute

_Scored = tuple[float, str]


def held_uniform(rng_seed: int, worker_id: str, model_id: str, bucket: int, salt: str) -> float:
    """A uniform number in [0, 1) fixed by its arguments (no hidden state, no salted hash)."""
    key = f"{rng_seed}\x1f{worker_id}\x1f{model_id}\x1f{bucket}\x1f{salt}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def noise(settings: ScoringSettings, rng_seed: int, worker_id: str, model_id: str,
          now: float) -> float:
    """The noise term of (worker, queue): in [-amplitude, amplitude), fixed per hold window."""
    if settings.noise_amplitude == 0:
        return 0.0
    bucket = math.floor(now / settings.noise_hold_s)
    u = held_uniform(rng_seed, worker_id, model_id, bucket, "noise")
    return settings.noise_amplitude * (2.0 * u - 1.0)


def warmth(queue: QueueView, worker: WorkerView, settings: ScoringSettings) -> float:
    """Device tier over host tier; pinned or loading here count as device-warm; else cold."""
    if queue.pinned:
        return max(settings.pinned_warmth_weight, _tier_warmth(queue, worker, settings))
    return _tier_warmth(queue, worker, settings)


def _tier_warmth(queue: QueueView, worker: WorkerView, settings: ScoringSettings) -> float:
    if queue.model_id in worker.resident_device or queue.model_id in worker.loading:
        return settings.device_warmth_weight
    if queue.model_id in worker.resident_host:
        return settings.host_warmth_weight
    return 0.0


def backlog_per_consumer(queue: QueueView, worker: WorkerView) -> float:
    """Backlog divided among the consumers, counting this worker as one of them."""
    held = queue.model_id in worker.subscriptions
    others = max(queue.consumers - (1 if held else 0), 0)
    return queue.backlog / (others + 1)


def pressure(queue: QueueView, worker: WorkerView, settings: ScoringSettings) -> float:
    per_consumer = backlog_per_consumer(queue, worker)
    return settings.pressure_weight * math.log1p(per_consumer / settings.pressure_scale)


def stickiness(queue: QueueView, worker: WorkerView, settings: ScoringSettings,
               now: float) -> float:
    served = worker.last_served.get(queue.model_id)
    if served is None:
        return 0.0
    age = max(now - served, 0.0)
    return settings.stickiness_weight * max(0.0, 1.0 - age / settings.stickiness_window_s)


def is_starving(queue: QueueView) -> bool:
    """Messages waiting and no consumer anywhere."""
    return queue.backlog > 0 and queue.consumers == 0


def score_queue(queue: QueueView, worker: WorkerView, settings: ScoringSettings, now: float,
                rng_seed: int) -> float:
    """The score of one queue for one worker (the starvation override included)."""
    base = (pressure(queue, worker, settings)
            + noise(settings, rng_seed, worker.worker_id, queue.model_id, now))
    if is_starving(queue):
        return settings.starvation_score + base
    return warmth(queue, worker, settings) + stickiness(queue, worker, settings, now) + base


def cold_budget(worker: WorkerView, settings: ScoringSettings, now: float) -> int:
    """Cold subscriptions this worker may still make in the current minute."""
    recent = sum(1 for t in worker.recent_cold_subscribes if now - t < COLD_WINDOW_S)
    return max(settings.cold_subscribes_per_minute - recent, 0)


def choose_queues(queues: Sequence[QueueView], worker: WorkerView, settings: ScoringSettings,
                  now: float, rng_seed: int) -> Decision:
    """Decide which queues this worker starts and stops consuming. Pure.

    ``queues`` must include every queue this worker holds; a held queue missing
    from it has expired and is dropped. Rules, in order of precedence:

    1. Starvation: a queue with messages and no consumer scores
       ``starvation_score``. Cold starved queues are claimed at most
       ``starvation_claims_per_decision`` at a time and only while this
       worker's loader has room, but they bypass the cold rate limit: the rate
       limit exists to stop a stampede onto a queue others already serve, and
       a starved queue stops being starved for everyone the moment one worker
       takes it. Gating on the loader does not starve it: the first worker
       whose loader frees up takes it at its next re-score, and on a worker
       whose loader is busy it would only have waited behind that load.
    2. Fan-out cap: no new subscription to a queue with ``cap`` consumers;
       a held queue with more than ``cap`` consumers is dropped with
       probability excess/consumers (a coin held fixed per noise window), so
       workers that raced past the cap converge back to it without
       coordinating and without all leaving at once. Pinned queues are exempt.
    3. Idle-cold: a queue with no backlog for a model not resident here is
       not worth a subscription (and a held one is dropped).
    4. Hysteresis: take at ``subscribe_threshold``, drop below ``drop_threshold``.
    5. Cold rate limit and capacity: new cold subscriptions fit the per-minute
       budget, need a free permit, and at most one per free loader slot.
    6. Subscription cap: the ``max_subscriptions`` best scores survive.
    """
    scores: dict[str, float] = {}
    reasons: dict[str, Reason] = {}
    kept: list[_Scored] = []
    take_warm: list[_Scored] = []
    take_cold: list[_Scored] = []
    take_starving: list[_Scored] = []
    unsubscribe: set[str] = set()
    bucket = math.floor(now / settings.noise_hold_s)

    for queue in queues:
        model_id = queue.model_id
        held = model_id in worker.subscriptions
        score = score_queue(queue, worker, settings, now, rng_seed)
        scores[model_id] = score
        warm = warmth(queue, worker, settings) > 0
        cap = None if queue.pinned else settings.fanout_cap(queue.fanout_max_workers, queue.plan)

        if held:
            if cap is not None and queue.consumers > cap:
                shed = (queue.consumers - cap) / queue.consumers
                u = held_uniform(rng_seed, worker.worker_id, model_id, bucket, "shed")
                if u < shed:
                    unsubscribe.add(model_id)
                    reasons[model_id] = "over-cap"
                    continue
            if queue.backlog == 0 and not warm:
                unsubscribe.add(model_id)
                reasons[model_id] = "idle-cold"
            elif score < settings.drop_threshold:
                unsubscribe.add(model_id)
                reasons[model_id] = "dropped"
            else:
                kept.append((score, model_id))
                reasons[model_id] = "warm" if warm else "pressure"
            continue

        if is_starving(queue):
            (take_warm if warm else take_starving).append((score, model_id))
            reasons[model_id] = "starving"
        elif queue.backlog == 0 and not warm:
            reasons[model_id] = "idle-cold"
        elif score < settings.subscribe_threshold:
            reasons[model_id] = "below-threshold"
        elif cap is not None and queue.consumers >= cap:
            reasons[model_id] = "fanout-cap"
        elif warm:
            take_warm.append((score, model_id))
            reasons[model_id] = "warm"
        else:
            take_cold.append((score, model_id))
            reasons[model_id] = "pressure"

    for model_id in worker.subscriptions:
        if model_id not in scores:
            unsubscribe.add(model_id)
            reasons[model_id] = "gone"

    cold = _admit_cold(take_starving, take_cold, worker, settings, now, reasons)
    chosen = kept + take_warm + [(scores[m], m) for m in cold]
    chosen.sort(key=lambda item: (-item[0], item[1]))
    for _, model_id in chosen[settings.max_subscriptions:]:
        reasons[model_id] = "max-subscriptions"
        if model_id in worker.subscriptions:
            unsubscribe.add(model_id)
    final = {model_id for _, model_id in chosen[: settings.max_subscriptions]}
    subscribe = frozenset(final - worker.subscriptions)
    return Decision(
        subscribe=subscribe,
        unsubscribe=frozenset(unsubscribe),
        scores=scores,
        reasons=reasons,
        cold=frozenset(cold) & subscribe,
    )


def _admit_cold(starving: list[_Scored], pressured: list[_Scored], worker: WorkerView,
                settings: ScoringSettings, now: float,
                reasons: dict[str, Reason]) -> list[str]:
    """The cold queues this worker takes now: starved first, then the rate-limited rest."""
    loader_room = max(settings.max_loads_for_cold - len(worker.loading), 0)
    admitted: list[str] = []
    starving.sort(key=lambda item: (-item[0], item[1]))
    claims = min(settings.starvation_claims_per_decision, loader_room)
    for _, model_id in starving[:claims]:
        admitted.append(model_id)
    for _, model_id in starving[claims:]:
        reasons[model_id] = "no-capacity"

    budget = cold_budget(worker, settings, now)
    room = loader_room - len(admitted) if worker.free_permits > 0 else 0
    pressured.sort(key=lambda item: (-item[0], item[1]))
    for _, model_id in pressured:
        if room <= 0:
            reasons[model_id] = "no-capacity"
        elif budget <= 0:
            reasons[model_id] = "rate-limited"
        else:
            admitted.append(model_id)
            budget -= 1
            room -= 1
    return admitted
