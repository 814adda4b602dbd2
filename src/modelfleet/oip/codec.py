"""Open Inference Protocol v2 request and response bodies <-> numpy arrays (pure).

A body is a JSON header, optionally followed by binary tensor data (the binary tensor
extension): then ``Inference-Header-Content-Length`` says how many leading bytes are
the JSON header, and each binary tensor says its ``binary_data_size``; the binary
parts follow the header in the order of their tensors. Tensors are row-major.

- ``parse_request`` checks a request's structure (every field's type, datatypes,
  shapes, binary sizes adding up to the body) without converting any data;
  ``InferenceRequest.decode_inputs`` then turns each input into a numpy array
  (``modelfleet.oip.tensor``: element types, counts and ranges checked);
- ``encode_response`` writes outputs as JSON ``data`` or as binary parts;
- ``encode_request`` and ``decode_response`` are the client's side of the same
  format (tests, benchmarks).

Every malformed input raises ``RequestRejected`` with a message naming the tensor and
what was wrong; nothing here knows HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from modelfleet.errors import RequestRejected
from modelfleet.oip import jsonio
from modelfleet.oip.datatypes import DATATYPES, datatype_of
from modelfleet.oip.tensor import (
    TensorHeader,
    as_output_array,
    binary_of,
    decode_tensor,
    json_data,
)

MAX_RANK = 32  # dimensions of a tensor (numpy's own limit is 64)
MAX_CLASSIFICATION = 1000  # the largest top-k the classification extension answers

# The tensor parameters this server honours; any other is refused, never ignored (a client
# that asked for shared memory would otherwise read a region nobody wrote).
INPUT_PARAMETERS = frozenset({"binary_data_size"})
OUTPUT_PARAMETERS = frozenset({"binary_data", "classification"})
SHARED_MEMORY_PARAMETERS = frozenset({"shared_memory_region", "shared_memory_byte_size",
                                      "shared_memory_offset"})


def _honoured(parameters: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    """``RequestRejected`` for a tensor parameter this server does not act on."""
    shared = sorted(set(parameters) & SHARED_MEMORY_PARAMETERS)
    if shared:
        raise RequestRejected(f"{where}: shared memory ({', '.join(shared)}) is not supported "
                              f"by this server (system or CUDA): send the tensor's data in "
                              f"the request body")
    unknown = sorted(set(parameters) - allowed)
    if unknown:
        raise RequestRejected(f"{where}: parameter(s) {unknown} are not supported; this server "
                              f"honours {', '.join(sorted(allowed))}")


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool | None = None  # its ``binary_data`` parameter; None: the request's default
    parameters: Mapping[str, Any] = field(default_factory=dict)
    classification: int | None = None  # top-k classes instead of the raw tensor


@dataclass(frozen=True)
class InferenceRequest:
    """A parsed request: the header's fields, and where each binary input lies."""

    inputs: tuple[TensorHeader, ...]
    outputs: tuple[RequestedOutput, ...] | None = None  # None: every output
    id: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=dict)
    binary: memoryview = field(default_factory=lambda: memoryview(b""))  # after the header
    offsets: Mapping[str, int] = field(default_factory=dict)  # input name -> binary offset

    @property
    def binary_output(self) -> bool:
        """The ``binary_data_output`` parameter: outputs in binary unless an output says."""
        return bool(self.parameters.get("binary_data_output", False))

    def output_is_binary(self, name: str) -> bool:
        for wanted in self.outputs or ():
            if wanted.name == name and wanted.binary is not None:
                return wanted.binary
        return self.binary_output

    def decode_inputs(self) -> dict[str, np.ndarray]:
        """Every input as a numpy array, by name."""
        return {t.name: decode_tensor(t, self.binary_of(t)) for t in self.inputs}

    def binary_of(self, tensor: TensorHeader) -> memoryview | None:
        if tensor.binary_size is None:
            return None
        start = self.offsets[tensor.name]
        return self.binary[start:start + tensor.binary_size]


@dataclass(frozen=True)
class OutputTensor:
    name: str
    array: np.ndarray
    datatype: str
    binary: bool = False
    parameters: Mapping[str, Any] = field(default_factory=dict)


# -- the request ----------------------------------------------------------------------

def split_body(body: bytes | memoryview, header_length: int | None
               ) -> tuple[memoryview, memoryview]:
    """(JSON header, binary part) of a body; ``header_length`` None: all of it is JSON."""
    view = memoryview(body)
    if header_length is None:
        return view, view[len(view):]
    if header_length < 0 or header_length > len(view):
        raise RequestRejected(
            f"Inference-Header-Content-Length is {header_length} but the body has "
            f"{len(view)} bytes: the JSON header cannot be that long")
    return view[:header_length], view[header_length:]


