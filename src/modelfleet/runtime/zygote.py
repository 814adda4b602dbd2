"""The zygote: one process per worker that imports once and forks runtimes on request.

Started by the worker (``worker/zygote_launcher.py``) as ``python -m
modelfleet.runtime.zygote --fd N`` with the environment its shared runtimes share (the
compute-thread sizes above all: a BLAS sizes its pool when it is imported, here). It
imports the runtime's code, then whatever its runtimes' models imported (``preload``),
and answers the worker's requests on the socket ``N`` (``ipc/zygote.py``). A forked
runtime starts with those pages shared copy-on-write, so a restart after a crash costs a
fork plus its models' reloads, and the frameworks' memory is held once, not per runtime.

Single-threaded on purpose: a fork copies only the thread that calls it, so a lock held by
any other thread would stay held in the child forever. The zygote never runs a predict;
imports that leave a Python thread behind make it refuse to fork (the worker then starts
that runtime as a process of its own). Native thread pools started at import are
fork-aware (OpenBLAS shuts its pool down before a fork and starts it again on first use;
an OpenMP pool is only started by a parallel region, which never runs here).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import logging
import os
import select
import signal
import socket
import sys
import threading
import traceback
from collections import deque
from typing import Any

from modelfleet.ipc.protocol import PRELOAD_ENV, SETTINGS_ENV
from modelfleet.ipc.zygote import decode, encode

log = logging.getLogger("modelfleet.zygote")
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux); exit at once if it already has."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os._exit(1)


ZYGOTE_COMM = "mf-zygote"


def set_comm(name: str) -> None:
    """Name this process (``ps -o comm``, ``top``, ``psutil.Process.name()``; 15 bytes):
    a forked runtime's command line is its zygote's, so its name says which it is."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def native_threads() -> int:
    """Threads of this process, Python's and native ones (a BLAS pool)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


class Zygote:
    def __init__(self, control: socket.socket) -> None:
        self._control = control
        self._children: set[int] = set()
        self._buffer = b""
        # Preloads asked for and not done yet: (request id, modules left), oldest first.
        # One module is imported per turn of the loop, so that a fork asked for meanwhile
        # (a runtime's restart after a crash) and its children's exits are answered
        # between two imports, not after all of them (a first preload takes seconds).
        self._imports: deque[tuple[Any, deque[str]]] = deque()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        signal.set_wakeup_fd(self._wake_write)
        # A handler (not SIG_DFL) so that SIGCHLD writes to the wake-up pipe.
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: self._stop())

    def _send(self, message: dict[str, Any]) -> None:
        self._control.sendall(encode(message))

    def serve(self) -> None:
        self._send({"event": "ready", "pid": os.getpid(), "threads": native_threads()})
        while True:
            readable, _, _ = select.select([self._control.fileno(), self._wake_read], [], [],
                                           0 if self._imports else None)
            if self._wake_read in readable:
                os.read(self._wake_read, 4096)
                self._reap()
            if self._control.fileno() in readable:
                data = self._control.recv(1 << 20)
                if not data:  # the worker closed its end, or died
                    self._stop()
                self._buffer += data
                *lines, self._buffer = self._buffer.split(b"\n")
                for line in lines:
                    if line:
                        self._answer(decode(line))
            if not readable and self._imports:
                self._import_next()

    def _import_next(self) -> None:
        """Import the oldest preload's next module; answer that preload once it is done."""
        request_id, modules = self._imports[0]
        if modules:
            preload([modules.popleft()], freeze=False)
        if not modules:
            self._imports.popleft()
            # Out of the cyclic collector's sight: a collection in a runtime then does not
            # touch (and so copy) the zygote's pages.
            gc.freeze()
            self._send({"id": request_id, "threads": native_threads()})

    def _answer(self, request: dict[str, Any]) -> None:
        op = request.get("op")
        try:
            if op == "fork":
                self._send({"id": request["id"], "pid": self._fork(request["env"],
                                                                   request["argv"])})
            elif op == "preload":  # answered once imported, between other requests
                self._imports.append((request["id"], deque(request["modules"])))
            elif op == "signal":
                pid = int(request["pid"])
                if pid in self._children:  # not reaped yet: the pid is still that child's
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, int(request["signal"]))
                self._send({"id": request["id"]})
            else:
                raise ValueError(f"unknown zygote op {op!r}")
        except Exception as exc:
            self._send({"id": request.get("id"), "error": repr(exc)})

    def _fork(self, env: dict[str, str], argv: list[str]) -> int:
        if threading.active_count() > 1:
            raise RuntimeError(
                f"the zygote has {threading.active_count()} Python threads after its "
                "imports; a fork would copy their locks held")
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid:
            self._children.add(pid)
            return pid
        code = 1
        try:  # the child: undo what is the zygote's, then become the runtime
            os.setsid()  # its own session, as a runtime started as a process has
            die_with_parent(parent)
            if "--name" in argv:
                set_comm(argv[argv.index("--name") + 1])
            signal.set_wakeup_fd(-1)
            for number in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(number, signal.SIG_DFL)
            os.close(self._wake_read)
            os.close(self._wake_write)
            self._control.close()
            os.environ.clear()
            os.environ.update(env)
            _reseed()
            from modelfleet.runtime.server import main
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            logging.shutdown()
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def _reap(self) -> None:
        while self._children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._children.discard(pid)
            self._send({"event": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)})

    def _stop(self) -> None:
        """Kill what it forked (the worker stops them first), then exit."""
        for pid in self._children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os._exit(0)


def _reseed() -> None:
    """A fork copies random states: ``random`` reseeds itself at a fork, numpy's does not."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        with contextlib.suppress(Exception):
            numpy_random.seed()


def preload(modules: list[str], freeze: bool = True) -> None:
    """Import the named modules (best effort: a failure is only logged)."""
    for name in modules:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:
            log.info("zygote: preloading %s failed: %r", name, exc)
    if freeze:  # out of the collector's sight: a runtime's collection copies no page of it
        gc.freeze()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="modelfleet-zygote")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    die_with_parent(args.parent)
    set_comm(ZYGOTE_COMM)
    settings = os.environ.get(SETTINGS_ENV)  # the first runtime's: for the log's format
    if settings:
        from modelfleet.logformat import configure_logging
        from modelfleet.settings import Settings
        parsed = Settings.model_validate_json(settings)
        configure_logging(parsed.log_level, parsed.log_format,
                          text_format="%(asctime)s %(levelname)s [zygote] %(message)s",
                          static={"runtime": "zygote"})
    else:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s [zygote] %(message)s")
    control = socket.socket(fileno=args.fd)
    import modelfleet.runtime.server  # noqa: F401  what every runtime runs: imported once
    preload([m for m in os.environ.get(PRELOAD_ENV, "").split(",") if m])
    Zygote(control).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
