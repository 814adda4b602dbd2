"""What a handler is given and returns: ``Model``, ``Request``, ``Context``, ``Output``.

A handler subclasses ``Model`` and writes ``load`` and ``predict``; ``preprocess``
and ``postprocess`` are optional coroutines for per-request work and I/O waits.
``predict`` takes a *batch* (a list of preprocessed inputs) and returns one output
per input. The framework decides where each part runs: the coroutines on the
runtime's event loop, ``load`` and ``predict`` on a worker thread.

This module imports no web framework and nothing of the runtime.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelfleet.errors import InvalidInput


@dataclass(frozen=True)
class Request:
    """One inference request as a handler sees it."""

    body: bytes
    content_type: str
    params: Mapping[str, str] = field(default_factory=dict)
    request_id: str = ""
    deadline_ms: int = 0
    # An Open Inference Protocol v2 request to a model with a tensor signature: its inputs
    # decoded, numpy arrays by name (``BYTES``: object arrays of bytes). None on /v1.
    tensors: Mapping[str, Any] | None = None

    def json(self) -> Any:
        """The body parsed as JSON; malformed JSON is the caller's fault (422)."""
        try:
            return json.loads(self.body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidInput(f"body is not valid JSON: {exc}") from exc
        except RecursionError as exc:  # a few KiB of "[[[[..." must not be a server error
            raise InvalidInput("body is JSON nested too deeply") from exc

    def text(self) -> str:
        try:
            return self.body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"body is not valid UTF-8 text: {exc}") from exc


@dataclass(frozen=True)
class Output:
    """Return this from ``postprocess`` to answer with raw bytes instead of JSON."""

    body: bytes
    content_type: str = "application/octet-stream"


@dataclass(frozen=True)
class Context:
    """What ``load`` gets: where the package lies and the limits it runs under."""

    model_id: str
    version: str
    package_dir: Path
    device: str
    memory_limit_bytes: int | None = None

    def artifact(self, name: str) -> Path:
        """Path of an artifact shipped in (or built into) the package folder."""
        return self.package_dir / name


class Model:
    """Base class of every model handler."""

    def load(self, ctx: Context) -> None:
        """Load weights. Runs once per residency, in the runtime process, on a thread."""

    async def preprocess(self, request: Request) -> Any:
        """Turn a request into one model input. May await I/O.

        By default: the decoded tensors of a v2 request, else the body's bytes.
        """
        return request.tensors if request.tensors is not None else request.body

    def predict(self, batch: list[Any]) -> list[Any]:
        """Run the model over a batch; return one output per input, in order."""
        raise NotImplementedError(f"{type(self).__name__} must implement predict()")

    async def postprocess(self, output: Any, request: Request) -> Any:
        """Turn one model output into the answer (JSON-able, or an ``Output``)."""
        return output

    def unload(self) -> None:
        """Release what ``load`` took. Called on eviction."""
