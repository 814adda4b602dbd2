"""A v2 (Open Inference Protocol) request through a handler with a tensor signature.

``TensorCall.open`` decodes the request body the gateway forwarded unchanged (JSON
tensors or the binary tensor extension), checks it against the manifest's
``[[inputs]]``, and gives the handler a ``Request`` whose ``tensors`` are numpy arrays
by input name and whose ``params`` hold the request's own ``parameters``.
``TensorCall.answer`` turns what the handler returned (a dict of arrays
by output name, a list of them in the manifest's order, or one array for a model with
one output) into the v2 response, with the outputs the caller asked for, each as JSON
``data`` or in binary as asked. A request that does not fit is the caller's fault
(``RequestRejected``); outputs that do not fit the declared ones are the handler's
(``ModelFailed``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from modelfleet.errors import ModelFailed, RequestRejected
from modelfleet.model.api import Output, Request
from modelfleet.oip import HEADER_LENGTH_PARAM
from modelfleet.oip.codec import (
    InferenceRequest,
    OutputTensor,
    encode_response,
    parse_header_length,
    parse_request,
)
from modelfleet.oip.signature import check_request, shape_fits
from modelfleet.oip.tensor import as_output_array
from modelfleet.repository.manifest import Manifest

# Request parameters the protocol itself acts on; the handler gets the others.
PROTOCOL_PARAMETERS = frozenset({"timeout", "binary_data_output"})


def handler_parameters(parameters: Mapping[str, Any]) -> dict[str, str]:
    """A v2 request's own parameters as ``Request.params`` holds /v1 query parameters:
    strings as they are, any other JSON value as its JSON text (``true``, ``5``)."""
    return {name: value if isinstance(value, str) else json.dumps(value)
            for name, value in parameters.items() if name not in PROTOCOL_PARAMETERS}


def classify(array: np.ndarray, top: int, labels: Sequence[str] = ()) -> np.ndarray:
    """The classification extension: the ``top`` largest scores along the last axis, each
    as ``b"value:index"`` (``b"value:index:label"`` where ``labels`` names the index), best
    first; shape ``[..., min(top, classes)]``. Ties keep the lower index first."""
    if array.ndim == 0:
        raise ModelFailed("classification needs an output with a class axis, got a scalar")
    scores = array.astype(np.float64, copy=False)
    k = min(top, scores.shape[-1])
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    best = np.take_along_axis(scores, order, axis=-1)
    out = np.empty(order.shape, dtype=object)
    for at in np.ndindex(order.shape):
        index = int(order[at])
        text = f"{best[at]:f}:{index}"
        if index < len(labels):
            text += f":{labels[index]}"
        out[at] = text.encode()
    return out


@dataclass(frozen=True)
class TensorCall:
    manifest: Manifest
    request: InferenceRequest

    @classmethod
    def open(cls, request: Request, manifest: Manifest | None) -> tuple[TensorCall, Request]:
        """The call, and the handler's ``Request`` with its ``tensors`` decoded."""
        if manifest is None or not manifest.has_signature:
            name = manifest.name if manifest is not None else "this model"
            raise RequestRejected(f"model '{name}' declares no tensor signature "
                                  f"([[inputs]] in model.toml): use the /v1 API")
        header_length = parse_header_length(request.params.get(HEADER_LENGTH_PARAM))
        parsed = parse_request(request.body, header_length)
        check_request(parsed, manifest.inputs, manifest.outputs, manifest.name)
        params = {k: v for k, v in request.params.items() if k != HEADER_LENGTH_PARAM}
        params.update(handler_parameters(parsed.parameters))
        return cls(manifest, parsed), replace(request, tensors=parsed.decode_inputs(),
                                              params=params)

    def answer(self, result: Any) -> Output:
        """The v2 response body for what the handler returned."""
        named = self._named(result)
        specs = {spec.name: spec for spec in self.manifest.outputs}
        wanted = ([o.name for o in self.request.outputs] if self.request.outputs is not None
                  else list(specs))
        outputs = []
        for name in wanted:
            spec = specs[name]
            try:
                array = as_output_array(named[name], spec.datatype, name)
            except (TypeError, ValueError) as exc:
                raise ModelFailed(f"model '{self.manifest.name}': {exc}") from exc
            if not shape_fits(array.shape, spec.shape):
                raise ModelFailed(f"model '{self.manifest.name}' returned output '{name}' of "
                                  f"shape {list(array.shape)}; model.toml declares "
                                  f"{list(spec.shape)}")
            top = self._classification(name)
            if top is not None:
                outputs.append(OutputTensor(name, classify(array, top, spec.label_names),
                                            "BYTES", self.request.output_is_binary(name)))
                continue
            outputs.append(OutputTensor(name, array, spec.datatype,
                                        self.request.output_is_binary(name)))
        body, header_length = encode_response(self.manifest.name, self.manifest.version,
                                              outputs, self.request.id)
        if header_length is None:
            return Output(body, "application/json")
        return Output(body, "application/octet-stream", header_length)

    def _classification(self, name: str) -> int | None:
        for wanted in self.request.outputs or ():
            if wanted.name == name:
                return wanted.classification
        return None

    def _named(self, result: Any) -> Mapping[str, Any]:
        specs = self.manifest.outputs
        model = self.manifest.name
        if isinstance(result, Mapping):
            extra = sorted(set(result) - {spec.name for spec in specs})
            missing = sorted({spec.name for spec in specs} - set(result))
            if extra or missing:
                raise ModelFailed(
                    f"model '{model}' returned outputs {sorted(result)}; model.toml declares "
                    f"{[spec.name for spec in specs]}")
            return result
        if isinstance(result, np.ndarray) and len(specs) == 1:
            return {specs[0].name: result}
        if isinstance(result, list | tuple) and len(result) == len(specs):
            return {spec.name: value for spec, value in zip(specs, result, strict=True)}
        raise ModelFailed(
            f"model '{model}' answered a v2 request with {type(result).__name__}; return a "
            f"dict of arrays by output name (or a list of {len(specs)} in model.toml's order)")
