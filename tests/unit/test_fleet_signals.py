"""The fleet page's data and the autoscaling signals: load rates, bounded labels,
desired workers, and the gauges a gateway publishes from a real embedded broker."""

from __future__ import annotations

import asyncio
import re

import pytest
from prometheus_client import generate_latest

from modelfleet.broker.base import QueueStats
from modelfleet.broker.embedded import MemoryBroker
from modelfleet.gateway.fleet import FleetView
from modelfleet.gateway.fleet_summary import FleetSummary, desired_workers
from modelfleet.gateway.loadrate import LoadRateRing
from modelfleet.gateway.parking import ParkedRequests
from modelfleet.labels import OTHER, ModelLabels, top_n
from modelfleet.settings import BrokerSettings, GatewaySettings, Settings
from tests.contract.brokers import make_task


def state(worker_id: str, loads: dict[str, int], device: list[str],
          host: list[str] | None = None, in_use: int = 0, cap: int = 4,
          subscriptions: list[str] | None = None) -> dict[str, object]:
    return {"kind": "worker_state", "worker_id": worker_id, "ready": True, "loads": loads,
            "resident": {"device": device, "host": host or []},
            "permits_in_use": in_use, "permits_cap": cap,
            "subscriptions": subscriptions or []}


def test_loads_per_minute_keep_storage_loads_and_promotions_apart() -> None:
    ring = LoadRateRing(step_s=10, window_s=600)
    ring.observe("w1", state("w1", {"disk": 2}, ["a", "b"]), now=0)
    ring.observe("w1", state("w1", {"disk": 5, "repository": 1, "host": 3},
                             ["a", "b", "c"], ["d"]), now=30)
    (point,) = ring.series()["points"]
    assert point["workers"]["w1"] == {"resident_device": 3, "resident_host": 1,
                                      "loads": 4, "promotions": 3,
                                      "loads_per_min": 4, "promotions_per_min": 3}
    assert point["fleet"]["loads_per_min"] == 4


def test_fleet_rate_sums_workers_and_restarted_or_new_workers_do_not_go_negative() -> None:
    ring = LoadRateRing(step_s=10, window_s=600)
    ring.observe("w1", state("w1", {"disk": 10}, ["a"]), now=0)
    ring.observe("w1", state("w1", {"disk": 2}, ["a"]), now=60)  # restarted: 2 new loads
    ring.observe("w2", state("w2", {"disk": 50}, ["b"]), now=61)  # first seen: no rate yet
    ring.sample(now=75)
    ring.observe("w2", state("w2", {"disk": 53}, ["b"]), now=90)
    points = ring.series()["points"]
    assert points[0]["workers"] == {"w1": {"resident_device": 1, "resident_host": 0,
                                           "loads": 2, "promotions": 0,
                                           "loads_per_min": 2, "promotions_per_min": 0}}
    assert points[1]["workers"]["w2"]["loads_per_min"] == 0
    last = points[-1]
    assert last["workers"]["w2"]["loads_per_min"] == 3
    assert last["workers"]["w1"]["loads_per_min"] == 2  # counted at t=60: in the minute
    assert last["fleet"]["resident_device"] == 2


def test_loads_per_minute_count_the_minute_up_to_each_sample() -> None:
    ring = LoadRateRing(step_s=10, window_s=600)
    for t, loads in ((0, 0), (20, 1), (40, 3), (60, 3), (80, 4), (100, 4), (120, 4)):
        ring.observe("w", state("w", {"disk": loads}, []), now=float(t))
    rates = [p["fleet"]["loads_per_min"] for p in ring.series()["points"]]
    assert rates == [1, 3, 3, 3, 1, 1]  # t=20..120: loads at 20 (1), 40 (2), 80 (1)


def test_the_ring_keeps_only_its_window() -> None:
    ring = LoadRateRing(step_s=1, window_s=5)
    for t in range(20):
        ring.observe("w", state("w", {"disk": t}, []), now=float(t))
    points = ring.series()["points"]
    assert len(points) == 5 and points[0]["at"] == 15


