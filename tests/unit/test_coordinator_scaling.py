"""A re-score's cost follows the candidates, not the catalog (issue 23).

Nothing here is timed: an instrumented catalog counts the entries a re-score walks
and looks up, an instrumented broker counts the queues it asks to count, and one
re-score of the same candidate set must touch exactly as much with 100 models in the
catalog as with 10,000 (and walk the catalog not at all). The coordinator is the real
one, over the embedded broker and in-process runtimes; the models it serves are real
packages, the rest of the catalog is entries that are never asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from modelfleet.broker import QueueStats
from modelfleet.broker.embedded import MemoryBroker
from modelfleet.control import Command, ControlState, Revision
from modelfleet.control.pins import PinnedIndex
from modelfleet.launch import open_repository
from modelfleet.messages import PayloadRef, Task, now_ms
from modelfleet.repository import Catalog, CatalogEntry
from modelfleet.repository.manifest import Fanout, Manifest
from modelfleet.settings import Settings
from modelfleet.worker.coordinator import Coordinator
from tests.fleet import in_process_fleet
from tests.procs import ECHO_HANDLER, write_package
from tests.waiting import eventually

SERVED = ("alpha", "beta", "gamma")  # real packages, with tasks
ANNOUNCED = ("filler-00001", "filler-00002")  # in demand, no queue


def manifest(name: str, pinned: bool = False) -> str:
    return f'''
        name = "{name}"
        version = "1"
        entrypoint = "handler:Echo"
        accepts = ["text/plain"]
        [fanout]
        pinned = {"true" if pinned else "false"}
    '''


class CountingCatalog(Catalog):
    """A real catalog that counts what is asked of it."""

    def __init__(self, entries: dict[str, CatalogEntry]) -> None:
        super().__init__(entries)
        self.touches: Counter[str] = Counter()

    def __iter__(self) -> Iterator[CatalogEntry]:
        self.touches["iter"] += 1
        return super().__iter__()

    def get(self, model_id: str) -> CatalogEntry:
        self.touches["get"] += 1
        return super().get(model_id)

    def __contains__(self, model_id: object) -> bool:
        self.touches["contains"] += 1
        return super().__contains__(model_id)


class CountingBroker(MemoryBroker):
    """The embedded broker, counting the queues it is asked to count."""

    counted = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked: Counter[str] = Counter()

    async def queue_stats(self, model_ids: list[str]) -> dict[str, QueueStats]:
        self.counted += len(model_ids)
        self.asked.update(model_ids)
        return await super().queue_stats(model_ids)


def filler(count: int) -> dict[str, CatalogEntry]:
    """Catalog entries nobody asks for: what a big repository mostly is."""
    base = Manifest(name="filler", entrypoint="handler:Echo")
    return {f"filler-{i:05d}": CatalogEntry((base.model_copy(update={"name": f"filler-{i:05d}"}),))
            for i in range(count)}


def task(model: str, inbox: str) -> Task:
    return Task(uuid.uuid4().hex, model, "1", now_ms() + 60_000, inbox,
                PayloadRef("inline", data=b"hi", size_bytes=2), "text/plain", now_ms())


@contextlib.asynccontextmanager
async def settled(tmp_path: Path, catalog_size: int
                  ) -> AsyncIterator[tuple[Coordinator, CountingBroker, CountingCatalog]]:
    """A coordinator that has served SERVED and re-scored once more after, with
    ANNOUNCED in demand (no queue) and a pinned model resident (no queue)."""
    repo = tmp_path / f"repo-{catalog_size}"
    for name in SERVED:
        write_package(repo, name, manifest(name), ECHO_HANDLER)
    write_package(repo, "pinned", manifest("pinned", pinned=True), ECHO_HANDLER)
    settings = Settings(repo=str(repo), state_dir=tmp_path / f"state-{catalog_size}",
                        broker={"url": "memory"}, worker={"worker_id": "w-scale", "permits": 4})
    store, real = open_repository(settings)
    catalog = CountingCatalog({**filler(catalog_size - len(real)),
                               **{e.model_id: e for e in real}})
    assert len(catalog) == catalog_size
    async with in_process_fleet(settings, start="runtimes", store=store, catalog=catalog,
                                broker_type=CountingBroker) as fleet:
        broker, coordinator, replies = fleet.broker, fleet.coordinator, fleet.replies
        assert isinstance(broker, CountingBroker)
        sent = {}
        for name in SERVED:
            sent[(published := task(name, fleet.inbox_address)).request_id] = name
            await broker.publish_task(published)
        for name in (*SERVED, *ANNOUNCED):
            coordinator._note_demand(name)
        await coordinator._pins.keep()  # what start() does: the pinned model goes on
        answered: set[str] = set()

        async def rescored_and_answered() -> bool:
            """Re-score as its loop would, and take the replies that came meanwhile."""
            await coordinator._rescore(full=True)
            with contextlib.suppress(TimeoutError):
                reply = await asyncio.wait_for(replies.get(), 0.1)
                assert reply.status == "ok", reply
                answered.add(sent[reply.request_id])
            return answered == set(SERVED)

        await eventually(rescored_and_answered, 20, every_s=0,
                         what=f"all of {SERVED} answered",
                         state=lambda: f"answered only {answered}")
        await coordinator._rescore(full=True)  # settles on the state after the tasks
        catalog.touches.clear()
        broker.counted = 0
        broker.asked.clear()
        yield coordinator, broker, catalog


async def one_rescore(tmp_path: Path, catalog_size: int) -> tuple[Counter[str], int, set[str]]:
    """What the second of two re-scores touched, with the same candidates each time."""
    async with settled(tmp_path, catalog_size) as (coordinator, broker, catalog):
        await coordinator._rescore(full=True)
        return Counter(catalog.touches), broker.counted, set(coordinator._consumers)


async def test_one_rescore_touches_as_much_at_10000_models_as_at_100(tmp_path: Path) -> None:
    small = await one_rescore(tmp_path, 100)
    large = await one_rescore(tmp_path, 10_000)
    touches, counted, held = small
    assert large == small
    assert touches["iter"] == 0  # never a walk of the catalog
    assert held == set(SERVED)  # it did serve them, and holds them warm
    candidates = len(SERVED) + len(ANNOUNCED) + 1  # + the pinned model (no queue yet)
    # One count per candidate whose queue exists: the broker said the others have none
    # at the re-scores before, and nothing announced a task for them since.
    assert counted == len(SERVED)
    assert touches["get"] + touches["contains"] <= 8 * candidates


async def test_a_queue_found_missing_is_asked_for_again_once_a_task_is_announced(
        tmp_path: Path) -> None:
    """At thousands of models most resident ones have no queue; on RabbitMQ each ask of
    one is a passive declare that the broker answers by closing a channel. Asked once;
    again only after a demand event names the model (a task was published there)."""
    async with settled(tmp_path, 100) as (coordinator, broker, _):
        listening = asyncio.create_task(coordinator._listen_events())
        try:
            for _ in range(3):
                await coordinator._rescore(full=True)
                await coordinator._rescore(full=False)
            assert set(broker.asked) == set(SERVED)  # never the pinned or announced ones
            # ... though the pinned model is resident, a candidate at every re-score.
            assert "pinned" in (coordinator._residency.models("device")
                                | coordinator._residency.models("host"))

            # A task published to the pinned model's queue, announced as a gateway does:
            # at once and again each interval while its request waits.
            inbox = await broker.open_inbox()
            published = task("pinned", inbox.address)
            await broker.publish_task(published)
            async def announced_and_counted() -> bool:
                """Announce as a gateway does each interval; re-score as woken."""
                if broker.asked["pinned"]:
                    return True
                await broker.publish_event({"kind": "demand", "model_id": "pinned",
                                            "at": time.time()})
                await asyncio.sleep(0.05)
                await coordinator._rescore(full=False)
                return False

            await eventually(announced_and_counted, 10, every_s=0,
                             what="the announced queue being counted")
            async for reply in inbox:  # and it is served, on its queue
                assert (reply.request_id, reply.status) == (published.request_id, "ok")
                break
            await inbox.close()
        finally:
            listening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listening


def test_the_pinned_set_follows_catalog_changes_and_operators_orders() -> None:
    def entry(name: str, pinned: bool) -> CatalogEntry:
        return CatalogEntry((Manifest(name=name, entrypoint="h:M", fanout=Fanout(pinned=pinned)),))

    catalog = Catalog({"a": entry("a", True), "b": entry("b", False), "c": entry("c", False)})
    state = ControlState()
    pins = PinnedIndex(catalog, state)
    assert pins.ids() == {"a"}

    def order(action: str, model_id: str, at: float) -> None:
        Command(f"c{at}", model_id, action, Revision(at, "g")).apply(state)  # type: ignore[arg-type]

    order("pin", "b", 1.0)
    assert pins.ids() == {"a", "b"}
    order("unload", "a", 2.0)  # an unloaded model is not kept loaded, pinned or not
    assert pins.ids() == {"b"}
    order("load", "a", 3.0)
    order("unpin", "b", 4.0)
    assert pins.ids() == {"a"}
    # A refresh: "a" loses its pin in model.toml, "d" comes pinned, "c" goes.
    catalog.replace_with(Catalog({"a": entry("a", False), "b": entry("b", False),
                                  "d": entry("d", True)}))
    assert pins.ids() == {"d"}
    assert all(pins.pinned(m) == (m in pins.ids()) for m in ("a", "b", "c", "d"))
