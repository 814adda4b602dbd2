"""The simulator against the measured system: bench/peers' modelfleet row, side by side.

    .venv/bin/python bench/sim_vs_measured.py                 # sim vs bench/peers_measured.json
    .venv/bin/python bench/sim_vs_measured.py --calibrate     # warm rows -> per-task CPU, overhead
    .venv/bin/python bench/sim_vs_measured.py --measure-costs # physical costs the sim is built on
    .venv/bin/python bench/sim_vs_measured.py --store bench/peers/results/latest.json
                                                  # copy a bench run's modelfleet row into
                                                  # bench/peers_measured.json (with provenance)
    .venv/bin/python bench/sim_vs_measured.py --store-5000 RESULTS   # the scale variant's
    .venv/bin/python bench/sim_vs_measured.py --probe --save-probe   # per-process CPU

The simulator is never fitted to the zipf row: its inputs are the bench's settings,
physical measurements (``--measure-costs``: loads, predicts, decisions, broker round
trips) and the *warm* rows (``--calibrate``: warm-c32 req/s gives the CPU per request
outside the model, warm-c1 p50 the latency outside it that is not CPU). The zipf row
is the prediction checked. See bench/README_sim.md ("Simulator against the bench").
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "bench" / "peers_measured.json"
PEERS = ROOT / "bench" / "peers"


def peers_module(name: str) -> ModuleType:
    """bench/peers/<name>.py, imported by path (its siblings on sys.path, as run.py does)."""
    if str(PEERS) not in sys.path:
        sys.path.insert(0, str(PEERS))
    spec = importlib.util.spec_from_file_location(f"bench_peers_{name}", PEERS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# -- the comparison --------------------------------------------------------------------------


def simulate(overrides: dict[str, Any] | None = None) -> dict[str, float]:
    """The peers scenario's figures, in the bench's units."""
    from modelfleet.sim.report import peers_row
    from modelfleet.sim.scenario import scenario

    return peers_row(scenario("peers", **(overrides or {})))


def compare_rows(measured: dict[str, Any], simulated: dict[str, float]) -> str:
    lines = ["| figure | simulated | measured | sim / measured |", "|---|---:|---:|---:|"]
    for key, label in (("req_per_s", "req/s"), ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"),
                       ("loads", "loads in window")):
        sim, real = simulated.get(key), measured.get(key)
        ratio = (f"{sim / real:.2f}" if sim is not None and real not in (None, 0)
                 else "-")
        lines.append(f"| {label} | {_fmt(sim)} | {_fmt(real)} | {ratio} |")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}" if isinstance(value, float) else f"{value:,}"


def load_measured(path: Path = MEASURED) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


# -- storing a bench run ---------------------------------------------------------------------


def store(results_path: Path, system: str = "modelfleet") -> dict[str, Any]:
    """The modelfleet row of a bench/peers results file, as bench/peers_measured.json holds it."""
    results = json.loads(results_path.read_text())
    row = next((s for s in results.get("systems", []) if s.get("system") == system), None)
    if row is None:
        raise SystemExit(f"{results_path}: no {system!r} system in it")
    summary = row["summary"]
    work = row.get("workloads", {})
    zipf = work.get("zipf-32", {})
    return {
        "placeholder": False,
        "source": {
            "file": str(results_path.relative_to(ROOT)) if results_path.is_relative_to(ROOT)
            else str(results_path),
            "command": " ".join(results.get("command", [])),
            "started": results.get("started"),
            "machine": results.get("machine"),
            "modelfleet_commit": results.get("versions", {}).get("modelfleet", {}).get("commit"),
            "quick": results.get("quick"),
            "stored": dt.datetime.now().isoformat(timespec="seconds"),
        },
        "system": system,
        "settings": row.get("settings"),
        "zipf": {"req_per_s": summary.get("zipf_rps"), "p50_ms": summary.get("zipf_p50_ms"),
                 "p99_ms": summary.get("zipf_p99_ms"), "loads": summary.get("zipf_loads"),
                 "errors": summary.get("zipf_errors"), "timeouts": summary.get("zipf_timeouts"),
                 "idle_permit_s_while_backlog": summary.get("zipf_idle_permit_s_while_backlog"),
                 "ok": zipf.get("ok")},
        "warm_c1": {"p50_ms": summary.get("c1_p50_ms"),
                    "p99_ms": work.get("warm-c1", {}).get("p99_ms")},
        "warm_c32": {"req_per_s": summary.get("c32_rps"), "p50_ms": work.get(
            "warm-c32", {}).get("p50_ms"), "p99_ms": summary.get("c32_p99_ms")},
    }


# -- calibration from the warm rows ------------------------------------------------------------


def warm(overrides: dict[str, Any]) -> dict[str, float]:
    """The sim's warm-c32 (32 clients on model-00, 2 + 10 s) or warm-c1 (1 client, 2 + 5 s)."""
    return simulate(overrides)


