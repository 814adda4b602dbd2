"""The worker's side of the model control API: carry out orders, roll versions, re-announce.

``ControlAgent`` listens to the broker's events on its own (no call from a gateway ever
reaches a worker's address):

- ``{"kind": "control"}``: an operator's order. Every worker records it in its
  ``ControlState``; the workers the command names carry it out on their runtimes
  (load, unload, pin, unpin) and answer ``{"kind": "control_result"}``.
- ``{"kind": "control_orders"}``: a gateway's copy of the orders (merged), told at
  its start-up (the orders kept in the deployment's database) and whenever this
  worker's announcement lacks one of them (it restarted, or missed an order).
- ``{"kind": "worker_control"}``: another worker's re-announcement: its copy of the
  orders (merged: a worker that missed an order learns it here) and the versions it
  holds (for the route, which every worker computes like the gateways do).

Every ``control.announce_interval_s`` it plans (``control.versions.plan``, pure) and
acts: warm the newest version where an older one is resident, unpin a version the
route left, release it after ``control.drain_s``, drop what an operator unloaded;
then it announces its own copy and holdings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from modelfleet import metrics
from modelfleet.broker import Broker
from modelfleet.control import (
    CONTROL_ORDERS,
    Command,
    ControlState,
    Holdings,
    ModelView,
    Result,
    announcement,
    holdings_of,
    plan,
    route,
)
from modelfleet.control.configs import follow_configs
from modelfleet.control.pins import PinnedIndex
from modelfleet.control.versions import Versions, newest_good, pin_versions
from modelfleet.errors import BrokerUnavailable, ModelfleetError, ModelUnavailable
from modelfleet.repository import Catalog
from modelfleet.settings import Settings

# How long a version just warmed counts as loading while residency has not shown it yet.
WARMED_LAG_S = 5.0

log = logging.getLogger("modelfleet.worker")

# Load errors that say the version itself is broken: it is announced as failed and never
# takes the route. Others (no room now, a runtime crash) are retried after a pause.
DETERMINISTIC = frozenset({"model_load_failed", "model_too_large", "config_error",
                           "invalid_manifest", "model_not_found"})
RETRY_TRANSIENT_S = 10.0


class Placement(Protocol):
    """This worker's runtimes, as far as placing model versions goes."""

    def versions(self) -> tuple[Versions, Versions, Versions]:
        """(resident, pinned, loading) versions by model, as last read from the runtimes."""
        ...

    async def load(self, model_id: str, version: str, pinned: bool) -> None: ...

    async def unload(self, model_id: str, version: str | None) -> None:
        """Drop one version (or every version, ``None``) of the model."""
        ...

    async def unpin(self, model_id: str, version: str) -> None: ...


