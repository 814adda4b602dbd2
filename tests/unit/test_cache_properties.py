"""Random reserve/commit/release/hit/remove/set_budgets/shed sequences against ModelCache.

A mirror of "physical" memory carries out every returned Eviction in order, as
the runtime would, and must always agree with the cache's books; neither tier
may ever be over its budget, not even between two actions of one list, except
by what a budget cut could not take (pinned models and loads in flight, which
keep the room they reserved): the device tier never grows past its level at the cut,
and a load that measured within its reservation is always resident after commit.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from modelfleet.cache import (
    POLICIES,
    CacheSnapshot,
    Eviction,
    EvictionPolicy,
    LoadSource,
    ModelCache,
)
from modelfleet.errors import ModelTooLarge, NoCapacity

DEVICE_BUDGET = 100
IDS = st.sampled_from([f"m{i}" for i in range(8)])
SIZES = st.integers(min_value=0, max_value=120)
SOURCES = st.sampled_from(["repository", "disk", "host"])


class CacheMachine(RuleBasedStateMachine):
    policy_name = "gdsf"
    host_budget = 60

    def __init__(self) -> None:
        super().__init__()
        factory: Callable[[], EvictionPolicy] = POLICIES[self.policy_name]
        self.cache = ModelCache(
            DEVICE_BUDGET, self.host_budget, factory(), factory(), clock=lambda: 0.0
        )
        # What the runtime would physically hold if it obeyed every action.
        self.device: dict[str, int] = {}
        self.host: dict[str, int] = {}
        self.pinned_resident: set[str] = set()
        # Device bytes (resident + reserved) left above the budget by the last cut, if any:
        # the tier may stay over its budget by that much, never more, until back within.
        self.over_cut = 0

    def carry_out(self, actions: list[Eviction]) -> None:
        for ev in actions:
            tier = self.device if ev.from_tier == "device" else self.host
            assert tier.pop(ev.model_id) == ev.size_bytes
            assert ev.model_id not in self.pinned_resident, f"pinned {ev.model_id} evicted"
            if ev.action == "demote":
                assert ev.from_tier == "device"
                self.host[ev.model_id] = ev.size_bytes
            assert sum(self.host.values()) <= self.cache.host_budget_bytes + self.promoting()

    def promoting(self) -> int:
        """Host bytes of promotions in flight: protected from a host budget cut."""
        return sum(self.host.get(m, 0) for m, r in self.cache.snapshot().reserved.items()
                   if r.promotion)

    @rule(model_id=IDS, size=SIZES, pinned=st.booleans())
    def reserve(self, model_id: str, size: int, pinned: bool) -> None:
        before = self.cache.snapshot()
        if self.cache.reservation(model_id) is not None:
            with pytest.raises(ValueError, match="already being loaded"):
                self.cache.reserve(model_id, size, pinned)
            return
        try:
            actions = self.cache.reserve(model_id, size, pinned)
        except ModelTooLarge as exc:
            assert model_id in str(exc) and str(self.cache.device_budget_bytes) in str(exc)
            assert self.cache.snapshot() == before
            return
        except NoCapacity:
            assert self.cache.snapshot() == before
            return
        self.carry_out(actions)
        reservation = self.cache.reservation(model_id)
        if reservation is not None:
            # Room for the load must exist physically once the actions are done.
            in_flight = self.cache.snapshot().device_reserved_bytes
            assert sum(self.device.values()) + in_flight <= self.cache.device_budget_bytes
            assert reservation.promotion == (model_id in self.host)

    @rule(model_id=IDS, measured=SIZES, seconds=st.floats(0, 10), source=SOURCES)
    def commit(self, model_id: str, measured: int, seconds: float, source: LoadSource) -> None:
        reservation = self.cache.reservation(model_id)
        if reservation is None:
            with pytest.raises(ValueError, match="no load"):
                self.cache.commit(model_id, measured, seconds, source)
            return
        if reservation.promotion:
            self.host.pop(model_id)  # the copy moves up
        try:
            actions = self.cache.commit(model_id, measured, seconds, source)
        except (ModelTooLarge, NoCapacity):
            # Not resident; the runtime unloads what it loaded. Never within its room.
            assert measured > reservation.size_bytes
            return
        self.device[model_id] = measured
        self.carry_out(actions)
        if measured <= reservation.size_bytes:  # a load keeps the room it reserved
            assert self.cache.tier_of(model_id) == "device"
        assert self.cache.last_measured_bytes(model_id) == measured
        # An unpin while the load was in flight cancels the pin it asked for.
        if (reservation.pinned and self.cache.is_pinned(model_id)
                and self.cache.tier_of(model_id) == "device"):
            self.pinned_resident.add(model_id)

    @rule(model_id=IDS, size=SIZES, measured=SIZES, source=SOURCES)
    def load(self, model_id: str, size: int, measured: int, source: LoadSource) -> None:
        """The common path: reserve, load, commit, with nothing in between."""
        if self.cache.reservation(model_id) is None and self.cache.tier_of(model_id) != "device":
            self.reserve(model_id, size, pinned=False)
            self.commit(model_id, measured, 1.0, source)

    @rule(model_id=IDS)
    def release(self, model_id: str) -> None:
        if self.cache.reservation(model_id) is None:
            with pytest.raises(ValueError):
                self.cache.release(model_id)
            return
        self.cache.release(model_id)

    @rule(model_id=IDS)
    def hit(self, model_id: str) -> None:
        assert self.cache.hit(model_id) == self.cache.tier_of(model_id)

    @rule(model_id=IDS)
    def remove(self, model_id: str) -> None:
        if self.cache.reservation(model_id) is not None:
            with pytest.raises(ValueError):
                self.cache.remove(model_id)
            return
        self.pinned_resident.discard(model_id)
        actions = self.cache.remove(model_id)
        assert all(ev.action == "drop" for ev in actions)
        self.carry_out(actions)

    @rule(model_id=IDS)
    def unpin(self, model_id: str) -> None:
        self.cache.unpin(model_id)
        self.pinned_resident.discard(model_id)

    @rule(device=st.integers(min_value=0, max_value=120),
          host=st.integers(min_value=0, max_value=80))
    def set_budgets(self, device: int, host: int) -> None:
        """A worker moves budget between its runtimes, with loads in flight or not."""
        actions = self.cache.set_budgets(device, host)
        self.carry_out(actions)
        assert all(ev.model_id not in self.pinned_resident for ev in actions)
        snap = self.cache.snapshot()
        held = snap.device_used_bytes + snap.device_reserved_bytes
        if held > device:  # only what a cut cannot take is left
            unpinned = set(snap.device) - snap.pinned
            assert not unpinned, unpinned
        self.over_cut = max(0, held - device)

    @rule()
    def shed(self) -> None:
        """Memory pressure: drop one model, never a pinned one nor a load in flight."""
        before = self.cache.snapshot()
        eviction = self.cache.shed()
        if eviction is None:
            assert not set(before.host) - {m for m, r in before.reserved.items()
                                           if r.promotion}
            assert not set(before.device) - before.pinned
            return
        assert eviction.action == "drop" and eviction.model_id not in before.reserved
        self.carry_out([eviction])

    @invariant()
    def books_match_memory_and_budgets(self) -> None:
        snap: CacheSnapshot = self.cache.snapshot()
        assert dict(snap.device) == self.device
        assert dict(snap.host) == self.host
        assert snap.device_used_bytes == sum(snap.device.values())
        assert snap.host_used_bytes == sum(snap.host.values())
        assert snap.device_reserved_bytes == sum(r.size_bytes for r in snap.reserved.values())
        held = snap.device_used_bytes + snap.device_reserved_bytes
        if held <= snap.device_budget_bytes:
            self.over_cut = 0  # back within: the next cut starts afresh
        assert held <= snap.device_budget_bytes + self.over_cut
        assert snap.host_used_bytes <= snap.host_budget_bytes + self.promoting()
        assert not set(snap.device) & set(snap.host)
        assert not set(snap.device) & set(snap.reserved)
        for model_id, reservation in snap.reserved.items():
            assert reservation.promotion == (model_id in snap.host)
        assert snap.pinned <= set(snap.device) | set(snap.reserved)
        assert self.pinned_resident <= set(snap.device)
        assert len(self.cache.policy) == len(snap.device)
        assert len(self.cache.host.policy) == len(snap.host)


class GdsfWithHost(CacheMachine):
    policy_name = "gdsf"
    host_budget = 60


class LruWithHost(CacheMachine):
    policy_name = "lru"
    host_budget = 60


class GdsfNoHost(CacheMachine):
    policy_name = "gdsf"
    host_budget = 0


class TinyLfuWithHost(CacheMachine):
    """TinyLFU plans room itself (window, admission): the budgets must hold all the same."""

    policy_name = "tinylfu"
    host_budget = 60


class TinyLfuNoHost(CacheMachine):
    policy_name = "tinylfu"
    host_budget = 0


_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TestGdsfWithHost = GdsfWithHost.TestCase
TestGdsfWithHost.settings = _SETTINGS
TestLruWithHost = LruWithHost.TestCase
TestLruWithHost.settings = _SETTINGS
TestGdsfNoHost = GdsfNoHost.TestCase
TestGdsfNoHost.settings = _SETTINGS
TestTinyLfuWithHost = TinyLfuWithHost.TestCase
TestTinyLfuWithHost.settings = _SETTINGS
TestTinyLfuNoHost = TinyLfuNoHost.TestCase
TestTinyLfuNoHost.settings = _SETTINGS
