"""A frequency sketch that outlives residency: count-min with periodic aging (TinyLFU).

``FrequencySketch`` estimates how often each key was used recently in a fixed amount
of memory, whether or not the key is resident now: an evicted model keeps its count,
so when it comes back it is ranked by its history, not as a newcomer. Every
``sample_size`` increments all counters are halved (Einziger, Friedman & Manes,
"TinyLFU", 2017), so the estimate follows a popularity that shifts.

Count-min: ``depth`` rows of ``width`` counters; a key increments one counter per row
(conservative update: only the rows at the current minimum) and its estimate is the
minimum over its rows, so it never under-counts and over-counts only on collisions.
Hashes are ``blake2b`` of the key, not Python's ``hash`` (salted per process): the
same trace gives the same estimates in every run.

Counters are not capped at 15 as in Caffeine's 4-bit sketch: the policies here rank
by ``frequency * cost / size``, and saturated head counts would lose the order among
hot models; aging alone bounds them (a counter never exceeds about ``2 * sample_size``).
"""

from __future__ import annotations

import hashlib


class FrequencySketch:
    """Estimated recent use counts of string keys, aged by halving.

    ``width`` counters per row (rounded up to a power of two), ``depth`` rows;
    ``sample_size`` increments between two halvings (TinyLFU's ``W``; Caffeine uses
    ten times the cache's entry capacity).
    """

    def __init__(self, sample_size: int, width: int = 4096, depth: int = 4) -> None:
        if sample_size < 1:
            raise ValueError(f"sample_size must be >= 1, got {sample_size}")
        if width < 1 or not 1 <= depth <= 8:
            raise ValueError(f"width must be >= 1 and depth in 1..8, got {width}, {depth}")
        self.sample_size = sample_size
        self._mask = (1 << (width - 1).bit_length()) - 1
        self._rows = [[0] * (self._mask + 1) for _ in range(depth)]
        self._additions = 0
        self.resets = 0
        """How many times the counters were halved."""

    def _slots(self, key: str) -> list[int]:
        digest = hashlib.blake2b(key.encode(), digest_size=8 * len(self._rows)).digest()
        return [int.from_bytes(digest[8 * i: 8 * i + 8], "little") & self._mask
                for i in range(len(self._rows))]

    def increment(self, key: str) -> None:
        """Count one use of ``key``; halves every counter each ``sample_size`` uses."""
        slots = self._slots(key)
        counts = [row[slot] for row, slot in zip(self._rows, slots, strict=True)]
        low = min(counts)
        for row, slot, count in zip(self._rows, slots, counts, strict=True):
            if count == low:  # conservative update: the minimum is what is estimated
                row[slot] = count + 1
        self._additions += 1
        if self._additions >= self.sample_size:
            self._age()

    def estimate(self, key: str) -> int:
        """Uses of ``key`` since the counters were last halved, plus half the period before
        (an upper bound: collisions only add)."""
        return min(row[slot] for row, slot in zip(self._rows, self._slots(key), strict=True))

    def resize_sample(self, sample_size: int) -> None:
        """Change ``W`` (e.g. when the cache learns how many entries it holds)."""
        self.sample_size = max(1, sample_size)
        if self._additions >= self.sample_size:
            self._age()

    def _age(self) -> None:
        for row in self._rows:
            row[:] = [count >> 1 for count in row]
        self._additions //= 2  # as in TinyLFU: the halved counts still weigh in the sample
        self.resets += 1
