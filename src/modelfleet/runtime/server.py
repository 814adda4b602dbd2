"""The runtime process: ``RuntimeService`` (the ops over a ``ModelHost``) behind a socket.

Started by the worker's supervisor as ``python -m modelfleet.runtime --socket PATH``
with the settings in the ``MODELFLEET_RUNTIME_SETTINGS`` environment variable (JSON,
written once by the coordinator). It answers ``health`` from its event loop even
while a long ``load`` runs on a thread, so liveness survives long loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import json
import logging
import os
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from modelfleet.errors import (
    ClientGone,
    DeadlineExceeded,
    ModelFailed,
    ModelfleetError,
    UnsupportedContentType,
)
from modelfleet.ipc.flight import FLIGHT_ENV, FlightRecord
from modelfleet.ipc.framing import Frame, error_header, pack_frame, read_frame
from modelfleet.ipc.protocol import (
    NICE_ENV,
    PRELOAD_ENV,
    SETTINGS_ENV,
    DeviceBudget,
    RuntimeHealth,
    RuntimeStats,
    budget_to_wire,
    health_to_wire,
    stats_to_wire,
)
from modelfleet.logformat import configure_logging
from modelfleet.messages import EncodedReply, Reply, decode_task, now_ms
from modelfleet.model.api import Output, Request
from modelfleet.model.pipeline import handle_request
from modelfleet.redaction import secure_logging
from modelfleet.repository import open_store
from modelfleet.runtime.host import ModelHost
from modelfleet.runtime.memory import MemoryGuard, configure_allocator
from modelfleet.runtime.payload import PayloadFetcher
from modelfleet.settings import Settings

log = logging.getLogger("modelfleet.runtime")
MAX_PRELOAD = 5000  # module names reported: a bound on the health answer
MAX_CANCELLED = 10_000  # hung-up request ids remembered (for a cancel that came first)


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


class RuntimeService:
    """The runtime's ops, typed: what both ``SocketServer`` and ``InProcessRuntime`` call."""

    def __init__(self, settings: Settings, own_process: bool = False) -> None:
        """``own_process``: this is a runtime process of its own, so its RSS is its models'
        (the memory guard is on); an in-process runtime shares the coordinator's."""
        store = open_store(settings.repo, settings.disk_cache_path,
                           settings.runtime.disk_cache_bytes)
        margin = settings.runtime.rss_margin
        floor = settings.runtime.rss_margin_floor_bytes
        guard = (None if not own_process else lambda cache, collect: MemoryGuard(
            lambda: cache.device_budget_bytes + cache.host_budget_bytes, margin,
            lambda: cache.device_budget_bytes, margin_floor_bytes=floor, collect=collect))
        flight = FlightRecord(os.environ.get(FLIGHT_ENV) if own_process else None)
        self.host = ModelHost(settings.runtime, store, memory=guard, flight=flight)
        self._fetcher = PayloadFetcher(settings.runtime)
        self.stopping = asyncio.Event()
        self._running: set[str] = set()  # request ids of the tasks here
        # Tasks in a step a hang-up stops (the fetch, preprocess and predict), by id.
        self._interruptible: dict[str, asyncio.Task[Any]] = {}
        self._cancelled: dict[str, None] = {}  # hung-up request ids, oldest first

    def cancel(self, request_id: str) -> bool:
        """The caller hung up: a fetch, a wait for its model's load (not the load) or a
        preprocess under way is stopped, a task not yet at predict never gets there, and
        one not arrived yet is dropped when it comes.
        (A predict already running on its thread cannot be stopped; its result is
        dropped.) True when the task was here."""
        self._cancelled[request_id] = None
        while len(self._cancelled) > MAX_CANCELLED:
            self._cancelled.pop(next(iter(self._cancelled)))
        running = self._interruptible.get(request_id)
        if running is not None:
            running.cancel()
        return request_id in self._running

    @contextlib.contextmanager
    def _stoppable(self, request_id: str) -> Iterator[None]:
        """A step that a hang-up interrupts; it does not start for a hung-up task."""
        if request_id in self._cancelled:
            raise ClientGone("the caller hung up; the task was dropped before its answer")
        current = asyncio.current_task()
        if current is not None:
            self._interruptible[request_id] = current
        try:
            yield
        finally:
            self._interruptible.pop(request_id, None)

    async def close(self) -> None:
        await self.host.close()
        await self._fetcher.close()

    def health(self) -> RuntimeHealth:
        return RuntimeHealth(os.getpid(), tuple(self.host.loading), self.host.load_ages_s(),
                             tuple(sorted(self.host.frameworks)[:MAX_PRELOAD]))

    def stats(self) -> RuntimeStats:
        return self.host.stats()

    async def set_budgets(self, device_budget_bytes: int, host_budget_bytes: int | None) -> None:
        await self.host.set_budgets(device_budget_bytes, host_budget_bytes)

    def budget(self) -> DeviceBudget:
        return self.host.device_budget()

    async def load(self, model_id: str, version: str, pinned: bool) -> None:
        await self.host.ensure(model_id, version, pinned)

    async def unload(self, model_id: str, version: str | None = None) -> bool:
        return await self.host.evict(model_id, version)

    def unpin(self, model_id: str, version: str) -> None:
        self.host.unpin(model_id, version)

    def shutdown(self) -> None:
        self.stopping.set()

    async def infer(self, task_bytes: bytes, delivery_count: int, accepts: Sequence[str],
                    worker_id: str, queue_wait_ms: float,
                    batching: Mapping[str, int | float] | None = None) -> EncodedReply:
        """Run one task end to end; always returns an encoded Reply (errors included).

        ``batching``: an operator's override of the model's ``[batching]`` (a load's
        config), which its batcher takes before this task joins it.

        The reply carries the worker's id and the task's queue wait, given with the task,
        so that it is encoded here once and crosses the coordinator as bytes.
        """
        task = decode_task(task_bytes, delivery_count)
        timings: dict[str, float] = {"queue_wait": queue_wait_ms}
        cold = False
        self._running.add(task.request_id)
        try:
            started = time.perf_counter()
            remaining_s = (task.deadline_ms - now_ms()) / 1000
            with self._stoppable(task.request_id):
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
            # The wait for the model is stopped by a hang-up; the load itself goes on (it
            # runs apart: other tasks may wait for it, and the next one finds it done).
            with self._stoppable(task.request_id):
                loaded, cold = await self.host.ensure(task.model_id, task.version)
            loaded.configure(batching or {})
            timings["model_load"] = (time.perf_counter() - started) * 1000
            request = Request(body, content_type, task.params, task.request_id, task.deadline_ms)
            remaining_s = (task.deadline_ms - now_ms()) / 1000
            if remaining_s <= 0:
                raise DeadlineExceeded("deadline passed before inference started")
            try:
                with self._stoppable(task.request_id), loaded.using():
                    async with asyncio.timeout(remaining_s):
                        result, phases = await handle_request(loaded.handler, loaded.batcher,
                                                              request, loaded.manifest)
            except TimeoutError as exc:
                raise DeadlineExceeded(f"inference did not finish within the deadline "
                                       f"({remaining_s:.2f}s left when it started)") from exc
            timings.update(phases)
            data, out_type = encode_result(result)
            # A v2 binary answer's JSON header length: a field of the reply of its own.
            header_length = result.header_length if isinstance(result, Output) else None
            reply = Reply(task.request_id, "ok", data, out_type, timings_ms=timings,
                          worker_id=worker_id, cold=cold, header_length=header_length)
        except ModelfleetError as exc:
            reply = Reply.failure(task.request_id, exc, worker_id, timings)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.request_id not in self._cancelled or current is None:
                raise  # shutting down
            current.uncancel()  # ours: its caller hung up
            log.info("task %s for %s: its caller hung up; dropped", task.request_id,
                     task.model_id)
            reply = Reply.failure(task.request_id, ClientGone(
                "the caller hung up; the task was dropped before its answer"), worker_id,
                timings)
        except Exception as exc:  # a bug here must still answer the caller
            log.exception("task %s for %s failed in the runtime", task.request_id, task.model_id)
            reply = Reply.failure(task.request_id, ModelFailed(f"runtime error: {exc!r}"),
                                  worker_id, timings)
        finally:
            self._running.discard(task.request_id)
        return EncodedReply.of(reply)


