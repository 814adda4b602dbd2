"""The worker's control agent in one process: the embedded broker, in-process runtimes.

Pins follow versions (the leak: a pinned model's new version was never preloaded
while the old one was resident, and the old one stayed pinned for good); an unload
drops the model and refuses its queued tasks; a failed load is answered with why and
announced, so that the version never takes the route. The test plays the gateway:
it publishes control commands and reads results and announcements on the event
channel, as gateway/control_plane.py does.
"""

from __future__ import annotations

import asyncio
import contextlib
import textwrap
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from modelfleet.broker.embedded import MemoryBroker
from modelfleet.control import Command, ControlState, Revision, orders_announcement
from modelfleet.control.commands import Action
from modelfleet.errors import ModelLoadFailed, NoCapacity
from modelfleet.ipc.protocol import RuntimeStats
from modelfleet.launch import open_repository
from modelfleet.messages import PayloadRef, Reply, Task, now_ms
from modelfleet.repository import Catalog, ModelStore
from modelfleet.repository.refresher import CatalogRefresher
from modelfleet.settings import Settings
from modelfleet.worker.coordinator import Coordinator
from modelfleet.worker.supervisor import RuntimeSupervisor
from tests.fleet import in_process_fleet
from tests.waiting import eventually

HANDLER = '''\
from modelfleet import Model


class Echo(Model):
    def load(self, ctx):
        if {fail}:
            raise RuntimeError("version {version} does not load")
        self.version = ctx.version

    def predict(self, batch):
        return [{{"version": self.version}} for _ in batch]
'''


def add_version(repo: Path, name: str, version: str, pinned: bool = False,
                fail: bool = False) -> None:
    folder = repo / name / version
    folder.mkdir(parents=True)
    (folder / "model.toml").write_text(textwrap.dedent(f"""\
        name = "{name}"
        version = "{version}"
        entrypoint = "handler:Echo"
        accepts = ["application/json"]
        [fanout]
        pinned = {"true" if pinned else "false"}
        """))
    (folder / "handler.py").write_text(HANDLER.format(fail=fail, version=version))


@dataclass
class Worker:
    broker: MemoryBroker
    coordinator: Coordinator
    supervisor: RuntimeSupervisor
    catalog: Catalog
    store: ModelStore
    repo: Path
    events: list[dict[str, Any]]
    replies: asyncio.Queue[Reply]
    inbox: str

    def refresh(self) -> None:
        """What the repository refresh does: the catalog swapped for a fresh read."""
        self.catalog.replace_with(Catalog.from_store(self.store))

    async def stats(self) -> RuntimeStats:
        runtime = self.supervisor.shared[0].runtime
        assert runtime is not None
        return await runtime.stats()

    async def command(self, action: Action, model: str, version: str = "",
                      workers: tuple[str, ...] = ("w-test",)) -> dict[str, Any]:
        """Publish a command as a gateway does; returns this worker's result event."""
        command = Command(uuid.uuid4().hex, model, action, Revision(time.time(), "gw-test"),
                          version, workers)
        await self.broker.publish_event(command.event())
        return await eventually(lambda: next(
            (e for e in self.events if e.get("kind") == "control_result"
             and e["command_id"] == command.command_id), None))

    def announced(self) -> dict[str, Any] | None:
        mine = [e for e in self.events if e.get("kind") == "worker_control"]
        return mine[-1] if mine else None


@pytest.fixture
async def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    return root


@pytest.fixture
async def worker(tmp_path: Path, repo: Path, request: pytest.FixtureRequest
                 ) -> AsyncIterator[Worker]:
    settings = Settings(repo=str(repo), state_dir=tmp_path / "state", broker={"url": "memory"},
                        worker={"worker_id": "w-test", "rescore_interval_s": 0.1,
                                "state_interval_s": 0.2, "standby_keep_s": 0},
                        runtime={"ping_interval_s": 0.1},
                        control={"announce_interval_s": 0.1, "drain_s": 0.5})
    store, catalog = open_repository(settings)
    # indirect=True with True: the worker scans its repository when asked, as launch wires it
    refresher = CatalogRefresher(store, catalog, 3600) if getattr(request, "param", False) \
        else None
    async with in_process_fleet(settings, store=store, catalog=catalog, hear_events=True,
                                refresh_catalog=None if refresher is None
                                else refresher.refresh_now) as fleet:
        refreshing = None if refresher is None else asyncio.create_task(refresher.run())
        try:
            yield Worker(fleet.broker, fleet.coordinator, fleet.supervisor, catalog, store,
                         repo, fleet.events, fleet.replies, fleet.inbox_address)
        finally:
            if refreshing is not None:
                refreshing.cancel()
                await asyncio.gather(refreshing, return_exceptions=True)