def test_model_labels_are_bounded_and_stable() -> None:
    label = ModelLabels(limit=2)
    assert [label(m) for m in ("a", "b", "c", "a", "d")] == ["a", "b", OTHER, "a", OTHER]


def test_top_n_keeps_the_largest_and_sums_the_rest() -> None:
    assert top_n({"a": 5, "b": 1, "c": 3, "d": 2}, limit=2) == {"a": 5, "c": 3, OTHER: 3}
    assert top_n({"a": 5, "b": 1, "c": 3}, limit=2, combine=max) == {"a": 5, "c": 3, OTHER: 1}
    assert top_n({}, limit=2) == {OTHER: 0.0}


@pytest.mark.parametrize(("in_use", "backlog", "per_worker", "target", "want"), [
    (0, 0, 16, 0.8, 0),       # no work at all: KEDA's minReplicaCount decides
    (16, 0, 16, 0.8, 2),      # one full worker is over the 80 % target
    (12, 0, 16, 0.8, 1),
    (12, 40, 16, 0.8, 5),     # 52 / 12.8
    (3, 0, 0, 0.8, 4),        # workers with no permits count as one permit each
])
def test_desired_workers(in_use: int, backlog: int, per_worker: float, target: float,
                         want: int) -> None:
    assert desired_workers(in_use, backlog, per_worker, target) == want


