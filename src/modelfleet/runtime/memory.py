"""A runtime's memory is its budget: the allocator set up to give evicted models back, RSS
measured against the budget, and loads refused while it is over.

Why the allocator needs setting up (measured with ``bench/rss_budget.py``: an LRU of real
numpy MLPs of 1-36 MB in a real runtime process, 88 MB budget; the table is in the
README, "Memory: the budget is the RSS"). glibc serves a request above its mmap threshold
(128 KiB at start) with its own mapping, which ``free`` returns to the system at once;
but the first time such a mapping is freed, glibc *raises* the threshold to its size (up
to 32 MiB). After a few evictions every model-sized array comes from the heap arenas
instead, where a freed array leaves a hole the next, differently sized array does not
fit: RSS ends at about three times start-up + budget, and stays there with every model
unloaded. The options, measured:

- ``MALLOC_MMAP_THRESHOLD_=131072`` (fixed at 128 KiB): RSS follows the budget, but
  ``np.load`` reads in 256 KiB chunks, so every chunk of every load is an ``mmap``, a
  ``munmap`` and fresh page faults: 35-70 % more CPU per GB loaded.
- ``malloc_trim(0)`` after each eviction alone, or ``MALLOC_ARENA_MAX=1``: the arenas
  still fragment; RSS stays 55-90 MB above start-up + budget.
- **A fixed mmap threshold of 1 MiB** (``mallopt(M_MMAP_THRESHOLD)``, which also stops
  the threshold rising) **plus ``malloc_trim(0)`` after evictions** (the default): arrays
  of model size are their own mappings and go back to the system when the model is
  evicted; read buffers and small objects keep reusing the heap, so a load costs the CPU
  it costs with glibc's defaults (within this machine's noise); the trim gives back what
  the small allocations left. 2 and 4 MiB measure alike for speed, with a higher peak.

``configure_allocator`` runs once at the runtime process's start-up (glibc only; a no-op
elsewhere, and in the coordinator's process, which ``InProcessRuntime`` shares).

``MemoryGuard`` holds the rule the runtime keeps: RSS <= overhead + budget + slack, the
slack being the larger of budget x margin and a floor (a runtime of the pooled budget
may hold a budget of 0 between loads, and its RSS still moves by a few MB),
where the overhead is the RSS measured at start-up, after imports and before any model,
plus what the first import of each framework a model needs added (``count_imports``),
and the budget is the cache's device plus host budgets (both are bytes in this process
for CPU models; a GPU model's device bytes are held to the device budget through the CUDA
allocator's reserved bytes instead, see ``device_memory``). Over that line, the runtime
trims and sheds models until it is back under (a load waits for that, and is refused,
``NoCapacity``: retryable, "not accepting cold work", only if it does not come back
under in time: ``runtime/shedding.py``), counts the episode and logs one warning for it
once it sheds a model or refuses a load.
The budget is read live from the cache, so ``ModelHost.set_budgets`` moves the line.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from modelfleet.errors import NoCapacity
from modelfleet.libc import LIBC as _LIBC
from modelfleet.libc import trim
from modelfleet.runtime.device import DeviceMemory, device_memory

log = logging.getLogger("modelfleet.runtime")

# The least time between two full collections of a runtime process's reference cycles.
GC_MIN_INTERVAL_S = 1.0


class CycleCollector:
    """Full collections (``gc.collect()``), at most one every ``min_interval_s``.

    Reference counting frees a model's arrays the moment its handler goes; only a handler
    caught in a reference cycle waits for the collector. A full collection stops the
    runtime's event loop for tens of milliseconds: run on every eviction it took 64 % of
    the loop's time at 20 evictions a second, and run on every check of a runtime over
    its memory line (a few a second at 5,000 small models, each shedding episode asking
    several times) 19 % of the whole fleet's CPU samples (both measured). So a cycle's
    memory may outlive its eviction by up to ``min_interval_s``. One per runtime host,
    shared by its evictions and its memory guard.
    """

    def __init__(self, min_interval_s: float = GC_MIN_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._collected_at = -1e9

    def __call__(self) -> bool:
        """Collect if the last collection is ``min_interval_s`` old; True if it ran."""
        now = self._clock()
        if now - self._collected_at < self._min_interval_s:
            return False
        self._collected_at = now
        gc.collect()
        return True


# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3




def configure_allocator(mmap_threshold_bytes: int) -> str:
    """Fix glibc's mmap and trim thresholds for this process; say what was done.

    ``mmap_threshold_bytes`` 0 leaves glibc's dynamic default alone. The trim threshold
    is fixed at twice the mmap threshold, so the heap's top is given back as it frees.
    """
    if mmap_threshold_bytes <= 0:
        return "glibc defaults (dynamic mmap threshold)"
    if _LIBC is None:
        return "not glibc: allocator left as it is"
    ok = (_LIBC.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(mmap_threshold_bytes)) == 1
          and _LIBC.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(2 * mmap_threshold_bytes)) == 1)
    if not ok:
        return "mallopt refused the thresholds: allocator left as it is"
    return f"mmap threshold fixed at {mmap_threshold_bytes} bytes"




_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """This process's resident set size, now.

    Read from ``/proc/self/statm`` (opened afresh each time: a runtime forked from the
    zygote must read its own), ~10 µs; ``psutil.Process()`` first reads the process's
    start time from ``/proc``, and the guard asks several times per load: profiled at
    5,000 models, that was a tenth of a runtime's CPU. Elsewhere, psutil."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return int(psutil.Process().memory_info().rss)


