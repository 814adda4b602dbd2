"""MissingQueues: a queue the broker said is missing is not asked for again until a
demand event names its model, its recheck time passed, or the events stream broke."""

from __future__ import annotations

from modelfleet.broker.missing_queues import MissingQueues
from tests.clock import ManualClock


def test_a_missing_queue_is_left_out_until_announced() -> None:
    missing = MissingQueues(ManualClock(), recheck_s=60)
    missing.found_missing({"a", "b"})
    assert missing.to_ask({"a", "b", "c"}) == {"c"}
    missing.appeared("a")  # a demand event: a task may wait there now
    assert missing.to_ask({"a", "b", "c"}) == {"a", "c"}
    assert "b" in missing and "a" not in missing


def test_a_missing_queue_is_asked_for_again_after_its_recheck_time() -> None:
    clock = ManualClock()
    missing = MissingQueues(clock, recheck_s=60)
    missing.found_missing({"old"})
    clock.now += 30
    missing.found_missing({"new"})
    clock.now += 30  # "old" was found missing 60 s ago, "new" 30 s ago
    assert missing.to_ask({"old", "new"}) == {"old"}
    assert len(missing) == 1
    clock.now += 30
    assert missing.to_ask({"old", "new"}) == {"old", "new"}
    assert len(missing) == 0  # aged out, not kept forever


def test_found_missing_again_restarts_its_recheck_time() -> None:
    clock = ManualClock()
    missing = MissingQueues(clock, recheck_s=60)
    missing.found_missing({"a", "b"})
    clock.now += 50
    missing.found_missing({"a"})  # asked again (announced, then gone) and still missing
    clock.now += 20
    assert missing.to_ask({"a", "b"}) == {"b"}


def test_a_broken_events_stream_forgets_every_mark() -> None:
    missing = MissingQueues(ManualClock(), recheck_s=60)
    missing.found_missing({"a", "b"})
    missing.forget_all()
    assert missing.to_ask({"a", "b"}) == {"a", "b"}
