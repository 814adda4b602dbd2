"""gRPC inference messages <-> the v2 body the fleet already carries (pure).

A ``ModelInferRequest`` becomes the same body an HTTP client would send with the binary
tensor extension: a JSON header naming each input with its ``binary_data_size``, then
the raw bytes of every input in order (``raw_input_contents`` as they came, or the typed
``contents`` packed into the same row-major form). Every output is asked for in binary
(``binary_data_output``), so the runtime's answer splits into the ``ModelInferResponse``'s
``raw_output_contents`` without converting a number. BYTES elements are 4-byte
little-endian lengths and their bytes in both forms.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from modelfleet.errors import RequestRejected
from modelfleet.gateway.grpc_api import inference_pb2 as pb
from modelfleet.oip import jsonio
from modelfleet.oip.codec import split_body
from modelfleet.oip.tensor import TensorHeader, binary_of, decode_tensor

# Which typed field of InferTensorContents holds each datatype (FP16 and BF16: raw only).
CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                  "INT32": "int_contents", "INT64": "int64_contents",
                  "UINT8": "uint_contents", "UINT16": "uint_contents",
                  "UINT32": "uint_contents", "UINT64": "uint64_contents",
                  "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}


def parameter_value(param: pb.InferParameter) -> Any:
    which = param.WhichOneof("parameter_choice")
    return None if which is None else getattr(param, which)


def parameters_of(params: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    return {name: parameter_value(value) for name, value in params.items()}


def set_parameter(into: pb.InferParameter, value: Any) -> None:
    if isinstance(value, bool):
        into.bool_param = value
    elif isinstance(value, int):
        into.int64_param = value
    elif isinstance(value, float):
        into.double_param = value
    else:
        into.string_param = value if isinstance(value, str) else json.dumps(value)


def _packed(tensor: pb.ModelInferRequest.InferInputTensor) -> bytes:
    """A tensor's typed ``contents`` in the binary extension's form."""
    field = CONTENTS_FIELD.get(tensor.datatype)
    if field is None:
        raise RequestRejected(f"input '{tensor.name}': {tensor.datatype or '(no datatype)'} "
                              f"data goes in raw_input_contents")
    values = list(getattr(tensor.contents, field))
    if tensor.datatype == "BYTES":
        return binary_of(np.array(values, dtype=object), "BYTES")
    # The JSON tensor path checks counts, element types and ranges: the same words here.
    header = TensorHeader(tensor.name, tensor.datatype, tuple(tensor.shape), {}, values)
    return binary_of(decode_tensor(header, None), tensor.datatype)


def request_body(request: pb.ModelInferRequest) -> tuple[bytes, int]:
    """(v2 body, its JSON header's length) for a gRPC inference request."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise RequestRejected(f"raw_input_contents has {len(raw)} entries for "
                              f"{len(request.inputs)} inputs: give one per input, in order")
    tensors, parts = [], []
    for index, tensor in enumerate(request.inputs):
        if raw and tensor.HasField("contents"):
            raise RequestRejected(f"input '{tensor.name}' has both contents and raw contents")
        part = raw[index] if raw else _packed(tensor)
        parameters = {**parameters_of(tensor.parameters), "binary_data_size": len(part)}
        tensors.append({"name": tensor.name, "datatype": tensor.datatype,
                        "shape": list(tensor.shape), "parameters": parameters})
        parts.append(part)
    doc: dict[str, Any] = {"inputs": tensors, "parameters": {
        **parameters_of(request.parameters), "binary_data_output": True}}
    if request.id:
        doc["id"] = request.id
    if request.outputs:
        doc["outputs"] = [{"name": o.name, "parameters": parameters_of(o.parameters)}
                          for o in request.outputs]
    header = jsonio.dumps(doc, [])
    return b"".join([header, *parts]), len(header)


def response_message(body: bytes, header_length: int | None) -> pb.ModelInferResponse:
    """The runtime's v2 response as a gRPC ``ModelInferResponse`` (raw output contents)."""
    raw_header, binary = split_body(body, header_length)
    doc = json.loads(bytes(raw_header))
    response = pb.ModelInferResponse(model_name=doc.get("model_name", ""),
                                     model_version=str(doc.get("model_version", "")),
                                     id=doc.get("id") or "")
    for name, value in (doc.get("parameters") or {}).items():
        set_parameter(response.parameters[name], value)
    at = 0
    for out in doc.get("outputs", []):
        tensor = response.outputs.add(name=out["name"], datatype=out["datatype"],
                                      shape=out["shape"])
        params = dict(out.get("parameters") or {})
        size = params.pop("binary_data_size", None)
        for key, value in params.items():
            set_parameter(tensor.parameters[key], value)
        if size is not None:
            response.raw_output_contents.append(bytes(binary[at:at + size]))
            at += size
        else:  # JSON data (an output the handler could only give so): pack it the same way
            header = TensorHeader(out["name"], out["datatype"], tuple(out["shape"]), {},
                                  out.get("data"))
            response.raw_output_contents.append(
                binary_of(decode_tensor(header, None), out["datatype"]))
    return response
