"""FleetView: the gateway's picture of live workers, from their state events."""

from __future__ import annotations

from modelfleet.gateway.fleet import FleetView


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def state(worker_id: str, device: list[str], host: list[str] | None = None) -> dict[str, object]:
    return {"kind": "worker_state", "worker_id": worker_id,
            "resident": {"device": device, "host": host or []}}


def test_stale_workers_age_out_and_gone_workers_leave_at_once() -> None:
    clock = Clock()
    fleet = FleetView(stale_after_s=10, clock=clock)
    fleet.observe(state("a", ["iris"]))
    fleet.observe(state("b", ["digits"], ["iris"]))
    assert fleet.warm_models() == {"iris": ["a", "b"], "digits": ["b"]}
    clock.now += 8
    fleet.observe(state("b", ["digits"]))
    clock.now += 5  # a has been silent for 13 s
    assert [w["worker_id"] for w in fleet.workers()] == ["b"]
    assert fleet.warm_models() == {"digits": ["b"]}
    fleet.observe({"kind": "worker_gone", "worker_id": "b"})
    assert fleet.workers() == []


def test_other_events_are_ignored() -> None:
    fleet = FleetView(stale_after_s=10)
    fleet.observe({"kind": "demand", "model_id": "iris"})
    fleet.observe({"kind": "worker_state"})  # no id
    assert fleet.workers() == []
