"""Eviction policies: which resident model to give up first.

A policy only ranks keys; it never decides *whether* to evict (``ModelCache``
does that from its byte budgets) and never touches memory. One policy instance
ranks one tier.

- ``GdsfPolicy``: GreedyDual-Size-Frequency (Cherkasova 1998). Priority
  ``H = L + frequency * reload_cost / size``; the lowest ``H`` goes first, and the
  aging clock ``L`` rises to the evicted entry's ``H``, so entries that stopped
  being used eventually lose to newcomers. Small, often-used, expensive-to-reload
  models stay; big, rarely-used, cheap ones go. This is the default.
- ``LruPolicy``: least recently used, for comparison.

Both are deterministic: ties break by admission order, never by wall time.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


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

    def __init__(self) -> None:
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


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"gdsf": GdsfPolicy, "lru": LruPolicy}
"""Policies by name, for settings and command lines: ``POLICIES[name]()``."""
