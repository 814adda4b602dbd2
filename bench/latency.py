"""Warm-path latency and throughput: embedded broker vs RabbitMQ vs calling predict directly.

Starts ``modelfleet serve`` twice as real processes on loopback (``--broker memory``
and ``--broker amqp://...``), warms the model, then for each: N sequential requests
(latency p50/p99) and N requests at concurrency C (throughput). The baseline is the
same model's whole handler path in-process (``LocalModel``), with no server, broker or
IPC. Everything runs in one invocation, interleaved, so the ratios compare like with
like on a shared, noisy machine. The load generator shares the machine's cores.

    .venv/bin/python bench/latency.py [--model iris] [--requests 400] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from modelfleet import LocalModel  # noqa: E402
from tests.procs import serve  # noqa: E402  (the tests' process helper, reused)

BODIES = {
    "iris": (b'{"features": [5.1, 3.5, 1.4, 0.2]}', "application/json"),
    "banner": (b"hello fleet", "text/plain"),
    "digits": ((ROOT / "examples" / "seven.png").read_bytes(), "image/png"),
}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def sequential(base: str, model: str, n: int) -> list[float]:
    body, ctype = BODIES[model]
    out = []
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(n):
            started = time.perf_counter()
            response = await client.post(f"{base}/v1/models/{model}/infer", content=body,
                                         headers={"content-type": ctype})
            out.append(time.perf_counter() - started)
            response.raise_for_status()
    return out


async def concurrent(base: str, model: str, n: int, concurrency: int) -> float:
    body, ctype = BODIES[model]
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(
            max_connections=concurrency)) as client:
        async def one() -> None:
            async with sem:
                r = await client.post(f"{base}/v1/models/{model}/infer", content=body,
                                      headers={"content-type": ctype})
                r.raise_for_status()
        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.perf_counter() - started)


def direct(model: str, n: int) -> list[float]:
    local = LocalModel.from_package(ROOT / "examples" / "models" / model / "1")
    body, ctype = BODIES[model]

    async def run() -> list[float]:
        out = []
        for _ in range(n):
            started = time.perf_counter()
            await local.ainfer(body, ctype)
            out.append(time.perf_counter() - started)
        return out

    return asyncio.run(run())


def amqp_reachable() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1):
            return True
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="iris", choices=sorted(BODIES))
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--amqp", default=os.environ.get(
        "MODELFLEET_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672/"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    brokers = ["memory"] + ([args.amqp] if amqp_reachable() else [])
    rows = [{"path": "direct (LocalModel, in-process)", **_summary(direct(args.model,
                                                                          args.requests))}]
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"modelfleet-bench-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    for broker in brokers:
        env = {"MODELFLEET_BROKER__QUEUE_PREFIX": f"bench{os.getpid()}.",
               # info: the harness reads the port serve bound from its "listening" line
               # (at warning the bench waited 60 s for it and gave up).
               "MODELFLEET_LOG_LEVEL": "info"}
        proc, base = serve(tmp, env=env, name=f"bench-{len(rows)}", broker=broker)
        try:
            asyncio.run(sequential(base, args.model, 20))  # warm: load, subscribe
            lat = asyncio.run(sequential(base, args.model, args.requests))
            rps = asyncio.run(concurrent(base, args.model, args.requests, args.concurrency))
        finally:
            proc.stop()
        name = "embedded broker" if broker == "memory" else "RabbitMQ (quorum queues)"
        rows.append({"path": f"HTTP -> {name} -> runtime", **_summary(lat),
                     "throughput_rps": round(rps, 1)})
    base_p50 = rows[0]["p50_ms"]
    for row in rows:
        row["p50_over_direct"] = round(row["p50_ms"] / base_p50, 1)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"model={args.model} requests={args.requests} concurrency={args.concurrency} "
          f"(cores: {os.cpu_count()}, load generator on the same machine)")
    print(f"{'path':44} {'p50 ms':>8} {'p99 ms':>8} {'req/s @C':>9} {'p50 / direct':>13}")
    for row in rows:
        rps = f"{row['throughput_rps']:.0f}" if "throughput_rps" in row else "-"
        print(f"{row['path']:44} {row['p50_ms']:8.2f} {row['p99_ms']:8.2f} {rps:>9} "
              f"{row['p50_over_direct']:12.1f}x")
    if len(brokers) == 1:
        print("RabbitMQ not reachable on 127.0.0.1:5672: its row is missing")
    return 0


def _summary(latencies: list[float]) -> dict[str, float]:
    return {"p50_ms": round(statistics.median(latencies) * 1000, 3),
            "p99_ms": round(pct(latencies, 0.99) * 1000, 3)}


if __name__ == "__main__":
    sys.exit(main())
