"""ModelCache behaviour a runtime would notice: sizes, pins, promotions, failures."""

from __future__ import annotations

import pytest

from modelfleet.cache import GdsfPolicy, LruPolicy, ModelCache
from modelfleet.cache.types import LoadSource
from modelfleet.errors import ModelTooLarge, NoCapacity

MB = 1_000_000


def make_cache(device: int = 100 * MB, host: int = 0, lru: bool = False) -> ModelCache:
    policy = LruPolicy() if lru else GdsfPolicy()
    return ModelCache(device, host, policy, clock=lambda: 42.0)


def load(
    cache: ModelCache,
    model_id: str,
    size: int,
    seconds: float = 1.0,
    pinned: bool = False,
    source: LoadSource = "disk",
) -> list[str]:
    """reserve + commit; returns the actions as 'action:model' strings."""
    actions = cache.reserve(model_id, size, pinned=pinned)
    actions += cache.commit(model_id, size, seconds, source)
    return [f"{ev.action}:{ev.model_id}" for ev in actions]


def test_too_large_model_names_model_size_and_budget() -> None:
    cache = make_cache(device=100 * MB)
    with pytest.raises(ModelTooLarge) as info:
        cache.reserve("llama-70b", 140 * MB)
    message = str(info.value)
    assert "llama-70b" in message
    assert str(140 * MB) in message
    assert str(100 * MB) in message
    assert info.value.code == "model_too_large"
    assert cache.snapshot().device_reserved_bytes == 0


def test_pinned_models_survive_pressure_and_block_with_no_capacity() -> None:
    cache = make_cache(device=100 * MB)
    load(cache, "pinned-a", 40 * MB, pinned=True)
    load(cache, "pinned-b", 30 * MB, pinned=True)
    for i in range(20):
        evicted = load(cache, f"other-{i}", 25 * MB)
        assert not any("pinned" in action for action in evicted)
    assert cache.tier_of("pinned-a") == cache.tier_of("pinned-b") == "device"
    before = cache.snapshot()
    with pytest.raises(NoCapacity, match=r"'big'.*pinned"):
        cache.reserve("big", 50 * MB)
    assert cache.snapshot() == before  # a refused reserve changes nothing
    cache.unpin("pinned-a")
    assert sorted(load(cache, "big", 50 * MB)) == ["drop:other-19", "drop:pinned-a"]


def test_loads_in_flight_count_against_the_budget() -> None:
    cache = make_cache(device=100 * MB)
    assert cache.reserve("a", 60 * MB) == []
    with pytest.raises(NoCapacity, match="in flight"):
        cache.reserve("b", 60 * MB)  # "a" is not resident yet: it cannot be evicted
    cache.release("a")
    assert cache.reserve("b", 60 * MB) == []
    assert cache.snapshot().device_reserved_bytes == 60 * MB


def test_second_reserve_of_a_loading_model_is_refused() -> None:
    cache = make_cache()
    cache.reserve("a", MB)
    with pytest.raises(ValueError, match="already being loaded"):
        cache.reserve("a", MB)


def test_measured_size_replaces_the_estimate_and_is_remembered() -> None:
    cache = make_cache(device=100 * MB)
    cache.reserve("a", 10 * MB)  # manifest estimate was far off
    assert cache.commit("a", 30 * MB, 1.0, "repository") == []
    assert cache.snapshot().device_used_bytes == 30 * MB
    cache.remove("a")
    assert cache.last_measured_bytes("a") == 30 * MB
    cache.reserve("a", 10 * MB)
    reservation = cache.reservation("a")
    assert reservation is not None and reservation.size_bytes == 30 * MB


