"""One machine's CPUs, shared by the threads that run on it.

The OS shares ``cores`` CPUs fairly among runnable *threads*; a thread runs on one
CPU at most. What matters is what a thread is: an event loop (the gateway and
coordinator of ``modelfleet serve``, each runtime process's loop, the load
generator) is one thread however many requests it juggles, so its work queues
behind itself; a model load or a batch's predict runs on a thread of its own
(``asyncio.to_thread``). So jobs belong to a *thread* (``Machine.run(..., thread=)``;
none: a thread of its own): the active threads share the cores, each at most one,
``min(1, cores / threads)``; the jobs of one thread share that thread's share.

With every job its own thread this is plain processor sharing. Counting an event
loop's requests as one thread is what keeps a load from being starved by fifteen
requests that are in fact waiting behind one loop (measured on bench/peers: the
per-process CPU of a warm run, ``bench/sim_vs_measured.py --probe``).

Implemented with a virtual clock per thread: every job of a thread has received the
same service since it started plus what it had at its start, so a job's finish is
fixed in that thread's virtual time and one heap per thread orders them; a change
in the number of threads or of a thread's jobs only changes how fast the clocks
advance. One timer event (the engine's heap) is kept for the next finish and
rescheduled when a rate changes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

Schedule = Callable[[float, int], None]
"""``schedule(at, generation)``: call ``Machine.on_timer(generation)`` at ``at``."""

_EPS = 1e-9  # CPU-seconds: finishes closer than this are one instant


class _Thread:
    __slots__ = ("jobs", "virtual")

    def __init__(self) -> None:
        self.virtual = 0.0  # service per job of this thread so far
        self.jobs: list[tuple[float, int, Callable[[], None]]] = []


class Machine:
    def __init__(self, cores: float, clock: Callable[[], float], schedule: Schedule) -> None:
        if cores <= 0:
            raise ValueError("a machine needs cores > 0")
        self.cores = cores
        self._clock = clock
        self._schedule = schedule
        self._threads: dict[str | tuple[str, int], _Thread] = {}
        self._since = 0.0  # real time of the last advance
        self._seq = itertools.count()
        self._generation = 0
        self.busy_cpu_s = 0.0  # CPU-seconds delivered so far
        self.cpu_by: dict[str, float] = {}  # ... per thread name (own threads: by kind)

    def __len__(self) -> int:
        return sum(len(t.jobs) for t in self._threads.values())

    def _share(self) -> float:
        """CPU per active thread now."""
        return min(1.0, self.cores / len(self._threads)) if self._threads else 0.0

    def _advance(self) -> None:
        now = self._clock()
        elapsed = now - self._since
        if elapsed > 0 and self._threads:
            share = self._share()
            used = elapsed * share
            for key, thread in self._threads.items():
                thread.virtual += used / len(thread.jobs)
                name = key if isinstance(key, str) else str(key[0])
                self.cpu_by[name] = self.cpu_by.get(name, 0.0) + used
            self.busy_cpu_s += used * len(self._threads)
        self._since = now

    def run(self, work_s: float, done: Callable[[], None], thread: str | None = None,
            kind: str = "other") -> None:
        """Run a job of ``work_s`` CPU-seconds on ``thread`` (an event loop's name; None:
        a thread of its own, accounted under ``kind``); ``done()`` is called when it
        finishes."""
        self._advance()
        key: str | tuple[str, int] = thread if thread is not None else (kind, next(self._seq))
        state = self._threads.get(key)
        if state is None:
            state = self._threads[key] = _Thread()
        heapq.heappush(state.jobs, (state.virtual + max(work_s, 0.0), next(self._seq), done))
        self._reschedule()

    def _reschedule(self) -> None:
        self._generation += 1
        if not self._threads:
            return
        share = self._share()
        soonest = math.inf
        for thread in self._threads.values():
            left = max(thread.jobs[0][0] - thread.virtual, 0.0)
            soonest = min(soonest, left * len(thread.jobs) / share)
        self._schedule(self._clock() + soonest, self._generation)

    def on_timer(self, generation: int) -> None:
        if generation != self._generation:
            return  # a rate changed since: a later timer stands for this one
        self._advance()
        finished = []
        for key in list(self._threads):
            thread = self._threads[key]
            while thread.jobs and thread.jobs[0][0] <= thread.virtual + _EPS:
                finished.append(heapq.heappop(thread.jobs)[2])
            if not thread.jobs:
                del self._threads[key]
        self._reschedule()
        for done in finished:
            done()

    def cpu_used(self) -> float:
        """CPU-seconds delivered up to now."""
        self._advance()
        return self.busy_cpu_s

    def cpu_by_thread(self) -> dict[str, float]:
        """CPU-seconds delivered up to now, per thread name (own threads: per kind)."""
        self._advance()
        return dict(self.cpu_by)
