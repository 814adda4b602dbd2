"""Poison pills among bystanders: what three ``crasher`` pills cost the other models.

The scenario of issue 19, on the embedded broker and on RabbitMQ (``modelfleet serve``
on each): clients loop on iris and banner with those models' own deadlines (their
``timeout_s``: no deadline header), first without pills (the baseline), then while three
``crasher`` pills (body ``CRASH``) and innocent crasher requests go out at once. Printed
per broker: the bystanders' p50/p99/max and non-200 answers in the baseline and during
the pills (requests sent from the pills' send until the last crasher request was
answered), after the pills, the pills' latencies and answers, the crasher innocents'
slowest answer, and the runtimes' restarts.

    .venv/bin/python bench/pill_bystanders.py [--brokers memory,amqp] [--runs 1]

``PILL_BENCH_LOG_DIR=DIR`` keeps each run's whole server log in DIR;
``PILL_BENCH_LOG=1`` prints the end of it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
AMQP = os.environ.get("MODELFLEET_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672/")
REQUESTS: dict[str, dict[str, Any]] = {
    "iris": {"json": {"features": [5.1, 3.5, 1.4, 0.2]}},
    "banner": {"content": b"hi", "headers": {"content-type": "text/plain"}},
}
CLIENTS = ("iris", "iris", "iris", "iris", "banner", "banner")
PILLS = 3
INNOCENTS = 24  # crasher requests that are not pills, sent with the pills


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Run:
    baseline: list[tuple[str, float, float, int]] = field(default_factory=list)
    traffic: list[tuple[str, float, float, int]] = field(default_factory=list)  # model, at, s, code
    pills: list[tuple[float, int]] = field(default_factory=list)
    innocents: list[tuple[float, int]] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)
    restarts: dict[str, int] = field(default_factory=dict)
    memory: str = ""  # the server's process tree before the pills (tree_memory)
    memory_after: str = ""  # and after them
    errors: list[str] = field(default_factory=list)  # the bystanders' non-200 answers


def tree_memory(root: int) -> str:
    """RSS and PSS summed over ``root`` and its descendants (Linux ``/proc``).

    RSS counts the pages a forked runtime shares with its zygote once per process; PSS
    splits each shared page among the processes that map it, so its sum is what the tree
    really holds."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, []))
    rss = pss = 0
    for pid in pids:
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue
        kib = {line.split(":")[0]: int(line.split()[1]) for line in rollup[1:]}
        rss, pss = rss + kib.get("Rss", 0), pss + kib.get("Pss", 0)
    return f"{len(pids)} processes, RSS {rss / 1024:.0f} MiB, PSS {pss / 1024:.0f} MiB"


