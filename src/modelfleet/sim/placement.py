"""Which of a worker's runtimes runs a model, as the simulator places it.

Two ways, one seam (``Placement``) that the engine and the pull router read:

- ``HashPlacement``: runtime ``crc32(model id) % runtimes_per_worker``, fixed for the
  run (``Catalog.runtime``). That is how ``RuntimeSupervisor.runtime_for`` placed models
  before ``worker/spread.py``; with one runtime per worker (the fleet scenario) it is
  also what spread placement comes to. The push routers' runtimes are placed this way.
- ``SpreadPlacement``: the worker's own ``worker.spread.Spread`` per simulated worker,
  fed what the worker's ``BudgetPool`` feeds it. A model's home is placed by the tasks
  running on each runtime and its free share of the pool (``Spread.place``), the first
  time it is asked for (a task, or a re-score's facts of a candidate queue); a task goes
  to the least-loaded holder (``Spread.route``), and a model whose tasks reach
  ``replica_at`` per holder gets another runtime (``Spread.review``). Every
  ``rescore_s`` the pool reads each runtime (``resync``): placements of models neither
  resident nor running are forgotten and cooled replicas dropped (their copy unloaded),
  as ``BudgetPool.resync`` does. Between reads placement sees each runtime as last read
  (residency, bytes held), with the tasks running on it now, as the worker does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from modelfleet.scheduling import QueueFacts
from modelfleet.sim.pool import runtime_view
from modelfleet.sim.scenario import Catalog
from modelfleet.sim.worker import SimRuntime, SimWorker, Task
from modelfleet.worker.spread import RuntimeView, Spread


class Placement(Protocol):
    """Where each of a worker's models and tasks runs."""

    def home(self, worker: SimWorker, model: int) -> int:
        """The index of the runtime that holds ``model`` first (placed now if none)."""
        ...

    def homes(self, worker: SimWorker) -> Sequence[int]:
        """``home`` as an indexable by model (what the coordinator's facts read)."""
        ...

    def take(self, worker: SimWorker, task: Task) -> SimRuntime:
        """The runtime ``task`` runs on, counted there until ``done``."""
        ...

    def runtime_of(self, worker: SimWorker, task: Task) -> SimRuntime:
        """The runtime ``take`` gave ``task``."""
        ...

    def done(self, worker: SimWorker, task: Task) -> None:
        """``task`` finished (or was dropped) where it was taken."""
        ...

    def moves(self, worker: SimWorker) -> int:
        """How many times the worker's placements changed: equal, the same homes."""
        ...


class HashPlacement:
    """``crc32(model id) % runtimes``: fixed for the run."""

    def __init__(self, catalog: Catalog) -> None:
        self._runtime = catalog.runtime

    def home(self, worker: SimWorker, model: int) -> int:
        return self._runtime[model]

    def homes(self, worker: SimWorker) -> Sequence[int]:
        return self._runtime

    def take(self, worker: SimWorker, task: Task) -> SimRuntime:
        return worker.runtimes[self._runtime[task[1]]]

    runtime_of = take  # nothing is counted: the same runtime for every task of a model

    def done(self, worker: SimWorker, task: Task) -> None:
        pass

    def moves(self, worker: SimWorker) -> int:
        return 0


class _Book:
    """One worker's ``Spread`` and its runtimes as its pool last read them."""

    def __init__(self, worker: SimWorker, spread: Spread, pool_bytes: int) -> None:
        self.worker = worker
        self.spread = spread
        self.pool_bytes = pool_bytes
        self.index = {runtime.name: runtime.index for runtime in worker.runtimes}
        self.read: dict[str, RuntimeView] = {}  # runtime -> as last read (none yet: zeros)
        self.moves = 0

    def refresh(self) -> None:
        """Read every runtime (``BudgetPool._read_all``)."""
        for runtime in self.worker.runtimes:
            self.read[runtime.name] = runtime_view(runtime)

    def views(self) -> list[RuntimeView]:
        """The runtimes as last read, with the tasks running on each now."""
        running = self.spread.running_on
        views = []
        for runtime in self.worker.runtimes:
            read = self.read.get(runtime.name)
            views.append(RuntimeView(runtime.name, running=running(runtime.name))
                         if read is None else replace(read, running=running(runtime.name)))
        return views

    def home(self, model_id: str) -> str:
        held = self.spread.holders(model_id)
        if held:
            return held[0]
        self.moves += 1
        return self.spread.home(model_id, self.views(), self.pool_bytes)


