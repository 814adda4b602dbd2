"""The Open Inference Protocol v2 data plane against /v1, on the warm path of one server.

Starts one ``modelfleet serve`` (embedded broker) on loopback and sends the iris example
the same rows three ways, interleaved round by round so the ratios compare like with
like on a shared machine: /v1 JSON (one row per request: the v1 handler takes one),
/v2 JSON tensors and /v2 binary tensors (rows per request as given). For each: the
sequential latency (p50, p99) per request and per row. A second table is the codec
alone (no server): encoding and decoding a request of N FP32 values as JSON and in
binary. A third table puts gRPC (``inference.GRPCInferenceService``, raw tensor
contents) beside JSON and binary HTTP: p50 and req/s at 1 and 32 requests in flight, for
1 row and 4,096 rows of FP32.

    .venv/bin/python bench/oip.py [--rows 1 64 4096] [--requests 200] [--flight-s 5]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from modelfleet.gateway.grpc_api import inference_pb2 as pb  # noqa: E402
from modelfleet.oip.codec import decode_response, encode_request, parse_request  # noqa: E402
from tests.procs import free_port, serve  # noqa: E402  (the tests' process helpers, reused)

ROW = [5.1, 3.5, 1.4, 0.2]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def v2_call(rows: int, binary: bool) -> tuple[bytes, dict[str, str]]:
    features = np.tile(np.array([ROW], np.float32), (rows, 1))
    body, header_length = encode_request({"features": features}, binary=binary,
                                         outputs=["class_index"], binary_outputs=binary)
    headers = {} if header_length is None else {
        "Inference-Header-Content-Length": str(header_length)}
    return body, headers


async def timed(client: httpx.AsyncClient, url: str, body: bytes,
                headers: dict[str, str]) -> float:
    started = time.perf_counter()
    response = await client.post(url, content=body, headers=headers)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed


async def measure(base: str, rows: int, n: int) -> dict[str, list[float]]:
    v1 = (f"{base}/v1/models/iris/infer", f'{{"features": {ROW}}}'.encode(),
          {"content-type": "application/json"})
    v2 = f"{base}/v2/models/iris/infer"
    ways = {"v1 json (1 row)": v1,
            f"v2 json ({rows} rows)": (v2, *v2_call(rows, False)),
            f"v2 binary ({rows} rows)": (v2, *v2_call(rows, True))}
    out: dict[str, list[float]] = {name: [] for name in ways}
    async with httpx.AsyncClient(timeout=60) as client:
        for url, body, headers in ways.values():  # warm: model loaded, connections open
            for _ in range(5):
                await timed(client, url, body, headers)
        for _ in range(n):
            for name, (url, body, headers) in ways.items():
                out[name].append(await timed(client, url, body, headers))
    return out


def grpc_request(rows: int) -> pb.ModelInferRequest:
    features = np.tile(np.array([ROW], np.float32), (rows, 1))
    request = pb.ModelInferRequest(model_name="iris")
    request.inputs.add(name="features", datatype="FP32", shape=list(features.shape))
    request.outputs.add(name="class_index")
    request.raw_input_contents.append(features.tobytes())
    return request


async def in_flight(base: str, address: str, rows: int, flight: int, seconds: float
                    ) -> dict[str, tuple[float, float]]:
    """way -> (p50 s, requests/s) with ``flight`` requests in flight for ``seconds``."""
    url = f"{base}/v2/models/iris/infer"
    json_body, json_headers = v2_call(rows, False)
    binary_body, binary_headers = v2_call(rows, True)
    out: dict[str, tuple[float, float]] = {}
    limits = httpx.Limits(max_connections=flight, max_keepalive_connections=flight)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client, \
            grpc.aio.insecure_channel(address) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                    request_serializer=pb.ModelInferRequest.SerializeToString,
                                    response_deserializer=pb.ModelInferResponse.FromString)
        message = grpc_request(rows)

        async def via_grpc() -> None:
            await infer(message, timeout=60)

        async def via_http(body: bytes, headers: dict[str, str]) -> None:
            (await client.post(url, content=body, headers=headers)).raise_for_status()

        ways: dict[str, Callable[[], Any]] = {
            "http json": lambda: via_http(json_body, json_headers),
            "http binary": lambda: via_http(binary_body, binary_headers),
            "grpc raw": via_grpc}
        for name, send in ways.items():
            for _ in range(3):
                await send()  # warm: the model loaded, connections open
            times: list[float] = []
            stop = time.perf_counter() + seconds
            began = time.perf_counter()
            await asyncio.gather(*(_loop(send, stop, times) for _ in range(flight)))
            out[name] = (pct(times, 0.5), len(times) / (time.perf_counter() - began))
    return out


async def _loop(send: Callable[[], Any], stop: float, times: list[float]) -> None:
    """One closed-loop sender until ``stop``; each request's latency into ``times``."""
    while time.perf_counter() < stop:
        started = time.perf_counter()
        await send()
        times.append(time.perf_counter() - started)


