"""ModelHost: the runtime's loading discipline over the real ModelCache, with real packages."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import threading
import types
import weakref
from pathlib import Path

import numpy as np
import pytest

from modelfleet.errors import ModelLoadFailed, ModelTooLarge
from modelfleet.model import Request
from modelfleet.model.pipeline import handle_request
from modelfleet.repository import LocalStore
from modelfleet.runtime.device import package_bytes
from modelfleet.runtime.host import ModelHost
from modelfleet.settings import MiB, RuntimeSettings
from tests.waiting import eventually

HANDLER = '''
import threading, time
import numpy as np
from modelfleet import Model

import sys
LOADS = []
PROBE = sys.modules.get("mf_load_probe")  # set by a test that counts concurrent loads

class Weights(Model):
    """Weights live on the "device" or the "host"; moving copies them, like module.to()."""

    def load(self, ctx):
        LOADS.append(ctx.model_id)
        if PROBE is not None:
            PROBE.enter()
        time.sleep({load_s})
        if PROBE is not None:
            PROBE.leave()
        self.w = np.fromfile(ctx.artifact("weights.bin"), dtype=np.float64)
        self.where = "device"

    def to_host(self):
        self.w = self.w.copy(); self.where = "host"

    def unload(self):
        time.sleep({unload_s})

    def to_device(self):
        time.sleep({move_s})
        self.w = self.w.copy(); self.where = "device"

    async def preprocess(self, request):
        return np.asarray(request.json()["x"], dtype=float)

    def predict(self, batch):
        assert self.where == "device", "predict on a demoted model"
        return [(x @ self.w[:256].reshape(64, 4)).tolist() for x in batch]
'''


def package(root: Path, name: str, estimate_mb: float, load_s: float = 0.0,
            pinned: bool = False, broken: bool = False, move_s: float = 0.0,
            unload_s: float = 0.0) -> None:
    folder = root / name / "1"
    folder.mkdir(parents=True)
    (folder / "model.toml").write_text(textwrap.dedent(f'''
        name = "{name}"
        entrypoint = "handler:Weights"
        memory_estimate_mb = {estimate_mb}
        [fanout]
        pinned = {"true" if pinned else "false"}
    '''))
    source = HANDLER.replace("{load_s}", str(load_s)).replace("{move_s}", str(move_s)) \
        .replace("{unload_s}", str(unload_s))
    if estimate_mb <= 16:  # real artifact bytes, so the measured size matches the estimate
        rng = np.random.default_rng(len(name))
        rng.standard_normal(int(estimate_mb * MiB / 8)).tofile(folder / "weights.bin")
    if broken:
        source = source.replace("LOADS.append",
                                "raise RuntimeError('weights corrupt'); LOADS.append")
    (folder / "handler.py").write_text(source)


def host_for(root: Path, device_mb: float, host_mb: float) -> ModelHost:
    settings = RuntimeSettings(device_budget_bytes=int(device_mb * MiB),
                               host_budget_bytes=int(host_mb * MiB), max_concurrent_loads=2)
    return ModelHost(settings, LocalStore(root))


async def infer(host: ModelHost, model_id: str, x: list[float]) -> list[float]:
    loaded, _ = await host.ensure(model_id, "1")
    request = Request(f'{{"x": {x}}}'.encode(), "application/json")
    result, _ = await handle_request(loaded.handler, loaded.batcher, request)
    return list(result)


async def test_concurrent_requests_for_a_cold_model_cause_one_load(tmp_path: Path) -> None:
    package(tmp_path, "slow", 1, load_s=0.3)
    host = host_for(tmp_path, 64, 0)
    results = await asyncio.gather(*(host.ensure("slow", "1") for _ in range(10)))
    assert len({id(loaded) for loaded, _ in results}) == 1
    stats = host.stats()
    assert [load.model_id for load in stats.loads] == ["slow"]  # one load, ten waiters


async def test_demote_then_promote_keeps_outputs_identical(tmp_path: Path) -> None:
    for name in ("a", "b"):
        package(tmp_path, name, 3)
    # Room on the device for one model at a time, on the host for both.
    host = host_for(tmp_path, 5, 10)
    x = [0.5] * 64
    before = await infer(host, "a", x)
    await infer(host, "b", x)  # evicts a from the device: demoted, not dropped
    assert host.tier_of("a", "1") == "host"
    after = await infer(host, "a", x)  # promoted back: a copy, not a reload
    assert after == before
    sources = [load.source for load in host.stats().loads]
    assert sources == ["repository", "repository", "host"]


async def test_without_host_room_eviction_drops_and_reloads(tmp_path: Path) -> None:
    for name in ("a", "b"):
        package(tmp_path, name, 3)
    host = host_for(tmp_path, 5, 0)
    await infer(host, "a", [1.0] * 64)
    await infer(host, "b", [1.0] * 64)
    assert host.tier_of("a", "1") is None
    await infer(host, "a", [1.0] * 64)
    assert [load.source for load in host.stats().loads] == ["repository"] * 3


async def test_pinned_model_survives_pressure(tmp_path: Path) -> None:
    package(tmp_path, "core", 2, pinned=True)
    for name in ("x", "y", "z"):
        package(tmp_path, name, 2)
    host = host_for(tmp_path, 4.5, 0)
    await host.ensure("core", "1", pinned=True)
    for name in ("x", "y", "z", "x"):
        await infer(host, name, [1.0] * 64)
    assert host.tier_of("core", "1") == "device"


async def test_a_model_larger_than_the_budget_fails_at_once(tmp_path: Path) -> None:
    package(tmp_path, "huge", 100)
    host = host_for(tmp_path, 10, 10)
    with pytest.raises(ModelTooLarge, match="huge"):
        await host.ensure("huge", "1")
    with pytest.raises(ModelTooLarge):  # and again, without a load attempt in between
        await host.ensure("huge", "1")
    assert host.stats().loads == ()


async def test_a_failed_load_leaves_nothing_and_is_retried(tmp_path: Path) -> None:
    package(tmp_path, "bad", 1, broken=True)
    host = host_for(tmp_path, 10, 0)
    for _ in range(2):
        with pytest.raises(ModelLoadFailed, match="weights corrupt"):
            await host.ensure("bad", "1")
    stats = host.stats()
    assert stats.load_failures == 2
    assert stats.device_used_bytes == 0 and host.loading == []


class LoadProbe(types.ModuleType):
    """Counts loads under way across every handler module (each package has its own)."""

    def __init__(self) -> None:
        super().__init__("mf_load_probe")
        self.now = self.peak = 0
        self.lock = threading.Lock()

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


async def test_at_most_k_loads_at_once_per_runtime(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    probe = LoadProbe()
    monkeypatch.setitem(sys.modules, "mf_load_probe", probe)
    names = [f"m{i}" for i in range(5)]
    for name in names:
        package(tmp_path, name, 1, load_s=0.2)
    host = host_for(tmp_path, 64, 0)  # max_concurrent_loads=2
    await asyncio.gather(*(host.ensure(name, "1") for name in names))
    assert probe.peak == 2  # two at a time: the limit, and it was used
    assert sorted(load.model_id for load in host.stats().loads) == names


def versioned(root: Path, name: str, versions: dict[str, bool]) -> None:
    """Versions of one model; ``True`` marks a version whose load fails."""
    for version, broken in versions.items():
        folder = root / name / version
        folder.mkdir(parents=True)
        (folder / "model.toml").write_text(
            f'name = "{name}"\nversion = "{version}"\nentrypoint = "handler:V"\n')
        (folder / "handler.py").write_text(textwrap.dedent(f"""
            from modelfleet import Model

            class V(Model):
                def load(self, ctx):
                    if {broken}:
                        raise RuntimeError("version {version} is broken")

                def predict(self, batch):
                    return ["{version}" for _ in batch]
        """))


async def test_versions_are_resident_side_by_side(tmp_path: Path) -> None:
    versioned(tmp_path, "ver", {"1": False, "2": False})
    host = host_for(tmp_path, 256, 0)  # room for both (each estimated at 64 MiB)
    for _ in range(5):
        for version in ("1", "2"):
            loaded, _ = await host.ensure("ver", version)
            assert (await loaded.batcher.submit(None))[0] == version
    assert [load.model_id for load in host.stats().loads] == ["ver", "ver"]  # one load each


async def test_a_broken_version_does_not_fail_the_others(tmp_path: Path) -> None:
    versioned(tmp_path, "ver", {"1": False, "2": True})
    host = host_for(tmp_path, 256, 0)
    await host.ensure("ver", "1")
    results = await asyncio.gather(host.ensure("ver", "2"), host.ensure("ver", "1"),
                                   return_exceptions=True)
    assert isinstance(results[0], ModelLoadFailed) and "version 2 is broken" in str(results[0])
    assert not isinstance(results[1], BaseException)
    assert host.tier_of("ver", "1") == "device"


async def test_a_promotion_waits_for_a_demotion_under_way(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        package(tmp_path, name, 3)
    settings = RuntimeSettings(device_budget_bytes=7 * MiB, host_budget_bytes=20 * MiB,
                               eviction_policy="lru")
    host = ModelHost(settings, LocalStore(tmp_path))
    a, _ = await host.ensure("a", "1")
    await host.ensure("b", "1")
    await host.ensure("b", "1")  # a is now the least recently used
    with a.using():  # a request still runs on a
        load_c = asyncio.create_task(host.ensure("c", "1"))  # demotes a: waits for it
        await asyncio.sleep(0.05)
        assert host.tier_of("a", "1") == "host" and a.handler.where == "device"
        want_a = asyncio.create_task(host.ensure("a", "1"))  # promotion: waits for the move
        await asyncio.sleep(0.05)
        assert not want_a.done()
    await load_c
    promoted, _ = await want_a
    assert promoted is a
    assert host.tier_of("a", "1") == "device" and a.handler.where == "device"


async def test_a_load_is_sized_by_what_its_model_holds_not_by_the_process(
        tmp_path: Path) -> None:
    """Another allocation while the model loads (a second load, requests) is not its size."""
    package(tmp_path, "small", 1, load_s=0.3)
    host = host_for(tmp_path, 64, 0)
    hog: list[np.ndarray] = []
    allocating = threading.Thread(target=lambda: hog.append(np.ones(80 * MiB // 8)))
    load = asyncio.create_task(host.ensure("small", "1"))
    await asyncio.sleep(0.05)  # inside the model's load
    allocating.start()
    await load
    allocating.join()
    [measured] = host.stats().loads
    size = measured.size_bytes
    assert hog and MiB <= size < 2 * MiB, size  # its 1 MiB of weights (+ the small files)


async def test_a_model_may_declare_what_it_holds(tmp_path: Path) -> None:
    folder = tmp_path / "native" / "1"
    folder.mkdir(parents=True)
    (folder / "model.toml").write_text('name = "native"\nentrypoint = "handler:N"\n')
    (folder / "handler.py").write_text(textwrap.dedent("""
        from modelfleet import Model

        class N(Model):  # memory held by a C++ session that no Python object shows
            def memory_bytes(self):
                return 3 * 1024 * 1024

            def predict(self, batch):
                return batch
    """))
    host = host_for(tmp_path, 64, 0)
    await host.ensure("native", "1")
    [measured] = host.stats().loads
    size = measured.size_bytes
    assert size == 3 * MiB


async def test_models_that_fit_wait_for_loads_in_flight_rather_than_being_refused(
        tmp_path: Path) -> None:
    """Room for one model at a time: the second waits for the first load, then evicts it."""
    for name in ("a", "b"):
        package(tmp_path, name, 3, load_s=0.2)
    host = host_for(tmp_path, 5, 0)  # max_concurrent_loads=2: both start at once
    (a, _), (b, _) = await asyncio.gather(host.ensure("a", "1"), host.ensure("b", "1"))
    assert a.manifest.name == "a" and b.manifest.name == "b"
    tiers = {host.tier_of("a", "1"), host.tier_of("b", "1")}
    assert tiers == {"device", None}  # the one loaded second evicted the first
    assert sorted(load.model_id for load in host.stats().loads) == ["a", "b"]


async def test_evicted_models_are_freed_without_stopping_the_loop_for_a_collection(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reference counting frees an evicted model; the full gc (for cycles) runs rarely."""
    import gc

    collections: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(1) or 0)
    for name in ("a", "b", "c"):
        package(tmp_path, name, 3)
    host = host_for(tmp_path, 5, 0)  # room for one at a time: each load evicts the last
    for name in ("a", "b", "c", "a"):
        loaded, _ = await host.ensure(name, "1")
        weights = weakref.ref(loaded.handler.w)
        del loaded
    await host.ensure("b", "1")  # evicts the last a
    await asyncio.sleep(0.05)  # the thread that ran its unload() lets go of it
    assert weights() is None  # freed: no collection needed
    assert collections == [1]  # four evictions within a second, one collection


