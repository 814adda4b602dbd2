"""The model author's API: Request, Context, Model defaults, run_pipeline, import_handler,
LocalModel. Handlers here are tiny packages written to a temporary folder."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from modelfleet import Context, InvalidInput, LocalModel, Model, Output, Request
from modelfleet.errors import ModelFailed, ModelLoadFailed, RequestRejected
from modelfleet.model.importer import import_handler
from modelfleet.model.local import run_pipeline
from modelfleet.repository.manifest import parse_manifest


def write_package(root: Path, source: str, *, name: str = "pkg", version: str = "1",
                  entrypoint: str = "handler:Handler", module_path: str = "handler.py",
                  extra_toml: str = "") -> Path:
    package = root / name / version
    (package / module_path).parent.mkdir(parents=True, exist_ok=True)
    (package / "model.toml").write_text(
        f'name = "{name}"\nversion = "{version}"\nentrypoint = "{entrypoint}"\n{extra_toml}'
    )
    (package / module_path).write_text(textwrap.dedent(source))
    return package


def manifest_for(package: Path) -> Any:
    return parse_manifest((package / "model.toml").read_text(), str(package / "model.toml"))


def run(model: Model, bodies: list[bytes]) -> list[Any]:
    return asyncio.run(run_pipeline(model, [Request(b, "application/json") for b in bodies]))


# --- Request, Context, Model defaults ----------------------------------------------


def test_request_json_parses_the_body() -> None:
    assert Request(b'{"a": [1, 2.5, null]}', "application/json").json() == {"a": [1, 2.5, None]}


@pytest.mark.parametrize("body", [b"{not json", b"", b'{"a": 1} trailing', b"\xff\xfe\x00"])
def test_request_json_rejects_malformed_json_as_invalid_input(body: bytes) -> None:
    with pytest.raises(InvalidInput, match="not valid JSON") as info:
        Request(body, "application/json").json()
    assert isinstance(info.value, RequestRejected)
    assert info.value.code == "invalid_input"


def test_request_text_decodes_utf8() -> None:
    assert Request("héllo ✓".encode(), "text/plain").text() == "héllo ✓"


def test_request_text_rejects_bytes_that_are_not_utf8() -> None:
    with pytest.raises(InvalidInput, match="not valid UTF-8"):
        Request(b"caf\xe9", "text/plain").text()


def test_request_is_frozen_with_empty_defaults() -> None:
    request = Request(b"x", "text/plain")
    assert (dict(request.params), request.request_id, request.deadline_ms) == ({}, "", 0)
    with pytest.raises(AttributeError):
        request.body = b"y"  # type: ignore[misc]


def test_context_artifact_is_a_path_inside_the_package(tmp_path: Path) -> None:
    ctx = Context("m", "1", tmp_path, "cpu")
    assert ctx.artifact("artifacts/w.bin") == tmp_path / "artifacts" / "w.bin"


def test_output_defaults_to_octet_stream() -> None:
    assert Output(b"\x00").content_type == "application/octet-stream"


def test_model_defaults_pass_the_body_through_and_demand_predict() -> None:
    model = Model()
    model.load(Context("m", "1", Path("."), "cpu"))
    request = Request(b"raw", "application/octet-stream")
    assert asyncio.run(model.preprocess(request)) == b"raw"
    assert asyncio.run(model.postprocess({"x": 1}, request)) == {"x": 1}
    with pytest.raises(NotImplementedError, match="must implement predict"):
        model.predict([b"raw"])
    model.unload()


def test_a_model_without_predict_fails_its_requests_with_model_failed() -> None:
    [result] = run(Model(), [b"1"])
    assert isinstance(result, ModelFailed)
    assert "predict" in str(result)


# --- run_pipeline --------------------------------------------------------------------


class Recording(Model):
    """Doubles numbers; rejects bodies it cannot parse; remembers each predict batch."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []

    async def preprocess(self, request: Request) -> Any:
        value = request.json()
        if value == "boom":
            raise KeyError("boom")  # a handler bug, not the caller's fault
        if not isinstance(value, int):
            raise InvalidInput(f"expected an integer, got {value!r}")
        return value

    def predict(self, batch: list[Any]) -> list[Any]:
        self.batches.append(list(batch))
        if -1 in batch:
            raise InvalidInput("-1 is not allowed")
        return [2 * x for x in batch]

    async def postprocess(self, output: Any, request: Request) -> Any:
        if output == 26:
            raise ValueError("unlucky")
        return {"double": output}


def test_pipeline_answers_each_request_in_order() -> None:
    model = Recording()
    assert run(model, [b"1", b"2", b"3"]) == [{"double": 2}, {"double": 4}, {"double": 6}]
    assert sorted(x for b in model.batches for x in b) == [1, 2, 3]


