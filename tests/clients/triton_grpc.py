"""What Triton's gRPC examples do, with tritonclient.grpc, against one address; prints one
JSON line of what it saw (run by tests/e2e/test_grpc.py and test_triton_model_control.py
in a process of its own).

    python -m tests.clients.triton_grpc HOST:PORT [API_KEY]
    python -m tests.clients.triton_grpc --model-control HOST:PORT
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
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


if __name__ == "__main__":
    if sys.argv[1] == "--model-control":
        print(json.dumps(model_control(sys.argv[2])))
    else:
        print(json.dumps(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)))
