"""The gateway's side of the model control API: orders out, results in, the route.

``ControlPlane`` keeps this gateway's copy of the operators' orders (``ControlState``)
and what each worker announced it holds, both learned from the broker's events. The
request path asks it two things: may this model be served (``check``), and which
version do unversioned requests get (``route``). The control routes ask it to carry
out a command: publish it as an event, then collect the named workers' results.

Both request-path questions cost O(1) in the catalog and the fleet: the route reads
only the announcements of workers that mention the model (an index, model -> workers,
kept as announcements arrive, in the gateway's one ``WorkerRegistry``, which says which
workers are live for the fleet view and this plane alike), and the repository index is
read a page at a time.

With an ``OrderBook`` (the deployment's database, ``control.orders``) every order it
gives is kept there too; ``restore`` reads them back at start-up and tells the fleet,
and any worker whose announcement lacks one of this gateway's orders (it restarted,
or missed it) is told them again (``{"kind": "control_orders"}``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from modelfleet import metrics
from modelfleet.broker import Broker
from modelfleet.control import (
    CONTROL_ORDERS,
    Command,
    ControlState,
    Holdings,
    Result,
    RevisionClock,
    holdings_of,
    orders_announcement,
    route,
)
from modelfleet.control.commands import Action
from modelfleet.control.configs import follow_configs
from modelfleet.control.orders import OrderBook, OrderStoreError
from modelfleet.errors import (
    BrokerUnavailable,
    DeadlineExceeded,
    ModelfleetError,
    ModelUnavailable,
    NoCapacity,
    error_from_code,
)
from modelfleet.gateway.fleet import WorkerRegistry
from modelfleet.repository import Catalog, CatalogEntry
from modelfleet.repository.manifest import Manifest
from modelfleet.repository.overrides import ConfigOverride
from modelfleet.settings import Settings


@dataclass(frozen=True)
class Outcome:
    """What a command achieved: the version it concerned and the workers that did it."""

    model_id: str
    version: str
    workers: tuple[str, ...]


class _Collect:
    """The results of one command, until every expected worker answered."""

    def __init__(self, expected: frozenset[str]) -> None:
        self.expected = expected
        self.results: dict[str, Result] = {}
        self.done = asyncio.Event()
        if not expected:
            self.done.set()

    def add(self, result: Result) -> None:
        if result.worker_id in self.expected:
            self.results[result.worker_id] = result
            if set(self.results) >= self.expected:
                self.done.set()


class ControlPlane:
    def __init__(self, settings: Settings, broker: Broker, catalog: Catalog,
                 clock: Callable[[], float] = time.time, orders: OrderBook | None = None,
                 registry: WorkerRegistry | None = None) -> None:
        """``registry``: the gateway's one registry of workers, shared with its
        ``FleetView`` (one of its own, by ``control.stale_after_s`` and ``clock``, when
        none is given)."""
        self._settings = settings.control
        self._orders = orders
        self._told_at = float("-inf")  # when the orders were last told to the fleet
        self._telling: asyncio.Task[None] | None = None
        self._broker = broker
        self._catalog = catalog
        self._clock = clock
        self.state = ControlState()
        follow_configs(self.state, catalog)
        self._revisions = RevisionClock(f"gateway-{uuid.uuid4().hex[:12]}", clock)
        self._workers = registry if registry is not None else \
            WorkerRegistry(settings.control.stale_after_s, clock)
        self._holdings: dict[str, tuple[Holdings, bool]] = {}  # worker -> (holdings, ready)
        self._mentions = self._workers.index()  # model -> workers whose holdings name it
        self._workers.on_forget(self._forget)
        self._pending: dict[str, _Collect] = {}
        self._routed: dict[str, tuple[str, float]] = {}  # model -> (version, when) last routed
        self._started = time.monotonic()  # workers announce themselves only every few s

    # -- what the fleet said ------------------------------------------------------
    def observe(self, event: dict[str, Any]) -> None:
        """Take one broker event (every kind comes here; others are ignored)."""
        kind = event.get("kind")
        if kind == "control":
            command = Command.from_event(event)
            if command is not None:
                command.apply(self.state)
        elif kind == CONTROL_ORDERS:
            self.state.merge(event.get("control"))
        elif kind == "control_result":
            result = Result.from_event(event)
            if result is not None and result.command_id in self._pending:
                self._pending[result.command_id].add(result)
        elif kind == "worker_gone":
            self._workers.forget(str(event.get("worker_id", "")))
        else:
            holdings = holdings_of(event)
            if holdings is not None:
                self.state.merge(event.get("control"))
                self._workers.heard(holdings.worker_id)
                self._holdings[holdings.worker_id] = (holdings, bool(event.get("ready", True)))
                self._mentions.put(holdings.worker_id, _named(holdings))  # O(models named)
                if self.state.newer_than(event.get("control")):
                    self._tell_soon()

    def _forget(self, worker_id: str) -> None:
        """The registry forgot ``worker_id`` (gone, or silent): its holdings go too."""
        self._holdings.pop(worker_id, None)

    # -- the orders kept ----------------------------------------------------------
    async def restore(self) -> int:
        """Take the orders kept in the database and tell them to the fleet; returns
        how many models have orders. Errors of the database are raised."""
        if self._orders is None:
            return 0
        changed = self.state.merge(await asyncio.to_thread(self._orders.wire))
        await self._tell()
        return len(changed)

    def _tell_soon(self) -> None:
        """Tell the orders again, at most once per ``control.announce_interval_s``."""
        if self._telling is not None and not self._telling.done():
            return
        if self._clock() - self._told_at < self._settings.announce_interval_s:
            return
        self._telling = asyncio.get_running_loop().create_task(self._tell(),
                                                               name="control-orders")

    async def _tell(self) -> None:
        self._told_at = self._clock()
        try:
            await self._broker.publish_event(orders_announcement(self._revisions.origin,
                                                                 self.state))
        except BrokerUnavailable:
            self._told_at = float("-inf")  # the next announcement lacking them asks again

    def holdings(self) -> list[Holdings]:
        """Live workers' latest announcements (silent ones age out)."""
        self._workers.prune()
        return [h for h, _ in self._holdings.values()]

    def holdings_of(self, model_id: str) -> list[Holdings]:
        """The live announcements that name ``model_id`` (resident, failed or pinned),
        by worker id: what every per-model question needs, in O(those workers)."""
        return [self._holdings[worker_id][0] for worker_id in self._mentions.live(model_id)]

    async def _ready_workers_at_least(self, wanted: int) -> list[str]:
        """The ready workers; while there are fewer than ``wanted`` and this gateway is
        younger than ``stale_after_s`` (it may not have heard every live worker's state
        yet, and answering 503 then would refuse a fleet that is there), wait for them."""
        ready = self._ready_workers()
        while len(ready) < wanted and \
                time.monotonic() - self._started < self._settings.stale_after_s:
            await asyncio.sleep(0.1)
            ready = self._ready_workers()
        return ready

    def _ready_workers(self) -> list[str]:
        self.holdings()
        return sorted(w for w, (_, ready) in self._holdings.items() if ready)

    # -- the request path ---------------------------------------------------------
    def available(self, model_id: str) -> bool:
        return self.state.loaded(model_id)

    def check(self, model_id: str) -> None:
        """Raise ``ModelUnavailable`` for a model an operator unloaded."""
        if not self.state.loaded(model_id):
            raise ModelUnavailable(
                f"model '{model_id}' was unloaded (POST /v2/repository/models/{model_id}"
                "/unload); it serves again after POST .../load")

    def route(self, model_id: str, version: str | None = None) -> str | None:
        """The version a request gets: the one it named, else the model's route."""
        if version is not None or model_id not in self._catalog:
            return version
        return self.route_of(self._catalog.get(model_id)).version

    def route_of(self, entry: CatalogEntry, version: str | None = None) -> Manifest:
        """The manifest a request for ``entry`` gets: the version it named
        (``ModelNotFound`` if not served), else the model's route. It asks the catalog
        nothing more: the request path looks the model up once and passes the entry.
        An unversioned route is remembered (stickiness): call it once per request."""
        if version is not None:
            return entry.version(version)
        model_id = entry.model_id
        versions = [m.version for m in entry.versions]
        now = self._clock()
        last = self._routed.get(model_id)
        sticky = last[0] if last is not None and now - last[1] < \
            self._settings.stale_after_s else None
        # Workers that do not name the model change nothing in the rule: leave them out.
        chosen = route(model_id, versions, self.state.version(model_id),
                       self.holdings_of(model_id), sticky)
        self._routed[model_id] = (chosen, now)
        return entry.version(chosen)

    def warm_on(self, model_id: str, version: str) -> list[str]:
        return sorted(h.worker_id for h in self.holdings_of(model_id)
                      if version in h.resident.get(model_id, frozenset()))

    def index(self, ready_only: bool = False, after: str | None = None,
              limit: int | None = None) -> tuple[list[dict[str, Any]], str | None]:
        """One page of the repository index (OIP model repository extension): up to
        ``limit`` models (all without one) whose ids sort after ``after``, and the id
        the next page starts after (None: that was the last)."""
        keep = (lambda entry: self.state.loaded(entry.model_id)) if ready_only else None
        entries, last = self._catalog.page(after, limit or len(self._catalog) or 1, keep)
        rows = []
        for entry in entries:
            model_id = entry.model_id
            loaded = self.state.loaded(model_id)
            version = self.route(model_id) or entry.manifest.version
            rows.append({"name": model_id, "version": version,
                         "state": "READY" if loaded else "UNAVAILABLE",
                         "reason": "" if loaded else "unloaded by an operator",
                         "pinned": self.state.pinned(model_id, entry.manifest.fanout.pinned),
                         "warm_on": self.warm_on(model_id, version),
                         # worker -> versions: what each holds, and holds pinned
                         "versions_on": self._by_worker(model_id, "resident"),
                         "pinned_on": self._by_worker(model_id, "pinned")})
        return rows, last

    def _by_worker(self, model_id: str, kind: Literal["resident", "pinned"]
                   ) -> dict[str, list[str]]:
        found = {}
        for holdings in self.holdings_of(model_id):
            held = holdings.resident if kind == "resident" else holdings.pinned
            versions = held.get(model_id)
            if versions:
                found[holdings.worker_id] = sorted(versions)
        return dict(sorted(found.items()))

    # -- commands -------------------------------------------------------------------
    async def load(self, model_id: str, version: str | None, workers: int,
                   config: str = "") -> Outcome:
        """Warm the model (``version``, else its route) on ``workers`` workers, and on
        every worker that holds another version of it; answer when all are warm.

        ``config``: the override of its model.toml settings it serves with from now on
        (``ConfigOverride.to_json``; "": model.toml's own), on every gateway and worker.

        A named version takes the unversioned route once it is warm on all of them;
        a version that fails anywhere never does (the error names the worker and why).
        """
        # The versions the model serves under this load's config, not the last one's.
        entry = self._catalog.view(model_id, ConfigOverride.from_json(config))
        if version is not None:
            entry.version(version)  # ModelNotFound for a version not served
        ready = await self._ready_workers_at_least(workers)
        if workers > len(ready):
            raise NoCapacity(f"asked to warm '{model_id}' on {workers} worker(s); "
                             f"{len(ready)} ready worker(s) are live")
        versions = [m.version for m in entry.versions]
        target = version or route(model_id, versions, None, self.holdings_of(model_id))
        chosen = self._choose(model_id, target, workers, ready)
        await self._run(model_id, "load", target, chosen, target, named=version is not None,
                        config=config)
        if version is not None:
            await self._run(model_id, "route", version, frozenset(), version)
        return Outcome(model_id, target, tuple(sorted(chosen)))

    async def unload(self, model_id: str) -> Outcome:
        """Refuse the model's requests from now on and drop it from every live worker."""
        self._catalog.get(model_id)
        workers = frozenset(self._ready_workers()) | {h.worker_id for h in self.holdings()}
        await self._run(model_id, "unload", "", workers, "")
        return Outcome(model_id, "", tuple(sorted(workers)))

    async def pin(self, model_id: str, pinned: bool) -> Outcome:
        """Pin (preload everywhere, never evict) or unpin; answered once every live
        worker has done it."""
        self._catalog.get(model_id)
        version = self.route(model_id) or ""
        workers = frozenset(self._ready_workers())
        await self._run(model_id, "pin" if pinned else "unpin", "", workers, version)
        return Outcome(model_id, version, tuple(sorted(workers)))

    async def _keep(self, action: Action, model_id: str) -> None:
        assert self._orders is not None
        try:
            await asyncio.to_thread(self._orders.put, model_id, self.state)
        except OrderStoreError as exc:
            metrics.CONTROL_COMMANDS.labels(action, "not_kept").inc()
            raise type(exc)(
                f"the {action} of '{model_id}' was given to the fleet but could not be kept "
                f"in {self._orders.location}, so it is forgotten if every gateway and worker "
                f"restarts: {exc.message}; give it again once the database is back") from exc

    def _choose(self, model_id: str, version: str, count: int, ready: list[str]
                ) -> frozenset[str]:
        """Workers already warm first, then those holding another version (they must
        have the new one before the route moves), then the least loaded."""
        holdings = {h.worker_id: h for h in self.holdings()}
        warm = [w for w in ready if version in holdings[w].resident.get(model_id, ())]
        holders = [w for w in ready if holdings[w].resident.get(model_id) and w not in warm]
        rest = sorted((w for w in ready if w not in warm and w not in holders),
                      key=lambda w: (sum(len(v) for v in holdings[w].resident.values()), w))
        chosen = list(holders)  # every holder of an old version warms the new one
        for worker_id in warm + rest:
            if len(chosen) >= count:
                break
            chosen.append(worker_id)
        return frozenset(chosen)

    async def _run(self, model_id: str, action: Action, version: str,
                   workers: frozenset[str], about: str, named: bool = False,
                   config: str = "") -> None:
        """Publish one command (applied here once the broker took it) and wait for
        ``workers``' results."""
        command = Command(uuid.uuid4().hex, model_id, action, self._revisions.next(),
                          version, tuple(sorted(workers)), named, config)
        collect = self._pending[command.command_id] = _Collect(workers)
        try:
            # BrokerUnavailable here: nobody heard it, so it is not applied here either.
            await self._broker.publish_event(command.event())
            command.apply(self.state)  # this gateway's next request obeys it at once
            if self._orders is not None:  # kept: it outlives every process's memory
                await self._keep(action, model_id)
            timeout_s = self._settings.command_timeout_s
            try:
                await asyncio.wait_for(collect.done.wait(), timeout_s)
            except TimeoutError:
                metrics.CONTROL_COMMANDS.labels(action, "timed_out").inc()
                missing = sorted(workers - set(collect.results))
                raise DeadlineExceeded(
                    f"{action} of '{model_id}' not confirmed within {timeout_s:.0f}s by "
                    f"worker(s) {', '.join(missing)}; the order stands and they carry it "
                    "out when they can") from None
        finally:
            del self._pending[command.command_id]
        failed = [r for r in collect.results.values() if not r.ok]
        metrics.CONTROL_COMMANDS.labels(action, "failed" if failed else "ok").inc()
        if failed:
            first = failed[0]
            detail = "; ".join(f"{r.worker_id}: {r.message}" for r in failed)
            what = f"'{model_id}' version {about}" if about else f"'{model_id}'"
            error: ModelfleetError = error_from_code(
                first.code, f"{action} of {what} failed on {len(failed)} of "
                f"{len(workers)} worker(s): {detail}")
            raise error


def _named(holdings: Holdings) -> frozenset[str]:
    """The models one announcement names."""
    return frozenset(holdings.resident) | frozenset(holdings.failed) \
        | frozenset(holdings.pinned)
