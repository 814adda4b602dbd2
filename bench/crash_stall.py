"""How long one runtime's crash stalls the other models on it: with and without a standby.

Starts ``modelfleet serve`` on the examples (one shared runtime) twice, side by side in
one run: with ``worker.standby_keep_s=0`` (a crash restarts the interpreter) and with the
default (after a first crash, a started spare takes over). In each, one client sends iris
requests back to back while the runtime is killed (SIGKILL) every few seconds; the stall
of a crash is the longest iris request around it.

    .venv/bin/python bench/crash_stall.py [--crashes 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from modelfleet.runtime.zygote import ZYGOTE_COMM

ROOT = Path(__file__).resolve().parent.parent
IRIS = {"features": [5.1, 3.5, 1.4, 0.2]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serving_runtime(pid: int) -> int:
    """The oldest runtime child: the one serving (a standby is started after it)."""
    runtimes = [p for p in psutil.Process(pid).children(recursive=True)
                if (runtime_name(p) or "").startswith("runtime-")]
    return min(runtimes, key=lambda p: p.create_time()).pid


def runtime_name(process: psutil.Process) -> str | None:
    """The runtime a process runs: its ``--name``, or for one forked from the worker's
    zygote (whose command line it has) its process name (``runtime/zygote.py``)."""
    cmdline = process.cmdline()
    if "modelfleet.runtime.zygote" in cmdline:
        return None if process.name() == ZYGOTE_COMM else process.name()
    if "modelfleet.runtime" in cmdline and "--name" in cmdline:
        return cmdline[cmdline.index("--name") + 1]
    return None


async def send_until(client: httpx.AsyncClient, base: str, stop: asyncio.Event,
                     latencies: list[float]) -> None:
    while not stop.is_set():
        started = time.monotonic()
        response = await client.post(f"{base}/v1/models/iris/infer", json=IRIS)
        response.raise_for_status()
        latencies.append(time.monotonic() - started)


async def stalls(base: str, server_pid: int, crashes: int) -> list[float]:
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(20):
            await client.post(f"{base}/v1/models/iris/infer", json=IRIS)
        found = []
        for _ in range(crashes):
            latencies: list[float] = []
            stop = asyncio.Event()
            sender = asyncio.ensure_future(send_until(client, base, stop, latencies))
            await asyncio.sleep(1.5)
            os.kill(serving_runtime(server_pid), signal.SIGKILL)
            await asyncio.sleep(4.5)  # past the restart and a spare's start
            stop.set()
            await sender
            found.append(max(latencies))
        return found


def run(standby_keep_s: str, crashes: int) -> list[float]:
    port = free_port()
    env = {**os.environ, "MODELFLEET_WORKER__STANDBY_KEEP_S": standby_keep_s,
           "MODELFLEET_RUNTIME__PING_INTERVAL_S": "0.5"}
    server = subprocess.Popen([sys.executable, "-m", "modelfleet", "serve", "--repo",
                               str(ROOT / "examples" / "models"), "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("modelfleet serve did not become ready")
            time.sleep(0.2)
        return asyncio.run(stalls(base, server.pid, crashes))
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crashes", type=int, default=4)
    args = parser.parse_args()
    rows = [("restart (standby_keep_s=0)", run("0", args.crashes)),
            ("standby (default)", run("300", args.crashes))]
    print("| runtime after a crash | stall per crash, s | median of crashes 2.. |")
    print("|---|---|---:|")
    for name, found in rows:
        later = statistics.median(found[1:]) if len(found) > 1 else found[0]
        print(f"| {name} | {', '.join(f'{s:.2f}' for s in found)} | {later:.2f} |")


if __name__ == "__main__":
    main()