WARM_C32 = {"only_model": 0, "clients": 32, "warmup_s": 2.0, "duration_s": 12.0}
WARM_C1 = {"only_model": 0, "clients": 1, "warmup_s": 2.0, "duration_s": 7.0}


def calibrate(c32_rps: float, c1_p50_ms: float, probe_c32: dict[str, float],
              build: dict[str, Any] | None = None,
              cores: float | None = None) -> dict[str, Any]:
    """What the warm rows fix, in order (never the zipf row):

    1. the CPU a warm request costs outside the model in each process (``client_cpu_s``,
       ``serve_cpu_s``, ``runtime_cpu_s``): the per-process CPU per request of a warm-c32
       run (``probe_c32``, measured by ``--probe`` with the kernel's accounting), less
       what the sim spends there itself (the runtime's predicts, the coordinator's
       decisions);
    2. ``cores``: the CPU the shared bench machine gave the system, so that the sim's
       warm-c32 req/s is the bench's (or ``cores`` as given: the machine's own CPUs when
       it was otherwise idle; the bisection's answer is then reported beside it);
    3. ``task_overhead_s``: what warm-c1's p50 leaves once that CPU work is counted.
    """
    build = build or {}
    zero = {"client_cpu_s": 0.0, "serve_cpu_s": 0.0, "runtime_cpu_s": 0.0}
    # The probe ran the current build: its own re-scores are in its serve CPU.
    own = warm({**WARM_C32, **zero, "cores": 64.0, "task_overhead_s": 0.0})
    by = own["cpu_ms_per_request_by"]
    # Summed over the runtimes: a model hot enough gets a replica on the other runtime
    # (worker.replica_at_tasks), and warm-c32's one model then runs on both.
    runtime_ms = sum(probe_c32[k] for k in probe_c32 if k.startswith("runtime-"))
    fixed: dict[str, Any] = {
        "client_cpu_s": round(probe_c32["loadgen"] / 1000, 6),
        "serve_cpu_s": round(max(0.0, probe_c32["serve"] - by.get("serve", 0.0)) / 1000, 6),
        "runtime_cpu_s": round(max(0.0, runtime_ms - by.get("predict", 0.0)) / 1000, 6),
    }
    low, high = 0.2, 4.0
    for _ in range(14):
        mid = (low + high) / 2
        got = warm({**build, **WARM_C32, **fixed, "cores": mid,
                    "task_overhead_s": 0.0})["req_per_s"]
        if got > c32_rps:
            high = mid
        else:
            low = mid
    fitted = round((low + high) / 2, 3)
    fixed["cores"] = fitted if cores is None else cores
    c1 = warm({**build, **WARM_C1, **fixed, "task_overhead_s": 0.0})["p50_ms"]
    fixed["task_overhead_s"] = round(max(0.0, (c1_p50_ms - c1) / 1000), 6)
    check32 = warm({**build, **WARM_C32, **fixed})
    check1 = warm({**build, **WARM_C1, **fixed})
    return {**fixed, "cores_warm_c32_bisection": fitted,
            "sim_c32_req_per_s": check32["req_per_s"],
            "sim_c32_cpu_ms_per_request": check32["cpu_ms_per_request_by"],
            "sim_c1_p50_ms": check1["p50_ms"]}


# -- physical costs ------------------------------------------------------------------------------


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