async def test_concurrent_loads_of_models_that_fit_are_never_refused(tmp_path: Path) -> None:
    """A burst over a catalog far bigger than the budget: every model fits alone, so
    every request gets its model, however the loads and evictions interleave."""
    import random

    from modelfleet.errors import ModelfleetError

    sizes = {f"m{i}": random.Random(i).choice([1, 2, 3, 4, 6]) for i in range(12)}
    for name, mb in sizes.items():
        package(tmp_path, name, mb, load_s=0.01)
    host = host_for(tmp_path, 10, 0)
    rng = random.Random(1)
    refused: list[str] = []

    async def one() -> None:
        try:
            await host.ensure(rng.choice(list(sizes)), "1")
        except ModelfleetError as exc:
            refused.append(str(exc))

    for _ in range(40):
        await asyncio.gather(*(one() for _ in range(8)))
    assert refused == []
    assert host.cache.snapshot().device_used_bytes <= 10 * MiB


def books_match(host: ModelHost) -> None:
    """What the cache says is resident is exactly what the host holds loaded, and the
    other way round: the pair of facts a later request for either relies on."""
    snap = host.cache.snapshot()
    resident = set(snap.device) | set(snap.host)
    # A cold load holds its handler from the end of its load until its commit.
    assert resident <= set(host._models) <= resident | set(snap.reserved), (snap, host._models)


