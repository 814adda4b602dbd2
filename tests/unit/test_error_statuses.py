"""Errors mapped once: every modelfleet error carries its status, each dialect (/v1, /v2,
gRPC) renders it with one function, and nothing else in the gateway decides a status."""

from __future__ import annotations

import ast
import asyncio
import http
import importlib
import json
import pkgutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

import modelfleet
from modelfleet.errors import (
    ModelfleetError,
    ModelNotFound,
    NoCapacity,
    UnsupportedContentType,
    error_from_code,
)
from modelfleet.gateway.http import (
    error_response,
    load_failed,
    raw_error,
    v1_error,
    v2_error,
    v2_status,
)

GATEWAY = Path(modelfleet.__file__).parent / "gateway"


def _every_error_class() -> list[type[ModelfleetError]]:
    for module in pkgutil.walk_packages(modelfleet.__path__, "modelfleet."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)  # every subclass defined, wherever it is

    def walk(cls: type[ModelfleetError]) -> Iterator[type[ModelfleetError]]:
        yield cls
        for sub in cls.__subclasses__():
            yield from walk(sub)

    return sorted(set(walk(ModelfleetError)), key=lambda c: f"{c.__module__}.{c.__name__}")


ERRORS = _every_error_class()


def instance(cls: type[ModelfleetError], message: str = "what went wrong") -> ModelfleetError:
    """An instance of ``cls`` however its constructor is shaped (as ``error_from_code``)."""
    error = cls.__new__(cls)
    ModelfleetError.__init__(error, message)
    return error


def test_the_walk_finds_the_errors_defined_outside_errors_py() -> None:
    names = {cls.__name__ for cls in ERRORS}
    assert {"Unauthenticated", "RateLimited", "ShuttingDown", "RequestTimeout",
            "OrderStoreUnavailable", "TooManyConnections", "NoRoute"} <= names


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_error_has_a_status_and_renders_in_every_dialect(
        cls: type[ModelfleetError]) -> None:
    from modelfleet.gateway.grpc_api.servicer import grpc_status

    error = instance(cls)
    assert isinstance(cls.status, int)
    assert 400 <= cls.status < 600, "an error's status is a 4xx or a 5xx"
    assert cls.status == 499 or cls.status in set(http.HTTPStatus)
    if cls.status == 503:
        assert cls.retry_after_s is not None and cls.retry_after_s >= 1, \
            "every 503 tells the caller when to come back"
    if cls.retry_after_s is not None:
        assert cls.status in (429, 503)

    v1 = v1_error(error)
    assert v1.status_code == cls.status
    assert json.loads(v1.body) == {"error": {"code": cls.code, "message": "what went wrong"}}
    v2 = v2_error(error)
    assert v2.status_code == v2_status(error)
    assert v2.status_code == (400 if cls.status in (415, 422) else cls.status)
    body = json.loads(v2.body)
    assert list(body) == ["error"] and isinstance(body["error"], str)
    assert body["error"].endswith("what went wrong")
    for answer in (v1, v2):
        if cls.retry_after_s is not None:
            assert answer.headers["retry-after"] == str(cls.retry_after_s)
        else:
            assert "retry-after" not in answer.headers
        assert (answer.headers.get("connection") == "close") == cls.closes_connection
    code = grpc_status(error)
    assert isinstance(code, grpc.StatusCode) and code is not grpc.StatusCode.OK
    # PackageNotPolled is INTERNAL on gRPC on purpose: Triton answers it so, and its
    # simple_grpc_model_control example checks it (test_triton_model_control).
    if cls.status < 500 and cls.status not in (405, 409, 431) \
            and cls.code != "package_not_polled":
        assert code is not grpc.StatusCode.INTERNAL, "a caller's mistake is not INTERNAL"


@pytest.mark.parametrize("cls", [c for c in ERRORS if c.__module__ == "modelfleet.errors"],
                         ids=lambda c: c.__name__)
def test_an_error_rebuilt_from_its_code_keeps_its_status(cls: type[ModelfleetError]) -> None:
    """What travels in a Reply (code, message) answers with the status it was raised with."""
    rebuilt = error_from_code(cls.code, "m")  # (a ManifestError's is a ConfigError)
    assert (rebuilt.status, rebuilt.retry_after_s) == (cls.status, cls.retry_after_s)


