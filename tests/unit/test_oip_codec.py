"""The Open Inference Protocol v2 tensor codec: every datatype both ways, every malformed body."""

from __future__ import annotations

import json
import struct
from typing import Any

import msgpack
import numpy as np
import pytest

from modelfleet.errors import RequestRejected
from modelfleet.messages import Reply, decode_reply, encode_reply
from modelfleet.oip.codec import (
    OutputTensor,
    decode_response,
    encode_request,
    encode_response,
    parse_header_length,
    parse_request,
)
from modelfleet.oip.datatypes import DATATYPES, datatype_of, element_size
from modelfleet.oip.signature import check_request, shape_fits
from modelfleet.oip.tensor import TensorHeader, as_output_array, decode_tensor

SAMPLES: dict[str, np.ndarray] = {
    "BOOL": np.array([[True, False, True], [False, False, True]]),
    "UINT8": np.array([[0, 255, 7]], dtype=np.uint8),
    "UINT16": np.array([0, 65535], dtype=np.uint16),
    "UINT32": np.array([0, 2**32 - 1], dtype=np.uint32),
    "UINT64": np.array([0, 2**64 - 1], dtype=np.uint64),
    "INT8": np.array([-128, 127], dtype=np.int8),
    "INT16": np.array([[-32768], [32767]], dtype=np.int16),
    "INT32": np.array([-(2**31), 2**31 - 1], dtype=np.int32),
    "INT64": np.array([-(2**63), 2**63 - 1], dtype=np.int64),
    "FP16": np.array([0.5, -2.0, 65504.0], dtype=np.float16),
    "FP32": np.array([[1.5, -0.25], [3.0, 1e-7]], dtype=np.float32),
    "FP64": np.array([np.pi, -1e300], dtype=np.float64),
    "BYTES": np.array([[b"a", b""], [b"\xc3\xa9t\xc3\xa9", b"x" * 300]], dtype=object),
}


def body_of(doc: dict[str, Any], binary: bytes = b"") -> tuple[bytes, int | None]:
    header = json.dumps(doc).encode()
    return header + binary, (len(header) if binary or _has_binary(doc) else None)


def _has_binary(doc: dict[str, Any]) -> bool:
    return any("binary_data_size" in (t.get("parameters") or {}) for t in doc.get("inputs", []))


