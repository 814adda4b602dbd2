"""Allocates memory on request, to show a memory limit kills only this model's runtime.

``{"mb": 50}`` allocates 50 MiB, writes every page (untouched pages cost nothing, so
a zero-filled ``bytearray`` would prove nothing), holds it for ``hold_ms`` and frees
it. Under a 200 MiB limit that answers; ``{"mb": 300}`` gets the runtime killed (at
once by a cgroup, within a sampling interval by the RSS watchdog, which is why the
memory is held a moment). Anything else answers with ``ctx.memory_limit_bytes``.
"""

from __future__ import annotations

import time
from typing import Any

from modelfleet import Context, InvalidInput, Model, Request

MiB = 1024 * 1024
MAX_MB = 64 * 1024
MAX_HOLD_MS = 10_000


class MemHog(Model):
    memory_limit_bytes: int | None

    def load(self, ctx: Context) -> None:
        self.memory_limit_bytes = ctx.memory_limit_bytes

    async def preprocess(self, request: Request) -> tuple[int, int] | None:
        body = request.json()
        if not (isinstance(body, dict) and "mb" in body):
            return None
        mb, hold_ms = body["mb"], body.get("hold_ms", 1000)
        for field, value, most in (("mb", mb, MAX_MB), ("hold_ms", hold_ms, MAX_HOLD_MS)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
                raise InvalidInput(f"'{field}' must be an integer from 0 to {most}")
        return mb, hold_ms

    def predict(self, batch: list[tuple[int, int] | None]) -> list[dict[str, Any]]:
        answers: list[dict[str, Any]] = []
        for item in batch:
            if item is None:
                answers.append({"memory_limit_bytes": self.memory_limit_bytes})
                continue
            mb, hold_ms = item
            block = b"\x01" * (mb * MiB)  # every page written, so every page is resident
            time.sleep(hold_ms / 1000)
            answers.append({"allocated_mb": len(block) // MiB})
            del block
        return answers
