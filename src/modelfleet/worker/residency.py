"""What this worker's runtimes hold, read from their ``stats``, mirrored into metrics.

Runtimes are separate processes; the worker's ``/metrics`` shows their caches by
asking each for its stats (a snapshot, plus the loads and evictions since the last
ask) at every re-score, and keeping the sums here.
"""

from __future__ import annotations

from collections.abc import Callable

from modelfleet import metrics
from modelfleet.errors import ModelfleetError
from modelfleet.ipc.protocol import RuntimeStats
from modelfleet.worker import runtime_memory
from modelfleet.worker.cachestats import CacheTally
from modelfleet.worker.supervised_runtime import SupervisedRuntime

_ByModel = dict[str, frozenset[str]]  # model id -> versions


class Residency:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._by_runtime: dict[str, dict[str, list[str]]] = {}  # runtime -> tier -> ids
        self._loading: dict[str, frozenset[str]] = {}  # runtime -> models loading on it
        # runtime -> (resident, pinned, loading) residency keys "model@version"
        self._versions: dict[str, tuple[tuple[str, ...], ...]] = {}
        self.tally = CacheTally(clock)  # loads by source, bytes per tier, load rates

    def models(self, tier: str) -> frozenset[str]:
        """Models resident in ``tier`` ("device" or "host") on any runtime of this worker."""
        return frozenset(m for tiers in self._by_runtime.values() for m in tiers.get(tier, []))

    def loading(self, runtime: str) -> frozenset[str]:
        """Models being loaded (or waiting for a load slot) on ``runtime`` at the last ask."""
        return self._loading.get(runtime, frozenset())

    async def refresh(self, runtimes: list[SupervisedRuntime]) -> None:
        totals = {"device": 0, "host": 0, "device_bytes": 0, "host_bytes": 0}
        for gone in set(self._by_runtime) - {r.name for r in runtimes}:
            del self._by_runtime[gone]  # retired: what it held is gone with it
            self._loading.pop(gone, None)
            self.tally.forget(gone)
            runtime_memory.forget(gone)
        for runtime in runtimes:
            target = runtime.runtime
            if not runtime.ready or target is None:
                self._by_runtime.pop(runtime.name, None)
                self._loading.pop(runtime.name, None)
                self.tally.forget(runtime.name)
                runtime_memory.forget(runtime.name)
                continue
            try:
                stats = await target.stats(timeout_s=5)
            except (ModelfleetError, TimeoutError):
                continue
            self._by_runtime[runtime.name] = {"device": list(stats.device),
                                              "host": list(stats.host)}
            self._loading[runtime.name] = frozenset(stats.loading)
            self._versions[runtime.name] = (stats.resident_versions, stats.pinned_versions,
                                            stats.loading_versions)
            totals["device"] += len(stats.device)
            totals["host"] += len(stats.host)
            totals["device_bytes"] += stats.device_used_bytes
            totals["host_bytes"] += stats.host_used_bytes
            self._count_events(stats)
            self.tally.observe(runtime.name, stats)
            runtime_memory.publish(runtime.name, stats)
        metrics.RESIDENT_MODELS.labels("device").set(totals["device"])
        metrics.RESIDENT_MODELS.labels("host").set(totals["host"])
        metrics.RESIDENT_BYTES.labels("device").set(totals["device_bytes"])
        metrics.RESIDENT_BYTES.labels("host").set(totals["host_bytes"])
        self.tally.publish_rates()  # storage loads and host promotions, per minute, apart

    def versions(self) -> tuple[_ByModel, _ByModel, _ByModel]:
        """(resident, pinned, loading) versions by model, on the runtimes up at the last ask."""
        found: list[dict[str, set[str]]] = [{}, {}, {}]
        for name, kinds in self._versions.items():
            if name not in self._by_runtime:
                continue  # down or retired: it holds nothing now
            for into, keys in zip(found, kinds, strict=True):
                for key in keys:
                    model_id, _, version = key.rpartition("@")
                    into.setdefault(model_id, set()).add(version)
        resident, pinned, loading = ({m: frozenset(vs) for m, vs in kind.items()}
                                     for kind in found)
        return resident, pinned, loading

    def _count_events(self, stats: RuntimeStats) -> None:
        for load in stats.loads:
            metrics.MODEL_LOADS.labels(load.source).inc()
            metrics.MODEL_LOAD_BYTES.labels(load.source).inc(load.size_bytes)
            metrics.MODEL_LOAD_SECONDS.labels(load.source).observe(load.seconds)
        for action, _model_id in stats.evictions:
            metrics.EVICTIONS.labels(action).inc()
        metrics.MODEL_LOAD_FAILURES.inc(stats.load_failures)
