"""The zygote's control channel: what the worker and its fork server say to each other.

A zygote (``runtime/zygote.py``) is a process that has imported the runtime's code and
its models' frameworks once, and forks a runtime on request, so that a runtime's restart
costs a fork instead of an interpreter start and those imports. The worker starts it with
one end of a socket pair (``--fd``) and speaks JSON lines over it:

- worker to zygote: ``{"id": n, "op": "fork", "env": {...}, "argv": [...]}`` (a runtime
  with exactly that environment, running ``modelfleet.runtime`` with those arguments),
  ``{"id": n, "op": "preload", "modules": [...]}`` (import them ahead of the next fork,
  one module at a time between the other requests; answered once all are imported),
  ``{"id": n, "op": "signal", "pid": p, "signal": s}`` (to one of its children
  that it has not reaped yet, so that a pid reused after an exit is never hit);
- zygote to worker: ``{"id": n, "pid": p}`` or ``{"id": n, "error": "..."}`` answering a
  request, ``{"event": "ready", "pid": p, "threads": t}`` once at start, and
  ``{"event": "exit", "pid": p, "code": c}`` when a child it forked has exited (``code``
  as ``subprocess`` gives it: the exit status, or minus the signal that ended it).

Closing the worker's end stops the zygote, which kills what it forked first.
"""

from __future__ import annotations

import json
from typing import Any

from modelfleet.ipc.flight import FLIGHT_ENV
from modelfleet.ipc.protocol import MEMORY_LIMIT_ENV, NICE_ENV, PRELOAD_ENV, SETTINGS_ENV

# What a forked runtime may be told differently from its zygote: each is read by the
# runtime after the fork (``runtime/server.py``: settings, flight record, nice, preload,
# memory limit). Anything else (thread-pool sizes, which a BLAS reads at its import; the
# device a GPU worker's runtime is pinned to, which /proc/PID/environ and tools reading it
# would show as the zygote's) must be the zygote's own, or the runtime is started as a
# process of its own.
PER_RUNTIME_ENV = frozenset({SETTINGS_ENV, FLIGHT_ENV, NICE_ENV, PRELOAD_ENV, MEMORY_LIMIT_ENV})


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError(f"zygote message is not a map: {line[:200]!r}")
    return message