def test_measured_overflow_evicts_others_or_the_newcomer() -> None:
    cache = make_cache(device=100 * MB)
    load(cache, "a", 50 * MB)
    cache.reserve("b", 40 * MB)
    actions = cache.commit("b", 70 * MB, 1.0, "disk")
    assert [(ev.action, ev.model_id) for ev in actions] == [("drop", "a")]
    assert cache.snapshot().device == {"b": 70 * MB}
    # Pinned neighbours cannot give way: the newcomer itself leaves.
    cache.reserve("b", 0, pinned=True)  # already resident: just pins it
    cache.reserve("c", 20 * MB)
    actions = cache.commit("c", 40 * MB, 1.0, "disk")
    assert [(ev.action, ev.model_id) for ev in actions] == [("drop", "c")]
    assert cache.tier_of("c") is None and cache.tier_of("b") == "device"


def test_demote_then_promote_is_a_host_sourced_copy() -> None:
    cache = make_cache(device=100 * MB, host=150 * MB, lru=True)
    load(cache, "a", 60 * MB, source="repository")
    assert load(cache, "b", 60 * MB) == ["demote:a"]
    assert cache.tier_of("a") == "host"
    # Using "a" again: its reservation is a promotion, and "b" is demoted for it.
    actions = cache.reserve("a", 60 * MB)
    assert [(ev.action, ev.model_id, ev.from_tier) for ev in actions] == [("demote", "b", "device")]
    reservation = cache.reservation("a")
    assert reservation is not None and reservation.promotion
    assert cache.tier_of("a") == "host"  # its host copy stays until the copy is done
    assert cache.snapshot().host_used_bytes == 120 * MB
    assert cache.commit("a", 60 * MB, 0.05, "host") == []
    snap = cache.snapshot()
    assert snap.device == {"a": 60 * MB} and snap.host == {"b": 60 * MB}
    assert snap.loads_by_source == {"repository": 1, "disk": 1, "host": 1}
    assert snap.demotions == 2


def test_promotion_never_over_commits_host_memory() -> None:
    # Host holds only one model: while "a" is copied up, "b" cannot go down.
    cache = make_cache(device=100 * MB, host=100 * MB, lru=True)
    load(cache, "a", 60 * MB)
    load(cache, "b", 60 * MB)
    assert [(ev.action, ev.model_id) for ev in cache.reserve("a", 60 * MB)] == [("drop", "b")]


def test_host_tier_drops_its_own_victims_before_taking_a_demotion() -> None:
    cache = make_cache(device=100 * MB, host=100 * MB, lru=True)
    cache.host.policy = LruPolicy()
    load(cache, "a", 60 * MB)
    load(cache, "b", 60 * MB)  # demotes a
    actions = cache.reserve("c", 60 * MB)  # demotes b; host must drop a first
    assert [(ev.action, ev.model_id, ev.from_tier) for ev in actions] == [
        ("drop", "a", "host"),
        ("demote", "b", "device"),
    ]


def test_failed_promotion_leaves_the_host_copy() -> None:
    cache = make_cache(device=100 * MB, host=100 * MB)
    load(cache, "a", 60 * MB)
    load(cache, "b", 60 * MB)
    cache.reserve("a", 60 * MB)
    cache.release("a")
    assert cache.tier_of("a") == "host"
    assert cache.snapshot().device_reserved_bytes == 0


def test_model_bigger_than_host_budget_is_dropped_not_demoted() -> None:
    cache = make_cache(device=100 * MB, host=50 * MB)
    load(cache, "a", 60 * MB)
    assert load(cache, "b", 60 * MB) == ["drop:a"]


def test_hit_reports_the_tier_and_remove_frees_bytes() -> None:
    cache = make_cache(device=100 * MB, host=100 * MB)
    load(cache, "a", 10 * MB, pinned=True)
    assert cache.hit("a") == "device"
    assert cache.hit("nope") is None
    assert [ev.action for ev in cache.remove("a")] == ["drop"]
    snap = cache.snapshot()
    assert snap.device_used_bytes == 0 and not snap.pinned
    assert cache.remove("a") == []


def test_commit_feeds_the_cost_model_and_the_policy_sees_measured_cost() -> None:
    cache = make_cache(device=100 * MB)
    load(cache, "slow", 10 * MB, seconds=8.0, source="repository")
    assert cache.reload_cost_s("slow", 10 * MB) == 8.0
    assert cache.cost_model.observations("repository") == pytest.approx(1.0)
    # Never loaded: falls back to the cost model, which has learned from "slow".
    assert cache.reload_cost_s("new", 10 * MB) == pytest.approx(8.0)


