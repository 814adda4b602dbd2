"""Control orders kept in the deployment's database (SQLite, and PostgreSQL at
$MODELFLEET_TEST_POSTGRES in a schema of each test's own), and the gateway's control
plane over them: every order it gives is kept, a new plane over the same database
obeys them at once and tells them to the fleet, and a worker whose announcement lacks
one is told them again. The fleet here is the test speaking the event protocol on a
real embedded broker; tests/e2e/test_control_orders.py restarts a real ``serve``.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelfleet.broker.embedded import MemoryBroker
from modelfleet.control import CONTROL_ORDERS, ControlState, Revision
from modelfleet.control.orders import TABLE, OrderStore, OrderStoreError, OrderStoreUnavailable
from modelfleet.errors import ConfigError, ModelNotFound, ModelUnavailable
from modelfleet.gateway.control_plane import ControlPlane
from modelfleet.settings import BrokerSettings, Settings
from tests.unit.test_control_plane import answering, repo, worker
from tests.waiting import eventually

POSTGRES_URL = os.environ.get("MODELFLEET_TEST_POSTGRES",
                              "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture
def postgres_schema() -> Iterator[str]:
    """A PostgreSQL URL whose tables live in a schema of this test's own (dropped after)."""
    import psycopg

    schema = f"co_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as db:
        db.execute(f"CREATE SCHEMA {schema}")
    try:
        yield f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as db:
            db.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture(params=["sqlite", "postgres"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "deployment.sqlite3")
    return str(request.getfixturevalue("postgres_schema"))


def orders(*given: tuple[str, str, bool | str, float, str]) -> ControlState:
    state = ControlState()
    for model_id, field, value, at, origin in given:
        state.set(model_id, field, value, Revision(at, origin))  # type: ignore[arg-type]
    return state


# -- the store ---------------------------------------------------------------------------

def test_orders_kept_are_read_back_by_a_store_opened_later(location: str) -> None:
    store = OrderStore(location)
    store.put("m", orders(("m", "loaded", False, 10.0, "gw-a"), ("m", "pinned", True, 11.0,
                                                                 "gw-a"),
                          ("m", "version", "2", 12.0, "gw-a")))
    store.put("n", orders(("n", "pinned", False, 13.5, "gw-b")))
    store.close()
    again = OrderStore(location)  # the table exists already: opened, not re-created
    try:
        assert again.wire() == {"m": {"loaded": [False, 10.0, "gw-a"],
                                      "pinned": [True, 11.0, "gw-a"],
                                      "version": ["2", 12.0, "gw-a"]},
                                "n": {"pinned": [False, 13.5, "gw-b"]}}
        state = ControlState()
        assert state.merge(again.wire()) == ["m", "n"]
        assert not state.loaded("m") and state.pinned("m", False)
        assert state.version("m") == "2" and not state.pinned("n", True)
    finally:
        again.close()


def test_a_newer_order_overwrites_and_an_older_one_never_does(location: str) -> None:
    store = OrderStore(location)
    try:
        store.put("m", orders(("m", "loaded", False, 10.0, "gw-a")))
        store.put("m", orders(("m", "loaded", True, 20.0, "gw-b")))  # a load supersedes it
        assert store.wire() == {"m": {"loaded": [True, 20.0, "gw-b"]}}
        store.put("m", orders(("m", "loaded", False, 15.0, "gw-c")))  # a late, older copy
        assert store.wire() == {"m": {"loaded": [True, 20.0, "gw-b"]}}
        store.put("m", orders(("m", "loaded", False, 20.0, "gw-a")))  # same time: origin
        assert store.wire() == {"m": {"loaded": [True, 20.0, "gw-b"]}}
        store.put("m", orders(("m", "loaded", False, 20.0, "gw-c")))
        assert store.wire() == {"m": {"loaded": [False, 20.0, "gw-c"]}}
        store.put("m", ControlState())  # nothing known of it: nothing written
        assert store.wire() == {"m": {"loaded": [False, 20.0, "gw-c"]}}
    finally:
        store.close()


def test_rows_this_release_cannot_read_are_skipped_not_fatal(tmp_path: Path) -> None:
    path = tmp_path / "d.sqlite3"
    OrderStore(str(path)).close()
    with sqlite3.connect(path) as db:
        db.execute(f"INSERT INTO {TABLE} VALUES ('m', 'colour', '\"red\"', 1.0, 'gw')")
        db.execute(f"INSERT INTO {TABLE} VALUES ('m', 'pinned', 'not json', 2.0, 'gw')")
        db.execute(f"INSERT INTO {TABLE} VALUES ('n', 'loaded', 'false', 3.0, 'gw')")
    store = OrderStore(str(path))
    try:
        state = ControlState()
        assert state.merge(store.wire()) == ["n"]
        assert not state.loaded("n") and state.loaded("m")
    finally:
        store.close()


def test_the_store_shares_the_tenants_database_file(tmp_path: Path) -> None:
    from modelfleet.tenancy.store import open_store

    path = str(tmp_path / "deployment.sqlite3")
    tenants = open_store(path)
    store = OrderStore(path)
    try:
        tenants.set_tenant("acme")
        store.put("m", orders(("m", "loaded", False, 1.0, "gw")))
        assert tenants.tenant("acme") is not None and store.wire()["m"]["loaded"][0] is False
    finally:
        store.close()
        tenants.close()


def test_an_unreachable_postgres_is_order_store_unavailable_without_the_password() -> None:
    with pytest.raises(OrderStoreUnavailable, match="control orders") as caught:
        OrderStore("postgresql://mf:s3cret@127.0.0.1:1/test")
    assert "s3cret" not in str(caught.value)


def test_an_unopenable_file_is_order_store_unavailable(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(OrderStoreUnavailable, match=r"cannot open the control orders' "
                                                    r"database .*file/d\.sqlite3"):
        OrderStore(str(tmp_path / "file" / "d.sqlite3"))


def test_an_unknown_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="redis:// is not supported"):
        OrderStore("redis://127.0.0.1/0")


def test_a_database_that_fails_a_write_is_order_store_error(tmp_path: Path) -> None:
    path = tmp_path / "d.sqlite3"
    store = OrderStore(str(path))
    try:
        with sqlite3.connect(path) as db:
            db.execute(f"DROP TABLE {TABLE}")
            db.execute(f"CREATE TABLE {TABLE} (model TEXT)")  # not ours any more
        with pytest.raises(OrderStoreError, match="keep the orders for m"):
            store.put("m", orders(("m", "loaded", False, 1.0, "gw")))
    finally:
        store.close()


# -- what a state says of another's copy -------------------------------------------------

def test_a_state_says_when_a_copy_lacks_one_of_its_orders() -> None:
    mine = orders(("m", "loaded", False, 10.0, "gw"), ("n", "pinned", True, 5.0, "gw"))
    assert not ControlState().newer_than({})  # nothing to tell
    assert mine.newer_than({}) and mine.newer_than(None)
    assert mine.newer_than(orders(("m", "loaded", False, 10.0, "gw")).wire())
    assert mine.newer_than({"m": mine.wire()["m"], "n": {"pinned": [True, 4.0, "gw"]}})
    assert not mine.newer_than(mine.wire())
    newer = orders(("m", "loaded", True, 11.0, "gw"), ("n", "pinned", True, 5.0, "gw"),
                   ("o", "pinned", True, 1.0, "gw"))
    assert not mine.newer_than(newer.wire())


# -- the gateway's control plane over a store --------------------------------------------

def plane(tmp_path: Path, broker: MemoryBroker, store: OrderStore | None, interval: float = 60
          ) -> ControlPlane:
    settings = Settings(control={"announce_interval_s": interval})  # type: ignore[arg-type]
    catalog = repo(tmp_path / uuid.uuid4().hex, {"m": ["1", "2"], "n": ["1"]})
    return ControlPlane(settings, broker, catalog, orders=store)


async def listening(broker: MemoryBroker) -> tuple[list[dict[str, Any]], asyncio.Task[None]]:
    seen: list[dict[str, Any]] = []

    async def listen() -> None:
        async for event in broker.events():
            seen.append(event)

    task = asyncio.create_task(listen())
    await asyncio.sleep(0)
    return seen, task


async def test_a_gateway_started_later_obeys_the_kept_orders_and_tells_the_fleet(
        tmp_path: Path, location: str) -> None:
    broker = MemoryBroker(BrokerSettings())
    await broker.connect()
    store = OrderStore(location)
    first = plane(tmp_path, broker, store)
    first.observe(worker("a", {"m": {"1"}}))
    workers = asyncio.create_task(answering(broker, first, {"a": (True, "")}, []))
    await asyncio.sleep(0)
    try:
        await first.unload("m")
        await first.pin("n", True)
    finally:
        workers.cancel()
    kept = store.wire()
    assert kept["m"]["loaded"][0] is False and kept["n"]["pinned"][0] is True
    store.close()

    # Every gateway and worker restarted: a new broker, a new plane, the same database.
    broker = MemoryBroker(BrokerSettings())
    await broker.connect()
    seen, listener = await listening(broker)
    store = OrderStore(location)
    try:
        second = plane(tmp_path, broker, store)
        assert await second.restore() == 2
        with pytest.raises(ModelUnavailable, match="'m' was unloaded"):
            second.check("m")
        row = {r["name"]: r for r in second.index()[0]}
        assert row["m"]["state"] == "UNAVAILABLE" and row["n"]["pinned"] is True
        told = await eventually(lambda: [e for e in seen if e["kind"] == CONTROL_ORDERS],
                                every_s=0.005)
        assert told[0]["control"] == second.state.wire()
        learned = ControlState()  # what a worker that merges the announcement knows
        learned.merge(told[0]["control"])
        assert not learned.loaded("m") and learned.pinned("n", False)
    finally:
        listener.cancel()
        store.close()


async def test_a_worker_whose_announcement_lacks_an_order_is_told_again(
        tmp_path: Path) -> None:
    broker = MemoryBroker(BrokerSettings())
    await broker.connect()
    seen, listener = await listening(broker)
    store = OrderStore(str(tmp_path / "d.sqlite3"))
    store.put("m", orders(("m", "loaded", False, 10.0, "gw-old")))
    try:
        p = plane(tmp_path, broker, store, interval=0.05)
        await p.restore()
        told = lambda: [e for e in seen if e["kind"] == CONTROL_ORDERS]  # noqa: E731
        await eventually(lambda: len(told()) == 1, every_s=0.005)
        p.observe(worker("a", {}, p.state))  # it knows them all: nothing to tell
        await asyncio.sleep(0.1)
        assert len(told()) == 1
        p.observe(worker("b", {}))  # a worker that restarted knows nothing
        await eventually(lambda: len(told()) == 2, every_s=0.005)
        p.observe(worker("b", {}))  # again at once: told once per announce interval
        p.observe(worker("b", {}))
        await asyncio.sleep(0.02)
        assert len(told()) == 2
        await asyncio.sleep(0.06)
        p.observe(worker("b", {}))
        await eventually(lambda: len(told()) == 3, every_s=0.005)
    finally:
        listener.cancel()
        store.close()


async def test_an_order_the_database_refuses_is_given_but_answered_with_why(
        tmp_path: Path) -> None:
    path = tmp_path / "d.sqlite3"
    broker = MemoryBroker(BrokerSettings())
    await broker.connect()
    store = OrderStore(str(path))
    p = plane(tmp_path, broker, store)
    p.observe(worker("a", {"m": {"1"}}))
    with sqlite3.connect(path) as db:
        db.execute(f"DROP TABLE {TABLE}")
        db.execute(f"CREATE TABLE {TABLE} (model TEXT)")
    workers = asyncio.create_task(answering(broker, p, {"a": (True, "")}, []))
    await asyncio.sleep(0)
    try:
        with pytest.raises(OrderStoreError, match=r"unload of 'm' was given to the fleet but "
                                                  r"could not be kept in .*d\.sqlite3.*give it "
                                                  "again once the database is back"):
            await p.unload("m")
        assert not p.available("m")  # the order stands here and on the fleet
    finally:
        workers.cancel()
        store.close()


async def test_a_gateway_without_a_store_restores_nothing(tmp_path: Path) -> None:
    broker = MemoryBroker(BrokerSettings())
    await broker.connect()
    seen, listener = await listening(broker)
    try:
        p = plane(tmp_path, broker, None)
        assert await p.restore() == 0
        await asyncio.sleep(0.05)
        assert seen == [] and p.available("m")
    finally:
        listener.cancel()


async def test_a_loads_config_is_kept_and_served_again_after_every_restart(
        tmp_path: Path, location: str) -> None:
    broker = MemoryBroker(BrokerSettings())
    await broker.connect()
    store = OrderStore(location)
    first = plane(tmp_path, broker, store)
    first.observe(worker("a", {"m": {"1"}}))
    workers = asyncio.create_task(answering(broker, first, {"a": (True, "")}, []))
    await asyncio.sleep(0)
    config = '{"max_batch_size":4,"versions":{"latest":1}}'
    try:
        await first.load("m", None, 1, config)
    finally:
        workers.cancel()
    assert store.wire()["m"]["config"][0] == config
    served = first._catalog.get("m")
    assert [m.version for m in served.versions] == ["2"]
    assert served.manifest.batching.max_batch_size == 4
    store.close()

    broker = MemoryBroker(BrokerSettings())  # every gateway and worker restarted
    await broker.connect()
    store = OrderStore(location)
    try:
        second = plane(tmp_path, broker, store)
        assert second._catalog.get("m").manifest.batching.max_batch_size == 1
        await second.restore()
        again = second._catalog.get("m")
        assert [m.version for m in again.versions] == ["2"]
        assert again.manifest.batching.max_batch_size == 4
        with pytest.raises(ModelNotFound, match="version '1' is not served"):
            again.version("1")  # what a request for it is answered
        with pytest.raises(ModelNotFound, match="version '1' is not served"):
            await second.load("m", "1", 1, config)  # a version its own config leaves out
    finally:
        store.close()