class _Homes(Sequence[int]):
    """A worker's homes by model index, placing a model the first time it is read."""

    def __init__(self, book: _Book, names: Sequence[str]) -> None:
        self._book = book
        self._names = names

    def __getitem__(self, model: int) -> int:  # type: ignore[override]
        book = self._book
        return book.index[book.home(self._names[model])]

    def __len__(self) -> int:
        return len(self._names)


class PlacedFacts(Mapping[str, QueueFacts]):
    """A worker's queue facts by model id, each with the runtime its home is now
    (``QueueFacts.runtime``, which the coordinator asks ``runtime_for``)."""

    def __init__(self, facts: Sequence[QueueFacts], index_of: Mapping[str, int],
                 homes: Sequence[int], runtimes: int) -> None:
        # Per model, its facts on each runtime: made once, so equal homes give the same
        # objects (the decision's views compare facts by identity first).
        self._variants = [tuple(replace(f, runtime=f"runtime-{r}") for r in range(runtimes))
                          for f in facts]
        self._index_of = index_of
        self._homes = homes

    def __getitem__(self, model_id: str) -> QueueFacts:
        model = self._index_of[model_id]
        return self._variants[model][self._homes[model]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._index_of)

    def __len__(self) -> int:
        return len(self._index_of)


class SpreadPlacement:
    """``worker.spread.Spread`` per worker, read as its ``BudgetPool`` reads it."""

    def __init__(self, catalog: Catalog, workers: Sequence[SimWorker], replica_at: int,
                 keep_s: float, pool_bytes: int, clock: Callable[[], float]) -> None:
        self._names = catalog.names
        self._clock = clock
        sizes = dict(zip(catalog.names, catalog.size_bytes, strict=True))
        self._books = [_Book(worker, Spread(replica_at, keep_s, sizes.__getitem__),
                             pool_bytes) for worker in workers]
        self._homes = [_Homes(book, catalog.names) for book in self._books]
        self._taken: dict[int, SimRuntime] = {}  # request index -> the runtime it runs on

    def home(self, worker: SimWorker, model: int) -> int:
        return self._homes[worker.index][model]

    def homes(self, worker: SimWorker) -> Sequence[int]:
        return self._homes[worker.index]

    def take(self, worker: SimWorker, task: Task) -> SimRuntime:
        """``RuntimeSupervisor.take``: the least-loaded holder; a model this makes hot
        gets one more runtime (the next task routed there loads the copy)."""
        book = self._books[worker.index]
        spread, name = book.spread, self._names[task[1]]
        if not spread.holders(name):
            book.moves += 1
        views = book.views()
        chosen = spread.route(name, views, book.pool_bytes)
        spread.started(name, chosen)
        if spread.review(name, views, book.pool_bytes, self._clock()) is not None:
            book.moves += 1
        runtime = self._taken[task[0]] = worker.runtimes[book.index[chosen]]
        return runtime

    def runtime_of(self, worker: SimWorker, task: Task) -> SimRuntime:
        return self._taken[task[0]]

    def done(self, worker: SimWorker, task: Task) -> None:
        runtime = self._taken.pop(task[0], None)
        if runtime is not None:
            self._books[worker.index].spread.finished(self._names[task[1]], runtime.name)

    def moves(self, worker: SimWorker) -> int:
        return self._books[worker.index].moves

    def holders(self, worker: SimWorker, model: int) -> tuple[str, ...]:
        """The runtimes holding ``model`` in the worker's book, home first (none: not
        placed now)."""
        return self._books[worker.index].spread.holders(self._names[model])

    def read(self, worker: SimWorker) -> None:
        """The pool read every runtime (it moved budgets for a miss)."""
        self._books[worker.index].refresh()

    def resync(self, worker: SimWorker, now: float,
               unload: Callable[[SimRuntime, str], None]) -> None:
        """``BudgetPool.resync`` after its budget moves: read every runtime, drop cooled
        replicas (``unload(runtime, model id)`` unloads that copy) and forget the
        placement of models neither resident nor running."""
        book = self._books[worker.index]
        book.refresh()
        for change in book.spread.sweep(book.views(), book.pool_bytes, now):
            if change.action == "drop":
                runtime = worker.runtimes[book.index[change.runtime]]
                unload(runtime, change.model_id)
                read = book.read[runtime.name]
                book.read[runtime.name] = replace(read, resident=read.resident - {change.model_id})
        book.moves += 1  # forgotten placements: those models are placed afresh
