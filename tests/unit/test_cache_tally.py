"""The worker's cache counters: promotions from host memory are not loads."""

from __future__ import annotations

import re

from prometheus_client import generate_latest

from modelfleet.ipc.protocol import Load, RuntimeStats
from modelfleet.worker.cachestats import CacheTally


def gauge(name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", generate_latest().decode(), re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_promotions_are_counted_apart_from_loads_and_age_out_of_the_minute() -> None:
    now = [1000.0]
    tally = CacheTally(lambda: now[0])
    tally.observe("runtime-0", RuntimeStats(
        device=("a", "b"), host=("c",), device_used_bytes=300, host_used_bytes=50,
        device_budget_bytes=1000, host_budget_bytes=2000,
        loads=(Load("a", "disk", 0.1, 100), Load("b", "repository", 0.2, 200),
               Load("c", "host", 0.01, 50)),
        evictions=(("demote", "c"),)))
    tally.observe("runtime-1", RuntimeStats(device_used_bytes=10, device_budget_bytes=1000,
                                            loads=(Load("d", "host", 0.01, 10),)))
    tally.publish_rates()
    assert gauge("modelfleet_model_loads_per_minute") == 2
    assert gauge("modelfleet_model_promotions_per_minute") == 2
    assert tally.summary() == {
        "resident_bytes": {"device": 310, "host": 50},
        "budget_bytes": {"device": 2000, "host": 2000},
        "loads": {"disk": 1, "repository": 1, "host": 2},
        "evictions": {"demote": 1},
    }
    now[0] += 61
    tally.forget("runtime-1")  # down: what it held is gone, its counts stay
    tally.publish_rates()
    assert gauge("modelfleet_model_loads_per_minute") == 0
    assert tally.summary()["resident_bytes"] == {"device": 300, "host": 50}
    assert tally.summary()["loads"]["host"] == 2
