"""The calls of Triton's example clients (triton-inference-server/client,
``src/python/examples/``), made as they make them, with tritonclient, against
``modelfleet serve`` on the stand-ins of the models they expect
(``tests/fixtures/triton``, see its README), over HTTP and gRPC, asserting what the
examples assert:

- simple_http/grpc_infer_client, ..._async_..., ..._aio_...: ``simple``'s sum and
  difference, inputs in JSON and binary;
- simple_http/grpc_string_infer_client: ``simple_string`` (decimal BYTES) and
  ``simple_identity`` (BYTES in binary and JSON);
- simple_http/grpc_sequence_sync_infer_client: three sequences (two by number, one by
  a UUID string) on ``simple_sequence``, the results the example expects;
- image_client (``-m densenet_onnx -c 3``): the model's metadata and configuration
  parsed as the example parses them (one NCHW image input of 3 dims, a vector output),
  the image preprocessed the same way, the top 3 classes by name;
- ensemble_image_client (``-c 3``): images as BYTES rows, the top 3 of each;
- memory_growth_test: ``custom_identity_int32`` gives its input back, a fresh client a
  call.

and beyond them that a stand-in refuses what it cannot answer (400 / INVALID_ARGUMENT).
tritonclient.grpc runs in a process of its own (tests/clients/triton_grpc.py
``--examples``: it and kserve collide in one protobuf pool). The model-control examples
are tests/e2e/test_triton_model_control.py's.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton
from PIL import Image
from tritonclient.utils import InferenceServerException

from tests.procs import ROOT, free_port, serve

REPOSITORY = ROOT / "tests" / "fixtures" / "triton"
SEQUENCE_VALUES = [11, 7, 5, 3, 2, 0, 1]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(HTTP host:port, gRPC host:port) of one ``modelfleet serve`` on the stand-ins."""
    tmp = tmp_path_factory.mktemp("triton-examples")
    port = free_port()
    proc, base = serve(tmp, repo=REPOSITORY, env={"MODELFLEET_GATEWAY__GRPC_PORT": str(port)})
    try:
        yield base.removeprefix("http://"), f"127.0.0.1:{port}"
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def http(served: tuple[str, str]) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(url=served[0], network_timeout=120)


def png(rgb: tuple[int, int, int], size: tuple[int, int] = (300, 200)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, rgb).save(out, format="PNG")
    return out.getvalue()


def jpeg(rgb: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 64), rgb).save(out, format="JPEG")
    return out.getvalue()


