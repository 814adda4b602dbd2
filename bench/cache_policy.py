"""LRU, GDSF and TinyLFU+GDSF on real artifact reads, beside the offline optimum.

Writes a catalog of model artifact files with log-normal sizes to a temp
folder, then replays one Zipf request trace through ``modelfleet.cache.ModelCache``
once per policy and budget. A hit costs nothing; a miss is a real load:

1. read the whole artifact from disk into memory (``readinto`` a buffer), then
   ``posix_fadvise(DONTNEED)`` so the OS page cache does not turn the next
   read of the same file into a memory copy (it is also dropped right after
   the catalog is written);
2. a fixed per-load CPU step standing in for deserialisation and module
   construction: parse a JSON "model graph" header of ``--header-layers``
   layers (the same for every model, so it costs the same whatever the size).

Both are timed with ``time.perf_counter``; the duration is what ``commit``
feeds the cost model and GDSF. Evictions drop the loaded buffer for real.
The host tier is off (budget 0): this compares device-tier policies only.

Beside the policies, offline optima in bytes loaded per request, computed on the same
trace (exact MIN with sizes is NP-hard, so it is bracketed by two standard bounds):

- ``static``: the best fixed set of residents for the trace's request counts (a greedy
  knapsack by count, leaving room to serve the largest model left out). Requests here
  are drawn independently (Zipf), so this is what an online policy can approach;

- ``belady``: an achievable offline schedule, Belady's MIN with sizes: on a miss,
  evict the residents whose next request is farthest in the future until the model
  fits (it must be resident to be served, as in the runtime). The optimum loads at
  most this much;
- ``bound``: PFOO-L (Berger, Beckmann & Harchol-Balter, SIGMETRICS 2018), a lower
  bound: the gaps between two requests of a model, each costing ``size x length`` of
  budget-time and saving ``size`` bytes, taken shortest first until ``budget x
  requests`` of budget-time is spent (the last one fractionally). The optimum loads
  at least this much.

    .venv/bin/python bench/cache_policy.py [--zipf 1.0] [--models 200]
        [--requests 3000] [--seed 0] [--budgets 0.1,0.25,0.5] [--total-mb 300]
        [--policies lru,gdsf,tinylfu] [--json]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from modelfleet.cache import POLICIES, LoadCostModel, ModelCache
from modelfleet.errors import ModelTooLarge

_MB = 1_000_000
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Result:
    policy: str
    budget_fraction: float
    hit_ratio: float
    bytes_loaded: int
    load_time_s: float | None  # None for the offline rows: they are computed, not run
    bytes_per_request: float


def drop_page_cache(fd: int) -> None:
    """Ask the kernel to forget this file's cached pages, so reads hit the disk."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def write_catalog(folder: Path, models: int, total_mb: float, rng: random.Random) -> list[int]:
    """Artifact files ``m{i}.bin`` of log-normal sizes summing to about ``total_mb``."""
    weights = [rng.lognormvariate(0.0, 1.0) for _ in range(models)]
    scale = total_mb * _MB / sum(weights)
    sizes = [max(4096, int(w * scale)) for w in weights]
    block = os.urandom(_CHUNK)  # incompressible; content is irrelevant otherwise
    for i, size in enumerate(sizes):
        with open(folder / f"m{i}.bin", "wb") as f:
            for start in range(0, size, _CHUNK):
                f.write(block[: min(_CHUNK, size - start)])
            f.flush()
            os.fsync(f.fileno())
            drop_page_cache(f.fileno())
    return sizes


def zipf_trace(models: int, requests: int, s: float, rng: random.Random) -> list[int]:
    """Request model indices; popularity rank is a random permutation (not tied to size)."""
    ranks = list(range(models))
    rng.shuffle(ranks)
    weights = [1.0 / (rank + 1) ** s for rank in ranks]
    return rng.choices(range(models), weights=weights, k=requests)


def make_header(layers: int) -> str:
    """The per-load deserialisation work: a JSON description of a model graph."""
    graph = [
        {"name": f"layer{i}", "op": "linear", "shape": [i % 97, 64], "attrs": {"bias": True}}
        for i in range(layers)
    ]
    return json.dumps({"graph": graph})


def load_artifact(path: Path, size: int, header: str) -> tuple[bytearray, float]:
    """Really load one model: read every byte, then 'deserialise'. Returns (buffer, seconds)."""
    started = time.perf_counter()
    buffer = bytearray(size)
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < size:
            n = os.readv(fd, [view[done : done + _CHUNK]])
            if n == 0:
                break
            done += n
        drop_page_cache(fd)
    finally:
        os.close(fd)
    json.loads(header)  # fixed part: same work for every model, whatever its size
    return buffer, time.perf_counter() - started


