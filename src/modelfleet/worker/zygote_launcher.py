"""Runtimes forked from a zygote: a restart costs a fork, not an interpreter start.

``ZygoteLauncher`` is a ``Launcher`` (``ipc.protocol``) that starts one zygote per worker
(``runtime/zygote.py``: an interpreter that has imported the runtime's code and what its
models import) and has it fork each runtime. A shared runtime's restart after a crash then
costs a fork plus its models' reloads from the local cache (measured in the README's
crash section), and the imported frameworks' pages are shared copy-on-write by every
runtime forked from it instead of being held once per interpreter.

A runtime is forked only when it would run the same interpreter with the same
environment as the zygote, less what the child sets itself (``ipc.zygote``
``PER_RUNTIME_ENV``): a BLAS sizes its thread pool when imported, in the zygote, so a
runtime told other thread-pool sizes, or an isolated model's own virtual environment, is
started as a process of its own (``ProcessLauncher``), as it is whenever the zygote is
down. A zygote that dies is restarted at once (its runtimes die with it:
``PR_SET_PDEATHSIG``, and each is restarted by its supervisor); one that fails to start
is tried again after ``RETRY_START_S``. The zygote is stopped after its runtimes
(``close``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from modelfleet.errors import RuntimeCrashed
from modelfleet.ipc.flight import FLIGHT_ENV
from modelfleet.ipc.protocol import PRELOAD_ENV, SETTINGS_ENV, Started
from modelfleet.ipc.socket_runtime import SocketRuntime
from modelfleet.ipc.zygote import PER_RUNTIME_ENV, decode, encode
from modelfleet.worker.process_launcher import (
    ProcessLauncher,
    StartedRuntime,
    connect_when_up,
)

log = logging.getLogger("modelfleet.worker")
RETRY_START_S = 60.0  # after a zygote failed to start, runtimes start as processes this long


class Zygote:
    """One running zygote, seen from the worker: requests out; answers and exits in."""

    def __init__(self, process: asyncio.subprocess.Process, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, on_lost: Callable[[Zygote, int | None], None]
                 ) -> None:
        self.process = process
        self._reader, self._writer = reader, writer
        self._on_lost = on_lost
        self._ids = itertools.count()
        self._answers: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._exits: dict[int, asyncio.Future[int]] = {}  # its children's, until they exit
        self._unclaimed: dict[int, asyncio.Future[int]] = {}  # until fork() returns them
        self._pidfds: dict[int, int] = {}  # to see a child gone once the zygote is
        self.lost = False
        self._reading = asyncio.create_task(self._read(), name="zygote-read")

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    async def start(cls, env: Mapping[str, str], modules: Sequence[str], timeout_s: float,
                    on_lost: Callable[[Zygote, int | None], None]) -> Zygote:
        """Start one and return once it has imported ``modules`` and said it is ready."""
        ours, theirs = socket.socketpair()
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "modelfleet.runtime.zygote", "--fd", str(theirs.fileno()),
                "--parent", str(os.getpid()), env={**env, PRELOAD_ENV: ",".join(modules)},
                pass_fds=(theirs.fileno(),),
                # Its own session, as the runtimes have: a Ctrl-C reaches the coordinator,
                # which stops the runtimes and then the zygote in order.
                start_new_session=True)
        finally:
            theirs.close()
        try:
            reader, writer = await asyncio.open_unix_connection(sock=ours)
            line = await asyncio.wait_for(reader.readline(), timeout_s)
            if not line:
                raise RuntimeCrashed(f"the zygote exited with {await process.wait()} "
                                     "during start-up")
            hello = decode(line)
        except BaseException:
            ours.close()
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            raise
        log.info("zygote %d ready with %d module(s) imported (%d thread(s))", process.pid,
                 len(modules), hello.get("threads", 0))
        return cls(process, reader, writer, on_lost)

    async def request(self, op: str, timeout_s: float, **args: Any) -> dict[str, Any]:
        """Ask it something; ``RuntimeCrashed`` if it refuses, is gone, or takes too long."""
        if self.lost:
            raise RuntimeCrashed("the zygote is gone")
        request_id = next(self._ids)
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._answers[request_id] = answer
        self._writer.write(encode({"id": request_id, "op": op, **args}))
        try:
            message = await asyncio.wait_for(answer, timeout_s)
        except TimeoutError as exc:
            raise RuntimeCrashed(f"the zygote did not answer {op} within {timeout_s}s") \
                from exc
        except asyncio.CancelledError:
            if answer.done() and not answer.cancelled() and answer.exception() is None \
                    and "pid" in answer.result():  # forked for a launch dropped meanwhile
                self.send_signal(int(answer.result()["pid"]), signal.SIGKILL)
            raise
        finally:
            self._answers.pop(request_id, None)
        if "error" in message:
            raise RuntimeCrashed(f"the zygote refused {op}: {message['error']}")
        return message

    async def fork(self, env: Mapping[str, str], argv: Sequence[str], timeout_s: float
                   ) -> tuple[int, asyncio.Future[int]]:
        """A runtime forked with exactly ``env``; its pid, and its exit code to come."""
        answer = await self.request("fork", timeout_s, env=dict(env), argv=list(argv))
        pid = int(answer["pid"])
        return pid, self._unclaimed.pop(pid)

    def send_signal(self, pid: int, number: int) -> None:
        """Signal a child through the zygote, which signals only children it has not reaped
        (so never a process that reused the pid of one that exited)."""
        if not self.lost:
            self._writer.write(encode({"id": -1, "op": "signal", "pid": pid,
                                       "signal": int(number)}))

    async def _read(self) -> None:
        try:
            while line := await self._reader.readline():
                message = decode(line)
                event = message.get("event")
                if event == "exit":
                    self._exited(int(message["pid"]), int(message["code"]))
                    continue
                if "pid" in message and "id" in message:  # a fork: its exit is awaited now
                    pid = int(message["pid"])
                    exited = asyncio.get_running_loop().create_future()
                    self._exits[pid] = self._unclaimed[pid] = exited
                    with contextlib.suppress(OSError):  # ESRCH: gone already, its exit follows
                        self._pidfds[pid] = os.pidfd_open(pid)
                answer = self._answers.get(message.get("id", -1))
                if answer is not None and not answer.done():
                    answer.set_result(message)
                elif "pid" in message:  # forked for a launch dropped meanwhile: nobody's
                    self._unclaimed.pop(int(message["pid"]), None)
                    self.send_signal(int(message["pid"]), signal.SIGKILL)
        except (OSError, ValueError) as exc:
            log.error("zygote %d: its control channel broke: %r", self.pid, exc)
        finally:
            await self._lose()

    def _exited(self, pid: int, code: int) -> None:
        exited = self._exits.pop(pid, None)
        if exited is not None and not exited.done():
            exited.set_result(code)
        pidfd = self._pidfds.pop(pid, None)
        if pidfd is not None:
            os.close(pidfd)

    async def _lose(self) -> None:
        """It is gone: so are its children (``PR_SET_PDEATHSIG``); say so once they are."""
        self.lost = True
        self._writer.close()
        for answer in self._answers.values():
            if not answer.done():
                answer.set_exception(RuntimeCrashed("the zygote exited"))
        for pid in list(self._exits):
            pidfd = self._pidfds.get(pid)
            if pidfd is not None:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                await _readable(pidfd)  # a pidfd is readable once its process has exited
            self._exited(pid, -signal.SIGKILL)
        try:
            code: int | None = await asyncio.wait_for(self.process.wait(), 5.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            code = await self.process.wait()
        self._on_lost(self, code)

    async def close(self) -> None:
        """Stop it (it kills what it forked first) and wait until it and they are gone."""
        if not self.lost:
            self._writer.close()  # end of file: the zygote kills its children and exits
        await asyncio.wait({self._reading})


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


class ZygoteStarted(StartedRuntime):
    """A runtime the zygote forked: not the worker's child, so its exit comes from the
    zygote and signals go through it."""

    def __init__(self, zygote: Zygote, pid: int, exited: asyncio.Future[int],
                 runtime: SocketRuntime, socket_path: str, flight_path: str) -> None:
        super().__init__(runtime, socket_path, flight_path)
        self._zygote = zygote
        self._pid = pid
        self._exited = exited

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def exit_code(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait_exit(self) -> int | None:
        return await asyncio.shield(self._exited)

    def terminate(self) -> None:
        self._zygote.send_signal(self._pid, signal.SIGTERM)

    async def _end_process(self) -> None:
        if not self._exited.done():
            self._zygote.send_signal(self._pid, signal.SIGKILL)
            await asyncio.shield(self._exited)


def _read_modules(path: Path | None) -> list[str]:
    if path is None:
        return []
    try:
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


class ZygoteLauncher:
    """Forks runtimes from a zygote where it can; starts them as processes otherwise."""

    def __init__(self, plain: ProcessLauncher, known_modules: Path | None = None) -> None:
        """``known_modules``: a file that keeps what the runtimes' models imported across
        worker restarts, so that a zygote imports it before its first fork and the first
        runtimes share those pages too (learned afresh, they import them themselves)."""
        self._plain = plain
        self._known_modules = known_modules
        self._zygote: Zygote | None = None
        self._starting: asyncio.Task[Zygote] | None = None
        # The zygote's environment: the first launch's it could fork, less PER_RUNTIME_ENV
        # (and that launch's settings, for the zygote's own log format).
        self._env: dict[str, str] | None = None
        self._start_env: dict[str, str] = {}
        # What the runtimes' models imported, in order (a dict: a look-up per module).
        self._modules = dict.fromkeys(_read_modules(known_modules))
        self._failed_at = -RETRY_START_S
        self._closed = False
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def zygote_pid(self) -> int | None:
        """The running zygote's pid (None: none is up)."""
        zygote = self._zygote
        return None if zygote is None or zygote.lost else zygote.pid

    def preload(self, modules: Sequence[str]) -> None:
        new = [m for m in modules if m not in self._modules]
        if not new:
            return
        self._modules.update(dict.fromkeys(new))
        if self._known_modules is not None:
            try:
                self._known_modules.parent.mkdir(parents=True, exist_ok=True)
                self._known_modules.write_text("".join(f"{m}\n" for m in self._modules))
            except OSError as exc:
                log.warning("could not keep the zygote's modules in %s: %r",
                            self._known_modules, exc)
        zygote = self._zygote
        if zygote is not None and not zygote.lost:
            self._background(self._preload(zygote, new))

    async def _preload(self, zygote: Zygote, modules: list[str]) -> None:
        started = time.perf_counter()
        try:
            # Imports can take seconds on a busy machine: bounded by a runtime's start.
            answer = await zygote.request("preload", self._plain.start_timeout_s,
                                          modules=modules)
        except RuntimeCrashed as exc:
            log.warning("zygote %d did not preload %s: %s", zygote.pid, ",".join(modules), exc)
            return
        log.info("zygote %d imported %d module(s) in %.2fs (%d thread(s))", zygote.pid,
                 len(modules), time.perf_counter() - started, answer.get("threads", 0))

    async def launch(self, name: str, python: str, env: Mapping[str, str],
                     standby: bool = False) -> Started:
        zygote = await self._zygote_for(python, env)
        if zygote is None:
            return await self._plain.launch(name, python, env, standby)
        socket_path, flight_path = self._plain.paths(name, standby)
        try:
            pid, exited = await zygote.fork({**env, FLIGHT_ENV: flight_path},
                                            ["--socket", socket_path, "--name", name],
                                            self._plain.start_timeout_s)
        except RuntimeCrashed as exc:
            log.warning("runtime %s: %s; starting it as a process of its own", name, exc)
            return await self._plain.launch(name, python, env, standby)
        try:
            runtime = await connect_when_up(
                name, socket_path, flight_path,
                lambda: exited.result() if exited.done() else None,
                self._plain.start_timeout_s, self._plain.ping_timeout_s)
        except BaseException:
            if not exited.done():  # e.g. a standby dropped while it started
                zygote.send_signal(pid, signal.SIGKILL)
                await asyncio.shield(exited)
            for path in (socket_path, flight_path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise
        return ZygoteStarted(zygote, pid, exited, runtime, socket_path, flight_path)

    async def _zygote_for(self, python: str, env: Mapping[str, str]) -> Zygote | None:
        """The zygote to fork this runtime from, started if need be; None: start a process."""
        if self._closed or python != sys.executable:  # an isolated model's own environment
            return None
        base = {k: v for k, v in env.items() if k not in PER_RUNTIME_ENV}
        if self._env is None:
            self._env = base
            self._start_env = {**base, SETTINGS_ENV: env.get(SETTINGS_ENV, "")}
        elif base != self._env:  # e.g. other thread-pool sizes than the zygote imported with
            return None
        if self._zygote is not None and not self._zygote.lost:
            return self._zygote
        if self._starting is None:
            if time.monotonic() - self._failed_at < RETRY_START_S:
                return None
            self._starting = asyncio.create_task(self._start(), name="zygote-start")
        try:
            return await asyncio.shield(self._starting)
        except RuntimeCrashed:
            return None

    async def _start(self) -> Zygote:
        try:
            self._zygote = await Zygote.start(self._start_env, list(self._modules),
                                              self._plain.start_timeout_s, self._lost)
            return self._zygote
        except (OSError, ValueError, TimeoutError, RuntimeCrashed) as exc:
            self._failed_at = time.monotonic()
            log.warning("the zygote did not start (%r); runtimes start as processes of their "
                        "own for %.0fs", exc, RETRY_START_S)
            raise RuntimeCrashed(f"the zygote did not start: {exc!r}") from exc
        finally:
            self._starting = None

    def _lost(self, zygote: Zygote, code: int | None) -> None:
        if self._closed or zygote is not self._zygote:
            return
        self._zygote = None
        log.warning("zygote %d exited with %s; its runtimes are restarted, and it is too",
                    zygote.pid, code)
        if self._starting is None:
            self._starting = asyncio.create_task(self._start(), name="zygote-start")
            self._background_wait(self._starting)

    def _background(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self._background_wait(task)

    def _background_wait(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: what failed was logged where it failed

    async def close(self) -> None:
        """Stop the zygote: after the runtimes (each stopped by its supervisor)."""
        self._closed = True
        for task in [*self._tasks, *([self._starting] if self._starting else [])]:
            task.cancel()
        await asyncio.gather(*self._tasks, *([self._starting] if self._starting else []),
                             return_exceptions=True)
        zygote, self._zygote = self._zygote, None
        if zygote is not None:
            await zygote.close()
