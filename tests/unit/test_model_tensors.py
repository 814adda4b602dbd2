"""A tensor signature in model.toml, and v2 requests through a handler (no server)."""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelfleet import LocalModel
from modelfleet.errors import ManifestError, ModelFailed, RequestRejected
from modelfleet.oip import HEADER_LENGTH_PARAM, OIP_CONTENT_TYPE
from modelfleet.oip.codec import decode_response, encode_request
from modelfleet.repository.manifest import parse_manifest

MODELS = Path(__file__).resolve().parents[2] / "examples" / "models"
BASE = 'name = "t"\nentrypoint = "handler:H"\n'
SIGNATURE = """
[[inputs]]
name = "a"
datatype = "FP32"
shape = [-1, 2]

[[inputs]]
name = "words"
datatype = "BYTES"
shape = [-1]

[[outputs]]
name = "sum"
datatype = "FP64"
shape = [-1]

[[outputs]]
name = "upper"
datatype = "BYTES"
shape = [-1]
"""


# --- the manifest --------------------------------------------------------------------

def test_signature_is_parsed_and_the_model_also_accepts_v2() -> None:
    manifest = parse_manifest(BASE + SIGNATURE, "model.toml")
    assert manifest.has_signature
    assert [(s.name, s.datatype, s.shape) for s in manifest.inputs] == [
        ("a", "FP32", (-1, 2)), ("words", "BYTES", (-1,))]
    assert [s.name for s in manifest.outputs] == ["sum", "upper"]
    assert manifest.accepts == ("application/json", OIP_CONTENT_TYPE)


def test_a_model_without_signature_is_unchanged() -> None:
    manifest = parse_manifest(BASE, "model.toml")
    assert not manifest.has_signature and manifest.accepts == ("application/json",)


@pytest.mark.parametrize(("toml", "field", "match"), [
    ('[[inputs]]\nname = "a"\ndatatype = "FLOAT"\nshape = [1]\n', "inputs.0.datatype",
     "Input should be 'BOOL'"),
    ('[[inputs]]\nname = "a"\ndatatype = "FP32"\nshape = [-2]\n', "inputs.0.shape",
     "-1 for any size"),
    ('[[inputs]]\nname = "a"\ndatatype = "FP32"\nshape = "1"\n', "inputs.0.shape", "tuple"),
    ('[[inputs]]\nname = "a"\ndatatype = "FP32"\nshape = [1.5]\n', "inputs.0.shape.0",
     "integer"),
    ('[[inputs]]\nname = ""\ndatatype = "FP32"\nshape = [1]\n', "inputs.0.name", "at least 1"),
    ('[[inputs]]\nname = "a"\ndatatype = "FP32"\n', "inputs.0.shape", "Field required"),
    ('[[inputs]]\nname = "a"\ndatatype = "FP32"\nshape = [1]\nsize = 3\n', "inputs.0.size",
     "unknown field"),
    ('[[inputs]]\nname = "a"\ndatatype = "FP32"\nshape = [1]\n', "(root)",
     "both [[inputs]] and [[outputs]]"),
    ('[[outputs]]\nname = "a"\ndatatype = "FP32"\nshape = [1]\n', "(root)",
     "both [[inputs]] and [[outputs]]"),
    ('[[inputs]]\nname = "a"\ndatatype = "FP32"\nshape = [1]\n'
     '[[inputs]]\nname = "a"\ndatatype = "FP64"\nshape = [1]\n'
     '[[outputs]]\nname = "b"\ndatatype = "FP32"\nshape = [1]\n', "(root)",
     "input name(s) ['a'] declared more than once"),
])
def test_bad_signatures_name_the_field(toml: str, field: str, match: str) -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(BASE + toml, "pkg/model.toml")
    assert info.value.field == field
    assert match in info.value.problem
    assert str(info.value).startswith("pkg/model.toml: field")


def test_accepting_v2_needs_a_signature() -> None:
    with pytest.raises(ManifestError, match="declares no tensor signature"):
        parse_manifest(BASE + f'accepts = ["{OIP_CONTENT_TYPE}"]\n', "model.toml")


# --- a handler's tensor path ---------------------------------------------------------

