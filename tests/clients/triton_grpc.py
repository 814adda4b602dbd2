"""What Triton's gRPC examples do, with tritonclient.grpc, against one address; prints one
JSON line of what it saw (run by tests/e2e/test_grpc.py and test_triton_model_control.py
in a process of its own).

    python -m tests.clients.triton_grpc HOST:PORT [API_KEY]
    python -m tests.clients.triton_grpc --model-control HOST:PORT
    python -m tests.clients.triton_grpc --examples HOST:PORT BLUE_JPEG RED_PNG
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from PIL import Image
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException


def refused(call: Any) -> list[str]:
    """[status, message] of the InferenceServerException a call raises."""
    try:
        call()
    except InferenceServerException as exc:
        return [str(exc.status()), str(exc.message())]
    return ["no error", ""]


def main(url: str, key: str | None) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {key}"} if key else None
    client = grpcclient.InferenceServerClient(url=url)
    seen: dict[str, Any] = {"live": client.is_server_live(headers=headers),
                            "ready": client.is_server_ready(headers=headers)}
    meta = client.get_server_metadata(headers=headers, as_json=True)
    seen["server"] = [meta["name"], sorted(meta["extensions"])]
    model = client.get_model_metadata("simple", headers=headers, as_json=True)
    seen["model_inputs"] = [(t["name"], t["datatype"], t["shape"]) for t in model["inputs"]]
    seen["model_ready"] = client.is_model_ready("simple", headers=headers)
    # simple_grpc_infer_client: INPUT0 = 0..15, INPUT1 = ones.
    in0 = np.arange(16, dtype=np.int32).reshape(1, 16)
    in1 = np.ones((1, 16), dtype=np.int32)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
              grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(in0)
    inputs[1].set_data_from_numpy(in1)
    outputs = [grpcclient.InferRequestedOutput("OUTPUT0"),
               grpcclient.InferRequestedOutput("OUTPUT1")]
    result = client.infer("simple", inputs, outputs=outputs, headers=headers,
                          client_timeout=60)
    seen["sum_ok"] = bool(np.array_equal(result.as_numpy("OUTPUT0"), in0 + in1))
    seen["difference_ok"] = bool(np.array_equal(result.as_numpy("OUTPUT1"), in0 - in1))
    # simple_grpc_string_infer_client's shape: BYTES in, BYTES out.
    words = np.array([b"hello", "\u00e9t\u00e9".encode(), b""], dtype=object)
    text = grpcclient.InferInput("text", [3], "BYTES")
    text.set_data_from_numpy(words)
    echoed = client.infer("words", [text], headers=headers, client_timeout=60)
    seen["upper"] = [v.decode() for v in echoed.as_numpy("upper").tolist()]
    seen["length"] = echoed.as_numpy("length").tolist()
    stats = client.get_inference_statistics("simple", headers=headers, as_json=True)
    one = stats["model_stats"][0]
    seen["stats"] = [one["name"], one["version"], int(one.get("inference_count", 0)),
                     int(one["inference_stats"]["success"].get("count", 0))]
    config = client.get_model_config("simple", headers=headers, as_json=True)["config"]
    seen["config"] = [config["name"], int(config.get("max_batch_size", 0)),
                      [i["name"] for i in config["input"]]]
    index = client.get_model_repository_index(headers=headers, as_json=True)
    seen["index"] = sorted(m["name"] for m in index.get("models", []))
    client.load_model("simple", headers=headers)
    seen["load_bad_config"] = refused(lambda: client.load_model(
        "simple", config=json.dumps({"max_batch_size": 9}), headers=headers))
    seen["missing"] = refused(lambda: client.get_model_metadata("nope", headers=headers))
    seen["bad_input"] = refused(lambda: client.infer(
        "simple", inputs[:1], headers=headers, client_timeout=60))
    return seen


# A package published by a gRPC load's files (bytes_param), Triton's file:1/ layout.
PUBLISHED_MANIFEST = b"""name = "published"
entrypoint = "handler:Doubler"
[[inputs]]
name = "INPUT0"
datatype = "INT32"
shape = [-1, 16]
[[outputs]]
name = "OUTPUT0"
datatype = "INT32"
shape = [-1, 16]
"""
PUBLISHED_HANDLER = b"""from modelfleet import Model

