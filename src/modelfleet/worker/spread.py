"""Which shared runtimes hold each model, and how one worker budget is split among them.

Pure decisions; ``worker/pool.py`` reads the runtimes and carries them out.

*Placement.* A model's first runtime (its home) is where it is already resident;
else the runtime with the least load (tasks in flight on it), then the most free
share of the pool (its share is the pool over the runtimes up, less what it holds).
A hash would keep a model in one place too, but it puts models without regard for
what a runtime already holds or runs: with the head of a Zipf trace split by a hash,
one runtime was saturated while the other had room (issue 20).

*Replicas.* A model whose tasks in flight reach ``replica_at`` per runtime holding
it is hot: one runtime cannot serve it alone. It gets one more runtime, if one is up
with fewer than ``replica_at`` tasks in flight and the pool has room for another copy
beside what is pinned, being loaded and busy serving. It loses that runtime again
once its tasks stayed at or below half of what its other runtimes take
(``replica_at`` x (holders - 1) / 2) for ``keep_s``: between the two lines nothing
changes, so a load that hovers near the line does not load and drop a copy in turn.

*Tasks* go to the least-loaded runtime that holds their model and is up (ties: one
where the model is resident).

*Budget.* ``split_budget`` gives each runtime what it holds (resident and being
loaded) and the pool's free bytes as one block to the runtime about to load: the
room a miss needs is kept once for the pool, not once per runtime. When the free
block is smaller than the miss, runtimes that hold more give bytes back (they evict
down to their new budget), down to what their pinned models and loads in flight hold.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class RuntimeView:
    """One shared runtime as placement sees it."""

    name: str
    up: bool = True
    running: int = 0  # tasks in flight on it, every model
    budget_bytes: int = 0
    used_bytes: int = 0  # resident on the device
    reserved_bytes: int = 0  # loads in flight
    pinned_bytes: int = 0
    resident: frozenset[str] = field(default_factory=frozenset)

    @property
    def held_bytes(self) -> int:
        return self.used_bytes + self.reserved_bytes

    @property
    def floor_bytes(self) -> int:
        """What cannot be taken back: pinned models and loads in flight."""
        return self.pinned_bytes + self.reserved_bytes


@dataclass(frozen=True)
class Change:
    """One placement change: a model gains (``add``) or loses (``drop``) a runtime."""

    action: Literal["add", "drop"]
    model_id: str
    runtime: str


class Spread:
    """The book of which runtimes hold which model, and the counts that move it."""

    def __init__(self, replica_at: int, keep_s: float, size_of: Callable[[str], int]) -> None:
        if replica_at < 1:
            raise ValueError(f"replica_at must be >= 1, got {replica_at}")
        self.replica_at = replica_at
        self.keep_s = keep_s
        self._size_of = size_of  # a model's bytes (its estimate until measured)
        self._holders: dict[str, list[str]] = {}  # model id -> runtimes, home first
        # runtime -> the models placed on it: the inverse of _holders, kept by _hold, so
        # that what is placed and not yet resident is a set difference, not a walk of
        # every placement (a miss is placed on every cold request).
        self._placed_on: dict[str, set[str]] = {}
        self._running: Counter[tuple[str, str]] = Counter()  # (model, runtime) -> tasks
        self._on_runtime: Counter[str] = Counter()  # runtime -> tasks, every model
        self._quiet_since: dict[str, float] = {}  # model -> since when under the drop line

    # -- the book --------------------------------------------------------------------
    def holders(self, model_id: str) -> tuple[str, ...]:
        return tuple(self._holders.get(model_id, ()))

    def replicated(self) -> dict[str, tuple[str, ...]]:
        """Models held by more than one runtime, and those runtimes."""
        return {m: tuple(rs) for m, rs in self._holders.items() if len(rs) > 1}

    def running(self, model_id: str) -> int:
        return sum(n for (m, _), n in self._running.items() if m == model_id)

    def running_at(self, model_id: str, runtime: str) -> int:
        return self._running[model_id, runtime]

    def running_on(self, runtime: str) -> int:
        return self._on_runtime[runtime]

    def started(self, model_id: str, runtime: str) -> None:
        self._running[model_id, runtime] += 1
        self._on_runtime[runtime] += 1

    def finished(self, model_id: str, runtime: str) -> None:
        key = (model_id, runtime)
        self._running[key] -= 1
        if self._running[key] <= 0:
            del self._running[key]
        self._on_runtime[runtime] -= 1
        if self._on_runtime[runtime] <= 0:
            del self._on_runtime[runtime]

    # -- decisions -------------------------------------------------------------------
    def home(self, model_id: str, views: Sequence[RuntimeView], pool_bytes: int) -> str:
        """The model's first runtime, placed now if it has none."""
        held = self._holders.get(model_id)
        if held:
            return held[0]
        chosen = self.place(model_id, views, pool_bytes)
        self._hold(model_id, [chosen])
        return chosen

    def rehome(self, model_id: str, refused: str, views: Sequence[RuntimeView],
               pool_bytes: int) -> str | None:
        """The runtime ``refused`` turned the model's load away for memory (its RSS guard:
        it takes no load until it has shed back under its line, which can take seconds).
        Another runtime that is up runs it instead, and replaces ``refused`` among its
        holders: a holder already up if it has one, else the best place among the
        others. None if no other runtime is up."""
        holders = self._holders.get(model_id, [])
        by_name = {v.name: v for v in views}
        up = [name for name in holders
              if name != refused and name in by_name and by_name[name].up]
        if up:
            chosen = min(up, key=lambda name: (self._on_runtime[name], holders.index(name)))
        else:
            others = [v for v in views if v.up and v.name != refused]
            if not others:
                return None
            chosen = self.place(model_id, others, pool_bytes)
        self._hold(model_id, [chosen, *(h for h in holders if h not in (chosen, refused))])
        return chosen

    def place(self, model_id: str, views: Sequence[RuntimeView], pool_bytes: int,
              exclude: frozenset[str] = frozenset()) -> str:
        """Where a model goes: resident first, else least load, then most free share."""
        candidates = [v for v in views if v.name not in exclude]
        if not candidates:
            raise ValueError(f"no runtime to place {model_id!r} on")
        live = [v for v in candidates if v.up] or candidates
        resident = [v for v in live if model_id in v.resident]
        share = pool_bytes // max(1, len([v for v in views if v.up]))
        pick = min(resident or live, key=lambda v: (
            self._on_runtime[v.name], -(share - v.held_bytes - self._pending_bytes(v)), v.name))
        return pick.name

    def _pending_bytes(self, view: RuntimeView) -> int:
        """Bytes of models placed on a runtime and not resident there (yet)."""
        placed = self._placed_on.get(view.name, set())
        return sum(self._size_of(m) for m in placed - view.resident)

    def _hold(self, model_id: str, holders: list[str]) -> None:
        """Set the runtimes holding ``model_id``, home first (none: forget it)."""
        for name in self._holders.get(model_id, ()):
            self._placed_on[name].discard(model_id)
        if holders:
            self._holders[model_id] = holders
            for name in holders:
                self._placed_on.setdefault(name, set()).add(model_id)
        else:
            self._holders.pop(model_id, None)

    def route(self, model_id: str, views: Sequence[RuntimeView], pool_bytes: int) -> str:
        """The runtime a task for the model runs on: the least-loaded holder that is up."""
        self.home(model_id, views, pool_bytes)
        by_name = {v.name: v for v in views}
        holders = self._holders[model_id]
        up = [name for name in holders if by_name.get(name, RuntimeView(name, up=False)).up]
        if not up:
            return holders[0]  # it waits for its home to come back, as before
        return min(up, key=lambda name: (self._on_runtime[name],
                                         model_id not in by_name[name].resident,
                                         holders.index(name)))

    def review(self, model_id: str, views: Sequence[RuntimeView], pool_bytes: int,
               now: float) -> Change | None:
        """A replica to add (hot) or to drop (quiet for ``keep_s``), or nothing.

        Tasks waiting for a model's first load are not demand one runtime fails to
        serve: a replica is added only once the model is resident on every runtime
        holding it (a second copy mid-load would only double the load's cost).
        """
        holders = self._holders.get(model_id)
        if not holders:
            return None
        demand = self.running(model_id)
        if demand >= self.replica_at * len(holders):
            self._quiet_since.pop(model_id, None)
            by_name = {v.name: v for v in views}
            if not all(name in by_name and model_id in by_name[name].resident
                       for name in holders):
                return None
            spare = [v for v in views if v.up and v.name not in holders
                     and self._on_runtime[v.name] < self.replica_at]
            if not spare or not self.room_for(self._size_of(model_id), views, pool_bytes):
                return None
            chosen = self.place(model_id, spare, pool_bytes)
            self._hold(model_id, [*holders, chosen])
            return Change("add", model_id, chosen)
        if len(holders) > 1 and demand * 2 <= self.replica_at * (len(holders) - 1):
            since = self._quiet_since.setdefault(model_id, now)
            if now - since < self.keep_s:
                return None
            self._quiet_since.pop(model_id, None)
            self._hold(model_id, holders[:-1])
            return Change("drop", model_id, holders[-1])
        self._quiet_since.pop(model_id, None)
        return None

    def room_for(self, size_bytes: int, views: Sequence[RuntimeView], pool_bytes: int) -> bool:
        """Would one more copy fit the pool beside what is pinned, loading and serving?"""
        fixed = sum(v.floor_bytes for v in views if v.up)
        busy = sum(self._size_of(model) for (model, _), n in self._running.items() if n > 0)
        return size_bytes + fixed + busy <= pool_bytes

    def sweep(self, views: Sequence[RuntimeView], pool_bytes: int,
              now: float) -> list[Change]:
        """Review every replicated model, and forget the placement of models that are
        neither resident on any runtime nor running (they are placed afresh next time)."""
        changes = [change for model_id in list(self._holders)
                   if (change := self.review(model_id, views, pool_bytes, now))]
        resident = frozenset().union(*(v.resident for v in views))
        busy = {model for model, _ in self._running}
        for model_id in list(self._holders):
            if model_id not in resident and model_id not in busy:
                self._hold(model_id, [])
                self._quiet_since.pop(model_id, None)
        return changes


