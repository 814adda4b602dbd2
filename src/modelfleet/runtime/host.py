"""The model host: which models are loaded in this runtime process, and loading them.

The byte accounting and the choice of victims belong to ``modelfleet.cache.ModelCache``
(pure); this module carries its decisions out: it imports handlers, calls ``load``
on a thread, demotes and drops models, and keeps the invariants:

- one load per model version at a time (single-flight): concurrent requests for a
  model that is loading await that one load; versions are resident side by side
  (keys ``model@version``), so a rollout or a caller pinned to an old version does not
  make them evict each other;
- a model is moved between tiers by one move at a time (a promotion waits for a
  demotion still under way), and never while a request or a predict runs on it;
- at most ``max_concurrent_loads`` loads at once in this runtime;
- a failed load leaves nothing behind, so the next request tries again;
- a model larger than the whole device budget fails at once (``ModelTooLarge``);
- in a runtime process of its own (``memory`` given), its memory is its budget: an
  eviction gives the model's memory back to the system (``runtime.memory``: the
  allocator set up at start-up, ``malloc_trim`` after evictions), and while RSS is over
  start-up RSS + budgets x (1 + ``rss_margin``) models are shed, lowest-ranked first,
  until it is back under, and a load waits for that, refused (``NoCapacity``) only if
  shedding cannot bring RSS under in time (``runtime/shedding.py``);
- the budgets can change at run time (``set_budgets``: a worker's pooled budget moved);
  what no longer fits is evicted at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from modelfleet.cache import POLICIES, Eviction, ModelCache
from modelfleet.errors import ConfigError, ModelfleetError, ModelLoadFailed, NoCapacity
from modelfleet.ipc.flight import FlightRecord
from modelfleet.ipc.protocol import DeviceBudget, Load, RuntimeStats
from modelfleet.libc import trim
from modelfleet.model.api import Context, Model
from modelfleet.model.importer import import_handler
from modelfleet.model.pipeline import Batcher
from modelfleet.repository import ModelStore
from modelfleet.repository.manifest import Manifest, load_manifest
from modelfleet.repository.overrides import merged_batching
from modelfleet.runtime.device import (
    measure_load,
    move,
    package_bytes,
    release_device_memory,
    resolve_device,
)
from modelfleet.runtime.memory import CycleCollector, MemoryGuard
from modelfleet.runtime.shedding import Shedder
from modelfleet.settings import RuntimeSettings

log = logging.getLogger("modelfleet.runtime")

T = TypeVar("T")


@dataclass
class LoadedModel:
    manifest: Manifest
    handler: Model
    batcher: Batcher
    device: str
    in_use: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    def configure(self, batching: Mapping[str, int | float]) -> None:
        """Batch as model.toml says, with an operator's override of it (``batching``:
        ``ConfigOverride.batching``, checked by the gateway; empty: model.toml's own)."""
        try:
            wanted = merged_batching(self.manifest.batching, dict(batching)) if batching \
                else self.manifest.batching
        except ValueError as exc:  # pydantic's ValidationError: not one a gateway passed
            raise ConfigError(f"model '{self.manifest.name}': the [batching] override "
                              f"{dict(batching)} does not fit model.toml's bounds: "
                              f"{exc}") from exc
        settings = (wanted.max_batch_size, wanted.max_delay_ms / 1000)
        if self.batcher.settings != settings:
            self.batcher.configure(*settings)

    async def quiesce(self) -> None:
        """Wait until no request and no batch (even one whose caller gave up) runs on it."""
        await self.idle.wait()
        await self.batcher.idle()

    @contextlib.contextmanager
    def using(self) -> Iterator[None]:
        """Held while a request runs on the model: it is not moved or freed under it."""
        self.in_use += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.in_use -= 1
            if not self.in_use:
                self.idle.set()


def residency_key(model_id: str, version: str) -> str:
    """The cache's key for one version of a model (``@`` is not allowed in either)."""
    return f"{model_id}@{version}"


def model_of(key: str) -> str:
    return key.rsplit("@", 1)[0]


@dataclass
class HostEvents:
    """What happened since the coordinator last asked (drained by ``stats``)."""

    loads: list[Load] = field(default_factory=list)
    evictions: list[tuple[str, str]] = field(default_factory=list)  # (action, model id)
    load_failures: int = 0
    loads_refused: int = 0  # refused while over the memory budget