def measure_loads_and_predicts(passes: int = 3) -> dict[str, Any]:
    """What a load and a predict cost on this machine, each the best of ``passes`` (the
    machine is shared: the minimum is the cost, the rest is someone else's work).

    - ``mlp.load`` of each artifact of the bench's catalog (np.load from the page cache
      and the copies): fixed + MB / rate;
    - the runtime's own work around it: a real ``ModelHost`` (the runtime's) loading each
      model with room to spare (manifest, handler import, sizing, thread hops), minus
      ``mlp.load``;
    - an eviction: the runtime unloads the model and runs ``gc.collect()``, in a process
      holding what a runtime holds;
    - ``mlp.predict`` per batch size: fixed + MB * (a + rows * b).
    """
    import gc

    import numpy as np

    from modelfleet.repository import open_store
    from modelfleet.runtime.host import ModelHost
    from modelfleet.settings import RuntimeSettings

    cat = peers_module("catalog")
    mlp = peers_module("mlp")
    catalog = cat.write_catalog(PEERS / ".cache" / "catalog")
    mb = {m.name: catalog.artifact(m.name).stat().st_size / 1e6 for m in catalog.models}
    np_load: dict[str, float] = {}
    for _ in range(passes):
        for name in mb:
            started = time.perf_counter()
            mlp.load(catalog.artifact(name))
            np_load[name] = min(np_load.get(name, math.inf), time.perf_counter() - started)
    np_fixed, np_per_mb = fit_line([mb[n] for n in mb], [np_load[n] for n in mb])
    ensure: dict[str, float] = {}
    evict: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = cat.write_modelfleet_repo(catalog, Path(tmp) / "repo")
        store_ = open_store(str(repo), Path(tmp) / "cache", 1 << 30)

        async def run() -> None:
            for _ in range(passes):
                host = ModelHost(RuntimeSettings(device_budget_bytes=4 * catalog.total_bytes,
                                                 host_budget_bytes=0), store_)
                for name in mb:
                    started = time.perf_counter()
                    await host.ensure(name, "1")
                    seconds = time.perf_counter() - started
                    ensure[name] = min(ensure.get(name, math.inf), seconds)
                for name in list(mb)[:10]:
                    started = time.perf_counter()
                    await host.evict(name)  # unload + gc.collect(), as an eviction does
                    evict.append(time.perf_counter() - started)
                await host.close()
        asyncio.run(run())
    overhead = statistics.median(ensure[n] - np_load[n] for n in mb)
    gc_s = []
    for _ in range(10):
        started = time.perf_counter()
        gc.collect()
        gc_s.append(time.perf_counter() - started)
    if os.environ.get("SIM_COSTS_VERBOSE"):
        for name in mb:
            print(f"{name} {mb[name]:7.2f} MB np.load {np_load[name] * 1000:7.2f} ms "
                  f"runtime load {ensure[name] * 1000:7.2f} ms", file=sys.stderr)
    rows: dict[int, list[tuple[float, float]]] = {}
    for spec in catalog.models[::2]:
        model = mlp.load(catalog.artifact(spec.name))
        for k in (1, 2, 4, 8, 16):
            x = np.random.default_rng(k).standard_normal((k, 64), dtype=np.float32)
            best = math.inf
            for _ in range(5 * passes):
                started = time.perf_counter()
                mlp.predict(model, x)
                best = min(best, time.perf_counter() - started)
            rows.setdefault(k, []).append((mb[spec.name], best))
    per_k = {k: fit_line([m for m, _ in v], [t for _, t in v]) for k, v in rows.items()}
    ks = sorted(per_k)
    slope_fixed, slope_row = fit_line([float(k) for k in ks], [per_k[k][1] for k in ks])
    return {
        "np_load_fixed_s": round(np_fixed, 6), "np_load_mb_per_s": round(1 / np_per_mb, 1),
        "runtime_load_overhead_s": round(overhead, 6),
        "load_fixed_s": round(np_fixed + overhead, 6),
        "load_mb_per_s": round(1 / np_per_mb, 1),
        "evict_s_median": round(statistics.median(evict), 6),
        "evict_s_min": round(min(evict), 6),
        "gc_collect_s_min": round(min(gc_s), 6),
        "gc_objects": len(gc.get_objects()),
        "predict_fixed_s": round(statistics.fmean(per_k[k][0] for k in ks), 6),
        "predict_s_per_mb": round(slope_fixed, 9),
        "predict_row_s_per_mb": round(slope_row, 9),
        "predict_by_batch": {k: {"fixed_s": round(a, 6), "s_per_mb": round(b, 9)}
                             for k, (a, b) in per_k.items()},
    }