@pytest.mark.parametrize("worker", [True], indirect=True)
async def test_a_load_of_a_version_not_yet_scanned_scans_first(repo: Path,
                                                               worker: Worker) -> None:
    """A load with files reaches a worker with the publish's announcement: its order may
    come before the scan that finds the version (the repository refresh is an hour off)."""
    add_version(repo, "m", "1")
    assert "m" not in worker.catalog
    loaded = await worker.command("load", "m", "1")
    assert loaded["ok"], loaded
    add_version(repo, "m", "2")
    loaded = await worker.command("load", "m", "2")
    assert loaded["ok"], loaded
    assert [m.version for m in worker.catalog.get("m").versions] == ["1", "2"]


async def test_without_a_scan_a_load_of_an_unknown_model_says_so(worker: Worker) -> None:
    refused = await worker.command("load", "nowhere", "1")
    assert not refused["ok"]
    assert "has no model 'nowhere'" in refused["message"]


@pytest.fixture
def pinned_repo(repo: Path) -> Path:
    add_version(repo, "p", "1", pinned=True)
    return repo


async def test_a_pinned_models_new_version_is_preloaded_and_the_old_pin_released(
        pinned_repo: Path, worker: Worker) -> None:
    await eventually(lambda: worker_stats_has(worker, "pinned_versions", ("p@1",)))
    add_version(worker.repo, "p", "2", pinned=True)
    worker.refresh()
    # Preloaded, pinned, while version 1 is still resident (the leak kept it out)...
    both = await eventually(lambda: worker_stats_has(worker, "resident_versions", ("p@1", "p@2")))
    assert "p@2" in both.pinned_versions
    # ...then version 1 is unpinned and, after its drain, released: one pin, not two.
    final = await eventually(lambda: worker_stats_has(worker, "resident_versions", ("p@2",)))
    assert final.pinned_versions == ("p@2",)


async def worker_stats_has(worker: Worker, field: str, keys: tuple[str, ...]
                           ) -> RuntimeStats | None:
    if worker.supervisor.shared[0].runtime is None:
        return None
    stats = await worker.stats()
    return stats if getattr(stats, field) == keys else None


async def test_unload_drops_the_model_and_refuses_what_was_queued(repo: Path,
                                                                 worker: Worker) -> None:
    add_version(repo, "m", "1")
    worker.refresh()
    loaded = await worker.command("load", "m", "1")
    assert loaded["ok"], loaded
    assert "m@1" in (await worker.stats()).resident_versions
    unloaded = await worker.command("unload", "m")
    assert unloaded["ok"]
    assert (await worker.stats()).resident_versions == ()
    task = Task(uuid.uuid4().hex, "m", "1", now_ms() + 10_000, worker.inbox,
                PayloadRef("inline", data=b"{}", size_bytes=2), "application/json", now_ms())
    await worker.broker.publish_task(task)
    await worker.broker.publish_event({"kind": "demand", "model_id": "m", "at": time.time()})
    reply = await asyncio.wait_for(worker.replies.get(), 20)
    assert reply.status == "error" and reply.error_code == "model_unavailable"
    await eventually(lambda: (a := worker.announced()) is not None
                     and a["control"]["m"]["loaded"][0] is False)
    assert (await worker.command("load", "m", "1"))["ok"]
    assert "m@1" in (await worker.stats()).resident_versions


async def test_orders_a_gateway_tells_are_obeyed_by_a_worker_that_never_heard_them(
        repo: Path, worker: Worker) -> None:
    """A worker started after the orders were given (every process restarted; the
    gateway read them from the database) learns them from ``control_orders``."""
    add_version(repo, "m", "1")
    add_version(repo, "p", "1")
    worker.refresh()
    assert (await worker.command("load", "m", "1"))["ok"]
    told = ControlState()
    told.set("m", "loaded", False, Revision(time.time(), "gw-kept"))
    told.set("p", "pinned", True, Revision(time.time(), "gw-kept"))
    await worker.broker.publish_event(orders_announcement("gw-kept", told))
    await eventually(lambda: _resident(worker, "p@1", "m@1"))
    assert worker.coordinator.control.refusal("m") is not None
    assert worker.coordinator.control.pinned("p")
    await eventually(lambda: (a := worker.announced()) is not None
                     and a["control"].get("m", {}).get("loaded", [True])[0] is False)


