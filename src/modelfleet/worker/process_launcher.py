"""Runtime processes: ``python -m modelfleet.runtime`` on a Unix socket, via ``SocketRuntime``."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from modelfleet.errors import RuntimeCrashed
from modelfleet.ipc.flight import FLIGHT_ENV
from modelfleet.ipc.socket_runtime import SocketRuntime


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it if the coordinator dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class StartedRuntime:
    """What every started runtime process has, however it was started: its connection
    and files, and a kill that closes the one and removes the others once it is gone."""

    def __init__(self, runtime: SocketRuntime, socket_path: str, flight_path: str) -> None:
        self._runtime = runtime
        self._socket_path = socket_path
        self._flight_path = flight_path

    @property
    def runtime(self) -> SocketRuntime:
        return self._runtime

    async def _end_process(self) -> None:
        """SIGKILL the process unless it has exited, and wait until it has."""
        raise NotImplementedError

    async def kill(self) -> None:
        await self._runtime.close()
        await self._end_process()
        self._runtime.crash_record()  # read (and kept) before its file goes
        for path in (self._socket_path, self._flight_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class ProcessStarted(StartedRuntime):
    def __init__(self, process: asyncio.subprocess.Process, runtime: SocketRuntime,
                 socket_path: str, flight_path: str) -> None:
        super().__init__(runtime, socket_path, flight_path)
        self._process = process

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def exit_code(self) -> int | None:
        return self._process.returncode

    async def wait_exit(self) -> int | None:
        return await self._process.wait()

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._process.terminate()

    async def _end_process(self) -> None:
        if self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            await self._process.wait()


async def connect_when_up(name: str, socket_path: str, flight_path: str,
                          exit_code: Callable[[], int | None], start_timeout_s: float,
                          ping_timeout_s: float) -> SocketRuntime:
    """Connect to a starting runtime once it answers ``health``; ``RuntimeCrashed`` if it
    exits first (``exit_code`` is not None) or does not answer within ``start_timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + start_timeout_s
    delay = 0.01
    while True:  # the socket appears once the child has imported and bound it
        code = exit_code()
        if code is not None:
            raise RuntimeCrashed(f"runtime {name} exited with {code} during start-up")
        try:
            runtime = await SocketRuntime.connect(socket_path, name, flight_path)
        except OSError:
            runtime = None
        if runtime is not None:
            try:
                await runtime.health(timeout_s=ping_timeout_s)
                return runtime
            except (OSError, RuntimeCrashed):
                await runtime.close()
        if loop.time() > deadline:
            raise RuntimeCrashed(f"runtime {name} did not start within {start_timeout_s}s")
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, 0.05)


class ProcessLauncher:
    def __init__(self, socket_dir: Path, start_timeout_s: float, ping_timeout_s: float) -> None:
        self._socket_dir = socket_dir
        self._start_timeout_s = start_timeout_s
        self._ping_timeout_s = ping_timeout_s
        self._serial = itertools.count()

    def paths(self, name: str, standby: bool) -> tuple[str, str]:
        """A new runtime's socket, and its flight record beside it (``ipc/flight.py``)."""
        role = ".standby" if standby else ""
        socket_path = str(self._socket_dir / f"{name}.{next(self._serial)}{role}.sock")
        return socket_path, f"{socket_path}.flight"

    @property
    def start_timeout_s(self) -> float:
        return self._start_timeout_s

    @property
    def ping_timeout_s(self) -> float:
        return self._ping_timeout_s

    def preload(self, modules: Sequence[str]) -> None:
        """Nothing to import ahead: each runtime is an interpreter of its own."""

    async def launch(self, name: str, python: str, env: Mapping[str, str],
                     standby: bool = False) -> ProcessStarted:
        """Start a runtime process and connect to it once it answers ``health``."""
        socket_path, flight_path = self.paths(name, standby)
        process = await asyncio.create_subprocess_exec(
            python, "-m", "modelfleet.runtime", "--socket", socket_path,
            "--name", name, env={**env, FLIGHT_ENV: flight_path}, preexec_fn=_die_with_parent,
            # Its own session: a Ctrl-C or a group-wide SIGTERM reaches the coordinator,
            # which stops runtimes in order; PR_SET_PDEATHSIG still ties them to it.
            start_new_session=True,
        )
        try:
            runtime = await connect_when_up(name, socket_path, flight_path,
                                            lambda: process.returncode,
                                            self._start_timeout_s, self._ping_timeout_s)
            return ProcessStarted(process, runtime, socket_path, flight_path)
        except BaseException:
            if process.returncode is None:  # e.g. a standby dropped while it started
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(flight_path)
            raise
