"""Loads slowly (like a model with large weights), then echoes its JSON body.

``MODELFLEET_EXAMPLE_SLOWLOAD_S`` (seconds, default 3) sets the load time, read
at each load. ``SlowLoad.loads_started`` counts loads in this process, so a test
can tell one shared load from several concurrent ones.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, ClassVar

from modelfleet import Context, Model, Request

ENV_VAR = "MODELFLEET_EXAMPLE_SLOWLOAD_S"
DEFAULT_S = 3.0


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


class SlowLoad(Model):
    loads_started: ClassVar[int] = 0
    _count_lock: ClassVar[threading.Lock] = threading.Lock()

    def load(self, ctx: Context) -> None:
        with SlowLoad._count_lock:
            SlowLoad.loads_started += 1
        self.load_s = load_seconds()
        time.sleep(self.load_s)  # load runs on a worker thread: the loop stays free

    async def preprocess(self, request: Request) -> Any:
        return request.json()

    def predict(self, batch: list[Any]) -> list[dict[str, Any]]:
        return [{"echo": item} for item in batch]
