"""The gateway's control plane: what it learns from events, and how it runs a command.

The workers here are the test speaking the event protocol on a real embedded broker;
the plane together with real workers runs in tests/e2e/test_control.py.
"""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path
from typing import Any

import pytest

from modelfleet.broker.embedded import MemoryBroker
from modelfleet.control import ControlState, Revision, announcement
from modelfleet.errors import (
    BrokerUnavailable,
    DeadlineExceeded,
    ModelLoadFailed,
    ModelUnavailable,
    NoCapacity,
)
from modelfleet.gateway.control_plane import ControlPlane
from modelfleet.repository import Catalog, LocalStore
from modelfleet.settings import BrokerSettings, Settings


def repo(tmp_path: Path, versions: dict[str, list[str]]) -> Catalog:
    for name, numbers in versions.items():
        for number in numbers:
            folder = tmp_path / name / number
            folder.mkdir(parents=True)
            (folder / "model.toml").write_text(textwrap.dedent(f"""\
                name = "{name}"
                version = "{number}"
                entrypoint = "handler:Model"
                """))
    return Catalog.from_store(LocalStore(tmp_path))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def worker(worker_id: str, resident: dict[str, set[str]], state: ControlState | None = None,
           failed: dict[str, set[str]] | None = None, ready: bool = True) -> dict[str, Any]:
    return announcement(worker_id, 0.0, ready, state or ControlState(),
                        {m: frozenset(v) for m, v in resident.items()},
                        {m: frozenset(v) for m, v in (failed or {}).items()})


def plane(tmp_path: Path, broker: MemoryBroker | None = None, clock: Clock | None = None,
          **control: float) -> ControlPlane:
    settings = Settings(control=control) if control else Settings()  # type: ignore[arg-type]
    return ControlPlane(settings, broker or MemoryBroker(BrokerSettings()),
                        repo(tmp_path, {"m": ["1", "2"], "n": ["1"]}), clock or Clock())


def test_the_route_waits_for_the_new_version_on_every_holder(tmp_path: Path) -> None:
    p = plane(tmp_path)
    assert p.route("m") == "2"  # nobody holds it: the newest
    p.observe(worker("a", {"m": {"1", "2"}}))
    p.observe(worker("b", {"m": {"1"}}))
    assert p.route("m") == "1" and p.route("m", "2") == "2"  # a named version is kept
    p.observe(worker("b", {"m": {"1", "2"}}))
    assert p.route("m") == "2"
    assert p.warm_on("m", "2") == ["a", "b"]


def test_a_version_failed_on_one_worker_never_routes(tmp_path: Path) -> None:
    p = plane(tmp_path)
    p.observe(worker("a", {"m": {"1"}}, failed={"m": {"2"}}))
    p.observe(worker("b", {"m": {"1", "2"}}))
    assert p.route("m") == "1"


def test_a_gateway_learns_an_unload_from_any_workers_announcement(tmp_path: Path) -> None:
    p = plane(tmp_path)
    p.check("m")
    told = ControlState()
    told.set("m", "loaded", False, Revision(5.0, "gw-other"))
    p.observe(worker("a", {}, told))
    assert not p.available("m")
    with pytest.raises(ModelUnavailable, match=r"unloaded.*POST \.\.\./load"):
        p.check("m")
    assert [(r["name"], r["state"]) for r in p.index()[0]] == [("m", "UNAVAILABLE"),
                                                              ("n", "READY")]
    assert [r["name"] for r in p.index(ready_only=True)[0]] == ["n"]


def test_silent_workers_stop_counting(tmp_path: Path) -> None:
    clock = Clock()
    p = plane(tmp_path, clock=clock, stale_after_s=5)
    p.observe(worker("a", {"m": {"1"}}))
    assert p.route("m") == "1"
    clock.now += 6
    assert p.route("m") == "2"
    p.observe(worker("b", {"m": {"1"}}))
    p.observe({"kind": "worker_gone", "worker_id": "b"})
    assert p.route("m") == "2"


async def answering(broker: MemoryBroker, p: ControlPlane, answers: dict[str, tuple[bool, str]],
                    seen: list[dict[str, Any]]) -> None:
    """Workers that answer every command naming them (``answers``: worker -> ok, message)."""
    async for event in broker.events():
        p.observe(event)
        if event.get("kind") != "control":
            continue
        seen.append(event)
        for worker_id in event["workers"]:
            if worker_id in answers:
                ok, message = answers[worker_id]
                await broker.publish_event({
                    "kind": "control_result", "command_id": event["command_id"],
                    "worker_id": worker_id, "model_id": event["model_id"],
                    "version": event["version"], "ok": ok,
                    "code": "" if ok else "model_load_failed", "message": message})


async def run_with_workers(tmp_path: Path, answers: dict[str, tuple[bool, str]],
                           holdings: dict[str, dict[str, set[str]]], call: Any,
                           **control: float) -> tuple[Any, list[dict[str, Any]], ControlPlane]:
    broker = MemoryBroker(BrokerSettings())
    await broker.connect()
    p = plane(tmp_path, broker, **control)
    for worker_id, resident in holdings.items():
        p.observe(worker(worker_id, resident))
    seen: list[dict[str, Any]] = []
    listener = asyncio.create_task(answering(broker, p, answers, seen))
    await asyncio.sleep(0)
    try:
        return await call(p), seen, p
    finally:
        listener.cancel()
        await broker.close()


async def test_load_asks_holders_of_the_old_version_and_moves_a_named_route(
        tmp_path: Path) -> None:
    ok = {"a": (True, ""), "b": (True, ""), "c": (True, "")}
    outcome, seen, p = await run_with_workers(
        tmp_path, ok, {"a": {"m": {"1"}}, "b": {}, "c": {"m": {"1"}}},
        lambda p: p.load("m", "2", workers=1))
    assert outcome.workers == ("a", "c")  # both holders, though one worker was asked for
    assert [e["action"] for e in seen] == ["load", "route"]
    assert p.route("m") == "2" and p.state.version("m") == "2"


