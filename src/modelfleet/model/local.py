"""``LocalModel``: a model package run in-process, with no server, the way the runtime runs it.

A model author unit-tests a handler with plain pytest through it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from modelfleet.errors import ModelfleetError, ModelLoadFailed
from modelfleet.model.api import Context, Model, Request
from modelfleet.model.importer import import_handler
from modelfleet.model.pipeline import Batcher, handle_request
from modelfleet.oip import HEADER_LENGTH_PARAM, OIP_CONTENT_TYPE
from modelfleet.repository.manifest import Manifest, load_manifest


async def run_pipeline(model: Model, requests: list[Request], max_batch_size: int | None = None,
                       max_delay_s: float = 0.0, manifest: Manifest | None = None) -> list[Any]:
    """Run requests through the handler the way the runtime does, batching ``predict``.

    Returns one result per request: the postprocessed output, or the ``ModelfleetError``
    that request raised (a bad input fails only its own request, never its batch mates).
    """
    batcher = Batcher(model.predict, max_batch_size or max(1, len(requests)),
                      max_delay_s if max_batch_size else 0.05)
    try:
        done = await asyncio.gather(*(handle_request(model, batcher, r, manifest)
                                      for r in requests), return_exceptions=True)
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

    async def ainfer_many(self, items: list[tuple[bytes, str]],
                          params: dict[str, str] | None = None) -> list[Any]:
        """Run a batch; raises the first request's error if any request failed."""
        requests = [Request(body, ctype, params or {}) for body, ctype in items]
        results = await run_pipeline(self.handler, requests, manifest=self.manifest)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    async def ainfer(self, body: bytes, content_type: str) -> Any:
        return (await self.ainfer_many([(body, content_type)]))[0]

    def infer(self, body: bytes, content_type: str) -> Any:
        """Run one request through preprocess, predict and postprocess; return the result."""
        return asyncio.run(self.ainfer(body, content_type))

    def infer_tensors(self, inputs: dict[str, Any], binary: bool = False,
                      outputs: list[str] | None = None) -> dict[str, Any]:
        """A v2 tensor request (as the gateway forwards it) for a model with a signature:
        numpy arrays by input name in, numpy arrays by output name out.

        >>> model = LocalModel.from_package("examples/models/iris/1")
        >>> model.infer_tensors({"features": np.array([[5.1, 3.5, 1.4, 0.2]], "f4")})
        """
        from modelfleet.oip.codec import decode_response, encode_request  # numpy: only here

        body, header_length = encode_request(inputs, binary=binary, outputs=outputs,
                                             binary_outputs=binary)
        params = {} if header_length is None else {HEADER_LENGTH_PARAM: str(header_length)}
        answer = asyncio.run(self.ainfer_many([(body, OIP_CONTENT_TYPE)], params))[0]
        _, arrays = decode_response(answer.body, answer.header_length)
        return arrays
