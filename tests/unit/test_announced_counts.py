"""Queue counts from the fleet's announcements: the broker is asked only what matters.

Gateways say how many requests wait per model, workers say what they consume; a
worker estimates the queues it does not hold from that, and counts exactly (on
RabbitMQ a passive declare each) only what it holds or is resident here, what has no
fresh announced count, and what it is about to take.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from modelfleet.broker import QueueStats, cold_lane
from modelfleet.broker.embedded import MemoryBroker
from modelfleet.errors import DeadlineExceeded
from modelfleet.gateway.service import GatewayService
from modelfleet.launch import open_repository
from modelfleet.messages import PayloadRef, Task, now_ms
from modelfleet.settings import Settings
from modelfleet.worker.announced import AnnouncedCounts
from modelfleet.worker.coordinator import Coordinator
from tests.fleet import in_process_fleet
from tests.procs import EXAMPLES, ask, write_package
from tests.waiting import eventually

MODEL = '''
    from modelfleet import Model

    class Echo(Model):
        def predict(self, batch):
            return [{"ok": True} for _ in batch]
'''


def demand(model: str, waiting: object, gateway: str = "g1") -> dict[str, object]:
    return {"kind": "demand", "model_id": model, "waiting": waiting, "gateway": gateway}


def test_an_estimate_sums_the_gateways_fresh_counts_and_the_peers_that_consume() -> None:
    counts = AnnouncedCounts(fresh_s=1.0, forget_s=10.0, peer_stale_s=3.0, worker_id="me")
    assert counts.estimate("m", 0.0) is None  # never announced with a count
    counts.observe({"kind": "demand", "model_id": "m"}, 0.0)  # an older gateway: no count
    assert counts.estimate("m", 0.0) is None
    counts.observe(demand("m", 2, "g1"), 0.0)
    counts.observe(demand("m", 3, "g2"), 0.5)
    counts.observe({"kind": "worker_state", "worker_id": "w1", "subscriptions": ["m", "x"]},
                   0.5)
    counts.observe({"kind": "worker_state", "worker_id": "me", "subscriptions": ["m"]}, 0.5)
    assert counts.estimate("m", 0.9) == (5, 1)  # its own state is not a peer's
    assert counts.estimate("m", 1.2) == (3, 1)  # g1 went quiet: nothing waits there
    assert counts.estimate("m", 2.0) == (0, 1)  # both quiet: nothing waits
    assert counts.estimate("m", 10.6) is None  # nobody said anything for the window
    counts.observe({"kind": "worker_state", "worker_id": "w2", "subscriptions": ["x"]}, 2.0)
    counts.observe({"kind": "worker_state", "worker_id": "w1", "subscriptions": ["x"]}, 2.0)
    counts.observe(demand("x", 1), 2.0)
    assert counts.estimate("x", 2.0) == (1, 2)
    counts.observe({"kind": "worker_gone", "worker_id": "w2"}, 2.1)
    assert counts.estimate("x", 2.1) == (1, 1)
    counts.expire_peers(5.5)  # w1 not heard from for 3.5 s
    counts.observe(demand("x", 1), 5.5)
    assert counts.estimate("x", 5.5) == (1, 0)
    for bad in (-1, True, "3", None):  # malformed counts say nothing
        counts.observe(demand("y", bad), 5.5)
    assert counts.estimate("y", 5.5) is None


def test_a_task_a_worker_put_back_is_counted_exactly_whatever_the_gateways_say() -> None:
    """A gateway does not count a request it put in the cold lane, nor know when a worker
    passes it on to the model's queue (or hands a task back after a crash): its word that
    nothing waits there is short by that task. A worker's put-back, announced
    ``requeued``, makes the model counted exactly for the demand window."""
    counts = AnnouncedCounts(fresh_s=1.0, forget_s=10.0, peer_stale_s=3.0, worker_id="me")
    counts.observe(demand("m", 0, "g1"), 0.0)
    assert counts.estimate("m", 0.1) == (0, 0)  # the gateway says nothing waits
    counts.observe({"kind": "demand", "model_id": "m", "requeued": True}, 0.2)
    assert counts.estimate("m", 0.3) is None  # count it on the broker
    counts.observe(demand("m", 0, "g1"), 0.5)  # the gateway, still short by that task
    assert counts.estimate("m", 9.0) is None
    assert counts.estimate("m", 10.3) == (0, 0)  # the window is over: the gateways' word
    counts.observe(demand("m", 2, "g1"), 10.4)
    assert counts.estimate("m", 10.5) == (2, 0)


@contextlib.asynccontextmanager
async def gateway_hearing_events(tmp_path: Path, **gateway: object) -> AsyncIterator[
        tuple[GatewayService, MemoryBroker, list[dict[str, object]]]]:
    """A started gateway service on the embedded broker, no worker, and every event
    published while it runs."""
    settings = Settings(repo=str(EXAMPLES), state_dir=tmp_path,
                        gateway={"demand_announce_interval_s": 0.05, **gateway})
    broker = MemoryBroker(settings.broker)
    await broker.connect()
    _, catalog = open_repository(settings)
    service = GatewayService(settings, broker, catalog)
    await service.start()
    events: list[dict[str, object]] = []

    async def listen() -> None:
        async for event in broker.events():
            events.append(event)

    listener = asyncio.create_task(listen())
    await asyncio.sleep(0.05)  # subscribed
    try:
        yield service, broker, events
    finally:
        listener.cancel()
        await service.stop()
        await broker.close()


async def test_the_gateway_announces_how_many_wait_and_who_says_so(tmp_path: Path) -> None:
    async with gateway_hearing_events(tmp_path, cold_lane_per_model=0) as (service, _, events):
        calls = [ask(service, "banner", None, b"hi", "text/plain", now_ms() + 400, {})
                 for _ in range(3)]  # no worker here, no cold lane: they wait, announced
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            assert isinstance(outcome, DeadlineExceeded)
    demands = [e for e in events if e.get("kind") == "demand" and e["model_id"] == "banner"]
    assert demands[0]["waiting"] == 1  # announced with the first request
    assert 3 in {e["waiting"] for e in demands}  # then re-announced with all three
    assert len({e["gateway"] for e in demands}) == 1 and demands[0]["gateway"]


class CountingBroker(MemoryBroker):
    """The embedded broker, recording the queues it is asked to count."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.counted: list[str] = []

    async def queue_stats(self, model_ids: list[str]) -> dict[str, QueueStats]:
        self.counted.extend(model_ids)
        return await super().queue_stats(model_ids)