def test_simple_infer_client(http: triton.InferenceServerClient) -> None:
    in0 = np.arange(16, dtype=np.int32).reshape(1, 16)
    in1 = np.ones((1, 16), dtype=np.int32)
    inputs = [triton.InferInput("INPUT0", [1, 16], "INT32"),
              triton.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(in0, binary_data=False)
    inputs[1].set_data_from_numpy(in1, binary_data=True)
    outputs = [triton.InferRequestedOutput("OUTPUT0", binary_data=True),
               triton.InferRequestedOutput("OUTPUT1", binary_data=False)]
    result = http.infer("simple", inputs, outputs=outputs, query_params={"test_1": 1})
    assert np.array_equal(result.as_numpy("OUTPUT0"), in0 + in1)
    assert np.array_equal(result.as_numpy("OUTPUT1"), in0 - in1)
    # The async example: the same, in flight together.
    pending = [http.async_infer("simple", inputs) for _ in range(3)]
    for request in pending:
        assert np.array_equal(request.get_result().as_numpy("OUTPUT0"), in0 + in1)
    with pytest.raises(InferenceServerException) as info:  # the example's last call
        http.infer("wrong_model_name", inputs)
    assert "Request for unknown model" in info.value.message()


def test_string_infer_client(http: triton.InferenceServerClient) -> None:
    in0 = np.arange(16, dtype=np.int32).reshape(1, 16)
    in1 = np.ones((1, 16), dtype=np.int32)
    words = [np.array([str(x).encode() for x in a.flatten()], dtype=np.object_).reshape(1, 16)
             for a in (in0, in1)]
    inputs = [triton.InferInput("INPUT0", [1, 16], "BYTES"),
              triton.InferInput("INPUT1", [1, 16], "BYTES")]
    inputs[0].set_data_from_numpy(words[0], binary_data=True)
    inputs[1].set_data_from_numpy(words[1], binary_data=False)
    result = http.infer("simple_string", inputs)
    assert [int(v) for v in result.as_numpy("OUTPUT0").flatten()] == list(range(1, 17))
    assert [int(v) for v in result.as_numpy("OUTPUT1").flatten()] == list(range(-1, 15))
    # simple_identity, as the example sends it: binary, then JSON.
    for binary in (True, False):
        tensor = triton.InferInput("INPUT0", [1, 16], "BYTES")
        tensor.set_data_from_numpy(words[0], binary_data=binary)
        wanted = triton.InferRequestedOutput("OUTPUT0", binary_data=binary)
        echoed = http.infer("simple_identity", [tensor], outputs=[wanted])
        # In JSON tritonclient gives str, as the example expects (it encodes them).
        got = [v if isinstance(v, bytes) else str(v).encode()
               for v in echoed.as_numpy("OUTPUT0").flatten()]
        assert got == list(words[0].flatten())


def test_a_string_that_is_no_number_is_a_400(http: triton.InferenceServerClient) -> None:
    inputs = [triton.InferInput(name, [1, 16], "BYTES") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.array([[b"x"] * 16], dtype=np.object_))
    with pytest.raises(InferenceServerException) as info:
        http.infer("simple_string", inputs)
    assert info.value.status() == "400"
    assert "INPUT0 must hold decimal numbers" in info.value.message()


def sequence(http: triton.InferenceServerClient, values: list[int],
             sequence_id: int | str) -> list[int]:
    """sync_send of the sequence example: one request per value, start and end marked."""
    results = []
    for count, value in enumerate(values, 1):
        tensor = triton.InferInput("INPUT", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.full((1, 1), value, dtype=np.int32))
        result = http.infer("simple_sequence", [tensor],
                            outputs=[triton.InferRequestedOutput("OUTPUT")],
                            sequence_id=sequence_id, sequence_start=count == 1,
                            sequence_end=count == len(values))
        results.append(int(result.as_numpy("OUTPUT")[0][0]))
    return results


def test_sequence_sync_infer_client(http: triton.InferenceServerClient) -> None:
    first = sequence(http, [0, *SEQUENCE_VALUES], 1000)
    second = sequence(http, [100] + [-v for v in SEQUENCE_VALUES], 1001)
    by_name = sequence(http, [20] + [-v for v in SEQUENCE_VALUES], str(uuid.uuid4()))
    assert first == [1, *SEQUENCE_VALUES]
    assert second == [101] + [-v for v in SEQUENCE_VALUES]
    assert by_name == [21] + [-v for v in SEQUENCE_VALUES]


def test_a_request_of_no_started_sequence_is_a_400(
        http: triton.InferenceServerClient) -> None:
    tensor = triton.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.ones((1, 1), dtype=np.int32))
    with pytest.raises(InferenceServerException) as info:
        http.infer("simple_sequence", [tensor], sequence_id=4242)
    assert info.value.status() == "400" and "sequence 4242 was not started" in \
        info.value.message()
    with pytest.raises(InferenceServerException) as info:
        http.infer("simple_sequence", [tensor])
    assert info.value.status() == "400" and "sequence_id" in info.value.message()


def parse_model(metadata: dict[str, Any], config: dict[str, Any]) -> tuple[Any, ...]:
    """image_client's parse_model, over HTTP's JSON: what it checks, what it takes."""
    assert len(metadata["inputs"]) == 1 and len(metadata["outputs"]) == 1
    assert len(config["input"]) == 1
    output = metadata["outputs"][0]
    assert output["datatype"] == "FP32"
    batched = config["max_batch_size"] > 0
    assert sum(1 for d in output["shape"][int(batched):] if d > 1) <= 1  # a vector
    tensor = metadata["inputs"][0]
    assert len(tensor["shape"]) == 3 + int(batched)
    layout = config["input"][0]["format"]
    assert layout in ("FORMAT_NCHW", "FORMAT_NHWC")
    dims = tensor["shape"][int(batched):]
    c, h, w = dims if layout == "FORMAT_NCHW" else (dims[2], dims[0], dims[1])
    return config["max_batch_size"], tensor["name"], output["name"], c, h, w, layout, \
        tensor["datatype"]


def preprocess(data: bytes, layout: str, c: int, h: int, w: int) -> np.ndarray:
    """image_client's preprocess with its default scaling (NONE)."""
    with Image.open(io.BytesIO(data)) as image:
        resized = np.array(image.convert("RGB" if c == 3 else "L").resize(
            (w, h), Image.BILINEAR)).astype(np.float32)
    return np.transpose(resized, (2, 0, 1)) if layout == "FORMAT_NCHW" else resized