class ModelHost:
    def __init__(self, settings: RuntimeSettings, store: ModelStore,
                 clock: Callable[[], float] = time.monotonic,
                 memory: Callable[[ModelCache, CycleCollector], MemoryGuard] | None = None,
                 flight: FlightRecord | None = None) -> None:
        """``memory``: builds the guard of this process's memory over the cache and the
        host's cycle collector (only a runtime in a process of its own: in-process
        runtimes share the coordinator's RSS).
        ``flight``: where the models running code on a thread are written (a process's
        own, ``runtime/flight.py``)."""
        self.flight = flight or FlightRecord(None)
        self._settings = settings
        self._store = store
        policy = POLICIES.get(settings.eviction_policy)
        if policy is None:
            raise ModelLoadFailed(f"unknown eviction policy '{settings.eviction_policy}' "
                                  f"(choose from {', '.join(POLICIES)})")
        self.cache = ModelCache(settings.device_budget_bytes, settings.host_budget_bytes,
                                policy(), host_policy=policy(), clock=clock)
        self._models: dict[str, LoadedModel] = {}  # residency key -> loaded model
        self._loading: dict[str, asyncio.Future[LoadedModel]] = {}
        self._load_tasks: set[asyncio.Task[None]] = set()
        self._load_started: dict[str, float] = {}
        self._moves: dict[str, asyncio.Lock] = {}  # residency key -> one tier move at a time
        self._load_slots = asyncio.Semaphore(settings.max_concurrent_loads)
        # Modules that loading models imported (e.g. sklearn.svm, torch): a standby runtime
        # imports them ahead, so that a crash does not also cost their import.
        self.frameworks: set[str] = set()
        self.events = HostEvents()
        self._collect_cycles = CycleCollector()  # at most once a second (see its class)
        self.memory = memory(self.cache, self._collect_cycles) if memory is not None else None
        self._shedder = None if self.memory is None else Shedder(
            self.memory, self.cache.shed, lambda evictions: self._carry_out(evictions),
            self._count_refused)

    @property
    def loading(self) -> list[str]:
        return sorted({model_of(key) for key in self._loading})

    def load_ages_s(self) -> dict[str, float]:
        """Seconds each load under way has been running (or waiting for a load slot)."""
        now = time.monotonic()
        return {model_of(key): now - started for key, started in self._load_started.items()}

    def tier_of(self, model_id: str, version: str) -> str | None:
        return self.cache.tier_of(residency_key(model_id, version))

    def loaded(self, model_id: str, version: str) -> LoadedModel | None:
        return self._models.get(residency_key(model_id, version))

    async def ensure(self, model_id: str, version: str, pinned: bool = False
                     ) -> tuple[LoadedModel, bool]:
        """The model version ready on its device; returns (model, whether this waited on a load).

        One load per model version at a time: a request for one being loaded waits on
        that load. Whatever happened meanwhile (an eviction, a demotion) is checked
        again before the model is handed out.
        """
        key = residency_key(model_id, version)
        waited = False
        while True:
            loaded = self._models.get(key)
            if loaded is not None and self.cache.tier_of(key) == "device":
                self.cache.hit(key)  # a use, for the eviction policy's frequency count
                if pinned:  # pinned after it was loaded (an operator's pin)
                    self.cache.pin(key)
                return loaded, waited
            pending = self._loading.get(key)
            if pending is None:
                pending = asyncio.get_running_loop().create_future()
                self._loading[key] = pending
                self._load_started[key] = time.monotonic()
                load = asyncio.create_task(self._load(model_id, version, pinned, pending),
                                           name=f"load-{key}")
                self._load_tasks.add(load)
                load.add_done_callback(self._load_tasks.discard)
            await asyncio.shield(pending)
            waited = True

    def _move_lock(self, key: str) -> asyncio.Lock:
        return self._moves.setdefault(key, asyncio.Lock())

    async def _load(self, model_id: str, version: str, pinned: bool,
                    done: asyncio.Future[LoadedModel]) -> None:
        key = residency_key(model_id, version)
        try:
            async with self._load_slots:
                loaded = await self._load_now(model_id, version, pinned)
            done.set_result(loaded)
        except ModelfleetError as exc:
            self.events.load_failures += 1
            done.set_exception(exc)
        except Exception as exc:
            self.events.load_failures += 1
            done.set_exception(ModelLoadFailed(f"model '{model_id}' failed to load: {exc!r}"))
        finally:
            self._loading.pop(key, None)
            self._load_started.pop(key, None)
            if done.done() and not done.cancelled():
                done.exception()  # mark retrieved: a load nobody awaited is not an error

    async def _device_for(self, requested: str) -> str:
        """The device a model will use. Asking for CUDA imports torch if it is not yet
        (seconds: in a thread): that import is the model's framework, kept for the
        zygote like a load's imports, and what it adds to RSS is overhead."""
        if requested != "cuda":
            return resolve_device(requested)
        before = set(sys.modules)
        rss_before = self.memory.rss() if self.memory is not None else 0
        device = await asyncio.to_thread(resolve_device, requested)
        if self._note_frameworks(before) and self.memory is not None:
            self.memory.count_imports(rss_before, 0)
        return device

    def _note_frameworks(self, before: set[str], own: str | None = None) -> bool:
        """Add the modules imported since ``before`` (not ours, not the package's
        own) to the frameworks the runtime reports; True if any was new."""
        skipped = ("modelfleet", "_", own) if own else ("modelfleet", "_")
        imported = {name for name in set(sys.modules) - before if not name.startswith(skipped)}
        new = bool(imported - self.frameworks)
        self.frameworks |= imported
        return new

    async def _load_now(self, model_id: str, version: str, pinned: bool) -> LoadedModel:
        key = residency_key(model_id, version)
        current = self._models.get(key)
        if current is not None and self.cache.tier_of(key) == "device":
            return current  # a promotion or a reload raced us here and won
        if self._shedder is not None:
            await self._shedder.admit(model_id)  # RSS under its line, shedding if need be
        if current is not None and self.cache.tier_of(key) == "host":
            promoted = await self._promote(key, current, pinned)
            if promoted is not None:
                return promoted
            # Its host copy was dropped while the promotion waited for room: load it afresh.

        package_dir, source = await asyncio.to_thread(self._store.materialize, model_id, version)
        manifest = load_manifest(package_dir / "model.toml")
        pinned = pinned or manifest.fanout.pinned  # pinned stays pinned across restarts
        device = await self._device_for(manifest.device)
        size = self.cache.last_measured_bytes(key) or manifest.memory_estimate_bytes
        if device == "cpu":
            # On CPU a load measures at least its package's bytes: reserve that much, or
            # an estimate a little short would overflow at commit beside other loads.
            size = max(size, await asyncio.to_thread(package_bytes, package_dir))
        evictions = await self._reserve(key, size, pinned)
        try:
            await self._carry_out(evictions)
            limit = manifest.memory_limit_bytes or self._settings.memory_limit_bytes
            ctx = Context(model_id, version, package_dir, device, limit)
            handlers: list[Model] = []

            def prepare() -> Model:
                handlers.append(import_handler(manifest, package_dir)())
                return handlers[0]

            before = set(sys.modules)
            rss_before = self.memory.rss() if self.memory is not None else 0
            try:
                measured = await asyncio.to_thread(self._recorded, model_id, lambda: (
                    measure_load(device, package_dir, prepare, lambda: handlers[0].load(ctx))))
            except ModelfleetError:
                raise
            except Exception as exc:
                raise ModelLoadFailed(f"model '{model_id}' failed to load: {exc!r}") from exc
            handler = handlers.pop()
            own = handler.__class__.__module__.split(".")[0]
            new_frameworks = self._note_frameworks(before, own)
        except BaseException:
            self.cache.release(key)
            raise
        loaded = LoadedModel(manifest, handler, self._batcher(model_id, manifest, handler),
                             device)
        self._models[key] = loaded
        # Measured bigger than reserved, and loads started earlier hold the rest: they
        # finish (and become evictable) first, rather than this model being refused.
        while not self.cache.room_for(key, measured.size_bytes):
            if not await self._load_finished(key, older_only=True):
                break
        try:
            more = self.cache.commit(key, measured.size_bytes, measured.seconds, source)
        except ModelfleetError:  # measured bigger than the budget, or than what can be freed
            await self._unload(key)
            raise
        self.events.loads.append(Load(model_id, source, measured.seconds,
                                           measured.size_bytes))
        await self._carry_out(more)
        if self.cache.tier_of(key) != "device":
            raise NoCapacity(f"model '{model_id}' measured {measured.size_bytes} bytes at load, "
                             "more than this runtime can hold next to its pinned models and "
                             "loads in flight; it was unloaded again")
        if new_frameworks and self.memory is not None:  # an import is overhead, not a model
            self.memory.count_imports(rss_before, measured.size_bytes)
        log.info("loaded %s v%s from %s in %.2fs (%d bytes)", model_id, version, source,
                 measured.seconds, measured.size_bytes)
        return loaded

    def watch_memory(self) -> None:
        """Shed models if RSS is over its line without any load asking (a handler grew)."""
        if self._shedder is not None:
            self._shedder.watch()

    async def set_budgets(self, device_budget_bytes: int,
                          host_budget_bytes: int | None = None) -> None:
        """Change the budgets now; what no longer fits is evicted before this returns."""
        try:
            evictions = self.cache.set_budgets(device_budget_bytes, host_budget_bytes)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        await self._carry_out(evictions)
        log.info("budgets set: device %d bytes, host %d bytes", self.cache.device_budget_bytes,
                 self.cache.host_budget_bytes)

    async def _reserve(self, key: str, size: int, pinned: bool) -> list[Eviction]:
        """Reserve device room, waiting for loads in flight when only they stand in the way.

        ``NoCapacity`` only when pinned models alone leave no room: reservations of
        other loads are temporary, so a model that fits the budget waits for them.
        """
        while True:
            try:
                return self.cache.reserve(key, size, pinned=pinned)
            except NoCapacity:
                # Waiting here holds no room, so any load holding room may be waited for.
                if not await self._load_finished(key, older_only=False):
                    raise

    async def _load_finished(self, key: str, older_only: bool) -> bool:
        """Wait until one other load that holds room ends; False at once if none does.

        ``older_only``: only loads that started before ``key``'s, for a load that holds
        room itself, so two loads never wait for each other.
        """
        started = self._load_started.get(key, float("inf")) if older_only else float("inf")
        older = [future for other, future in self._loading.items()
                 if other != key and self._load_started.get(other, float("inf")) < started
                 and self.cache.reservation(other) is not None]
        if not older:
            return False
        await asyncio.wait(older, return_when=asyncio.FIRST_COMPLETED)
        return True

    async def _promote(self, key: str, loaded: LoadedModel, pinned: bool) -> LoadedModel | None:
        """Move a host-resident model back to the device; None (nothing reserved) if its
        host copy was dropped while this waited for room (memory shedding, a lower host
        budget, demotions pushing it out: a copy is protected only once reserved)."""
        size = self.cache.last_measured_bytes(key) or loaded.manifest.memory_estimate_bytes
        evictions = await self._reserve(key, size, pinned or loaded.manifest.fanout.pinned)
        reservation = self.cache.reservation(key)
        if reservation is None or not reservation.promotion or self._models.get(key) is not loaded:
            # The copy is gone (and its handler unloaded): this reserved a cold load's room.
            if reservation is not None:
                self.cache.release(key)
            await self._carry_out(evictions)
            return None
        try:
            await self._carry_out(evictions)
            async with self._move_lock(key):  # after a demotion still under way, not before
                started = time.perf_counter()
                await asyncio.to_thread(move, loaded.handler, "device")
                seconds = time.perf_counter() - started
        except BaseException:
            self.cache.release(key)
            raise
        await self._carry_out(self.cache.commit(key, size, seconds, "host"))
        self.events.loads.append(Load(loaded.manifest.name, "host", seconds, size))
        return loaded

    def _batcher(self, model_id: str, manifest: Manifest, handler: Model) -> Batcher:
        flight = self.flight
        return Batcher(handler.predict, manifest.batching.max_batch_size,
                       manifest.batching.max_delay_ms / 1000,
                       (lambda keys: flight.running(model_id, keys)) if flight.keeping else None)

    def _recorded(self, model_id: str, call: Callable[[], T]) -> T:
        """``call`` on this thread, in the flight record as the model's (a load)."""
        with self.flight.running(model_id):
            return call()

    async def _carry_out(self, evictions: list[Eviction]) -> None:
        """Carry out the cache's evictions, in order. Every dropped model leaves
        ``_models`` before the first await: a request that comes while an earlier one
        is being freed loads that model afresh, and this eviction frees the copy it was
        decided for, never the fresh one (which the cache holds, and a later request
        would then have found missing)."""
        dropped = {e.model_id: self._models.pop(e.model_id, None)
                   for e in evictions if e.action != "demote"}
        for eviction in evictions:
            self.events.evictions.append((eviction.action, model_of(eviction.model_id)))
            if eviction.action == "demote":
                await self._demote(eviction.model_id)
            elif (loaded := dropped.pop(eviction.model_id, None)) is not None:
                await self._free(loaded)

    async def _demote(self, key: str) -> None:
        loaded = self._models.get(key)
        if loaded is None:
            return
        async with self._move_lock(key):
            await loaded.quiesce()  # requests and batches running on it finish first
            if self._models.get(key) is not loaded or self.cache.tier_of(key) != "host":
                return  # unloaded or promoted back meanwhile: nothing to move
            try:
                await asyncio.to_thread(move, loaded.handler, "host")
            except Exception:
                log.exception("demoting %s failed; dropping it", key)
                if self.cache.reservation(key) is None:
                    self.cache.remove(key)
                    await self._unload(key)

    async def evict(self, model_id: str, version: str | None = None) -> bool:
        """Drop every version of a model (or only ``version``) from every tier. False if
        none was resident.

        A load of it in flight (cold or a promotion) finishes first and is then dropped:
        unloading a handler under its load would leave the cache's books naming a model
        that is no longer loaded, and the next request's load would find no room of its
        own to commit ("no load ... is in flight").
        """
        def chosen(key: str) -> bool:
            return model_of(key) == model_id and (version is None
                                                  or key == residency_key(model_id, version))

        while pending := [future for key, future in self._loading.items() if chosen(key)]:
            await asyncio.wait(pending)
        # From here to the last pop no await: no load of these keys can start in between.
        keys = [key for key in self._models if chosen(key)]
        unloading = []
        for key in keys:
            self.cache.remove(key)
            unloading.append(self._models.pop(key))
        for loaded in unloading:
            await self._free(loaded)
        return bool(keys)

    async def _unload(self, key: str) -> None:
        loaded = self._models.pop(key, None)
        if loaded is not None:
            await self._free(loaded)

    async def _free(self, loaded: LoadedModel) -> None:
        """Free a model already taken off ``_models``."""
        await loaded.quiesce()  # requests and batches running on it finish first
        device = loaded.device
        await loaded.batcher.close()
        with contextlib.suppress(Exception):  # a failing unload must not wedge the runtime
            await asyncio.to_thread(loaded.handler.unload)
        del loaded
        self._collect_cycles()  # at most once a second: a cycle's memory may outlive it
        release_device_memory(device)
        if self.memory is not None and self._settings.trim_after_eviction:
            await asyncio.to_thread(trim)  # the heap pages it freed go back to the system

    def unpin(self, model_id: str, version: str) -> None:
        """The version may be evicted again (its route moved on, or an operator unpinned)."""
        self.cache.unpin(residency_key(model_id, version))

    def device_budget(self) -> DeviceBudget:
        snap = self.cache.snapshot()
        return DeviceBudget(snap.device_budget_bytes, snap.device_used_bytes,
                            snap.device_reserved_bytes, self.cache.pinned_device_bytes,
                            tuple(sorted({model_of(key) for key in snap.device})))

    def stats(self) -> RuntimeStats:
        """Residency by model id (versions folded), and what happened since the last ask."""
        self.watch_memory()
        snap = self.cache.snapshot()
        events, self.events = self.events, HostEvents()
        device = {model_of(key) for key in snap.device}
        return RuntimeStats(
            device=tuple(sorted(device)),
            host=tuple(sorted({model_of(key) for key in snap.host} - device)),
            loading=tuple(self.loading),
            pinned=tuple(sorted({model_of(key) for key in snap.pinned})),
            device_budget_bytes=snap.device_budget_bytes,
            host_budget_bytes=snap.host_budget_bytes,
            device_used_bytes=snap.device_used_bytes,
            host_used_bytes=snap.host_used_bytes,
            loads=tuple(events.loads),
            evictions=tuple(events.evictions),
            load_failures=events.load_failures,
            resident_versions=tuple(sorted({*snap.device, *snap.host})),
            pinned_versions=tuple(sorted(snap.pinned)),
            loading_versions=tuple(sorted(self._loading)),
            **self._memory_stats(events.loads_refused),
        )

    def _memory_stats(self, refused: int) -> dict[str, Any]:
        if self.memory is None:
            return {}
        state = self.memory.state()
        return {"rss_bytes": state.rss_bytes, "rss_startup_bytes": state.startup_bytes,
                "rss_overhead_bytes": state.overhead_bytes,
                "memory_budget_bytes": state.budget_bytes, "rss_limit_bytes": state.limit_bytes,
                "over_memory_budget": state.over, "loads_refused": refused,
                "device_reserved_bytes": state.device.reserved_bytes,
                "device_allocated_bytes": state.device.allocated_bytes}

    def _count_refused(self) -> None:
        self.events.loads_refused += 1

    async def close(self) -> None:
        if self._shedder is not None:
            self._shedder.close()
        for key in list(self._models):
            await self._unload(key)