def split_budget(pool_bytes: int, views: Sequence[RuntimeView], grow: str | None = None,
                 need_bytes: int = 0) -> dict[str, int]:
    """Device budgets for the runtimes in ``views`` (those up) that sum to ``pool_bytes``.

    Each keeps what it holds; the free rest goes as one block to ``grow`` (the runtime
    about to load ``need_bytes``), or else stays with the runtime that has it now. When
    the free block is short of ``need_bytes``, the other runtimes give bytes back, the
    ones holding most above their floor first. No budget goes below its floor (pinned
    models and loads in flight), so the sum exceeds the pool only when the floors do.
    """
    if not views:
        return {}
    budgets = {v.name: v.held_bytes for v in views}
    floors = {v.name: v.floor_bytes for v in views}

    def give_back(amount: int, spare: str | None) -> None:
        for name in sorted(budgets, key=lambda n: (floors[n] - budgets[n], n)):
            if amount <= 0:
                return
            if name == spare:
                continue
            taken = min(amount, budgets[name] - floors[name])
            if taken > 0:
                budgets[name] -= taken
                amount -= taken

    give_back(sum(budgets.values()) - pool_bytes, None)  # held more than the pool: shrink
    if grow in budgets and need_bytes > pool_bytes - sum(budgets.values()):
        give_back(need_bytes - (pool_bytes - sum(budgets.values())), grow)
    free = max(0, pool_bytes - sum(budgets.values()))
    recipient = grow if grow in budgets else max(
        views, key=lambda v: (v.budget_bytes - v.held_bytes, v.name)).name
    budgets[recipient] += free
    return budgets


def size_table(sizes: Mapping[str, int]) -> Callable[[str], int]:
    """A ``size_of`` for a fixed table (tests, the simulator); 0 for unknown models."""
    return lambda model_id: sizes.get(model_id, 0)
