"""The Open Inference Protocol over gRPC, spoken by the real clients: tritonclient.grpc (in
a process of its own, see tests/clients) and the KServe SDK's InferenceGRPCClient,
against ``modelfleet serve`` and against a gateway and a worker on a real RabbitMQ."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from modelfleet.gateway.grpc_api import inference_pb2 as pb
from tests.conftest import own_deployment, rabbitmq_url, require_rabbitmq
from tests.e2e.test_oip import repository as oip_repository
from tests.e2e.test_oip_extensions import SIMPLE_HANDLER, SIMPLE_MANIFEST
from tests.procs import (
    ROOT,
    Proc,
    free_port,
    gateway,
    provision_key,
    serve,
    worker,
    write_package,
)

ROWS = np.array([[5.1, 3.5, 1.4, 0.2], [6.3, 3.3, 6.0, 2.5]], np.float32)


def repository(root: Path) -> Path:
    """test_oip's repository (iris, words: BYTES in and out, nap: sleeps, plain), and a
    stand-in for Triton's ``simple``."""
    oip_repository(root)
    write_package(root, "simple", SIMPLE_MANIFEST, SIMPLE_HANDLER)
    return root


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(HTTP base URL, gRPC address) of one ``modelfleet serve``."""
    tmp = tmp_path_factory.mktemp("grpc-serve")
    port = free_port()
    proc, base = serve(tmp, repo=repository(tmp / "repo"),
                       env={"MODELFLEET_GATEWAY__GRPC_PORT": str(port)})
    try:
        yield base, f"127.0.0.1:{port}"
    finally:
        proc.stop()


def triton_grpc(address: str, key: str | None = None) -> dict[str, Any]:
    """Run tests/clients/triton_grpc.py against ``address``; what it saw."""
    args = [sys.executable, "-m", "tests.clients.triton_grpc", address, *([key] if key else [])]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    seen: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return seen


def check_triton_examples(seen: dict[str, Any]) -> None:
    assert seen["live"] and seen["ready"] and seen["model_ready"]
    assert seen["server"] == ["modelfleet", ["binary_tensor_data", "classification",
                                             "model_configuration", "model_repository",
                                             "statistics"]]
    assert seen["model_inputs"] == [["INPUT0", "INT32", ["1", "16"]],
                                    ["INPUT1", "INT32", ["1", "16"]]]
    assert seen["sum_ok"] and seen["difference_ok"]
    # bytes in, bytes out: upper() of bytes changes ASCII only; lengths are in bytes
    assert seen["upper"] == ["HELLO", "\u00e9T\u00e9", ""] and seen["length"] == [5, 5, 0]
    name, version, count, success = seen["stats"]
    assert (name, version) == ("simple", "1") and count >= 1 and success >= 1
    assert seen["config"] == ["simple", 0, ["INPUT0", "INPUT1"]]
    assert {"simple", "words", "iris"} <= set(seen["index"])
    status, message = seen["load_bad_config"]
    assert status == "StatusCode.INVALID_ARGUMENT" and "max_batch_size" in message
    status, message = seen["missing"]
    assert status == "StatusCode.NOT_FOUND" and "nope" in message
    status, message = seen["bad_input"]
    assert status == "StatusCode.INVALID_ARGUMENT" and "INPUT1" in message


def test_tritonclient_grpc_against_serve(served: tuple[str, str]) -> None:
    check_triton_examples(triton_grpc(served[1]))


def test_the_readme_grpc_example_runs_as_printed(served: tuple[str, str]) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### gRPC"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    script = match.group(1).replace("localhost:8001", served[1])
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["[b'setosa']"]


async def kserve_infer(address: str) -> tuple[bool, bool, np.ndarray, list[Any]]:
    from kserve import InferenceGRPCClient, InferInput, InferRequest  # ~1 s to import

    async with InferenceGRPCClient(address, timeout=60) as client:
        ready = await client.is_server_ready()
        model_ready = await client.is_model_ready("iris")
        features = InferInput("features", list(ROWS.shape), "FP32")
        features.set_data_from_numpy(ROWS, binary_data=True)
        response = await client.infer(InferRequest("iris", [features]))
        by_name = {out.name: out for out in response.outputs}
        return (ready, model_ready, by_name["probabilities"].as_numpy(),
                list(by_name["class"].as_numpy()))


def test_kserve_grpc_client_against_serve(served: tuple[str, str]) -> None:
    ready, model_ready, probabilities, classes = asyncio.run(kserve_infer(served[1]))
    assert ready and model_ready
    assert probabilities.shape == (2, 3) and np.allclose(probabilities.sum(axis=1), 1, atol=1e-4)
    assert [c.decode() if isinstance(c, bytes) else c for c in classes] == ["setosa",
                                                                           "virginica"]


def call(address: str, method: str, request: Any, response: Any, timeout: float = 30,
         metadata: tuple[tuple[str, str], ...] = ()) -> Any:
    """One unary call of inference.GRPCInferenceService with modelfleet's own messages."""
    with grpc.insecure_channel(address) as channel:
        stub = channel.unary_unary(f"/inference.GRPCInferenceService/{method}",
                                   request_serializer=type(request).SerializeToString,
                                   response_deserializer=response.FromString)
        return stub(request, timeout=timeout, metadata=metadata)