def measure_decide() -> dict[str, float]:
    """``scheduling.decide`` on a snapshot shaped like the bench's (50 queues)."""
    from modelfleet.scheduling import QueueView, ScoringSettings, Snapshot, WorkerView, decide

    settings = ScoringSettings()
    out: dict[str, float] = {}
    for n in (10, 50):
        queues = tuple(QueueView(f"model-{i:02d}", i % 3, 1 if i % 2 else 0, 2, "free", False,
                                 16, f"runtime-{i % 2}") for i in range(n))
        held = frozenset(q.model_id for q in queues[::2])
        view = WorkerView("w", held, frozenset(list(held)[:10]), frozenset(), {}, (), 4, 16,
                          frozenset(), {"runtime-0": 1, "runtime-1": 2},
                          {m: 1 for m in held}, {m: 16 for m in held})
        best = math.inf
        for _ in range(5):
            started = time.perf_counter()
            for i in range(200):
                decide(Snapshot(1000.0 + i, queues, view), settings, 1)
            best = min(best, (time.perf_counter() - started) / 200)
        out[f"decide_{n}_queues_s"] = best
    per_queue = (out["decide_50_queues_s"] - out["decide_10_queues_s"]) / 40
    out["decide_cpu_per_queue_s"] = round(per_queue, 7)
    out["decide_cpu_s"] = round(out["decide_10_queues_s"] - 10 * per_queue, 7)
    return out


def measure_embedded_broker() -> dict[str, float]:
    from modelfleet.broker.embedded import MemoryBroker
    from modelfleet.settings import BrokerSettings

    async def run() -> dict[str, float]:
        broker = MemoryBroker(BrokerSettings())
        await broker.connect()
        names = [f"m{i}" for i in range(50)]
        for name in names:
            sub = await broker.subscribe(name, 1)
            await sub.cancel()
        started = time.perf_counter()
        for _ in range(200):
            await broker.queue_stats(names)
        count_s = (time.perf_counter() - started) / (200 * len(names))
        started = time.perf_counter()
        subs = [await broker.subscribe(name, 16) for name in names]
        subscribe_s = (time.perf_counter() - started) / len(names)
        for sub in subs:
            await sub.cancel()
        latencies = await _event_latency(broker)
        await broker.close()
        return {"count_s": count_s, "subscribe_s": subscribe_s,
                "announce_s": statistics.median(latencies)}
    return asyncio.run(run())


async def _event_latency(broker: Any) -> list[float]:
    got: asyncio.Queue[float] = asyncio.Queue()

    async def listen() -> None:
        async for event in broker.events():
            if event.get("kind") == "probe":
                got.put_nowait(time.perf_counter() - float(event["t"]))
    listener = asyncio.create_task(listen())
    await asyncio.sleep(0.2)
    latencies = []
    for _ in range(100):
        await broker.publish_event({"kind": "probe", "t": time.perf_counter()})
        latencies.append(await asyncio.wait_for(got.get(), 5))
        await asyncio.sleep(0.002)
    listener.cancel()
    return latencies


def measure_rabbitmq(url: str) -> dict[str, float]:
    """Passive declares, consumers and a fanout event's latency through the project's
    ``AmqpBroker`` (aio-pika), on the given RabbitMQ."""
    import uuid

    from modelfleet.broker.rabbitmq.broker import AmqpBroker
    from modelfleet.settings import BrokerSettings

    tag = f"simcost-{uuid.uuid4().hex[:6]}"
    settings = BrokerSettings(url=url, queue_prefix=f"{tag}.model.",
                              events_exchange=f"{tag}.events",
                              dead_letter_queue=f"{tag}.dead-letters")

    async def run() -> dict[str, float]:
        broker = AmqpBroker(settings, dead_letter_queue=settings.dead_letter_queue,
                            events_exchange=settings.events_exchange)
        await broker.connect()
        names = [f"m{i}" for i in range(20)]
        subs = [await broker.subscribe(name, 1) for name in names]
        for sub in subs:
            await sub.cancel()
        started = time.perf_counter()
        for _ in range(10):
            await broker.queue_stats(names)
        count_s = (time.perf_counter() - started) / (10 * len(names))
        started = time.perf_counter()
        subs = [await broker.subscribe(name, 16) for name in names]
        subscribe_s = (time.perf_counter() - started) / len(names)
        for sub in subs:
            await sub.cancel()
        latencies = await _event_latency(broker)
        await _delete(broker, [settings.queue_prefix + n for n in names],
                      settings.events_exchange)
        await broker.close()
        return {"count_s": count_s, "subscribe_s": subscribe_s,
                "announce_s": statistics.median(latencies)}
    return asyncio.run(run())


