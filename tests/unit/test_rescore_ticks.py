"""The re-score loop's ticks keep their schedule however often the worker is woken.

A woken re-score counts only what changed, and the event listener neither wakes a
worker for, nor marks to be counted, a queue whose last count saw it at its fan-out
cap (``Coordinator._at_cap``): only a tick (a full re-score) counts such a queue again.
Here a worker counts a queue at its cap (another consumer holds it; its cap is 1),
that consumer leaves with tasks waiting, and the worker is woken far more often than
its re-score period, as a busy one is (a task ending while work waits, demand for
other models). The tasks must still be served: before the ticks kept their schedule,
every wake put the next tick off, and they waited for ever. The simulator models the
same loop (``sim/pull.py``): its workers tick on schedule however often woken.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from pathlib import Path

from modelfleet.messages import PayloadRef, Task, now_ms
from modelfleet.settings import Settings
from modelfleet.sim import pull
from modelfleet.sim.engine import Simulation
from modelfleet.sim.scenario import ScenarioConfig, build_catalog, build_trace
from tests.fleet import in_process_fleet
from tests.procs import ECHO_HANDLER, write_package
from tests.waiting import eventually

CAPPED = '''
    name = "capped"
    version = "1"
    entrypoint = "handler:Echo"
    accepts = ["text/plain"]
    [fanout]
    max_workers = 1
'''
RESCORE_INTERVAL_S = 0.5
WAKE_EVERY_S = 0.05  # ten times a re-score period and more


def task(inbox: str) -> Task:
    return Task(uuid.uuid4().hex, "capped", "1", now_ms() + 60_000, inbox,
                PayloadRef("inline", data=b"hi", size_bytes=2), "text/plain", now_ms())


async def test_a_queue_last_counted_at_its_cap_is_served_when_its_consumers_leave(
        tmp_path: Path) -> None:
    write_package(tmp_path / "repo", "capped", CAPPED, ECHO_HANDLER)
    settings = Settings(repo=str(tmp_path / "repo"), state_dir=tmp_path / "state",
                        broker={"url": "memory"},
                        worker={"worker_id": "w-ticks", "permits": 2,
                                "rescore_interval_s": RESCORE_INTERVAL_S})
    async with in_process_fleet(settings) as fleet:
        broker, coordinator = fleet.broker, fleet.coordinator
        # Another worker holds the queue (its fan-out cap is 1): it takes one task into
        # its window and leaves the next one waiting.
        other = await broker.subscribe("capped", prefetch=1)
        sent = [task(fleet.inbox_address) for _ in range(2)]
        for published in sent:
            await broker.publish_task(published)

        async def announce() -> None:
            """What a gateway does while requests wait: announce their model, again and
            again (``gateway.demand_announce_interval_s``)."""
            while True:
                await broker.publish_event({"kind": "demand", "model_id": "capped"})
                await asyncio.sleep(0.25)

        async def keep_waking() -> None:
            """What keeps a busy worker woken: tasks ending while work waits, demand for
            models it does not hold."""
            while True:
                coordinator._wake()
                await asyncio.sleep(WAKE_EVERY_S)

        loops = [asyncio.create_task(announce())]
        try:
            await eventually(lambda: coordinator._at_cap("capped"), 10,
                             what="the worker counting capped at its fan-out cap")
            assert "capped" not in coordinator._consumers
            loops.append(asyncio.create_task(keep_waking()))
            await other.cancel()  # the other worker leaves: both tasks wait, no consumer
            answered: set[str] = set()

            async def all_answered() -> bool:
                with contextlib.suppress(TimeoutError):
                    reply = await asyncio.wait_for(fleet.replies.get(), 0.1)
                    assert reply.status == "ok", reply
                    answered.add(reply.request_id)
                return answered == {t.request_id for t in sent}

            await eventually(all_answered, 20 * RESCORE_INTERVAL_S,
                             what="both tasks of the queue left by its consumer answered",
                             state=lambda: f"answered {len(answered)}; counted "
                                           f"{coordinator._queues.get('capped')}, held "
                                           f"{sorted(coordinator._consumers)}")
        finally:
            for loop in loops:
                loop.cancel()
            await asyncio.gather(*loops, return_exceptions=True)


class TickLog(pull.PullAffinity):
    """Pull-affinity that notes when each worker counts every candidate (a tick)."""

    def __init__(self, seed: int) -> None:
        super().__init__(rng_seed=seed)
        self.ticks: dict[int, list[float]] = {}
        self.woken = 0

    def _count(self, coord: pull.Coordinator, full: bool) -> None:
        if full:
            self.ticks.setdefault(coord.worker.index, []).append(self.sim.now)
        else:
            self.woken += 1
        super()._count(coord, full)


def test_the_simulated_workers_tick_on_schedule_however_often_woken() -> None:
    # A busy fleet: announcements and task ends wake every worker many times a period.
    config = ScenarioConfig(models=60, workers=4, duration_s=30.0, warmup_s=5.0, rate=40.0,
                            device_gib=2.0, host_gib=2.0, size_median_mb=150.0,
                            size_max_mb=1_500.0, sample_s=5.0, seed=3)
    router = TickLog(config.seed)
    Simulation(config, build_catalog(config), build_trace(config), router).run()
    assert sorted(router.ticks) == list(range(config.workers))
    assert router.woken > 3 * sum(map(len, router.ticks.values()))  # 5x, seed 3
    for ticks in router.ticks.values():
        gaps = [b - a for a, b in itertools.pairwise(ticks)
                if b <= config.duration_s]
        # A tick's period is rescore_s x uniform(0.75, 1.25) from the start of the last
        # one; a re-score under way when it falls due delays it by what it has left.
        assert max(gaps) <= 1.25 * config.rescore_s + 0.25, max(gaps)
