"""The v2 routes' pure parts: error statuses, the timeout parameter, model metadata."""

from __future__ import annotations

import json

import pytest

from modelfleet.errors import (
    ClientGone,
    DeadlineExceeded,
    InvalidInput,
    ModelFailed,
    ModelNotFound,
    ModelUnavailable,
    NoCapacity,
    PayloadTooLarge,
    RequestRejected,
    UnsupportedContentType,
)
from modelfleet.gateway.inflight import RequestTimeout
from modelfleet.gateway.oip import deadline_request, model_metadata, v2_error
from modelfleet.oip.codec import parse_request
from modelfleet.repository.manifest import parse_manifest


@pytest.mark.parametrize(("error", "status"), [
    (RequestRejected("x"), 400), (InvalidInput("x"), 400), (UnsupportedContentType("x"), 400),
    (ModelNotFound("x"), 404), (RequestTimeout("x"), 408), (PayloadTooLarge("x"), 413),
    (ClientGone("x"), 499), (ModelFailed("x"), 500), (NoCapacity("x", 3), 503),
    (ModelUnavailable("x"), 503), (DeadlineExceeded("x"), 504),
])
def test_v2_errors_are_a_message_with_the_spec_status(error: Exception, status: int) -> None:
    answer = v2_error(error)  # type: ignore[arg-type]
    assert answer.status_code == status
    # An unknown model in the protocol's words (Triton's clients check them), then ours.
    message = "Request for unknown model: x" if isinstance(error, ModelNotFound) else "x"
    assert json.loads(answer.body) == {"error": message}
    if status == 503:
        assert answer.headers["retry-after"] == ("3" if isinstance(error, NoCapacity) else "1")
    if status == 408:
        assert answer.headers["connection"] == "close"


def request_with(parameters: object) -> bytes:
    return json.dumps({"parameters": parameters, "inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}).encode()


def test_the_timeout_parameter_is_microseconds() -> None:
    assert deadline_request(parse_request(request_with({"timeout": 2_500_000})), 9.0) == 2.5
    assert deadline_request(parse_request(request_with({})), 9.0) == 9.0
    assert deadline_request(parse_request(request_with({})), None) is None


@pytest.mark.parametrize("timeout", [0, -5, 1.5, "100", True, None])
def test_a_bad_timeout_parameter_is_refused(timeout: object) -> None:
    doc = request_with({"timeout": timeout})
    if timeout is None:  # "timeout": null is the parameter's absence
        assert deadline_request(parse_request(doc), None) is None
        return
    with pytest.raises(RequestRejected, match="positive whole number of microseconds"):
        deadline_request(parse_request(doc), None)


def test_model_metadata_comes_from_the_manifest() -> None:
    manifest = parse_manifest('name = "m"\nversion = "2"\nentrypoint = "h:C"\n'
                              '[[inputs]]\nname = "a"\ndatatype = "INT8"\nshape = [-1, 3]\n'
                              '[[outputs]]\nname = "b"\ndatatype = "BYTES"\nshape = [1]\n',
                              "model.toml")
    assert model_metadata(manifest, ["1", "2"]) == {
        "name": "m", "versions": ["1", "2"], "platform": "modelfleet_python",
        "inputs": [{"name": "a", "datatype": "INT8", "shape": [-1, 3]}],
        "outputs": [{"name": "b", "datatype": "BYTES", "shape": [1]}]}