HANDLER = """
import numpy as np
from modelfleet import Model

class H(Model):
    answer = "dict"

    def predict(self, batch):
        outputs = []
        for tensors in batch:
            total = tensors["a"].astype(np.float64).sum(axis=1)
            upper = [w.upper() for w in tensors["words"]]
            if self.answer == "dict":
                outputs.append({"sum": total, "upper": upper})
            elif self.answer == "list":
                outputs.append([total, upper])
            else:
                outputs.append(self.answer)
        return outputs
"""


@pytest.fixture
def model(tmp_path: Path) -> LocalModel:
    package = tmp_path / "t" / "1"
    package.mkdir(parents=True)
    (package / "model.toml").write_text(BASE + SIGNATURE)
    (package / "handler.py").write_text(textwrap.dedent(HANDLER))
    return LocalModel.from_package(package)


INPUTS = {"a": np.array([[1, 2], [3, 4.5]], np.float32),
          "words": np.array([b"hi", b"there"], dtype=object)}


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("answer", ["dict", "list"])
def test_the_handler_gets_arrays_and_returns_arrays(model: LocalModel, binary: bool,
                                                    answer: str) -> None:
    model.handler.answer = answer  # type: ignore[attr-defined]
    out = model.infer_tensors(INPUTS, binary=binary)
    assert out["sum"].tolist() == [3.0, 7.5]
    assert out["upper"].tolist() == [b"HI", b"THERE"]


def raw_answer(model: LocalModel, doc: dict[str, Any]) -> Any:
    return model.infer(json.dumps(doc).encode(), OIP_CONTENT_TYPE)


def doc_of(inputs: dict[str, np.ndarray], **extra: Any) -> dict[str, Any]:
    body, _ = encode_request(inputs)
    return {**json.loads(body), **extra}


def test_the_response_echoes_the_id_and_names_the_model(model: LocalModel) -> None:
    answer = raw_answer(model, doc_of(INPUTS, id="r-7"))
    doc = json.loads(answer.body)
    assert (doc["id"], doc["model_name"], doc["model_version"]) == ("r-7", "t", "1")
    assert answer.content_type == "application/json"


PARAMS_HANDLER = """
from modelfleet import Model

class H(Model):
    async def preprocess(self, request):
        return dict(request.params)

    def predict(self, batch):
        return [{"sum": [0.0], "upper": [str(sorted(item.items())).encode()]} for item in batch]
"""


def test_the_handler_gets_the_requests_own_parameters(tmp_path: Path) -> None:
    package = tmp_path / "t" / "1"
    package.mkdir(parents=True)
    (package / "model.toml").write_text(BASE + SIGNATURE)
    (package / "handler.py").write_text(textwrap.dedent(PARAMS_HANDLER))
    model = LocalModel.from_package(package)
    body, header_length = encode_request(INPUTS, binary=True, parameters={
        "top_k": 3, "mode": "fast", "exact": True, "timeout": 5_000_000})
    [answer] = asyncio.run(model.ainfer_many([(body, OIP_CONTENT_TYPE)],
                                             {HEADER_LENGTH_PARAM: str(header_length)}))
    _, arrays = decode_response(answer.body)
    # strings as they are, other values as JSON; timeout (the protocol's) and the header
    # length (the transport's) are not the handler's
    assert arrays["upper"].tolist() == [
        b"[('exact', 'true'), ('mode', 'fast'), ('top_k', '3')]"]


def test_only_the_requested_outputs_in_the_format_asked(model: LocalModel) -> None:
    answer = raw_answer(model, doc_of(INPUTS, outputs=[
        {"name": "upper", "parameters": {"binary_data": True}}]))
    header_length = answer.header_length
    assert header_length is not None
    doc, arrays = decode_response(answer.body, header_length)
    assert [o["name"] for o in doc["outputs"]] == ["upper"]
    assert arrays["upper"].tolist() == [b"HI", b"THERE"]


async def test_binary_request_needs_its_header_length(model: LocalModel) -> None:
    body, header_length = encode_request(INPUTS, binary=True)
    with pytest.raises(RequestRejected, match="needs the Inference-Header-Content-Length"):
        await model.ainfer(body, OIP_CONTENT_TYPE)  # the header length did not travel
    [answer] = await model.ainfer_many([(body, OIP_CONTENT_TYPE)],
                                       {HEADER_LENGTH_PARAM: str(header_length)})
    assert decode_response(answer.body)[1]["sum"].tolist() == [3.0, 7.5]