@dataclass
class Fleet:
    broker: CountingBroker
    coordinator: Coordinator
    inbox: str


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    repo = tmp_path / "repo"
    for name in ("quiet", "busy", "stale"):
        write_package(repo, name, f'name = "{name}"\nversion = "1"\n'
                      'entrypoint = "handler:Echo"\naccepts = ["text/plain"]\n', MODEL)
    settings = Settings(repo=str(repo), state_dir=tmp_path / "state", broker={"url": "memory"},
                        worker={"worker_id": "w-me", "permits": 4})
    async with in_process_fleet(settings, start="runtimes", broker_type=CountingBroker) as rig:
        assert isinstance(rig.broker, CountingBroker)
        yield Fleet(rig.broker, rig.coordinator, rig.inbox_address)


def hear(fleet: Fleet, event: dict[str, object]) -> None:
    """What the coordinator's event listener does with one event."""
    coordinator = fleet.coordinator
    coordinator._announced.observe(event, coordinator._clock())
    coordinator._queues.demand_heard(str(event["model_id"]))
    coordinator._note_demand(str(event["model_id"]))


async def test_a_periodic_rescore_counts_only_what_announcements_do_not_say(
        fleet: Fleet) -> None:
    hear(fleet, demand("quiet", 0))  # announced, nothing waits: no need to ask
    hear(fleet, {"kind": "demand", "model_id": "stale"})  # announced without a count
    await fleet.coordinator._rescore(full=True)
    # The first tick counts every candidate, whatever was announced (and so does one
    # every EXACT_EVERY_S, in case an announcement was lost); the next ones do not.
    assert sorted(fleet.broker.counted) == ["quiet", "stale"]
    fleet.broker.counted.clear()
    # Neither has a queue. Re-announced at the next interval, as a gateway does while a
    # request waits: the one announced without a count is asked for again.
    hear(fleet, demand("quiet", 0))
    hear(fleet, {"kind": "demand", "model_id": "stale"})
    await fleet.coordinator._rescore(full=True)
    assert fleet.broker.counted == ["stale"]
    # Not announced again: the broker said it has no queue, so nobody asks it again.
    fleet.broker.counted.clear()
    await fleet.coordinator._rescore(full=True)
    assert fleet.broker.counted == []


async def test_a_queue_is_taken_on_the_brokers_count_not_on_an_announcement(
        fleet: Fleet) -> None:
    body = b"x"
    await fleet.broker.publish_task(Task(uuid.uuid4().hex, "busy", "1", now_ms() + 60_000,
                                         fleet.inbox, PayloadRef("inline", data=body,
                                                                 size_bytes=1),
                                         "text/plain", now_ms()))
    hear(fleet, demand("busy", 1))
    hear(fleet, demand("quiet", 4))  # says 4 wait; the queue is empty (answered since)
    fleet.coordinator._exact_at = time.monotonic()  # not a tick that counts everything
    await fleet.coordinator._rescore(full=True)
    # Both looked worth taking on the announcements: each was counted exactly before
    # being taken, and only the one with work waiting was.
    assert sorted(set(fleet.broker.counted)) == ["busy", "quiet"]
    assert set(fleet.coordinator._consumers) == {"busy"}


async def test_requests_in_the_cold_lane_are_not_announced_as_waiting(tmp_path: Path) -> None:
    """No worker holds banner: its first two requests go to the cold lane (its fan-out cap
    is 2), the third to banner's queue, and the demand announced counts only what waits
    in banner's queue."""
    async with gateway_hearing_events(tmp_path) as (service, broker, events):
        calls = [asyncio.create_task(ask(service, "banner", None, b"hi", "text/plain",
                                                   now_ms() + 400, {})) for _ in range(3)]

        async def all_queued() -> dict[str, QueueStats] | None:
            stats = await broker.queue_stats(["banner", cold_lane(0)])
            queued = sum(s.backlog for s in stats.values())
            return stats if queued == 3 else None

        stats = await eventually(all_queued, 5, what="the three requests queued",
                                 every_s=0.01)
        assert stats[cold_lane(0)].backlog == 2 and stats["banner"].backlog == 1
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            assert isinstance(outcome, DeadlineExceeded)
    demands = [e for e in events if e.get("kind") == "demand" and e["model_id"] == "banner"]
    assert demands and {e["waiting"] for e in demands} == {1}