async def test_evicting_a_model_during_its_promotion_leaves_it_loadable(tmp_path: Path) -> None:
    """The coordinator takes a model off (an operator's unload, a replica no longer needed)
    while a request promotes it from host memory: the model is gone afterwards, and the
    next request loads it again instead of failing with 'no load ... is in flight'."""
    package(tmp_path, "a", 3, move_s=0.3)
    package(tmp_path, "b", 3)
    host = host_for(tmp_path, 5, 10)
    x = [0.5] * 64
    before = await infer(host, "a", x)
    await infer(host, "b", x)  # a is demoted to host memory
    assert host.tier_of("a", "1") == "host"
    promoting = asyncio.create_task(host.ensure("a", "1"))
    await eventually(lambda: host.cache.reservation("a@1") is not None, 5,
                     what="a's promotion started", every_s=0.01)
    assert await host.evict("a") is True
    await asyncio.gather(promoting, return_exceptions=True)
    assert host.tier_of("a", "1") is None and host.loaded("a", "1") is None
    books_match(host)
    assert await infer(host, "a", x) == before  # loaded again, from the repository
    assert host.tier_of("a", "1") == "device"
    books_match(host)


async def test_a_promotion_whose_host_copy_is_dropped_while_it_waits_loads_afresh(
        tmp_path: Path) -> None:
    """A promotion waiting for room (another load holds it) loses its host copy meanwhile:
    the worker moved the host budget away (``set_budgets``; memory shedding drops host
    copies the same way). The request is served by a fresh load, not by the dropped
    handler, and no later request fails with 'no load ... is in flight'."""
    package(tmp_path, "a", 3)
    package(tmp_path, "b", 3)
    package(tmp_path, "c", 3, load_s=0.5)
    host = host_for(tmp_path, 5, 10)
    x = [0.5] * 64
    before = await infer(host, "a", x)
    await infer(host, "b", x)  # a demoted
    loading_c = asyncio.create_task(host.ensure("c", "1"))  # demotes b, holds 3 of 5 MiB
    await eventually(lambda: host.cache.reservation("c@1") is not None, 5,
                     what="c's load started", every_s=0.01)
    promoting = asyncio.create_task(infer(host, "a", x))  # no room: waits for c's load
    await asyncio.sleep(0.05)
    assert not promoting.done() and host.cache.reservation("a@1") is None
    await host.set_budgets(5 * MiB, 0)  # the host copies of a and b are dropped
    assert host.tier_of("a", "1") is None
    assert await promoting == before
    assert host.tier_of("a", "1") == "device"
    books_match(host)
    await loading_c
    books_match(host)
    sources = [load.source for load in host.stats().loads]
    assert sources.count("host") == 0  # a came back from the repository, not from nothing
    assert await infer(host, "a", x) == before
    books_match(host)


