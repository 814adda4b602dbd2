"""decision_holds: when a decision taken now is still the decision later in its noise window."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from modelfleet.scheduling import (
    QueueView,
    ScoringSettings,
    Snapshot,
    WorkerView,
    decide,
    decision_holds,
)

MODELS = [f"m{i}" for i in range(10)]
HOLD_S = ScoringSettings().noise_hold_s

queue_views = st.builds(
    QueueView,
    model_id=st.sampled_from(MODELS),
    backlog=st.integers(0, 40),
    consumers=st.integers(0, 4),
    fanout_max_workers=st.integers(1, 3),
    plan=st.sampled_from(["free", "pro", "enterprise"]),
    pinned=st.booleans(),
)
model_sets = st.frozensets(st.sampled_from(MODELS))


def outcome(snapshot: Snapshot, cfg: ScoringSettings, seed: int) -> tuple[object, ...]:
    """What a caller carries out of a decision (its scores are for debugging only)."""
    decision = decide(snapshot, cfg, seed)
    return decision.subscribe, decision.unsubscribe, decision.cold, dict(decision.prefetch)


@settings(max_examples=400, deadline=None)
@given(
    queues=st.lists(queue_views, max_size=10, unique_by=lambda q: q.model_id),
    subscriptions=model_sets,
    device=model_sets,
    host=model_sets,
    served=st.dictionaries(st.sampled_from(MODELS), st.floats(0, 12), max_size=10),
    window=st.sampled_from([2.0, 6.0, 120.0]),
    free=st.integers(0, 4),
    offset=st.floats(0, 1),
    later=st.floats(0, 1),
    idle_join=st.sampled_from([2.0, 1000.0]),
    recent=st.integers(0, 7),
    seed=st.integers(0, 2**32),
)
def test_a_decision_said_to_hold_is_the_decision_later_in_its_window(
        queues: list[QueueView], subscriptions: frozenset[str], device: frozenset[str],
        host: frozenset[str], served: dict[str, float], free: int, offset: float,
        later: float, idle_join: float, window: float, recent: int,
        seed: int) -> None:
    # Short stickiness windows: scores move enough within a noise window to cross bars.
    cfg = ScoringSettings(idle_join_backlog=idle_join, stickiness_window_s=window)
    queues = [q if q.model_id not in subscriptions or q.consumers > 0 else
              replace(q, consumers=1) for q in queues]
    bucket_start = 100 * HOLD_S
    now = bucket_start + offset * HOLD_S * 0.5
    then = now + later * (bucket_start + HOLD_S - now) * 0.999
    assert math.floor(then / HOLD_S) == math.floor(now / HOLD_S)
    worker = WorkerView("w", subscriptions=subscriptions, resident_device=device,
                        resident_host=host,
                        last_served={m: now - age for m, age in served.items()},
                        recent_cold_subscribes=(now - 1.0,) * recent,
                        free_permits=free, permits_cap=4)
    snapshot = Snapshot(now, tuple(sorted(queues, key=lambda q: q.model_id)), worker)
    if decision_holds(snapshot, decide(snapshot, cfg, seed), cfg, seed):
        assert outcome(replace(snapshot, now=then), cfg, seed) == outcome(snapshot, cfg, seed)


def test_a_cold_queue_kept_over_the_bar_by_its_stickiness_does_not_hold() -> None:
    # Served here 23 s ago, then evicted: stickiness 0.808 plus pressure 0.693 is just over
    # the bar to take it; a second later it is under, and the decision changes.
    cfg = ScoringSettings(noise_amplitude=0.0, idle_join_backlog=1000.0)
    now = 1000.0
    worker = WorkerView("w", last_served={"cold": now - 23.0}, free_permits=2, permits_cap=4)
    snapshot = Snapshot(now, (QueueView("cold", backlog=8, consumers=1),), worker)
    assert decide(snapshot, cfg, 7).subscribe == {"cold"}
    assert decide(replace(snapshot, now=now + 1.0), cfg, 7).subscribe == frozenset()
    assert not decision_holds(snapshot, decide(snapshot, cfg, 7), cfg, 7)


def test_warm_or_starved_queues_and_stale_stickiness_hold() -> None:
    cfg = ScoringSettings()
    now = 1000.0
    worker = WorkerView("w", subscriptions=frozenset({"warm"}),
                        resident_device=frozenset({"warm"}),
                        last_served={"warm": now - 1.0, "starved": now - 1.0,
                                     "stale": now - cfg.stickiness_window_s},
                        free_permits=1, permits_cap=4)
    queues = (QueueView("stale", backlog=3, consumers=1),
              QueueView("starved", backlog=2, consumers=0),
              QueueView("warm", backlog=0, consumers=1))
    assert holds(Snapshot(now, queues, worker), cfg)
    # A cold held queue kept idle by its stickiness: still kept at the window's end...
    idle = replace(worker, subscriptions=frozenset({"idle"}), resident_device=frozenset(),
                   last_served={"idle": now - 1.0})
    assert holds(Snapshot(now, (QueueView("idle", 0, 1),), idle), cfg)
    # ... or not: 0.51 of stickiness now, under the drop bar (0.5) 1.2 s later.
    quiet = ScoringSettings(noise_amplitude=0.0)
    idle = replace(idle, last_served={"idle": now - 58.8})
    snapshot = Snapshot(now, (QueueView("idle", 0, 1),), idle)
    assert decide(snapshot, quiet, 7).unsubscribe == frozenset()
    assert decide(replace(snapshot, now=now + 4.0), quiet, 7).unsubscribe == {"idle"}
    assert not holds(snapshot, quiet)
    # More queues than the subscription cap: the cap compares scores, which decay.
    small = ScoringSettings(max_subscriptions=1)
    assert not holds(Snapshot(now, queues, worker), small)


def test_a_cold_take_ranked_against_a_refused_one_does_not_hold() -> None:
    # Two cold queues under pressure, one free permit: the higher score is taken, the
    # other refused. Its lead is stickiness, which decays: the order may turn.
    cfg = ScoringSettings(noise_amplitude=0.0)
    now = 1000.0
    worker = WorkerView("w", last_served={"a": now - 1.0}, free_permits=1, permits_cap=4)
    queues = (QueueView("a", backlog=40, consumers=1), QueueView("b", backlog=40, consumers=1))
    snapshot = Snapshot(now, queues, worker)
    assert decide(snapshot, cfg, 7).subscribe == {"a"}
    assert not holds(snapshot, cfg)
    # With a permit for each, both are taken in any order: it holds.
    assert holds(replace(snapshot, worker=replace(worker, free_permits=2)), cfg)


def holds(snapshot: Snapshot, cfg: ScoringSettings) -> bool:
    return decision_holds(snapshot, decide(snapshot, cfg, 7), cfg, 7)
