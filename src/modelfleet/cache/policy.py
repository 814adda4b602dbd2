"""Eviction policies: which resident model to give up first.

A policy only ranks keys; it never decides *whether* to evict (``ModelCache``
does that from its byte budgets) and never touches memory. One policy instance
ranks one tier.

- ``GdsfPolicy``: GreedyDual-Size-Frequency (Cherkasova 1998). Priority
  ``H = L + frequency * reload_cost / size``; the lowest ``H`` goes first, and the
  aging clock ``L`` rises to the evicted entry's ``H``, so entries that stopped
  being used eventually lose to newcomers. Small, often-used, expensive-to-reload
  models stay; big, rarely-used, cheap ones go. This is the default.
- ``TinyLfuPolicy``: W-TinyLFU (Einziger, Friedman & Manes 2017, as in Caffeine)
  made size- and cost-aware: a frequency sketch that survives eviction, a small
  window (scratch share) every newcomer is served from, and a main part ranked by
  GDSF over the sketch's frequencies that a model enters only if it is worth more
  than what it would push out. A tail model is served and dropped without evicting
  the head; a popular model evicted once comes back with its count.
- ``LruPolicy``: least recently used, for comparison.

All are deterministic: ties break by admission order, never by wall time.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from modelfleet.cache.sketch import FrequencySketch


@runtime_checkable
class EvictionPolicy(Protocol):
    """Keeps priorities of the resident keys of one tier.

    Contract: ``admit`` a key before any other call names it; ``evict`` or
    ``forget`` it when it leaves the tier. Calls naming an unknown key raise
    ``KeyError`` (a bookkeeping bug in the caller), except ``admit``.
    """

    def admit(self, key: str, size_bytes: int, load_cost_s: float) -> None:
        """Start ranking ``key`` (counts as its first use). On a key already
        admitted: update its size and cost, keep its use history."""
        ...

    def touch(self, key: str) -> None:
        """Record one use (a cache hit) of ``key``."""
        ...

    def evict(self, key: str) -> None:
        """``key`` leaves because ``victim`` chose it (GDSF ages its clock here)."""
        ...

    def forget(self, key: str) -> None:
        """``key`` leaves for another reason (explicit removal, promotion)."""
        ...

    def victim(self, exclude: Collection[str] = ()) -> str | None:
        """The lowest-priority key not in ``exclude``, or None. Changes nothing."""
        ...

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...


@runtime_checkable
class AdmissionPolicy(EvictionPolicy, Protocol):
    """An ``EvictionPolicy`` that also decides admission, so it plans room itself.

    ``ModelCache`` asks ``plan_room`` instead of calling ``victim`` in a loop. The
    policy may relabel its own entries (window to main) there, but the cache's books
    change only when the cache carries the plan out (``evict`` each victim, then
    ``admit`` the newcomer). A requested model is always served: the plan makes room
    for it whether or not it earns a place beyond the scratch share.
    """

    def plan_room(self, key: str, size_bytes: int, load_cost_s: float, free_bytes: int,
                  budget_bytes: int, exclude: Collection[str], committing: bool = False
                  ) -> list[str]:
        """Residents to evict, in order, so ``size_bytes`` for ``key`` fits in
        ``free_bytes`` plus what they free; never one in ``exclude``. May come up short
        (everything else excluded): the caller then refuses the load.

        ``committing``: the load has finished and only its measured size is new; the
        admission decided when its room was first planned stands."""
        ...


@dataclass(slots=True)
class _GdsfEntry:
    size_bytes: int
    load_cost_s: float
    frequency: int
    priority: float
    seq: int  # identifies the one live heap item for this key


class GdsfPolicy:
    """GreedyDual-Size-Frequency: evict the lowest ``L + frequency * cost / size``.

    ``load_cost_s`` is what it would cost to get the model back (seconds);
    ``size_bytes`` what keeping it costs. Frequency counts uses during the
    current residency (admission counts as one), so a model that was evicted
    starts again from one: the aging clock, not old history, decides.

    Operations are O(log n) amortised (a heap with lazy deletion).
    """

    def __init__(self, frequency: Callable[[str], int] | None = None) -> None:
        self._frequency = frequency
        """When given (``TinyLfuPolicy`` passes its sketch), a key's frequency is read from
        it at every admit and touch instead of counted per residency."""
        self._entries: dict[str, _GdsfEntry] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self.clock: float = 0.0
        """The aging value ``L``; only ever rises."""

    def admit(self, key: str, size_bytes: int, load_cost_s: float) -> None:
        entry = self._entries.get(key)
        frequency = entry.frequency if entry is not None else 1
        self._entries[key] = _GdsfEntry(
            max(1, size_bytes), max(0.0, load_cost_s), frequency, 0.0, -1
        )
        self._reprioritise(key)

    def touch(self, key: str) -> None:
        self._entries[key].frequency += 1
        self._reprioritise(key)

    def evict(self, key: str) -> None:
        entry = self._entries.pop(key)
        # Aging: everything admitted or used from now on starts above the
        # evicted entry, so idle old entries sink below active new ones.
        self.clock = max(self.clock, entry.priority)
        self._compact_if_needed()

    def forget(self, key: str) -> None:
        del self._entries[key]
        self._compact_if_needed()

    def victim(self, exclude: Collection[str] = ()) -> str | None:
        skipped: list[tuple[float, int, str]] = []
        found: str | None = None
        while self._heap:
            item = self._heap[0]
            if not self._is_live(item):
                heapq.heappop(self._heap)
                continue
            if item[2] in exclude:
                skipped.append(heapq.heappop(self._heap))
                continue
            found = item[2]
            break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return found

    def priority(self, key: str) -> float:
        """Current ``H`` of ``key`` (for tests and introspection)."""
        return self._entries[key].priority

    def frequency(self, key: str) -> int:
        """Uses of ``key`` during its current residency."""
        return self._entries[key].frequency

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _reprioritise(self, key: str) -> None:
        entry = self._entries[key]
        if self._frequency is not None:
            entry.frequency = max(1, self._frequency(key))
        entry.priority = self.clock + entry.frequency * entry.load_cost_s / entry.size_bytes
        entry.seq = next(self._seq)
        heapq.heappush(self._heap, (entry.priority, entry.seq, key))
        self._compact_if_needed()

    def _is_live(self, item: tuple[float, int, str]) -> bool:
        entry = self._entries.get(item[2])
        return entry is not None and entry.seq == item[1]

    def _compact_if_needed(self) -> None:
        # Stale items pile up on every touch; rebuild once they dominate.
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = [item for item in self._heap if self._is_live(item)]
            heapq.heapify(self._heap)


class LruPolicy:
    """Least recently used: evict the key whose last admit or touch is oldest.

    Ignores size and cost. ``victim`` is O(1) unless many of the oldest keys
    are excluded.
    """

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def admit(self, key: str, size_bytes: int, load_cost_s: float) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: str) -> None:
        self._order.move_to_end(key)

    def evict(self, key: str) -> None:
        del self._order[key]

    def forget(self, key: str) -> None:
        del self._order[key]

    def victim(self, exclude: Collection[str] = ()) -> str | None:
        for key in self._order:
            if key not in exclude:
                return key
        return None

    def order(self) -> list[str]:
        """Keys from least to most recently used."""
        return list(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


@dataclass(slots=True)
class _Resident:
    size_bytes: int
    load_cost_s: float


class TinyLfuPolicy:
    """W-TinyLFU with sizes and costs: a window (scratch share), a GDSF main part, a sketch.

    - Every use (admit or touch) counts in a ``FrequencySketch`` that keeps counts of
      evicted models too, halved every ``sample_size`` uses (default: ten times the
      most entries seen resident, at least 160).
    - A newcomer is served from the *window*, ``window_fraction`` of the budget, in
      LRU order. When the window overflows, its oldest entry is a *candidate* for the
      main part: it moves there if main has room, or if it is worth more than the main
      residents it would push out (estimated frequency x reload cost, summed over
      them: the reloads that keeping it saves against those that keeping them saves);
      otherwise it is dropped and the head stays.
    - A newcomer too big for the window is a candidate at once; if it loses it is
      still served (the room comes from the window first) and is the first to go.
    - Main ranks by GDSF, ``L + frequency * cost / size``, with frequencies from the
      sketch, so a popular model reloaded after an eviction is ranked by its history.

    ``victim`` (for callers that do not plan, like the host tier) names the oldest
    window entry first, then main's lowest. Ties reject: a candidate must be worth
    strictly more than what it displaces.
    """

    def __init__(self, window_fraction: float = 0.1, sample_size: int | None = None,
                 width: int = 4096) -> None:
        if not 0.0 <= window_fraction < 1.0:
            raise ValueError(f"window_fraction must be in [0, 1), got {window_fraction}")
        self.window_fraction = window_fraction
        self._fixed_sample = sample_size is not None
        self.sketch = FrequencySketch(sample_size or 160, width=width)
        self._main = GdsfPolicy(frequency=self.sketch.estimate)
        self._window: OrderedDict[str, _Resident] = OrderedDict()
        self._main_sizes: dict[str, _Resident] = {}
        self._main_bytes = 0
        self._window_bytes = 0
        self._to_main: set[str] = set()  # won admission at plan time, enter main at admit
        self._peak_entries = 0
        self.admitted = 0
        """Candidates that won a place in main (for tests and the bench)."""
        self.rejected = 0
        """Candidates dropped, or served only from the window, to keep the head."""

    # -- EvictionPolicy -------------------------------------------------------------

    def admit(self, key: str, size_bytes: int, load_cost_s: float) -> None:
        self.sketch.increment(key)
        resident = _Resident(max(1, size_bytes), max(0.0, load_cost_s))
        if key in self._main_sizes:
            self._main_bytes += resident.size_bytes - self._main_sizes[key].size_bytes
            self._main_sizes[key] = resident
            self._main.admit(key, resident.size_bytes, resident.load_cost_s)
        elif key in self._to_main:
            self._to_main.discard(key)
            self._enter_main(key, resident)
        else:
            old = self._window.pop(key, None)
            self._window_bytes += resident.size_bytes - (old.size_bytes if old else 0)
            self._window[key] = resident
        entries = len(self._window) + len(self._main_sizes)
        if entries > self._peak_entries:
            self._peak_entries = entries
            if not self._fixed_sample:
                self.sketch.resize_sample(max(160, 10 * entries))

    def touch(self, key: str) -> None:
        if key in self._window:
            self.sketch.increment(key)
            self._window.move_to_end(key)
        elif key in self._main_sizes:
            self.sketch.increment(key)
            self._main.touch(key)
        else:
            raise KeyError(key)

    def evict(self, key: str) -> None:
        self._leave(key, evicted=True)

    def forget(self, key: str) -> None:
        self._leave(key, evicted=False)

    def victim(self, exclude: Collection[str] = ()) -> str | None:
        for key in self._window:
            if key not in exclude:
                return key
        return self._main.victim(exclude)

    def __contains__(self, key: object) -> bool:
        return key in self._window or key in self._main_sizes

    def __len__(self) -> int:
        return len(self._window) + len(self._main_sizes)

    # -- AdmissionPolicy ------------------------------------------------------------

    def plan_room(self, key: str, size_bytes: int, load_cost_s: float, free_bytes: int,
                  budget_bytes: int, exclude: Collection[str], committing: bool = False
                  ) -> list[str]:
        window_cap = int(self.window_fraction * budget_bytes)
        main_cap = budget_bytes - window_cap
        excluded = set(exclude) | {key}
        victims: list[str] = []
        if committing or key in self:  # decided already: room only
            pass
        elif size_bytes > window_cap:
            self._to_main.discard(key)
            won, pushed_out = self._contest(key, size_bytes, load_cost_s, 1,
                                            self._main_bytes, main_cap, excluded)
            if won:
                self._to_main.add(key)
                victims += pushed_out
                excluded.update(pushed_out)
        else:
            # The window takes the newcomer; its oldest entries become candidates.
            self._to_main.discard(key)
            window_used = self._window_bytes
            main_used = self._main_bytes
            for candidate in list(self._window):
                if window_used + size_bytes <= window_cap:
                    break
                if candidate in excluded:
                    continue
                resident = self._window[candidate]
                window_used -= resident.size_bytes
                won, pushed_out = self._contest(candidate, resident.size_bytes,
                                                resident.load_cost_s, 0, main_used, main_cap,
                                                excluded)
                if won:
                    del self._window[candidate]
                    self._window_bytes -= resident.size_bytes
                    self._enter_main(candidate, resident)
                    main_used += resident.size_bytes - sum(self._size(v) for v in pushed_out)
                    victims += pushed_out
                    excluded.update(pushed_out)
                else:
                    victims.append(candidate)
                    excluded.add(candidate)
        freed = sum(self._size(v) for v in victims)
        while free_bytes + freed < size_bytes:  # loads in flight hold room: take more
            victim = self.victim(excluded)
            if victim is None:
                break
            victims.append(victim)
            excluded.add(victim)
            freed += self._size(victim)
        return victims

    # -- internals ------------------------------------------------------------------

    def is_in_window(self, key: str) -> bool:
        """Whether ``key`` is served from the scratch share (not yet admitted to main)."""
        return key in self._window

    def _contest(self, key: str, size_bytes: int, load_cost_s: float, pending_uses: int,
                 main_used: int, main_cap: int, excluded: set[str]) -> tuple[bool, list[str]]:
        """Does ``key`` earn ``size_bytes`` of main, holding ``main_used`` bytes now?
        Returns (won, the main residents it pushes out)."""
        need = main_used + size_bytes - main_cap
        pushed_out: list[str] = []
        value = 0.0
        skip = set(excluded)
        while need > 0:
            victim = self._main.victim(skip)
            if victim is None:  # pinned or in flight: main cannot make room
                self.rejected += 1
                return False, []
            resident = self._main_sizes[victim]
            pushed_out.append(victim)
            skip.add(victim)
            need -= resident.size_bytes
            value += max(1, self.sketch.estimate(victim)) * resident.load_cost_s
        worth = (self.sketch.estimate(key) + pending_uses) * max(0.0, load_cost_s)
        if pushed_out and worth <= value:
            self.rejected += 1
            return False, []
        self.admitted += 1
        return True, pushed_out

    def _enter_main(self, key: str, resident: _Resident) -> None:
        self._main_sizes[key] = resident
        self._main_bytes += resident.size_bytes
        self._main.admit(key, resident.size_bytes, resident.load_cost_s)

    def _size(self, key: str) -> int:
        resident = self._window.get(key) or self._main_sizes[key]
        return resident.size_bytes

    def _leave(self, key: str, evicted: bool) -> None:
        self._to_main.discard(key)
        if key in self._window:
            self._window_bytes -= self._window.pop(key).size_bytes
            return
        resident = self._main_sizes.pop(key)  # KeyError on an unknown key, as promised
        self._main_bytes -= resident.size_bytes
        if evicted:
            self._main.evict(key)
        else:
            self._main.forget(key)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "gdsf": GdsfPolicy, "lru": LruPolicy, "tinylfu": TinyLfuPolicy,
}
"""Policies by name, for settings and command lines: ``POLICIES[name]()``."""