class Doubler(Model):
    def predict(self, batch):
        return [{"OUTPUT0": t["INPUT0"] * 2} for t in batch]
"""


def model_control(url: str) -> dict[str, Any]:
    """The calls of simple_grpc_model_control.py, in its order."""
    client = grpcclient.InferenceServerClient(url=url)
    seen: dict[str, Any] = {"index": len(client.get_model_repository_index().models)}
    client.load_model("simple")
    seen["ready_after_load"] = client.is_model_ready("simple")
    seen["wrong_format"] = refused(lambda: client.load_model(
        "simple", config='"parameters": {"config": {{"max_batch_size": "16"}}}'))
    client.load_model("simple", config='{"max_batch_size":"16"}')
    seen["max_batch_size"] = client.get_model_config("simple").config.max_batch_size
    client.unload_model("simple")
    seen["ready_after_unload"] = client.is_model_ready("simple")
    seen["files"] = refused(lambda: client.load_model(
        "simple", config="{}", files={"file:" + "A" * 256: b"a"}))
    seen["live_after_files"] = client.is_server_live()
    seen["wrong_model"] = refused(lambda: client.load_model("wrong_model_name"))
    # Beyond the example: files that make a package publish it, and it serves.
    client.load_model("published", files={"file:1/model.toml": PUBLISHED_MANIFEST,
                                          "file:1/handler.py": PUBLISHED_HANDLER})
    rows = np.arange(16, dtype=np.int32).reshape(1, 16)
    tensor = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
    tensor.set_data_from_numpy(rows)
    doubled = client.infer("published", [tensor], client_timeout=60).as_numpy("OUTPUT0")
    seen["published"] = [client.is_model_ready("published"),
                         bool(np.array_equal(doubled, rows * 2))]
    seen["no_manifest"] = refused(lambda: client.load_model(
        "published", files={"file:1/handler.py": PUBLISHED_HANDLER}))
    return seen


def _sequence(client: grpcclient.InferenceServerClient, values: list[int],
              sequence_id: int | str) -> list[int]:
    results = []
    for count, value in enumerate(values, 1):
        tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.full((1, 1), value, dtype=np.int32))
        result = client.infer("simple_sequence", [tensor], sequence_id=sequence_id,
                              sequence_start=count == 1, sequence_end=count == len(values),
                              outputs=[grpcclient.InferRequestedOutput("OUTPUT")])
        results.append(int(result.as_numpy("OUTPUT")[0][0]))
    return results


def examples(url: str, blue: str, red: str) -> dict[str, Any]:
    """The calls of Triton's gRPC example clients on tests/fixtures/triton's stand-ins
    (tests/e2e/test_triton_examples.py asserts what they saw)."""
    client = grpcclient.InferenceServerClient(url=url)
    seen: dict[str, Any] = {}
    # simple_grpc_infer_client, ..._async_infer_client
    in0 = np.arange(16, dtype=np.int32).reshape(1, 16)
    in1 = np.ones((1, 16), dtype=np.int32)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
              grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(in0)
    inputs[1].set_data_from_numpy(in1)
    result = client.infer("simple", inputs, client_timeout=60)
    seen["simple"] = [bool(np.array_equal(result.as_numpy("OUTPUT0"), in0 + in1)),
                      bool(np.array_equal(result.as_numpy("OUTPUT1"), in0 - in1))]
    done: list[Any] = []
    for _ in range(3):
        client.async_infer("simple", inputs, lambda result, error: done.append((result, error)))
    waited = 0
    while len(done) < 3 and waited < 6000:
        time.sleep(0.01)
        waited += 1
    seen["async"] = [e is None and bool(np.array_equal(r.as_numpy("OUTPUT0"), in0 + in1))
                     for r, e in done]
    seen["unknown_model"] = refused(lambda: client.infer("wrong_model_name", inputs))
    # simple_grpc_string_infer_client
    words = [np.array([str(x).encode() for x in a.flatten()], dtype=np.object_).reshape(1, 16)
             for a in (in0, in1)]
    strings = [grpcclient.InferInput("INPUT0", [1, 16], "BYTES"),
               grpcclient.InferInput("INPUT1", [1, 16], "BYTES")]
    for tensor, data in zip(strings, words, strict=True):
        tensor.set_data_from_numpy(data)
    result = client.infer("simple_string", strings, client_timeout=60)
    seen["string"] = [[int(v) for v in result.as_numpy(name).flatten()]
                      for name in ("OUTPUT0", "OUTPUT1")]
    identity = grpcclient.InferInput("INPUT0", [1, 16], "BYTES")
    identity.set_data_from_numpy(words[0])
    echoed = client.infer("simple_identity", [identity]).as_numpy("OUTPUT0")
    seen["identity"] = [bytes(v) for v in echoed.flatten()] == list(words[0].flatten())
    # simple_grpc_sequence_sync_infer_client
    values = [11, 7, 5, 3, 2, 0, 1]
    seen["sequences"] = [_sequence(client, [0, *values], 1000),
                         _sequence(client, [100] + [-v for v in values], 1001),
                         _sequence(client, [20] + [-v for v in values], str(uuid.uuid4()))]
    lone = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    lone.set_data_from_numpy(np.ones((1, 1), dtype=np.int32))
    seen["not_started"] = refused(lambda: client.infer("simple_sequence", [lone],
                                                       sequence_id=4242))
    # image_client -i grpc -m densenet_onnx -c 3: parse_model reads the protobufs.
    metadata = client.get_model_metadata("densenet_onnx")
    config = client.get_model_config("densenet_onnx").config
    seen["image_model"] = [config.max_batch_size, metadata.inputs[0].name,
                           metadata.outputs[0].name, list(metadata.inputs[0].shape),
                           mc.ModelInput.Format.Name(config.input[0].format)]
    with Image.open(red) as image:
        rgb = np.array(image.convert("RGB").resize((224, 224), Image.BILINEAR))
    pixels = np.transpose(rgb.astype(np.float32), (2, 0, 1))
    tensor = grpcclient.InferInput("data_0", list(pixels.shape), "FP32")
    tensor.set_data_from_numpy(pixels)
    result = client.infer("densenet_onnx", [tensor], outputs=[
        grpcclient.InferRequestedOutput("fc6_1", class_count=3)])
    seen["image_top"] = [bytes(v).decode().split(":") for v in result.as_numpy("fc6_1")]
    # ensemble_image_client -i grpc -c 3
    rows = []
    for path in (blue, red):
        with open(path, "rb") as f:
            rows.append(np.array([f.read()], dtype=bytes))
    images = np.stack(rows, axis=0)
    tensor = grpcclient.InferInput("INPUT", list(images.shape), "BYTES")
    tensor.set_data_from_numpy(images)
    result = client.infer("preprocess_inception_ensemble", [tensor], outputs=[
        grpcclient.InferRequestedOutput("OUTPUT", class_count=3)])
    seen["ensemble_top"] = ["".join(chr(x) for x in row[0]).split(":")[2]
                            for row in result.as_numpy("OUTPUT")]
    # memory_growth_test -i grpc: a fresh client per call.
    ok = True
    for _ in range(3):
        fresh = grpcclient.InferenceServerClient(url=url)
        tensor = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
        tensor.set_data_from_numpy(in0)
        out = fresh.infer("custom_identity_int32", [tensor]).as_numpy("OUTPUT0")
        ok = ok and out.dtype == in0.dtype and bool(np.array_equal(out, in0))
        fresh.close()
    seen["identity_int32"] = ok
    return seen


if __name__ == "__main__":
    if sys.argv[1] == "--model-control":
        print(json.dumps(model_control(sys.argv[2])))
    elif sys.argv[1] == "--examples":
        print(json.dumps(examples(*sys.argv[2:5])))
    else:
        print(json.dumps(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)))