class Replayer:
    """One policy at one budget, stepped one request at a time."""

    def __init__(self, policy_name: str, budget_fraction: float, sizes: Sequence[int]) -> None:
        self.policy_name = policy_name
        self.budget_fraction = budget_fraction
        self.budget = int(budget_fraction * sum(sizes))
        self.cache = ModelCache(self.budget, 0, POLICIES[policy_name](), cost_model=LoadCostModel())
        self.sizes = sizes
        self.resident: dict[str, bytearray] = {}  # what the "runtime" really holds
        self.requests = 0
        self.hits = 0
        self.bytes_loaded = 0
        self.load_time_s = 0.0

    def step(self, index: int, folder: Path, header: str) -> None:
        self.requests += 1
        model_id = f"m{index}"
        if self.cache.hit(model_id) == "device":
            self.hits += 1
            return
        try:
            evictions = self.cache.reserve(model_id, self.sizes[index])
        except ModelTooLarge:
            evictions = None  # served straight from disk, never cached (same for both)
        for eviction in evictions or []:
            del self.resident[eviction.model_id]
        buffer, seconds = load_artifact(folder / f"{model_id}.bin", self.sizes[index], header)
        self.bytes_loaded += len(buffer)
        self.load_time_s += seconds
        if evictions is not None:
            self.resident[model_id] = buffer
            for eviction in self.cache.commit(model_id, len(buffer), seconds, "disk"):
                del self.resident[eviction.model_id]
        assert sum(len(b) for b in self.resident.values()) <= self.budget

    def result(self) -> Result:
        return Result(
            self.policy_name,
            self.budget_fraction,
            self.hits / max(1, self.requests),
            self.bytes_loaded,
            self.load_time_s,
            self.bytes_loaded / max(1, self.requests),
        )


def replay_interleaved(
    budget_fraction: float,
    folder: Path,
    sizes: Sequence[int],
    trace: Sequence[int],
    header: str,
    policies: Sequence[str] = ("lru", "gdsf", "tinylfu"),
) -> list[Result]:
    """All policies in lock-step over the same trace, so that whatever else the
    machine is doing (other processes, disk contention) slows them alike."""
    replayers = [Replayer(name, budget_fraction, sizes) for name in policies]
    for position, index in enumerate(trace):
        # Rotate who goes first, so none always reads right after another.
        shift = position % len(replayers)
        for replayer in replayers[shift:] + replayers[:shift]:
            replayer.step(index, folder, header)
    return [replayer.result() for replayer in replayers]


def next_uses(trace: Sequence[int]) -> list[int]:
    """For each position, the position of the same model's next request (len(trace): none)."""
    following = [len(trace)] * len(trace)
    last: dict[int, int] = {}
    for position in range(len(trace) - 1, -1, -1):
        following[position] = last.get(trace[position], len(trace))
        last[trace[position]] = position
    return following


def belady(sizes: Sequence[int], trace: Sequence[int], budget: int) -> tuple[int, int]:
    """Belady's MIN with sizes: (hits, bytes loaded). An achievable offline schedule."""
    following = next_uses(trace)
    resident: dict[int, int] = {}  # model -> its next request
    farthest: list[tuple[int, int]] = []  # (-next request, model), lazily deleted
    used = hits = loaded = 0
    for position, model in enumerate(trace):
        if model in resident:
            hits += 1
        else:
            loaded += sizes[model]
            if sizes[model] > budget:
                continue  # served straight from disk, never cached (as the replayers do)
            while used + sizes[model] > budget:
                negative, victim = heapq.heappop(farthest)
                if resident.get(victim) == -negative:
                    del resident[victim]
                    used -= sizes[victim]
            used += sizes[model]
        resident[model] = following[position]
        heapq.heappush(farthest, (-following[position], model))
    return hits, loaded


def pfoo_lower_bound(sizes: Sequence[int], trace: Sequence[int], budget: int) -> tuple[int, int]:
    """PFOO-L: (hits, bytes loaded) no schedule can beat at this budget (a lower bound
    on bytes; hits may be fractional in the relaxation, rounded down here)."""
    following = next_uses(trace)
    gaps = sorted(
        (following[p] - p, trace[p])
        for p in range(len(trace))
        if following[p] < len(trace) and sizes[trace[p]] <= budget
    )
    capacity = float(budget) * len(trace)  # budget-time: bytes x requests
    saved = 0.0
    hits = 0.0
    for length, model in gaps:
        cost = float(sizes[model]) * length
        if cost > capacity:
            saved += sizes[model] * capacity / cost
            hits += capacity / cost
            break
        capacity -= cost
        saved += sizes[model]
        hits += 1
    requested = sum(sizes[model] for model in trace)
    return int(hits), int(requested - saved)


def static_optimum(sizes: Sequence[int], trace: Sequence[int], budget: int) -> tuple[int, int]:
    """The best fixed set of residents for this trace's request counts: (hits, bytes
    loaded). A greedy 0/1 knapsack (keeping a model saves its bytes on every request but
    the first, so models go in by request count), leaving room to serve the largest model
    left out, as a runtime must. What an online policy can hope for when popularity does
    not change (requests drawn independently, as here)."""
    counts = Counter(trace)
    order = sorted(counts, key=lambda m: (-counts[m], sizes[m], m))
    margin, chosen = 0, set[int]()
    for _ in range(8):  # the margin depends on what is left out: iterate to a fixed point
        chosen, used = set(), 0
        for model in order:
            if counts[model] > 1 and used + sizes[model] <= budget - margin:
                chosen.add(model)
                used += sizes[model]
        left_out = [sizes[m] for m in counts if m not in chosen and sizes[m] <= budget]
        new_margin = max(left_out, default=0)
        if new_margin == margin:
            break
        margin = max(margin, new_margin)
    hits = sum(counts[m] - 1 for m in chosen)
    loaded = sum(sizes[m] * (1 if m in chosen else counts[m]) for m in counts)
    return hits, loaded


