"""Each runtime's memory against its budget, mirrored into the worker's metrics.

``Residency`` hands every runtime's stats answer to ``publish`` at each re-score, and
calls ``forget`` for a runtime that is down or retired (its series are removed, so a
scrape does not show a dead process's RSS).
"""

from __future__ import annotations

import contextlib

from modelfleet import metrics
from modelfleet.ipc.protocol import RuntimeStats

_GAUGES = (metrics.RUNTIME_RSS, metrics.RUNTIME_BUDGET, metrics.RUNTIME_RSS_STARTUP,
           metrics.RUNTIME_RSS_OVERHEAD,
           metrics.RUNTIME_RSS_LIMIT, metrics.RUNTIME_OVER_BUDGET,
           metrics.RUNTIME_DEVICE_RESERVED)


def publish(runtime: str, stats: RuntimeStats) -> None:
    if not stats.rss_bytes:
        return  # an in-process runtime: its RSS is the coordinator's, not its own
    metrics.RUNTIME_RSS.labels(runtime).set(stats.rss_bytes)
    metrics.RUNTIME_BUDGET.labels(runtime).set(stats.memory_budget_bytes)
    metrics.RUNTIME_RSS_STARTUP.labels(runtime).set(stats.rss_startup_bytes)
    metrics.RUNTIME_RSS_OVERHEAD.labels(runtime).set(stats.rss_overhead_bytes)
    metrics.RUNTIME_RSS_LIMIT.labels(runtime).set(stats.rss_limit_bytes)
    metrics.RUNTIME_OVER_BUDGET.labels(runtime).set(1 if stats.over_memory_budget else 0)
    metrics.RUNTIME_DEVICE_RESERVED.labels(runtime).set(stats.device_reserved_bytes)
    metrics.RUNTIME_LOADS_REFUSED.labels(runtime).inc(stats.loads_refused)


def forget(runtime: str) -> None:
    for gauge in _GAUGES:
        # KeyError: never published (in-process, or down before its first answer).
        with contextlib.suppress(KeyError):
            gauge.remove(runtime)
