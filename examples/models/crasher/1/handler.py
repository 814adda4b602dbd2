"""Echoes its text, or kills its process when the text is exactly ``CRASH``.

It stands for a request that crashes whatever runs it (a native-code segfault, an
out-of-memory kill): nothing is raised, the process is simply gone. The fleet must
survive it, answer the other requests, and stop redelivering the poison pill.
"""

from __future__ import annotations

import os
import sys

from modelfleet import Model, Request

POISON = "CRASH"
EXIT_CODE = 13


class Crasher(Model):
    async def preprocess(self, request: Request) -> str:
        return request.text()

    def predict(self, batch: list[str]) -> list[dict[str, str]]:
        if POISON in batch:
            sys.stderr.write(f"crasher: got {POISON!r}, exiting with {EXIT_CODE}\n")
            sys.stderr.flush()
            os._exit(EXIT_CODE)  # on purpose: no exception, no cleanup
        return [{"echo": text} for text in batch]
