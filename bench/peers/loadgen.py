"""The peers bench's load generator: closed-loop keep-alive HTTP clients, and an AMQP baseline.

Runs in its own venv (aiohttp, aio-pika, numpy), one process per workload, so the
orchestrator's bookkeeping never shares its event loop:

    python loadgen.py http CONFIG_JSON      -> one JSON result on stdout
    python loadgen.py amqp-rtt CONFIG_JSON  -> one JSON result on stdout

HTTP: ``clients`` coroutines share one aiohttp session whose pool holds ``clients``
connections (keep-alive: each client reuses one connection). Each sends a request,
waits for the whole answer, and sends the next. The model is fixed or drawn per request
by a seeded Zipf sampler per client. Timeline: ``warmup_s`` not counted, then
``measure_s`` measured; latencies and errors are of requests *started* in the window
(in-flight ones are waited for at the end, up to the client timeout); req/s counts the
successful answers *completed* in the window. At the window's start and end it reads
the load log's line count and scrapes the given /metrics URLs.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from stats import Zipf, fold_prometheus, summarize

N_BODIES = 64  # distinct inputs, cycled
MODEL_HEADER = "serve_multiplexed_model_id"


def build_bodies(protocol: str, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((N_BODIES, 64), dtype=np.float32).round(4).tolist()
    if protocol == "mlserver":
        return [json.dumps({"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32",
                                        "data": row}]}).encode() for row in rows]
    return [json.dumps({"inputs": row}).encode() for row in rows]


def request_target(protocol: str, base: str, model: str) -> tuple[str, dict[str, str]]:
    headers = {"content-type": "application/json"}
    if protocol == "mlserver":
        return f"{base}/v2/models/{model}/infer", headers
    if protocol == "ray":
        return f"{base}/infer", {**headers, MODEL_HEADER: model}
    return f"{base}/v1/models/{model}/infer", headers  # plain, modelfleet


def logits_of(protocol: str, body: bytes) -> list[float] | None:
    """The 10 logits of an answer, or None when it does not hold them."""
    try:
        data = json.loads(body)
        values = data["outputs"][0]["data"] if protocol == "mlserver" else data["outputs"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(values, list) or len(values) != 10:
        return None
    return values


def parse_server_timing(header: str) -> dict[str, float]:
    """``queue;dur=1.50, predict;dur=0.20`` -> {"queue": 1.5, "predict": 0.2} (ms)."""
    out: dict[str, float] = {}
    for part in header.split(","):
        name, _, rest = part.strip().partition(";dur=")
        try:
            out[name] = float(rest)
        except ValueError:
            continue
    return out


def phase_breakdown(phases: list[tuple[float, str, bool]]) -> dict[str, Any]:
    """What the answers' time is made of (the server's own phases, Server-Timing), for
    all of them, for the middle tenth (from the p45 to the p55: what the median is made
    of) and for the slowest 1 % (at or over the p99): the mean ms of each phase and the
    share answered cold (the model loaded for it)."""
    ordered = sorted(phases, key=lambda p: p[0])
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))][0]
    middle = ordered[int(0.45 * len(ordered)):max(int(0.55 * len(ordered)), 1)]

    def describe(rows: list[tuple[float, str, bool]]) -> dict[str, Any]:
        sums: dict[str, float] = {}
        for _, header, _ in rows:
            for name, ms in parse_server_timing(header).items():
                sums[name] = sums.get(name, 0.0) + ms
        return {"n": len(rows), "latency_ms": round(1000 * sum(r[0] for r in rows)
                                                    / len(rows), 1),
                "cold_share": round(sum(1 for r in rows if r[2]) / len(rows), 3),
                "phase_ms": {k: round(v / len(rows), 1) for k, v in sorted(sums.items())}}

    return {"all": describe(ordered), "middle": describe(middle),
            "tail": describe([p for p in ordered if p[0] >= p99])}


def count_lines(path: str | None) -> int | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


async def snapshot(session: aiohttp.ClientSession, urls: list[str],
                   load_log: str | None) -> dict[str, Any]:
    texts = []
    for url in urls:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
                texts.append(await r.text())
        except (aiohttp.ClientError, TimeoutError) as exc:
            texts.append(f"# scrape of {url} failed: {exc!r}\n")
    return {"t": time.monotonic(), "load_log_lines": count_lines(load_log),
            "metrics": fold_prometheus("\n".join(texts)) if urls else {}}


async def run_http(cfg: dict[str, Any]) -> dict[str, Any]:
    protocol, base = cfg["protocol"], cfg["base"].rstrip("/")
    clients, warmup_s, measure_s = int(cfg["clients"]), float(cfg["warmup_s"]), \
        float(cfg["measure_s"])
    timeout_s = float(cfg.get("timeout_s", 30))
    seed = int(cfg.get("seed", 1))
    models: list[str] = cfg["models"]  # rank order
    fixed = cfg.get("model")
    bodies = build_bodies(protocol, seed)
    targets = {m: request_target(protocol, base, m) for m in ([fixed] if fixed else models)}
    check_every = int(cfg.get("check_every", 50))

    started: list[tuple[float, float, str, str]] = []  # (t0, t1, model, outcome)
    phases: list[tuple[float, str, bool]] = []  # modelfleet: (latency, Server-Timing, cold)
    warm_models: dict[str, int] = {}  # requests per model started in the warm-up
    status_counts: dict[str, int] = {}
    error_samples: list[str] = []
    checked = bad = 0
    connector = aiohttp.TCPConnector(limit=clients, limit_per_host=clients,
                                     keepalive_timeout=120, enable_cleanup_closed=True)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session, \
            aiohttp.ClientSession() as scraper:
        t_begin, wall_begin = time.monotonic(), time.time()
        ws, we = t_begin + warmup_s, t_begin + warmup_s + measure_s
        snaps: dict[str, Any] = {}

        async def snap_at(name: str, at: float) -> None:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            snaps[name] = await snapshot(scraper, cfg.get("metrics_urls", []),
                                         cfg.get("load_log"))

        async def client(index: int) -> None:
            nonlocal checked, bad
            zipf = None if fixed else Zipf(len(models), float(cfg.get("zipf_s", 1.0)),
                                           seed=seed * 1000 + index)
            n = index
            while True:
                t0 = time.monotonic()
                if t0 >= we:
                    return
                model = fixed if fixed else models[zipf()]  # type: ignore[misc]
                url, headers = targets[model]
                body = bodies[n % N_BODIES]
                n += 1
                answer = b""
                timing, cold = "", False
                try:
                    async with session.post(url, data=body, headers=headers) as r:
                        answer = await r.read()
                        status = r.status
                        timing = r.headers.get("Server-Timing", "")
                        cold = r.headers.get("X-Model-Cold") == "1"
                    outcome = str(status)
                except TimeoutError:
                    outcome = "timeout"
                except aiohttp.ClientError as exc:
                    outcome = f"exception:{type(exc).__name__}"
                    answer = str(exc).encode()
                    await asyncio.sleep(0.05)  # a refused connection must not spin
                t1 = time.monotonic()
                if t0 < ws:
                    warm_models[model] = warm_models.get(model, 0) + 1
                else:
                    started.append((t0, t1, model, outcome))
                    if timing and outcome == "200":
                        phases.append((t1 - t0, timing, cold))
                    if outcome != "200":
                        status_counts[outcome] = status_counts.get(outcome, 0) + 1
                        if len(error_samples) < 8 and outcome != "timeout":
                            error_samples.append(f"{outcome} {model}: "
                                                 f"{answer[:300].decode(errors='replace')}")
                if outcome == "200" and (checked < 20 or n % check_every == 0):
                    checked += 1
                    if logits_of(protocol, answer) is None:
                        bad += 1
                        if len(error_samples) < 8:
                            error_samples.append(f"bad answer {model}: {answer[:300]!r}")

        await asyncio.gather(snap_at("start", ws), snap_at("end", we),
                             *(client(i) for i in range(clients)))
        t_done = time.monotonic()

    window = we - ws
    ok_latencies = [t1 - t0 for t0, t1, _, o in started if o == "200"]
    completed_ok = sum(1 for _, t1, _, o in started if o == "200" and t1 <= we)
    timeouts = sum(1 for *_, o in started if o == "timeout")
    errors = sum(1 for *_, o in started if o not in ("200", "timeout"))
    result = summarize(ok_latencies, window, errors=errors, timeouts=timeouts)
    # Throughput: successful answers completed inside the window (started there too).
    result["req_per_s"] = round(completed_ok / window, 2)
    result["requests_started"] = len(started)
    result["completed_ok"] = completed_ok
    # The window in unix time: the orchestrator reads its CPU and RSS samples and the load
    # log's timestamped lines over it.
    result["window_start_unix"] = round(wall_begin + warmup_s, 3)
    result["window_end_unix"] = round(wall_begin + warmup_s + measure_s, 3)
    result["drain_s"] = round(max(0.0, t_done - we), 3)
    result["status_counts"] = status_counts
    result["error_samples"] = error_samples
    result["answers_checked"], result["bad_answers"] = checked, bad
    per_model: dict[str, int] = {}
    for _, _, model, _ in started:
        per_model[model] = per_model.get(model, 0) + 1
    result["models_requested"] = len(per_model)
    result["requests_per_model"] = {m: per_model[m] for m in models if m in per_model}
    result["warmup_requests_per_model"] = {m: warm_models[m] for m in models
                                           if m in warm_models}
    if phases:
        result["phases"] = phase_breakdown(phases)
    start, end = snaps.get("start", {}), snaps.get("end", {})
    if cfg.get("load_log"):
        result["loads_in_window_log"] = (end.get("load_log_lines") or 0) - \
            (start.get("load_log_lines") or 0)
    if cfg.get("metrics_urls"):
        result["metrics_start"], result["metrics_end"] = start.get("metrics"), \
            end.get("metrics")
    return result


async def run_amqp_rtt(cfg: dict[str, Any]) -> dict[str, Any]:
    """Bare aio-pika round trip, one caller: confirmed publish to a quorum queue, a consumer
    in this process answers with a confirmed publish to a reply queue, the caller gets it.

    Caller and consumer have a connection each (as a gateway and a worker would).
    """
    import aio_pika

    url = cfg["url"]
    warmup_s, measure_s = float(cfg["warmup_s"]), float(cfg["measure_s"])
    tag = cfg.get("tag") or uuid.uuid4().hex[:8]
    request_q, reply_q = f"bench-rtt-{tag}.requests", f"bench-rtt-{tag}.replies"
    caller_conn = await aio_pika.connect(url)
    worker_conn = await aio_pika.connect(url)
    try:
        caller = await caller_conn.channel(publisher_confirms=True)
        worker = await worker_conn.channel(publisher_confirms=True)
        await worker.set_qos(prefetch_count=16)
        requests = await worker.declare_queue(request_q, durable=True,
                                              arguments={"x-queue-type": "quorum"})
        replies = await caller.declare_queue(reply_q, exclusive=True, auto_delete=True)
        waiting: dict[str, asyncio.Future[bytes]] = {}

        async def on_request(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await worker.default_exchange.publish(
                aio_pika.Message(message.body, correlation_id=message.correlation_id),
                routing_key=message.reply_to or reply_q)
            await message.ack()

        async def on_reply(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            future = waiting.pop(message.correlation_id or "", None)
            if future is not None and not future.done():
                future.set_result(message.body)
            await message.ack()

        await requests.consume(on_request)
        await replies.consume(on_reply)
        body = json.dumps({"inputs": [0.5] * 64}).encode()
        latencies: list[float] = []
        t_begin = time.monotonic()
        ws, we = t_begin + warmup_s, t_begin + warmup_s + measure_s
        n = 0
        while True:
            t0 = time.monotonic()
            if t0 >= we:
                break
            cid = f"{n}"
            n += 1
            future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
            waiting[cid] = future
            await caller.default_exchange.publish(
                aio_pika.Message(body, correlation_id=cid, reply_to=reply_q,
                                 delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=request_q)
            await asyncio.wait_for(future, 10)
            if t0 >= ws:
                latencies.append(time.monotonic() - t0)
        result = summarize(latencies, measure_s)
        try:
            version = caller_conn.transport.connection.server_properties.get("version")
            result["rabbitmq_version"] = version.decode() if isinstance(version, bytes) \
                else version
        except AttributeError:
            pass
        await worker.queue_delete(request_q)
        return result
    finally:
        await caller_conn.close()
        await worker_conn.close()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("http", "amqp-rtt"):
        print(__doc__, file=sys.stderr)
        return 2
    arg = argv[1]
    cfg = json.loads(Path(arg[1:]).read_text() if arg.startswith("@") else arg)
    run = run_http if argv[0] == "http" else run_amqp_rtt
    result = asyncio.run(run(cfg))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