def codec_rate(values: int, binary: bool) -> tuple[float, float, int]:
    """(encode MB/s, decode MB/s, body bytes) for a request of ``values`` FP32 values."""
    array = np.random.default_rng(0).random(values, dtype=np.float32)
    mb = array.nbytes / 1e6

    def best(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(3):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return min(times)

    body, header_length = encode_request({"x": array}, binary=binary)
    encode_s = best(lambda: encode_request({"x": array}, binary=binary))
    decode_s = best(lambda: parse_request(body, header_length).decode_inputs())
    return mb / encode_s, mb / decode_s, len(body)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 4096])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--flight-s", type=float, default=5.0,
                        help="seconds per way of the in-flight table")
    args = parser.parse_args()
    tmp = Path("/tmp") / f"modelfleet-bench-oip-{time.time_ns()}"
    tmp.mkdir(parents=True)
    grpc_port = free_port()
    proc, base = serve(tmp, name="bench-oip",
                       env={"MODELFLEET_GATEWAY__GRPC_PORT": str(grpc_port)})
    try:
        print(f"iris on modelfleet serve (embedded broker), {args.requests} sequential "
              f"requests per way, interleaved")
        print(f"{'way':<24}{'p50 ms':>9}{'p99 ms':>9}{'p50 us/row':>12}{'vs v1 p50':>11}")
        for rows in args.rows:
            results = asyncio.run(measure(base, rows, args.requests))
            v1_p50 = pct(results["v1 json (1 row)"], 0.5)
            for name, times in results.items():
                per = rows if name.startswith("v2") else 1
                p50 = pct(times, 0.5)
                print(f"{name:<24}{p50 * 1e3:>9.2f}{pct(times, 0.99) * 1e3:>9.2f}"
                      f"{p50 / per * 1e6:>12.1f}{p50 / v1_p50:>10.2f}x")
        # A sanity check that the answers are right, not only fast.
        body, headers = v2_call(3, True)
        answer = httpx.post(f"{base}/v2/models/iris/infer", content=body, headers=headers)
        _, arrays = decode_response(answer.content,
                                    int(answer.headers["inference-header-content-length"]))
        assert arrays["class_index"].tolist() == [0, 0, 0]
        print()
        print(f"gRPC beside HTTP: iris, {args.flight_s:.0f} s per way, ways one after another")
        print(f"{'rows':>6}{'in flight':>11}{'way':>13}{'p50 ms':>9}{'req/s':>9}"
              f"{'vs http binary':>16}")
        for rows in (1, 4096):
            for flight in (1, 32):
                table = asyncio.run(in_flight(base, f"127.0.0.1:{grpc_port}", rows, flight,
                                              args.flight_s))
                reference = table["http binary"][1]
                for name, (p50, rate) in table.items():
                    print(f"{rows:>6}{flight:>11}{name:>13}{p50 * 1e3:>9.2f}{rate:>9.1f}"
                          f"{rate / reference:>15.2f}x")
    finally:
        proc.stop()
    print()
    print("codec alone: a request of N FP32 values, best of 3")
    print(f"{'N':>10}{'format':>8}{'body MB':>9}{'encode MB/s':>13}{'decode MB/s':>13}")
    for values in (1_000, 1_000_000):
        for binary in (False, True):
            enc, dec, size = codec_rate(values, binary)
            print(f"{values:>10}{'binary' if binary else 'json':>8}{size / 1e6:>9.3f}"
                  f"{enc:>13.1f}{dec:>13.1f}")


if __name__ == "__main__":
    main()
