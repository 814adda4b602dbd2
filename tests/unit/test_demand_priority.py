"""A tenant's plan priority travels with the demand: the gateway announces the highest
priority among a model's recent callers, and a worker with one free load slot takes the
queue whose callers have the higher priority first (embedded broker, real coordinator,
in-process runtimes, real handlers)."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from modelfleet.broker import cold_lane
from modelfleet.broker.embedded import MemoryBroker
from modelfleet.errors import DeadlineExceeded
from modelfleet.gateway.service import GatewayService
from modelfleet.launch import open_repository
from modelfleet.messages import PayloadRef, Task, now_ms
from modelfleet.scheduling import QueueView, ScoringSettings, WorkerView, choose_queues
from modelfleet.scheduling.demand import DemandPriority
from modelfleet.settings import Settings
from modelfleet.tenancy.access import CALLER, Principal
from modelfleet.tenancy.plans import BUILTIN
from modelfleet.tenancy.store import Tenant
from tests.fleet import in_process_fleet
from tests.procs import EXAMPLES, ask, write_package
from tests.waiting import eventually


def test_the_highest_priority_within_the_window_counts() -> None:
    demand = DemandPriority(window_s=10)
    assert demand.of("m", 0) == 0
    demand.note("m", 2, now=0)
    demand.note("m", 0, now=5)
    assert demand.of("m", 6) == 2
    assert demand.of("m", 11) == 0  # the priority-2 caller is 11 s old: gone
    for malformed in ("2", -1, True, None, 10**9, 2.5):
        demand.note("x", malformed, now=0)
    assert demand.of("x", 0) == 0


def test_a_queue_scores_by_its_callers_priority_when_it_is_above_its_plans() -> None:
    queues = [QueueView("a", backlog=40, consumers=0, plan="free"),
              QueueView("b", backlog=1, consumers=0, plan="free", priority=2)]
    worker = WorkerView("w1", free_permits=4, permits_cap=4, loader_room={"": 1})
    decision = choose_queues(queues, worker, ScoringSettings(noise_amplitude=0), 1000.0, 7)
    assert decision.subscribe == {"b"}


def principal(plan: str) -> Principal:
    return Principal("0123456789ab", "caller", Tenant("acme", plan), BUILTIN[plan])


async def test_the_gateway_announces_its_callers_priority(tmp_path: Path) -> None:
    # No cold lane: the request waits in banner's own queue, announced.
    settings = Settings(repo=str(EXAMPLES), state_dir=tmp_path,
                        gateway={"cold_lane_per_model": 0})
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
    token = CALLER.set(principal("enterprise"))
    try:
        with pytest.raises(DeadlineExceeded):  # no worker here: only the announcement
            await ask(service, "banner", None, b"hi", "text/plain", now_ms() + 300, {})
    finally:
        CALLER.reset(token)
        listener.cancel()
        await service.stop()
        await broker.close()
    demands = [e for e in events if e.get("kind") == "demand" and e["model_id"] == "banner"]
    assert demands and all(e["priority"] == 2 for e in demands)


HANDLER = '''
    import time
    from pathlib import Path

    from modelfleet import Model


    class Logged(Model):
        def load(self, ctx):
            time.sleep(0.3)  # long enough for the other queue to wait for the loader
            self.log = Path(__file__).resolve().parents[2] / "calls.log"
            self.name = ctx.model_id

        def predict(self, batch):
            with self.log.open("a") as log:
                log.write(f"{self.name} {time.monotonic()}\\n")
            return [{"ok": True} for _ in batch]
'''
MANIFEST = '''
    name = "{name}"
    version = "1"
    entrypoint = "handler:Logged"
    accepts = ["text/plain"]
'''


async def test_one_load_slot_goes_to_the_queue_whose_callers_have_the_higher_plan(
        tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name in ("a-free", "b-enterprise"):
        write_package(repo, name, MANIFEST.format(name=name), HANDLER)
    settings = Settings(repo=str(repo), state_dir=tmp_path / "state", worker={
        "worker_id": "w-prio", "permits": 4, "rescore_interval_s": 5,
        "rescore_jitter_s": 0.3},  # both announcements land before the first decision
        runtime={"max_concurrent_loads": 1},
        scheduling={"noise_amplitude": 0, "max_loads_for_cold": 1})
    async with in_process_fleet(settings) as fleet:
        broker = fleet.broker
        await asyncio.sleep(0.3)  # its first (empty) decision is behind it
        for model in ("a-free", "b-enterprise"):
            await broker.publish_task(Task(uuid.uuid4().hex, model, "1", now_ms() + 20_000,
                                           fleet.inbox_address,
                                           PayloadRef("inline", b"x", "", 1), "text/plain",
                                           now_ms()))
        for model, priority in (("a-free", 0), ("b-enterprise", 2)):
            await broker.publish_event({"kind": "demand", "model_id": model,
                                        "at": time.time(), "priority": priority})
        log = repo / "calls.log"

        def served() -> list[str]:
            return log.read_text().splitlines() if log.exists() else []

        await eventually(lambda: len(served()) >= 2, 20,
                         what="both tasks served", state=served)
        order = [line.split()[0] for line in log.read_text().splitlines()]
        assert order == ["b-enterprise", "a-free"]


async def test_a_cold_request_takes_the_cold_lane_of_its_callers_priority(tmp_path: Path
                                                                         ) -> None:
    """No worker holds banner: an enterprise caller's request waits in the priority-2 cold
    lane, a free caller's in lane 0, and neither in banner's queue."""
    settings = Settings(repo=str(EXAMPLES), state_dir=tmp_path)
    broker = MemoryBroker(settings.broker)
    await broker.connect()
    _, catalog = open_repository(settings)
    service = GatewayService(settings, broker, catalog)
    await service.start()
    try:
        for plan in ("enterprise", "free"):
            token = CALLER.set(principal(plan))
            try:
                with pytest.raises(DeadlineExceeded):
                    await ask(service, "banner", None, b"hi", "text/plain", now_ms() + 200, {})
            finally:
                CALLER.reset(token)
        stats = await broker.queue_stats(["banner", cold_lane(0), cold_lane(2)])
        assert stats[cold_lane(2)].backlog == 1 and stats[cold_lane(0)].backlog == 1
        assert "banner" not in stats  # its own queue was never declared
    finally:
        await service.stop()
        await broker.close()