def one_input(**fields: Any) -> dict[str, Any]:
    tensor = {"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}
    tensor.update(fields)
    return {"inputs": [{k: v for k, v in tensor.items() if v is not None}]}


def rejected(body: bytes, header_length: int | None, match: str) -> None:
    with pytest.raises(RequestRejected, match=match):
        parse_request(body, header_length).decode_inputs()


# --- round trips ---------------------------------------------------------------------

def test_every_datatype_is_covered() -> None:
    assert set(SAMPLES) == set(DATATYPES)


@pytest.mark.parametrize("datatype", DATATYPES)
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_request_round_trip(datatype: str, binary: bool) -> None:
    array = SAMPLES[datatype]
    body, header_length = encode_request({"x": array}, binary=binary)
    assert (header_length is not None) == binary
    request = parse_request(body, header_length)
    assert request.inputs[0].datatype == datatype
    assert request.inputs[0].shape == array.shape
    decoded = request.decode_inputs()["x"]
    assert decoded.shape == array.shape
    if datatype == "BYTES":
        assert decoded.tolist() == array.tolist()
    else:
        assert decoded.dtype == array.dtype.newbyteorder("<")
        np.testing.assert_array_equal(decoded, array)


@pytest.mark.parametrize("datatype", DATATYPES)
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_response_round_trip(datatype: str, binary: bool) -> None:
    array = SAMPLES[datatype]
    body, header_length = encode_response(
        "m", "3", [OutputTensor("y", array, datatype, binary)], request_id="req-1")
    doc, arrays = decode_response(body, header_length)
    assert doc["model_name"] == "m" and doc["model_version"] == "3" and doc["id"] == "req-1"
    out = doc["outputs"][0]
    assert (out["datatype"], out["shape"]) == (datatype, list(array.shape))
    assert ("data" in out) != binary
    if binary:
        assert out["parameters"]["binary_data_size"] == len(body) - header_length  # type: ignore[operator]
    assert arrays["y"].tolist() == array.tolist()


def test_binary_bytes_layout_is_length_prefixed_little_endian() -> None:
    body, header_length = encode_request({"s": np.array([b"ab", b"c"], dtype=object)},
                                         binary=True)
    assert header_length is not None
    assert body[header_length:] == struct.pack("<I", 2) + b"ab" + struct.pack("<I", 1) + b"c"


def test_binary_numbers_are_little_endian_row_major() -> None:
    array = np.array([[1, 2], [3, 4]], dtype=">i4")  # big-endian in memory: still sent LE
    body, header_length = encode_request({"x": array}, binary=True)
    assert body[header_length:] == struct.pack("<4i", 1, 2, 3, 4)


def test_nested_and_flat_data_decode_alike() -> None:
    flat = one_input(shape=[2, 2], data=[1, 2, 3, 4])
    nested = one_input(shape=[2, 2], data=[[1, 2], [3, 4]])
    a = parse_request(*body_of(flat)).decode_inputs()["x"]
    b = parse_request(*body_of(nested)).decode_inputs()["x"]
    np.testing.assert_array_equal(a, b)
    assert a.shape == (2, 2) and a.dtype == np.float32


def test_json_infinity_and_nan_are_kept() -> None:  # Python's json reads them; so may others
    body = (b'{"inputs": [{"name": "x", "datatype": "FP16", "shape": [2], '
            b'"data": [NaN, -Infinity]}]}')
    array = parse_request(body).decode_inputs()["x"]
    assert np.isnan(array[0]) and array[1] == -np.inf and array.dtype == np.float16


def test_json_numbers_may_be_integers_for_float_tensors() -> None:
    array = parse_request(*body_of(one_input(datatype="FP64", data=[1, 2.5]))).decode_inputs()
    assert array["x"].tolist() == [1.0, 2.5]


def test_mixed_json_and_binary_inputs_take_their_binary_in_order() -> None:
    first = np.arange(3, dtype=np.int32).tobytes()
    second = np.array([0.5], dtype=np.float64).tobytes()
    doc = {"inputs": [
        {"name": "a", "datatype": "INT32", "shape": [3],
         "parameters": {"binary_data_size": len(first)}},
        {"name": "j", "datatype": "BOOL", "shape": [1], "data": [True]},
        {"name": "b", "datatype": "FP64", "shape": [1],
         "parameters": {"binary_data_size": len(second)}},
    ]}
    arrays = parse_request(*body_of(doc, first + second)).decode_inputs()
    assert arrays["a"].tolist() == [0, 1, 2]
    assert arrays["j"].tolist() == [True]
    assert arrays["b"].tolist() == [0.5]


def test_empty_tensors_decode() -> None:
    doc = one_input(shape=[0, 4], data=[])
    assert parse_request(*body_of(doc)).decode_inputs()["x"].shape == (0, 4)


def test_decoded_binary_arrays_are_writable_copies() -> None:
    body, header_length = encode_request({"x": np.zeros(4, np.float32)}, binary=True)
    array = parse_request(body, header_length).decode_inputs()["x"]
    array[0] = 1.0  # a handler may work in place
    assert array[0] == 1.0


def test_request_fields_are_kept() -> None:
    doc = {"id": "abc", "parameters": {"binary_data_output": True, "custom": 3},
           **one_input(), "outputs": [{"name": "y", "parameters": {"binary_data": False}},
                                      {"name": "z"}]}
    request = parse_request(*body_of(doc))
    assert request.id == "abc" and request.parameters["custom"] == 3
    assert request.output_is_binary("y") is False
    assert request.output_is_binary("z") is True  # the request's default
    assert [o.name for o in request.outputs or ()] == ["y", "z"]


def test_the_model_named_in_the_body_is_ignored() -> None:  # the KServe SDK sends it
    doc = {"model_name": "other", "model_version": "9", **one_input()}
    assert parse_request(*body_of(doc)).decode_inputs()["x"].tolist() == [1.0, 2.0]


def test_outputs_are_json_unless_asked() -> None:
    request = parse_request(*body_of(one_input()))
    assert request.outputs is None and request.output_is_binary("anything") is False


def test_output_parameters_are_echoed_beside_binary_size() -> None:
    out = OutputTensor("y", np.ones(2, np.float32), "FP32", True, {"note": "hi"})
    body, header_length = encode_response("m", "1", [out])
    doc, _ = decode_response(body, header_length)
    assert doc["outputs"][0]["parameters"] == {"note": "hi", "binary_data_size": 8}


# --- malformed bodies ----------------------------------------------------------------

@pytest.mark.parametrize(("value", "match"), [
    ("abc", "whole number"), ("-1", "whole number"), ("1.5", "whole number"), ("", "whole"),
])
def test_bad_header_length_values(value: str, match: str) -> None:
    with pytest.raises(RequestRejected, match=match):
        parse_header_length(value)


def test_header_length_past_the_body() -> None:
    body, _ = body_of(one_input())
    rejected(body, len(body) + 1, "cannot be that long")


def test_header_length_cutting_the_json() -> None:
    body, _ = body_of(one_input())
    rejected(body, len(body) - 3, "not valid JSON")


@pytest.mark.parametrize(("body", "match"), [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe{}", "not UTF-8|not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b"[" * 100000, "nested too deeply|not valid JSON"),
    (b"{}", "'inputs' must be a non-empty list"),
    (b'{"inputs": []}', "'inputs' must be a non-empty list"),
    (b'{"inputs": {"name": "x"}}', "'inputs' must be a non-empty list"),
    (b'{"inputs": [3]}', r"inputs\[0\] must be an object"),
    (b'{"inputs": [{"datatype": "FP32", "shape": [1], "data": [1]}]}', "'name'"),
    (b'{"inputs": [{"name": "", "datatype": "FP32", "shape": [1], "data": [1]}]}', "'name'"),
    (b'{"inputs": [], "extra": 1}', r"unknown field\(s\) \['extra'\]"),
    (b'{"id": 5, "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}',
     "'id' must be a string"),
    (b'{"parameters": [], "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], '
     b'"data": [1]}]}', "'parameters' must be an object"),
])
def test_malformed_request_documents(body: bytes, match: str) -> None:
    rejected(body, None, match)


