"""A catalog of N models: start-up, memory, idle CPU and the listing routes of a real
``modelfleet serve`` (embedded broker) and ``modelfleet gateway`` (RabbitMQ).

Generates N copies of ``examples/models/banner`` (``m000000`` ... : a fresh model.toml
each, the handler a symlink) into ``--repo`` (kept, reused when it already holds N),
then for each process: seconds from spawn to ``/readyz`` 200 (and the CPU seconds the
process used until then: on a busy machine the wall time stretches), RSS at ready, CPU of the
process over ``--idle-s`` seconds of idling (percent of one core, psutil), RSS after,
and the time and size of ``GET /v1/models`` and ``POST /v2/repository/index`` (one
default page, and every page followed to the end), and of a cold request.

Each process starts with a state dir of its own, empty: a first start, which parses
every manifest. With ``--restart`` it is started a second time on the same state dir
(``<kind>-restart``): a start that finds the manifest cache the first one wrote.

    .venv/bin/python bench/catalog_scale.py [--models 100000] [--repo /tmp/catalog-100k]
        [--idle-s 20] [--broker amqp://guest:guest@127.0.0.1:5672/ | --private-rabbit]
        [--only serve] [--restart]
    .venv/bin/python bench/catalog_scale.py --only refresh   # a refresh's loop lag
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.procs import Proc, free_port, loopback_client  # noqa: E402  (the tests' process helper, reused)

BANNER = ROOT / "examples" / "models" / "banner" / "1"


def generate(repo: Path, count: int) -> None:
    """``count`` banner copies under ``repo`` (skipped when it already holds them)."""
    marker = repo / f".generated-{count}"
    if marker.exists():
        return
    manifest = (BANNER / "model.toml").read_text()
    handler = BANNER / "handler.py"
    for i in range(count):
        name = f"m{i:06d}"
        folder = repo / name / "1"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.toml").write_text(manifest.replace('name = "banner"',
                                                            f'name = "{name}"'))
        if not (folder / "handler.py").exists():
            (folder / "handler.py").symlink_to(handler)
    marker.touch()


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


# One client for every timed request, made before the clock starts: a client of its own
# per request would add its set-up (~20 ms of CPU loading certificates) to each figure.
_CLIENT = loopback_client(timeout=120)


def _timed(method: str, url: str, **kwargs: object) -> tuple[float, httpx.Response]:
    started = time.perf_counter()
    response = _CLIENT.request(method, url, **kwargs)  # type: ignore[arg-type]
    return time.perf_counter() - started, response


def _pages(method: str, url: str, key: str) -> tuple[float, int, int, int]:
    """Follow ``next_cursor`` to the end: (seconds, pages, entries, bytes)."""
    started = time.perf_counter()
    cursor, pages, entries, size = None, 0, 0, 0
    while True:
        params = {"limit": "1000", **({"cursor": cursor} if cursor else {})}
        response = _CLIENT.request(method, url, params=params)
        response.raise_for_status()
        body = response.json()
        pages, size = pages + 1, size + len(response.content)
        entries += len(body[key])
        cursor = body.get("next_cursor")
        if not cursor:
            return time.perf_counter() - started, pages, entries, size


def _wait_until_idle(pid: int | None, limit_s: float = 60.0) -> None:
    """Wait until a freshly started RabbitMQ node stops working: for some seconds after
    it first answers it keeps a core busy, and a gateway started beside it then took
    twice the CPU to be ready (13.2 s against 5.4 s beside a settled node, measured)."""
    if pid is None:
        return
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = sum(_cpu(p) for p in tree)
        time.sleep(1.0)
        if sum(_cpu(p) for p in tree) - before < 0.05:  # under 5 % of a core
            return


def measure(kind: str, args: list[str], env: dict[str, str], base: str, idle_s: float,
            log_dir: Path, cold_model: str, all_pages: bool = True) -> dict[str, object]:
    started = time.perf_counter()
    proc = Proc(args, env, log_dir / f"{kind}.log", f"{base}/readyz")
    try:
        proc.wait_ready(timeout_s=300)
        ready_s = time.perf_counter() - started
        ps = psutil.Process(proc.pid)
        rss_ready = ps.memory_info().rss
        cpu_ready = _cpu(ps)  # CPU seconds to ready: what a busy machine does not stretch
        cpu0, wall0 = _cpu(ps), time.perf_counter()
        time.sleep(idle_s)
        idle_cpu = (_cpu(ps) - cpu0) / (time.perf_counter() - wall0)
        rss_idle = ps.memory_info().rss
        out: dict[str, object] = {
            "ready_s": round(ready_s, 2), "cpu_to_ready_s": round(cpu_ready, 2),
            "rss_ready_mb": round(rss_ready / 2**20),
            "idle_cpu_pct": round(100 * idle_cpu, 2), "rss_after_idle_mb": round(rss_idle / 2**20)}
        seconds, response = _timed("GET", f"{base}/v1/models")
        out["v1_models_default"] = {"s": round(seconds, 3), "bytes": len(response.content),
                                    "status": response.status_code}
        paged = all_pages and "next_cursor" in response.json()
        seconds, response = _timed("POST", f"{base}/v2/repository/index")
        out["v2_index_default"] = {"s": round(seconds, 3), "bytes": len(response.content),
                                   "status": response.status_code}
        if paged:
            s, pages, entries, size = _pages("GET", f"{base}/v1/models", "models")
            out["v1_models_all_pages"] = {"s": round(s, 2), "pages": pages, "models": entries,
                                          "bytes": size}
            s, pages, entries, size = _pages("POST", f"{base}/v2/repository/index", "models")
            out["v2_index_all_pages"] = {"s": round(s, 2), "pages": pages, "models": entries,
                                         "bytes": size}
        seconds, response = _timed("GET", f"{base}/v1/fleet/summary")
        out["fleet_summary"] = {"s": round(seconds, 3), "bytes": len(response.content)}
        if kind.startswith("serve"):
            seconds, response = _timed("POST", f"{base}/v1/models/{cold_model}/infer",
                                       content=b"hi", headers={"content-type": "text/plain"})
            out["cold_request"] = {"s": round(seconds, 3), "status": response.status_code}
        out["rss_end_mb"] = round(ps.memory_info().rss / 2**20)
        return out
    finally:
        proc.stop()


async def _lag_while(work: object) -> tuple[float, float]:
    """(seconds ``work`` took in a thread, the event loop's worst lag meanwhile): a
    ticker that wants to run every 10 ms measures how late it ran."""
    import asyncio

    worst = 0.0
    done = asyncio.Event()

    async def tick() -> None:
        nonlocal worst
        while not done.is_set():
            planned = time.perf_counter() + 0.01
            await asyncio.sleep(0.01)
            worst = max(worst, time.perf_counter() - planned)

    ticker = asyncio.create_task(tick())
    started = time.perf_counter()
    await asyncio.to_thread(work)  # type: ignore[arg-type]
    took = time.perf_counter() - started
    done.set()
    await ticker
    return took, worst


def refresh_lag(repo: Path, touched: int) -> dict[str, object]:
    """A refresh of the whole repository off the loop, as ``serve`` runs it: the scan's
    time and CPU, and the loop's worst lag, with nothing changed and with ``touched``
    manifests rewritten."""
    import asyncio

    from modelfleet.repository import Catalog, CatalogUpdate, LocalStore

    store = LocalStore(repo)
    cpu = time.process_time()
    catalog = Catalog.from_store(store)
    out: dict[str, object] = {"from_store_cpu_s": round(time.process_time() - cpu, 2)}
    for label, count in (("unchanged", 0), (f"{touched}_changed", touched)):
        for i in range(count):
            manifest = repo / f"m{i:06d}" / "1" / "model.toml"
            manifest.write_text(manifest.read_text())
            old = time.time() - 60
            os.utime(manifest, (old, old))
        updates: list[CatalogUpdate] = []
        cpu = time.process_time()
        took, lag = asyncio.run(_lag_while(
            lambda into=updates: into.append(catalog.scan(store))))
        out[label] = {"scan_s": round(took, 2), "cpu_s": round(time.process_time() - cpu, 2),
                      "parsed": updates[0].parses, "worst_loop_lag_ms": round(lag * 1000, 1)}
        catalog.apply(updates[0])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=100_000)
    parser.add_argument("--repo", type=Path, default=None)
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--broker", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--only", choices=("serve", "gateway", "refresh"), default=None)
    parser.add_argument("--no-all-pages", action="store_true",
                        help="skip reading every page (minutes at 100,000 on a busy VM)")
    parser.add_argument("--private-rabbit", action="store_true",
                        help="run the gateway on a RabbitMQ node of its own "
                             "(modelfleet.devtools.rabbit_node), not on --broker")
    parser.add_argument("--restart", action="store_true",
                        help="start each process again on the state dir its first start "
                             "left (the manifest cache)")
    opts = parser.parse_args()
    repo = opts.repo or Path(tempfile.gettempdir()) / f"modelfleet-catalog-{opts.models}"
    started = time.perf_counter()
    generate(repo, opts.models)
    print(f"repository: {opts.models} models in {repo} "
          f"({time.perf_counter() - started:.1f}s to make)", flush=True)
    log_dir = Path(tempfile.mkdtemp(prefix="catalog-scale-"))
    env = {"MODELFLEET_TENANCY__AUTH": "off", "MODELFLEET_DLQ_DB": str(log_dir / "dlq.sqlite3"),
           "MODELFLEET_TENANCY__DB": str(log_dir / "tenants.sqlite3")}
    cold = f"m{opts.models // 2:06d}"
    results: dict[str, dict[str, object]] = {}
    if opts.only == "refresh":
        results["refresh"] = refresh_lag(repo, 1000)
        print("refresh", json.dumps(results["refresh"]), flush=True)
    with contextlib.ExitStack() as stack:
        amqp = opts.broker
        if opts.private_rabbit and opts.only in (None, "gateway"):
            from modelfleet.devtools.rabbit_node import RabbitNode

            node = stack.enter_context(RabbitNode.started(log_dir / "rabbitmq"))
            amqp = node.url
            _wait_until_idle(node.pid)
        for kind in ("serve", "gateway"):
            if opts.only != kind and opts.only is not None:
                continue
            state = {"MODELFLEET_STATE_DIR": str(log_dir / f"state-{kind}")}
            for run in (kind, f"{kind}-restart") if opts.restart else (kind,):
                port = free_port()
                broker = "memory" if kind == "serve" else amqp
                results[run] = measure(run, [kind, "--repo", str(repo), "--port", str(port),
                                             "--broker", broker], env | state,
                                       f"http://127.0.0.1:{port}", opts.idle_s, log_dir, cold,
                                       not opts.no_all_pages)
                print(run, json.dumps(results[run]), flush=True)
    print(f"logs in {log_dir}")
    if os.environ.get("CATALOG_SCALE_JSON"):
        Path(os.environ["CATALOG_SCALE_JSON"]).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