class SocketServer:
    """The runtime process's socket: frames in, ``RuntimeService`` ops, frames out."""

    def __init__(self, service: RuntimeService, name: str) -> None:
        self._service = service
        self._name = name
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def serve(self, socket_path: str) -> None:
        server = await asyncio.start_unix_server(self._connection, socket_path, limit=2**20)
        loop = asyncio.get_running_loop()
        # The coordinator stops us (the shutdown op, or closing our socket) in its own
        # order; a Ctrl-C meant for it must not stop us first. SIGTERM still does.
        loop.add_signal_handler(signal.SIGINT, lambda: None)
        loop.add_signal_handler(signal.SIGTERM, self._service.stopping.set)
        log.info("runtime %s listening on %s (pid %d)", self._name, socket_path, os.getpid())
        try:
            await self._service.stopping.wait()
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            for writer in list(self._writers):  # the coordinator sees us gone at once
                writer.close()
            await self._service.close()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        lock = asyncio.Lock()
        self._writers.add(writer)
        try:
            while True:
                frame = await read_frame(reader)
                task = asyncio.create_task(self._answer(frame, writer, lock))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            # The coordinator went away: nothing is left to answer for. Stop.
            self._service.stopping.set()
        except asyncio.CancelledError:
            return  # shutting down
        finally:
            self._writers.discard(writer)

    async def _answer(self, frame: Frame, writer: asyncio.StreamWriter,
                      lock: asyncio.Lock) -> None:
        request_id = frame.header.get("id", 0)
        op = frame.header.get("op", "")
        body = b""
        try:
            result, body = await self._dispatch(op, frame.header.get("args", {}), frame.body)
            header = {"id": request_id, "ok": True, "result": result}
        except ModelfleetError as exc:
            header = error_header(request_id, exc)
        except Exception as exc:  # a bug here must answer, not hang the caller
            log.exception("runtime op %s failed", op)
            header = error_header(request_id, ModelFailed(f"runtime error: {exc!r}"))
        async with lock:
            with contextlib.suppress(ConnectionError):
                writer.write(pack_frame(header, body))
                await writer.drain()

    async def _dispatch(self, op: str, args: dict[str, Any], body: bytes) -> tuple[Any, bytes]:
        service = self._service
        if op == "infer":
            reply = await service.infer(body, args["delivery_count"], args["accepts"],
                                        args["worker_id"], args["queue_wait_ms"],
                                        args.get("batching") or {})
            return {"request_id": reply.request_id, "status": reply.status}, reply.data
        if op == "health":
            return health_to_wire(service.health()), b""
        if op == "stats":
            return stats_to_wire(service.stats()), b""
        if op == "budget":
            return budget_to_wire(service.budget()), b""
        if op == "load":
            await service.load(args["model_id"], args["version"], args.get("pinned", False))
            return True, b""
        if op == "unload":
            return await service.unload(args["model_id"], args.get("version")), b""
        if op == "unpin":
            service.unpin(args["model_id"], args["version"])
            return True, b""
        if op == "set_budgets":
            await service.set_budgets(args["device_budget_bytes"], args.get("host_budget_bytes"))
            return True, b""
        if op == "shutdown":
            service.shutdown()
            return True, b""
        if op == "cancel":
            return service.cancel(args["request_id"]), b""
        raise ModelFailed(f"unknown runtime op {op!r}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="modelfleet-runtime")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--name", default="runtime")
    args = parser.parse_args(argv)
    nice = int(os.environ.get(NICE_ENV) or 0)
    if nice > 0:
        os.nice(nice)  # the quarantine runtime: before its imports take the cores
    settings = Settings.model_validate_json(os.environ[SETTINGS_ENV])
    configure_logging(settings.log_level, settings.log_format,
                      text_format=f"%(asctime)s %(levelname)s [{args.name}] %(message)s",
                      static={"runtime": args.name})
    secure_logging()  # payload URLs are signed: no URL is logged whole, at any level
    allocator = configure_allocator(settings.runtime.malloc_mmap_threshold_bytes)
    log.info("allocator: %s; malloc_trim after evictions: %s", allocator,
             "on" if settings.runtime.trim_after_eviction else "off")
    preload(os.environ.get(PRELOAD_ENV, ""))
    # What start-up made (modules, classes, numpy) lives as long as the process: out of
    # the cyclic collector's sight, a full collection walks only what came after (the
    # models). Unfrozen, each one took ~60 ms on the runtime's loop: a third of a
    # runtime's busy time in the 5,000-model bench went to the once-a-second collection
    # after evictions and to the memory guard's collection before a load.
    gc.freeze()
    asyncio.run(_serve(settings, args.name, args.socket))
    return 0


async def _serve(settings: Settings, name: str, socket_path: str) -> None:
    await SocketServer(RuntimeService(settings, own_process=True), name).serve(socket_path)


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