def test_statuses_of_note_in_each_dialect() -> None:
    from modelfleet.gateway.grpc_api.servicer import grpc_status
    from modelfleet.tenancy import RateLimited, TenancyStoreError, Unauthenticated

    limited = RateLimited("slow down", 7)
    assert v1_error(limited).status_code == 429
    assert v1_error(limited).headers["retry-after"] == "7"
    assert grpc_status(limited) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert v1_error(NoCapacity("busy", 4)).headers["retry-after"] == "4"
    refused = v2_error(Unauthenticated("no key"))
    assert refused.status_code == 401 and "Bearer" in refused.headers["www-authenticate"]
    assert grpc_status(Unauthenticated("no key")) is grpc.StatusCode.UNAUTHENTICATED
    # The key store failing is the same 503 over HTTP and gRPC (gRPC said INTERNAL).
    assert v1_error(TenancyStoreError("down")).status_code == 503
    assert grpc_status(TenancyStoreError("down")) is grpc.StatusCode.UNAVAILABLE
    assert v2_error(UnsupportedContentType("x")).status_code == 400  # the spec's 400
    assert v1_error(UnsupportedContentType("x")).status_code == 415
    assert json.loads(v2_error(ModelNotFound("m")).body) == \
        {"error": "Request for unknown model: m"}


def test_a_load_failure_keeps_the_errors_class_and_status() -> None:
    from modelfleet.control.orders import OrderStoreUnavailable
    from modelfleet.tenancy import RateLimited

    worded = load_failed("m", OrderStoreUnavailable("the orders' database is down"))
    assert isinstance(worded, OrderStoreUnavailable)
    assert worded.message == "failed to load 'm': the orders' database is down"
    assert str(worded) == worded.message
    answer = v2_error(worded)
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    limited = load_failed("m", RateLimited("slow down", 9))
    assert (limited.status, limited.retry_after_s) == (429, 9)
    missing = load_failed("m", ModelNotFound("no model named 'm'"))
    assert json.loads(v2_error(missing).body) == {"error": "failed to load 'm': no model "
                                                           "named 'm'"}


def test_the_dialect_follows_the_path() -> None:
    error = ModelNotFound("no model named 'x'")
    assert json.loads(error_response(error, "/v1/models/x").body)["error"]["code"] == \
        "model_not_found"
    assert json.loads(error_response(error, "/v2/models/x").body) == \
        {"error": "Request for unknown model: no model named 'x'"}
    raw = raw_error(error, "/v2/models/x/infer")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404 Not Found\r\n")
    assert b"connection: close" in head.lower() and b"content-type: application/json" in head
    assert json.loads(body) == {"error": "Request for unknown model: no model named 'x'"}
    assert f"content-length: {len(body)}".encode() in head


async def _asgi_answer(app: Any, path: str, headers: list[tuple[bytes, bytes]]
                       ) -> tuple[int, dict[bytes, bytes], Any]:
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers,
             "query_string": b""}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), json.loads(body)


@pytest.mark.parametrize(("path", "shape"), [("/v1/models/m/infer", dict),
                                             ("/v2/models/m/infer", str)])