def test_pipeline_keeps_order_when_preprocess_finishes_out_of_order() -> None:
    class Staggered(Recording):
        async def preprocess(self, request: Request) -> Any:
            value = request.json()
            for _ in range(10 - value):  # the first request finishes last
                await asyncio.sleep(0)
            return value

    assert run(Staggered(), [b"1", b"5", b"9"]) == [{"double": 2}, {"double": 10},
                                                      {"double": 18}]


def test_one_bad_input_in_preprocess_fails_only_its_own_request() -> None:
    model = Recording()
    results = run(model, [b"1", b'"two"', b"3"])
    assert results[0] == {"double": 2} and results[2] == {"double": 6}
    assert isinstance(results[1], InvalidInput)
    assert "expected an integer" in str(results[1])
    assert sorted(x for b in model.batches for x in b) == [1, 3]  # predict never saw it


def test_a_handler_bug_in_preprocess_is_model_failed_for_that_request_only() -> None:
    results = run(Recording(), [b'"boom"', b"4"])
    assert isinstance(results[0], ModelFailed) and "KeyError" in str(results[0])
    assert results[1] == {"double": 8}


def test_a_bad_input_rejected_by_predict_fails_only_its_own_request() -> None:
    results = run(Recording(), [b"1", b"-1", b"3"])
    assert results[0] == {"double": 2} and results[2] == {"double": 6}
    assert isinstance(results[1], InvalidInput)


def test_a_failing_postprocess_fails_only_its_own_request() -> None:
    results = run(Recording(), [b"13", b"1"])
    assert isinstance(results[0], ModelFailed) and "unlucky" in str(results[0])
    assert results[1] == {"double": 2}


class WrongLength(Model):
    def predict(self, batch: list[Any]) -> list[Any]:
        return batch[:-1]


class NotAList(Model):
    def predict(self, batch: list[Any]) -> Any:
        return tuple(batch)


@pytest.mark.parametrize("model", [WrongLength(), NotAList()], ids=["short", "tuple"])
def test_predict_returning_the_wrong_shape_is_model_failed(model: Model) -> None:
    results = run(model, [b"1", b"2", b"3"])
    assert all(isinstance(r, ModelFailed) for r in results)
    assert all("expected a list of" in str(r) for r in results)


def test_predict_raising_is_model_failed_for_every_request() -> None:
    class Crashing(Model):
        def predict(self, batch: list[Any]) -> list[Any]:
            raise RuntimeError("CUDA out of memory")

    results = run(Crashing(), [b"1", b"2"])
    assert all(isinstance(r, ModelFailed) and "CUDA out of memory" in str(r) for r in results)


def test_output_from_postprocess_is_passed_through_untouched() -> None:
    class Png(Model):
        def predict(self, batch: list[Any]) -> list[Any]:
            return batch

        async def postprocess(self, output: Any, request: Request) -> Any:
            return Output(b"\x89PNG" + output, "image/png")

    [result] = run(Png(), [b"data"])
    assert result == Output(b"\x89PNGdata", "image/png")


def test_predict_runs_off_the_event_loop() -> None:
    class WhereAmI(Model):
        def predict(self, batch: list[Any]) -> list[Any]:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return ["thread"] * len(batch)
            return ["loop"] * len(batch)

    assert run(WhereAmI(), [b"1"]) == ["thread"]


# --- import_handler --------------------------------------------------------------------

HANDLER = """
    from modelfleet import Model

    class Handler(Model):
        def predict(self, batch):
            return [{"who": __name__, "n": len(batch)} for _ in batch]
"""


def test_import_handler_returns_the_model_class(tmp_path: Path) -> None:
    package = write_package(tmp_path, HANDLER)
    handler = import_handler(manifest_for(package), package)
    assert issubclass(handler, Model) and handler.__name__ == "Handler"
    assert str(package) not in sys.path  # only on sys.path during the import


def test_two_packages_may_both_ship_handler_py(tmp_path: Path) -> None:
    first = write_package(tmp_path, HANDLER, name="first")
    second = write_package(tmp_path, HANDLER.replace('"who"', '"which"'), name="second")
    a = import_handler(manifest_for(first), first)
    b = import_handler(manifest_for(second), second)
    assert a is not b and a.__module__ != b.__module__
    assert list(a().predict([1])[0]) == ["who", "n"]
    assert list(b().predict([1])[0]) == ["which", "n"]


def test_import_handler_finds_a_dotted_module_path(tmp_path: Path) -> None:
    package = write_package(tmp_path, HANDLER, entrypoint="serving.handler:Handler",
                            module_path="serving/handler.py")
    assert import_handler(manifest_for(package), package).__name__ == "Handler"


def test_missing_entrypoint_module_is_model_load_failed(tmp_path: Path) -> None:
    package = write_package(tmp_path, HANDLER, entrypoint="absent:Handler")
    with pytest.raises(ModelLoadFailed, match=r"model 'pkg': entrypoint module .*absent\.py"):
        import_handler(manifest_for(package), package)