async def _delete(broker: Any, queues: list[str], exchange: str) -> None:
    import aio_pika

    connection = await aio_pika.connect(broker._settings.url)
    async with connection:
        channel = await connection.channel()
        for name in queues:
            try:
                await channel.queue_delete(name)
            except Exception:
                channel = await connection.channel()
        try:
            await channel.exchange_delete(exchange)
        except Exception:
            pass


RUNTIME_PROBE = r"""
import asyncio, json, os, statistics, sys, time
from pathlib import Path
from modelfleet.errors import NoCapacity
from modelfleet.settings import Settings
from modelfleet.worker.supervisor import RuntimeSupervisor

def cpu_s(pid):
    # CPU time of every thread of the process, in ns resolution (schedstat).
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9

async def main(repo, sizes, budget):
    # The bench's budget (16 % of the catalog): every load below evicts, as in the bench.
    settings = Settings(repo=repo, worker={"shared_runtimes": 1},
                        runtime={"device_budget_bytes": budget, "host_budget_bytes": 0})
    sup = RuntimeSupervisor(settings)
    await sup.start()
    runtime = sup.shared[0]
    for _ in range(400):
        if runtime.ready:
            break
        await asyncio.sleep(0.05)
    # The runtime's process (plain or forked from the zygote) and its IPC client.
    pid = runtime._started_runtime.pid
    client = runtime.runtime
    for _ in range(50):
        await client.stats(timeout_s=5)
    rtt, stats_cpu = [], []
    for _ in range(200):
        c, t = cpu_s(pid), time.perf_counter()
        await client.stats(timeout_s=5)
        rtt.append(time.perf_counter() - t)
        stats_cpu.append(cpu_s(pid) - c)
    loads = []
    started = time.perf_counter()
    refused = 0
    for name, size in list(sizes.items()) * int(sys.argv[4]):
        c = cpu_s(pid)
        for _ in range(5):  # refused over its RSS line: the worker would ask again
            try:
                await client.load(name, "1", timeout_s=60)
                break
            except NoCapacity:
                refused += 1
                await asyncio.sleep(0.02)
        loads.append((size, cpu_s(pid) - c))
    elapsed = time.perf_counter() - started
    end = await client.stats(timeout_s=5)
    evictions = []
    resident = (await client.stats(timeout_s=5)).device
    for name in resident[:6]:
        await asyncio.sleep(1.1)  # the runtime collects garbage at most once a second
        c = cpu_s(pid)
        await client.unload(name, timeout_s=60)
        evictions.append(cpu_s(pid) - c)
    await sup.stop()
    print(json.dumps({"stats_rtt_s": statistics.median(rtt),
                      "stats_cpu_s": statistics.median(stats_cpu),
                      "loads": loads, "loads_elapsed_s": elapsed, "loads_refused": refused,
                      "resident_at_end": len(end.device),
                      "device_used_bytes_at_end": end.device_used_bytes,
                      "rss_bytes_at_end": end.rss_bytes, "rss_limit_bytes": end.rss_limit_bytes,
                      "rss_overhead_bytes": end.rss_overhead_bytes,
                      "evict_with_gc_cpu_s": evictions}))

asyncio.run(main(sys.argv[1], json.loads(Path(sys.argv[2]).read_text()), int(sys.argv[3])))
"""