def parse_header_length(value: str | None) -> int | None:
    """The ``Inference-Header-Content-Length`` header's value, checked."""
    if value is None:
        return None
    if not value.strip().isdigit():
        raise RequestRejected(f"Inference-Header-Content-Length must be a non-negative "
                              f"whole number of bytes, got {value!r}")
    return int(value)


def _json_object(raw: memoryview, what: str) -> dict[str, Any]:
    try:
        value = jsonio.loads(raw)
    except UnicodeDecodeError as exc:
        raise RequestRejected(f"the {what} is not UTF-8: {exc}") from exc
    except ValueError as exc:
        raise RequestRejected(f"the {what} is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise RequestRejected(f"the {what} is JSON nested too deeply") from exc
    if not isinstance(value, dict):
        raise RequestRejected(f"the {what} must be a JSON object, got {type(value).__name__}")
    return value


def _parameters(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestRejected(f"{where}: 'parameters' must be an object")
    return value


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise RequestRejected(f"{where}: 'shape' must be a list of non-negative integers, "
                              f"got {str(value)[:200]}")
    if len(value) > MAX_RANK:
        raise RequestRejected(f"{where}: 'shape' has {len(value)} dimensions; at most "
                              f"{MAX_RANK} are supported")
    return tuple(value)


def _input(value: Any, index: int, has_binary: bool) -> TensorHeader:
    if not isinstance(value, dict):
        raise RequestRejected(f"inputs[{index}] must be an object")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise RequestRejected(f"inputs[{index}]: 'name' must be a non-empty string")
    where = f"input '{name}'"
    unknown = sorted(set(value) - {"name", "datatype", "shape", "parameters", "data"})
    if unknown:
        raise RequestRejected(f"{where}: unknown field(s) {unknown}")
    datatype = value.get("datatype")
    if datatype not in DATATYPES:
        raise RequestRejected(f"{where}: 'datatype' must be one of {', '.join(DATATYPES)}, "
                              f"got {datatype!r}")
    shape = _shape(value.get("shape"), where)
    parameters = _parameters(value.get("parameters"), where)
    _honoured(parameters, INPUT_PARAMETERS, where)
    size = parameters.get("binary_data_size")
    if size is None:
        if "data" not in value:
            raise RequestRejected(f"{where} has neither 'data' nor a 'binary_data_size' "
                                  f"parameter")
        return TensorHeader(name, datatype, shape, parameters, value["data"])
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise RequestRejected(f"{where}: 'binary_data_size' must be a non-negative integer, "
                              f"got {size!r}")
    if "data" in value:
        raise RequestRejected(f"{where} has both 'data' and 'binary_data_size': send one")
    if not has_binary:
        raise RequestRejected(f"{where} says binary_data_size={size} but the request has no "
                              f"binary part (send the Inference-Header-Content-Length header)")
    return TensorHeader(name, datatype, shape, parameters, None, size)


def _output(value: Any, index: int) -> RequestedOutput:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) \
            or not value["name"]:
        raise RequestRejected(f"outputs[{index}] must be an object with a non-empty 'name'")
    unknown = sorted(set(value) - {"name", "parameters"})
    if unknown:
        raise RequestRejected(f"output '{value['name']}': unknown field(s) {unknown}")
    where = f"output '{value['name']}'"
    parameters = _parameters(value.get("parameters"), where)
    _honoured(parameters, OUTPUT_PARAMETERS, where)
    binary = parameters.get("binary_data")
    if binary is not None and not isinstance(binary, bool):
        raise RequestRejected(f"{where}: 'binary_data' must be true or false")
    top = parameters.get("classification")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                            or not 1 <= top <= MAX_CLASSIFICATION):
        raise RequestRejected(f"{where}: 'classification' is the number of top classes to "
                              f"return, a whole number from 1 to {MAX_CLASSIFICATION}; got "
                              f"{top!r}")
    return RequestedOutput(value["name"], binary, parameters, top)


