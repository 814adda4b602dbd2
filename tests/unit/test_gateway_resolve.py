"""A request is resolved once, and its outcome comes back as a value.

The gateway's real app (httpx's ASGI transport) in front of a real worker (the
coordinator with an in-process runtime) over the embedded broker, on one event loop.
The gateway's catalog counts its lookups: a /v1 and a /v2 request each look their model
up once, and the version the caller is answered by is the one the gateway logged and
counted. The worker checks a payload URL's content type against the task's version,
not the newest one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from modelfleet.broker.embedded import MemoryBroker
from modelfleet.gateway.app import create_app
from modelfleet.gateway.service import GatewayService
from modelfleet.launch import open_repository
from modelfleet.repository import Catalog, CatalogEntry
from modelfleet.settings import Settings
from modelfleet.tenancy.access import Principal
from modelfleet.tenancy.plans import BUILTIN
from modelfleet.tenancy.store import Tenant
from tests.fleet import in_process_fleet
from tests.procs import EXAMPLES

ECHO = '''
from modelfleet import Model, Request


class Echo(Model):
    async def preprocess(self, request: Request) -> str:
        return request.text()

    def predict(self, batch):
        return [{"echo": text, "version": "%s"} for text in batch]
'''
TWIN = '''
name = "twin"
version = "{version}"
entrypoint = "handler:Echo"
accepts = ["{accepts}"]
'''


class CountingCatalog(Catalog):
    """The catalog, counting each lookup of a model by id (``get``, ``view``, ``in``)."""

    lookups: Counter[str]

    def count(self, model_id: object) -> None:
        if not hasattr(self, "lookups"):
            self.lookups = Counter()
        self.lookups[str(model_id)] += 1

    def get(self, model_id: str) -> CatalogEntry:
        self.count(model_id)
        return super().get(model_id)

    def view(self, model_id: str, override: object) -> CatalogEntry:
        self.count(model_id)
        return super().view(model_id, override)  # type: ignore[arg-type]

    def __contains__(self, model_id: object) -> bool:
        self.count(model_id)
        return super().__contains__(model_id)


@dataclass
class Rig:
    client: httpx.AsyncClient
    gateway: GatewayService
    catalog: CountingCatalog


def twin_repository(root: Path) -> Path:
    """iris (from the examples) and twin, whose version 1 takes text and 2 JSON."""
    for version, accepts in (("1", "text/plain"), ("2", "application/json")):
        folder = root / "twin" / version
        folder.mkdir(parents=True)
        (folder / "model.toml").write_text(TWIN.format(version=version, accepts=accepts))
        (folder / "handler.py").write_text(ECHO % version)
    iris = EXAMPLES / "iris" / "1"
    target = root / "iris" / "1"
    target.mkdir(parents=True)
    for item in iris.iterdir():
        if item.is_file():
            (target / item.name).write_bytes(item.read_bytes())
    return root


@pytest.fixture
async def rig(tmp_path: Path, origin: str) -> AsyncIterator[Rig]:
    port = origin.rpartition(":")[2]
    settings = Settings(repo=str(twin_repository(tmp_path / "repo")),
                        state_dir=tmp_path / "state",
                        worker={"worker_id": "w1", "state_interval_s": 0.05},
                        runtime={"url_fetch_allow": [f"127.0.0.0/8:{port}"]})
    async with in_process_fleet(settings, gateway=True, gateway_catalog=lambda store, _:
                                CountingCatalog.from_store(store)) as fleet:
        catalog = fleet.service.catalog
        assert isinstance(catalog, CountingCatalog)
        await fleet.gateway_heard_of_the_worker()
        transport = httpx.ASGITransport(app=create_app(fleet.service))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                     timeout=30) as client:
            yield Rig(client, fleet.service, catalog)


async def _serve_text(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\n"
                 b"hello")
    await writer.drain()
    writer.close()


@pytest.fixture
async def origin() -> AsyncIterator[str]:
    """A caller's payload URL: serves text."""
    server = await asyncio.start_server(_serve_text, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def v2_request() -> dict[str, object]:
    return {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 4],
                        "data": [5.1, 3.5, 1.4, 0.2]}]}


