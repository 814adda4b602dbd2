"""The statistics extension of the Open Inference Protocol, fleet-wide at every gateway.

    GET /v2/models/stats                         every model that has served a request
    GET /v2/models/{m}/stats                     one model, each version that served
    GET /v2/models/{m}/versions/{v}/stats        one version

Built from what the fleet already measures: each answered request's reply carries the
phases its worker timed (queue wait, payload fetch, preprocess, predict, postprocess),
and the gateway times the whole exchange. Every gateway counts the requests it
answered and, every ``PUBLISH_INTERVAL_S`` while its counts changed, publishes its
cumulative counts of the models that changed as an event (``{"kind":
"inference_stats"}``); every gateway sums the latest counts of all gateways. So a
gateway's own requests count at once and other gateways' within about
``PUBLISH_INTERVAL_S`` (plus the broker's event latency); counts are cumulative since
each gateway started, and a gateway that stops keeps its last counts in the sum.

The protocol's phases, as modelfleet fills them:

| field | modelfleet's measure |
|---|---|
| success / fail | requests answered 200 / with an error, and their time at the gateway |
| queue | the task's wait in the broker until a worker took it |
| compute_input | payload fetch + preprocess (the v2 decode included) |
| compute_infer | predict (the model's share of its batch) |
| compute_output | postprocess (the v2 encode included) |
| batch_stats | by the request's batch size (a v2 request's first dimension; /v1: 1) |

Cold loads are not a protocol phase; ``modelfleet_phase_seconds{phase="model_load"}``
and the fleet page count them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

PUBLISH_INTERVAL_S = 2.0
EVENT_KIND = "inference_stats"
MAX_BATCH_SIZES = 32  # distinct batch sizes kept per model version; larger ones pool

_INPUT_PHASES = ("payload_fetch", "preprocess")
_PHASES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
_BATCH_PHASES = ("compute_input", "compute_infer", "compute_output")


def _ns(ms: float) -> int:
    return int(ms * 1_000_000)


@dataclass
class VersionStats:
    """One model version's counts on one gateway: [count, ns] per phase."""

    phases: dict[str, list[int]] = field(
        default_factory=lambda: {phase: [0, 0] for phase in _PHASES})
    batches: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0

    def add(self, ok: bool, total_s: float, timings_ms: dict[str, float], batch_size: int,
            at_ms: int) -> None:
        outcome = self.phases["success" if ok else "fail"]
        outcome[0] += 1
        outcome[1] += int(total_s * 1e9)
        self.last_inference_ms = max(self.last_inference_ms, at_ms)
        if not ok:
            return
        self.inference_count += batch_size
        self.execution_count += 1
        spans = {"queue": timings_ms.get("queue_wait", 0.0),
                 "compute_input": sum(timings_ms.get(p, 0.0) for p in _INPUT_PHASES),
                 "compute_infer": timings_ms.get("predict", 0.0),
                 "compute_output": timings_ms.get("postprocess", 0.0)}
        for phase, ms in spans.items():
            self.phases[phase][0] += 1
            self.phases[phase][1] += _ns(ms)
        if batch_size not in self.batches and len(self.batches) >= MAX_BATCH_SIZES:
            batch_size = max(self.batches)
        batch = self.batches.setdefault(batch_size, {p: [0, 0] for p in _BATCH_PHASES})
        for phase in _BATCH_PHASES:
            batch[phase][0] += 1
            batch[phase][1] += _ns(spans[phase])

    def to_wire(self) -> dict[str, Any]:
        return {"phases": self.phases, "batches": {str(k): v for k, v in self.batches.items()},
                "inference_count": self.inference_count,
                "execution_count": self.execution_count, "last": self.last_inference_ms}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> VersionStats:
        phases = {p: [int(x) for x in data.get("phases", {}).get(p, [0, 0])[:2]]
                  for p in _PHASES}
        batches = {int(k): {p: [int(x) for x in v.get(p, [0, 0])[:2]] for p in _BATCH_PHASES}
                   for k, v in data.get("batches", {}).items()}
        return cls(phases, batches, int(data.get("inference_count", 0)),
                   int(data.get("execution_count", 0)), int(data.get("last", 0)))

    def merged(self, other: VersionStats) -> VersionStats:
        total = VersionStats()
        for source in (self, other):
            for phase, (count, ns) in source.phases.items():
                total.phases[phase][0] += count
                total.phases[phase][1] += ns
            for size, phases in source.batches.items():
                into = total.batches.setdefault(size, {p: [0, 0] for p in _BATCH_PHASES})
                for phase, (count, ns) in phases.items():
                    into[phase][0] += count
                    into[phase][1] += ns
            total.inference_count += source.inference_count
            total.execution_count += source.execution_count
            total.last_inference_ms = max(total.last_inference_ms, source.last_inference_ms)
        return total


