"""Pure helpers of the peers bench: the Zipf sampler, percentiles, summaries, ratios.

Standard library only: the load generator imports this from its own venv, the tests and
the orchestrator from the repository's.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
import re
from collections.abc import Sequence
from typing import Any


class Zipf:
    """Ranks 0..n-1 drawn with P(k) proportional to 1 / (k + 1) ** s; seeded, reproducible."""

    def __init__(self, n: int, s: float = 1.0, seed: int = 0) -> None:
        if n < 1:
            raise ValueError("n must be >= 1")
        weights = [1.0 / (k + 1) ** s for k in range(n)]
        total = sum(weights)
        self.probabilities = [w / total for w in weights]
        self._cdf = list(itertools.accumulate(self.probabilities))
        self._cdf[-1] = 1.0
        self._rng = random.Random(seed)

    def __call__(self) -> int:
        return bisect.bisect_right(self._cdf, self._rng.random())

    def sample(self, count: int) -> list[int]:
        return [self() for _ in range(count)]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linearly interpolated (numpy's default method)."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within 0..100, got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(latencies_s: Sequence[float], seconds: float, errors: int = 0,
              timeouts: int = 0) -> dict[str, Any]:
    """Throughput and latency of a measured window; latencies of successful answers only.

    ``req_per_s`` counts successful answers (status 200) per second of the window.
    """
    ms = [x * 1000 for x in latencies_s]
    return {
        "ok": len(ms),
        "errors": errors,
        "timeouts": timeouts,
        "seconds": round(seconds, 3),
        "req_per_s": round(len(ms) / seconds, 2) if seconds > 0 else math.nan,
        "p50_ms": _round(percentile(ms, 50)),
        "p90_ms": _round(percentile(ms, 90)),
        "p99_ms": _round(percentile(ms, 99)),
        "max_ms": _round(max(ms)) if ms else math.nan,
        "mean_ms": _round(sum(ms) / len(ms)) if ms else math.nan,
    }


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base rounded to 2 decimals; None when either is missing, zero base or NaN."""
    if value is None or base is None:
        return None
    if any(isinstance(v, float) and math.isnan(v) for v in (value, base)) or base == 0:
        return None
    return round(value / base, 2)


def _round(x: float) -> float:
    return x if math.isnan(x) else round(x, 3)


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus text exposition: (name, labels, value)."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        samples.append((match.group(1), labels, value))
    return samples


def fold_prometheus(text: str, prefix: str = "modelfleet_",
                    drop_labels: tuple[str, ...] = ("model",)) -> dict[str, float]:
    """Samples named ``prefix*`` summed over the ``drop_labels`` (histogram buckets and
    ``_created`` left out), keyed ``name{label="v",...}`` with labels sorted."""
    out: dict[str, float] = {}
    for name, labels, value in parse_prometheus(text):
        if not name.startswith(prefix) or name.endswith(("_bucket", "_created")):
            continue
        kept = sorted((k, v) for k, v in labels.items() if k not in drop_labels)
        key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in kept) + "}" if kept else "")
        out[key] = out.get(key, 0.0) + value
    return out


def metric_total(folded: dict[str, float], name: str, **labels: str) -> float | None:
    """The sum of a folded metric's entries whose labels include ``labels``; None if absent."""
    total, seen = 0.0, False
    for key, value in folded.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
            seen = True
    return total if seen else None


def metric_by_label(folded: dict[str, float], name: str, label: str) -> dict[str, float]:
    """A folded metric's entries summed per value of ``label`` (e.g. loads by source)."""
    out: dict[str, float] = {}
    pattern = re.compile(rf'(?:^|,){re.escape(label)}="((?:[^"\\]|\\.)*)"')
    for key, value in folded.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        match = pattern.search(rest.rstrip("}"))
        if match:
            out[match.group(1)] = out.get(match.group(1), 0.0) + value
    return out


def counter_delta(start: dict[str, float], end: dict[str, float]) -> dict[str, float]:
    """end - start for the counters (``*_total``, ``*_count``, ``*_sum``) in ``end``."""
    return {key: round(value - start.get(key, 0.0), 6) for key, value in end.items()
            if key.partition("{")[0].endswith(("_total", "_count", "_sum"))}