@dataclass(frozen=True)
class MemoryState:
    rss_bytes: int
    startup_bytes: int  # RSS at start-up, after imports and before any model
    overhead_bytes: int  # start-up + what importing the models' frameworks added
    budget_bytes: int  # the cache's device + host budgets
    limit_bytes: int  # overhead + budget + max(budget x margin, floor)
    over: bool  # in an over-budget episode: loads are refused
    device: DeviceMemory


class MemoryGuard:
    """RSS against the budget; refuses loads while over it (see the module's docstring).

    ``budget`` is read at every check (the cache's live budgets); ``rss`` and
    ``device`` are injectable for tests of the rule itself.
    """

    def __init__(self, budget: Callable[[], int], margin: float, device_budget: Callable[[], int],
                 rss: Callable[[], int] = rss_bytes,
                 device: Callable[[], DeviceMemory] = device_memory,
                 margin_floor_bytes: int = 0,
                 collect: Callable[[], object] | None = None) -> None:
        self._budget = budget
        self._collect = collect if collect is not None else CycleCollector()
        self._floor = margin_floor_bytes
        self._device_budget = device_budget
        self._margin = margin
        self._rss = rss
        self._device = device
        self.startup_bytes = rss()
        self.overhead_bytes = self.startup_bytes  # + what the models' frameworks added
        self._device_overhead = device().reserved_bytes
        self.over = False
        self.episodes = 0  # over-budget episodes since start
        self._warned = 0  # the last episode whose warning was logged
        self.refused = 0  # loads refused since start

    def rss(self) -> int:
        return self._rss()

    def count_imports(self, rss_before: int, model_bytes: int) -> None:
        """A load imported modules not seen before (a framework, or a library a load uses
        lazily): what RSS grew by during that load beyond the model's own bytes is
        overhead from now on. An import is paid once per process, not per model; measured
        on the peers' MLPs, the first load's imports (zipfile, the rest of numpy's I/O)
        add 10-16 MB that no eviction gives back. (A load that finished beside it in the
        same window would be counted too: only loads that import something new count.)"""
        self.overhead_bytes += max(0, self._rss() - rss_before - model_bytes)

    def limit_bytes(self) -> int:
        budget = self._budget()
        return self.overhead_bytes + budget + max(int(budget * self._margin), self._floor)

    def _device_limit_bytes(self) -> int:
        return self._device_overhead + int(self._device_budget() * (1 + self._margin))

    def state(self) -> MemoryState:
        return MemoryState(self._rss(), self.startup_bytes, self.overhead_bytes, self._budget(),
                           self.limit_bytes(),
                           self.over, self._device())

    def exceeded(self) -> str | None:
        """What is over its line now (RSS, or CUDA reserved bytes), or None."""
        rss = self._rss()
        if rss > self.limit_bytes():
            return (f"RSS {rss} bytes > {self.limit_bytes()} (overhead {self.overhead_bytes} "
                    f"+ budget {self._budget()} + the larger of x {self._margin:g} and "
                    f"{self._floor} bytes)")
        reserved = self._device().reserved_bytes
        if reserved and reserved > self._device_limit_bytes():
            return (f"CUDA reserved {reserved} bytes > {self._device_limit_bytes()} "
                    f"(device budget {self._device_budget()} x {1 + self._margin:g})")
        return None

    def reclaim(self) -> str | None:
        """Collect cycles (if none was collected within ``GC_MIN_INTERVAL_S``) and trim
        the heap; what is still over afterwards, or None."""
        over = self.exceeded()
        if over is None:
            return None
        self._collect()
        trim()
        return self.exceeded()

    def check(self) -> str | None:
        """Over the line even after a trim? Then say what is over (and open an episode);
        back under ends the episode."""
        over = self.reclaim()
        if over is None:
            self.back_under()
            return None
        if not self.over:
            self.over = True
            self.episodes += 1
            log.debug("runtime over its memory budget: %s", over)
        return over

    def warn(self, over: str) -> None:
        """The episode's one warning, once it costs something: a model shed or a load
        refused. Most episodes cost nothing: at 5,000 small models a runtime's RSS sits
        at its line, goes a few hundred KB over about three times a second and is back
        under at the next trim (measured), which is not worth a warning each."""
        if self._warned != self.episodes:
            self._warned = self.episodes
            log.warning("runtime over its memory budget: %s; refusing loads and shedding "
                        "models until it is back under", over)

    def admit(self, model_id: str) -> None:
        """Raise ``NoCapacity`` if a load must not start now; the caller then sheds models."""
        over = self.check()
        if over is None:
            return
        self.refused += 1
        self.warn(over)
        raise NoCapacity(f"this runtime is over its memory budget ({over}); it takes no "
                         f"new model loads (asked for '{model_id}') until evictions bring it "
                         "back under: retry shortly or on another runtime")

    def back_under(self) -> None:
        if self.over:
            self.over = False
            log.log(logging.INFO if self._warned == self.episodes else logging.DEBUG,
                    "runtime back under its memory budget (RSS %d bytes, limit %d)",
                    self._rss(), self.limit_bytes())