def parse_request(body: bytes | memoryview, header_length: int | None = None
                  ) -> InferenceRequest:
    """Check a request body's structure; the data stays unconverted (``decode_inputs``)."""
    raw_header, binary = split_body(body, header_length)
    try:
        doc = _json_object(raw_header, "inference request")
    except RequestRejected as exc:
        if header_length is None:  # the likeliest mistake: binary data sent without it
            raise RequestRejected(f"{exc.message} (a body with binary tensors after its "
                                  f"JSON needs the Inference-Header-Content-Length "
                                  f"header)") from exc
        raise
    # The KServe SDK also names the model in the body; the URL does that here.
    unknown = sorted(set(doc) - {"id", "parameters", "inputs", "outputs", "model_name",
                                 "model_version"})
    if unknown:
        raise RequestRejected(f"unknown field(s) {unknown} in the inference request")
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise RequestRejected("'id' must be a string")
    parameters = _parameters(doc.get("parameters"), "the request")
    flag = parameters.get("binary_data_output")
    if flag is not None and not isinstance(flag, bool):
        raise RequestRejected("'binary_data_output' must be true or false")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise RequestRejected("'inputs' must be a non-empty list of tensors")
    has_binary = header_length is not None
    inputs = tuple(_input(v, i, has_binary) for i, v in enumerate(raw_inputs))
    _unique([t.name for t in inputs], "input")
    outputs = None
    if doc.get("outputs") is not None:
        if not isinstance(doc["outputs"], list):
            raise RequestRejected("'outputs' must be a list")
        outputs = tuple(_output(v, i) for i, v in enumerate(doc["outputs"]))
        _unique([o.name for o in outputs], "output")
    offsets: dict[str, int] = {}
    at = 0
    for tensor in inputs:
        if tensor.binary_size is not None:
            offsets[tensor.name] = at
            at += tensor.binary_size
    if at > len(binary):
        raise RequestRejected(f"the binary inputs declare {at} bytes but only {len(binary)} "
                              f"follow the JSON header: the body is truncated")
    if at < len(binary):
        raise RequestRejected(f"{len(binary) - at} bytes follow the binary inputs that no "
                              f"input's binary_data_size accounts for")
    return InferenceRequest(inputs, outputs, request_id, parameters, binary, offsets)


def _unique(names: list[str], what: str) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise RequestRejected(f"{what} '{name}' appears twice")
        seen.add(name)


# -- the response ---------------------------------------------------------------------

def encode_response(model_name: str, model_version: str, outputs: Sequence[OutputTensor],
                    request_id: str | None = None,
                    parameters: Mapping[str, Any] | None = None) -> tuple[bytes, int | None]:
    """(body, header length): the header length is None when no output is binary."""
    doc: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        doc["id"] = request_id
    if parameters:
        doc["parameters"] = dict(parameters)
    tensors, parts, arrays = [], [], []
    for out in outputs:
        tensor: dict[str, Any] = {"name": out.name, "datatype": out.datatype,
                                  "shape": list(out.array.shape)}
        params = dict(out.parameters)
        if out.binary:
            part = binary_of(out.array, out.datatype)
            parts.append(part)
            params["binary_data_size"] = len(part)
        else:
            tensor["data"] = data = json_data(out.array, out.datatype, out.name)
            if isinstance(data, np.ndarray):
                arrays.append(data)
        if params:
            tensor["parameters"] = params
        tensors.append(tensor)
    doc["outputs"] = tensors
    header = jsonio.dumps(doc, arrays)
    if not parts:
        return header, None
    return b"".join([header, *parts]), len(header)


# -- the client's side ----------------------------------------------------------------

def encode_request(inputs: Mapping[str, np.ndarray], binary: bool = False,
                   outputs: Sequence[str] | None = None, request_id: str | None = None,
                   parameters: Mapping[str, Any] | None = None,
                   binary_outputs: bool = False) -> tuple[bytes, int | None]:
    """A request body for ``inputs`` (JSON ``data``, or binary parts); see ``encode_response``."""
    doc: dict[str, Any] = {}
    if request_id is not None:
        doc["id"] = request_id
    params = dict(parameters or {})
    if binary_outputs:
        params["binary_data_output"] = True
    if params:
        doc["parameters"] = params
    tensors, parts, arrays = [], [], []
    for name, value in inputs.items():
        array = np.asarray(value)
        datatype = datatype_of(array)
        if datatype == "BYTES":
            array = as_output_array(array, "BYTES", name)
        tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if binary:
            part = binary_of(array, datatype)
            parts.append(part)
            tensor["parameters"] = {"binary_data_size": len(part)}
        else:
            tensor["data"] = data = json_data(array, datatype, name)
            if isinstance(data, np.ndarray):
                arrays.append(data)
        tensors.append(tensor)
    doc["inputs"] = tensors
    if outputs is not None:
        doc["outputs"] = [{"name": n} for n in outputs]
    header = jsonio.dumps(doc, arrays)
    if not parts:
        return header, None
    return b"".join([header, *parts]), len(header)


def decode_response(body: bytes, header_length: int | None = None
                    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(the response's JSON header, its outputs as arrays by name)."""
    raw_header, binary = split_body(body, header_length)
    doc = _json_object(raw_header, "inference response")
    arrays: dict[str, np.ndarray] = {}
    at = 0
    for out in doc.get("outputs", []):
        size = (out.get("parameters") or {}).get("binary_data_size")
        tensor = TensorHeader(out["name"], out["datatype"], tuple(out["shape"]), {},
                              out.get("data"), size)
        chunk = None
        if size is not None:
            chunk, at = binary[at:at + size], at + size
        arrays[tensor.name] = decode_tensor(tensor, chunk)
    return doc, arrays

