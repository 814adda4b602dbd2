"""Listings that stay bounded at any catalog size: pages of /v1/models and of the
repository index, the fleet summary's top queues, and the worker's per-model labels.

The gateway's real app over a real embedded broker, in process (httpx's ASGI transport).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest

from modelfleet import metrics
from modelfleet.broker import create_broker
from modelfleet.gateway.app import create_app
from modelfleet.gateway.pages import DEFAULT_LIMIT, MAX_LIMIT, decode_cursor, encode_cursor
from modelfleet.gateway.service import GatewayService
from modelfleet.repository import Catalog, LocalStore
from modelfleet.settings import BrokerSettings, GatewaySettings, Settings
from tests.contract.brokers import make_task
from tests.procs import EXAMPLES

BANNER = (EXAMPLES / "banner" / "1" / "model.toml").read_text()


def repository(root: Path, count: int) -> Catalog:
    for i in range(count):
        folder = root / f"m{i:04d}" / "1"
        folder.mkdir(parents=True)
        (folder / "model.toml").write_text(BANNER.replace('name = "banner"',
                                                          f'name = "m{i:04d}"'))
    return Catalog.from_store(LocalStore(root))


@pytest.fixture
async def gateway(tmp_path: Path, request: pytest.FixtureRequest
                  ) -> AsyncIterator[tuple[httpx.AsyncClient, GatewayService]]:
    count = getattr(request, "param", 7)
    settings = Settings(broker=BrokerSettings(url="memory"),
                        gateway=GatewaySettings(fleet_summary_models=5))
    broker = create_broker(settings.broker)
    await broker.connect()
    service = GatewayService(settings, broker, repository(tmp_path, count), bound_port=8000)
    transport = httpx.ASGITransport(app=create_app(service))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client, service
    finally:
        await broker.close()


async def all_pages(client: httpx.AsyncClient, limit: int) -> list[list[str]]:
    pages, cursor = [], None
    while True:
        params = {"limit": str(limit), **({"cursor": cursor} if cursor else {})}
        body = (await client.get("/v1/models", params=params)).json()
        pages.append([m["name"] for m in body["models"]])
        cursor = body["next_cursor"]
        if cursor is None:
            return pages


async def test_v1_models_pages_through_the_catalog_in_order(
        gateway: tuple[httpx.AsyncClient, GatewayService]) -> None:
    client, _ = gateway
    assert await all_pages(client, 3) == [["m0000", "m0001", "m0002"],
                                          ["m0003", "m0004", "m0005"], ["m0006"]]
    assert await all_pages(client, 7) == [[f"m{i:04d}" for i in range(7)]]
    one = (await client.get("/v1/models/m0003")).json()
    assert one["name"] == "m0003" and one["warm"] is False


@pytest.mark.parametrize("gateway", [DEFAULT_LIMIT + 20], indirect=True)
async def test_v1_models_without_a_limit_is_one_bounded_page(
        gateway: tuple[httpx.AsyncClient, GatewayService]) -> None:
    client, _ = gateway
    body = (await client.get("/v1/models")).json()
    assert len(body["models"]) == DEFAULT_LIMIT
    assert decode_cursor(body["next_cursor"]) == f"m{DEFAULT_LIMIT - 1:04d}"
    rest = (await client.get("/v1/models", params={"cursor": body["next_cursor"]})).json()
    assert [m["name"] for m in rest["models"]] == \
        [f"m{i:04d}" for i in range(DEFAULT_LIMIT, DEFAULT_LIMIT + 20)]
    assert rest["next_cursor"] is None


@pytest.mark.parametrize("params, problem", [
    ({"cursor": "not-a-cursor"}, "'cursor' 'not-a-cursor' is not one this API gave"),
    ({"cursor": "bTAwMDM"}, "is not one this API gave"),  # base64, but not ours
    ({"limit": "0"}, f"'limit' must be a whole number from 1 to {MAX_LIMIT}"),
    ({"limit": str(MAX_LIMIT + 1)}, "'limit' must be a whole number"),
    ({"limit": "ten"}, "'limit' must be a whole number"),
])
async def test_a_bad_cursor_or_limit_is_a_clear_400(
        gateway: tuple[httpx.AsyncClient, GatewayService], params: dict[str, str],
        problem: str) -> None:
    client, _ = gateway
    response = await client.get("/v1/models", params=params)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "bad_request" and problem in error["message"]
    response = await client.post("/v2/repository/index", json=params)
    assert response.status_code == 400 and problem in response.json()["error"]


async def test_a_cursor_survives_the_model_it_names_going_away(
        gateway: tuple[httpx.AsyncClient, GatewayService]) -> None:
    client, _ = gateway
    cursor = encode_cursor("m0002x")  # sorts between m0002 and m0003: as if m0002x left
    body = (await client.get("/v1/models", params={"cursor": cursor, "limit": "2"})).json()
    assert [m["name"] for m in body["models"]] == ["m0003", "m0004"]


@pytest.mark.parametrize("gateway", [DEFAULT_LIMIT + 5], indirect=True)
async def test_the_repository_index_keeps_its_array_bounded_and_pages_on_request(
        gateway: tuple[httpx.AsyncClient, GatewayService]) -> None:
    client, service = gateway
    plain = await client.post("/v2/repository/index")
    assert isinstance(plain.json(), list) and len(plain.json()) == DEFAULT_LIMIT
    assert decode_cursor(plain.headers["x-next-cursor"]) == f"m{DEFAULT_LIMIT - 1:04d}"
    # Asked for pages: an object with the next cursor, "ready" still applies.
    service.control.state.set("m0001", "loaded", False, service.control._revisions.next())
    first = (await client.post("/v2/repository/index",
                               json={"limit": 3, "ready": True})).json()
    assert [r["name"] for r in first["models"]] == ["m0000", "m0002", "m0003"]
    second = (await client.post("/v2/repository/index", params={"limit": "3"},
                                json={"cursor": first["next_cursor"]})).json()
    assert [r["name"] for r in second["models"]] == ["m0004", "m0005", "m0006"]
    last = (await client.post("/v2/repository/index", json={
        "limit": 50, "cursor": encode_cursor(f"m{DEFAULT_LIMIT - 10:04d}")})).json()
    assert len(last["models"]) == 14 and last["next_cursor"] is None
    small = await client.post("/v2/repository/index", json={"ready": False})
    assert "x-next-cursor" in small.headers  # still more than one page


async def test_the_fleet_summary_shows_the_busiest_queues_and_counts_the_rest(
        gateway: tuple[httpx.AsyncClient, GatewayService]) -> None:
    client, service = gateway
    broker = service.broker
    for i in range(12):  # backlogs 1..12: the five largest are shown
        model_id = f"q{i:02d}"
        for _ in range(i + 1):
            await broker.publish_task(make_task(model_id))
        service.fleet.observe({"kind": "demand", "model_id": model_id})
    held = [f"r{i:03d}" for i in range(40)]
    service.fleet.observe({"kind": "worker_state", "worker_id": "w1", "ready": True,
                           "resident": {"device": held, "host": held[:7]},
                           "subscriptions": held[:12], "permits_in_use": 0,
                           "permits_cap": 4})
    summary = (await client.get("/v1/fleet/summary")).json()
    assert [q["model"] for q in summary["queues"]] == ["q07", "q08", "q09", "q10", "q11"]
    assert summary["queues_omitted"] == {"queues": 7 + 40, "backlog": sum(range(1, 8)),
                                         "consumers": 0}
    assert summary["totals"]["backlog"] == sum(range(1, 13))  # the totals count them all
    (worker,) = summary["workers"]
    assert worker["resident"]["device"] == held[:5] and worker["subscriptions"] == held[:5]
    assert worker["counts"] == {"subscriptions": 12, "device": 40, "host": 7}


def worker_series(name: str, models: set[str]) -> set[str]:
    """The model label values of ``name``'s series that are in ``models`` or "other"."""
    found = set()
    for line in generate_latest().decode().splitlines():
        if line.startswith(name + "{"):
            model = line.split('model="', 1)[1].split('"', 1)[0]
            if model in models or model == "other":
                found.add(model)
    return found


def test_the_workers_per_model_counters_keep_a_bounded_label_set() -> None:
    limit = metrics.WORKER_MODELS.limit
    metrics.bound_models(len(metrics.WORKER_MODELS) + 2)  # room for two more models
    try:
        models = [f"tail-{uuid.uuid4().hex[:8]}" for _ in range(30)]
        for model_id in models:
            metrics.TASKS.labels(model_id, "ok").inc()
            metrics.EXPIRED_TASKS.labels(model_id).inc()
            metrics.DEAD_LETTERED.labels(model=model_id, reason="runtime_crashed").inc()
        for name in ("modelfleet_worker_tasks_total", "modelfleet_worker_expired_tasks_total",
                     "modelfleet_worker_dead_lettered_total"):
            assert worker_series(name, set(models)) == {models[0], models[1], "other"}
        assert metrics.TASKS.labels(models[5], "ok") is metrics.TASKS.labels("other", "ok")
    finally:
        metrics.bound_models(limit)
