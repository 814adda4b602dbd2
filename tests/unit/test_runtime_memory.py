"""The memory rule a runtime keeps, and the cache operations it drives it with.

``MemoryGuard`` is given its RSS here (the real process is tested in
tests/e2e/test_runtime_memory.py); the cache is the real ``ModelCache``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from modelfleet.cache import LruPolicy, ModelCache
from modelfleet.errors import NoCapacity
from modelfleet.libc import trim
from modelfleet.repository import LocalStore
from modelfleet.runtime.device import DeviceMemory
from modelfleet.runtime.host import ModelHost
from modelfleet.runtime.inprocess import InProcessRuntime
from modelfleet.runtime.memory import (
    CycleCollector,
    MemoryGuard,
    configure_allocator,
    rss_bytes,
)
from modelfleet.runtime.server import RuntimeService
from modelfleet.settings import RuntimeSettings, Settings
from tests.procs import write_package
from tests.waiting import eventually

MB = 1_000_000


class Rss:
    def __init__(self, value: int) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value


def guard(rss: Rss, budget: list[int], device: list[DeviceMemory] | None = None
          ) -> MemoryGuard:
    devices = device if device is not None else [DeviceMemory()]
    return MemoryGuard(lambda: budget[0], 0.25, lambda: budget[0], rss=rss,
                       device=lambda: devices[0])


def test_loads_are_refused_over_the_line_with_one_warning_per_episode_that_costs(
        caplog: pytest.LogCaptureFixture) -> None:
    rss, budget = Rss(50 * MB), [100 * MB]
    memory = guard(rss, budget)
    assert memory.limit_bytes() == 50 * MB + 125 * MB
    memory.admit("a")  # under: admitted
    rss.value = 176 * MB
    with caplog.at_level(logging.INFO, logger="modelfleet.runtime"):
        for model in ("b", "c", "d"):
            with pytest.raises(NoCapacity, match=f"over its memory budget.*'{model}'"):
                memory.admit(model)
        assert memory.over and memory.refused == 3 and memory.episodes == 1
        rss.value = 120 * MB
        memory.admit("e")  # back under: the episode ends
        assert not memory.over
        assert any("back under" in r.getMessage() for r in caplog.records)
        rss.value = 200 * MB
        assert memory.check() is not None  # a second episode
        with pytest.raises(NoCapacity):
            memory.admit("f")
        rss.value = 120 * MB
        assert memory.check() is None
        rss.value = 180 * MB
        assert memory.check() is not None  # a third, over until the next trim only
        rss.value = 120 * MB
        memory.admit("g")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "RSS 176000000 bytes" in warnings[0].getMessage()
    assert "RSS 200000000 bytes" in warnings[1].getMessage()
    assert memory.episodes == 3


class FullCollections:
    """Counts the interpreter's full collections (generation 2), whoever runs them."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            self.count += 1


@pytest.fixture
def full_collections() -> Iterator[FullCollections]:
    counter = FullCollections()
    gc.callbacks.append(counter)
    try:
        yield counter
    finally:
        gc.callbacks.remove(counter)


def test_a_runtime_over_its_line_collects_cycles_at_most_once_an_interval(
        full_collections: FullCollections) -> None:
    """Every check of a runtime over its line (each load's admission, each model shed)
    used to run a full collection: tens of milliseconds of its event loop each, several
    times a second at 5,000 small models. One collection per interval is what frees the
    models caught in cycles; the rest of the checks only trim and read RSS."""
    now = [0.0]
    collector = CycleCollector(min_interval_s=1.0, clock=lambda: now[0])
    rss, budget = Rss(50 * MB), [100 * MB]
    memory = MemoryGuard(lambda: budget[0], 0.25, lambda: budget[0], rss=rss,
                         device=lambda: DeviceMemory(), collect=collector)
    rss.value = 300 * MB  # over its line of 175 MB
    gc.disable()  # only the guard's own collections are counted
    try:
        for model in ("a", "b", "c", "d", "e"):
            with pytest.raises(NoCapacity):
                memory.admit(model)
            assert memory.reclaim() is not None  # a shedding step's check
        assert full_collections.count == 1
        now[0] = 1.0  # an interval later: the next check collects again
        assert memory.check() is not None
        assert full_collections.count == 2
    finally:
        gc.enable()


def test_a_runtime_whose_pooled_budget_is_zero_still_admits_its_next_load() -> None:
    """Between loads a runtime of the pooled budget may hold a budget of 0, and its RSS
    moves by a few MB anyway (buffers, sockets): the floor of the slack keeps it admitting
    the load the pool is about to give it room for, instead of refusing every one."""
    rss, budget = Rss(50 * MB), [0]
    memory = MemoryGuard(lambda: budget[0], 0.25, lambda: budget[0], rss=rss,
                         device=lambda: DeviceMemory(), margin_floor_bytes=32 * MB)
    rss.value = 54 * MB
    memory.admit("a")
    assert memory.limit_bytes() == 50 * MB + 32 * MB
    budget[0] = 400 * MB  # a large budget: the margin, not the floor, is the slack
    assert memory.limit_bytes() == 50 * MB + 400 * MB + 100 * MB
    rss.value = 83 * MB
    budget[0] = 0
    with pytest.raises(NoCapacity):  # past the floor: refused as before
        memory.admit("b")


