"""What the tenants' auth layer costs on the warm path: one worker, two gateways.

One worker and two gateways on RabbitMQ, all real processes: gateway "open" has auth off,
gateway "auth" checks the key (cached), admits by plan through Redis (one Lua call, one
ZREM) and meters usage. Requests alternate between them, so both see the same worker, the
same machine noise and the same warm model; the table reports each one's latency and
throughput and the ratio. The load generator shares the machine's cores.

    .venv/bin/python bench/auth_overhead.py [--model banner] [--requests 400] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.latency import concurrent, pct  # noqa: E402  (the same load as the warm-path bench)
from tests.procs import gateway, worker  # noqa: E402  (the tests' process helpers, reused)

BODIES = {"banner": (b"hello fleet", "text/plain"),
          "iris": (b'{"features": [5.1, 3.5, 1.4, 0.2]}', "application/json")}


async def alternate(bases: dict[str, str], model: str, n: int) -> dict[str, list[float]]:
    body, ctype = BODIES[model]
    out: dict[str, list[float]] = {name: [] for name in bases}
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(n):
            for name, base in bases.items():
                started = time.perf_counter()
                response = await client.post(f"{base}/v1/models/{model}/infer", content=body,
                                             headers={"content-type": ctype})
                out[name].append(time.perf_counter() - started)
                response.raise_for_status()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="banner", choices=sorted(BODIES))
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--amqp", default=os.environ.get(
        "MODELFLEET_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672/"))
    args = parser.parse_args()
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"modelfleet-bench-auth-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    tag = f"benchauth{uuid.uuid4().hex[:6]}"
    env = {"MODELFLEET_BROKER__QUEUE_PREFIX": f"{tag}.",
           "MODELFLEET_BROKER__EVENTS_EXCHANGE": f"{tag}.events",
           "MODELFLEET_BROKER__DEAD_LETTER_QUEUE": f"{tag}.dead-letters",
           "MODELFLEET_TENANCY__REDIS_PREFIX": f"{tag}:", "MODELFLEET_LOG_LEVEL": "warning"}
    procs = [worker(tmp, args.amqp, env, "w-bench")[0]]
    try:
        open_gw, open_base = gateway(tmp, args.amqp, {**env, "MODELFLEET_TENANCY__AUTH": "off"},
                                     "gw-open")
        procs.append(open_gw)
        auth_gw, auth_base = gateway(tmp, args.amqp, env, "gw-auth")  # an enterprise admin key
        procs.append(auth_gw)
        bases = {"open": open_base.replace(f"{open_gw.api_key}:@", ""), "auth": auth_base}
        asyncio.run(alternate(bases, args.model, 20))  # warm: load, subscribe, key cache
        latency = asyncio.run(alternate(bases, args.model, args.requests))
        rps = {name: asyncio.run(concurrent(base, args.model, args.requests, args.concurrency))
               for name, base in bases.items()}
    finally:
        for proc in procs:
            proc.stop()
    print(f"model={args.model} requests={args.requests} (alternating) concurrency="
          f"{args.concurrency} (cores: {os.cpu_count()}, load generator on the same machine)")
    print(f"{'gateway':40} {'p50 ms':>8} {'p99 ms':>8} {'req/s @C':>9}")
    labels = {"open": "auth off", "auth": "auth on (key cache, Redis limits, usage)"}
    for name in bases:
        print(f"{labels[name]:40} {pct(latency[name], 0.5) * 1000:8.2f} "
              f"{pct(latency[name], 0.99) * 1000:8.2f} {rps[name]:9.0f}")
    print(f"auth on / off: p50 x{pct(latency['auth'], 0.5) / pct(latency['open'], 0.5):.2f}, "
          f"req/s x{rps['auth'] / rps['open']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