async def scenario(base: str, baseline_s: float, after_s: float, server_pid: int) -> Run:
    run = Run()
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
        for model, body in REQUESTS.items():
            for _ in range(5):
                (await client.post(f"{base}/v1/models/{model}/infer", **body)).raise_for_status()
        (await client.post(f"{base}/v1/models/crasher/infer", content=b"warm",
                           headers={"content-type": "text/plain"})).raise_for_status()
        stop = asyncio.Event()
        sink: list[list[tuple[str, float, float, int]]] = [run.baseline]

        async def loop(model: str) -> None:
            while not stop.is_set():
                at = time.monotonic()
                try:
                    answer = await client.post(f"{base}/v1/models/{model}/infer",
                                               **REQUESTS[model])
                    code = answer.status_code
                    if code != 200:
                        run.errors.append(f"{model} {code}: {answer.text[:200]}")
                except httpx.HTTPError:
                    code = 0
                sink[0].append((model, at, time.monotonic() - at, code))

        async def crasher(body: bytes, into: list[tuple[float, int]], deadline_s: str | None
                          ) -> None:
            headers = {"content-type": "text/plain"}
            if deadline_s:
                headers["x-request-timeout"] = deadline_s
            at = time.monotonic()
            try:
                code = (await client.post(f"{base}/v1/models/crasher/infer", content=body,
                                          headers=headers)).status_code
            except httpx.HTTPError:
                code = 0
            into.append((time.monotonic() - at, code))

        loops = [asyncio.ensure_future(loop(m)) for m in CLIENTS]
        await asyncio.sleep(baseline_s)
        run.memory = tree_memory(server_pid)  # a spare's or zygote's imports are done by now
        sink[0] = run.traffic
        started = time.monotonic()
        # Pills with a long deadline, to see how long they really take; innocents with
        # crasher's own (timeout_s).
        await asyncio.gather(*(crasher(b"CRASH", run.pills, "30") for _ in range(PILLS)),
                             *(crasher(b"hello", run.innocents, None) for _ in range(INNOCENTS)))
        run.window = (started, time.monotonic())
        await asyncio.sleep(after_s)
        run.memory_after = tree_memory(server_pid)
        stop.set()
        await asyncio.gather(*loops)
        workers = (await client.get(f"{base}/v1/fleet")).json()["workers"]
        run.restarts = {r["name"]: r["restarts"] for w in workers for r in w["runtimes"]}
    return run


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one(broker: str, baseline_s: float, after_s: float) -> Run:
    port = free_port()
    env = {**os.environ, "MODELFLEET_RUNTIME__PING_INTERVAL_S": "0.5"}
    with tempfile.TemporaryDirectory() as tmp:
        env["MODELFLEET_DLQ_DB"] = str(Path(tmp) / "dlq.sqlite3")
        if broker != "memory":
            tag = f"pills{uuid.uuid4().hex[:8]}"
            env.update({"MODELFLEET_BROKER__QUEUE_PREFIX": f"{tag}.",
                        "MODELFLEET_BROKER__EVENTS_EXCHANGE": f"{tag}.events",
                        "MODELFLEET_BROKER__DEAD_LETTER_QUEUE": f"{tag}.dead-letters"})
        log = open(Path(tmp) / "serve.log", "wb")
        server = subprocess.Popen(
            [sys.executable, "-m", "modelfleet", "serve", "--repo",
             str(ROOT / "examples" / "models"), "--port", str(port), "--broker", broker],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 90
            while True:
                try:
                    if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit(f"modelfleet serve ({broker}) did not become ready")
                time.sleep(0.2)
            return asyncio.run(scenario(base, baseline_s, after_s, server.pid))
        finally:
            server.terminate()
            try:
                server.wait(20)
            except subprocess.TimeoutExpired:
                server.kill()
            log.close()
            if os.environ.get("PILL_BENCH_LOG_DIR"):  # keep each run's whole log there
                kept = Path(os.environ["PILL_BENCH_LOG_DIR"])
                kept.mkdir(parents=True, exist_ok=True)
                name = "memory" if broker == "memory" else "amqp"
                shutil.copy(Path(tmp) / "serve.log",
                            kept / f"serve-{name}-{time.strftime('%H%M%S')}.log")
            if os.environ.get("PILL_BENCH_LOG"):
                print((Path(tmp) / "serve.log").read_text(errors="replace")[-20000:])


def row(name: str, samples: list[tuple[str, float, float, int]]) -> str:
    seconds = [s for _, _, s, _ in samples]
    bad = Counter(code for _, _, _, code in samples if code != 200)
    return (f"| {name} | {len(samples)} | {pct(seconds, 0.5) * 1000:.0f} | "
            f"{pct(seconds, 0.99) * 1000:.0f} | {max(seconds, default=0) * 1000:.0f} | "
            f"{dict(bad) or 0} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--brokers", default="memory,amqp")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--baseline-s", type=float, default=6.0)
    parser.add_argument("--after-s", type=float, default=4.0)
    args = parser.parse_args()
    for broker in args.brokers.split(","):
        for n in range(args.runs):
            run = one(AMQP if broker == "amqp" else broker, args.baseline_s, args.after_s)
            start, end = run.window
            during = [t for t in run.traffic if start <= t[1] <= end]
            after = [t for t in run.traffic if t[1] > end]
            print(f"\n{broker} run {n + 1}: pills window {end - start:.2f} s")
            print("| bystanders | requests | p50 ms | p99 ms | max ms | not 200 |")
            print("|---|---:|---:|---:|---:|---|")
            print(row("baseline", run.baseline))
            print(row("during the pills", during))
            print(row("after the pills", after))
            for model in REQUESTS:
                print(row(f"  {model} during", [t for t in during if t[0] == model]))
            print(f"pills: {', '.join(f'{s:.2f} s ({c})' for s, c in sorted(run.pills))}")
            innocent = [s for s, _ in run.innocents]
            codes = Counter(c for _, c in run.innocents)
            print(f"crasher innocents: max {max(innocent, default=0):.2f} s, {dict(codes)}")
            print(f"restarts: {run.restarts}")
            print(f"memory before the pills: {run.memory}; after: {run.memory_after}")
            for error in sorted(set(run.errors))[:5]:
                print(f"bystander error: {error}")


if __name__ == "__main__":
    main()