@pytest.mark.parametrize(("inputs", "match"), [
    ({"a": INPUTS["a"]}, r"needs input\(s\) \['words'\]"),
    ({**INPUTS, "a": INPUTS["a"].astype(np.float64)}, "is FP32, got FP64"),
    ({**INPUTS, "a": np.zeros((2, 3), np.float32)}, r"got \[2, 3\]"),
])
def test_requests_off_the_signature_are_refused(model: LocalModel, inputs: dict[str, Any],
                                                match: str) -> None:
    with pytest.raises(RequestRejected, match=match):
        model.infer_tensors(inputs)


@pytest.mark.parametrize(("answer", "match"), [
    ({"sum": np.zeros(2)}, r"returned outputs \['sum'\]; model.toml declares"),
    ({"sum": np.zeros(2), "upper": [b"a", b"b"], "extra": 1}, "returned outputs"),
    ("text", "answered a v2 request with str"),
    ([np.zeros(2)], "answered a v2 request with list"),
    ({"sum": np.zeros((2, 2)), "upper": [b"a", b"b"]}, r"shape \[2, 2\]; model.toml declares"),
    ({"sum": np.array(["x", "y"]), "upper": [b"a", b"b"]}, "holds <U1 values"),
    ({"sum": np.zeros(2), "upper": [1, 2]}, "element 0 is int"),
])
def test_outputs_off_the_signature_are_the_handlers_fault(model: LocalModel, answer: Any,
                                                          match: str) -> None:
    model.handler.answer = answer  # type: ignore[attr-defined]
    with pytest.raises(ModelFailed, match=match):
        model.infer_tensors(INPUTS)


def test_v2_on_a_model_without_signature_is_refused(tmp_path: Path) -> None:
    package = tmp_path / "plain" / "1"
    package.mkdir(parents=True)
    (package / "model.toml").write_text('name = "plain"\nentrypoint = "handler:H"\n')
    (package / "handler.py").write_text(textwrap.dedent(HANDLER))
    plain = LocalModel.from_package(package)
    with pytest.raises(RequestRejected, match="declares no tensor signature"):
        plain.infer(json.dumps(doc_of(INPUTS)).encode(), OIP_CONTENT_TYPE)


# --- the iris example on both APIs ---------------------------------------------------

@pytest.fixture(scope="module")
def iris() -> LocalModel:
    return LocalModel.from_package(MODELS / "iris" / "1")


def test_iris_classifies_rows_of_a_tensor(iris: LocalModel) -> None:
    rows = np.array([[5.1, 3.5, 1.4, 0.2], [7.0, 3.2, 4.7, 1.4], [6.3, 3.3, 6.0, 2.5]],
                    np.float32)
    out = iris.infer_tensors({"features": rows}, binary=True)
    assert out["class"].tolist() == [b"setosa", b"versicolor", b"virginica"]
    assert out["class_index"].tolist() == [0, 1, 2]
    assert out["probabilities"].dtype == np.float32
    np.testing.assert_allclose(out["probabilities"].sum(axis=1), 1.0, rtol=1e-5)


async def test_iris_batches_v1_and_v2_requests_together(iris: LocalModel) -> None:
    body, _ = encode_request({"features": np.array([[6.3, 3.3, 6.0, 2.5]] * 2, np.float32)})
    results = await iris.ainfer_many([
        (b'{"features": [5.1, 3.5, 1.4, 0.2]}', "application/json"),
        (body, OIP_CONTENT_TYPE),
    ])
    assert results[0]["class"] == "setosa"
    _, arrays = decode_response(results[1].body)
    assert arrays["class"].tolist() == [b"virginica", b"virginica"]


def test_iris_refuses_non_finite_features(iris: LocalModel) -> None:
    with pytest.raises(RequestRejected, match="finite"):
        iris.infer_tensors({"features": np.array([[np.nan, 1, 1, 1]], np.float32)})


def test_iris_answers_an_empty_tensor(iris: LocalModel) -> None:
    out = iris.infer_tensors({"features": np.zeros((0, 4), np.float32)})
    assert out["probabilities"].shape == (0, 3) and out["class"].shape == (0,)
