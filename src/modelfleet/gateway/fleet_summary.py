"""The fleet as one gateway sees it: the /dashboard page's data and the autoscaling gauges.

Built from what the gateway already has, never by calling a worker: the workers'
published ``worker_state`` events (``FleetView``), the broker's exact counts for the
queues with demand (any gateway's announcements, workers' subscriptions and resident
models, this gateway's parked requests) and for the cold lanes, and this gateway's
parked requests' ages. A resident model whose queue the broker said is missing is not
counted again while nothing announces a task for it (``broker/missing_queues.py``):
at thousands of models most resident ones have none, and each scrape asked for them all.
Every gateway computes the same fleet-wide figures (aggregate them with ``max``).

Bounded at any catalog size: ``queues`` holds the ``gateway.fleet_summary_models``
most active queues (by backlog, then the oldest wait, then consumers), and
``queues_omitted`` the count and the summed backlog and consumers of the rest; each
worker's model lists (``subscriptions``, ``resident.device``, ``resident.host``) keep
their first that many names, and ``counts`` says how many each holds in all.

Desired workers: enough that the work now in the fleet (permits in use plus the
backlog) fills ``target_permit_utilization`` of their permits:
``ceil((in_use + backlog) / (permits per worker x target))``, 0 with no work at all.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

from modelfleet import metrics
from modelfleet.broker.base import COLD_LANE, Broker, cold_lane
from modelfleet.broker.missing_queues import MissingQueues
from modelfleet.errors import BrokerError
from modelfleet.gateway.fleet import FleetView
from modelfleet.gateway.parking import ParkedRequests
from modelfleet.labels import OTHER, top_n
from modelfleet.settings import Settings

MIN_REFRESH_S = 1.0  # scrapes and page polls share one count of the queues per second
# Counting is one passive declare per queue with demand (~0.6 ms each on RabbitMQ): with
# thousands of models in demand a count takes a second or more, so the next one waits
# at least this many times as long as the last took (counting takes <= 1/5 of the time).
REFRESH_COST_FACTOR = 5.0


def desired_workers(in_use: int, backlog: int, permits_per_worker: float,
                    target_utilization: float) -> int:
    work = in_use + backlog
    if work <= 0:
        return 0
    return math.ceil(work / (max(permits_per_worker, 1.0) * target_utilization))


class FleetSummary:
    def __init__(self, settings: Settings, broker: Broker, fleet: FleetView,
                 parked: ParkedRequests, clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._broker = broker
        self._fleet = fleet
        self._parked = parked
        self._clock = clock
        self._lock = asyncio.Lock()
        self._missing = MissingQueues(clock)
        self._built_at = -math.inf
        self._min_interval_s = MIN_REFRESH_S
        self._last: dict[str, Any] = {}
        self._labelled: dict[str, set[str]] = {"backlog": set(), "oldest": set()}

    async def get(self, worker: str | None = None) -> dict[str, Any]:
        """The current summary (at most ``MIN_REFRESH_S`` old, or longer when counting
        the queues is slow); sets the fleet gauges. Its load-rate series is the fleet's,
        with ``worker``'s own beside it when one is named."""
        summary = await self._current()
        if worker is None:
            return summary
        return {**summary, "load_rate": self._fleet.load_rates.series({worker})}

    async def _current(self) -> dict[str, Any]:
        async with self._lock:
            started = self._clock()
            if started - self._built_at >= self._min_interval_s:
                self._last = await self._build()
                self._built_at = self._clock()
                self._min_interval_s = max(MIN_REFRESH_S, REFRESH_COST_FACTOR
                                           * (self._built_at - started))
                self._publish(self._last)
            return self._last

    async def _build(self) -> dict[str, Any]:
        workers = sorted(self._fleet.workers(), key=lambda w: str(w.get("worker_id")))
        self._fleet.sample_load_rates()
        oldest = self._parked.oldest_waiting_s()
        # Queues with work or a consumer are counted at every build; those of models only
        # resident somewhere, unless the broker said lately that they have none.
        wanted = set(self._fleet.in_demand()) | set(oldest)
        resident_models: set[str] = set()
        for state in workers:
            resident = state.get("resident") or {}
            wanted.update(state.get("subscriptions", []))
            resident_models.update(resident.get("device", []), resident.get("host", []))
        models = wanted | resident_models
        ask = wanted | self._missing.to_ask(resident_models - wanted)
        # The cold lanes hold work too (a model no worker pulls): counted with the rest.
        lanes = [cold_lane(p) for p in
                 sorted({0, *self._settings.scheduling.plan_priority.values()})]
        broker_error = ""
        try:
            counts = await self._broker.queue_stats([*sorted(ask), *lanes])
            self._missing.found_missing(ask - counts.keys())
        except BrokerError as exc:  # the page still shows the workers
            counts, broker_error = {}, str(exc)
        in_lanes = sum(counts.pop(lane).backlog for lane in lanes if lane in counts)
        limit = self._settings.gateway.fleet_summary_models
        ranked = sorted(models, key=lambda m: (
            -(counts[m].backlog if m in counts else 0), -oldest.get(m, 0.0),
            -(counts[m].consumers if m in counts else 0), m))
        shown, rest = sorted(ranked[:limit]), ranked[limit:]
        queues = [{"model": model_id,
                   "backlog": counts[model_id].backlog if model_id in counts else None,
                   "consumers": counts[model_id].consumers if model_id in counts else None,
                   "oldest_waiting_s": (round(oldest[model_id], 3) if model_id in oldest
                                        else None),  # None: nothing waits on this gateway
                   "warm_on": self._fleet.warm_on(model_id)}
                  for model_id in shown]
        omitted = {"queues": len(rest),
                   "backlog": sum(counts[m].backlog for m in rest if m in counts),
                   "consumers": sum(counts[m].consumers for m in rest if m in counts)}
        in_use = sum(int(w.get("permits_in_use", 0)) for w in workers)
        cap = sum(int(w.get("permits_cap", 0)) for w in workers)
        backlog = sum(qs.backlog for qs in counts.values()) + in_lanes
        per_worker = cap / len(workers) if workers else float(self._settings.worker.permits)
        rates = self._fleet.load_rates.series(workers_shown=())
        totals = {
            "workers": len(workers),
            "ready_workers": sum(1 for w in workers if w.get("ready")),
            "permits_in_use": in_use,
            "permits_cap": cap,
            "permit_utilization": round(in_use / cap, 4) if cap else 0.0,
            # Unknown, not 0, when the broker could not count: a 0 would tell an
            # autoscaler to shrink the fleet because the broker is down.
            "backlog": None if broker_error else backlog,
            "cold_lane_backlog": None if broker_error else in_lanes,  # part of backlog
            "desired_workers": None if broker_error else desired_workers(
                in_use, backlog, per_worker, self._settings.gateway.target_permit_utilization),
            "resident_device": sum(len((w.get("resident") or {}).get("device", []))
                                   for w in workers),
            "resident_host": sum(len((w.get("resident") or {}).get("host", []))
                                 for w in workers),
            "storage_loads": sum(int((w.get("loads") or {}).get(s, 0)) for w in workers
                                 for s in ("repository", "disk")),
            "promotions": sum(int((w.get("loads") or {}).get("host", 0)) for w in workers),
            "requests_waiting": len(self._parked),
        }
        return {"at": time.time(), "totals": totals,
                "workers": [_bounded(w, limit) for w in workers], "queues": queues,
                "queues_omitted": omitted, "load_rate": rates, "broker_error": broker_error}

    def _publish(self, summary: dict[str, Any]) -> None:
        totals = summary["totals"]
        metrics.FLEET_WORKERS.set(totals["workers"])
        metrics.FLEET_PERMITS_IN_USE.set(totals["permits_in_use"])
        metrics.FLEET_PERMITS_CAP.set(totals["permits_cap"])
        metrics.FLEET_PERMIT_UTILIZATION.set(totals["permit_utilization"])
        if totals["backlog"] is None:  # not counted: the gauges keep their last values
            return
        metrics.FLEET_DESIRED_WORKERS.set(totals["desired_workers"])
        metrics.FLEET_TOTAL_BACKLOG.set(totals["backlog"])
        limit = self._settings.gateway.fleet_metrics_models
        queues = summary["queues"]
        backlogs = top_n({q["model"]: q["backlog"] for q in queues
                          if q["backlog"] is not None}, limit)
        backlogs[OTHER] += summary["queues_omitted"]["backlog"]  # the tail, not shown
        # Tasks in the cold lanes are of models nobody pulls; the broker cannot say whose.
        backlogs[COLD_LANE] = totals["cold_lane_backlog"]
        self._set_top(metrics.FLEET_BACKLOG, "backlog", backlogs)
        self._set_top(metrics.FLEET_OLDEST_WAITING, "oldest",
                      top_n({q["model"]: q["oldest_waiting_s"] for q in queues
                             if q["oldest_waiting_s"] is not None}, limit, combine=max))

    def _set_top(self, gauge: Any, key: str, values: dict[str, float]) -> None:
        """Set ``values`` and remove the labels of models that dropped out of the top N
        (a gauge nobody updates would go stale)."""
        for gone in self._labelled[key] - set(values):
            gauge.remove(gone)
        for model, value in values.items():
            gauge.labels(model).set(value)
        self._labelled[key] = set(values) | {OTHER}


def _bounded(state: dict[str, Any], limit: int) -> dict[str, Any]:
    """A worker's state with each model list cut to its first ``limit`` names, and
    ``counts`` of them all."""
    resident = state.get("resident") or {}
    subscriptions = list(state.get("subscriptions") or [])
    device, host = list(resident.get("device") or []), list(resident.get("host") or [])
    return {**state, "subscriptions": subscriptions[:limit],
            "resident": {**resident, "device": device[:limit], "host": host[:limit]},
            "counts": {"subscriptions": len(subscriptions), "device": len(device),
                       "host": len(host)}}