@pytest.mark.parametrize(("fields", "match"), [
    ({"datatype": "FLOAT32"}, "'datatype' must be one of"),
    ({"datatype": None}, "'datatype' must be one of"),
    ({"shape": [-1]}, "non-negative integers"),
    ({"shape": [2.0]}, "non-negative integers"),
    ({"shape": [True, 2]}, "non-negative integers"),
    ({"shape": "2"}, "non-negative integers"),
    ({"shape": None}, "non-negative integers"),
    ({"data": None}, "neither 'data' nor"),
    ({"parameters": "x"}, "'parameters' must be an object"),
    ({"contents": [1]}, "unknown field"),
])
def test_malformed_inputs(fields: dict[str, Any], match: str) -> None:
    doc = one_input(**fields)
    if fields.get("datatype", "") is None:
        doc["inputs"][0].pop("datatype", None)
    rejected(json.dumps(doc).encode(), None, match)


def test_duplicate_input_names() -> None:
    doc = one_input()
    doc["inputs"].append(dict(doc["inputs"][0]))
    rejected(json.dumps(doc).encode(), None, "appears twice")


@pytest.mark.parametrize(("outputs", "match"), [
    ({"name": "y"}, "'outputs' must be a list"),
    ([{"parameters": {}}], "non-empty 'name'"),
    (["y"], "non-empty 'name'"),
    ([{"name": "y", "parameters": {"binary_data": "yes"}}], "'binary_data' must be true"),
    ([{"name": "y", "shape": [1]}], "unknown field"),
    ([{"name": "y"}, {"name": "y"}], "appears twice"),
])
def test_malformed_requested_outputs(outputs: Any, match: str) -> None:
    rejected(json.dumps({**one_input(), "outputs": outputs}).encode(), None, match)


