"""Eviction policies: GDSF keeps what is expensive to lose, LRU keeps what is recent,
TinyLFU remembers what was popular and keeps the head from a stream of tail models."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelfleet.cache import (
    POLICIES,
    AdmissionPolicy,
    EvictionPolicy,
    FrequencySketch,
    GdsfPolicy,
    LruPolicy,
    ModelCache,
    TinyLfuPolicy,
)

MB = 1_000_000


def test_policies_table_builds_fresh_instances() -> None:
    assert set(POLICIES) == {"gdsf", "lru", "tinylfu"}
    for factory in POLICIES.values():
        first, second = factory(), factory()
        assert isinstance(first, EvictionPolicy)
        assert first is not second


def run_small_hot_vs_big_cold(policy: EvictionPolicy) -> ModelCache:
    """A small model used all the time and slow to load (a 5 s repository fetch)
    shares 100 MB with big models loaded once each, quick to read from disk."""
    cache = ModelCache(100 * MB, 0, policy, clock=lambda: 0.0)
    cache.reserve("small-hot", 10 * MB)
    cache.commit("small-hot", 10 * MB, 5.0, "repository")
    for _ in range(5):
        cache.hit("small-hot")
    for i in range(4):  # a scan of big, cold models
        cache.reserve(f"big-{i}", 45 * MB)
        cache.commit(f"big-{i}", 45 * MB, 1.0, "disk")
    return cache


def test_gdsf_keeps_small_frequent_expensive_model_that_lru_evicts() -> None:
    assert run_small_hot_vs_big_cold(GdsfPolicy()).tier_of("small-hot") == "device"
    assert run_small_hot_vs_big_cold(LruPolicy()).tier_of("small-hot") is None


def test_lru_order_follows_last_use() -> None:
    lru = LruPolicy()
    for key in "abcd":
        lru.admit(key, 1, 1.0)
    lru.touch("a")
    lru.touch("c")
    assert lru.order() == ["b", "d", "a", "c"]
    assert lru.victim() == "b"
    assert lru.victim(exclude={"b", "d"}) == "a"
    lru.evict("b")
    lru.admit("b", 1, 1.0)
    assert lru.order() == ["d", "a", "c", "b"]
    assert lru.victim(exclude=set("abcd")) is None


def test_gdsf_priority_is_clock_plus_frequency_times_cost_per_byte() -> None:
    gdsf = GdsfPolicy()
    gdsf.admit("a", 100, 2.0)
    assert gdsf.priority("a") == 2.0 / 100
    gdsf.touch("a")
    assert gdsf.frequency("a") == 2
    assert gdsf.priority("a") == 2 * 2.0 / 100


def test_gdsf_ages_so_old_favourites_eventually_lose_to_newcomers() -> None:
    gdsf = GdsfPolicy()
    gdsf.admit("old-favourite", 10, 1.0)
    for _ in range(9):
        gdsf.touch("old-favourite")  # H = 10 * 1.0 / 10 = 1.0
    # Room for two: a stream of one-hit newcomers (H = L + 0.1) passes through.
    for newcomers in range(1, 100):
        gdsf.admit(f"n{newcomers}", 10, 1.0)
        victim = gdsf.victim()
        assert victim is not None
        gdsf.evict(victim)  # each eviction raises the clock L to the victim's H
        if victim == "old-favourite":
            break
    assert victim == "old-favourite"
    assert 5 < newcomers < 20
    assert gdsf.clock == 1.0


def test_admit_of_a_known_key_updates_size_and_keeps_frequency() -> None:
    gdsf = GdsfPolicy()
    gdsf.admit("a", 100, 1.0)
    gdsf.touch("a")
    gdsf.admit("a", 50, 1.0)
    assert gdsf.frequency("a") == 2
    assert gdsf.priority("a") == 2 * 1.0 / 50
    assert len(gdsf) == 1


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["admit", "touch", "evict", "forget", "victim"]),
            st.integers(0, 9),
            st.integers(1, 1000),
            st.floats(0.0, 10.0),
        ),
        max_size=300,
    ),
    st.frozensets(st.integers(0, 9), max_size=4),
)
def test_gdsf_victim_is_the_lowest_priority_non_excluded_key(
    ops: list[tuple[str, int, int, float]], excluded_ids: frozenset[int]
) -> None:
    gdsf = GdsfPolicy()
    excluded = {f"k{i}" for i in excluded_ids}
    for op, key_id, size, cost in ops:
        key = f"k{key_id}"
        if op == "admit":
            gdsf.admit(key, size, cost)
        elif key in gdsf and op == "touch":
            gdsf.touch(key)
        elif key in gdsf and op == "evict":
            gdsf.evict(key)
        elif key in gdsf and op == "forget":
            gdsf.forget(key)
        keys = [f"k{i}" for i in range(10) if f"k{i}" in gdsf and f"k{i}" not in excluded]
        victim = gdsf.victim(excluded)
        if not keys:
            assert victim is None
        else:
            assert victim is not None and victim not in excluded
            assert gdsf.priority(victim) == min(gdsf.priority(k) for k in keys)


# -- TinyLFU: a sketch that outlives residency, a window, admission --------------------


def load(cache: ModelCache, key: str, size: int, seconds: float = 1.0) -> list[str]:
    """One request as the runtime makes it: a hit, or reserve + load + commit.
    Returns the ids evicted to serve it."""
    if cache.hit(key) == "device":
        return []
    evicted = [ev.model_id for ev in cache.reserve(key, size)]
    evicted += [ev.model_id for ev in cache.commit(key, size, seconds, "disk")]
    return evicted


def test_sketch_aging_halves_every_count_each_sample() -> None:
    sketch = FrequencySketch(sample_size=10)
    for _ in range(6):
        sketch.increment("a")
    for _ in range(3):
        sketch.increment("b")
    assert (sketch.estimate("a"), sketch.estimate("b"), sketch.resets) == (6, 3, 0)
    sketch.increment("c")  # the 10th use: every counter halves
    assert (sketch.estimate("a"), sketch.estimate("b"), sketch.estimate("c")) == (3, 1, 0)
    assert sketch.resets == 1
    assert sketch.estimate("never-seen") == 0


def test_sketch_is_the_same_in_every_process() -> None:
    # blake2b, not the per-process salted hash(): one trace, one set of estimates.
    first, second = FrequencySketch(1000, width=16), FrequencySketch(1000, width=16)
    for i in range(200):
        first.increment(f"m{i % 37}")
        second.increment(f"m{i % 37}")
    assert [first.estimate(f"m{i}") for i in range(37)] == [
        second.estimate(f"m{i}") for i in range(37)]
    # Count-min never under-counts, even with 37 keys in 16 counters a row.
    assert all(first.estimate(f"m{i}") >= 200 // 37 for i in range(37))


def test_sketch_rejects_nonsense_settings() -> None:
    with pytest.raises(ValueError, match="sample_size"):
        FrequencySketch(0)
    with pytest.raises(ValueError, match="depth"):
        FrequencySketch(10, depth=9)
    with pytest.raises(ValueError, match="window_fraction"):
        TinyLfuPolicy(window_fraction=1.0)


def test_tinylfu_keeps_a_reloaded_models_count_across_eviction() -> None:
    tiny, gdsf = TinyLfuPolicy(window_fraction=0.0), GdsfPolicy()
    for policy in (tiny, gdsf):
        cache = ModelCache(100 * MB, 0, policy, clock=lambda: 0.0)
        for _ in range(5):
            load(cache, "popular", 60 * MB)
        assert cache.remove("popular")  # gone from memory
        load(cache, "popular", 60 * MB)  # and back
    assert isinstance(tiny, AdmissionPolicy) and not isinstance(gdsf, AdmissionPolicy)
    assert tiny.sketch.estimate("popular") == 6
    assert gdsf.frequency("popular") == 1  # GDSF forgets: it starts again from one
    # Main ranks it by that history: six uses' worth of cost per byte.
    assert tiny._main.frequency("popular") == 6


def test_tinylfu_a_popular_model_evicted_once_is_not_evicted_for_a_newcomer() -> None:
    # A 60 MB favourite is pushed out by a burst of big models once; when it returns,
    # its remembered count keeps it over a one-off 30 MB model, which GDSF evicts it for
    # (to GDSF it is a newcomer used once, below a 40 MB model used twice).
    outcomes = {}
    for name in ("gdsf", "tinylfu"):
        policy = POLICIES[name]() if name == "gdsf" else TinyLfuPolicy(window_fraction=0.0)
        cache = ModelCache(100 * MB, 0, policy, clock=lambda: 0.0)
        for _ in range(8):
            load(cache, "favourite", 60 * MB)
        cache.remove("favourite")
        load(cache, "favourite", 60 * MB)
        load(cache, "other", 40 * MB)
        load(cache, "other", 40 * MB)
        load(cache, "one-off", 30 * MB)
        outcomes[name] = cache.tier_of("favourite")
    assert outcomes == {"gdsf": None, "tinylfu": "device"}


def head_and_window_cache(policy: TinyLfuPolicy) -> ModelCache:
    """Three head models of 30 MB used ten times each fill main (90 of 100 MB);
    the window is the other 10 MB."""
    cache = ModelCache(100 * MB, 0, policy, clock=lambda: 0.0)
    for _ in range(10):
        for key in ("head-a", "head-b", "head-c"):
            load(cache, key, 30 * MB)
    return cache


def test_tinylfu_rejects_a_one_hit_wonder_against_a_frequent_victim() -> None:
    policy = TinyLfuPolicy(window_fraction=0.1)
    cache = head_and_window_cache(policy)
    assert all(not policy.is_in_window(key) for key in ("head-a", "head-b", "head-c"))
    # A tail model is served from the window: nothing of the head goes for it.
    assert load(cache, "tail-1", 8 * MB) == []
    assert cache.tier_of("tail-1") == "device" and policy.is_in_window("tail-1")
    # The next one pushes it out of the window: it competes with the head and loses.
    assert load(cache, "tail-2", 8 * MB) == ["tail-1"]
    assert policy.rejected == 1
    assert {"head-a", "head-b", "head-c"} <= set(cache.snapshot().device)


def test_tinylfu_admits_a_window_model_used_more_than_the_victim() -> None:
    policy = TinyLfuPolicy(window_fraction=0.1)
    cache = ModelCache(100 * MB, 0, policy, clock=lambda: 0.0)
    for key in ("once-a", "once-b", "once-c"):
        load(cache, key, 30 * MB)
    for _ in range(5):
        load(cache, "rising", 8 * MB)  # used five times while in the window
    assert policy.is_in_window("rising")
    evicted = load(cache, "newcomer", 8 * MB)
    assert not policy.is_in_window("rising") and cache.tier_of("rising") == "device"
    assert len(evicted) == 1 and evicted[0].startswith("once-")  # one of the once-used


def test_tinylfu_serves_a_model_it_does_not_admit() -> None:
    # Bigger than the window and rarer than the head: it loses admission but a request
    # for it must still be served, so it is loaded (room from the window first) and is
    # the first in line to go.
    policy = TinyLfuPolicy(window_fraction=0.1)
    cache = head_and_window_cache(policy)
    evicted = load(cache, "big-rare", 20 * MB)
    assert cache.tier_of("big-rare") == "device" and policy.is_in_window("big-rare")
    assert policy.rejected == 1 and len(evicted) == 1  # 10 MB free: one head model gave way
    assert policy.victim() == "big-rare"


def test_tinylfu_victim_names_the_window_before_main() -> None:
    policy = TinyLfuPolicy(window_fraction=0.0)
    assert policy.plan_room("main-1", 10, 1.0, 100, 100, ()) == []  # room: admitted
    policy.admit("main-1", 10, 1.0)
    policy.admit("window-1", 10, 1.0)  # without a plan, a newcomer stays in the window
    assert not policy.is_in_window("main-1") and policy.is_in_window("window-1")
    assert policy.victim() == "window-1"
    assert policy.victim({"window-1"}) == "main-1"
    policy.evict("window-1")
    policy.evict("main-1")
    assert len(policy) == 0 and policy.victim() is None
    with pytest.raises(KeyError):
        policy.touch("main-1")
