"""Invariants of choose_queues over arbitrary snapshots."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from modelfleet.scheduling import QueueScorer, QueueView, ScoringSettings, WorkerView, choose_queues

MODELS = [f"m{i}" for i in range(12)]

queue_views = st.builds(
    QueueView,
    model_id=st.sampled_from(MODELS),
    backlog=st.integers(0, 200),
    consumers=st.integers(0, 12),
    fanout_max_workers=st.integers(1, 4),
    plan=st.sampled_from(["free", "pro", "enterprise"]),
    pinned=st.booleans(),
)
model_sets = st.frozensets(st.sampled_from(MODELS))


@settings(max_examples=300, deadline=None)
@given(
    queues=st.lists(queue_views, max_size=12, unique_by=lambda q: q.model_id),
    subscriptions=model_sets,
    device=model_sets,
    host=model_sets,
    recent=st.lists(st.floats(0, 120), max_size=10),
    loading=st.frozensets(st.sampled_from(["x", "m1"]), max_size=2),
    free=st.integers(0, 4),
    max_subs=st.integers(1, 12),
    now=st.floats(60, 10_000),
    seed=st.integers(0, 2**32),
)
def test_decisions_respect_the_caps(queues: list[QueueView], subscriptions: frozenset[str],
                                    device: frozenset[str], host: frozenset[str],
                                    recent: list[float], loading: frozenset[str], free: int,
                                    max_subs: int, now: float, seed: int) -> None:
    cfg = ScoringSettings(max_subscriptions=max_subs, cold_subscribes_per_minute=3)
    # A worker that holds a queue is one of its consumers.
    queues = [q if q.model_id not in subscriptions or q.consumers > 0 else
              QueueView(q.model_id, q.backlog, 1, q.fanout_max_workers, q.plan, q.pinned)
              for q in queues]
    by_id = {q.model_id: q for q in queues}
    worker = WorkerView("w", subscriptions=subscriptions, resident_device=device,
                        resident_host=host, recent_cold_subscribes=tuple(now - r for r in recent),
                        free_permits=free, permits_cap=4, loading=loading)
    decision = choose_queues(queues, worker, cfg, now, seed)

    assert not decision.subscribe & subscriptions
    assert decision.unsubscribe <= subscriptions
    assert decision.cold <= decision.subscribe
    after = decision.apply(subscriptions)
    assert len(after) <= max_subs
    assert after <= set(by_id)  # never a queue that is not there
    for model_id in decision.subscribe:
        q = by_id[model_id]
        assert q.backlog > 0 or model_id in device | host | loading or q.pinned
        if not q.pinned:
            assert q.consumers < cfg.fanout_cap(q.fanout_max_workers, q.plan)
    # Cold subscriptions need loader room; only starved ones may exceed the minute's budget.
    if decision.cold:
        assert len(loading) < cfg.max_loads_for_cold
    assert len(decision.cold) <= max(cfg.max_loads_for_cold - len(loading), 0)


@settings(max_examples=500, deadline=None)
@given(
    model_id=st.sampled_from(MODELS),
    backlog=st.integers(1, 10_000),
    plan=st.sampled_from(["free", "pro", "enterprise"]),
    pinned=st.booleans(),
    warmth=st.floats(0, 3),
    served=st.one_of(st.none(), st.floats(0, 10_000)),
    now=st.floats(0, 10_000),
    seed=st.integers(0, 2**32),
    amplitude=st.sampled_from([0.0, 0.05, 0.3]),
    pressure_scale=st.floats(0.5, 64),
)
def test_starving_score_is_score_bit_for_bit(model_id: str, backlog: int, plan: str,
                                             pinned: bool, warmth: float,
                                             served: float | None, now: float, seed: int,
                                             amplitude: float,
                                             pressure_scale: float) -> None:
    """The simulator ranks starved cold queues by ``starving_score`` with each queue's
    noise kept for the window: it must be ``score`` of that queue, to the last bit."""
    cfg = ScoringSettings(noise_amplitude=amplitude, pressure_scale=pressure_scale)
    worker = WorkerView("w", last_served={} if served is None else {model_id: served})
    scorer = QueueScorer(worker, cfg, now, seed)
    queue = QueueView(model_id, backlog, 0, 2, plan, pinned)
    expected = scorer.score(queue, warmth)
    assert scorer.starving_score(backlog, scorer.noise(model_id)) == expected
