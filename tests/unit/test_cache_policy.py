"""Eviction policies: GDSF keeps what is expensive to lose, LRU keeps what is recent."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from modelfleet.cache import POLICIES, EvictionPolicy, GdsfPolicy, LruPolicy, ModelCache

MB = 1_000_000


def test_policies_table_builds_fresh_instances() -> None:
    assert set(POLICIES) == {"gdsf", "lru"}
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
