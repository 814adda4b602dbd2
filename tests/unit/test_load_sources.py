"""A promotion from host memory is not a load, from the runtime's model host through the
worker's counters to the fleet page's series: a real ModelHost with room for one
TorchModel on its "device" loads two from the repository and promotes the first back."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import generate_latest

from modelfleet.gateway.loadrate import LoadRateRing
from modelfleet.repository import LocalStore
from modelfleet.runtime.host import ModelHost
from modelfleet.settings import MiB, RuntimeSettings
from modelfleet.worker.cachestats import CacheTally
from tests.unit.test_torch_model import infer, package


def gauge(name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", generate_latest().decode(), re.MULTILINE)
    assert match, name
    return float(match.group(1))


async def test_promotions_are_counted_apart_end_to_end(tmp_path: Path) -> None:
    package(tmp_path, "a")
    package(tmp_path, "b")
    host = ModelHost(RuntimeSettings(device_budget_bytes=70 * MiB, host_budget_bytes=200 * MiB),
                     LocalStore(tmp_path))
    now = [0.0]
    tally = CacheTally(lambda: now[0])
    ring = LoadRateRing(step_s=1)
    try:
        ring.observe("w", {"loads": tally.summary()["loads"], "resident": {}}, now=0)
        await infer(host, "a")
        await infer(host, "b")  # a is demoted to host memory
        await infer(host, "a")  # and promoted back: a copy, not a load
        stats = host.stats()
        tally.observe("runtime-0", stats)
        tally.publish_rates()
        assert gauge("modelfleet_model_loads_per_minute") == 2
        assert gauge("modelfleet_model_promotions_per_minute") == 1
        summary = tally.summary()
        assert summary["loads"] == {"repository": 2, "host": 1}
        assert summary["evictions"].get("demote", 0) >= 1
        assert summary["resident_bytes"]["device"] == stats.device_used_bytes
        now[0] = 30
        ring.observe("w", {"loads": summary["loads"],
                           "resident": {"device": list(stats.device),
                                        "host": list(stats.host)}}, now=30)
        (point,) = ring.series()["points"]
        assert (point["fleet"]["loads"], point["fleet"]["promotions"]) == (2, 1)
    finally:
        await host.close()
