"""The Open Inference Protocol's extensions, unit by unit: parameters refused rather than
ignored, classification, model configuration, and the fleet-wide statistics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from modelfleet.errors import ManifestError, RequestRejected
from modelfleet.gateway.statistics import InferenceStatistics, model_stats
from modelfleet.model.tensors import classify
from modelfleet.oip.codec import parse_request
from modelfleet.oip.model_config import config_override, model_config, parse_config
from modelfleet.oip.signature import check_request
from modelfleet.repository.catalog import CatalogEntry
from modelfleet.repository.manifest import Manifest, load_manifest, parse_manifest
from modelfleet.repository.overrides import ConfigOverride

SIMPLE = """
name = "simple"
entrypoint = "handler:Simple"
[batching]
max_batch_size = 8
max_delay_ms = 1.5
[[inputs]]
name = "INPUT0"
datatype = "INT32"
shape = [-1, 16]
[[outputs]]
name = "OUTPUT0"
datatype = "INT32"
shape = [-1, 16]
labels = "labels.txt"
"""


def request(outputs: list[dict[str, object]] | None = None,
            input_parameters: dict[str, object] | None = None) -> bytes:
    tensor: dict[str, object] = {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16],
                                 "data": list(range(16))}
    if input_parameters is not None:
        tensor["parameters"] = input_parameters
    doc: dict[str, object] = {"inputs": [tensor]}
    if outputs is not None:
        doc["outputs"] = outputs
    return json.dumps(doc).encode()


# --- parameters the server does not honour are refused --------------------------------

@pytest.mark.parametrize("parameters", [
    {"shared_memory_region": "input0_data", "shared_memory_byte_size": 64},
    {"shared_memory_region": "cuda_region", "shared_memory_offset": 0},
])
def test_shared_memory_on_an_input_is_refused(parameters: dict[str, object]) -> None:
    with pytest.raises(RequestRejected, match=r"shared memory .* is not supported"):
        parse_request(request(input_parameters=parameters))


def test_shared_memory_on_an_output_is_refused_not_answered_in_the_body() -> None:
    with pytest.raises(RequestRejected, match="output 'OUTPUT0': shared memory"):
        parse_request(request([{"name": "OUTPUT0", "parameters": {
            "shared_memory_region": "output0_data", "shared_memory_byte_size": 64}}]))


def test_an_unknown_tensor_parameter_is_refused_with_what_is_honoured() -> None:
    with pytest.raises(RequestRejected, match=r"\['priority_hint'\] are not supported; "
                                              r"this server honours binary_data, "
                                              r"classification"):
        parse_request(request([{"name": "OUTPUT0", "parameters": {"priority_hint": 1}}]))
    with pytest.raises(RequestRejected, match="honours binary_data_size"):
        parse_request(request(input_parameters={"layout": "NCHW"}))


@pytest.mark.parametrize("value", [0, -1, True, "3", 1001, 2.5])
def test_classification_must_be_a_sensible_count(value: object) -> None:
    with pytest.raises(RequestRejected, match="'classification' is the number of top"):
        parse_request(request([{"name": "OUTPUT0", "parameters": {"classification": value}}]))


def test_classification_of_a_bytes_output_is_refused_at_the_gateway() -> None:
    manifest = parse_manifest(SIMPLE.replace('labels = "labels.txt"', "").replace(
        'name = "OUTPUT0"\ndatatype = "INT32"', 'name = "OUTPUT0"\ndatatype = "BYTES"'), "x")
    parsed = parse_request(request([{"name": "OUTPUT0", "parameters": {"classification": 2}}]))
    with pytest.raises(RequestRejected, match="classification needs numeric scores"):
        check_request(parsed, manifest.inputs, manifest.outputs, "simple")


# --- classification -------------------------------------------------------------------

def test_classify_gives_the_top_k_best_first_with_labels() -> None:
    scores = np.array([[0.1, 0.7, 0.2], [0.5, 0.1, 0.4]], np.float32)
    out = classify(scores, 2, ["cat", "dog", "eel"])
    assert out.shape == (2, 2)
    assert [v.decode() for v in out[0]] == ["0.700000:1:dog", "0.200000:2:eel"]
    assert [v.decode() for v in out[1]] == ["0.500000:0:cat", "0.400000:2:eel"]


def test_classify_without_labels_and_k_above_the_classes() -> None:
    out = classify(np.array([3, 9, 1], np.int32), 5)
    assert [v.decode() for v in out] == ["9.000000:1", "3.000000:0", "1.000000:2"]


# --- labels and model configuration ---------------------------------------------------

def package(tmp_path: Path, labels: str | None = "a\nb\n") -> Path:
    (tmp_path / "model.toml").write_text(SIMPLE)
    if labels is not None:
        (tmp_path / "labels.txt").write_text(labels)
    return tmp_path / "model.toml"


def test_load_manifest_reads_an_outputs_labels(tmp_path: Path) -> None:
    manifest = load_manifest(package(tmp_path))
    assert manifest.outputs[0].label_names == ("a", "b")


def test_a_missing_labels_file_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=r"outputs\.0\.labels.*cannot read labels.txt"):
        load_manifest(package(tmp_path, labels=None))


def test_labels_outside_the_package_are_refused() -> None:
    with pytest.raises(ManifestError, match="inside the package"):
        parse_manifest(SIMPLE.replace('"labels.txt"', '"../../etc/passwd"'), "x")


def test_model_config_is_tritons_shape(tmp_path: Path) -> None:
    config = model_config(load_manifest(package(tmp_path)))
    assert config["name"] == "simple" and config["max_batch_size"] == 8
    assert config["input"] == [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [16],
                                "format": "FORMAT_NONE"}]
    assert config["output"] == [{"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [16],
                                 "label_filename": "labels.txt"}]
    assert config["dynamic_batching"] == {"preferred_batch_size": [8],
                                          "max_queue_delay_microseconds": 1500}


def test_model_config_without_a_batch_dimension_keeps_every_dim() -> None:
    manifest = parse_manifest(SIMPLE.replace("[-1, 16]", "[1, 16]"), "x")
    config = model_config(manifest)
    assert config["max_batch_size"] == 0 and config["input"][0]["dims"] == [1, 16]


def entry_of(*manifests: Manifest) -> CatalogEntry:
    return CatalogEntry(tuple(manifests))


def refusal(given: dict[str, object], entry: CatalogEntry) -> str:
    with pytest.raises(RequestRejected) as info:
        config_override(given, entry)
    return info.value.message


def test_a_load_config_that_says_what_model_toml_says_overrides_nothing(
        tmp_path: Path) -> None:
    manifest = load_manifest(package(tmp_path))
    assert config_override(model_config(manifest), entry_of(manifest)).to_json() == ""
    assert not config_override({"name": "simple", "backend": ""}, entry_of(manifest))
    with pytest.raises(RequestRejected, match="not JSON"):
        parse_config("{nope")
    with pytest.raises(RequestRejected, match="JSON object"):
        parse_config("[1]")


def test_a_load_config_overrides_batching_as_triton_writes_it(tmp_path: Path) -> None:
    manifest = load_manifest(package(tmp_path))
    override = config_override({"max_batch_size": "16"}, entry_of(manifest))  # int64 text
    assert override.batching() == {"max_batch_size": 16}
    applied = override.apply(manifest)
    assert (applied.batching.max_batch_size, applied.batching.max_delay_ms) == (16, 1.5)
    assert model_config(applied)["max_batch_size"] == 16
    both = config_override({"max_batch_size": 4, "dynamic_batching": {
        "preferred_batch_size": [4], "max_queue_delay_microseconds": "250"}},
        entry_of(manifest))
    assert both.batching() == {"max_batch_size": 4, "max_delay_ms": 0.25}
    assert ConfigOverride.from_json(both.to_json()) == both  # as the order travels


def test_a_load_config_names_every_field_that_does_not_map(tmp_path: Path) -> None:
    manifest = load_manifest(package(tmp_path))
    entry = entry_of(manifest)
    message = refusal({"backend": "onnxruntime", "instance_group": [{"count": 2}],
                       "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [3]}]},
                      entry)
    assert "backend, input, instance_group differ(s)" in message and "model.toml" in message
    assert "preferred_batch_size" in refusal(
        {"dynamic_batching": {"preferred_batch_size": [2, 8]}}, entry)
    assert "dynamic_batching.priority_levels" in refusal(
        {"dynamic_batching": {"priority_levels": 3}}, entry)
    assert "max_batch_size" in refusal({"max_batch_size": 5000}, entry)  # over 1024
    assert "whole number" in refusal({"max_batch_size": "many"}, entry)
    flat = parse_manifest(SIMPLE.replace("[-1, 16]", "[1, 16]").replace(
        'labels = "labels.txt"', ""), "x")
    assert "no batch dimension" in refusal({"max_batch_size": 8}, entry_of(flat))
    assert not config_override({"max_batch_size": 0}, entry_of(flat))


def test_a_load_config_chooses_the_versions_served(tmp_path: Path) -> None:
    one = load_manifest(package(tmp_path))
    entry = entry_of(one, one.model_copy(update={"version": "2"}),
                     one.model_copy(update={"version": "3"}))
    latest = config_override({"version_policy": {"latest": {"num_versions": 2}}}, entry)
    assert latest.policy.served(["1", "2", "3"]) == ("2", "3")
    specific = config_override({"version_policy": {"specific": {"versions": [1, "3"]}}},
                               entry)
    assert specific.policy.served(["1", "2", "3"]) == ("1", "3")
    assert model_config(one, specific.policy)["version_policy"] == {
        "specific": {"versions": [1, 3]}}
    assert not config_override({"version_policy": {"all": {}}}, entry)
    assert "not in the repository" in refusal(
        {"version_policy": {"specific": {"versions": [7]}}}, entry)
    assert "whole numbers" in refusal(
        {"version_policy": {"specific": {"versions": ["v2"]}}}, entry)
    assert "num_versions" in refusal({"version_policy": {"latest": {"num_versions": 0}}},
                                     entry)
    assert "version_policy" in refusal({"version_policy": {"newest": {}}}, entry)


# --- statistics -----------------------------------------------------------------------

TIMINGS = {"queue_wait": 2.0, "payload_fetch": 0.5, "preprocess": 1.0, "predict": 3.0,
           "postprocess": 0.25, "model_load": 40.0}


def test_statistics_count_each_phase_in_the_protocols_shape() -> None:
    stats = InferenceStatistics("gw-a", clock=lambda: 100.0)
    stats.record("simple", "1", True, 0.010, TIMINGS, batch_size=4)
    stats.record("simple", "1", False, 0.002, {})
    body = model_stats(stats.fleet("simple"))
    [one] = body["model_stats"]
    assert (one["name"], one["version"], one["last_inference"]) == ("simple", "1", 100_000)
    assert (one["inference_count"], one["execution_count"]) == (4, 1)
    phases = one["inference_stats"]
    assert phases["success"] == {"count": 1, "ns": 10_000_000}
    assert phases["fail"] == {"count": 1, "ns": 2_000_000}
    assert phases["queue"] == {"count": 1, "ns": 2_000_000}
    assert phases["compute_input"] == {"count": 1, "ns": 1_500_000}
    assert phases["compute_infer"] == {"count": 1, "ns": 3_000_000}
    assert phases["compute_output"] == {"count": 1, "ns": 250_000}
    assert [b["batch_size"] for b in one["batch_stats"]] == [4]


def test_statistics_are_summed_over_gateways_through_their_events() -> None:
    a, b = InferenceStatistics("gw-a"), InferenceStatistics("gw-b")
    a.record("simple", "1", True, 0.01, TIMINGS)
    b.record("simple", "1", True, 0.01, TIMINGS)
    b.record("other", "2", True, 0.01, TIMINGS)
    event_a, event_b = a.event(), b.event()
    assert event_a is not None and event_b is not None
    assert a.event() is None  # nothing changed since
    a.observe(event_a)  # its own: ignored, its counts are live
    a.observe(event_b)
    b.observe(event_a)
    for gateway in (a, b):
        fleet = gateway.fleet()
        assert fleet[("simple", "1")].phases["success"][0] == 2
        assert fleet[("other", "2")].execution_count == 1
    b.record("simple", "1", True, 0.01, TIMINGS)  # a later event replaces, never adds twice
    later = b.event()
    assert later is not None and [m for m, _, _ in later["models"]] == ["simple"]
    a.observe(later)
    assert a.fleet("simple", "1")[("simple", "1")].phases["success"][0] == 3


def test_a_malformed_statistics_event_is_ignored() -> None:
    a = InferenceStatistics("gw-a")
    a.observe({"kind": "inference_stats", "gateway_id": "gw-x", "models": [
        ["m", "1", {"phases": {"success": ["x", 1]}}], "junk", ["m"]]})
    a.observe({"kind": "inference_stats", "gateway_id": "gw-y", "models": "nope"})
    assert a.fleet() == {}


def test_an_unsent_event_goes_out_with_the_next() -> None:
    a = InferenceStatistics("gw-a")
    a.record("m", "1", True, 0.01, TIMINGS)
    first = a.event()
    assert first is not None
    a.unsent(first)
    again = a.event()
    assert again is not None and [m for m, _, _ in again["models"]] == ["m"]


# --- the gRPC messages ----------------------------------------------------------------

def test_the_generated_grpc_messages_are_current(tmp_path: Path) -> None:
    """inference_pb2.py is what `make grpc-proto` makes of inference.proto today."""
    from grpc_tools import protoc

    src = Path(__file__).resolve().parents[2] / "src"
    proto = "modelfleet/gateway/grpc_api/inference.proto"
    assert protoc.main(["protoc", f"-I{src}", f"--python_out={tmp_path}", str(src / proto)]) == 0
    made = (tmp_path / proto).with_name("inference_pb2.py").read_text()
    assert made == (src / proto).with_name("inference_pb2.py").read_text(), \
        "run `make grpc-proto` and commit inference_pb2.py"


def test_grpc_tensors_round_trip_through_the_v2_body() -> None:
    from modelfleet.gateway.grpc_api import inference_pb2 as pb
    from modelfleet.gateway.grpc_api.tensors import request_body, response_message
    from modelfleet.oip.codec import OutputTensor, encode_response

    request = pb.ModelInferRequest(model_name="simple", id="r1")
    request.inputs.add(name="INPUT0", datatype="INT32", shape=[1, 16],
                       contents=pb.InferTensorContents(int_contents=list(range(16))))
    request.parameters["sequence_id"].int64_param = 7
    request.outputs.add(name="OUTPUT0").parameters["classification"].int64_param = 2
    body, header_length = request_body(request)
    parsed = parse_request(body, header_length)
    assert parsed.id == "r1" and parsed.parameters["sequence_id"] == 7
    assert parsed.binary_output and parsed.outputs is not None
    assert parsed.outputs[0].classification == 2
    assert parsed.decode_inputs()["INPUT0"].tolist() == [list(range(16))]
    out = encode_response("simple", "1", [OutputTensor(
        "OUTPUT0", np.array([[b"a", b"bc"]], dtype=object), "BYTES", binary=True)], "r1")
    response = response_message(*out)
    assert (response.model_name, response.model_version, response.id) == ("simple", "1", "r1")
    assert list(response.outputs[0].shape) == [1, 2]
    assert response.raw_output_contents[0] == b"\x01\x00\x00\x00a\x02\x00\x00\x00bc"


def test_grpc_contents_out_of_range_are_refused() -> None:
    from modelfleet.gateway.grpc_api import inference_pb2 as pb
    from modelfleet.gateway.grpc_api.tensors import request_body

    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="UINT8", shape=[1],
                       contents=pb.InferTensorContents(uint_contents=[300]))
    with pytest.raises(RequestRejected, match="x"):
        request_body(request)
    half = pb.ModelInferRequest(model_name="m")
    half.inputs.add(name="h", datatype="FP16", shape=[1])
    with pytest.raises(RequestRejected, match="raw_input_contents"):
        request_body(half)


def test_an_image_inputs_layout_is_in_its_config_and_must_fit_its_shape() -> None:
    image = SIMPLE.replace('shape = [-1, 16]\n[[outputs]]',
                           'shape = [-1, 3, 8, 8]\nformat = "NCHW"\n[[outputs]]', 1)
    config = model_config(parse_manifest(image, "x"))
    assert config["input"][0]["format"] == "FORMAT_NCHW" and config["input"][0]["dims"] == [
        3, 8, 8]
    with pytest.raises(ManifestError, match="layout of 3 dimensions"):
        parse_manifest(SIMPLE.replace('shape = [-1, 16]\n[[outputs]]',
                                      'shape = [-1, 16]\nformat = "NHWC"\n[[outputs]]', 1),
                       "x")
    with pytest.raises(ManifestError, match="an input's image layout"):
        parse_manifest(SIMPLE.replace('labels = "labels.txt"', 'format = "NCHW"'), "x")
