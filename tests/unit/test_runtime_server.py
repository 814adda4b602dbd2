"""RuntimeServer.infer, in-process: the reply a worker publishes for one task."""

from __future__ import annotations

import zstandard

from modelfleet.messages import PayloadRef, Task, decode_reply, now_ms
from modelfleet.runtime.server import RuntimeServer, encode_result
from modelfleet.settings import RuntimeSettings, Settings
from tests.procs import EXAMPLES


def task(model_id: str, body: bytes, ctype: str, deadline_s: float = 30) -> Task:
    return Task("r1", model_id, "1", now_ms() + int(deadline_s * 1000), "inbox.x",
                PayloadRef("inline", data=body, size_bytes=len(body)), ctype, now_ms())


def server(threshold: int) -> RuntimeServer:
    return RuntimeServer(Settings(repo=str(EXAMPLES), runtime=RuntimeSettings(
        compress_threshold_bytes=threshold)), "test")


async def test_large_results_are_compressed_small_ones_not() -> None:
    runtime = server(threshold=512)
    text = " ".join(f"w{i}" for i in range(400)).encode()
    big = decode_reply(await runtime.infer(task("banner", text, "text/plain"), ["text/plain"]))
    assert big.status == "ok" and big.compressed and big.cold
    assert b"w399" in zstandard.ZstdDecompressor().decompress(big.body)
    small = decode_reply(await runtime.infer(task("banner", b"hi", "text/plain"),
                                             ["text/plain"]))
    assert small.status == "ok" and not small.compressed and not small.cold
    assert set(small.timings_ms) >= {"payload_fetch", "model_load", "preprocess", "predict",
                                     "postprocess"}
    await runtime.host.close()


async def test_errors_become_failure_replies() -> None:
    runtime = server(threshold=512)
    bad = decode_reply(await runtime.infer(task("iris", b"{oops", "application/json"),
                                           ["application/json"]))
    assert bad.status == "error" and bad.error_code == "invalid_input"
    late = decode_reply(await runtime.infer(task("iris", b"{}", "application/json",
                                                 deadline_s=-1), ["application/json"]))
    assert late.error_code == "deadline_exceeded"
    await runtime.host.close()


def test_numpy_results_encode_as_json() -> None:
    import numpy as np

    body, ctype = encode_result({"x": np.float32(1.5), "v": np.arange(3)})
    assert ctype == "application/json" and body == b'{"x":1.5,"v":[0,1,2]}'