async def test_a_v1_and_a_v2_request_each_look_their_model_up_once(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    # Warm first (a cold load is the worker's business, not the lookups').
    assert (await rig.client.post("/v1/models/iris/infer",
                                  json={"features": [5.1, 3.5, 1.4, 0.2]})).status_code == 200
    for path, body in (("/v1/models/iris/infer", {"features": [5.1, 3.5, 1.4, 0.2]}),
                       ("/v2/models/iris/infer", v2_request()),
                       ("/v1/models/twin/infer", None)):
        rig.catalog.lookups.clear()
        with caplog.at_level(logging.DEBUG, logger="modelfleet.requests"):
            caplog.clear()
            if body is None:
                answer = await rig.client.post(path, content=b"hi",
                                               headers={"content-type": "application/json"})
            else:
                answer = await rig.client.post(path, json=body)
        assert answer.status_code == 200, answer.text
        model = path.split("/")[3]
        assert rig.catalog.lookups[model] == 1, (path, dict(rig.catalog.lookups))
        # The version the worker ran is the one the request's log line names.
        [line] = [r for r in caplog.records if r.name == "modelfleet.requests"]
        fields = line.fields  # type: ignore[attr-defined]
        if model == "twin":
            assert answer.json() == {"echo": "hi", "version": "2"}
        assert fields["version"] == ("2" if model == "twin" else "1")
        assert fields["request_id"] and fields["worker"] == "w1" and fields["status"] == 200
        assert fields["timings_ms"]["predict"] > 0


async def test_a_worker_failure_is_an_outcome_with_its_phases_and_status(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="modelfleet.requests"):
        answer = await rig.client.post("/v1/models/iris/infer", json={"features": [1]})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "invalid_input"
    [line] = [r for r in caplog.records if r.name == "modelfleet.requests"]
    fields = line.fields  # type: ignore[attr-defined]
    # The worker's failure reply reached the log line as a value: its worker and phases.
    assert fields["outcome"] == "invalid_input" and fields["worker"] == "w1"
    assert "model_load" in fields["timings_ms"]


async def test_the_worker_checks_a_payload_url_against_the_tasks_version(
        rig: Rig, origin: str) -> None:
    """twin 1 takes text/plain, twin 2 (the newest) only JSON: a URL that serves text is
    fine for a request to version 1 and refused for one to version 2."""
    url = json.dumps({"url": f"{origin}/text"}).encode()
    json_type = {"content-type": "application/json"}
    one = await rig.client.post("/v1/models/twin/versions/1/infer", content=url,
                                headers=json_type)
    assert one.status_code == 200, one.text
    assert one.json() == {"echo": "hello", "version": "1"}
    two = await rig.client.post("/v1/models/twin/versions/2/infer", content=url,
                                headers=json_type)
    assert two.status_code == 415, two.text
    assert "the payload URL served text/plain" in two.json()["error"]["message"]


def test_the_plan_carries_the_callers_tenant_and_plan_when_one_is_known(
        tmp_path: Path) -> None:
    settings = Settings(repo=str(twin_repository(tmp_path / "repo")),
                        state_dir=tmp_path / "state")
    _, catalog = open_repository(settings)
    gateway = GatewayService(settings, MemoryBroker(settings.broker), catalog,
                             runtimes_local=True)
    owner = gateway.resolve("iris", None, None, None)  # auth off: the model owner's
    assert (owner.tenant, owner.plan, owner.priority) == ("examples", "free", 0)
    caller = Principal("0123456789ab", "caller", Tenant("acme", "pro"), BUILTIN["pro"])
    resolved = gateway.resolve("iris", None, 2.5, caller)
    assert (resolved.tenant, resolved.plan) == ("acme", "pro")
    assert resolved.priority == BUILTIN["pro"].priority
    assert resolved.version == "1" and resolved.request_id != owner.request_id
    # The caller's 2.5 s, not the model's timeout_s (10 s), fixes the deadline.
    assert resolved.deadline_ms < owner.deadline_ms - 5000