class ControlAgent:
    def __init__(self, settings: Settings, broker: Broker, catalog: Catalog,
                 placement: Placement, worker_id: str, ready: Callable[[], bool],
                 clock: Callable[[], float] = time.time,
                 refresh_catalog: Callable[[], Awaitable[object]] | None = None) -> None:
        self._settings = settings.control
        self._broker = broker
        self._catalog = catalog
        self._placement = placement
        self.worker_id = worker_id
        self._ready = ready
        self._clock = clock
        # Scans the repository now (``CatalogRefresher.refresh_now``): an order for a
        # version just published may arrive before this worker's scan that finds it.
        self._refresh_catalog = refresh_catalog
        self.state = ControlState()
        follow_configs(self.state, catalog)
        self._pins = PinnedIndex(catalog, self.state)
        self._others: dict[str, tuple[float, Holdings]] = {}
        self._failed: dict[str, dict[str, str]] = {}  # model -> version -> why it failed here
        self._retry_at: dict[tuple[str, str], float] = {}  # (model, version) -> after when
        self._warming: dict[tuple[str, str], asyncio.Task[None]] = {}
        # Versions just warmed, until residency shows them (it lags a load by a state
        # read): not warmed again meanwhile. (model, version) -> when warmed.
        self._warmed: dict[tuple[str, str], float] = {}
        self._routes: dict[str, str] = {}  # model -> the route at the last plan
        self._superseded: dict[tuple[str, str], float] = {}  # (model, version) -> route left
        self._commands: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Start carrying out orders; events reach ``observe`` from the worker's one
        subscription (the coordinator's), not from one of its own."""
        self._loops = [asyncio.create_task(self._tick_loop(), name="control-tick")]

    async def stop(self) -> None:
        tasks = [*self._loops, *self._commands, *self._warming.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- what the coordinator asks -----------------------------------------------------
    def refusal(self, model_id: str) -> ModelfleetError | None:
        """The error a task of an unloaded model is answered with (None: run it)."""
        if self.state.loaded(model_id):
            return None
        return ModelUnavailable(f"model '{model_id}' was unloaded by an operator; it "
                                "serves again after POST /v2/repository/models/"
                                f"{model_id}/load")

    def pinned(self, model_id: str) -> bool:
        """Pinned by its manifest or an operator, and not unloaded."""
        return self._pins.pinned(model_id)

    def pinned_ids(self) -> frozenset[str]:
        """Every model :meth:`pinned` says yes of; rebuilt only when the catalog or the
        orders change (``control.pins``), so a re-score does not walk the catalog."""
        return self._pins.ids()

    def pin_versions(self, model_id: str) -> list[str]:
        """The versions of a pinned model to keep loaded: its route's, and the newest."""
        versions = [m.version for m in self._catalog.get(model_id).versions]
        failed = frozenset(self._failed.get(model_id, {}))
        route_version = self.route(model_id)
        return pin_versions(route_version,
                            newest_good(versions, self.state.version(model_id), failed))

    def route(self, model_id: str) -> str:
        versions = [m.version for m in self._catalog.get(model_id).versions]
        return route(model_id, versions, self.state.version(model_id), self._fleet())

    def load_failed(self, model_id: str, version: str, error: ModelfleetError) -> None:
        """A load of this version failed here: a broken version never takes the route (it
        is announced); after a transient error it is tried again in a while."""
        if error.code in DETERMINISTIC:
            self._failed.setdefault(model_id, {})[version] = error.message
        else:
            self._retry_at[(model_id, version)] = self._clock() + RETRY_TRANSIENT_S

    def loaded_ok(self, model_id: str, version: str) -> None:
        self._failed.get(model_id, {}).pop(version, None)
        self._retry_at.pop((model_id, version), None)

    def failed_versions(self) -> dict[str, frozenset[str]]:
        """Versions that failed to load here as broken, by model (what is announced)."""
        return {m: frozenset(vs) for m, vs in self._failed.items() if vs}

    def _not_now(self, model_id: str, now: float) -> frozenset[str]:
        """Versions not to warm now: broken, or pausing after a transient error."""
        return frozenset(self._failed.get(model_id, {})) | {
            v for (m, v), at in self._retry_at.items() if m == model_id and now < at}

    # -- events --------------------------------------------------------------------------
    def observe(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        if kind == "control":
            command = Command.from_event(event)
            if command is None:
                return
            command.apply(self.state)
            if self.worker_id in command.workers:
                task = asyncio.create_task(self._carry_out(command),
                                           name=f"control-{command.action}")
                self._commands.add(task)
                task.add_done_callback(self._commands.discard)
            self._wake.set()
        elif kind == CONTROL_ORDERS:  # a gateway's copy: what it kept, or what we lack
            if self.state.merge(event.get("control")):
                self._wake.set()
        elif kind == "worker_gone":
            self._others.pop(str(event.get("worker_id", "")), None)
        else:
            holdings = holdings_of(event)
            if holdings is None or holdings.worker_id == self.worker_id:
                return
            self._others[holdings.worker_id] = (self._clock(), holdings)
            if self.state.merge(event.get("control")):
                self._wake.set()

    async def _carry_out(self, command: Command) -> None:
        model_id, version = command.model_id, command.version
        try:
            await self._catalog_holds(model_id, version)
            if model_id not in self._catalog:
                raise ModelUnavailable(f"this worker's repository has no model '{model_id}'")
            if command.action == "load":
                version = version or self.route(model_id)
                await self._load(model_id, version, self.pinned(model_id))
            elif command.action == "unload":
                await self._placement.unload(model_id, None)
            elif command.action == "pin":
                for each in self.pin_versions(model_id):
                    await self._load(model_id, each, True)
            elif command.action == "unpin":
                resident, _, _ = self._placement.versions()
                for each in sorted(resident.get(model_id, frozenset())):
                    await self._placement.unpin(model_id, each)
            result = Result(command.command_id, self.worker_id, model_id, version, True)
        except ModelfleetError as exc:
            log.warning("control: %s of %s failed here: %s", command.action, model_id, exc)
            result = Result(command.command_id, self.worker_id, model_id, version, False,
                            exc.code, exc.message)
        await self._publish(result.event())
        self._wake.set()

    async def _catalog_holds(self, model_id: str, version: str) -> None:
        """Scan the repository first where the order names what the catalog lacks."""
        known = model_id in self._catalog and (not version or version in {
            m.version for m in self._catalog.get(model_id).versions})
        if known or self._refresh_catalog is None:
            return
        with contextlib.suppress(Exception):  # what is still missing is said after
            await asyncio.wait_for(self._refresh_catalog(), self._settings.command_timeout_s)

    async def _load(self, model_id: str, version: str, pinned: bool) -> None:
        try:
            await self._placement.load(model_id, version, pinned)
        except ModelfleetError as exc:
            self.load_failed(model_id, version, exc)
            raise
        self.loaded_ok(model_id, version)

    # -- plan and act ------------------------------------------------------------------
    async def _tick_loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.tick()
            except Exception:
                log.exception("control: plan failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._settings.announce_interval_s)

    def _fleet(self) -> list[Holdings]:
        now = self._clock()
        for worker_id, (seen, _) in list(self._others.items()):
            if now - seen > self._settings.stale_after_s:
                del self._others[worker_id]
        resident, _, _ = self._placement.versions()
        own = Holdings(self.worker_id, resident, self.failed_versions())
        return [own, *(h for _, h in self._others.values())]

    async def tick(self) -> None:
        """Plan over the current views, act on the plan, announce."""
        now = self._clock()
        resident, pinned_here, loading = self._placement.versions()
        fleet = self._fleet()
        views = []
        # Only what this worker holds can need warming, unpinning or releasing (pinned
        # models are loaded by the PinKeeper): the plan's cost follows residency, not
        # the catalog's size.
        held = sorted(m for m, vs in resident.items() if vs and m in self._catalog)
        for gone in set(self._routes) - set(held):
            del self._routes[gone]
        for key in [k for k in self._superseded if k[1] not in resident.get(k[0], ())]:
            del self._superseded[key]
        for key, at in list(self._warmed.items()):
            if key[1] in resident.get(key[0], ()) or now - at > WARMED_LAG_S:
                del self._warmed[key]
        warming: dict[str, set[str]] = {}
        for m, v in (*self._warming, *self._warmed):
            warming.setdefault(m, set()).add(v)
        for model_id in held:
            versions = tuple(m.version for m in self._catalog.get(model_id).versions)
            if len(versions) == 1 and resident[model_id] == {versions[0]} \
                    and self.state.loaded(model_id) and not pinned_here.get(model_id) \
                    and not self.pinned(model_id):
                # Nearly every model of a large catalog: one version, resident at it
                # alone, no order. Its route is that version and the plan has nothing to
                # do for it
                # (``plan``), so it costs a dict write here, not a view.
                self._superseded.pop((model_id, versions[0]), None)
                self._routes[model_id] = versions[0]
                continue
            current = route(model_id, versions, self.state.version(model_id), fleet)
            previous = self._routes.get(model_id)
            if previous is not None and previous != current:
                self._superseded[(model_id, previous)] = now
            self._superseded.pop((model_id, current), None)
            self._routes[model_id] = current
            here = resident.get(model_id, frozenset())
            views.append(ModelView(
                model_id, versions, current, self.state.loaded(model_id),
                self.pinned(model_id), self.state.version(model_id), here,
                pinned_here.get(model_id, frozenset()),
                loading.get(model_id, frozenset()) | warming.get(model_id, set()),
                self._not_now(model_id, now),
                {v: now - t for (m, v), t in self._superseded.items() if m == model_id}))
        decided = plan(views, self._settings.drain_s)
        for model_id in decided.unload:
            log.info("control: dropping %s (unloaded by an operator)", model_id)
            await self._quietly(self._placement.unload(model_id, None))
            metrics.VERSION_CHANGES.labels("unload").inc()
        for model_id, version in decided.unpin:
            await self._quietly(self._placement.unpin(model_id, version))
            metrics.VERSION_CHANGES.labels("unpin").inc()
        for model_id, version in decided.release:
            log.info("control: releasing %s v%s (the route left it %.0fs ago)", model_id,
                     version, self._settings.drain_s)
            await self._quietly(self._placement.unload(model_id, version))
            self._superseded.pop((model_id, version), None)
            metrics.VERSION_CHANGES.labels("release").inc()
        for warm in decided.warm:
            key = (warm.model_id, warm.version)
            if key not in self._warming:
                log.info("control: warming %s v%s (a new version)", *key)
                task = asyncio.create_task(self._warm(*key), name=f"warm-{key[0]}@{key[1]}")
                self._warming[key] = task
        held_pinned = {m: vs & resident.get(m, frozenset()) for m, vs in pinned_here.items()}
        await self._publish(announcement(self.worker_id, now, self._ready(), self.state,
                                         resident, self.failed_versions(), held_pinned))

    async def _warm(self, model_id: str, version: str) -> None:
        try:
            await self._load(model_id, version, False)
            self._warmed[(model_id, version)] = self._clock()
            metrics.VERSION_CHANGES.labels("warm").inc()
        except ModelfleetError as exc:
            metrics.VERSION_CHANGES.labels("warm_failed").inc()
            log.error("control: %s v%s failed to load; it will not take the route: %s",
                      model_id, version, exc)
        finally:
            self._warming.pop((model_id, version), None)
            self._wake.set()

    async def _quietly(self, action: Any) -> None:
        try:
            await action
        except ModelfleetError as exc:
            log.warning("control: %s", exc)

    async def _publish(self, event: dict[str, Any]) -> None:
        with contextlib.suppress(BrokerUnavailable):
            await self._broker.publish_event(event)
