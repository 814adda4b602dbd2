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
from typing import TYPE_CHECKING, Any

from modelfleet.errors import InvalidInput

if TYPE_CHECKING:
    import numpy as np


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
    """Return this from ``postprocess`` to answer with raw bytes instead of JSON.

    ``header_length``: a v2 answer with binary outputs, the length of its JSON header
    (the v2 codec sets it; the reply carries it to the gateway as a field of its own)."""

    body: bytes
    content_type: str = "application/octet-stream"
    header_length: int | None = None


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

    def map_array(self, name: str) -> np.ndarray:
        """The ``.npy`` artifact ``name``, mapped read-only instead of read and copied.

        No byte is read until used; the pages are the OS page cache's, shared with
        every runtime that maps the same artifact, and leave with the array. The
        package folder is always on local disk (the repository's disk cache), so this
        maps the local copy. ``ModelLoadFailed`` for a missing file or an ``.npz``.
        """
        from modelfleet.model.mapped import map_npy  # numpy: only for models that map

        return map_npy(self.artifact(name))

    def map_tensors(self, name: str) -> dict[str, np.ndarray]:
        """Every tensor of the safetensors artifact ``name`` by name, mapped read-only
        (like ``map_array``; a ``TorchModel`` gets torch tensors on its device from
        ``load_tensors``). ``ModelLoadFailed`` for a missing or malformed file."""
        from modelfleet.model.mapped import map_safetensors

        return map_safetensors(self.artifact(name))


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
