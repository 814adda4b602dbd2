"""Tier accounting: which model ids are resident on the device and in host memory.

``ModelCache`` never loads or frees anything. The runtime (and the simulator)
drive real loads around it in two phases, because a load takes seconds and
several may be in flight::

    tier = cache.hit(model_id)                    # "device": run it now
    if tier != "device":
        for ev in cache.reserve(model_id, manifest_bytes):   # raises ModelTooLarge, NoCapacity
            carry_out(ev)                                    # demote or drop, in this order
        try:
            measured_bytes, seconds, source = load(model_id)  # "host" if promotion
        except Exception:
            cache.release(model_id)
            raise
        for ev in cache.commit(model_id, measured_bytes, seconds, source):
            carry_out(ev)

Invariant: device bytes resident plus reserved <= device budget; host bytes <= host budget.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import cast

from modelfleet.cache.cost import LoadCostModel
from modelfleet.cache.policy import AdmissionPolicy, EvictionPolicy, GdsfPolicy
from modelfleet.cache.tiers import HostTier
from modelfleet.cache.types import CacheSnapshot, Eviction, LoadSource, Reservation, Tier
from modelfleet.errors import ModelTooLarge, NoCapacity


class ModelCache:
    """Pure, synchronous accounting of a device tier backed by a host-memory tier.

    ``policy`` ranks device residents; ``host_policy`` (default: a new
    ``GdsfPolicy``) ranks host residents. ``clock`` (seconds, monotonic) only
    stamps reservations and snapshots. ``cost_model`` learns reload costs from
    ``commit``; pass one to share it between caches.

    Not thread-safe: call it from one thread (the runtime's control loop).
    """

    def __init__(
        self,
        device_budget_bytes: int,
        host_budget_bytes: int,
        policy: EvictionPolicy,
        host_policy: EvictionPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        cost_model: LoadCostModel | None = None,
    ) -> None:
        if min(device_budget_bytes, host_budget_bytes) < 0:
            raise ValueError(f"budgets must be >= 0: {device_budget_bytes}, {host_budget_bytes}")
        self.device_budget_bytes = device_budget_bytes
        self.policy = policy
        # (policy, whether it is an AdmissionPolicy): see _admission_policy.
        self._admission_of: tuple[EvictionPolicy, bool] | None = None
        self.cost_model = cost_model if cost_model is not None else LoadCostModel()
        # `is None`, not `or`: an empty policy has len() 0 and is falsy.
        host_policy = host_policy if host_policy is not None else GdsfPolicy()
        self.host = HostTier(host_budget_bytes, host_policy)
        self._clock = clock
        self._device: dict[str, int] = {}
        self._device_used = 0
        self._reserved: dict[str, Reservation] = {}
        self._reserved_bytes = 0
        self._pinned: set[str] = set()
        self._measured: dict[str, int] = {}
        self._loads: Counter[str] = Counter()
        self._drops = 0

    @property
    def host_budget_bytes(self) -> int:
        return self.host.budget_bytes

    def tier_of(self, model_id: str) -> Tier | None:
        """Where ``model_id`` is resident now. A model being promoted is still
        ``"host"`` until ``commit``; a model being loaded cold is ``None``."""
        if model_id in self._device:
            return "device"
        if model_id in self.host:
            return "host"
        return None

    def reservation(self, model_id: str) -> Reservation | None:
        """The load in flight for ``model_id``, if any."""
        return self._reserved.get(model_id)

    def last_measured_bytes(self, model_id: str) -> int | None:
        """The size measured by the last ``commit`` of ``model_id``, even after eviction."""
        return self._measured.get(model_id)

    def is_pinned(self, model_id: str) -> bool:
        return model_id in self._pinned

    def reload_cost_s(self, model_id: str, size_bytes: int) -> float:
        """Seconds to get ``model_id`` back if it were dropped (see ``LoadCostModel``)."""
        return self.cost_model.reload_cost(model_id, size_bytes)

    def snapshot(self) -> CacheSnapshot:
        """An immutable view of every tier, budget and counter."""
        return CacheSnapshot(
            taken_at_s=self._clock(),
            device_budget_bytes=self.device_budget_bytes,
            host_budget_bytes=self.host.budget_bytes,
            device=dict(self._device),
            host=self.host.resident(),
            reserved=dict(self._reserved),
            pinned=frozenset(self._pinned),
            device_used_bytes=self._device_used,
            device_reserved_bytes=self._reserved_bytes,
            host_used_bytes=self.host.used_bytes,
            loads_by_source=dict(self._loads),
            demotions=self.host.demotions,
            drops=self._drops + self.host.drops,
        )

    def resident_ids(self) -> tuple[frozenset[str], frozenset[str]]:
        """The model ids on the device and in host memory now: ``snapshot``'s
        ``device`` and ``host`` keys, without copying the rest of it."""
        return frozenset(self._device), self.host.ids()

    def hit(self, model_id: str) -> Tier | None:
        """Record one use of ``model_id`` and say where it is. None: not resident
        (it may be loading: see ``reservation``; a load's commit counts as one use)."""
        if model_id in self._device:
            self.policy.touch(model_id)
            return "device"
        if model_id in self.host:
            self.host.policy.touch(model_id)
            return "host"
        return None

    def reserve(self, model_id: str, size_bytes: int, pinned: bool = False) -> list[Eviction]:
        """Make room on the device for ``model_id``; return what to evict first, in order.

        ``size_bytes`` is the manifest estimate; the last measured size wins when
        known. On a host-resident model this starts a promotion (see
        ``reservation(model_id).promotion``; commit it with ``source="host"``).
        On a model already on the device: nothing to do (pins it if asked).

        Raises ``ModelTooLarge`` if the model exceeds the whole device budget,
        ``NoCapacity`` if pinned models and loads in flight leave no room (state
        unchanged), ``ValueError`` if a load of ``model_id`` is already in flight.
        """
        if size_bytes < 0:
            raise ValueError(f"size_bytes must be >= 0, got {size_bytes} for {model_id!r}")
        if model_id in self._reserved:
            raise ValueError(
                f"model {model_id!r} is already being loaded; wait for that load "
                "instead of starting a second one"
            )
        if model_id in self._device:
            if pinned:
                self._pinned.add(model_id)
            return []
        promotion = model_id in self.host
        size = (
            self.host.size_of(model_id) if promotion else self._measured.get(model_id, size_bytes)
        )
        if size > self.device_budget_bytes:
            raise self._too_large(model_id, size)
        victims = self._plan_device_room(model_id, size)
        if promotion:
            # Before evicting: demotions must not push out the copy we promote.
            self.host.protect(model_id)
        actions = self._evict_from_device(victims, f"making room for {model_id!r}")
        self._reserved[model_id] = Reservation(model_id, size, pinned, promotion, self._clock())
        self._reserved_bytes += size
        if pinned:
            self._pinned.add(model_id)
        return actions

    def commit(
        self, model_id: str, measured_bytes: int, load_seconds: float, source: LoadSource
    ) -> list[Eviction]:
        """The load of ``model_id`` finished: it is now resident on the device.

        Replaces the reservation by ``measured_bytes``, feeds the cost model and
        frees the host copy of a promotion. If the measured size overflows the
        budget, returns further evictions to carry out now; when only the new
        model itself can give way, the list holds its own demotion or drop.

        A load keeps the room it reserved: measured within its reservation, it is
        resident after ``commit`` even if ``set_budgets`` cut the budget under it
        meanwhile (the lowest-ranked unpinned residents give way first; what still
        does not fit stays over the budget until the next reservation or budget change
        evicts down to it).

        Raises ``ModelTooLarge`` (measured size, above its reservation, exceeds the
        whole budget) or ``NoCapacity`` (pinned, above its reservation, and no room):
        the model is then not resident and the caller must unload it. ``ValueError``
        if nothing was reserved.
        """
        if measured_bytes < 0:
            raise ValueError(f"measured_bytes must be >= 0, got {measured_bytes} for {model_id!r}")
        reservation = self._pop_reservation(model_id)
        self._measured[model_id] = measured_bytes
        self.cost_model.observe(source, measured_bytes, load_seconds, model_id)
        self._loads[source] += 1
        if reservation.promotion:
            self.host.forget(model_id)
        promised = measured_bytes <= reservation.size_bytes
        if measured_bytes > self.device_budget_bytes and not promised:
            self._pinned.discard(model_id)
            raise self._too_large(model_id, measured_bytes)
        try:
            victims = self._plan_device_room(model_id, measured_bytes, committing=True,
                                             short_ok=promised)
        except NoCapacity:
            if reservation.pinned:
                self._pinned.discard(model_id)
                raise
            # Nothing else can give way: the newcomer itself leaves again.
            return self._to_host_or_drop(
                model_id, measured_bytes, f"measured size of {model_id!r} does not fit"
            )
        actions = self._evict_from_device(victims, f"measured size of {model_id!r} overflowed")
        self._device[model_id] = measured_bytes
        self._device_used += measured_bytes
        self.policy.admit(model_id, measured_bytes, self.reload_cost_s(model_id, measured_bytes))
        return actions

    def release(self, model_id: str) -> None:
        """The load of ``model_id`` failed: return its reserved bytes. A promoted
        model stays in host memory; a pin requested with ``reserve`` is dropped."""
        reservation = self._pop_reservation(model_id)
        if reservation.promotion:
            self.host.unprotect(model_id)
        if reservation.pinned:
            self._pinned.discard(model_id)

    def remove(self, model_id: str) -> list[Eviction]:
        """Drop ``model_id`` from whichever tier holds it (pinned or not); returns
        the one drop to carry out, or ``[]`` if it was not resident."""
        if model_id in self._reserved:
            raise ValueError(f"model {model_id!r} is being loaded; release or commit it first")
        self._pinned.discard(model_id)
        if model_id in self._device:
            self.policy.forget(model_id)
            size = self._device.pop(model_id)
            self._device_used -= size
            self._drops += 1
            return [Eviction(model_id, size, "drop", "device", "removed explicitly")]
        if model_id in self.host:
            return [self.host.remove(model_id, "removed explicitly")]
        return []

    def set_budgets(self, device_budget_bytes: int,
                    host_budget_bytes: int | None = None) -> list[Eviction]:
        """Change the budgets now (a worker's pooled budget moved); returns what to evict.

        A smaller device budget evicts the lowest-ranked unpinned residents (to host
        memory, or dropped) until resident plus reserved bytes fit; pinned models and
        loads in flight stay, so the device tier may remain over a budget cut below them
        until those loads finish and after (a load keeps the room it reserved: see
        ``commit``); the next reservation or budget change evicts down to the budget. A
        smaller host budget drops host residents the same way (promotions in flight stay).
        """
        host_budget = self.host.budget_bytes if host_budget_bytes is None else host_budget_bytes
        if min(device_budget_bytes, host_budget) < 0:
            raise ValueError(f"budgets must be >= 0: {device_budget_bytes}, {host_budget}")
        self.device_budget_bytes = device_budget_bytes
        actions = self.host.set_budget(host_budget)
        excluded = set(self._pinned)
        victims: list[str] = []
        free = device_budget_bytes - self._device_used - self._reserved_bytes
        while free < 0:
            victim = self.policy.victim(excluded)
            if victim is None:
                break
            victims.append(victim)
            excluded.add(victim)
            free += self._device[victim]
        return actions + self._evict_from_device(victims, "the device budget was lowered")

    def shed(self) -> Eviction | None:
        """Drop the lowest-ranked unpinned model, host tier first (memory pressure: a CPU
        model demoted to host memory still holds its bytes, so nothing is demoted);
        None when nothing can be given up."""
        dropped = self.host.shed("shedding memory: the runtime is over its budget")
        if dropped is not None:
            return dropped
        victim = self.policy.victim(set(self._pinned))
        if victim is None:
            return None
        self.policy.evict(victim)
        size = self._device.pop(victim)
        self._device_used -= size
        self._drops += 1
        return Eviction(victim, size, "drop", "device",
                        "shedding memory: the runtime is over its budget")

    def room_for(self, model_id: str, size_bytes: int) -> bool:
        """Would ``size_bytes`` for ``model_id`` fit now, evicting every unpinned model?

        Counts pinned models and the *other* loads in flight (their reservations), not
        ``model_id``'s own reservation: the question a load asks before ``commit``.
        """
        own = self._reserved.get(model_id)
        reserved = self._reserved_bytes - (own.size_bytes if own is not None else 0)
        pinned = sum(self._device.get(key, 0) for key in self._pinned if key != model_id)
        return pinned + reserved + size_bytes <= self.device_budget_bytes

    @property
    def pinned_device_bytes(self) -> int:
        """Bytes of pinned models resident on the device."""
        return sum(self._device.get(key, 0) for key in self._pinned)

    def pin(self, model_id: str) -> bool:
        """Pin ``model_id`` if it is on the device (True); False if it is not there."""
        if model_id not in self._device:
            return False
        self._pinned.add(model_id)
        return True

    def unpin(self, model_id: str) -> None:
        """Make ``model_id`` evictable again (no-op if it was not pinned)."""
        self._pinned.discard(model_id)

    def _pop_reservation(self, model_id: str) -> Reservation:
        reservation = self._reserved.pop(model_id, None)
        if reservation is None:
            raise ValueError(f"no load of model {model_id!r} is in flight; call reserve first")
        self._reserved_bytes -= reservation.size_bytes
        return reservation

    def _too_large(self, model_id: str, size: int) -> ModelTooLarge:
        return ModelTooLarge(
            f"model {model_id!r} needs {size} bytes but the whole device budget is "
            f"{self.device_budget_bytes} bytes; serve it on a larger worker or raise "
            "the device memory budget"
        )

    def _admission_policy(self) -> AdmissionPolicy | None:
        """``policy`` if it decides admission (an ``AdmissionPolicy``), else None. An
        isinstance check against a runtime-checkable Protocol walks its members, so it
        is asked once per policy object, not per reserve and commit."""
        policy = self.policy
        known = self._admission_of
        if known is None or known[0] is not policy:
            known = self._admission_of = (policy, isinstance(policy, AdmissionPolicy))
        return cast(AdmissionPolicy, policy) if known[1] else None

    def _plan_device_room(self, model_id: str, size: int, committing: bool = False,
                          short_ok: bool = False) -> list[str]:
        """Device residents to evict, lowest priority first, so ``size`` fits. Changes
        nothing (an ``AdmissionPolicy`` may relabel its own entries: see its docs).

        ``short_ok``: when even every unpinned resident would not free enough, return
        them all instead of raising ``NoCapacity`` (a load keeping its reserved room)."""
        free = self.device_budget_bytes - self._device_used - self._reserved_bytes
        excluded = set(self._pinned)
        victims: list[str] = []
        admission = self._admission_policy()
        if admission is not None:  # it decides admission, so it plans
            victims = admission.plan_room(model_id, size, self.reload_cost_s(model_id, size),
                                          free, self.device_budget_bytes, excluded,
                                          committing=committing)
            excluded.update(victims)
            free += sum(self._device[victim] for victim in victims)
        while free < size:
            victim = self.policy.victim(excluded)
            if victim is None and short_ok:
                break
            if victim is None:
                pinned_bytes = sum(self._device.get(key, 0) for key in self._pinned)
                raise NoCapacity(
                    f"no room on the device for model {model_id!r} ({size} bytes): budget "
                    f"{self.device_budget_bytes} bytes, {pinned_bytes} pinned, "
                    f"{self._reserved_bytes} reserved by loads in flight, "
                    f"{free} free after evicting everything else; retry once loads "
                    "finish, or unpin models"
                )
            victims.append(victim)
            excluded.add(victim)
            free += self._device[victim]
        return victims

    def _evict_from_device(self, victims: list[str], reason: str) -> list[Eviction]:
        actions: list[Eviction] = []
        for victim in victims:
            self.policy.evict(victim)
            size = self._device.pop(victim)
            self._device_used -= size
            actions.extend(self._to_host_or_drop(victim, size, reason))
        return actions

    def _to_host_or_drop(self, model_id: str, size: int, reason: str) -> list[Eviction]:
        """``model_id`` (already off the device books) goes to host memory if the
        host tier takes it, else it is dropped."""
        cost = self.reload_cost_s(model_id, size)
        demoted = self.host.demote(model_id, size, cost, reason)
        if demoted is not None:
            return demoted
        self._drops += 1
        return [Eviction(model_id, size, "drop", "device", reason)]
