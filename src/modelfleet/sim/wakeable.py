"""The simulated workers an announcement can wake, kept in the order of how far each has
folded what it heard (``Coordinator.heard_upto``).

An announcement of a model heard before wakes only a worker that has folded since that
model's previous announcement (``PullAnnouncements._heard``): under load few of hundreds
of wakeable workers have, and walking all of them for each announcement was half of a
100,000-model run. Kept by ``(heard_upto, index)``, those are a tail found by bisection.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterator
from sys import maxsize


class WakeableWorkers:
    """A set of worker indices, each with its ``heard_upto``, ordered by it."""

    __slots__ = ("_sorted", "_upto")

    def __init__(self) -> None:
        self._upto: dict[int, int] = {}  # worker index -> its heard_upto, as kept here
        self._sorted: list[tuple[int, int]] = []  # (heard_upto, index), ascending

    def __contains__(self, index: object) -> bool:
        return index in self._upto

    def __len__(self) -> int:
        return len(self._upto)

    def __iter__(self) -> Iterator[int]:
        return iter(self._upto)

    def add(self, index: int, heard_upto: int) -> None:
        if index not in self._upto:
            self._upto[index] = heard_upto
            insort(self._sorted, (heard_upto, index))

    def discard(self, index: int) -> None:
        upto = self._upto.pop(index, None)
        if upto is not None:
            del self._sorted[bisect_left(self._sorted, (upto, index))]

    def folded(self, index: int, heard_upto: int) -> None:
        """Worker ``index`` folded up to ``heard_upto`` (kept in place if not wakeable)."""
        if index in self._upto:
            self.discard(index)
            self.add(index, heard_upto)

    def heard_after(self, before: int) -> list[int]:
        """The wakeable workers whose ``heard_upto`` is past ``before``, in index order."""
        tail = self._sorted[bisect_right(self._sorted, (before, maxsize)):]
        return sorted(index for _, index in tail)
