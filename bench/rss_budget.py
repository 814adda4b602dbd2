"""Does a runtime's RSS follow its budget? One real runtime process per allocator option.

The catalog is bench/peers' (two-layer numpy MLPs in uncompressed ``.npz``, loaded by the
peers' shared load code), here 30 models of 1-36 MB. For each option below, a fresh
``python -m modelfleet.runtime`` process (started the way the worker starts one) serves a
Zipf trace of ``load`` requests from two clients at once, with a device budget of 88 MB
and no host tier (an evicted model is dropped): an LRU of real arrays. After every
request the bench samples the process's RSS.

Options (the runtime settings and environment each run starts with):

- ``glibc defaults``: ``malloc_mmap_threshold_bytes=0``, no trim (the behaviour before);
- ``MALLOC_MMAP_THRESHOLD_=131072``: glibc's own variable, every allocation of 128 KiB
  or more is a mapping of its own;
- ``MALLOC_ARENA_MAX=1``: one malloc arena for all threads;
- ``malloc_trim after evictions``: glibc's thresholds, ``malloc_trim(0)`` after each;
- ``mmap threshold N MiB``: ``mallopt(M_MMAP_THRESHOLD, N MiB)`` at start-up (fixed, so
  it no longer rises), with or without the trim.

Columns: RSS at start-up (after imports, before any model), the peak and the end, the
peak's excess over start-up + budget, model loads, load throughput (artifact bytes /
wall seconds of the loads, as the runtime measured them) and the runtime process's CPU
seconds per GB loaded (steadier than wall time on a busy machine), and the RSS once every
model is unloaded again (what the runtime keeps that is not a model's). "overhead" is the
guard's base: start-up plus what the first loads' imports added. The memory guard is
off (``rss_margin`` 100) in every row but the last: they measure the allocator; the last
row is the default with the guard on, and counts the loads it refused.

    PYTHONPATH=src .venv/bin/python bench/rss_budget.py [--requests 400] [--budget-mb 88]
        [--only NAME,...] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import psutil

from modelfleet.errors import NoCapacity
from modelfleet.ipc.protocol import SETTINGS_ENV
from modelfleet.settings import MiB, Settings
from modelfleet.worker.process_launcher import ProcessLauncher

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))
import catalog as peers_catalog  # noqa: E402  (bench/peers' catalog, on its own path)

MB = 1_000_000


@dataclass(frozen=True)
class Option:
    name: str
    mmap_threshold: int = 0
    trim: bool = False
    env: dict[str, str] = field(default_factory=dict)
    margin: float = 100  # the memory guard off, unless a row says otherwise


OPTIONS = (
    Option("glibc defaults"),
    Option("MALLOC_MMAP_THRESHOLD_=131072", env={"MALLOC_MMAP_THRESHOLD_": "131072"}),
    Option("MALLOC_ARENA_MAX=1", env={"MALLOC_ARENA_MAX": "1"}),
    Option("malloc_trim after evictions", trim=True),
    Option("mmap threshold 1 MiB + trim (default)", 1 * MiB, True),
    Option("mmap threshold 2 MiB", 2 * MiB, False),
    Option("mmap threshold 2 MiB + trim", 2 * MiB, True),
    Option("mmap threshold 4 MiB + trim", 4 * MiB, True),
    Option("default, guard on (rss_margin 0.25)", 1 * MiB, True, margin=0.25),
)


@dataclass
class Result:
    option: str
    budget_mb: float
    start_mb: float
    overhead_mb: float  # start-up + what the first loads' imports added (the guard's base)
    peak_mb: float
    end_mb: float
    peak_excess_mb: float  # peak - (start + budget)
    loads: int
    refused: int  # loads refused over the memory budget (only with the guard on)
    emptied_mb: float  # RSS once every model is unloaded again
    load_gb_s: float
    cpu_s_per_gb: float


def trace(n_models: int, requests: int, seed: int = 7) -> list[str]:
    ranks = np.arange(1, n_models + 1, dtype=float)
    p = 1 / ranks
    rng = np.random.default_rng(seed)
    picks = rng.choice(n_models, size=requests, p=p / p.sum())
    return [peers_catalog.model_name(int(i)) for i in picks]


async def run_option(option: Option, repo: Path, work: Path, budget: int,
                     requests: list[str]) -> Result:
    settings = Settings(repo=str(repo), state_dir=str(work / "state"), log_level="warning",
                        runtime={
        "device_budget_bytes": budget, "host_budget_bytes": 0,
        "malloc_mmap_threshold_bytes": option.mmap_threshold,
        "trim_after_eviction": option.trim, "rss_margin": option.margin})
    env = {**os.environ, SETTINGS_ENV: settings.model_dump_json(), **option.env}
    launcher = ProcessLauncher(work, start_timeout_s=60, ping_timeout_s=10)
    started = await launcher.launch("rss", sys.executable, env)
    runtime = started.runtime
    process = psutil.Process(started.pid)
    try:
        start = (await runtime.stats()).rss_startup_bytes
        cpu_before = sum(process.cpu_times()[:2])
        peak = 0
        loaded = {"n": 0, "bytes": 0, "seconds": 0.0, "refused": 0}
        queue = list(reversed(requests))

        async def client() -> None:
            nonlocal peak
            while queue:
                try:
                    await runtime.load(queue.pop(), "1", timeout_s=120)
                except NoCapacity:
                    pass  # refused over the memory budget (counted by the runtime)
                peak = max(peak, process.memory_info().rss)
                stats = await runtime.stats()
                loaded["refused"] += stats.loads_refused
                for load in stats.loads:
                    loaded["n"] += 1
                    loaded["bytes"] += load.size_bytes
                    loaded["seconds"] += load.seconds

        await asyncio.gather(client(), client())
        end = process.memory_info().rss
        cpu = sum(process.cpu_times()[:2]) - cpu_before
        overhead = (await runtime.stats()).rss_overhead_bytes
        for model in sorted(set(requests)):
            await runtime.unload(model, timeout_s=30)
        emptied = process.memory_info().rss
    finally:
        await runtime.shutdown(timeout_s=10)
        await started.wait_exit()
    gb = loaded["bytes"] / 1e9
    return Result(option.name, budget / MB, start / MB, overhead / MB, peak / MB, end / MB,
                  (peak - start - budget) / MB, int(loaded["n"]), int(loaded["refused"]),
                  emptied / MB, gb / max(float(loaded["seconds"]), 1e-9), cpu / max(gb, 1e-9))


def table(results: list[Result]) -> str:
    lines = ["| option | start MB | overhead MB | peak MB | end MB | peak over start + budget MB "
             "| loads | refused | all unloaded MB | load GB/s | CPU s / GB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.option} | {r.start_mb:.0f} | {r.overhead_mb:.0f} | {r.peak_mb:.0f} | "
                     f"{r.end_mb:.0f} | {r.peak_excess_mb:+.0f} | {r.loads} | {r.refused} | "
                     f"{r.emptied_mb:.0f} | "
                     f"{r.load_gb_s:.2f} | "
                     f"{r.cpu_s_per_gb:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--budget-mb", type=float, default=88)
    parser.add_argument("--models", type=int, default=30)
    parser.add_argument("--only", default="", help="comma-separated option names")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cache = Path(tempfile.gettempdir()) / "modelfleet-rss-budget"
    catalog = peers_catalog.write_catalog(cache / "catalog", n=args.models,
                                          max_bytes=36 * peers_catalog.MiB)
    wanted = {name.strip() for name in args.only.split(",") if name.strip()}
    options = [o for o in OPTIONS if not wanted or o.name in wanted]
    results = []
    with tempfile.TemporaryDirectory(prefix="rss-budget-") as tmp:
        repo = peers_catalog.write_modelfleet_repo(catalog, Path(tmp) / "repo")
        requests = trace(args.models, args.requests)
        for option in options:
            started = time.perf_counter()
            work = Path(tmp) / f"run{len(results)}"
            work.mkdir()
            result = asyncio.run(run_option(option, repo, work, int(args.budget_mb * MB),
                                            requests))
            results.append(result)
            print(f"{option.name}: peak {result.peak_mb:.0f} MB, end {result.end_mb:.0f} MB "
                  f"({time.perf_counter() - started:.0f}s)", file=sys.stderr)
    print(f"catalog: {args.models} models, {catalog.total_bytes / MB:.0f} MB; budget "
          f"{args.budget_mb:.0f} MB; {args.requests} requests (Zipf 1.0), 2 clients")
    print(json.dumps([asdict(r) for r in results], indent=1) if args.json else table(results))


if __name__ == "__main__":
    main()