Key = tuple[str, str]  # (model, version)


class InferenceStatistics:
    """This gateway's counts, the other gateways' latest, and their sum."""

    def __init__(self, gateway_id: str, clock: Callable[[], float] = time.time) -> None:
        self.gateway_id = gateway_id
        self._clock = clock
        self._own: dict[Key, VersionStats] = {}
        self._changed: set[Key] = set()
        self._others: dict[str, dict[Key, VersionStats]] = {}

    def record(self, model: str, version: str, ok: bool, total_s: float,
               timings_ms: dict[str, float], batch_size: int = 1) -> None:
        """One request this gateway answered (or failed) for a model in the catalog."""
        key = (model, version)
        self._own.setdefault(key, VersionStats()).add(
            ok, total_s, timings_ms, max(1, batch_size), int(self._clock() * 1000))
        self._changed.add(key)

    def event(self) -> dict[str, Any] | None:
        """The cumulative counts of what changed since the last event; None if nothing did."""
        if not self._changed:
            return None
        changed, self._changed = self._changed, set()
        return {"kind": EVENT_KIND, "gateway_id": self.gateway_id,
                "models": [[m, v, self._own[(m, v)].to_wire()] for m, v in sorted(changed)]}

    def unsent(self, event: dict[str, Any]) -> None:
        """An event that could not be published: its models go out with the next one."""
        self._changed.update((str(m), str(v)) for m, v, _ in event["models"])

    def observe(self, event: dict[str, Any]) -> None:
        """Another gateway's counts (an event of our own is ignored: ours are live)."""
        if event.get("kind") != EVENT_KIND or event.get("gateway_id") == self.gateway_id:
            return
        gateway = str(event.get("gateway_id", ""))
        models = event.get("models")
        if not gateway or not isinstance(models, list):
            return
        theirs = self._others.setdefault(gateway, {})
        for item in models:
            if isinstance(item, list) and len(item) == 3 and isinstance(item[2], dict):
                try:
                    theirs[(str(item[0]), str(item[1]))] = VersionStats.from_wire(item[2])
                except (TypeError, ValueError, AttributeError):
                    continue  # a malformed entry from a newer or broken peer: skip it

    def fleet(self, model: str | None = None, version: str | None = None
              ) -> dict[Key, VersionStats]:
        """Summed over every gateway, optionally for one model (and version)."""
        total: dict[Key, VersionStats] = {}
        for source in (self._own, *self._others.values()):
            for key, stats in source.items():
                if (model is not None and key[0] != model) or \
                        (version is not None and key[1] != version):
                    continue
                total[key] = total[key].merged(stats) if key in total else stats
        return total


def _duration(pair: list[int]) -> dict[str, int]:
    return {"count": pair[0], "ns": pair[1]}


def model_stats(stats: dict[Key, VersionStats]) -> dict[str, Any]:
    """The protocol's (Triton's) statistics body for ``stats``."""
    return {"model_stats": [_one(model, version, s) for (model, version), s in sorted(
        stats.items())]}


def _one(model: str, version: str, s: VersionStats) -> dict[str, Any]:
    inference = {phase: _duration(s.phases[phase]) for phase in _PHASES}
    inference["cache_hit"] = {"count": 0, "ns": 0}  # no response cache
    inference["cache_miss"] = {"count": 0, "ns": 0}
    return {
        "name": model, "version": version, "last_inference": s.last_inference_ms,
        "inference_count": s.inference_count, "execution_count": s.execution_count,
        "inference_stats": inference,
        "batch_stats": [{"batch_size": size, **{p: _duration(v[p]) for p in _BATCH_PHASES}}
                        for size, v in sorted(s.batches.items())],
        "memory_usage": [],
    }


def empty_stats(model: str, versions: Iterable[str]) -> dict[Key, VersionStats]:
    """Zero counts for versions that exist but have not served yet."""
    return {(model, v): VersionStats() for v in versions}
