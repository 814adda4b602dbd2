"""IdleMeter: free permits x time, counted only while work this worker could run waits."""

from __future__ import annotations

from modelfleet.worker.idle import IdleMeter
from tests.clock import ManualClock


def test_idle_permits_count_only_while_work_waits() -> None:
    clock = ManualClock()
    meter = IdleMeter(permits_cap=4, clock=clock)
    clock.now += 2  # nothing waiting: free permits are not idle
    meter.observe(free_permits=4, waiting=True)
    assert meter.idle_permit_s == 0 and meter.permit_s == 8
    clock.now += 1  # 4 free while work waits
    meter.observe(free_permits=1)
    assert meter.idle_permit_s == 4
    clock.now += 3  # 1 free while work waits
    meter.observe(free_permits=0)
    assert meter.idle_permit_s == 7
    clock.now += 5  # all busy: not idle, whatever waits
    meter.observe(free_permits=4, waiting=False)
    assert meter.idle_permit_s == 7 and meter.permit_s == 4 * 11
    assert not meter.waiting
