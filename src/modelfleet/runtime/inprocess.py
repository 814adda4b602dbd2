"""``InProcessRuntime``: the runtime's own server code, called in this process.

The same ``RuntimeService`` the runtime process serves on its socket, without the
process and the socket: a coordinator can be run and tested in one process with the
embedded broker. What a process boundary gives is kept where it shows: a runtime
that is killed fails every call in flight and every later one with
``RuntimeCrashed``, as a dead process's socket does, and the supervisor sees it end
and starts another. What it cannot give is isolation: a handler that crashes the
interpreter takes the caller with it, and no memory limit applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Mapping, Sequence
from typing import TypeVar

from modelfleet.errors import RuntimeCrashed
from modelfleet.ipc.flight import Flight
from modelfleet.ipc.protocol import (
    SETTINGS_ENV,
    DeviceBudget,
    InferCall,
    RuntimeHealth,
    RuntimeStats,
)
from modelfleet.messages import EncodedReply
from modelfleet.runtime.server import RuntimeService
from modelfleet.settings import Settings

_T = TypeVar("_T")
KILLED = -9


class InProcessRuntime:
    def __init__(self, service: RuntimeService, name: str) -> None:
        self._service = service
        self._name = name
        self._closed: str | None = None
        self._calls: set[asyncio.Task[object]] = set()

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def crash_record(self) -> Flight | None:
        """None: an in-process runtime keeps no flight record (it does not crash alone)."""
        return None

    async def infer(self, call: InferCall, timeout_s: float | None = None) -> EncodedReply:
        return await self._call(self._service.infer(
            call.task, call.delivery_count, call.accepts, call.worker_id, call.queue_wait_ms,
            call.batching),
            timeout_s)

    async def load(self, model_id: str, version: str, pinned: bool = False,
                   timeout_s: float | None = None) -> None:
        await self._call(self._service.load(model_id, version, pinned), timeout_s)

    async def unload(self, model_id: str, timeout_s: float | None = None,
                     version: str | None = None) -> bool:
        return await self._call(self._service.unload(model_id, version), timeout_s)

    async def unpin(self, model_id: str, version: str, timeout_s: float | None = None) -> None:
        self._check()
        self._service.unpin(model_id, version)

    async def stats(self, timeout_s: float | None = None) -> RuntimeStats:
        self._check()
        return self._service.stats()

    async def set_budgets(self, device_budget_bytes: int, host_budget_bytes: int | None = None,
                          timeout_s: float | None = None) -> None:
        await self._call(self._service.set_budgets(device_budget_bytes, host_budget_bytes),
                         timeout_s)

    async def budget(self, timeout_s: float | None = None) -> DeviceBudget:
        self._check()
        return self._service.budget()

    async def health(self, timeout_s: float | None = None) -> RuntimeHealth:
        self._check()
        return self._service.health()

    async def cancel(self, request_id: str, timeout_s: float | None = None) -> bool:
        self._check()
        return self._service.cancel(request_id)

    async def shutdown(self, timeout_s: float | None = None) -> None:
        self._check()
        self._service.shutdown()

    async def close(self) -> None:
        self._fail_all("closed by coordinator")

    def _fail_all(self, why: str) -> None:
        if self._closed is None:
            self._closed = why
        for call in list(self._calls):
            call.cancel(why)

    def _check(self) -> None:
        if self._closed is not None:
            raise RuntimeCrashed(f"runtime {self._name} is gone: {self._closed}")

    async def _call(self, operation: Awaitable[_T], timeout_s: float | None) -> _T:
        if self._closed is not None:
            if asyncio.iscoroutine(operation):
                operation.close()
            self._check()
        call: asyncio.Task[_T] = asyncio.ensure_future(operation)
        self._calls.add(call)
        try:
            return await asyncio.wait_for(asyncio.shield(call), timeout_s)
        except asyncio.CancelledError:
            if call.cancelled() and self._closed is not None:
                raise RuntimeCrashed(f"runtime {self._name} is gone: {self._closed}") from None
            raise
        finally:
            self._calls.discard(call)


class InProcessStarted:
    """An in-process runtime as a ``Launcher`` hands it over: it "exits" when shut down
    (the ``shutdown`` op, ``terminate``) or killed."""

    def __init__(self, service: RuntimeService, name: str) -> None:
        self._service = service
        self._name = name
        self._runtime = InProcessRuntime(service, name)
        self._exit_code: int | None = None
        self._exited = asyncio.Event()
        self._watch = asyncio.create_task(self._until_stopped(), name=f"inprocess-{name}")
        # A killed runtime's models are released in the background, as a killed
        # process's memory is: predicts still running on threads cannot be stopped.
        self.released: asyncio.Task[None] | None = None

    @property
    def runtime(self) -> InProcessRuntime:
        return self._runtime

    @property
    def pid(self) -> int:
        return os.getpid()

    @property
    def exit_code(self) -> int | None:
        return self._exit_code

    async def wait_exit(self) -> int | None:
        await self._exited.wait()
        return self._exit_code

    def terminate(self) -> None:
        self._service.shutdown()

    async def kill(self) -> None:
        """Like SIGKILL: it is gone at once; calls in flight fail with ``RuntimeCrashed``."""
        if self._exit_code is None:
            self._exit_code = KILLED
        self._watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watch
        self._end()

    async def _until_stopped(self) -> None:
        await self._service.stopping.wait()
        if self._exit_code is None:
            self._exit_code = 0
        self._end()

    def _end(self) -> None:
        if self._exited.is_set():
            return
        self._runtime._fail_all(f"exited with {self._exit_code}")
        self.released = asyncio.create_task(self._service.close(),
                                            name=f"inprocess-release-{self._name}")
        self._exited.set()


class InProcessLauncher:
    """Starts ``InProcessRuntime``s from the settings a runtime process would be given."""

    def __init__(self) -> None:
        self.started: list[InProcessStarted] = []

    async def close(self) -> None:
        """Wait until every runtime it started has released its models."""
        for started in self.started:
            if started.exit_code is None:
                await started.kill()
        await asyncio.gather(*(s.released for s in self.started if s.released is not None),
                             return_exceptions=True)

    def preload(self, modules: Sequence[str]) -> None:
        """Nothing to import ahead: its runtimes run in this process."""

    async def launch(self, name: str, python: str, env: Mapping[str, str],
                     standby: bool = False) -> InProcessStarted:
        settings = Settings.model_validate_json(env[SETTINGS_ENV])
        started = InProcessStarted(RuntimeService(settings), name)
        self.started.append(started)
        return started
