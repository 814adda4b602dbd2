"""RuntimeService.infer, in-process: the reply a worker publishes for one task, encoded once."""

from __future__ import annotations

import asyncio
from pathlib import Path

from modelfleet.messages import PayloadRef, Task, decode_reply, encode_task, now_ms
from modelfleet.runtime.server import RuntimeService, encode_result
from modelfleet.settings import Settings
from tests.procs import EXAMPLES, write_package
from tests.waiting import eventually


def task(model_id: str, body: bytes, ctype: str, deadline_s: float = 30,
         request_id: str = "r1") -> bytes:
    return encode_task(Task(request_id, model_id, "1", now_ms() + int(deadline_s * 1000), "inbox.x",
                            PayloadRef("inline", data=body, size_bytes=len(body)), ctype,
                            now_ms()))


async def test_the_reply_carries_what_the_worker_adds_and_the_whole_result() -> None:
    service = RuntimeService(Settings(repo=str(EXAMPLES)))
    text = " ".join(f"w{i}" for i in range(400)).encode()
    encoded = await service.infer(task("banner", text, "text/plain"), 0, ["text/plain"],
                                  "worker-7", 12.5)
    reply = decode_reply(encoded.data)
    assert (encoded.request_id, encoded.status) == ("r1", "ok")
    assert reply.status == "ok" and reply.cold and b"w399" in reply.body
    assert reply.worker_id == "worker-7" and reply.timings_ms["queue_wait"] == 12.5
    assert set(reply.timings_ms) >= {"payload_fetch", "model_load", "preprocess", "predict",
                                     "postprocess"}
    warm = decode_reply((await service.infer(task("banner", b"hi", "text/plain"), 0,
                                             ["text/plain"], "worker-7", 0.0)).data)
    assert warm.status == "ok" and not warm.cold
    await service.close()


async def test_errors_become_failure_replies_stamped_like_answers() -> None:
    service = RuntimeService(Settings(repo=str(EXAMPLES)))
    bad = await service.infer(task("iris", b"{oops", "application/json"), 0,
                              ["application/json"], "worker-7", 3.0)
    assert bad.status == "error"
    reply = decode_reply(bad.data)
    assert reply.error_code == "invalid_input" and reply.worker_id == "worker-7"
    assert reply.timings_ms["queue_wait"] == 3.0
    late = decode_reply((await service.infer(task("iris", b"{}", "application/json",
                                                  deadline_s=-1), 0, ["application/json"],
                                             "worker-7", 0.0)).data)
    assert late.error_code == "deadline_exceeded"
    await service.close()


def test_numpy_results_encode_as_json() -> None:
    import numpy as np

    body, ctype = encode_result({"x": np.float32(1.5), "v": np.arange(3)})
    assert ctype == "application/json" and body == b'{"x":1.5,"v":[0,1,2]}'


async def test_a_tasks_batching_override_is_what_the_batcher_takes() -> None:
    service = RuntimeService(Settings(repo=str(EXAMPLES)))
    try:
        assert decode_reply((await service.infer(
            task("banner", b"hi", "text/plain"), 0, ["text/plain"], "w", 0.0,
            {"max_batch_size": 6, "max_delay_ms": 2.5})).data).status == "ok"
        loaded = service.host.loaded("banner", "1")
        assert loaded is not None and loaded.batcher.settings == (6, 0.0025)
        # The next task without one: back to model.toml's [batching].
        await service.infer(task("banner", b"hi", "text/plain"), 0, ["text/plain"], "w", 0.0)
        own = loaded.manifest.batching
        assert loaded.batcher.settings == (own.max_batch_size, own.max_delay_ms / 1000)
        refused = decode_reply((await service.infer(
            task("banner", b"hi", "text/plain"), 0, ["text/plain"], "w", 0.0,
            {"max_batch_size": 0})).data)  # out of bounds: a clear failure, no hang
        assert refused.status == "error" and "[batching] override" in refused.error_message
    finally:
        await service.close()


async def test_a_hang_up_while_waiting_for_a_load_ends_the_task_and_the_load_goes_on(
        tmp_path: Path) -> None:
    # A model whose load waits for a file: the task waits for that load when its caller
    # hangs up. The task is answered at once (client_gone), not when the load ends; the
    # load is not interrupted, and the next task finds the model loaded.
    gate = tmp_path / "load-may-finish"
    write_package(tmp_path / "repo", "gated", """
        name = "gated"
        version = "1"
        entrypoint = "handler:Gated"
        accepts = ["text/plain"]
        device = "cpu"
        """, f"""
        import os, time
        from modelfleet import Model

        class Gated(Model):
            def load(self, ctx):
                while not os.path.exists({str(gate)!r}):
                    time.sleep(0.01)

            def predict(self, batch):
                return [{{"ok": True}} for _ in batch]
        """)
    service = RuntimeService(Settings(repo=str(tmp_path / "repo")))
    try:
        waiting = asyncio.create_task(service.infer(
            task("gated", b"x", "text/plain", request_id="gone"), 0, ["text/plain"], "w",
            0.0))
        await eventually(lambda: service.host.loading, timeout_s=10)
        assert service.cancel("gone")  # the task is here, waiting for the load
        done, _ = await asyncio.wait({waiting}, timeout=10)  # not cancelled by the test
        assert waiting in done, "the hung-up task waited for the load"
        hung_up = decode_reply(waiting.result().data)
        assert hung_up.error_code == "client_disconnected"
        assert service.host.loading  # still loading: nothing interrupted it
        gate.touch()
        await eventually(lambda: not service.host.loading, timeout_s=10)
        warm = decode_reply((await service.infer(
            task("gated", b"y", "text/plain", request_id="next"), 0, ["text/plain"], "w",
            0.0)).data)
        assert warm.status == "ok"
        assert not warm.cold  # loaded by the load the hung-up task had started
    finally:
        gate.touch()
        await service.close()