async def test_the_edges_own_answers_are_in_the_paths_dialect(path: str, shape: type) -> None:
    """The edge's refusals (headers too large, ambiguous framing, a connection over the
    limit, the server's shutdown) answer /v2 paths in /v2's shape (they were /v1's)."""
    from modelfleet.gateway import edge

    async def never(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the edge answers before the app")

    async def cancelled(scope: Any, receive: Any, send: Any) -> None:
        raise asyncio.CancelledError

    big = [(b"x-h%d" % i, b"v") for i in range(200)]
    ambiguous = [(b"transfer-encoding", b"chunked"), (b"content-length", b"2")]
    cases = [(edge.EdgeApp(never), big, 431, "request_header_fields_too_large"),
             (edge.EdgeApp(never), ambiguous, 400, "bad_request"),
             (edge._refuse, [], 503, "too_many_connections"),
             (edge.EdgeApp(cancelled), [], 503, "shutting_down")]
    for app, headers, status, code in cases:
        got, answer_headers, body = await _asgi_answer(app, path, headers)
        assert got == status, code
        assert answer_headers[b"connection"] == b"close"
        assert (b"retry-after" in answer_headers) == (status == 503)
        assert isinstance(body["error"], shape)
        if shape is dict:
            assert body["error"]["code"] == code


async def test_the_apps_own_errors_in_both_dialects(tmp_path: Path) -> None:
    """No route (404), a method not allowed (405, with Allow), a dashboard file that is
    not there, a payload URL refused, a missing model: each a modelfleet error with its
    status, in the path's dialect."""
    from modelfleet.broker import create_broker
    from modelfleet.gateway.app import create_app
    from modelfleet.gateway.service import GatewayService
    from modelfleet.repository import Catalog, LocalStore
    from modelfleet.settings import BrokerSettings, Settings

    settings = Settings(broker=BrokerSettings(url="memory"), state_dir=tmp_path)
    broker = create_broker(settings.broker)
    await broker.connect()
    (tmp_path / "repo").mkdir()
    service = GatewayService(settings, broker, Catalog.from_store(LocalStore(tmp_path / "repo")),
                             bound_port=8000)
    try:
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            nope = await client.get("/v1/nope")
            assert nope.status_code == 404
            assert nope.json() == {"error": {"code": "not_found",
                                             "message": "no route GET /v1/nope"}}
            nope2 = await client.get("/v2/nope")
            assert (nope2.status_code, nope2.json()) == (404, {"error": "no route GET /v2/nope"})
            wrong = await client.get("/v1/models/m/infer")
            assert wrong.status_code == 405 and "POST" in wrong.headers["allow"]
            assert wrong.json()["error"]["code"] == "method_not_allowed"
            wrong2 = await client.get("/v2/models/m/infer")
            assert wrong2.status_code == 405 and "POST" in wrong2.headers["allow"]
            assert isinstance(wrong2.json()["error"], str)
            asset = await client.get("/dashboard/nope.js")
            assert asset.status_code == 404  # was an empty body
            assert asset.json()["error"]["code"] == "not_found"
            forged = await client.get("/v1/payloads/r1", params={"expires": "1", "sig": "x"})
            assert forged.status_code == 403
            assert forged.json()["error"]["code"] == "forbidden"
            missing = await client.post("/v1/models/m/infer", content=b"x")
            assert missing.status_code == 404
            assert missing.json()["error"]["code"] == "model_not_found"
            missing2 = await client.post("/v2/models/m/infer", content=b"{}")
            assert missing2.status_code == 404
            assert missing2.json()["error"].startswith("Request for unknown model")
    finally:
        await broker.close()


# -- nothing else decides a status ------------------------------------------------------

def _gateway_sources() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(GATEWAY.rglob("*.py")):
        if path.name.endswith("_pb2.py"):
            continue
        yield str(path.relative_to(GATEWAY)), ast.parse(path.read_text())


def _enclosing(tree: ast.Module) -> dict[ast.AST, str]:
    """Each node's innermost enclosing function (or module-level assignment target)."""
    owner: dict[ast.AST, str] = {}

    def visit(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            here = name
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                here = child.name
            elif isinstance(child, ast.Assign | ast.AnnAssign) and name == "<module>":
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                here = ",".join(ast.unparse(t) for t in targets)
            elif isinstance(child, ast.ClassDef):
                here = child.name
            owner[child] = here
            visit(child, here)

    visit(tree, "<module>")
    return owner


# Where an HTTP error status may be written as a number in gateway code, and why. A new
# place must be one of these, or read the error's own status through a renderer.
STATUS_LITERALS = {
    ("http.py", "v2_status"): "the /v2 dialect: 415 and 422 are the spec's 400",
    ("http.py", "NoRoute"): "the gateway's own errors' statuses",
    ("http.py", "MethodNotAllowed"): "",
    ("http.py", "PayloadURLRefused"): "",
    ("http.py", "PayloadGone"): "",
    ("http.py", "HeaderFieldsTooLarge"): "",
    ("http.py", "TooManyConnections"): "",
    ("inflight.py", "ShuttingDown"): "",
    ("inflight.py", "RequestTimeout"): "",
    ("grpc_api/servicer.py", "_GRPC_BY_HTTP"): "the gRPC dialect: HTTP status to gRPC code",
    ("app.py", "_http_error"): "the framework's 404 and 405 become NoRoute, MethodNotAllowed",
    ("app.py", "livez"): "a probe's state (not an error): 503 while wedged",
    ("app.py", "readyz"): "a probe's state: 503 while not ready",
    ("app.py", "infer"): "OpenAPI: the statuses /v1 infer documents",
    ("app.py", "infer_version"): "",
    ("oip.py", "live"): "the spec's health: 400 means false",
    ("oip.py", "ready"): "",
    ("oip.py", "model_ready"): "",
    ("exchange.py", "exchange"): "what a request that raised a bug of ours is counted as, "
                                 "and one never answered (499) in its usage",
    ("grpc_api/servicer.py", "model_infer"): "what a call that raised a bug is counted as",
    ("grpc_api/servicer.py", "__init__"): "_Usage: a call never answered counts as 499",
    ("auth.py", "_metered"): "a request never answered counts as 499",
}


def test_http_error_statuses_are_written_only_where_the_table_says() -> None:
    found: dict[tuple[str, str], list[int]] = {}
    for name, tree in _gateway_sources():
        owner = _enclosing(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and type(node.value) is int \
                    and 400 <= node.value < 600:
                found.setdefault((name, owner[node]), []).append(node.value)
    unexpected = {where: values for where, values in found.items()
                  if where not in STATUS_LITERALS}
    assert not unexpected, f"HTTP statuses decided outside a renderer: {unexpected}"


# The functions that may set a response's status: the renderers, and the probes whose
# answers are states rather than errors.
STATUS_SETTERS = {("http.py", "v1_error"), ("http.py", "v2_error"),
                  ("app.py", "livez"), ("app.py", "readyz"),
                  ("oip.py", "live"), ("oip.py", "ready"), ("oip.py", "model_ready"),
                  ("publish.py", "put_package")}  # 201 Created


def test_only_the_renderers_give_a_response_a_status() -> None:
    setters = set()
    for name, tree in _gateway_sources():
        owner = _enclosing(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "status_code":
                setters.add((name, owner[node]))
    assert setters <= STATUS_SETTERS, setters - STATUS_SETTERS


def test_no_handler_reads_an_errors_status_itself() -> None:
    """``except ... as exc`` blocks hand ``exc`` to a renderer; none looks at its status."""
    readers = []
    for name, tree in _gateway_sources():
        for handler in ast.walk(tree):
            if not (isinstance(handler, ast.ExceptHandler) and handler.name):
                continue
            for node in ast.walk(handler):
                if isinstance(node, ast.Attribute) and node.attr == "status" \
                        and isinstance(node.value, ast.Name) and node.value.id == handler.name:
                    readers.append((name, handler.lineno))
    assert not readers


def test_each_dialects_status_function_is_called_only_by_its_renderers() -> None:
    callers: dict[str, set[tuple[str, str]]] = {"v1_status": set(), "v2_status": set()}
    for name, tree in _gateway_sources():
        owner = _enclosing(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in callers:
                callers[node.func.id].add((name, owner[node]))
    assert callers["v1_status"] == {("http.py", "v1_error")}
    # /v2's, and gRPC's (its code is that of the /v2 status; the servicer counts by it).
    assert callers["v2_status"] == {("http.py", "v2_error"),
                                    ("grpc_api/servicer.py", "grpc_status"),
                                    ("grpc_api/servicer.py", "model_infer"),
                                    ("grpc_api/servicer.py", "_admitted")}


def test_no_status_table_by_code_remains() -> None:
    from modelfleet.gateway import http as dialects

    assert not hasattr(dialects, "STATUS_BY_CODE")
    assert not hasattr(dialects, "BAD_REQUEST_CODES")
