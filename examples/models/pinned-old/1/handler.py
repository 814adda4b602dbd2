"""Answers with the version of ``six`` it imported: the one its own environment pins.

``six`` is imported in ``load``, not at module level, so the package can be inspected
(and its manifest validated) where six is not installed; the runtime that serves it
runs in the model's own virtual environment, where it is.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from modelfleet import Context, Model, Request

PACKAGE = "six"


class PinnedPackage(Model):
    module: ModuleType

    def load(self, ctx: Context) -> None:
        self.module = importlib.import_module(PACKAGE)

    async def preprocess(self, request: Request) -> Any:
        return request.json()  # any JSON will do; malformed JSON is a 422

    def predict(self, batch: list[Any]) -> list[dict[str, str]]:
        answer = {"package": PACKAGE, "version": str(self.module.__version__)}
        return [dict(answer) for _ in batch]