def measure_runtime_process(models: int = 50) -> dict[str, Any]:
    """A real runtime process (``python -m modelfleet.runtime``) serving the bench's
    catalog (``models`` = 5000: the scale variant's, sizes small): its ``stats`` round
    trip, and the CPU it spends per load (handler import, np.load, sizing, its memory
    guard's checks and the evictions it makes room with) and per eviction that runs a
    full gc, read from the kernel's per-thread accounting (so other work on a shared
    machine does not count). The 50-model catalog is loaded twice over; of the
    5,000-model one the first 2,000 models once, and only the last 800 loads (a full
    cache: each evicts) are fitted."""
    cat = peers_module("catalog")
    if models == 50:
        catalog = cat.write_catalog(PEERS / ".cache" / "catalog")
        budget = int(0.16 * catalog.total_bytes)
        passes, skip = 2, 0
    else:
        low, high = cat.SIZE_PRESETS["small"]
        catalog = cat.write_catalog(PEERS / ".cache" / f"catalog-{models}-small", n=models,
                                    min_bytes=low, max_bytes=high)
        # 2,000 models once (a lone runtime reaches its RSS line after about 2,100 loads
        # of this catalog, then sheds and refuses for seconds a load): the last 800 fitted.
        budget = int(0.16 * catalog.total_bytes)  # the bench's, of the whole catalog
        catalog = cat.Catalog(catalog.root, catalog.models[:2000])
        passes, skip = 1, 1200
    with tempfile.TemporaryDirectory() as tmp:
        repo = cat.write_modelfleet_repo(catalog, Path(tmp) / "repo")
        sizes = {m.name: catalog.artifact(m.name).stat().st_size for m in catalog.models}
        (Path(tmp) / "sizes.json").write_text(json.dumps(sizes))
        env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFLEET_")}
        done = subprocess.run([sys.executable, "-c", RUNTIME_PROBE, str(repo),
                               str(Path(tmp) / "sizes.json"),
                               str(budget), str(passes)],
                              capture_output=True, text=True, timeout=600, check=False,
                              cwd=ROOT, env=env)
    if done.returncode != 0:
        return {"error": done.stderr[-3000:]}
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    gc_s = statistics.median(raw.pop("evict_with_gc_cpu_s"))
    loads = raw.pop("loads")[skip:]
    if skip:
        raw["loads_elapsed_s"] *= len(loads) / (len(loads) + skip)
    # The runtime collected garbage at most once a second during the loads: leave out
    # the loads that paid for a collection (the largest excess over a first fit).
    fixed, per_mb = fit_line([b / 1e6 for b, _ in loads], [c for _, c in loads])
    collections = math.ceil(raw["loads_elapsed_s"]) + 1
    excess = sorted(loads, key=lambda bc: bc[1] - fixed - per_mb * bc[0] / 1e6)
    kept = excess[:-collections] if collections < len(loads) else loads
    fixed, per_mb = fit_line([b / 1e6 for b, _ in kept], [c for _, c in kept])
    if os.environ.get("SIM_COSTS_VERBOSE"):
        for b, c in sorted(loads):
            print(f"runtime load {b / 1e6:7.2f} MB {c * 1000:8.2f} ms CPU", file=sys.stderr)
    return {**raw, "loads": len(loads), "load_cpu_fixed_s": round(fixed, 6),
            "load_cpu_mb_per_s": round(1 / per_mb, 1), "gc_cpu_s": round(gc_s, 6)}


