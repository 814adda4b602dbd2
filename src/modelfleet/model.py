"""The model author's API: ``Model``, ``Request``, ``Context``, ``Output``, and ``LocalModel``.

A handler subclasses ``Model`` and writes ``load`` and ``predict``; ``preprocess``
and ``postprocess`` are optional coroutines for per-request work and I/O waits.
``predict`` takes a *batch* (a list of preprocessed inputs) and returns one output
per input. The framework decides where each part runs: the coroutines on the
runtime's event loop, ``load`` and ``predict`` on a worker thread.

``LocalModel`` runs a model package's whole path in-process, with no server, so a
model author can unit-test a handler with plain pytest. This module imports no
web framework.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import inspect
import json
import os
import re
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from modelfleet.errors import InvalidInput, ModelfleetError, ModelLoadFailed
from modelfleet.manifest import Manifest, load_manifest


@dataclass(frozen=True)
class Request:
    """One inference request as a handler sees it."""

    body: bytes
    content_type: str
    params: Mapping[str, str] = field(default_factory=dict)
    request_id: str = ""
    deadline_ms: int = 0

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
        """Turn a request into one model input. May await I/O."""
        return request.body

    def predict(self, batch: list[Any]) -> list[Any]:
        """Run the model over a batch; return one output per input, in order."""
        raise NotImplementedError(f"{type(self).__name__} must implement predict()")

    async def postprocess(self, output: Any, request: Request) -> Any:
        """Turn one model output into the answer (JSON-able, or an ``Output``)."""
        return output

    def unload(self) -> None:
        """Release what ``load`` took. Called on eviction."""


_IMPORT_LOCK = threading.Lock()  # sys.path and sys.modules are process-wide


def import_handler(manifest: Manifest, package_dir: Path) -> type[Model]:
    """Import the handler class named by ``entrypoint = "module:Class"``.

    The entrypoint module is imported under a name unique to the model and version,
    so two packages may both ship a ``handler.py``. Sibling modules it imports from
    its package folder are removed from ``sys.modules`` afterwards (the handler keeps
    its references), so the next package's ``helpers.py`` is its own, not this one's.
    """
    module_name, _, class_name = manifest.entrypoint.partition(":")
    source = package_dir / (module_name.replace(".", os.sep) + ".py")
    if not source.is_file():
        raise ModelLoadFailed(f"model '{manifest.name}': entrypoint module {source} not found")
    identity = f"{manifest.name}:{manifest.version}:{module_name}:{package_dir}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    unique = "modelfleet_pkg_" + re.sub(r"\W", "_", f"{manifest.name}_{module_name}") + \
        f"_{digest}"
    spec = importlib.util.spec_from_file_location(unique, source)
    if spec is None or spec.loader is None:
        raise ModelLoadFailed(f"model '{manifest.name}': cannot import {source}")
    module: ModuleType = importlib.util.module_from_spec(spec)
    with _IMPORT_LOCK:
        before = set(sys.modules)
        sys.modules[unique] = module
        sys.path.insert(0, str(package_dir))
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(unique, None)
            raise ModelLoadFailed(
                f"model '{manifest.name}': importing {source} failed: {exc!r}") from exc
        finally:
            sys.path.remove(str(package_dir))
            _forget_package_siblings(set(sys.modules) - before - {unique}, package_dir)
    handler = getattr(module, class_name, None)
    if not (isinstance(handler, type) and issubclass(handler, Model)):
        raise ModelLoadFailed(
            f"model '{manifest.name}': {manifest.entrypoint} is not a modelfleet.Model subclass"
        )
    for hook in ("preprocess", "postprocess"):
        if not inspect.iscoroutinefunction(getattr(handler, hook)):
            raise ModelLoadFailed(f"model '{manifest.name}': {class_name}.{hook} must be "
                                  f"'async def' (it runs on the runtime's event loop)")
    return handler


def _forget_package_siblings(names: set[str], package_dir: Path) -> None:
    root = package_dir.resolve()
    for name in names:
        origin = getattr(sys.modules.get(name), "__file__", None)
        if origin and Path(origin).resolve().is_relative_to(root):
            del sys.modules[name]


async def run_pipeline(model: Model, requests: list[Request], max_batch_size: int | None = None,
                       max_delay_s: float = 0.0) -> list[Any]:
    """Run requests through the handler the way the runtime does, batching ``predict``.

    Returns one result per request: the postprocessed output, or the ``ModelfleetError``
    that request raised (a bad input fails only its own request, never its batch mates).
    """
    from modelfleet.runtime.pipeline import Batcher, handle_request

    batcher = Batcher(model.predict, max_batch_size or max(1, len(requests)),
                      max_delay_s if max_batch_size else 0.05)
    try:
        done = await asyncio.gather(*(handle_request(model, batcher, r) for r in requests),
                                    return_exceptions=True)
    finally:
        await batcher.close()
    return [r if isinstance(r, BaseException) else r[0] for r in done]


class LocalModel:
    """A model package run in-process: the test helper for model authors.

    >>> model = LocalModel.from_package("examples/models/iris/1")
    >>> model.infer(b'{"features": [5.1, 3.5, 1.4, 0.2]}', "application/json")
    """

    def __init__(self, manifest: Manifest, handler: Model) -> None:
        self.manifest = manifest
        self.handler = handler

    @classmethod
    def from_package(cls, package_dir: str | Path) -> LocalModel:
        package = Path(package_dir)
        manifest = load_manifest(package / "model.toml")
        handler = import_handler(manifest, package)()
        ctx = Context(manifest.name, manifest.version, package, "cpu", manifest.memory_limit_bytes)
        try:
            handler.load(ctx)
        except ModelfleetError:
            raise
        except Exception as exc:  # the same error the runtime gives for this failure
            raise ModelLoadFailed(f"model '{manifest.name}' failed to load: {exc!r}") from exc
        return cls(manifest, handler)

    async def ainfer_many(self, items: list[tuple[bytes, str]]) -> list[Any]:
        """Run a batch; raises the first request's error if any request failed."""
        requests = [Request(body, ctype) for body, ctype in items]
        results = await run_pipeline(self.handler, requests)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    async def ainfer(self, body: bytes, content_type: str) -> Any:
        return (await self.ainfer_many([(body, content_type)]))[0]

    def infer(self, body: bytes, content_type: str) -> Any:
        """Run one request through preprocess, predict and postprocess; return the result."""
        return asyncio.run(self.ainfer(body, content_type))