def test_binary_data_output_must_be_a_boolean() -> None:
    doc = {**one_input(), "parameters": {"binary_data_output": 1}}
    rejected(json.dumps(doc).encode(), None, "'binary_data_output' must be true or false")


def binary_doc(size: Any, datatype: str = "FP32", shape: list[int] | None = None
               ) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": datatype, "shape": shape or [2],
                        "parameters": {"binary_data_size": size}}]}


@pytest.mark.parametrize("size", [-1, True, 1.5, "8"])
def test_bad_binary_data_size(size: Any) -> None:
    header = json.dumps(binary_doc(size)).encode()
    rejected(header + b"\0" * 8, len(header), "'binary_data_size' must be a non-negative")


def test_binary_input_without_a_binary_part() -> None:
    rejected(json.dumps(binary_doc(8)).encode(), None, "no binary part")


def test_data_and_binary_size_together() -> None:
    doc = binary_doc(8)
    doc["inputs"][0]["data"] = [1.0, 2.0]
    header = json.dumps(doc).encode()
    rejected(header + b"\0" * 8, len(header), "both 'data' and 'binary_data_size'")


def test_truncated_binary_body() -> None:
    header = json.dumps(binary_doc(8)).encode()
    rejected(header + b"\0" * 7, len(header), "truncated")


def test_bytes_after_the_binary_inputs() -> None:
    header = json.dumps(binary_doc(8)).encode()
    rejected(header + b"\0" * 9, len(header), "1 bytes follow the binary inputs")


def test_binary_size_disagreeing_with_the_shape() -> None:
    header = json.dumps(binary_doc(4)).encode()  # FP32 [2] is 8 bytes
    rejected(header + b"\0" * 4, len(header), "takes 8 bytes, binary_data_size is 4")


def test_binary_bool_bytes_are_zero_or_one() -> None:
    header = json.dumps(binary_doc(2, "BOOL")).encode()
    rejected(header + b"\x01\x02", len(header), "BOOL element is a byte 0 or 1")


def test_a_huge_bytes_shape_is_refused_before_allocating() -> None:
    header = json.dumps(binary_doc(8, "BYTES", [10**15])).encode()
    rejected(header + b"\0" * 8, len(header), "need at least 4000000000000000 bytes")


def test_too_many_dimensions() -> None:
    rejected(json.dumps(one_input(shape=[1] * 33, data=[1.0])).encode(), None,
             "33 dimensions; at most 32")


@pytest.mark.parametrize(("payload", "match"), [
    (struct.pack("<I", 2) + b"ab" + b"\0\0", "element 1 of 2 has no 4-byte length prefix"),
    (struct.pack("<I", 5) + b"abcd", "says it has 5 bytes but only 4 remain"),
    (struct.pack("<I", 1) + b"a" + struct.pack("<I", 0) + b"zz", "2 bytes remain"),
    (struct.pack("<I", 1) + b"a", "2 BYTES elements need at least 8 bytes"),
])
def test_malformed_binary_bytes(payload: bytes, match: str) -> None:
    header = json.dumps(binary_doc(len(payload), "BYTES")).encode()
    rejected(header + payload, len(header), match)