def offline_results(budget_fraction: float, sizes: Sequence[int],
                    trace: Sequence[int]) -> list[Result]:
    budget = int(budget_fraction * sum(sizes))
    rows = []
    for name, solve in (("static", static_optimum), ("belady", belady),
                        ("bound", pfoo_lower_bound)):
        hits, loaded = solve(sizes, trace, budget)
        rows.append(Result(name, budget_fraction, hits / max(1, len(trace)), loaded, None,
                           loaded / max(1, len(trace))))
    return rows


def print_table(results: list[Result], overhead_ms: float, args: argparse.Namespace) -> None:
    print(
        f"{args.models} models, {args.total_mb:g} MB catalog (log-normal sizes), "
        f"{args.requests} requests, Zipf s={args.zipf}, seed {args.seed}"
    )
    print(
        f"miss = real read from disk (page cache dropped with POSIX_FADV_DONTNEED after "
        f"each write and read) + fixed {overhead_ms:.1f} ms JSON-header parse per load"
    )
    print("offline: static = best fixed set for these counts; belady = Belady's MIN with "
          "sizes (achievable, optimum <= it); bound = PFOO-L lower bound (optimum >= it)")
    print()
    header = (
        f"{'policy':<8} {'budget':>6} {'hit ratio':>9} {'MB/request':>10} {'MB loaded':>10}"
        f" {'load time s':>11} {'bytes/static':>12} {'bytes/belady':>12} {'time/LRU':>8}"
    )
    print(header)
    print("-" * len(header))
    by_key = {(r.policy, r.budget_fraction): r for r in results}
    for r in results:
        best = by_key.get(("belady", r.budget_fraction))
        static = by_key.get(("static", r.budget_fraction))
        vs_static = (f"{r.bytes_loaded / max(1, static.bytes_loaded):>12.2f}" if static
                     else f"{'':>12}")
        lru = by_key.get(("lru", r.budget_fraction))
        vs_best = f"{r.bytes_loaded / max(1, best.bytes_loaded):>12.2f}" if best else f"{'':>12}"
        timed = r.load_time_s is not None
        time_s = f"{r.load_time_s:>11.2f}" if timed else f"{'offline':>11}"
        vs_lru = (f"{r.load_time_s / lru.load_time_s:>8.2f}"
                  if timed and lru is not None and lru.load_time_s and r.policy != "lru"
                  else f"{'':>8}")
        print(
            f"{r.policy:<8} {r.budget_fraction:>6.0%} {r.hit_ratio:>9.3f} "
            f"{r.bytes_per_request / _MB:>10.3f} {r.bytes_loaded / _MB:>10.1f} {time_s} "
            f"{vs_static} {vs_best} {vs_lru}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent s")
    parser.add_argument("--models", type=int, default=200)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budgets", default="0.1,0.25,0.5", help="fractions of catalog bytes")
    parser.add_argument("--total-mb", type=float, default=300.0, help="catalog size on disk")
    parser.add_argument("--header-layers", type=int, default=2000, help="fixed per-load work")
    parser.add_argument("--policies", default="lru,gdsf,tinylfu",
                        help=f"comma-separated, from {', '.join(POLICIES)}")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    args = parser.parse_args(argv)
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    if not budgets or any(not 0 < b <= 1 or math.isnan(b) for b in budgets):
        parser.error("--budgets: comma-separated fractions in (0, 1]")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if not policies or unknown:
        parser.error(f"--policies: unknown {', '.join(unknown) or '(none given)'}; "
                     f"choose from {', '.join(POLICIES)}")

    rng = random.Random(args.seed)
    header = make_header(args.header_layers)
    started = time.perf_counter()
    for _ in range(20):
        json.loads(header)
    overhead_ms = (time.perf_counter() - started) / 20 * 1000
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="modelfleet-bench-cache-") as tmp:
        folder = Path(tmp)
        sizes = write_catalog(folder, args.models, args.total_mb, rng)
        trace = zipf_trace(args.models, args.requests, args.zipf, rng)
        for budget in budgets:
            results.extend(replay_interleaved(budget, folder, sizes, trace, header, policies))
            results.extend(offline_results(budget, sizes, trace))
    if args.json:
        json.dump([asdict(r) for r in results], sys.stdout, indent=2)
        print()
        print(
            "page cache dropped (POSIX_FADV_DONTNEED) after each write and read; "
            f"fixed per-load step {overhead_ms:.1f} ms",
            file=sys.stderr,
        )
    else:
        print_table(results, overhead_ms, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