async def test_a_failed_load_answers_why_and_leaves_the_route(tmp_path: Path) -> None:
    answers = {"a": (True, ""), "b": (False, "ImportError: no module named torch")}
    with pytest.raises(ModelLoadFailed, match="b: ImportError"):
        await run_with_workers(tmp_path, answers, {"a": {"m": {"1"}}, "b": {"m": {"1"}}},
                               lambda p: p.load("m", "2", workers=2))


async def test_load_on_more_workers_than_are_live_is_refused(tmp_path: Path) -> None:
    # Refused once the gateway has been up stale_after_s: every live worker has spoken.
    with pytest.raises(NoCapacity, match=r"3 worker.*2 ready"):
        await run_with_workers(tmp_path, {}, {"a": {}, "b": {}},
                               lambda p: p.load("m", None, workers=3), stale_after_s=0.5)


async def test_a_gateway_just_started_waits_to_hear_from_its_workers(tmp_path: Path) -> None:
    """Workers announce themselves every state_interval_s: a load asked of a gateway that
    has not heard from them yet waits for them instead of answering 503."""
    ok = {"a": (True, "")}

    async def load_while_a_announces_late(p: ControlPlane) -> Any:
        async def announce() -> None:
            await asyncio.sleep(0.3)
            p.observe(worker("a", {}))
        late = asyncio.create_task(announce())
        try:
            return await p.load("m", None, workers=1)
        finally:
            await late

    outcome, seen, _ = await run_with_workers(tmp_path, ok, {}, load_while_a_announces_late)
    assert outcome.workers == ("a",)
    assert [e["action"] for e in seen] == ["load"]


async def test_a_worker_that_never_answers_times_the_command_out(tmp_path: Path) -> None:
    with pytest.raises(DeadlineExceeded, match=r"not confirmed.*by worker.*b"):
        await run_with_workers(tmp_path, {"a": (True, "")}, {"a": {}, "b": {}},
                               lambda p: p.unload("n"), command_timeout_s=0.3)


async def test_unload_is_refused_here_at_once_and_answered_by_every_worker(
        tmp_path: Path) -> None:
    outcome, seen, p = await run_with_workers(
        tmp_path, {"a": (True, ""), "b": (True, "")}, {"a": {}, "b": {"n": {"1"}}},
        lambda p: p.unload("n"))
    assert outcome.workers == ("a", "b") and not p.available("n")
    assert seen[0]["action"] == "unload"


def test_the_gateway_keeps_its_route_until_a_worker_says_what_it_holds(tmp_path: Path) -> None:
    clock = Clock()
    catalog = repo(tmp_path, {"m": ["1"]})
    p = ControlPlane(Settings(control={"stale_after_s": 5}),  # type: ignore[arg-type]
                     MemoryBroker(BrokerSettings()), catalog, clock)
    assert p.route("m") == "1"
    (tmp_path / "m" / "2").mkdir()
    (tmp_path / "m" / "2" / "model.toml").write_text(
        'name = "m"\nversion = "2"\nentrypoint = "handler:Model"\n')
    catalog.replace_with(Catalog.from_store(LocalStore(tmp_path)))
    assert p.route("m") == "1"  # a request just went to 1: no announcement yet
    p.observe(worker("a", {"m": {"1"}}))
    assert p.route("m") == "1"
    p.observe(worker("a", {"m": {"1", "2"}}))
    assert p.route("m") == "2"


async def test_an_order_the_broker_did_not_take_is_not_applied_either(tmp_path: Path) -> None:
    broker = MemoryBroker(BrokerSettings())  # never started: every publish fails
    p = plane(tmp_path, broker)
    p.observe(worker("a", {}))
    with pytest.raises(BrokerUnavailable):
        await p.unload("m")
    assert p.available("m")  # nobody heard the unload: this gateway does not refuse alone


def test_the_fleet_view_and_the_plane_share_one_registry_and_one_staleness_rule(
        tmp_path: Path) -> None:
    """One registry under both: a worker heard by either event counts as live for both,
    a silent one leaves both at the same moment, a gone one at once."""
    from modelfleet.gateway.fleet import FleetView, WorkerRegistry

    clock = Clock()
    workers = WorkerRegistry(stale_after_s=10, clock=clock)
    fleet = FleetView(registry=workers)
    p = ControlPlane(Settings(), MemoryBroker(BrokerSettings(url="memory")),
                     repo(tmp_path, {"m": ["1", "2"]}), clock=clock, registry=workers)
    for name in ("a", "b"):
        p.observe(worker(name, {"m": {"1"}}))
        fleet.observe({"kind": "worker_state", "worker_id": name,
                       "resident": {"device": ["m"], "host": []}})
    assert fleet.warm_on("m") == ["a", "b"] and p.warm_on("m", "1") == ["a", "b"]
    clock.now += 8
    p.observe(worker("b", {"m": {"1"}}))  # b's control announcement keeps b live for both
    clock.now += 5  # a silent for 13 s, past stale_after_s
    assert fleet.warm_on("m") == ["b"] and p.warm_on("m", "1") == ["b"]
    assert [h.worker_id for h in p.holdings()] == ["b"]
    assert [w["worker_id"] for w in fleet.workers()] == ["b"]
    fleet.observe({"kind": "worker_gone", "worker_id": "b"})  # heard once: gone for both
    assert fleet.warm_on("m") == [] and p.holdings() == [] and p.holdings_of("m") == []
    assert not fleet.held_anywhere("m")