def metric(name: str, **labels: str) -> float | None:
    for line in generate_latest().decode().splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{.*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            return float(match.group(2))
    return None


async def test_summary_counts_the_fleets_queues_and_publishes_bounded_gauges() -> None:
    broker = MemoryBroker(BrokerSettings())
    await broker.connect()
    try:
        settings = Settings(gateway=GatewaySettings(fleet_metrics_models=2))
        fleet = FleetView(stale_after_s=10)
        now = [50.0]
        parked = ParkedRequests(clock=lambda: now[0])
        # Backlogs 4, 3, 2, 1 on four models: two labelled, the rest summed as "other".
        for model_id, n in (("m-a", 4), ("m-b", 3), ("m-c", 2), ("m-d", 1)):
            for _ in range(n):
                await broker.publish_task(make_task(model_id))
            fleet.observe({"kind": "demand", "model_id": model_id})
        fleet.observe(state("w1", {"disk": 3, "host": 1}, ["m-a"], ["m-b"], in_use=3, cap=4,
                            subscriptions=["m-a"]))
        fleet.observe(state("w2", {"repository": 2}, ["m-c"], in_use=1, cap=4))
        parked.park("r1", "m-a")
        now[0] += 7.5
        summary = await FleetSummary(settings, broker, fleet, parked).get()

        totals = summary["totals"]
        assert (totals["workers"], totals["permits_in_use"], totals["permits_cap"]) == (2, 4, 8)
        assert totals["backlog"] == 10 and totals["permit_utilization"] == 0.5
        assert totals["desired_workers"] == 5  # (4 + 10) / (4 x 0.8)
        assert (totals["storage_loads"], totals["promotions"]) == (5, 1)
        assert {q["model"]: q["backlog"] for q in summary["queues"]} == \
            {"m-a": 4, "m-b": 3, "m-c": 2, "m-d": 1}
        assert next(q for q in summary["queues"] if q["model"] == "m-a")["warm_on"] == ["w1"]

        assert metric("modelfleet_fleet_backlog", model="m-a") == 4
        assert metric("modelfleet_fleet_backlog", model="m-b") == 3
        assert metric("modelfleet_fleet_backlog", model="other") == 3
        assert metric("modelfleet_fleet_backlog", model="m-c") is None
        assert metric("modelfleet_fleet_total_backlog") == 10
        assert metric("modelfleet_fleet_desired_workers") == 5
        assert metric("modelfleet_fleet_permit_utilization") == 0.5
        assert metric("modelfleet_fleet_oldest_waiting_seconds", model="m-a") == 7.5
        assert metric("modelfleet_fleet_oldest_waiting_seconds", model="m-b") is None
    finally:
        await broker.close()


async def test_models_that_leave_the_top_n_lose_their_label() -> None:
    broker = MemoryBroker(BrokerSettings())
    await broker.connect()
    try:
        settings = Settings(gateway=GatewaySettings(fleet_metrics_models=1))
        fleet = FleetView(stale_after_s=10)
        clock = [0.0]
        summary = FleetSummary(settings, broker, fleet, ParkedRequests(), clock=lambda: clock[0])
        await broker.publish_task(make_task("gone-soon"))
        fleet.observe({"kind": "demand", "model_id": "gone-soon"})
        await summary.get()
        assert metric("modelfleet_fleet_backlog", model="gone-soon") == 1
        for _ in range(2):
            await broker.publish_task(make_task("bigger"))
        fleet.observe({"kind": "demand", "model_id": "bigger"})
        clock[0] += 2
        await summary.get()
        assert metric("modelfleet_fleet_backlog", model="bigger") == 2
        assert metric("modelfleet_fleet_backlog", model="gone-soon") is None
        assert metric("modelfleet_fleet_backlog", model="other") == 1
    finally:
        await broker.close()


async def test_oldest_waiting_age_is_per_model_and_leaves_with_the_answer() -> None:
    now = [100.0]
    parked = ParkedRequests(clock=lambda: now[0])
    parked.park("r1", "a")
    now[0] += 5
    parked.park("r2", "a")
    parked.park("r3", "b")
    now[0] += 1
    assert parked.oldest_waiting_s() == {"a": 6.0, "b": 1.0}
    parked.unpark("r1")
    assert parked.oldest_waiting_s() == {"a": 1.0, "b": 1.0}
    await asyncio.sleep(0)


class SlowCountingBroker(MemoryBroker):
    """The embedded broker, whose counts take 3 s of the summary's clock."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__(BrokerSettings())
        self.clock = clock
        self.counts = 0

    async def queue_stats(self, model_ids: list[str]) -> dict[str, QueueStats]:
        self.counts += 1
        self.clock[0] += 3
        return await super().queue_stats(model_ids)


async def test_a_slow_count_spaces_out_the_next_one() -> None:
    clock = [0.0]
    broker = SlowCountingBroker(clock)
    await broker.connect()
    try:
        fleet = FleetView(stale_after_s=10)
        fleet.observe({"kind": "demand", "model_id": "m"})
        await broker.publish_task(make_task("m"))
        summary = FleetSummary(Settings(), broker, fleet, ParkedRequests(),
                               clock=lambda: clock[0])
        await summary.get()
        clock[0] += 10  # 10 s later: less than 5 x the 3 s the count took
        await summary.get()
        assert broker.counts == 1
        clock[0] += 6
        assert (await summary.get())["totals"]["backlog"] == 1
        assert broker.counts == 2
    finally:
        await broker.close()


async def test_a_broker_that_cannot_count_still_leaves_the_workers_on_the_page() -> None:
    broker = MemoryBroker(BrokerSettings())
    await broker.connect()
    fleet = FleetView(stale_after_s=10)
    fleet.observe(state("w1", {"disk": 1}, ["m"], in_use=1, cap=4, subscriptions=["m"]))
    for _ in range(7):
        await broker.publish_task(make_task("m"))
    clock = [0.0]
    summary = FleetSummary(Settings(), broker, fleet, ParkedRequests(), clock=lambda: clock[0])
    assert (await summary.get())["totals"]["backlog"] == 7
    assert metric("modelfleet_fleet_desired_workers") == 3  # (1 + 7) / (4 x 0.8)
    await broker.close()  # counting now fails with BrokerUnavailable
    clock[0] += 2
    latest = await summary.get()
    assert latest["broker_error"]
    # Unknown, not zero: an autoscaler must not shrink the fleet because the broker is down.
    assert latest["totals"]["backlog"] is None and latest["totals"]["desired_workers"] is None
    assert metric("modelfleet_fleet_desired_workers") == 3
    assert metric("modelfleet_fleet_total_backlog") == 7
    summary = latest
    assert [w["worker_id"] for w in summary["workers"]] == ["w1"]
    assert summary["totals"]["permits_in_use"] == 1
    assert summary["queues"] == [{"model": "m", "backlog": None, "consumers": None,
                                  "oldest_waiting_s": None, "warm_on": ["w1"]}]


async def test_the_summary_carries_one_workers_series_only_when_asked() -> None:
    broker = MemoryBroker(BrokerSettings())
    await broker.connect()
    try:
        now = [0.0]
        fleet = FleetView(stale_after_s=60, clock=lambda: now[0])
        for t in (0.0, 10.0):
            now[0] = t
            fleet.observe(state("w1", {"disk": int(t)}, ["a"]))
            fleet.observe(state("w2", {"disk": 1}, ["b"]))
        summary = FleetSummary(Settings(), broker, fleet, ParkedRequests())
        whole = await summary.get()
        assert [p["workers"] for p in whole["load_rate"]["points"]] == [{}]
        assert whole["load_rate"]["points"][0]["fleet"]["loads"] == 10
        one = await summary.get("w1")
        (point,) = one["load_rate"]["points"]
        assert list(point["workers"]) == ["w1"] and point["workers"]["w1"]["loads"] == 10
        assert one["totals"] == whole["totals"]
    finally:
        await broker.close()


class AskedBroker(MemoryBroker):
    """The embedded broker, recording the queues each count asks for."""

    def __init__(self) -> None:
        super().__init__(BrokerSettings())
        self.asked: list[set[str]] = []

    async def queue_stats(self, model_ids: list[str]) -> dict[str, QueueStats]:
        self.asked.append(set(model_ids))
        return await super().queue_stats(model_ids)


async def test_a_resident_models_missing_queue_is_not_counted_again_until_announced() -> None:
    """At thousands of models most resident ones have no queue, and every scrape counted
    them all (on RabbitMQ, a passive declare that closes its channel each)."""
    broker = AskedBroker()
    await broker.connect()
    try:
        clock = [0.0]
        fleet = FleetView(stale_after_s=1e9)
        fleet.observe(state("w1", {"disk": 3}, ["cold-1", "cold-2", "held"],
                            subscriptions=["held"]))
        await broker.publish_task(make_task("held"))
        summary = FleetSummary(Settings(), broker, fleet, ParkedRequests(),
                               clock=lambda: clock[0])
        await summary.get()
        assert {"cold-1", "cold-2", "held"} <= broker.asked[-1]

        clock[0] += 2
        again = await summary.get()
        assert "held" in broker.asked[-1]  # consumed: counted at every build
        assert not {"cold-1", "cold-2"} & broker.asked[-1]
        rows = {q["model"]: q["backlog"] for q in again["queues"]}
        assert rows == {"cold-1": None, "cold-2": None, "held": 1}  # still listed

        # A task for cold-1, announced as every publish is: counted at the next build.
        await broker.publish_task(make_task("cold-1"))
        fleet.observe({"kind": "demand", "model_id": "cold-1"})
        clock[0] += 2
        announced = await summary.get()
        assert "cold-1" in broker.asked[-1] and "cold-2" not in broker.asked[-1]
        assert {q["model"]: q["backlog"] for q in announced["queues"]}["cold-1"] == 1
        assert announced["totals"]["backlog"] == 2

        clock[0] += 60  # past the recheck: asked once more, in case a word was lost
        await summary.get()
        assert "cold-2" in broker.asked[-1]
    finally:
        await broker.close()
