"""Open Inference Protocol v2 end to end, spoken by the real clients: tritonclient[http]
and the KServe SDK's InferenceRESTClient, against ``modelfleet serve`` and against a
gateway and a worker joined by a real RabbitMQ."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from modelfleet.oip.codec import decode_response, encode_request
from tests.conftest import own_deployment, rabbitmq_url, require_rabbitmq
from tests.procs import (
    EXAMPLES,
    ROOT,
    Proc,
    gateway,
    metric_sum,
    serve,
    worker,
    write_package,
)
from tests.waiting import eventually_blocking

MAX_BODY_BYTES = 4 * 1024 * 1024
PAYLOAD_STORE_BYTES = 3 * 1024 * 1024  # holds one 1.9 MB body, not a 3.5 MB one
ROWS = np.array([[5.1, 3.5, 1.4, 0.2], [7.0, 3.2, 4.7, 1.4], [6.3, 3.3, 6.0, 2.5]],
                np.float32)
CLASSES = [b"setosa", b"versicolor", b"virginica"]
TEXTS = np.array(["hello", "été", ""], dtype=object)


def repository(root: Path) -> Path:
    """iris (the example), words (BYTES in and out), nap (sleeps; a faulty answer on
    request), plain (no tensor signature)."""
    shutil.copytree(EXAMPLES / "iris", root / "iris")
    write_package(root, "words", """\
        name = "words"
        entrypoint = "handler:Words"
        [[inputs]]
        name = "text"
        datatype = "BYTES"
        shape = [-1]
        [[outputs]]
        name = "length"
        datatype = "INT32"
        shape = [-1]
        [[outputs]]
        name = "upper"
        datatype = "BYTES"
        shape = [-1]
        """, """\
        from modelfleet import Model

        class Words(Model):
            def predict(self, batch):
                return [{"length": [len(t) for t in item["text"]],
                         "upper": [t.upper() for t in item["text"]]} for item in batch]
        """)
    write_package(root, "nap", """\
        name = "nap"
        entrypoint = "handler:Nap"
        timeout_s = 30
        [[inputs]]
        name = "seconds"
        datatype = "FP32"
        shape = [1]
        [[outputs]]
        name = "slept"
        datatype = "FP32"
        shape = [1]
        """, """\
        import time
        from modelfleet import Model

        class Nap(Model):
            def predict(self, batch):
                out = []
                for item in batch:
                    seconds = float(item["seconds"][0])
                    if seconds < 0:  # a handler bug: text where FP32 is declared
                        out.append({"slept": ["oops"]})
                        continue
                    time.sleep(seconds)
                    out.append({"slept": item["seconds"]})
                return out
        """)
    write_package(root, "plain", """\
        name = "plain"
        entrypoint = "handler:Plain"
        """, """\
        from modelfleet import Model

        class Plain(Model):
            def predict(self, batch):
                return [{"size": len(body)} for body in batch]
        """)
    return root


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("oip-serve")
    proc, base = serve(tmp, repo=repository(tmp / "repo"),
                       env={"MODELFLEET_GATEWAY__MAX_BODY_BYTES": str(MAX_BODY_BYTES),
                            "MODELFLEET_GATEWAY__PAYLOAD_STORE_BYTES": str(PAYLOAD_STORE_BYTES),
                            "MODELFLEET_GATEWAY__BODY_READ_TIMEOUT_S": "2"})
    try:
        yield base
    finally:
        proc.stop()


def client_of(base: str) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(url=base.removeprefix("http://"),
                                        network_timeout=120.0)


def as_bytes(values: np.ndarray) -> list[bytes]:
    """BYTES elements as bytes (clients give JSON ones back as str, binary ones as bytes)."""
    return [v.encode() if isinstance(v, str) else bytes(v) for v in values.tolist()]


def triton_input(name: str, array: np.ndarray, datatype: str,
                 binary: bool = True) -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


# --- tritonclient against `modelfleet serve` -------------------------------------------

def test_health_and_metadata(served: str) -> None:
    client = client_of(served)
    assert client.is_server_live() and client.is_server_ready()
    server = client.get_server_metadata()
    assert server["name"] == "modelfleet" and "binary_tensor_data" in server["extensions"]
    meta = client.get_model_metadata("iris")
    assert meta["name"] == "iris" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 4]}]
    assert [(o["name"], o["datatype"], o["shape"]) for o in meta["outputs"]] == [
        ("probabilities", "FP32", [-1, 3]), ("class_index", "INT64", [-1]),
        ("class", "BYTES", [-1])]
    assert client.get_model_metadata("iris", "1")["versions"] == ["1"]
    assert client.is_model_ready("iris") and client.is_model_ready("iris", "1")
    assert not client.is_model_ready("plain")  # no signature: /v1 only
    assert not client.is_model_ready("nope")
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("nope")
    assert info.value.status() == "404" and "no model named 'nope'" in info.value.message()


@pytest.mark.parametrize(("binary_in", "binary_out"), [(False, False), (True, True),
                                                       (True, False), (False, True)])
def test_infer(served: str, binary_in: bool, binary_out: bool) -> None:
    client = client_of(served)
    outputs = [triton.InferRequestedOutput(name, binary_data=binary_out)
               for name in ("class", "probabilities")]
    result = client.infer("iris", [triton_input("features", ROWS, "FP32", binary_in)],
                          outputs=outputs, request_id=f"req-{binary_in}-{binary_out}")
    response = result.get_response()
    assert response["id"] == f"req-{binary_in}-{binary_out}"
    assert (response["model_name"], response["model_version"]) == ("iris", "1")
    assert [o["name"] for o in response["outputs"]] == ["class", "probabilities"]
    assert all(("data" in o) != binary_out for o in response["outputs"])
    assert as_bytes(result.as_numpy("class")) == CLASSES
    probabilities = result.as_numpy("probabilities")
    assert probabilities.shape == (3, 3) and probabilities.dtype == np.float32
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("compression", ["gzip", "deflate"])
def test_compressed_requests(served: str, compression: str) -> None:
    result = client_of(served).infer("iris", [triton_input("features", ROWS, "FP32")],
                                     request_compression_algorithm=compression)
    assert result.as_numpy("class_index").tolist() == [0, 1, 2]


def test_every_output_by_default_in_binary(served: str) -> None:
    # No outputs named: tritonclient asks for all of them, in binary (binary_data_output).
    result = client_of(served).infer("iris", [triton_input("features", ROWS, "FP32")])
    assert result.as_numpy("class_index").tolist() == [0, 1, 2]
    assert all("binary_data_size" in o["parameters"]
               for o in result.get_response()["outputs"])


@pytest.mark.parametrize("binary", [True, False])
def test_bytes_input(served: str, binary: bool) -> None:
    texts = TEXTS if not binary else np.array([b"\xffraw\x00", "été".encode(), b""],
                                              dtype=object)
    outputs = [triton.InferRequestedOutput("upper", binary_data=binary),
               triton.InferRequestedOutput("length", binary_data=False)]
    result = client_of(served).infer("words", [triton_input("text", texts, "BYTES", binary)],
                                     outputs=outputs)
    expected = [t.encode() if isinstance(t, str) else t for t in texts]
    assert result.as_numpy("length").tolist() == [len(t) for t in expected]
    assert as_bytes(result.as_numpy("upper")) == [t.upper() for t in expected]


def test_the_readme_tritonclient_example_runs_as_printed(served: str) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Open Inference Protocol v2"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    script = match.group(1).replace("localhost:8000", served.removeprefix("http://"))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "True True"
    assert lines[1] == "[{'name': 'features', 'datatype': 'FP32', 'shape': [-1, 4]}]"
    assert lines[2] == "[b'setosa' b'virginica']"


def test_the_v1_api_still_serves_a_model_with_a_signature(served: str) -> None:
    answer = httpx.post(f"{served}/v1/models/iris/infer", json={"features": [5.1, 3.5, 1.4, 0.2]},
                        timeout=60)
    assert answer.status_code == 200 and answer.json()["class"] == "setosa"


def test_a_large_body_is_held_at_the_gateway(served: str) -> None:
    rows = np.tile(ROWS, (40_000, 1))  # 480,000 floats: ~1.9 MB, far above the inline limit
    fetched = metric_sum(served, "modelfleet_gateway_payload_fetches_total", outcome="ok")
    result = client_of(served).infer("iris", [triton_input("features", rows, "FP32")],
                                     outputs=[triton.InferRequestedOutput("class_index")])
    assert result.as_numpy("class_index").tolist() == [0, 1, 2] * 40_000
    assert metric_sum(served, "modelfleet_gateway_payload_fetches_total",
                      outcome="ok") == fetched + 1


def test_a_body_the_payload_store_cannot_hold_is_answered_503(served: str) -> None:
    rows = np.zeros((230_000, 4), np.float32)  # 3.7 MB: under the body limit, over the store
    body, header_length = encode_request({"features": rows}, binary=True)
    answer = httpx.post(f"{served}/v2/models/iris/infer", content=body, timeout=60,
                        headers={"Inference-Header-Content-Length": str(header_length)})
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert "does not fit now" in answer.json()["error"]


def test_a_caller_hanging_up_is_counted_and_its_task_cancelled(served: str) -> None:
    hung_up = metric_sum(served, "modelfleet_gateway_client_disconnects_total")
    cancelled = metric_sum(served, "modelfleet_worker_cancelled_tasks_total")
    body, _ = encode_request({"seconds": np.array([3.0], np.float32)})
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{served}/v2/models/nap/infer", content=body, timeout=1.0)
    deadline = time.monotonic() + 20  # one bound for both
    eventually_blocking(lambda: metric_sum(served, "modelfleet_gateway_client_disconnects_total")
                        >= hung_up + 1, deadline - time.monotonic(),
                        what="the hang-up counted")
    eventually_blocking(lambda: metric_sum(served, "modelfleet_worker_cancelled_tasks_total")
                        >= cancelled + 1, deadline - time.monotonic(),
                        what="the worker told")


def test_a_body_that_stops_arriving_is_answered_408(served: str) -> None:
    url = httpx.URL(served)
    with socket.create_connection((url.host, url.port), timeout=30) as conn:
        conn.sendall(b"POST /v2/models/iris/infer HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: 1000\r\n\r\n" + b'{"inputs": [')
        answer = b""
        while chunk := conn.recv(65536):  # the gateway closes after its answer
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(body)["error"].startswith("the request body did not arrive within 2 s")


# --- error statuses --------------------------------------------------------------------

def triton_error(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


def test_errors_through_tritonclient(served: str) -> None:
    client = client_of(served)
    features = triton_input("features", ROWS, "FP32")
    unknown = triton_error(lambda: client.infer("nope", [features]))
    assert unknown.status() == "404"
    version = triton_error(lambda: client.infer("iris", [features], model_version="7"))
    assert version.status() == "404" and "7" in version.message()
    plain = triton_error(lambda: client.infer("plain", [features]))
    assert plain.status() == "400" and "declares no tensor signature" in plain.message()
    datatype = triton_error(lambda: client.infer(
        "iris", [triton_input("features", ROWS.astype(np.float64), "FP64")]))
    assert datatype.status() == "400" and "is FP32, got FP64" in datatype.message()
    shape = triton_error(lambda: client.infer(
        "iris", [triton_input("features", ROWS[:, :3].copy(), "FP32")]))
    assert shape.status() == "400" and "got [3, 3]" in shape.message()
    output = triton_error(lambda: client.infer(
        "iris", [features], outputs=[triton.InferRequestedOutput("score")]))
    assert output.status() == "400" and "no output 'score'" in output.message()
    faulty = triton_error(lambda: client.infer(
        "nap", [triton_input("seconds", np.array([-1], np.float32), "FP32")]))
    assert faulty.status() == "500" and "holds <U4 values" in faulty.message()


def test_the_timeout_parameter_is_the_deadline(served: str) -> None:
    client = client_of(served)
    nap = [triton_input("seconds", np.array([0.01], np.float32), "FP32")]
    assert client.infer("nap", nap).as_numpy("slept").tolist() == pytest.approx([0.01])
    long_nap = [triton_input("seconds", np.array([5.0], np.float32), "FP32")]
    started = time.monotonic()
    late = triton_error(lambda: client.infer("nap", long_nap, timeout=500_000))  # 0.5 s, in us
    assert late.status() == "504" and "deadline" in late.message()
    assert time.monotonic() - started < 5.0  # the caller's deadline, not the nap's end
    bad = httpx.post(f"{served}/v2/models/nap/infer", timeout=30, json={
        "parameters": {"timeout": -3},
        "inputs": [{"name": "seconds", "datatype": "FP32", "shape": [1], "data": [0]}]})
    assert bad.status_code == 400 and "positive whole number" in bad.json()["error"]


@pytest.mark.parametrize(("body", "headers", "status", "match"), [
    (b"{not json", {}, 400, "not valid JSON"),
    (b'{"inputs": []}', {}, 400, "'inputs' must be a non-empty list"),
    (b'{"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 4], '
     b'"data": [1, 2, 3]}]}', {}, 400, "has 4 elements, 'data' has 3"),
    (b'{"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 4], '
     b'"parameters": {"binary_data_size": 16}}]}' + b"\0" * 8,
     {"Inference-Header-Content-Length": "auto"}, 400, "truncated"),
    (b'{"inputs": []}', {"Inference-Header-Content-Length": "99"}, 400, "cannot be that long"),
    (b'{"inputs": []}', {"Inference-Header-Content-Length": "x"}, 400, "whole number"),
    (b'{"inputs": []}', {"Content-Encoding": "br"}, 400, "Content-Encoding 'br'"),
    (b'{"inputs": []}', {"Content-Encoding": "gzip"}, 400, "not valid gzip data"),
    (gzip.compress(b"\0" * (MAX_BODY_BYTES * 4), mtime=0), {"Content-Encoding": "gzip"}, 413,
     "inflates past the limit"),
    (b"\0" * (MAX_BODY_BYTES + 1), {}, 413, "limit"),
])
def test_malformed_requests(served: str, body: bytes, headers: dict[str, str], status: int,
                            match: str) -> None:
    if headers.get("Inference-Header-Content-Length") == "auto":  # all but 8 bytes of binary
        headers = {"Inference-Header-Content-Length": str(len(body) - 8)}
    answer = httpx.post(f"{served}/v2/models/iris/infer", content=body, headers=headers,
                        timeout=30)
    assert answer.status_code == status, answer.text
    assert set(answer.json()) == {"error"} and match in answer.json()["error"]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-(10**400), 10**400) | st.floats()
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=20)
TENSORS = st.fixed_dictionaries(
    {"name": st.sampled_from(["features", "text", "x", ""]),
     "datatype": st.sampled_from(["FP32", "BYTES", "INT64", "BOOL", "FP16", "UINT8", "fp32"]),
     "shape": st.lists(st.integers(-2, 10**12), max_size=4)},
    optional={"data": JSON_VALUES | st.lists(st.floats(width=32), max_size=12),
              "parameters": st.fixed_dictionaries({}, optional={
                  "binary_data_size": st.integers(-1, 64) | JSON_VALUES})})
REQUESTS = st.fixed_dictionaries(
    {"inputs": st.lists(TENSORS, max_size=3)},
    optional={"id": JSON_VALUES, "parameters": JSON_VALUES | st.fixed_dictionaries(
        {}, optional={"timeout": JSON_VALUES, "binary_data_output": JSON_VALUES}),
        "outputs": JSON_VALUES | st.lists(st.fixed_dictionaries(
            {"name": st.sampled_from(["class", "upper", "nope"])},
            optional={"parameters": JSON_VALUES}), max_size=3)})


@settings(max_examples=120, deadline=None)
@given(model=st.sampled_from(["iris", "words", "plain", "nope"]), doc=REQUESTS,
       tail=st.binary(max_size=64), header_length=st.none() | st.integers(-5, 400) | st.just(-1))
def test_random_v2_requests_get_4xx_never_5xx(served: str, model: str, doc: dict[str, Any],
                                              tail: bytes, header_length: int | None) -> None:
    header = json.dumps(doc).encode()
    headers = {}
    if header_length is not None:  # -1: the right length, so the binary tail is parsed
        length = len(header) if header_length == -1 else header_length
        headers["Inference-Header-Content-Length"] = str(length)
    answer = httpx.post(f"{served}/v2/models/{model}/infer", content=header + tail,
                        headers=headers, timeout=60)
    assert answer.status_code < 500, (answer.status_code, answer.text)
    if answer.status_code >= 400:
        assert isinstance(answer.json()["error"], str)


def valid_bodies() -> list[tuple[str, bytes, int]]:
    iris, iris_length = encode_request({"features": ROWS}, binary=True, binary_outputs=True)
    words, words_length = encode_request(
        {"text": np.array([b"ab", b"\xff", b""], dtype=object)}, binary=True)
    assert iris_length is not None and words_length is not None
    return [("iris", iris, iris_length), ("words", words, words_length)]


@settings(max_examples=120, deadline=None)
@given(which=st.sampled_from([0, 1]), cut=st.integers(0, 400), flips=st.lists(
    st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=4),
    length_shift=st.integers(-8, 8))
def test_damaged_binary_requests_get_4xx_never_5xx(served: str, which: int, cut: int,
                                                   flips: list[tuple[int, int]],
                                                   length_shift: int) -> None:
    model, body, header_length = valid_bodies()[which]
    damaged = bytearray(body[:len(body) - cut] if cut < len(body) else body)
    for at, value in flips:
        if at < len(damaged):
            damaged[at] = value
    answer = httpx.post(f"{served}/v2/models/{model}/infer", content=bytes(damaged),
                        timeout=60, headers={
                            "Inference-Header-Content-Length": str(header_length + length_shift)})
    assert answer.status_code < 500, (answer.status_code, answer.text)


# --- the KServe SDK's REST client against `modelfleet serve` ---------------------------

def test_kserve_rest_client(served: str) -> None:
    from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

    async def run() -> None:
        client = InferenceRESTClient(RESTConfig(protocol="v2", retries=0, timeout=120))
        assert await client.is_server_live(served) and await client.is_server_ready(served)
        assert await client.is_model_ready(served, "iris")
        for binary in (False, True):
            tensor = InferInput("features", list(ROWS.shape), "FP32")
            tensor.set_data_from_numpy(ROWS, binary_data=binary)
            result = await client.infer(served, InferRequest(
                model_name="iris", infer_inputs=[tensor], request_id=f"k-{binary}"),
                model_name="iris")
            assert result.id == f"k-{binary}"
            by_name = {o.name: o.as_numpy() for o in result.outputs}
            assert as_bytes(by_name["class"]) == CLASSES
            assert by_name["class_index"].tolist() == [0, 1, 2]
        words = InferInput("text", [3], "BYTES")
        words.set_data_from_numpy(TEXTS, binary_data=False)
        result = await client.infer(served, InferRequest(model_name="words",
                                                         infer_inputs=[words]),
                                    model_name="words")
        assert {o.name: o.as_numpy().tolist() for o in result.outputs}["length"] == [5, 5, 0]
        with pytest.raises(httpx.HTTPStatusError) as info:
            await client.infer(served, InferRequest(model_name="nope", infer_inputs=[words]),
                               model_name="nope")
        assert info.value.response.status_code == 404

    asyncio.run(run())


# --- gateway and worker on RabbitMQ ----------------------------------------------------

@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[str, str]]:
    require_rabbitmq()
    env = {**own_deployment(f"oip{uuid.uuid4().hex[:8]}"),
           "MODELFLEET_WORKER__RESCORE_INTERVAL_S": "0.5"}
    repo = repository(tmp_path / "repo")
    procs: list[Proc] = []
    try:
        gw, keyed = gateway(tmp_path, rabbitmq_url(), env, "gw", repo=repo)
        procs.append(gw)
        procs.append(worker(tmp_path, rabbitmq_url(), env, "w0", repo=repo)[0])
        # The clients take the key as a header: the base URL without its credentials.
        yield f"http://127.0.0.1:{httpx.URL(keyed).port}", gw.api_key  # type: ignore[attr-defined]
    finally:
        for proc in procs:
            proc.stop()


@pytest.mark.rabbitmq
def test_on_rabbitmq(fleet: tuple[str, str]) -> None:
    base, key = fleet

    def auth() -> dict[str, str]:  # a new dict each call: tritonclient adds its own headers
        return {"Authorization": f"Bearer {key}"}

    client = client_of(base)
    assert client.is_server_ready(headers=auth())
    assert client.is_model_ready("iris", headers=auth())
    words_meta = client.get_model_metadata("words", headers=auth())
    assert words_meta["inputs"][0]["datatype"] == "BYTES"
    for binary in (True, False):
        result = client.infer("iris", [triton_input("features", ROWS, "FP32", binary)],
                              headers=auth(), request_id="rq")
        assert as_bytes(result.as_numpy("class")) == CLASSES
        assert result.get_response()["id"] == "rq"
    words = client.infer("words", [triton_input("text", TEXTS, "BYTES")], headers=auth())
    assert as_bytes(words.as_numpy("upper")) == [t.encode().upper() for t in TEXTS]
    shape = triton_error(lambda: client.infer(
        "iris", [triton_input("features", ROWS[:, :2].copy(), "FP32")], headers=auth()))
    assert shape.status() == "400"
    late = triton_error(lambda: client.infer(
        "nap", [triton_input("seconds", np.array([5.0], np.float32), "FP32")],
        headers=auth(), timeout=500_000))
    assert late.status() == "504"
    rows = np.tile(ROWS, (40_000, 1))  # held at the gateway, fetched by the worker's runtime
    body, header_length = encode_request({"features": rows}, binary=True,
                                         outputs=["class_index"], binary_outputs=True)
    answer = httpx.post(f"{base}/v2/models/iris/infer", content=body, timeout=120,
                        headers={**auth(), "Inference-Header-Content-Length": str(header_length)})
    assert answer.status_code == 200, answer.text
    _, arrays = decode_response(answer.content,
                                int(answer.headers["inference-header-content-length"]))
    assert arrays["class_index"].tolist() == [0, 1, 2] * 40_000

    from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

    async def kserve_infer() -> Any:
        tensor = InferInput("features", list(ROWS.shape), "FP32")
        tensor.set_data_from_numpy(ROWS, binary_data=True)
        client = InferenceRESTClient(RESTConfig(protocol="v2", retries=0, timeout=120))
        return await client.infer(base, InferRequest(model_name="iris", infer_inputs=[tensor]),
                                  model_name="iris", headers=auth())

    result = asyncio.run(kserve_infer())
    assert {o.name: o.as_numpy() for o in result.outputs}["class_index"].tolist() == [0, 1, 2]


def test_json_response_body_is_plain_json(served: str) -> None:
    body, _ = encode_request({"features": ROWS[:1]}, request_id="plain-json")
    answer = httpx.post(f"{served}/v2/models/iris/infer", content=body, timeout=60)
    assert answer.headers["content-type"] == "application/json"
    assert "inference-header-content-length" not in answer.headers
    assert json.loads(answer.content)["id"] == "plain-json"
