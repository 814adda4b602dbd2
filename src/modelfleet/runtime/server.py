"""The runtime process: an IPC server in front of a ``ModelHost``.

Started by the worker's supervisor as ``python -m modelfleet.runtime --socket PATH``
with the settings in the ``MODELFLEET_RUNTIME_SETTINGS`` environment variable (JSON,
written once by the coordinator). It answers ``health`` from its event loop even
while a long ``load`` runs on a thread, so liveness survives long loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import signal
import time
from typing import Any

import zstandard

from modelfleet.errors import (
    DeadlineExceeded,
    ModelFailed,
    ModelfleetError,
    UnsupportedContentType,
)
from modelfleet.ipc.framing import error_response, pack_frame, read_frame
from modelfleet.ipc.protocol import PRELOAD_ENV, SETTINGS_ENV
from modelfleet.messages import Reply, Task, decode_task, encode_reply, now_ms
from modelfleet.model.api import Output, Request
from modelfleet.model.pipeline import handle_request
from modelfleet.redaction import secure_logging
from modelfleet.repository import open_store
from modelfleet.runtime.host import ModelHost
from modelfleet.runtime.payload import PayloadFetcher
from modelfleet.settings import Settings

log = logging.getLogger("modelfleet.runtime")
MAX_PRELOAD = 5000  # module names reported: a bound on the health answer


def _json_default(value: Any) -> Any:
    for attr in ("tolist", "item"):  # numpy arrays and scalars, without importing numpy
        method = getattr(value, attr, None)
        if callable(method):
            return method()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def encode_result(result: Any) -> tuple[bytes, str]:
    if isinstance(result, Output):
        return result.body, result.content_type
    if isinstance(result, bytes):
        return result, "application/octet-stream"
    try:
        body = json.dumps(result, default=_json_default, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise ModelFailed(f"postprocess returned something not JSON-serialisable: {exc}") from exc
    return body, "application/json"


class RuntimeServer:
    def __init__(self, settings: Settings, name: str) -> None:
        self._settings = settings
        self._name = name
        store = open_store(settings.repo, settings.state_dir / "disk-cache",
                           settings.runtime.disk_cache_bytes)
        self.host = ModelHost(settings.runtime, store)
        self._fetcher = PayloadFetcher(settings.runtime)
        self._compressor = zstandard.ZstdCompressor(level=3)
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    async def serve(self, socket_path: str) -> None:
        server = await asyncio.start_unix_server(self._connection, socket_path, limit=2**20)
        loop = asyncio.get_running_loop()
        # The coordinator stops us (the shutdown op, or closing our socket) in its own
        # order; a Ctrl-C meant for it must not stop us first. SIGTERM still does.
        loop.add_signal_handler(signal.SIGINT, lambda: None)
        loop.add_signal_handler(signal.SIGTERM, self._stopping.set)
        log.info("runtime %s listening on %s (pid %d)", self._name, socket_path, os.getpid())
        async with server:
            await self._stopping.wait()
        for task in list(self._tasks):
            task.cancel()
        await self.host.close()
        await self._fetcher.close()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        lock = asyncio.Lock()
        try:
            while True:
                frame = await read_frame(reader)
                task = asyncio.create_task(self._answer(frame, writer, lock))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            # The coordinator went away: nothing is left to answer for. Stop.
            self._stopping.set()
        except asyncio.CancelledError:
            return  # shutting down

    async def _answer(self, frame: dict[str, Any], writer: asyncio.StreamWriter,
                      lock: asyncio.Lock) -> None:
        request_id = frame.get("id", 0)
        try:
            result = await self._dispatch(frame.get("op", ""), frame.get("args", {}))
            response = {"id": request_id, "ok": True, "result": result}
        except ModelfleetError as exc:
            response = error_response(request_id, exc)
        except Exception as exc:  # a bug here must answer, not hang the caller
            log.exception("runtime op %s failed", frame.get("op"))
            response = error_response(request_id, ModelFailed(f"runtime error: {exc!r}"))
        async with lock:
            with contextlib.suppress(ConnectionError):
                writer.write(pack_frame(response))
                await writer.drain()

    async def _dispatch(self, op: str, args: dict[str, Any]) -> Any:
        if op == "infer":
            return await self.infer(decode_task(args["task"], args.get("delivery_count", 0)),
                                    args.get("accepts", []))
        if op == "health":
            return {"pid": os.getpid(), "loading": self.host.loading,
                    "load_ages_s": self.host.load_ages_s(),
                    "frameworks": sorted(self.host.frameworks)[:MAX_PRELOAD]}
        if op == "stats":
            return self.host.stats()
        if op == "load":
            await self.host.ensure(args["model_id"], args["version"], args.get("pinned", False))
            return True
        if op == "evict":
            return await self.host.evict(args["model_id"])
        if op == "shutdown":
            self._stopping.set()
            return True
        raise ModelFailed(f"unknown runtime op {op!r}")

    async def infer(self, task: Task, accepts: list[str]) -> bytes:
        """Run one task end to end; always returns an encoded Reply (errors included)."""
        timings: dict[str, float] = {}
        cold = False
        try:
            started = time.perf_counter()
            remaining_s = (task.deadline_ms - now_ms()) / 1000
            body, declared = await self._fetcher.fetch(task.payload, remaining_s)
            timings["payload_fetch"] = (time.perf_counter() - started) * 1000
            content_type = task.content_type
            if task.payload.kind == "url":
                content_type = declared or "application/octet-stream"
                if accepts and content_type not in accepts:
                    raise UnsupportedContentType(
                        f"the payload URL served {content_type}; model '{task.model_id}' "
                        f"accepts {', '.join(accepts)}")
            started = time.perf_counter()
            loaded, cold = await self.host.ensure(task.model_id, task.version)
            timings["model_load"] = (time.perf_counter() - started) * 1000
            request = Request(body, content_type, task.params, task.request_id, task.deadline_ms)
            remaining_s = (task.deadline_ms - now_ms()) / 1000
            if remaining_s <= 0:
                raise DeadlineExceeded("deadline passed before inference started")
            try:
                with loaded.using():  # taken at once: no eviction between ensure and predict
                    async with asyncio.timeout(remaining_s):
                        result, phases = await handle_request(loaded.handler, loaded.batcher,
                                                              request)
            except TimeoutError as exc:
                raise DeadlineExceeded(f"inference did not finish within the deadline "
                                       f"({remaining_s:.2f}s left when it started)") from exc
            timings.update(phases)
            data, out_type = encode_result(result)
            compressed = len(data) > self._settings.runtime.compress_threshold_bytes
            if compressed:
                data = self._compressor.compress(data)
            reply = Reply(task.request_id, "ok", data, out_type, compressed,
                          timings_ms=timings, cold=cold)
        except ModelfleetError as exc:
            reply = Reply.failure(task.request_id, exc, timings_ms=timings)
        except Exception as exc:  # a bug here must still answer the caller
            log.exception("task %s for %s failed in the runtime", task.request_id, task.model_id)
            reply = Reply.failure(task.request_id, ModelFailed(f"runtime error: {exc!r}"),
                                  timings_ms=timings)
        return encode_reply(reply)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="modelfleet-runtime")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--name", default="runtime")
    args = parser.parse_args(argv)
    settings = Settings.model_validate_json(os.environ[SETTINGS_ENV])
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [{args.name}] %(message)s")
    secure_logging()  # payload URLs are signed: no URL is logged whole, at any level
    preload(os.environ.get(PRELOAD_ENV, ""))
    asyncio.run(RuntimeServer(settings, args.name).serve(args.socket))
    return 0


def preload(modules: str) -> None:
    """Import the named modules now (best effort: a failure is only logged)."""
    names = [name for name in modules.split(",") if name]
    if not names:
        return
    started = time.perf_counter()
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:
            log.info("preloading %s failed: %r", name, exc)
    log.info("preloaded %d modules in %.2fs", len(names), time.perf_counter() - started)