def _schedstat_cpu_s(pid: int) -> float:
    """CPU-seconds of every thread of ``pid`` so far (the kernel's ns accounting)."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return total / 1e9


def probe(workloads: tuple[str, ...] = ("zipf-32", "warm-c32", "warm-c1"),
          measure_s: float = 20.0,
          warmup_s: float = 5.0) -> dict[str, Any]:
    """Run the real system as bench/peers runs it (``modelfleet serve``, embedded broker,
    2 runtimes, 16 % budget; its load generator) for short windows, and account the CPU
    each process spends in the window: how much per request, per load, and whether the
    machine was saturated. What the sim's CPU model is checked against."""
    import threading

    import psutil

    run = peers_module("run")
    args = run.parse_args(["--only", "modelfleet", "--skip-build", "--no-save"])
    venvs = {"loadgen": run.ensure_venv("loadgen", args.python, True, args.venvs)}
    bench = run.Bench(args)
    bench.venvs = venvs
    out: dict[str, Any] = {"machine_cores": os.cpu_count(),
                           "loadavg_at_start": os.getloadavg()}
    running = bench.start("modelfleet")
    try:
        server = running.servers[0]
        for workload in workloads:
            cfg = bench.workload_config(workload, running)
            cfg.update({"warmup_s": warmup_s, "measure_s": measure_s})
            samples: dict[str, dict[str, float]] = {}

            def sample(tag: str, samples: dict[str, dict[str, float]] = samples) -> None:
                cpu: dict[str, float] = {}
                for proc in server.tree():
                    # A runtime forked from the zygote is named by its process name
                    # (comm); a plain one by its command line.
                    name = "serve" if proc.pid == server.pid else proc.name() \
                        if proc.name().startswith(("runtime-", "quarantine", "mf-zygote")) \
                        else next((a for a in proc.cmdline() if a.startswith("runtime-")),
                                  f"pid{proc.pid}")
                    cpu[name] = _schedstat_cpu_s(proc.pid)
                for proc in psutil.process_iter(["cmdline"]):
                    if any("loadgen.py" in str(a) for a in proc.info["cmdline"] or []):
                        cpu["loadgen"] = _schedstat_cpu_s(proc.pid)
                cpu["wall"] = time.monotonic()
                samples[tag] = cpu
            timers = [threading.Timer(warmup_s + 0.3, sample, ("start",)),
                      threading.Timer(warmup_s + measure_s + 0.3, sample, ("end",))]
            for timer in timers:
                timer.start()
            result = bench.loadgen("http", cfg, warmup_s + measure_s + 90)
            for timer in timers:
                timer.join()
            start_, end_ = samples["start"], samples["end"]
            wall = end_["wall"] - start_["wall"]
            cpu = {k: round(end_[k] - start_.get(k, 0.0), 3) for k in end_ if k != "wall"}
            end_metrics = result.pop("metrics_end") or {}
            delta = run.stats.counter_delta(result.pop("metrics_start") or {}, end_metrics)
            loads = run.stats.metric_total(delta, "modelfleet_model_loads_total")
            answered = result["req_per_s"] * measure_s
            out[workload] = {
                "req_per_s": result["req_per_s"], "p50_ms": result["p50_ms"],
                "p99_ms": result["p99_ms"], "loads": loads, "cpu_s": cpu,
                "cpu_cores_used": round(sum(cpu.values()) / wall, 3),
                "cpu_ms_per_request": {k: round(v * 1000 / answered, 3)
                                       for k, v in cpu.items()},
                "metrics_delta": {k: v for k, v in delta.items() if k.startswith((
                    "modelfleet_worker_subscription_changes", "modelfleet_evictions",
                    "modelfleet_worker_idle_permit", "modelfleet_phase_seconds_sum",
                    "modelfleet_phase_seconds_count"))},
                "subscriptions_at_end": run.stats.metric_total(
                    end_metrics, "modelfleet_worker_subscriptions"),
            }
            log_ = out[workload]
            print(f"{workload}: {json.dumps(log_)}", file=sys.stderr)
    finally:
        for srv in running.servers:
            srv.stop()
    return out


def measure_costs(amqp: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"measured": dt.datetime.now().isoformat(timespec="seconds")}
    out["loads_and_predicts"] = measure_loads_and_predicts()
    out["decide"] = measure_decide()
    out["runtime_process"] = measure_runtime_process()
    out["runtime_process_5000"] = measure_runtime_process(5000)
    out["embedded"] = measure_embedded_broker()
    if amqp:
        try:
            out["rabbitmq"] = measure_rabbitmq(amqp)
        except Exception as exc:
            out["rabbitmq"] = {"error": repr(exc)}
    return out


def _commit_of(entry: dict[str, Any]) -> str | None:
    """The modelfleet commit an entry of bench/peers_measured.json was measured on."""
    source = entry.get("source")
    if isinstance(source, dict):
        return source.get("modelfleet_commit")
    return entry.get("modelfleet_commit")