def test_commit_or_release_without_reserve_is_a_caller_bug() -> None:
    cache = make_cache()
    with pytest.raises(ValueError, match="call reserve first"):
        cache.commit("a", MB, 1.0, "disk")
    with pytest.raises(ValueError, match="call reserve first"):
        cache.release("a")


def test_commit_refuses_what_cannot_stay_and_leaves_it_unaccounted() -> None:
    cache = make_cache(device=100 * MB)
    cache.reserve("liar", 10 * MB)  # the manifest said 10 MB
    with pytest.raises(ModelTooLarge, match=r"'liar' needs 150000000 bytes"):
        cache.commit("liar", 150 * MB, 1.0, "disk")
    assert cache.tier_of("liar") is None and cache.snapshot().device_reserved_bytes == 0
    load(cache, "pinned", 60 * MB, pinned=True)
    cache.reserve("pinned-too", 30 * MB, pinned=True)
    with pytest.raises(NoCapacity, match="'pinned-too'"):
        cache.commit("pinned-too", 50 * MB, 1.0, "disk")
    snap = cache.snapshot()
    assert snap.device == {"pinned": 60 * MB} and snap.pinned == {"pinned"}


def test_a_load_keeps_the_room_it_reserved_when_the_budget_is_cut_under_it() -> None:
    """A worker moves budget away from a runtime while a load there is in flight: the
    load still lands (the request it serves does not fail), the unpinned residents give
    way, and the next load evicts down to the new budget."""
    cache = make_cache(device=100 * MB)
    load(cache, "pinned", 40 * MB, pinned=True)
    load(cache, "old", 20 * MB)
    cache.reserve("new", 30 * MB)
    cut = cache.set_budgets(50 * MB)  # below the pinned model and the load in flight
    assert [(ev.action, ev.model_id) for ev in cut] == [("drop", "old")]
    assert cache.commit("new", 30 * MB, 1.0, "disk") == []
    snap = cache.snapshot()
    assert snap.device == {"pinned": 40 * MB, "new": 30 * MB}  # 70 MB over a 50 MB budget
    assert load(cache, "next", 5 * MB) == ["drop:new"]  # the next load evicts down
    snap = cache.snapshot()
    assert snap.device_used_bytes + snap.device_reserved_bytes <= 50 * MB


def test_a_budget_cut_below_a_load_in_flight_does_not_refuse_it() -> None:
    cache = make_cache(device=100 * MB)
    cache.reserve("big", 60 * MB)
    cache.set_budgets(40 * MB)  # below the model itself: new loads of it are refused...
    assert cache.commit("big", 55 * MB, 1.0, "disk") == []  # ...this one keeps its room
    assert cache.tier_of("big") == "device"
    cache.remove("big")
    with pytest.raises(ModelTooLarge, match="whole device budget is 40000000"):
        cache.reserve("big", 55 * MB)
    # Above its reservation a load is held to the budget as before.
    cache.reserve("liar", 10 * MB)
    cache.set_budgets(30 * MB)
    with pytest.raises(ModelTooLarge, match="'liar' needs 35000000 bytes"):
        cache.commit("liar", 35 * MB, 1.0, "disk")


def test_resident_ids_name_what_the_snapshot_lists_per_tier() -> None:
    cache = make_cache(device=100 * MB, host=150 * MB, lru=True)
    assert cache.resident_ids() == (frozenset(), frozenset())
    load(cache, "a", 60 * MB)
    load(cache, "b", 60 * MB)  # demotes "a"
    cache.reserve("c", 10 * MB)  # a load in flight is resident nowhere yet
    snap = cache.snapshot()
    assert cache.resident_ids() == (frozenset(snap.device), frozenset(snap.host))
    assert cache.resident_ids() == (frozenset({"b"}), frozenset({"a"}))