def test_a_packages_size_leaves_out_the_bytecode_its_import_writes(tmp_path: Path) -> None:
    """Importing a handler writes ``__pycache__`` beside it (unless the environment says
    not to) during the load being measured: that is not the model's memory, and counting
    it made a first load measure more than it reserved."""
    package(tmp_path, "a", 1)
    folder = tmp_path / "a" / "1"
    before = package_bytes(folder)
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "handler.cpython-311.pyc").write_bytes(b"\0" * 4096)
    assert package_bytes(folder) == before


class LoadGate(types.ModuleType):
    """Holds every load in its handler's ``load`` until opened."""

    def __init__(self) -> None:
        super().__init__("mf_load_probe")
        self.entered, self.opened = threading.Event(), threading.Event()

    def enter(self) -> None:
        self.entered.set()
        self.opened.wait(30)

    def leave(self) -> None:
        pass


async def test_a_budget_moved_away_during_a_load_does_not_fail_its_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's pool lowers this runtime's budget (``set_budgets``) below a pinned
    model and a load in flight: the load lands and its request is served; the next load
    evicts down to the new budget. (The load is held until the budget has moved: with a
    0.5 s load instead, a busy machine once moved it only after the load had landed.)"""
    package(tmp_path, "keep", 3, pinned=True)
    package(tmp_path, "a", 3)
    package(tmp_path, "b", 1)
    host = host_for(tmp_path, 7, 0)
    x = [0.5] * 64
    await infer(host, "keep", x)
    gate = LoadGate()
    monkeypatch.setitem(sys.modules, "mf_load_probe", gate)  # read by a's handler module
    loading = asyncio.create_task(infer(host, "a", x))
    assert await asyncio.to_thread(gate.entered.wait, 30), "a's load never started"
    assert host.cache.reservation("a@1") is not None
    await host.set_budgets(5 * MiB, 0)
    gate.opened.set()
    monkeypatch.delitem(sys.modules, "mf_load_probe")
    assert len(await loading) == 4
    assert host.tier_of("a", "1") == "device"
    books_match(host)
    await infer(host, "b", x)  # evicts a: back within the budget
    assert host.tier_of("a", "1") is None and host.tier_of("keep", "1") == "device"
    snap = host.cache.snapshot()
    assert snap.device_used_bytes <= 5 * MiB
    books_match(host)


async def test_a_model_reloaded_while_its_eviction_is_carried_out_stays_loaded(
        tmp_path: Path) -> None:
    """A budget cut evicts two models; while the first one's unload runs, the budget
    comes back (the worker's pool moves budgets between runtimes) and the second is
    requested and loaded afresh. The eviction that was decided before must not then
    take the fresh copy: that left the cache holding a model the host had dropped, and
    its next request failed with "no load ... is in flight; call reserve first" (one
    500 in the 5,000-model bench)."""
    package(tmp_path, "a", 1, unload_s=0.5)
    package(tmp_path, "b", 1, unload_s=0.5)
    host = host_for(tmp_path, 4, 0)
    x = [0.5] * 64
    await infer(host, "a", x)
    await infer(host, "b", x)
    cut = asyncio.create_task(host.set_budgets(0, 0))
    await eventually(lambda: host.tier_of("a", "1") is None and host.tier_of("b", "1") is None,
                     5, what="both evicted by the cache", every_s=0.01)
    await host.set_budgets(4 * MiB, 0)
    assert not cut.done()  # the first unload is still running
    for model in ("a", "b"):
        assert len(await infer(host, model, x)) == 4
    await cut
    books_match(host)
    for model in ("a", "b"):
        assert host.tier_of(model, "1") == "device"
        assert len(await infer(host, model, x)) == 4