@pytest.mark.parametrize(("fields", "match"), [
    ({"shape": [3]}, "shape \\[3\\] has 3 elements, 'data' has 2"),
    ({"data": [1.0]}, "has 2 elements, 'data' has 1"),
    ({"data": 1.0}, "'data' must be a list"),
    ({"shape": [2, 2], "data": [[1.0, 2.0], [3.0]]}, "does not match shape"),
    ({"shape": [2, 2], "data": [[1.0, 2.0, 3.0], [4.0]]}, "does not match shape"),
    ({"shape": [2], "data": [[1.0], [2.0]]}, "nested deeper than its shape"),
    ({"shape": [1, 2], "data": [[[1.0, 2.0]]]}, "does not match shape"),
    ({"data": [1.0, True]}, "FP32 elements in JSON are numbers, element 1 is 'True' \\(bool\\)"),
    ({"data": [1.0, "2"]}, "element 1 is '2' \\(str\\)"),
    ({"data": [1.0, None]}, "FP32 elements in JSON are numbers"),
    ({"datatype": "INT32", "data": [1, 2.5]},
     "INT32 elements in JSON are integers, element 1 is '2.5'"),
    ({"datatype": "INT32", "data": [1, False]}, "INT32 elements in JSON are integers"),
    ({"datatype": "INT8", "data": [1, 128]}, "128 is out of the range of INT8"),
    ({"datatype": "UINT8", "data": [-1, 0]}, "-1 is out of the range of UINT8"),
    ({"datatype": "UINT64", "data": [0, 2**64]}, "out of the range of UINT64"),
    ({"datatype": "FP16", "data": [1.0, 70000.0]}, "70000 is out of the range of FP16"),
    ({"datatype": "FP32", "data": [1.0, 1e300]}, "1e\\+300 is out of the range of FP32"),
    ({"datatype": "FP64", "data": [1.0, 10**400]}, "a number is out of the range of FP64"),
    ({"datatype": "FP32", "data": [1.0, 10**400]}, "a number is out of the range of FP32"),
    ({"datatype": "BOOL", "data": [True, 1]},
     "BOOL elements in JSON are true or false, element 1 is '1' \\(int\\)"),
    ({"datatype": "BYTES", "data": ["a", 1]}, "BYTES elements in JSON are strings"),
    ({"datatype": "BYTES", "data": ["a", "\ud800"]}, "not valid Unicode text"),
    ({"data": [1.0, [2.0]]}, "element 1 is '\\[2.0\\]' \\(list\\)"),
    ({"datatype": "BYTES", "data": ["a", ["b"]]}, "element 1 is .* \\(list\\)"),
])
def test_malformed_json_data(fields: dict[str, Any], match: str) -> None:
    rejected(json.dumps(one_input(**fields)).encode(), None, match)


def test_decode_tensor_of_a_binary_input_needs_its_bytes() -> None:
    with pytest.raises(RequestRejected, match="binary data is missing"):
        decode_tensor(TensorHeader("x", "FP32", (1,), {}, None, 4))


# --- outputs -------------------------------------------------------------------------

def test_outputs_cast_within_a_kind() -> None:
    assert as_output_array(np.array([1.5], np.float64), "FP32", "y").dtype == np.float32
    assert as_output_array([1, 2], "INT8", "y").dtype == np.int8
    assert as_output_array([True], "INT32", "y").tolist() == [1]
    assert as_output_array(["é", b"x"], "BYTES", "y").tolist() == ["é".encode(), b"x"]
    assert as_output_array([], "INT32", "y").dtype == np.int32  # [] is float64 to numpy


