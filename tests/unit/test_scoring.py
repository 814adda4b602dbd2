"""Queue scoring: one test (at least) per rule. Deterministic: time and seed are arguments."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from pydantic import ValidationError

from modelfleet.scheduling import (
    QueueView,
    ScoringSettings,
    Snapshot,
    WorkerView,
    choose_queues,
    decide,
    noise,
    score_queue,
    work_waiting,
)

NOW = 1_000.0
SEED = 7
QUIET = ScoringSettings(noise_amplitude=0.0)


def worker(**kwargs: object) -> WorkerView:
    base: dict[str, object] = {"worker_id": "w1", "free_permits": 4, "permits_cap": 4}
    base.update(kwargs)
    return WorkerView(**base)  # type: ignore[arg-type]


# --- warmth -----------------------------------------------------------------------------

def test_warm_scores_above_cold_and_device_above_host() -> None:
    q = QueueView("m", backlog=3, consumers=1)
    device = score_queue(q, worker(resident_device=frozenset({"m"})), QUIET, NOW, SEED)
    host = score_queue(q, worker(resident_host=frozenset({"m"})), QUIET, NOW, SEED)
    cold = score_queue(q, worker(), QUIET, NOW, SEED)
    assert device > host > cold


def test_pinned_counts_as_warm() -> None:
    pinned = QueueView("m", backlog=0, consumers=5, pinned=True)
    decision = choose_queues([pinned], worker(), QUIET, NOW, SEED)
    assert decision.subscribe == {"m"}  # warm everywhere, and exempt from the fan-out cap
    assert decision.reasons["m"] == "warm"


def test_a_model_loading_here_counts_as_warm() -> None:
    # Taken for a starved message, loading now, backlog drained: keep it, or a second
    # worker would find it starved again and load the same model a second time.
    q = QueueView("m", backlog=0, consumers=1)
    w = worker(subscriptions=frozenset({"m"}), loading=frozenset({"m"}))
    decision = choose_queues([q], w, QUIET, NOW, SEED)
    assert decision.unsubscribe == frozenset() and decision.reasons["m"] == "warm"


def test_warm_queue_is_taken_before_a_cold_one_with_more_backlog() -> None:
    queues = [QueueView("warm", backlog=2, consumers=1), QueueView("cold", backlog=30, consumers=1)]
    decision = choose_queues(queues, worker(resident_device=frozenset({"warm"})), QUIET, NOW, SEED)
    assert decision.scores["warm"] > decision.scores["cold"]


# --- pressure ---------------------------------------------------------------------------

def test_pressure_is_backlog_per_consumer_not_raw_depth() -> None:
    deep_but_served = QueueView("a", backlog=40, consumers=9)  # 4 per consumer if I join
    shallow_alone = QueueView("b", backlog=12, consumers=1)  # 6 per consumer if I join
    w = worker()
    assert score_queue(shallow_alone, w, QUIET, NOW, SEED) > score_queue(
        deep_but_served, w, QUIET, NOW, SEED)


def test_pressure_counts_this_worker_once_whether_or_not_it_holds_the_queue() -> None:
    free = score_queue(QueueView("a", backlog=10, consumers=1), worker(), QUIET, NOW, SEED)
    held = score_queue(QueueView("a", backlog=10, consumers=2),
                       worker(subscriptions=frozenset({"a"})), QUIET, NOW, SEED)
    assert free == pytest.approx(held)


def test_pressure_grows_with_backlog() -> None:
    w = worker()
    scores = [score_queue(QueueView("a", backlog=b, consumers=1), w, QUIET, NOW, SEED)
              for b in (1, 10, 100)]
    assert scores == sorted(scores) and scores[0] < scores[-1]


# --- stickiness -------------------------------------------------------------------------

def test_stickiness_decays_over_its_window() -> None:
    q = QueueView("m", backlog=5, consumers=1)
    window = QUIET.stickiness_window_s
    fresh = score_queue(q, worker(last_served={"m": NOW}), QUIET, NOW, SEED)
    half = score_queue(q, worker(last_served={"m": NOW - window / 2}), QUIET, NOW, SEED)
    gone = score_queue(q, worker(last_served={"m": NOW - 2 * window}), QUIET, NOW, SEED)
    never = score_queue(q, worker(), QUIET, NOW, SEED)
    assert fresh > half > gone == never


# --- starvation -------------------------------------------------------------------------

def test_starving_queue_wins_outright_even_with_cold_budget_spent() -> None:
    spent = tuple(NOW - i for i in range(QUIET.cold_subscribes_per_minute))
    queues = [
        QueueView("starving", backlog=1, consumers=0),
        QueueView("warm-busy", backlog=500, consumers=1),
    ]
    w = worker(resident_device=frozenset({"warm-busy"}), recent_cold_subscribes=spent)
    decision = choose_queues(queues, w, QUIET, NOW, SEED)
    assert decision.scores["starving"] > decision.scores["warm-busy"]
    assert "starving" in decision.subscribe
    assert decision.cold == {"starving"}  # the caller records it as a cold subscription


def test_starved_queues_are_claimed_one_per_free_load_slot() -> None:
    queues = [QueueView(f"s{i}", backlog=1, consumers=0) for i in range(5)]
    taken = choose_queues(queues, worker(), QUIET, NOW, SEED)
    assert len(taken.subscribe) == QUIET.max_loads_for_cold
    busy = frozenset(f"other{i}" for i in range(QUIET.max_loads_for_cold))
    loading = choose_queues(queues, worker(loading=busy), QUIET, NOW, SEED)
    assert loading.subscribe == frozenset()
    assert set(loading.reasons.values()) == {"no-capacity"}


def test_each_runtime_loads_for_its_own_starved_queues() -> None:
    """Two runtimes, two loaders: a busy loader on one does not hold back the other."""
    queues = [QueueView(f"a{i}", backlog=1, consumers=0, runtime="r0") for i in range(3)] + \
             [QueueView(f"b{i}", backlog=1, consumers=0, runtime="r1") for i in range(3)]
    decision = choose_queues(queues, worker(loader_room={"r0": 0, "r1": 2}), QUIET, NOW, SEED)
    assert decision.subscribe == {"b0", "b1"}
    assert {decision.reasons[f"a{i}"] for i in range(3)} == {"no-capacity"}
    both = choose_queues(queues, worker(loader_room={"r0": 1, "r1": 1}), QUIET, NOW, SEED)
    assert both.subscribe == {"a0", "b0"}


def test_starved_queue_is_taken_promptly_by_some_worker_of_the_fleet() -> None:
    # Every worker but one is busy loading: the idle one takes it at its next re-score.
    queue = [QueueView("tail", backlog=1, consumers=0)]
    busy = frozenset(f"other{i}" for i in range(QUIET.max_loads_for_cold))
    takers = [i for i in range(10)
              if choose_queues(queue, worker(worker_id=f"w{i}", free_permits=0,
                                             loading=busy if i != 3 else frozenset()),
                               QUIET, NOW, SEED).subscribe]
    assert takers == [3]


# --- hysteresis -------------------------------------------------------------------------

def test_hysteresis_does_not_flap_when_the_score_hovers_near_the_bar() -> None:
    settings = ScoringSettings(noise_amplitude=0.0, subscribe_threshold=1.5, drop_threshold=0.5)
    # Backlog per consumer such that pressure alone sits exactly on the subscribe bar.
    pressure_scale = settings.pressure_scale
    on_bar = pressure_scale * math.expm1(settings.subscribe_threshold / settings.pressure_weight)
    held: frozenset[str] = frozenset()
    transitions = 0
    now = NOW
    # Sweep the backlog up and down around the bar, 20 times, one re-score per step.
    for step in range(200):
        wobble = 0.15 * on_bar * math.sin(step / 3.0)
        backlog = max(1, round(on_bar + wobble))
        consumers = 1 + (1 if "m" in held else 0)
        q = QueueView("m", backlog=backlog * 2, consumers=consumers, fanout_max_workers=8)
        w = worker(subscriptions=held, free_permits=4)
        decision = choose_queues([q], w, settings, now, SEED)
        new = decision.apply(held)
        transitions += new != held
        held = new
        now += 100.0  # no cold rate limit in the way
    assert transitions == 1  # taken once on the way up, never dropped while hovering


def test_a_held_queue_is_dropped_once_its_score_falls_clearly_below_the_bar() -> None:
    w = worker(subscriptions=frozenset({"m"}), last_served={"m": NOW - 1000})
    tiny = QueueView("m", backlog=1, consumers=2)  # cold here, almost nothing to do
    decision = choose_queues([tiny], w, QUIET, NOW, SEED)
    assert decision.unsubscribe == {"m"} and decision.reasons["m"] == "dropped"


def test_settings_require_the_drop_bar_below_the_subscribe_bar() -> None:
    with pytest.raises(ValidationError):
        ScoringSettings(subscribe_threshold=1.0, drop_threshold=1.0)


# --- fan-out cap ------------------------------------------------------------------------

def test_fanout_cap_blocks_a_new_subscription_at_the_cap() -> None:
    hot = QueueView("m", backlog=1_000, consumers=2, fanout_max_workers=2, plan="free")
    decision = choose_queues([hot], worker(resident_device=frozenset({"m"})), QUIET, NOW, SEED)
    assert decision.subscribe == frozenset() and decision.reasons["m"] == "fanout-cap"


def test_fanout_cap_scales_with_plan_and_pinned_is_exempt() -> None:
    assert QUIET.fanout_cap(2, "free") == 2
    assert QUIET.fanout_cap(2, "pro") == 4
    assert QUIET.fanout_cap(2, "enterprise") == 8
    assert QUIET.fanout_cap(1, "unknown-plan") == 1
    assert ScoringSettings(plan_fanout_multiplier={"free": 0.1}).fanout_cap(2, "free") == 1
    pro = QueueView("m", backlog=1_000, consumers=2, fanout_max_workers=2, plan="pro")
    assert choose_queues([pro], worker(resident_device=frozenset({"m"})), QUIET, NOW,
                         SEED).subscribe == {"m"}


def test_workers_over_the_cap_shed_back_towards_it() -> None:
    q = QueueView("m", backlog=50, consumers=20, fanout_max_workers=2)
    stay = sum(
        not choose_queues([q], worker(worker_id=f"w{i}", subscriptions=frozenset({"m"}),
                                      resident_device=frozenset({"m"})), QUIET, NOW,
                          SEED).unsubscribe
        for i in range(20))
    assert 0 < stay <= 6  # about cap (2) of the 20 stay, and never all leave at once


# --- cold rate limit and capacity -------------------------------------------------------

def test_cold_subscriptions_are_rate_limited_per_minute() -> None:
    settings = ScoringSettings(noise_amplitude=0.0, cold_subscribes_per_minute=3)
    q = QueueView("m", backlog=500, consumers=1)
    recent = (NOW - 50, NOW - 20, NOW - 5)
    limited = choose_queues([q], worker(recent_cold_subscribes=recent), settings, NOW, SEED)
    assert limited.subscribe == frozenset() and limited.reasons["m"] == "rate-limited"
    a_minute_later = choose_queues([q], worker(recent_cold_subscribes=recent), settings,
                                   NOW + 11, SEED)
    assert a_minute_later.subscribe == {"m"} and a_minute_later.cold == {"m"}


def test_cold_subscription_needs_a_free_permit() -> None:
    q = QueueView("m", backlog=500, consumers=1)
    decision = choose_queues([q], worker(free_permits=0), QUIET, NOW, SEED)
    assert decision.subscribe == frozenset() and decision.reasons["m"] == "no-capacity"


def test_warm_subscriptions_are_not_rate_limited() -> None:
    spent = tuple(NOW - i for i in range(QUIET.cold_subscribes_per_minute))
    queues = [QueueView(f"m{i}", backlog=5, consumers=1) for i in range(10)]
    resident = frozenset(q.model_id for q in queues)
    decision = choose_queues(queues, worker(resident_device=resident,
                                            recent_cold_subscribes=spent), QUIET, NOW, SEED)
    assert len(decision.subscribe) == 10 and decision.cold == frozenset()


# --- noise ------------------------------------------------------------------------------

def test_noise_keeps_identical_workers_from_herding_onto_one_queue() -> None:
    queues = [QueueView(f"q{i}", backlog=1, consumers=0) for i in range(5)]

    def first_choice(worker_id: str) -> str:
        decision = choose_queues(queues, worker(worker_id=worker_id, loader_room={"": 1}),
                                 ScoringSettings(), NOW, SEED)
        [chosen] = decision.subscribe  # one free load slot: one claim
        return chosen

    picks = Counter(first_choice(f"worker-{i}") for i in range(10))
    assert len(picks) >= 3 and max(picks.values()) <= 5


def test_noise_is_held_for_its_window_then_redrawn() -> None:
    settings = ScoringSettings(noise_hold_s=5.0)
    start = 5.0 * 200
    held = {noise(settings, SEED, "w1", "m", start + dt) for dt in (0.0, 1.0, 4.99)}
    assert len(held) == 1
    later = {noise(settings, SEED, "w1", "m", start + 5.0 * k) for k in range(1, 20)}
    assert len(later) > 10
    assert all(abs(n) <= settings.noise_amplitude for n in held | later)


def test_choose_queues_is_pure() -> None:
    queues = [QueueView(f"q{i}", backlog=i, consumers=i % 3) for i in range(20)]
    w = worker(resident_device=frozenset({"q3", "q4"}), subscriptions=frozenset({"q4", "q9"}))
    settings = ScoringSettings()
    assert choose_queues(queues, w, settings, NOW, SEED) == choose_queues(
        queues, w, settings, NOW, SEED)


# --- what is worth a subscription -------------------------------------------------------

def test_idle_cold_queue_is_not_worth_a_subscription() -> None:
    idle = QueueView("m", backlog=0, consumers=0)
    assert choose_queues([idle], worker(last_served={"m": NOW}), QUIET, NOW,
                         SEED).subscribe == frozenset()
    held = choose_queues([idle], worker(subscriptions=frozenset({"m"})), QUIET, NOW, SEED)
    assert held.unsubscribe == {"m"} and held.reasons["m"] == "idle-cold"


def test_warm_idle_queues_are_kept_but_total_subscriptions_are_capped() -> None:
    settings = ScoringSettings(noise_amplitude=0.0, max_subscriptions=3)
    queues = [QueueView(f"m{i}", backlog=0, consumers=1) for i in range(5)]
    held = frozenset({"m0", "m1"})
    w = worker(subscriptions=held, resident_device=frozenset({"m0", "m1", "m2", "m3"}),
               last_served={"m3": NOW})
    decision = choose_queues(queues, w, settings, NOW, SEED)
    after = decision.apply(held)
    assert after == {"m0", "m1", "m3"}  # m3 is warm and sticky; m2 warm but fourth; m4 cold
    assert decision.reasons["m2"] == "max-subscriptions"


def test_a_held_queue_that_expired_is_dropped() -> None:
    decision = choose_queues([], worker(subscriptions=frozenset({"gone"})), QUIET, NOW, SEED)
    assert decision.unsubscribe == {"gone"} and decision.reasons["gone"] == "gone"


# --- work conservation ------------------------------------------------------------------

def test_a_free_worker_joins_a_queue_whose_consumers_are_full() -> None:
    """Below the pressure bar, under the cap, tasks waiting: an idle worker takes it."""
    spent = tuple(NOW - i for i in range(QUIET.cold_subscribes_per_minute))
    q = QueueView("m", backlog=4, consumers=1, fanout_max_workers=2)
    decision = choose_queues([q], worker(recent_cold_subscribes=spent), QUIET, NOW, SEED)
    assert decision.subscribe == {"m"} and decision.reasons["m"] == "idle-join"
    busy = choose_queues([q], worker(free_permits=0), QUIET, NOW, SEED)
    assert busy.subscribe == frozenset()
    shallow = choose_queues([QueueView("m", backlog=1, consumers=1)], worker(), QUIET, NOW, SEED)
    assert shallow.subscribe == frozenset() and shallow.reasons["m"] == "below-threshold"
    capped = choose_queues([QueueView("m", backlog=40, consumers=2)], worker(), QUIET, NOW, SEED)
    assert capped.subscribe == frozenset() and capped.reasons["m"] == "fanout-cap"


def test_an_idle_cold_queue_this_worker_alone_served_is_kept_while_it_is_free() -> None:
    q = QueueView("m", backlog=0, consumers=1)
    recent = {"m": NOW - 5}
    kept = choose_queues([q], worker(subscriptions=frozenset({"m"}), last_served=recent),
                         QUIET, NOW, SEED)
    assert kept.unsubscribe == frozenset()
    shared = choose_queues([QueueView("m", backlog=0, consumers=2)],
                           worker(subscriptions=frozenset({"m"}), last_served=recent),
                           QUIET, NOW, SEED)
    assert shared.unsubscribe == {"m"} and shared.reasons["m"] == "idle-cold"
    busy = choose_queues([q], worker(subscriptions=frozenset({"m"}), last_served=recent,
                                     free_permits=0), QUIET, NOW, SEED)
    assert busy.unsubscribe == {"m"}


def test_decide_sizes_prefetch_windows_to_the_work_waiting_and_the_free_permits() -> None:
    queues = (QueueView("hot", backlog=30, consumers=1, batch_size=1),
              QueueView("batchy", backlog=0, consumers=1, batch_size=8),
              QueueView("calm", backlog=0, consumers=1))
    held = frozenset({"hot", "batchy", "calm"})
    w = worker(subscriptions=held, resident_device=held, free_permits=10, permits_cap=16,
               running={"hot": 6}, prefetch={"hot": 1, "batchy": 8, "calm": 6})
    windows = decide(Snapshot(NOW, queues, w), QUIET, SEED).prefetch
    assert windows["hot"] == 16  # what runs here plus the permits free, not the whole backlog
    assert "batchy" not in windows  # a batch must fit: 8 stays 8
    assert "calm" not in windows  # 6 -> fair share 6: unchanged, no consumer churn
    # A window full while tasks wait and permits are free grows at once (not at 2x).
    busy = worker(subscriptions=frozenset({"hot"}), resident_device=frozenset({"hot"}),
                  free_permits=3, permits_cap=16, running={"hot": 8}, prefetch={"hot": 8})
    grown = decide(Snapshot(NOW, (QueueView("hot", backlog=16, consumers=1),), busy),
                   QUIET, SEED).prefetch
    assert grown == {"hot": 11}
    fresh = decide(Snapshot(NOW, (QueueView("new", backlog=3, consumers=0),),
                            worker(free_permits=10, permits_cap=16)), QUIET, SEED)
    assert fresh.subscribe == {"new"} and fresh.prefetch["new"] == 10  # the free permits


def test_work_waiting_counts_only_tasks_this_worker_could_take() -> None:
    def waiting(*queues: QueueView, **kw: object) -> bool:
        return work_waiting(Snapshot(NOW, queues, worker(**kw)), QUIET)

    assert waiting(QueueView("starved", backlog=1, consumers=0))
    assert waiting(QueueView("held", backlog=1, consumers=3),
                   subscriptions=frozenset({"held"}))
    assert waiting(QueueView("open", backlog=1, consumers=1, fanout_max_workers=2))
    assert not waiting(QueueView("capped", backlog=9, consumers=2, fanout_max_workers=2))
    assert not waiting(QueueView("empty", backlog=0, consumers=0))
    # What a new decision could change: only queues this worker does not consume yet.
    assert not work_waiting(Snapshot(NOW, (QueueView("held", backlog=5, consumers=1),),
                                     worker(subscriptions=frozenset({"held"}))),
                            QUIET, held_too=False)
    assert work_waiting(Snapshot(NOW, (QueueView("starved", backlog=1, consumers=0),),
                                 worker()), QUIET, held_too=False)
    # A cold queue whose runtime's loader is full: taking it would start nothing sooner.
    full = worker(loader_room={"r0": 0}, free_permits=4)
    cold = QueueView("cold", backlog=3, consumers=0, runtime="r0")
    assert not work_waiting(Snapshot(NOW, (cold,), full), QUIET)
    assert work_waiting(Snapshot(NOW, (cold,), worker(loader_room={"r0": 1})), QUIET)
    warm = worker(loader_room={"r0": 0}, resident_device=frozenset({"cold"}))
    assert work_waiting(Snapshot(NOW, (cold,), warm), QUIET)  # resident: it can start
