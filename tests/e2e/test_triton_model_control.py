"""The calls Triton's model-control examples make (simple_http_model_control.py and
simple_grpc_model_control.py of triton-inference-server/client), made the same way by
tritonclient against ``modelfleet serve``, asserting what those examples assert: the
index counts the repository's models, a load with a malformed config fails ("failed to
load"), one with ``{"max_batch_size":"16"}`` is applied (the model's configuration then
says 16), an unload makes the model not ready, and a load of a model that does not
exist fails ("failed to load"); over gRPC, a load whose files make no package (a file
name past 255 bytes) is StatusCode.INTERNAL "failed to poll from model repository", as
Triton answers it. Beyond them: the model serves under its config, a load
without one takes it back to model.toml's, and a config that does not map is a 400
that names what.

The repository is a stand-in for the one those examples expect: Triton's ``simple``
(INPUT0 + INPUT1 INT32, a batch of [16], max_batch_size 8; two versions here) and as
many other models as the example counts (7 for HTTP, 8 for gRPC). tritonclient.grpc
runs in a process of its own (tests/clients/triton_grpc.py: it and kserve collide in
one protobuf pool).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.e2e.test_oip_extensions import SIMPLE_HANDLER
from tests.procs import ROOT, Proc, free_port, serve, write_package
from tests.waiting import eventually_blocking

# Triton's own simple model: a batch dimension, then 16; it batches up to 8.
TRITON_SIMPLE = """\
    name = "simple"
    entrypoint = "handler:Simple"
    [batching]
    max_batch_size = 8
    [[inputs]]
    name = "INPUT0"
    datatype = "INT32"
    shape = [-1, 16]
    [[inputs]]
    name = "INPUT1"
    datatype = "INT32"
    shape = [-1, 16]
    [[outputs]]
    name = "OUTPUT0"
    datatype = "INT32"
    shape = [-1, 16]
    [[outputs]]
    name = "OUTPUT1"
    datatype = "INT32"
    shape = [-1, 16]
    """
OTHERS = ("simple_string", "simple_identity", "simple_sequence", "simple_int8",
          "simple_dyna_sequence", "simple_repeat", "simple_fp32")


def stand_in(root: Path, models: int) -> Path:
    """``simple`` (versions 1 and 2) and ``models - 1`` others (the examples only count
    them)."""
    folder = write_package(root, "simple", TRITON_SIMPLE, SIMPLE_HANDLER)
    shutil.copytree(folder, root / "simple" / "2")
    manifest = root / "simple" / "2" / "model.toml"
    manifest.write_text(manifest.read_text().replace('name = "simple"',
                                                     'name = "simple"\nversion = "2"'))
    for name in OTHERS[:models - 1]:
        write_package(root, name, f'name = "{name}"\nentrypoint = "handler:Simple"\n',
                      SIMPLE_HANDLER)
    return root


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(HTTP host:port, gRPC host:port) of one ``modelfleet serve`` on 7 models."""
    tmp = tmp_path_factory.mktemp("triton-control")
    port = free_port()
    proc, base = serve(tmp, repo=stand_in(tmp / "repo", 7),
                       env={"MODELFLEET_GATEWAY__GRPC_PORT": str(port)})
    try:
        yield base.removeprefix("http://"), f"127.0.0.1:{port}"
    finally:
        proc.stop()


def message_of(call: Any) -> str:
    with pytest.raises(InferenceServerException) as info:
        call()
    return str(info.value.message())


def test_the_http_model_control_examples_calls(served: tuple[str, str]) -> None:
    client = triton.InferenceServerClient(url=served[0], network_timeout=120)
    assert len(client.get_model_repository_index()) == 7
    client.load_model("simple")
    assert client.is_model_ready("simple")
    # The example's config "with wrong format": not JSON.
    wrong = '"parameters": {"config": {{"max_batch_size": "16"}}}'
    assert "failed to load" in message_of(lambda: client.load_model("simple", config=wrong))
    client.load_model("simple", config='{"max_batch_size":"16"}')
    assert client.get_model_config("simple")["max_batch_size"] == 16
    client.unload_model("simple")
    assert not client.is_model_ready("simple")
    missing = message_of(lambda: client.load_model("wrong_model_name"))
    assert "failed to load" in missing
    assert missing.startswith("failed to load 'wrong_model_name': no model named")


