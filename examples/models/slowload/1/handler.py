"""Loads slowly (like a model with large weights), then echoes its JSON body.

``MODELFLEET_EXAMPLE_SLOWLOAD_S`` (seconds, default 3) sets the load time, read
at each load. ``MODELFLEET_EXAMPLE_SLOWLOAD_RELEASE``, a file's path, ends every load
early once that file exists: a test holds the load for as long as it looks at the
waiting requests, not for a guessed number of seconds. ``SlowLoad.loads_started``
counts loads in this process, so a test can tell one shared load from several
concurrent ones.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

from modelfleet import Context, Model, Request

ENV_VAR = "MODELFLEET_EXAMPLE_SLOWLOAD_S"
RELEASE_VAR = "MODELFLEET_EXAMPLE_SLOWLOAD_RELEASE"
DEFAULT_S = 3.0
# How often a held load looks for its release file: another process creates it, and
# nothing else would tell this one.
RELEASE_POLL_S = 0.05


def load_seconds() -> float:
    raw = os.environ.get(ENV_VAR, "")
    if not raw:
        return DEFAULT_S
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_VAR}={raw!r} is not a number of seconds") from None
    if not 0 <= seconds <= 3600:
        raise ValueError(f"{ENV_VAR}={raw!r} must be between 0 and 3600 seconds")
    return seconds


def hold_load(seconds: float, release: str) -> None:
    """Sleep ``seconds``, or less once the file ``release`` (when named) exists. Load runs
    on a worker thread: the event loop stays free meanwhile."""
    deadline = time.monotonic() + seconds
    if not release:
        time.sleep(seconds)
        return
    released = Path(release)
    while not released.exists():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(RELEASE_POLL_S, left))


class SlowLoad(Model):
    loads_started: ClassVar[int] = 0
    _count_lock: ClassVar[threading.Lock] = threading.Lock()

    def load(self, ctx: Context) -> None:
        with SlowLoad._count_lock:
            SlowLoad.loads_started += 1
        self.load_s = load_seconds()
        hold_load(self.load_s, os.environ.get(RELEASE_VAR, ""))

    async def preprocess(self, request: Request) -> Any:
        return request.json()

    def predict(self, batch: list[Any]) -> list[dict[str, Any]]:
        return [{"echo": item} for item in batch]
