"""The protocol's extensions and error shape, spoken by tritonclient as Triton's own HTTP
examples speak it, against ``modelfleet serve``: a stand-in for Triton's ``simple``
model (INPUT0 + INPUT1 INT32 [1,16] -> OUTPUT0 sum, OUTPUT1 difference), statistics,
model configuration, classification with labels (the digits example), load with a
config, shared memory refused, and every /v2 error as ``{"error": "<message>"}``."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.procs import EXAMPLES, provision_key, serve, write_package

SIMPLE_MANIFEST = """\
    name = "simple"
    entrypoint = "handler:Simple"
    [[inputs]]
    name = "INPUT0"
    datatype = "INT32"
    shape = [1, 16]
    [[inputs]]
    name = "INPUT1"
    datatype = "INT32"
    shape = [1, 16]
    [[outputs]]
    name = "OUTPUT0"
    datatype = "INT32"
    shape = [1, 16]
    [[outputs]]
    name = "OUTPUT1"
    datatype = "INT32"
    shape = [1, 16]
    """
SIMPLE_HANDLER = """\
    from modelfleet import Model

    class Simple(Model):
        def predict(self, batch):
            return [{"OUTPUT0": t["INPUT0"] + t["INPUT1"], "OUTPUT1": t["INPUT0"] - t["INPUT1"]}
                    for t in batch]
    """


def repository(root: Path) -> Path:
    write_package(root, "simple", SIMPLE_MANIFEST, SIMPLE_HANDLER)
    shutil.copytree(EXAMPLES / "digits", root / "digits")
    return root


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("oip-ext")
    proc, base = serve(tmp, repo=repository(tmp / "repo"))
    try:
        yield base
    finally:
        proc.stop()


def client_of(base: str) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(url=base.removeprefix("http://"), network_timeout=120)


def simple_inputs() -> tuple[list[triton.InferInput], np.ndarray, np.ndarray]:
    """What simple_http_infer_client sends: 0..15 and all ones."""
    in0 = np.arange(16, dtype=np.int32).reshape(1, 16)
    in1 = np.ones((1, 16), dtype=np.int32)
    inputs = [triton.InferInput("INPUT0", [1, 16], "INT32"),
              triton.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(in0, binary_data=False)
    inputs[1].set_data_from_numpy(in1, binary_data=True)
    return inputs, in0, in1


def test_server_lists_exactly_the_extensions_it_serves(served: str) -> None:
    extensions = client_of(served).get_server_metadata()["extensions"]
    assert sorted(extensions) == ["binary_tensor_data", "classification",
                                  "model_configuration", "model_repository", "statistics"]


def test_simple_infer_then_its_statistics(served: str) -> None:
    client = client_of(served)
    inputs, in0, in1 = simple_inputs()
    outputs = [triton.InferRequestedOutput("OUTPUT0", binary_data=True),
               triton.InferRequestedOutput("OUTPUT1", binary_data=False)]
    for _ in range(3):
        result = client.infer("simple", inputs, outputs=outputs)
        assert np.array_equal(result.as_numpy("OUTPUT0"), in0 + in1)
        assert np.array_equal(result.as_numpy("OUTPUT1"), in0 - in1)
    stats = client.get_inference_statistics(model_name="simple")
    [one] = stats["model_stats"]  # the example checks there is exactly one
    assert one["name"] == "simple" and one["version"] == "1"
    assert one["inference_count"] >= 3 and one["execution_count"] >= 3
    assert one["inference_stats"]["success"]["count"] >= 3
    assert one["inference_stats"]["compute_infer"]["ns"] > 0
    assert one["last_inference"] > 0
    every = client.get_inference_statistics()
    assert "simple" in {s["name"] for s in every["model_stats"]}
    assert client.get_inference_statistics("simple", "1")["model_stats"][0]["version"] == "1"
    untouched = client.get_inference_statistics("digits")["model_stats"]
    assert [(s["version"], s["inference_count"]) for s in untouched] == [("1", 0)]
    with pytest.raises(InferenceServerException) as info:
        client.get_inference_statistics("nope")
    assert info.value.status() == "404" and "nope" in info.value.message()


def test_model_config_in_tritons_shape(served: str) -> None:
    config = client_of(served).get_model_config("digits")
    assert config["name"] == "digits" and config["max_batch_size"] == 16
    assert config["input"] == [{"name": "pixels", "data_type": "TYPE_FP32", "dims": [64],
                                "format": "FORMAT_NONE"}]
    assert config["output"][0]["label_filename"] == "labels.txt"
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    simple = client_of(served).get_model_config("simple", "1")
    assert simple["max_batch_size"] == 0 and simple["input"][0]["dims"] == [1, 16]


def test_classification_gives_the_top_digits_by_name(served: str) -> None:
    from sklearn.datasets import load_digits  # imported here: ~1.5 s of every collection

    digits = load_digits()
    rows = digits.data[:4].astype(np.float32)
    pixels = triton.InferInput("pixels", list(rows.shape), "FP32")
    pixels.set_data_from_numpy(rows)
    wanted = triton.InferRequestedOutput("probabilities", class_count=3)
    result = client_of(served).infer("digits", [pixels], outputs=[wanted])
    top = result.as_numpy("probabilities")
    assert top.shape == (4, 3)
    names = ["zero", "one", "two", "three"]
    for row, name in zip(top, names, strict=True):
        value, index, label = row[0].decode().split(":")
        assert label == name and int(index) == names.index(name) and float(value) > 0.5


def test_load_with_a_config(served: str) -> None:
    client = client_of(served)
    same = client.get_model_config("simple")
    client.load_model("simple", config=json.dumps(same))  # says what model.toml says
    assert client.is_model_ready("simple")
    with pytest.raises(InferenceServerException) as info:
        client.load_model("simple", config=json.dumps({**same, "max_batch_size": 8}))
    assert info.value.status() == "400"
    assert "max_batch_size" in info.value.message() and "model.toml" in info.value.message()


def test_shared_memory_is_refused_never_ignored(served: str) -> None:
    client = client_of(served)
    inputs, _, _ = simple_inputs()
    output = triton.InferRequestedOutput("OUTPUT0")
    output.set_shared_memory("output0_data", 64)
    with pytest.raises(InferenceServerException) as info:
        client.infer("simple", inputs, outputs=[output])
    assert info.value.status() == "400" and "shared memory" in info.value.message()
    shm_input = triton.InferInput("INPUT0", [1, 16], "INT32")
    shm_input.set_shared_memory("input0_data", 64)
    with pytest.raises(InferenceServerException) as info:
        client.infer("simple", [shm_input, inputs[1]])
    assert info.value.status() == "400" and "shared memory" in info.value.message()
    with pytest.raises(InferenceServerException) as info:  # the region APIs: not served
        client.get_system_shared_memory_status()
    assert info.value.status() == "404" and isinstance(info.value.message(), str)


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v2/nope", 404), ("GET", "/v2/systemsharedmemory/status", 404),
    ("POST", "/v2/health/live", 405), ("GET", "/v2/models/simple/infer", 405),
    ("DELETE", "/v2/repository/index", 405)])
def test_v2_paths_without_a_route_answer_in_the_protocols_shape(served: str, method: str,
                                                                path: str, status: int) -> None:
    answer = httpx.request(method, f"{served}{path}", timeout=10)
    assert answer.status_code == status
    assert set(answer.json()) == {"error"} and isinstance(answer.json()["error"], str)
    assert path in answer.json()["error"]


def test_v1_paths_keep_their_own_shape(served: str) -> None:
    answer = httpx.get(f"{served}/v1/nope", timeout=10)
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "not_found"


def test_auth_refusals_on_v2_are_in_the_protocols_shape(tmp_path: Path) -> None:
    db = tmp_path / "tenants.sqlite3"
    proc, base = serve(tmp_path, repo=repository(tmp_path / "repo"), name="auth",
                       env={"MODELFLEET_TENANCY__AUTH": "on", "MODELFLEET_TENANCY__DB": str(db),
                            "MODELFLEET_DLQ_DB": str(db)})
    try:
        unauthenticated = httpx.get(f"{base}/v2/models/simple/config", timeout=10)
        assert unauthenticated.status_code == 401
        assert isinstance(unauthenticated.json()["error"], str)
        caller = provision_key(str(db), role="caller", tenant="examples")
        forbidden = httpx.post(f"{base}/v2/repository/index", timeout=10,
                               headers={"Authorization": f"Bearer {caller}"})
        assert forbidden.status_code == 403 and isinstance(forbidden.json()["error"], str)
        v1 = httpx.get(f"{base}/v1/fleet", timeout=10)
        assert v1.status_code == 401 and v1.json()["error"]["code"] == "unauthenticated"
    finally:
        proc.stop()
