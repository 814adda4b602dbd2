"""A runtime's flight record: which models' code ran on its threads when it died.

A poison pill kills its runtime in native code (a segfault, ``os._exit``, an
out-of-memory kill), and every task in flight there loses its connection at once: the
coordinator cannot tell the task that killed it from its bystanders. The runtime
therefore writes, before and after each model's ``predict`` and ``load`` (the thread
work, where native code runs), the models doing so now into a small file beside its
socket. The write is one ``pwrite`` of a few bytes into the page cache, so it survives
the process however it dies; the coordinator reads it once the connection is lost
(``read_flight_record``).

What it is used for (``worker/tasks.py``): tasks of a model the record names are the
suspects; the others were not running model code that could crash it (they waited,
fetched or were between steps), so they go back to their queue unsuspected and run
again on the restarted runtime at once, instead of queueing behind the pills on the
quarantine runtime. A record that cannot be read, or names nothing (a crash on the event
loop, in ``preprocess``), leaves every task a suspect, as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

FLIGHT_ENV = "MODELFLEET_RUNTIME_FLIGHT"  # the record's path, set by the launcher
RECORD_BYTES = 4096  # the record is written whole at offset 0, padded to this
T = TypeVar("T")


class FlightRecord:
    """The models whose ``predict`` or ``load`` runs now, kept in a file (or nowhere)."""

    def __init__(self, path: str | None) -> None:
        self._running: Counter[str] = Counter()
        self._lock = threading.Lock()  # predicts and loads run on threads
        self._fd: int | None = None
        if path:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            self._write()

    @contextlib.contextmanager
    def running(self, model_id: str) -> Iterator[None]:
        """Held around model code on a thread: the record names ``model_id`` meanwhile."""
        if self._fd is None:
            yield
            return
        with self._lock:
            self._running[model_id] += 1
            self._write()
        try:
            yield
        finally:
            with self._lock:
                self._running[model_id] -= 1
                if not self._running[model_id]:
                    del self._running[model_id]
                self._write()

    def wrap(self, model_id: str, call: Callable[[Any], T]) -> Callable[[Any], T]:
        """``call`` (a handler's ``predict``), recorded while it runs."""
        if self._fd is None:
            return call

        def recorded(batch: Any) -> T:
            with self.running(model_id):
                return call(batch)
        return recorded

    def _write(self) -> None:
        assert self._fd is not None
        names = sorted(self._running)
        data = json.dumps(names).encode()
        while len(data) > RECORD_BYTES - 1 and names:  # too many at once: say "unknown"
            names, data = [], b"null"
        os.pwrite(self._fd, data.ljust(RECORD_BYTES - 1) + b"\n", 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_flight_record(path: str) -> frozenset[str] | None:
    """The models a dead runtime's record names (empty: none ran model code on a thread);
    None when there is no readable record."""
    try:
        with open(path, "rb") as f:
            names = json.loads(f.read(RECORD_BYTES))
    except (OSError, ValueError):
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    return frozenset(names)
