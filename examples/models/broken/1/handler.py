"""A model whose load always fails: it exists to demonstrate load-failure handling.

Its artifact (``artifacts/weights.json``) says ``format_version`` 3; this handler
reads only version 2, as happens when a trainer is upgraded and the serving code
is not. ``load`` raises ``ArtifactIncompatible`` naming the file and both
versions; nothing is cached, so each new attempt reads the file again.
"""

from __future__ import annotations

import json
from typing import Any

from modelfleet import Context, Model

READS_FORMAT = 2


class ArtifactIncompatible(RuntimeError):
    pass


class Broken(Model):
    def load(self, ctx: Context) -> None:
        path = ctx.artifact("artifacts/weights.json")
        found = json.loads(path.read_text(encoding="utf-8")).get("format_version")
        if found != READS_FORMAT:
            raise ArtifactIncompatible(
                f"artifact {path.name} is format_version {found}; this handler reads only "
                f"format_version {READS_FORMAT}: rebuild the artifact or upgrade the handler"
            )

    def predict(self, batch: list[Any]) -> list[Any]:  # pragma: no cover - never loads
        return batch
