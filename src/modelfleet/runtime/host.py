"""The model host: which models are loaded in this runtime process, and loading them.

The byte accounting and the choice of victims belong to ``modelfleet.cache.ModelCache``
(pure); this module carries its decisions out: it imports handlers, calls ``load``
on a thread, demotes and drops models, and keeps the invariants:

- one load per model id at a time (single-flight): concurrent requests for a model
  that is loading await that one load;
- at most ``max_concurrent_loads`` loads at once in this runtime;
- a failed load leaves nothing behind, so the next request tries again;
- a model larger than the whole device budget fails at once (``ModelTooLarge``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from modelfleet.cache import POLICIES, Eviction, ModelCache
from modelfleet.errors import ModelfleetError, ModelLoadFailed, NoCapacity
from modelfleet.manifest import Manifest, load_manifest
from modelfleet.model import Context, Model, import_handler
from modelfleet.repository import ModelStore
from modelfleet.runtime.device import measure_load, move, release_device_memory, resolve_device
from modelfleet.runtime.pipeline import Batcher
from modelfleet.settings import RuntimeSettings

log = logging.getLogger("modelfleet.runtime")


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


@dataclass(frozen=True)
class LoadEvent:
    model_id: str
    source: str
    seconds: float
    size_bytes: int


@dataclass
class HostEvents:
    """What happened since the coordinator last asked (drained by ``stats``)."""

    loads: list[LoadEvent] = field(default_factory=list)
    evictions: list[tuple[str, str]] = field(default_factory=list)  # (action, model id)
    load_failures: int = 0


class ModelHost:
    def __init__(self, settings: RuntimeSettings, store: ModelStore,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._store = store
        policy = POLICIES.get(settings.eviction_policy)
        if policy is None:
            raise ModelLoadFailed(f"unknown eviction policy '{settings.eviction_policy}' "
                                  f"(choose from {', '.join(POLICIES)})")
        self.cache = ModelCache(settings.device_budget_bytes, settings.host_budget_bytes,
                                policy(), host_policy=policy(), clock=clock)
        self._models: dict[str, LoadedModel] = {}
        self._loading: dict[str, asyncio.Future[LoadedModel]] = {}
        self._load_tasks: set[asyncio.Task[None]] = set()
        self._load_started: dict[str, float] = {}
        self._load_slots = asyncio.Semaphore(settings.max_concurrent_loads)
        self.events = HostEvents()

    @property
    def loading(self) -> list[str]:
        return sorted(self._loading)

    def load_ages_s(self) -> dict[str, float]:
        """Seconds each load under way has been running (or waiting for a load slot)."""
        now = time.monotonic()
        return {m: now - started for m, started in self._load_started.items()}

    async def ensure(self, model_id: str, version: str, pinned: bool = False
                     ) -> tuple[LoadedModel, bool]:
        """The model ready on its device; returns (model, whether this call waited on a load).

        One load per model id at a time: a request for a model being loaded waits on
        that load (and, if it wanted another version, loads its own after it).
        """
        waited = False
        while True:
            loaded = self._models.get(model_id)
            if loaded is not None and loaded.manifest.version == version \
                    and self.cache.tier_of(model_id) == "device":
                self.cache.hit(model_id)  # a use, for the eviction policy's frequency count
                return loaded, waited
            pending = self._loading.get(model_id)
            if pending is None:
                pending = asyncio.get_running_loop().create_future()
                self._loading[model_id] = pending
                self._load_started[model_id] = time.monotonic()
                load = asyncio.create_task(self._load(model_id, version, pinned, pending),
                                           name=f"load-{model_id}")
                self._load_tasks.add(load)
                load.add_done_callback(self._load_tasks.discard)
            loaded = await asyncio.shield(pending)
            waited = True
            if loaded.manifest.version == version:
                return loaded, True

    async def _load(self, model_id: str, version: str, pinned: bool,
                    done: asyncio.Future[LoadedModel]) -> None:
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
            self._loading.pop(model_id, None)
            self._load_started.pop(model_id, None)
            if done.done() and not done.cancelled():
                done.exception()  # mark retrieved: a load nobody awaited is not an error

    async def _load_now(self, model_id: str, version: str, pinned: bool) -> LoadedModel:
        current = self._models.get(model_id)
        if current is not None and current.manifest.version != version:
            await self._drop(model_id)  # a new version replaces the old one
            current = None
        if current is not None and self.cache.tier_of(model_id) == "host":
            return await self._promote(current, pinned)

        package_dir, source = await asyncio.to_thread(self._store.materialize, model_id, version)
        manifest = load_manifest(package_dir / "model.toml")
        pinned = pinned or manifest.fanout.pinned  # pinned stays pinned across restarts
        size = self.cache.last_measured_bytes(model_id) or manifest.memory_estimate_bytes
        evictions = self.cache.reserve(model_id, size, pinned=pinned)
        try:
            await self._carry_out(evictions)
            device = resolve_device(manifest.device)
            limit = manifest.memory_limit_bytes or self._settings.memory_limit_bytes
            ctx = Context(model_id, version, package_dir, device, limit)
            handlers: list[Model] = []

            def prepare() -> None:
                handlers.append(import_handler(manifest, package_dir)())

            try:
                measured = await asyncio.to_thread(measure_load, device, package_dir, prepare,
                                                   lambda: handlers[0].load(ctx))
            except ModelfleetError:
                raise
            except Exception as exc:
                raise ModelLoadFailed(f"model '{model_id}' failed to load: {exc!r}") from exc
            handler = handlers[0]
        except BaseException:
            self.cache.release(model_id)
            raise
        loaded = LoadedModel(manifest, handler, self._batcher(manifest, handler), device)
        self._models[model_id] = loaded
        try:
            more = self.cache.commit(model_id, measured.size_bytes, measured.seconds, source)
        except ModelfleetError:  # measured bigger than the budget, or than what can be freed
            await self._unload(model_id)
            raise
        self.events.loads.append(LoadEvent(model_id, source, measured.seconds,
                                           measured.size_bytes))
        await self._carry_out(more)
        if self.cache.tier_of(model_id) != "device":
            raise NoCapacity(f"model '{model_id}' measured {measured.size_bytes} bytes at load, "
                             "more than this runtime can hold next to its pinned models and "
                             "loads in flight; it was unloaded again")
        log.info("loaded %s v%s from %s in %.2fs (%d bytes)", model_id, version, source,
                 measured.seconds, measured.size_bytes)
        return loaded

    async def _promote(self, loaded: LoadedModel, pinned: bool) -> LoadedModel:
        model_id = loaded.manifest.name
        size = self.cache.last_measured_bytes(model_id) or loaded.manifest.memory_estimate_bytes
        evictions = self.cache.reserve(model_id, size,
                                       pinned=pinned or loaded.manifest.fanout.pinned)
        started = time.perf_counter()
        try:
            await self._carry_out(evictions)
            started = time.perf_counter()
            await asyncio.to_thread(move, loaded.handler, "device")
        except BaseException:
            self.cache.release(model_id)
            raise
        seconds = time.perf_counter() - started
        await self._carry_out(self.cache.commit(model_id, size, seconds, "host"))
        self.events.loads.append(LoadEvent(model_id, "host", seconds, size))
        return loaded

    def _batcher(self, manifest: Manifest, handler: Model) -> Batcher:
        return Batcher(handler.predict, manifest.batching.max_batch_size,
                       manifest.batching.max_delay_ms / 1000)

    async def _carry_out(self, evictions: list[Eviction]) -> None:
        for eviction in evictions:
            self.events.evictions.append((eviction.action, eviction.model_id))
            if eviction.action == "demote":
                loaded = self._models.get(eviction.model_id)
                if loaded is not None:
                    await loaded.quiesce()  # requests and batches running on it finish first
                    try:
                        await asyncio.to_thread(move, loaded.handler, "host")
                    except Exception:
                        log.exception("demoting %s failed; dropping it", eviction.model_id)
                        self.cache.remove(eviction.model_id)
                        await self._unload(eviction.model_id)
            else:
                await self._unload(eviction.model_id)

    async def evict(self, model_id: str) -> bool:
        """Drop a model from every tier. False if it was not resident."""
        if model_id not in self._models:
            return False
        await self._drop(model_id)
        return True

    async def _drop(self, model_id: str) -> None:
        self.cache.remove(model_id)
        await self._unload(model_id)

    async def _unload(self, model_id: str) -> None:
        loaded = self._models.pop(model_id, None)
        if loaded is None:
            return
        await loaded.quiesce()  # requests and batches running on it finish first
        device = loaded.device
        await loaded.batcher.close()
        with contextlib.suppress(Exception):  # a failing unload must not wedge the runtime
            await asyncio.to_thread(loaded.handler.unload)
        del loaded
        gc.collect()
        release_device_memory(device)

    def stats(self) -> dict[str, Any]:
        snap = self.cache.snapshot()
        events, self.events = self.events, HostEvents()
        return {
            "device": dict(snap.device),
            "host": dict(snap.host),
            "device_budget_bytes": snap.device_budget_bytes,
            "host_budget_bytes": snap.host_budget_bytes,
            "device_used_bytes": snap.device_used_bytes,
            "host_used_bytes": snap.host_used_bytes,
            "loading": self.loading,
            "pinned": sorted(snap.pinned),
            "loads": [(e.model_id, e.source, e.seconds, e.size_bytes) for e in events.loads],
            "evictions": events.evictions,
            "load_failures": events.load_failures,
        }

    async def close(self) -> None:
        for model_id in list(self._models):
            await self._unload(model_id)