def test_the_line_follows_the_budget_and_the_first_imports() -> None:
    rss, budget = Rss(50 * MB), [100 * MB]
    memory = guard(rss, budget)
    budget[0] = 40 * MB  # set_budgets moved it
    assert memory.limit_bytes() == 50 * MB + 50 * MB
    rss.value = 80 * MB  # a load of a 20 MB model that imported a framework of 10 MB
    memory.count_imports(rss_before=50 * MB, model_bytes=20 * MB)
    assert memory.overhead_bytes == 60 * MB and memory.startup_bytes == 50 * MB
    memory.count_imports(rss_before=80 * MB, model_bytes=30 * MB)  # grew less than its model
    assert memory.overhead_bytes == 60 * MB


def test_cuda_reserved_bytes_are_held_to_the_device_budget() -> None:
    device = [DeviceMemory()]  # nothing reserved at start-up
    memory = guard(Rss(10 * MB), [100 * MB], device)
    device[0] = DeviceMemory(reserved_bytes=120 * MB, allocated_bytes=90 * MB)
    assert memory.exceeded() is None  # within 100 MB x 1.25
    device[0] = DeviceMemory(reserved_bytes=130 * MB, allocated_bytes=90 * MB)
    over = memory.exceeded()
    assert over is not None and "CUDA reserved 130000000 bytes" in over
    assert memory.state().device == device[0]


def test_allocator_settings_are_applied_or_said_to_be_left_alone() -> None:
    assert "glibc defaults" in configure_allocator(0)
    assert configure_allocator(1 << 20) in ("mmap threshold fixed at 1048576 bytes",
                                            "not glibc: allocator left as it is")
    assert isinstance(trim(), bool) and rss_bytes() > 0


def loaded(cache: ModelCache, model_id: str, size: int, pinned: bool = False) -> None:
    cache.reserve(model_id, size, pinned=pinned)
    cache.commit(model_id, size, 1.0, "disk")


def test_a_lower_budget_evicts_what_no_longer_fits_but_never_a_pin() -> None:
    cache = ModelCache(100 * MB, 50 * MB, LruPolicy(), host_policy=LruPolicy())
    for name in ("old", "mid", "new"):
        loaded(cache, name, 30 * MB)
    loaded(cache, "pin", 10 * MB, pinned=True)
    actions = cache.set_budgets(45 * MB)
    assert [(a.action, a.model_id) for a in actions] == [
        ("demote", "old"), ("drop", "old"), ("demote", "mid")]  # host tier: room for one
    snap = cache.snapshot()
    assert set(snap.device) == {"new", "pin"} and set(snap.host) == {"mid"}
    actions = cache.set_budgets(5 * MB, host_budget_bytes=20 * MB)
    assert ("drop", "mid") in [(a.action, a.model_id) for a in actions]  # host shrank
    snap = cache.snapshot()
    assert set(snap.device) == {"pin"} and snap.host_used_bytes <= 20 * MB
    assert snap.device_budget_bytes == 5 * MB  # over it by the pin, which stays
    with pytest.raises(ValueError, match="budgets must be >= 0"):
        cache.set_budgets(-1)


def test_shedding_drops_host_residents_first_then_the_device_never_a_pin() -> None:
    cache = ModelCache(60 * MB, 30 * MB, LruPolicy(), host_policy=LruPolicy())
    loaded(cache, "pin", 10 * MB, pinned=True)
    for name in ("a", "b", "c"):
        loaded(cache, name, 25 * MB)  # "a" is demoted to the host tier by "c"
    assert cache.tier_of("a") == "host"
    shed = [cache.shed() for _ in range(4)]
    assert [(e.model_id, e.from_tier) for e in shed if e is not None] == [
        ("a", "host"), ("b", "device"), ("c", "device")]
    assert shed[3] is None and cache.tier_of("pin") == "device"


BLOB = '''
    import numpy as np
    from modelfleet import Model

    class Blob(Model):
        def load(self, ctx):
            self.w = np.fromfile(ctx.artifact("weights.bin"), dtype=np.uint8)

        async def preprocess(self, request):
            return 0

        def predict(self, batch):
            return [int(self.w[0]) for _ in batch]
'''