async def _resident(worker: Worker, present: str, absent: str) -> bool:
    resident = (await worker.stats()).resident_versions
    return present in resident and absent not in resident


async def test_a_failed_load_is_answered_with_why_and_announced(repo: Path,
                                                                worker: Worker) -> None:
    add_version(repo, "m", "1")
    add_version(repo, "m", "2", fail=True)
    worker.refresh()
    result = await worker.command("load", "m", "2")
    assert not result["ok"] and "version 2 does not load" in result["message"]
    assert result["code"] == "model_load_failed"
    announced = await eventually(lambda: (a := worker.announced()) and a["failed"] and a)
    assert announced["failed"] == {"m": ["2"]}
    assert worker.coordinator.control.route("m") == "1"


async def test_commands_for_other_workers_are_recorded_not_carried_out(
        repo: Path, worker: Worker) -> None:
    add_version(repo, "m", "1")
    worker.refresh()
    command = Command(uuid.uuid4().hex, "m", "pin", Revision(time.time(), "gw"), "",
                      ("w-other",))
    await worker.broker.publish_event(command.event())
    await eventually(lambda: worker.coordinator.control.pinned("m"))
    await asyncio.sleep(0.3)
    assert not [e for e in worker.events if e.get("kind") == "control_result"]


async def test_an_operators_pin_lifts_the_fan_out_cap_like_a_manifest_pin(
        tmp_path: Path, repo: Path) -> None:
    add_version(repo, "p", "1")
    manifest = repo / "p" / "1" / "model.toml"
    manifest.write_text(manifest.read_text() + "max_workers = 1\n")  # under [fanout]
    broker = MemoryBroker(Settings().broker)
    await broker.connect()
    try:
        async with contextlib.AsyncExitStack() as stack:
            fleets = []
            for name in ("w1", "w2"):
                settings = Settings(repo=str(repo), state_dir=tmp_path / name,
                                    broker={"url": "memory"},
                                    worker={"worker_id": name, "rescore_interval_s": 0.1,
                                            "state_interval_s": 0.2, "standby_keep_s": 0},
                                    control={"announce_interval_s": 0.1})
                fleets.append(await stack.enter_async_context(
                    in_process_fleet(settings, broker=broker)))
            pin = Command(uuid.uuid4().hex, "p", "pin", Revision(time.time(), "gw"), "",
                          ("w1", "w2"))
            await broker.publish_event(pin.event())
            for _ in range(3):  # the queue exists once a gateway publishes to it
                await broker.publish_task(Task(
                    uuid.uuid4().hex, "p", "1", now_ms() + 10_000, fleets[0].inbox_address,
                    PayloadRef("inline", data=b"{}", size_bytes=2), "application/json",
                    now_ms()))
                await broker.publish_event({"kind": "demand", "model_id": "p",
                                            "at": time.time()})
            await eventually(lambda: all("p" in f.coordinator.state()["subscriptions"]
                                         for f in fleets))
    finally:
        await broker.close()


async def test_only_a_broken_version_is_announced_failed(repo: Path, worker: Worker) -> None:
    add_version(repo, "m", "1")
    add_version(repo, "m", "2")
    worker.refresh()
    agent = worker.coordinator.control
    agent.load_failed("m", "2", NoCapacity("no room on the device now"))
    assert agent.failed_versions() == {}  # transient: tried again in a while
    agent.load_failed("m", "2", ModelLoadFailed("version 2 is broken"))
    assert agent.failed_versions() == {"m": frozenset({"2"})}
    assert agent.route("m") == "1"
    agent.loaded_ok("m", "2")  # an operator's load got it in after all
    assert agent.failed_versions() == {} and agent.route("m") == "2"


def _warms() -> float:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value("modelfleet_worker_version_changes_total",
                                     {"action": "warm"}) or 0.0


async def test_a_new_version_is_warmed_once_though_residency_shows_it_late(
        repo: Path, worker: Worker) -> None:
    """Residency learns of a load a state read after it: meanwhile the version was neither
    loading nor resident, and the plan warmed it again on every tick (~50 times in half a
    second). Once warmed, it counts as loading until residency shows it."""
    add_version(repo, "m", "1")
    worker.refresh()
    loaded = await worker.command("load", "m", "1")
    assert loaded["ok"], loaded
    before = _warms()
    add_version(repo, "m", "2")
    worker.refresh()
    await eventually(lambda: worker_stats_has(worker, "resident_versions", ("m@1", "m@2")))
    await asyncio.sleep(1.0)  # ten control ticks
    assert _warms() - before == 1