def test_image_client_on_densenet_onnx(http: triton.InferenceServerClient) -> None:
    metadata = http.get_model_metadata("densenet_onnx")
    config = http.get_model_config("densenet_onnx")
    batch, input_name, output_name, c, h, w, layout, dtype = parse_model(metadata, config)
    assert (batch, input_name, output_name, c, h, w, layout, dtype) == (
        0, "data_0", "fc6_1", 3, 224, 224, "FORMAT_NCHW", "FP32")
    assert config["output"][0]["label_filename"] == "labels.txt"
    image = preprocess(png((200, 30, 40)), layout, c, h, w)
    tensor = triton.InferInput(input_name, list(image.shape), dtype)
    tensor.set_data_from_numpy(image)
    result = http.infer("densenet_onnx", [tensor], outputs=[
        triton.InferRequestedOutput(output_name, class_count=3)])
    top = [bytes(v).decode().split(":") for v in result.as_numpy(output_name)]
    assert len(top) == 3 and top[0][1:] == ["0", "red"]
    assert float(top[0][0]) > float(top[1][0]) > float(top[2][0])


def test_ensemble_image_client(http: triton.InferenceServerClient) -> None:
    metadata = http.get_model_metadata("preprocess_inception_ensemble")
    config = http.get_model_config("preprocess_inception_ensemble")
    assert len(metadata["inputs"]) == 1 and len(config["input"]) == 1
    assert config["max_batch_size"] >= 2
    images = np.stack([np.array([data], dtype=bytes)
                       for data in (jpeg((30, 60, 210)), png((200, 30, 40)))])
    tensor = triton.InferInput(metadata["inputs"][0]["name"], list(images.shape), "BYTES")
    tensor.set_data_from_numpy(images, binary_data=True)
    outputs = [triton.InferRequestedOutput(o["name"], binary_data=True, class_count=3)
               for o in metadata["outputs"]]
    result = http.infer("preprocess_inception_ensemble", [tensor], outputs=outputs)
    top = result.as_numpy(metadata["outputs"][0]["name"])
    assert top.shape == (2, 3)
    # The example decodes each class as "".join(chr(x) for x in value).split(":").
    assert [["".join(chr(x) for x in row[0]).split(":")[2]] for row in top] == \
        [["blue"], ["red"]]


def test_an_ensemble_row_that_is_no_image_is_a_400(
        http: triton.InferenceServerClient) -> None:
    tensor = triton.InferInput("INPUT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[b"not an image"]], dtype=np.object_))
    with pytest.raises(InferenceServerException) as info:
        http.infer("preprocess_inception_ensemble", [tensor])
    assert info.value.status() == "400" and "PNG or JPEG" in info.value.message()


def test_memory_growth_test(served: tuple[str, str]) -> None:
    rows = np.arange(16, dtype=np.int32).reshape(1, 16)
    for _ in range(5):  # a fresh client each time, as the example's loop
        client = triton.InferenceServerClient(url=served[0], network_timeout=120)
        tensor = triton.InferInput("INPUT0", [1, 16], "INT32")
        tensor.set_data_from_numpy(rows)
        out = client.infer("custom_identity_int32", [tensor], outputs=[
            triton.InferRequestedOutput("OUTPUT0")]).as_numpy("OUTPUT0")
        assert out.dtype == rows.dtype and np.array_equal(out, rows)
        client.close()


def test_the_examples_calls_over_grpc(served: tuple[str, str], tmp_path: Path) -> None:
    """The gRPC counterparts of the examples above, with tritonclient.grpc."""
    image = tmp_path / "red.png"
    image.write_bytes(png((200, 30, 40)))
    blue = tmp_path / "blue.jpg"
    blue.write_bytes(jpeg((30, 60, 210)))
    args = [sys.executable, "-m", "tests.clients.triton_grpc", "--examples", served[1],
            str(blue), str(image)]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["simple"] == [True, True]
    assert seen["async"] == [True, True, True]
    assert seen["unknown_model"][0] == "StatusCode.NOT_FOUND"
    assert seen["string"] == [list(range(1, 17)), list(range(-1, 15))]
    assert seen["identity"] is True
    assert seen["sequences"] == [[1, *SEQUENCE_VALUES],
                                 [101] + [-v for v in SEQUENCE_VALUES],
                                 [21] + [-v for v in SEQUENCE_VALUES]]
    assert seen["image_model"] == [0, "data_0", "fc6_1", [3, 224, 224], "FORMAT_NCHW"]
    assert [row[1:] for row in seen["image_top"]] == [["0", "red"], ["11", "brown"],
                                                      ["1", "orange"]]
    assert seen["ensemble_top"] == ["blue", "red"]
    assert seen["identity_int32"] is True
    assert seen["not_started"][0] == "StatusCode.INVALID_ARGUMENT"