@pytest.mark.parametrize(
    ("entrypoint", "source"),
    [
        ("handler:Missing", HANDLER),
        ("handler:Plain", "class Plain:\n    def predict(self, batch):\n        return batch\n"),
        ("handler:instance", textwrap.dedent(HANDLER) + "\ninstance = Handler()\n"),
        ("handler:predict", "def predict(batch):\n    return batch\n"),
    ],
    ids=["missing-class", "not-a-model", "an-instance", "a-function"],
)
def test_entrypoint_that_is_not_a_model_subclass_is_model_load_failed(
    tmp_path: Path, entrypoint: str, source: str
) -> None:
    package = write_package(tmp_path, source, entrypoint=entrypoint)
    with pytest.raises(ModelLoadFailed, match=r"is not a modelfleet\.Model subclass") as info:
        import_handler(manifest_for(package), package)
    assert entrypoint in str(info.value) and "'pkg'" in str(info.value)


@pytest.mark.parametrize(
    ("source", "cause"),
    [
        ("import no_such_dependency_xyz\n", "No module named 'no_such_dependency_xyz'"),
        ("raise RuntimeError('weights server down')\n", "weights server down"),
        ("def broken(:\n", "SyntaxError"),
    ],
    ids=["missing-dependency", "raises", "syntax-error"],
)
def test_a_module_that_fails_to_import_is_model_load_failed(
    tmp_path: Path, source: str, cause: str
) -> None:
    package = write_package(tmp_path, source)
    before = set(sys.modules)
    with pytest.raises(ModelLoadFailed, match=r"importing .*handler\.py failed") as info:
        import_handler(manifest_for(package), package)
    assert cause in str(info.value)
    assert str(package) not in sys.path
    assert not {m for m in set(sys.modules) - before if m.startswith("modelfleet_pkg_pkg")}


def test_model_load_failed_is_not_the_callers_fault() -> None:
    assert not issubclass(ModelLoadFailed, RequestRejected)
    assert ModelLoadFailed("x").code == "model_load_failed"


# --- LocalModel ----------------------------------------------------------------------

LOADING = """
    from modelfleet import InvalidInput, Model

    class Handler(Model):
        def load(self, ctx):
            self.ctx = ctx
            self.weights = float(ctx.artifact("weights.txt").read_text())

        async def preprocess(self, request):
            value = request.json()
            if not isinstance(value, (int, float)):
                raise InvalidInput("expected a number")
            return value

        def predict(self, batch):
            return [self.weights * x for x in batch]

        async def postprocess(self, output, request):
            return {"y": output}
"""


@pytest.fixture
def loading_package(tmp_path: Path) -> Path:
    package = write_package(tmp_path, LOADING, name="scaler", version="2",
                            extra_toml="[isolation]\nmemory_limit_mb = 64\n")
    (package / "weights.txt").write_text("3.0")
    return package


def test_local_model_loads_with_the_packages_context(loading_package: Path) -> None:
    model = LocalModel.from_package(loading_package)
    ctx = model.handler.ctx
    assert (ctx.model_id, ctx.version, ctx.package_dir, ctx.device) == (
        "scaler", "2", loading_package, "cpu")
    assert ctx.memory_limit_bytes == 64 * 1024 * 1024
    assert model.manifest.name == "scaler"


def test_local_model_infer_runs_the_whole_pipeline(loading_package: Path) -> None:
    model = LocalModel.from_package(str(loading_package))
    assert model.infer(b"2", "application/json") == {"y": 6.0}


async def test_local_model_ainfer_and_ainfer_many(loading_package: Path) -> None:
    model = LocalModel.from_package(loading_package)
    assert await model.ainfer(b"1", "application/json") == {"y": 3.0}
    items = [(b"1", "application/json"), (b"2", "application/json")]
    assert await model.ainfer_many(items) == [{"y": 3.0}, {"y": 6.0}]


async def test_local_model_ainfer_many_raises_a_failed_requests_error(
    loading_package: Path,
) -> None:
    model = LocalModel.from_package(loading_package)
    with pytest.raises(InvalidInput, match="expected a number"):
        await model.ainfer_many([(b"1", "application/json"), (b'"x"', "application/json")])


def test_local_model_infer_raises_invalid_input(loading_package: Path) -> None:
    with pytest.raises(InvalidInput, match="not valid JSON"):
        LocalModel.from_package(loading_package).infer(b"{", "application/json")


def test_local_model_reports_an_invalid_manifest(tmp_path: Path) -> None:
    package = write_package(tmp_path, HANDLER, extra_toml='colour = "red"\n')
    from modelfleet.errors import ManifestError

    with pytest.raises(ManifestError, match="colour"):
        LocalModel.from_package(package)