def test_a_config_serves_until_a_load_without_one(served: tuple[str, str]) -> None:
    client = triton.InferenceServerClient(url=served[0], network_timeout=120)
    client.load_model("simple", config=json.dumps({
        "max_batch_size": 4, "dynamic_batching": {"max_queue_delay_microseconds": 500}}))
    config = client.get_model_config("simple")
    assert config["max_batch_size"] == 4
    assert config["dynamic_batching"] == {"preferred_batch_size": [4],
                                          "max_queue_delay_microseconds": 500}
    rows = np.arange(32, dtype=np.int32).reshape(2, 16)
    inputs = [triton.InferInput("INPUT0", [2, 16], "INT32"),
              triton.InferInput("INPUT1", [2, 16], "INT32")]
    inputs[0].set_data_from_numpy(rows)
    inputs[1].set_data_from_numpy(np.ones_like(rows))
    assert np.array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), rows + 1)
    client.load_model("simple")  # no config: model.toml's again
    config = client.get_model_config("simple")
    assert config["max_batch_size"] == 8
    assert config["dynamic_batching"] == {"preferred_batch_size": [8],
                                          "max_queue_delay_microseconds": 0}


def test_a_config_that_does_not_map_names_what(served: tuple[str, str]) -> None:
    client = triton.InferenceServerClient(url=served[0], network_timeout=120)
    with pytest.raises(InferenceServerException) as info:
        client.load_model("simple", config=json.dumps({
            "backend": "onnxruntime", "max_batch_size": 4,
            "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}]}))
    assert info.value.status() == "400"
    message = info.value.message()
    assert message.startswith("failed to load 'simple'")
    assert "backend, input differ(s)" in message and "model.toml" in message
    assert client.get_model_config("simple")["max_batch_size"] == 8  # nothing applied


def test_a_configs_version_policy_chooses_what_is_served(served: tuple[str, str]) -> None:
    client = triton.InferenceServerClient(url=served[0], network_timeout=120)
    assert client.get_model_metadata("simple")["versions"] == ["1", "2"]
    client.load_model("simple", config=json.dumps(
        {"version_policy": {"specific": {"versions": [1]}}}))
    assert client.get_model_metadata("simple")["versions"] == ["1"]
    assert client.get_model_config("simple")["version_policy"] == {
        "specific": {"versions": [1]}}
    rows = np.zeros((1, 16), dtype=np.int32)
    inputs = [triton.InferInput("INPUT0", [1, 16], "INT32"),
              triton.InferInput("INPUT1", [1, 16], "INT32")]
    for tensor in inputs:
        tensor.set_data_from_numpy(rows)
    assert client.infer("simple", inputs).get_response()["model_version"] == "1"
    with pytest.raises(InferenceServerException) as info:
        client.infer("simple", inputs, model_version="2")
    assert info.value.status() == "404"
    assert "version '2' is not served: the version policy" in info.value.message()
    client.load_model("simple", config=json.dumps(
        {"version_policy": {"latest": {"num_versions": 1}}}))
    assert client.infer("simple", inputs).get_response()["model_version"] == "2"
    client.load_model("simple")  # every version again
    assert client.get_model_metadata("simple")["versions"] == ["1", "2"]
    assert client.infer("simple", inputs, model_version="1").get_response()[
        "model_version"] == "1"


def triton_grpc_control(address: str) -> dict[str, Any]:
    args = [sys.executable, "-m", "tests.clients.triton_grpc", "--model-control", address]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    seen: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return seen


def test_the_grpc_model_control_examples_calls(tmp_path: Path) -> None:
    port = free_port()
    proc, _ = serve(tmp_path, repo=stand_in(tmp_path / "repo", 8),
                    env={"MODELFLEET_GATEWAY__GRPC_PORT": str(port)})
    try:
        seen = triton_grpc_control(f"127.0.0.1:{port}")
    finally:
        proc.stop()
    assert seen["index"] == 8
    assert seen["ready_after_load"] and not seen["ready_after_unload"]
    assert "failed to load" in seen["wrong_format"][1]
    assert seen["max_batch_size"] == 16
    # Files that make no package (a file name past 255 bytes): Triton's status and words,
    # which the example checks, then why.
    status, message = seen["files"]
    assert status == "StatusCode.INTERNAL"
    assert message.startswith("failed to load 'simple': failed to poll from model "
                              "repository: the package's path 'AAAA")
    assert "a part of 256 bytes: a file name is at most 255" in message
    assert seen["live_after_files"]
    assert seen["wrong_model"][0] == "StatusCode.NOT_FOUND"
    assert seen["wrong_model"][1].startswith("failed to load 'wrong_model_name'")
    # A gRPC load's files that make a package publish it (bytes, as tritonclient sends).
    assert seen["published"] == [True, True]
    status, message = seen["no_manifest"]  # a package, but not a model's: the caller's
    assert status == "StatusCode.INVALID_ARGUMENT" and "has no model.toml" in message


def test_files_that_make_no_package_over_http_are_a_400_in_tritons_words(
        served: tuple[str, str]) -> None:
    """The gRPC example's load of a file name past 255 bytes, over HTTP: the caller's
    mistake (400), worded as Triton words it; the server goes on serving."""
    client = triton.InferenceServerClient(url=served[0], network_timeout=120)
    client.load_model("simple")
    with pytest.raises(InferenceServerException) as info:
        client.load_model("simple", config="{}", files={"file:" + "A" * 256: b"a"})
    assert info.value.status() == "400"
    assert info.value.message().startswith(
        "failed to load 'simple': failed to poll from model repository: the package's "
        "path 'AAAA")
    assert client.is_server_live() and client.is_model_ready("simple")


# A stand-in for simple whose OUTPUT0 says how many requests its predict was given at once.
SIZES_MANIFEST = TRITON_SIMPLE.replace("max_batch_size = 8",
                                       "max_batch_size = 8\n    max_delay_ms = 200")
SIZES_HANDLER = """\
    import numpy as np
    from modelfleet import Model

    class Sizes(Model):
        def predict(self, batch):
            return [{"OUTPUT0": np.full_like(t["INPUT0"], len(batch)),
                     "OUTPUT1": t["INPUT1"]} for t in batch]
    """


def batch_sizes(url: str, key: str, requests: int = 6) -> set[int]:
    """The batch sizes ``requests`` concurrent requests were predicted in."""
    client = triton.InferenceServerClient(url=url, network_timeout=120,
                                          concurrency=requests)
    headers = {"Authorization": f"Bearer {key}"}
    rows = np.zeros((1, 16), dtype=np.int32)
    inputs = [triton.InferInput("INPUT0", [1, 16], "INT32"),
              triton.InferInput("INPUT1", [1, 16], "INT32")]
    for tensor in inputs:
        tensor.set_data_from_numpy(rows)
    pending = [client.async_infer("simple", inputs, headers=headers) for _ in range(requests)]
    return {int(p.get_result().as_numpy("OUTPUT0")[0, 0]) for p in pending}


@pytest.mark.rabbitmq
def test_a_config_holds_on_gateway_and_worker_and_outlives_their_restart(
        tmp_path: Path) -> None:
    """On a gateway and a worker joined by RabbitMQ: a load's config is what the worker's
    batcher takes (max_batch_size 1: every request predicted alone), an operator of
    another tenant cannot give one, and after both restart the kept order holds again."""
    from tests.conftest import rabbitmq_url, require_rabbitmq
    from tests.procs import gateway, provision_key, worker

    require_rabbitmq()
    repo = tmp_path / "repo"
    write_package(repo, "simple", SIZES_MANIFEST,
                  SIZES_HANDLER.replace("class Sizes", "class Simple"))
    tag = f"cfg{uuid.uuid4().hex[:8]}"  # a fleet of its own on the shared RabbitMQ
    env = {"MODELFLEET_BROKER__QUEUE_PREFIX": f"{tag}.",
           "MODELFLEET_BROKER__EVENTS_EXCHANGE": f"{tag}.events",
           "MODELFLEET_WORKER__RESCORE_INTERVAL_S": "0.5"}
    procs: list[Proc] = []
    try:
        gw, base = gateway(tmp_path, rabbitmq_url(), env, "gw", repo=repo)
        procs.append(gw)
        procs.append(worker(tmp_path, rabbitmq_url(), env, "w0", repo=repo)[0])
        key = gw.api_key
        url = base.split("@", 1)[1]
        headers = {"Authorization": f"Bearer {key}"}
        client = triton.InferenceServerClient(url=url, network_timeout=120)
        client.load_model("simple", config='{"max_batch_size": "1"}', headers=headers)
        assert client.get_model_config("simple", headers=headers)["max_batch_size"] == 1
        assert batch_sizes(url, key) == {1}

        outsider = provision_key(str(tmp_path / "tenants.sqlite3"), role="operator",
                                 tenant="outsiders")
        with pytest.raises(InferenceServerException) as info:
            client.load_model("simple", config='{"max_batch_size": "8"}',
                              headers={"Authorization": f"Bearer {outsider}"})
        assert info.value.status() == "404" and "failed to load" in info.value.message()
        assert client.get_model_config("simple", headers=headers)["max_batch_size"] == 1

        for proc in reversed(procs):  # every process of the fleet restarts
            proc.stop()
        procs.clear()
        procs.append(worker(tmp_path, rabbitmq_url(), env, "w1", repo=repo)[0])
        gw, base = gateway(tmp_path, rabbitmq_url(), env, "gw2", repo=repo)
        procs.append(gw)
        url = base.split("@", 1)[1]
        client = triton.InferenceServerClient(url=url, network_timeout=120)
        headers = {"Authorization": f"Bearer {gw.api_key}"}
        # The gateway read the order back before it became ready; the worker is told it.
        assert client.get_model_config("simple", headers=headers)["max_batch_size"] == 1
        eventually_blocking(lambda: batch_sizes(url, gw.api_key) == {1},
                 what="the restarted worker to serve under the kept config")
        client.load_model("simple", headers=headers)  # no config: model.toml's again
        assert client.get_model_config("simple", headers=headers)["max_batch_size"] == 8
    finally:
        for proc in procs:
            proc.stop()
