"""A runtime's flight record: which models' code ran on its threads when it died.

A poison pill kills its runtime in native code (a segfault, ``os._exit``, an
out-of-memory kill), and every task in flight there loses its connection at once: the
coordinator cannot tell the task that killed it from its bystanders. The runtime
therefore writes, before and after each model's ``predict`` and ``load`` (the thread
work, where native code runs), the models doing so now, and the requests in those
predicts, into a small file beside its socket. The write is one ``pwrite`` of a few
bytes into the page cache, so it survives the process however it dies; the coordinator
reads it once the connection is lost (``read_flight_record``).

What it is used for (``worker/tasks.py``): the tasks in a predict that ran, and every
task of a model that was loading, are the suspects; the others were not running model
code that could crash it (they waited, fetched or were between steps), so they go back
to their queue unsuspected and run again at once, instead of queueing behind the pills
on the quarantine runtime. A record that cannot be read, or names nothing (a crash on
the event loop, in ``preprocess``), leaves every task a suspect, as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

FLIGHT_ENV = "MODELFLEET_RUNTIME_FLIGHT"  # the record's path, set by the launcher
RECORD_BYTES = 8192  # the record is written whole at offset 0, padded to this


@dataclass(frozen=True)
class Flight:
    """What a dead runtime's record says ran on its threads when it died."""

    models: frozenset[str]  # models whose predict or load ran
    requests: frozenset[str]  # the request ids in the predicts that ran
    loading: frozenset[str]  # models whose load ran (all of their tasks are suspects)

    def suspects(self, model_id: str, request_id: str) -> bool:
        """Could this task's own input have killed it? (in a predict, or its model loading)"""
        return request_id in self.requests or model_id in self.loading


class FlightRecord:
    """The models (and requests) whose ``predict`` or ``load`` runs now, kept in a file."""

    def __init__(self, path: str | None) -> None:
        self._running: Counter[tuple[str, str]] = Counter()  # (model, request id or "")
        self._lock = threading.Lock()  # predicts and loads run on threads
        self._fd: int | None = None
        if path:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            self._write()

    @property
    def keeping(self) -> bool:
        return self._fd is not None

    @contextlib.contextmanager
    def running(self, model_id: str, request_ids: Sequence[str] = ()) -> Iterator[None]:
        """Held around model code on a thread: a predict of ``request_ids``, or a load (no
        request ids). The record names them meanwhile."""
        if self._fd is None:
            yield
            return
        keys = [(model_id, r) for r in request_ids] or [(model_id, "")]
        with self._lock:
            self._running.update(keys)
            self._write()
        try:
            yield
        finally:
            with self._lock:
                self._running.subtract(keys)
                self._running += Counter()  # drop the zeros
                self._write()

    def _write(self) -> None:
        assert self._fd is not None
        data = json.dumps(sorted(self._running)).encode()
        if len(data) > RECORD_BYTES - 1:  # too much at once: "unknown", every task a suspect
            data = b"null"
        os.pwrite(self._fd, data.ljust(RECORD_BYTES - 1) + b"\n", 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_flight_record(path: str) -> Flight | None:
    """What a dead runtime's record names (nothing: no model code ran on a thread); None
    when there is no readable record."""
    try:
        with open(path, "rb") as f:
            entries = json.loads(f.read(RECORD_BYTES))
    except (OSError, ValueError):
        return None
    if not isinstance(entries, list) or not all(
            isinstance(e, list) and len(e) == 2 and all(isinstance(x, str) for x in e)
            for e in entries):
        return None
    return Flight(frozenset(m for m, _ in entries), frozenset(r for _, r in entries if r),
                  frozenset(m for m, r in entries if not r))
