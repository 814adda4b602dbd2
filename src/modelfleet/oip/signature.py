"""A model's declared tensor signature, and a request checked against it.

The signature comes from ``model.toml`` (``[[inputs]]``, ``[[outputs]]``: name,
datatype, shape with -1 for a dimension of any size). Anything with those three
attributes is a ``TensorSpec``; this module imports no manifest code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from modelfleet.errors import RequestRejected
from modelfleet.oip.codec import InferenceRequest


class TensorSpec(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def datatype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


def shape_fits(shape: Sequence[int], declared: Sequence[int]) -> bool:
    """Same rank, and every declared dimension other than -1 equal."""
    return len(shape) == len(declared) and all(
        want in (-1, got) for got, want in zip(shape, declared, strict=True))


def check_request(request: InferenceRequest, inputs: Sequence[TensorSpec],
                  outputs: Sequence[TensorSpec], model: str) -> None:
    """``RequestRejected`` unless the request's inputs are exactly the declared ones, each
    of its declared datatype and a fitting shape, and every requested output is declared."""
    declared = {spec.name: spec for spec in inputs}
    given = {tensor.name: tensor for tensor in request.inputs}
    unknown = sorted(set(given) - set(declared))
    if unknown:
        raise RequestRejected(f"model '{model}' has no input(s) {unknown}; its inputs are "
                              f"{sorted(declared)}")
    missing = sorted(set(declared) - set(given))
    if missing:
        raise RequestRejected(f"model '{model}' needs input(s) {missing}")
    for name, tensor in given.items():
        spec = declared[name]
        if tensor.datatype != spec.datatype:
            raise RequestRejected(f"input '{name}' of model '{model}' is {spec.datatype}, "
                                  f"got {tensor.datatype}")
        if not shape_fits(tensor.shape, spec.shape):
            raise RequestRejected(f"input '{name}' of model '{model}' has shape "
                                  f"{list(spec.shape)} (-1: any size), got "
                                  f"{list(tensor.shape)}")
    by_name = {spec.name: spec for spec in outputs}
    for wanted in request.outputs or ():
        out = by_name.get(wanted.name)
        if out is None:
            raise RequestRejected(f"model '{model}' has no output '{wanted.name}'; its "
                                  f"outputs are {sorted(by_name)}")
        if wanted.classification is not None and (out.datatype in ("BYTES", "BOOL")
                                                  or not out.shape):
            raise RequestRejected(f"output '{wanted.name}' of model '{model}' is "
                                  f"{out.datatype} of shape {list(out.shape)}: "
                                  f"classification needs numeric scores with a class axis")