# -- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    # Numpy on one thread, as the bench runs every server (before numpy is imported:
    # everything below imports it lazily).
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--measured", type=Path, default=MEASURED)
    parser.add_argument("--store", type=Path, metavar="RESULTS_JSON",
                        help="write the modelfleet row of this bench/peers results file to "
                             "--measured")
    parser.add_argument("--calibrate", action="store_true",
                        help="per-task CPU and overhead from the stored warm rows")
    parser.add_argument("--probe", action="store_true",
                        help="run the real system briefly and account its CPU per process")
    parser.add_argument("--workloads", default="zipf-32,warm-c32,warm-c1",
                        help="--probe: which bench/peers workloads, in order")
    parser.add_argument("--measure-costs", action="store_true",
                        help="measure loads, predicts, decisions and broker round trips")
    parser.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672/",
                        help="RabbitMQ for --measure-costs ('' to skip)")
    parser.add_argument("--store-5000", type=Path, metavar="RESULTS_JSON",
                        help="write the modelfleet row of a --models 5000 bench/peers results "
                             "file to --measured's scale_5000 (the peers-5000 scenario's row)")
    parser.add_argument("--save-probe", action="store_true",
                        help="--probe: also keep what it measured in --measured ('probe')")
    parser.add_argument("--cores", type=float, default=None,
                        help="--calibrate: the machine's CPUs (an idle machine) instead of "
                             "the warm-c32 bisection")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a peers scenario field (JSON value), repeatable")
    args = parser.parse_args(argv)
    if args.store or args.store_5000:
        measured = load_measured(args.measured) if args.measured.is_file() else {}
        if args.store:
            row = store(args.store)
            commit = row["source"]["modelfleet_commit"]
            # What was measured of the same build stays with its row; nothing older does.
            kept = {k: measured[k] for k in ("probe", "scale_5000")
                    if k in measured and _commit_of(measured[k]) == commit}
            measured = {**row, "build": {"what": "the build bench/peers measured, with "
                                         "everything the sim models by default",
                                         "sim_overrides": {}}, **kept}
        if args.store_5000:
            measured["scale_5000"] = {**store(args.store_5000), "sim_scenario": "peers-5000"}
        args.measured.write_text(json.dumps(measured, indent=1) + "\n")
        print(f"wrote {args.measured}")
        return 0
    if args.probe:
        probed = probe(tuple(args.workloads.split(",")))
        print(json.dumps(probed, indent=1))
        if args.save_probe:
            measured = load_measured(args.measured)
            head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                  cwd=ROOT, check=False).stdout.strip()
            measured["probe"] = {"command": "bench/sim_vs_measured.py --probe --save-probe",
                                 "date": dt.datetime.now().isoformat(timespec="seconds"),
                                 "checkout": head, **{k.replace("-", "_"): v
                                                      for k, v in probed.items()}}
            args.measured.write_text(json.dumps(measured, indent=1) + "\n")
        return 0
    if args.measure_costs:
        print(json.dumps(measure_costs(args.amqp or None), indent=1))
        return 0
    measured = load_measured(args.measured)
    if args.calibrate:
        build = dict(measured.get("build", {}).get("sim_overrides", {}))
        probe_c32 = measured["probe"]["warm_c32"]["cpu_ms_per_request"]
        print(json.dumps(calibrate(measured["warm_c32"]["req_per_s"],
                                   measured["warm_c1"]["p50_ms"], probe_c32, build,
                                   args.cores), indent=1))
        return 0
    overrides = dict(measured.get("build", {}).get("sim_overrides", {}))
    for pair in args.set:
        key, _, raw = pair.partition("=")
        overrides[key] = json.loads(raw)
    started = time.perf_counter()
    simulated = simulate(overrides)
    wall = time.perf_counter() - started
    source = measured.get("source", {})
    print(f"# bench/peers zipf-32, modelfleet (embedded broker): sim vs measured "
          f"({source.get('file', '?')}, {source.get('started', '?')}, commit "
          f"{str(source.get('modelfleet_commit'))[:7]}); sim {wall:.1f} s wall\n")
    print(compare_rows(measured["zipf"], simulated))
    extra = {k: v for k, v in simulated.items() if k not in ("req_per_s", "p50_ms", "p99_ms",
                                                             "loads")}
    print(f"\nsim run with the measured build's settings: {json.dumps(overrides)}")
    print("sim also: " + ", ".join(f"{k} {v}" for k, v in extra.items()))
    scale = measured.get("scale_5000")
    if scale and not args.set:
        from modelfleet.sim.report import peers_row
        from modelfleet.sim.scenario import scenario

        started = time.perf_counter()
        simulated = peers_row(scenario(scale["sim_scenario"]))
        wall = time.perf_counter() - started
        print(f"\n# 5,000 models (`modelfleet sim --scenario {scale['sim_scenario']}`; sim "
              f"{wall:.1f} s wall) against {scale['source']['file']}\n")
        print(compare_rows(scale["zipf"], simulated))
    return 0


if __name__ == "__main__":
    sys.exit(main())