def blob_host(root: Path, extra: list[int]) -> ModelHost:
    """A host over 10 MB models whose "RSS" is 100 MB + its books + ``extra``."""
    for name in ("a", "b", "c", "d"):
        folder = write_package(root, name, f'name = "{name}"\nentrypoint = "handler:Blob"\n'
                               'memory_estimate_mb = 10\n', BLOB)
        np.full(10 * MB, 1, dtype=np.uint8).tofile(folder / "weights.bin")

    def guard_of(cache: ModelCache, collect: CycleCollector) -> MemoryGuard:
        return MemoryGuard(lambda: cache.device_budget_bytes, 0.25,
                           lambda: cache.device_budget_bytes,
                           rss=lambda: 100 * MB + cache.snapshot().device_used_bytes + extra[0],
                           collect=collect)

    settings = RuntimeSettings(device_budget_bytes=40 * MB, host_budget_bytes=0)
    return ModelHost(settings, LocalStore(root), memory=guard_of)


async def until_shed(host: ModelHost) -> None:
    await eventually(lambda: host.memory is not None and not host.memory.over, 2,
                     what="the host shedding back under its line", every_s=0.01)


async def test_a_host_over_its_line_sheds_back_under_before_it_loads(tmp_path: Path) -> None:
    extra = [0]
    host = blob_host(tmp_path, extra)
    for name in ("a", "b", "c"):
        await host.ensure(name, "1")
    extra[0] = 35 * MB  # a handler grew outside the books: 100 + 30 + 35 > 100 + 50
    await host.ensure("d", "1")  # waits for the shedding instead of being refused
    stats = host.stats()
    assert len(stats.device) == 2 and "d" in stats.device  # two shed, then d loaded
    assert stats.loads_refused == 0
    await host.close()


async def test_a_load_is_refused_when_shedding_cannot_bring_rss_under_in_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    extra = [0]
    host = blob_host(tmp_path, extra)
    for name in ("a", "b", "c"):
        await host.ensure(name, "1")
    release = asyncio.Event()
    carry_out = host._carry_out

    async def slow_carry_out(evictions: list) -> None:  # an eviction that takes its time
        await release.wait()
        await carry_out(evictions)

    monkeypatch.setattr(host, "_carry_out", slow_carry_out)
    monkeypatch.setattr("modelfleet.runtime.shedding.SHED_WAIT_S", 0.05)
    extra[0] = 35 * MB
    with pytest.raises(NoCapacity, match=r"over its memory budget.*'d'"):
        await host.ensure("d", "1")
    assert host.stats().loads_refused == 1
    release.set()
    monkeypatch.setattr(host, "_carry_out", carry_out)
    await until_shed(host)  # the shedding went on and brought it back under
    await host.ensure("d", "1")  # admitted again
    await host.close()


async def test_memory_outside_the_models_keeps_loads_refused_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    extra = [0]
    host = blob_host(tmp_path, extra)
    await host.ensure("a", "1")
    extra[0] = 80 * MB  # more than the whole budget and its margin: shedding cannot help
    with caplog.at_level(logging.WARNING, logger="modelfleet.runtime"):
        for _ in range(3):
            with pytest.raises(NoCapacity):
                await host.ensure("b", "1")
            await asyncio.sleep(0.05)  # the shedding task runs and gives up
            host.stats()  # the re-score's ask: watches memory too
    assert host.stats().device == ()  # everything evictable was shed
    messages = [r.getMessage() for r in caplog.records]
    assert sum("nothing left to shed" in m for m in messages) == 1
    assert sum("refusing loads" in m for m in messages) == 1  # one episode, one warning
    extra[0] = 0
    await host.ensure("b", "1")  # it fell: admitted, the episode over
    assert host.memory is not None and not host.memory.over
    await host.close()


async def test_an_in_process_runtime_takes_new_budgets_and_reports_no_rss_of_its_own(
        tmp_path: Path) -> None:
    blob_host(tmp_path / "repo", [0])  # writes the packages
    service = RuntimeService(Settings(repo=str(tmp_path / "repo"),
                                      state_dir=str(tmp_path / "state"),
                                      runtime={"device_budget_bytes": 40 * MB,
                                               "host_budget_bytes": 0}))
    runtime = InProcessRuntime(service, "in-process")
    for name in ("a", "b", "c"):
        await runtime.load(name, "1")
    await runtime.set_budgets(15 * MB)
    stats = await runtime.stats()
    assert stats.device_budget_bytes == 15 * MB and len(stats.device) == 1
    assert stats.rss_bytes == 0  # the coordinator's RSS is not this runtime's to report
    await service.close()


def test_rss_is_read_for_this_process_and_follows_what_it_touches() -> None:
    import psutil

    before = rss_bytes()
    assert abs(before - psutil.Process().memory_info().rss) < 8 * MB
    block = np.ones(64 * MB, dtype=np.uint8)  # touched: resident
    assert rss_bytes() - before > 48 * MB
    del block