def nap_request(seconds: float) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="nap")
    request.inputs.add(name="seconds", datatype="FP32", shape=[1],
                       contents=pb.InferTensorContents(fp32_contents=[seconds]))
    return request


def test_typed_contents_and_the_calls_own_deadline(served: tuple[str, str]) -> None:
    answer = call(served[1], "ModelInfer", nap_request(0.0), pb.ModelInferResponse)
    assert answer.outputs[0].name == "slept" and len(answer.raw_output_contents) == 1
    assert np.frombuffer(answer.raw_output_contents[0], np.float32).tolist() == [0.0]
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        call(served[1], "ModelInfer", nap_request(5.0), pb.ModelInferResponse, timeout=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 4


@pytest.mark.parametrize(("contents", "match"), [
    (pb.InferTensorContents(fp32_contents=[1.0, 2.0]), "needs 1"),
    (pb.InferTensorContents(), "needs 1"),
])
def test_contents_that_do_not_fit_are_invalid_argument(served: tuple[str, str],
                                                       contents: Any, match: str) -> None:
    request = pb.ModelInferRequest(model_name="nap")
    request.inputs.add(name="seconds", datatype="FP32", shape=[1], contents=contents)
    with pytest.raises(grpc.RpcError) as info:
        call(served[1], "ModelInfer", request, pb.ModelInferResponse)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "seconds" in (info.value.details() or "")


def test_raw_contents_must_match_the_inputs(served: tuple[str, str]) -> None:
    request = nap_request(0.0)
    request.raw_input_contents.extend([b"\0\0\0\0", b"\0\0\0\0"])
    with pytest.raises(grpc.RpcError) as info:
        call(served[1], "ModelInfer", request, pb.ModelInferResponse)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "raw_input_contents has 2 entries for 1 inputs" in (info.value.details() or "")


def test_grpc_with_auth(tmp_path: Path) -> None:
    """No key: UNAUTHENTICATED; another tenant's model: NOT_FOUND, like a missing one; a
    caller's key on the repository: PERMISSION_DENIED; a key that may: answered."""
    db = tmp_path / "tenants.sqlite3"
    port = free_port()
    proc, _ = serve(tmp_path, repo=repository(tmp_path / "repo"),
                    env={"MODELFLEET_TENANCY__AUTH": "on", "MODELFLEET_TENANCY__DB": str(db),
                         "MODELFLEET_DLQ_DB": str(db),
                         "MODELFLEET_GATEWAY__GRPC_PORT": str(port)})
    address = f"127.0.0.1:{port}"
    try:
        with pytest.raises(grpc.RpcError) as info:
            call(address, "ModelMetadata", pb.ModelMetadataRequest(name="iris"),
                 pb.ModelMetadataResponse)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        live = call(address, "ServerLive", pb.ServerLiveRequest(), pb.ServerLiveResponse)
        assert live.live  # health stays open
        outsider = provision_key(str(db), role="caller", tenant="outsiders")
        owner = provision_key(str(db), role="caller", tenant="examples")
        with pytest.raises(grpc.RpcError) as info:
            call(address, "ModelMetadata", pb.ModelMetadataRequest(name="iris"),
                 pb.ModelMetadataResponse, metadata=(("authorization", f"Bearer {outsider}"),))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        meta = call(address, "ModelMetadata", pb.ModelMetadataRequest(name="iris"),
                    pb.ModelMetadataResponse, metadata=(("authorization", f"Bearer {owner}"),))
        assert meta.name == "iris"
        with pytest.raises(grpc.RpcError) as info:
            call(address, "RepositoryIndex", pb.RepositoryIndexRequest(),
                 pb.RepositoryIndexResponse, metadata=(("authorization", f"Bearer {owner}"),))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # An operator of another tenant loading simple (with a config): NOT_FOUND, worded
        # as a load of a model that does not exist.
        stranger = provision_key(str(db), role="operator", tenant="outsiders")
        config = pb.ModelRepositoryParameter(string_param='{"max_batch_size": 4}')
        with pytest.raises(grpc.RpcError) as info:
            call(address, "RepositoryModelLoad", pb.RepositoryModelLoadRequest(
                model_name="simple", parameters={"config": config}),
                pb.RepositoryModelLoadResponse,
                metadata=(("authorization", f"Bearer {stranger}"),))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert str(info.value.details()).startswith("failed to load 'simple'")
        # A load's files publish as the key may, as on HTTP: a new model named for its
        # tenant, of its tenant; not another's name, nor another tenant's package.
        as_stranger = (("authorization", f"Bearer {stranger}"),)

        def files_load(model: str, tenant: str) -> pb.RepositoryModelLoadResponse:
            manifest = SIMPLE_MANIFEST.replace(
                'name = "simple"', f'name = "{model}"\n    tenant = "{tenant}"')
            files = {"file:1/model.toml": textwrap.dedent(manifest).encode(),
                     "file:1/handler.py": textwrap.dedent(SIMPLE_HANDLER).encode()}
            return call(address, "RepositoryModelLoad", pb.RepositoryModelLoadRequest(
                model_name=model, parameters={
                    path: pb.ModelRepositoryParameter(bytes_param=data)
                    for path, data in files.items()}),
                pb.RepositoryModelLoadResponse, metadata=as_stranger)

        files_load("outsiders-simple", "outsiders")
        ready = call(address, "ModelReady", pb.ModelReadyRequest(name="outsiders-simple"),
                     pb.ModelReadyResponse, metadata=as_stranger)
        assert ready.ready
        with pytest.raises(grpc.RpcError) as info:
            files_load("simple", "outsiders")  # another tenant's model: not found
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as info:
            files_load("unclaimed", "outsiders")  # a name not its tenant's
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as info:
            files_load("outsiders-theirs", "examples")  # another tenant's package
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "publishes that tenant's models only" in str(info.value.details())
        index = call(address, "RepositoryIndex", pb.RepositoryIndexRequest(),
                     pb.RepositoryIndexResponse, metadata=as_stranger)
        assert [m.name for m in index.models] == ["outsiders-simple"]
    finally:
        proc.stop()


@pytest.mark.rabbitmq
def test_tritonclient_grpc_on_rabbitmq(tmp_path: Path) -> None:
    """The same calls through a gateway (auth on, its admin key in the metadata) and a
    worker joined by a real RabbitMQ."""
    require_rabbitmq()
    repo = repository(tmp_path / "repo")
    port = free_port()
    env = {**own_deployment(f"grpc{uuid.uuid4().hex[:8]}"),
           "MODELFLEET_WORKER__RESCORE_INTERVAL_S": "0.5"}
    procs: list[Proc] = []
    try:
        gw, _ = gateway(tmp_path, rabbitmq_url(), {**env, "MODELFLEET_GATEWAY__GRPC_PORT":
                                                   str(port)}, "gw", repo=repo)
        procs.append(gw)
        procs.append(worker(tmp_path, rabbitmq_url(), env, "w0", repo=repo)[0])
        check_triton_examples(triton_grpc(f"127.0.0.1:{port}", gw.api_key))  # type: ignore[attr-defined]
    finally:
        for proc in procs:
            proc.stop()