@pytest.mark.parametrize(("value", "datatype", "match"), [
    (np.array([1.5]), "INT64", "do not cast"),
    (np.array([1.0]), "BOOL", "do not cast"),
    (np.array(["a"]), "FP32", "holds <U1 values"),
    ([1, 2], "BYTES", "element 0 is int"),
])
def test_outputs_that_do_not_fit_their_datatype(value: Any, datatype: str, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        as_output_array(value, datatype, "y")


def test_non_utf8_bytes_output_must_be_asked_for_in_binary() -> None:
    out = OutputTensor("y", np.array([b"\xff"], dtype=object), "BYTES", binary=False)
    with pytest.raises(RequestRejected, match="binary_data = true"):
        encode_response("m", "1", [out])
    body, header_length = encode_response("m", "1", [OutputTensor(
        "y", out.array, "BYTES", binary=True)])
    assert decode_response(body, header_length)[1]["y"].tolist() == [b"\xff"]


def test_json_response_has_no_header_length() -> None:
    body, header_length = encode_response(
        "m", "1", [OutputTensor("y", np.ones(1, np.float32), "FP32")])
    assert header_length is None and json.loads(body)["outputs"][0]["data"] == [1.0]


def test_nan_and_infinity_outputs_survive_json() -> None:
    body, _ = encode_response("m", "1", [OutputTensor(
        "y", np.array([np.nan, np.inf], np.float32), "FP32")])
    _, arrays = decode_response(body)
    assert np.isnan(arrays["y"][0]) and np.isinf(arrays["y"][1])


# --- datatypes, signature, transport -------------------------------------------------

def test_datatype_of_numpy_arrays() -> None:
    assert datatype_of(np.zeros(1, np.float16)) == "FP16"
    assert datatype_of(np.zeros(1, ">u2")) == "UINT16"
    assert datatype_of(np.array(["a"])) == "BYTES"
    assert datatype_of(np.array([b"a"])) == "BYTES"
    assert element_size("FP64") == 8 and element_size("BYTES") is None
    with pytest.raises(TypeError, match="complex128"):
        datatype_of(np.zeros(1, np.complex128))


class Spec:
    def __init__(self, name: str, datatype: str, shape: tuple[int, ...]) -> None:
        self.name, self.datatype, self.shape = name, datatype, shape


INPUTS = [Spec("x", "FP32", (-1, 2)), Spec("s", "BYTES", (1,))]
OUTPUTS = [Spec("y", "INT64", (-1,))]


def signed_request(**overrides: Any) -> dict[str, Any]:
    tensors = {"x": {"name": "x", "datatype": "FP32", "shape": [3, 2], "data": [0.0] * 6},
               "s": {"name": "s", "datatype": "BYTES", "shape": [1], "data": ["a"]}}
    for name, fields in overrides.items():
        if fields is None:
            tensors.pop(name)
        else:
            tensors[name] = {**tensors.get(name, {"name": name}), **fields}
    return {"inputs": list(tensors.values())}


@pytest.mark.parametrize(("overrides", "match"), [
    ({"z": {"datatype": "FP32", "shape": [1], "data": [1.0]}}, r"no input\(s\) \['z'\]"),
    ({"s": None}, r"needs input\(s\) \['s'\]"),
    ({"x": {"datatype": "FP64"}}, "'x' of model 'm' is FP32, got FP64"),
    ({"x": {"shape": [6], "data": [0.0] * 6}}, r"has shape \[-1, 2\] \(-1: any size\), got \[6\]"),
    ({"x": {"shape": [2, 3]}}, "got \\[2, 3\\]"),
    ({"s": {"shape": [2], "data": ["a", "b"]}}, "got \\[2\\]"),
])
def test_requests_that_do_not_fit_the_signature(overrides: dict[str, Any], match: str) -> None:
    request = parse_request(json.dumps(signed_request(**overrides)).encode())
    with pytest.raises(RequestRejected, match=match):
        check_request(request, INPUTS, OUTPUTS, "m")


def test_a_request_fitting_the_signature_passes() -> None:
    doc = {**signed_request(), "outputs": [{"name": "y"}]}
    check_request(parse_request(json.dumps(doc).encode()), INPUTS, OUTPUTS, "m")


def test_an_unknown_requested_output_is_refused() -> None:
    doc = {**signed_request(), "outputs": [{"name": "q"}]}
    with pytest.raises(RequestRejected, match="no output 'q'"):
        check_request(parse_request(json.dumps(doc).encode()), INPUTS, OUTPUTS, "m")


def test_shape_fits() -> None:
    assert shape_fits((5, 2), (-1, 2)) and shape_fits((), ())
    assert not shape_fits((5,), (-1, 2)) and not shape_fits((5, 3), (-1, 2))


def test_binary_answer_framing_travels_as_a_field_of_the_reply() -> None:
    binary = Reply("r", "ok", b"{}", "application/octet-stream", header_length=42)
    assert decode_reply(encode_reply(binary)).header_length == 42
    assert decode_reply(encode_reply(Reply("r", "ok", b"{}"))).header_length is None
    # A frame from an older sender (no such field) and from a newer one (a field this
    # version lacks) both decode.
    older = msgpack.packb({k: v for k, v in vars(binary).items() if k != "header_length"})
    assert decode_reply(older) == Reply("r", "ok", b"{}", "application/octet-stream")
    newer = msgpack.packb({**vars(binary), "added_later": 1})
    assert decode_reply(newer) == binary
