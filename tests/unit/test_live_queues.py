"""The live-queue count a process keeps from its own declares and expiries, and the
warning before it nears what the broker is sized for (pure, clock injected)."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import REGISTRY

from modelfleet.broker.live_queues import LiveQueueWatch
from modelfleet.broker.rabbitmq.topology import QueueLeases
from modelfleet.settings import BrokerSettings, GatewaySettings
from tests.clock import ManualClock


def test_a_lease_that_ran_out_stops_counting_and_is_declared_again() -> None:
    clock = ManualClock(1000.0)
    leases = QueueLeases(expiry_s=300, clock=clock)
    leases.renewed("model.a", clock())
    clock.now += 100
    leases.renewed("model.b", clock())
    assert leases.live() == 2

    clock.now += 201  # a's lease ran out, b's did not
    assert leases.live() == 1
    assert not leases.known("model.a")  # the next publish declares it again
    assert leases.known("model.b")
    assert leases.needs_renewal("model.a", task_remaining_s=10)


def test_a_renewal_extends_the_lease_it_replaces() -> None:
    clock = ManualClock(1000.0)
    leases = QueueLeases(expiry_s=300, clock=clock)
    leases.renewed("model.a", clock())
    clock.now += 250
    leases.renewed("model.a", clock())
    clock.now += 100  # past the first lease, inside the second
    assert leases.live() == 1
    assert leases.known("model.a")


def test_a_consumed_queue_stays_live_and_its_lease_starts_when_the_consumer_leaves() -> None:
    clock = ManualClock(1000.0)
    leases = QueueLeases(expiry_s=300, clock=clock)
    leases.hold("model.a")
    clock.now += 10_000
    assert leases.live() == 1
    leases.release("model.a")
    clock.now += 299
    assert leases.live() == 1
    clock.now += 2
    assert leases.live() == 0


def test_a_reconnect_forgets_all_but_the_consumed_queues() -> None:
    clock = ManualClock(1000.0)
    leases = QueueLeases(expiry_s=300, clock=clock)
    leases.renewed("model.a", clock())
    leases.hold("model.b")
    leases.clear()
    assert (leases.known("model.a"), leases.known("model.b")) == (False, True)
    assert leases.live() == 1


def test_the_table_holds_what_is_live_not_every_queue_ever_declared() -> None:
    clock = ManualClock(1000.0)
    leases = QueueLeases(expiry_s=300, clock=clock)
    for i in range(10_000):
        leases.renewed(f"model.{i}", clock())
        clock.now += 0.1  # 10,000 models over 1,000 s, 5 min expiry: about 3,000 live
    assert 2_990 <= leases.live() <= 3_000
    assert len(leases._lease_end) == leases.live()  # internals: nothing lapsed is kept


def test_the_warning_comes_once_at_the_threshold_and_rearms_below_it(
        caplog: pytest.LogCaptureFixture) -> None:
    live = [0]
    watch = LiveQueueWatch(BrokerSettings(max_live_queues=100, live_queues_warn_fraction=0.8),
                           lambda: live[0], "RabbitMQ at amqp://x")
    caplog.set_level(logging.WARNING, logger="modelfleet.broker")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "live model queues" in r.getMessage()]

    def at(count: int) -> None:
        live[0] = count
        watch.check()

    for count in range(1, 100):
        at(count)
    assert warnings() == ['80 live model queues on RabbitMQ at amqp://x: 80% of '
                          'broker.max_live_queues=100; size the broker for more (README '
                          '"The broker at scale") or shorten broker.queue_idle_expiry_s']
    at(75)  # not yet far enough below the threshold to warn again
    at(80)
    assert len(warnings()) == 1
    at(71)
    at(80)
    assert len(warnings()) == 2


def test_the_gauge_reads_the_count_at_scrape_time() -> None:
    count = 7
    watch = LiveQueueWatch(BrokerSettings(max_live_queues=50), lambda: count, "x")
    watch.export()
    assert REGISTRY.get_sample_value("modelfleet_broker_live_queues") == 7
    assert REGISTRY.get_sample_value("modelfleet_broker_max_live_queues") == 50
    count = 3
    assert REGISTRY.get_sample_value("modelfleet_broker_live_queues") == 3
    watch.unexport()
    assert REGISTRY.get_sample_value("modelfleet_broker_live_queues") == 0


def test_the_default_expiry_lets_the_tail_go_in_minutes_and_covers_every_deadline() -> None:
    expiry_s = BrokerSettings().queue_idle_expiry_s
    assert expiry_s <= 600
    # A lease must cover the longest task a gateway accepts, plus its margin.
    assert QueueLeases(expiry_s).covers(GatewaySettings().max_timeout_s)
