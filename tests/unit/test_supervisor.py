"""The supervisor and the residency mirror in one process, over in-process runtimes.

tests/e2e/test_chaos.py and test_standby.py kill real runtime processes; here the
supervision itself (states, restarts, the standby, an orderly stop) is checked with
runtimes started by ``InProcessLauncher``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from modelfleet.launch import open_repository
from modelfleet.runtime.inprocess import InProcessLauncher
from modelfleet.settings import Settings
from modelfleet.worker.residency import Residency
from modelfleet.worker.supervisor import RuntimeSupervisor
from tests.procs import EXAMPLES
from tests.waiting import eventually


def settings_for(tmp_path: Path, standby_keep_s: float = 0, **worker: object) -> Settings:
    """The shared runtime alone (no standing quarantine runtime) unless ``worker`` says."""
    return Settings(repo=str(EXAMPLES), state_dir=tmp_path, worker={
        "standby_keep_s": standby_keep_s, "restart_backoff_max_s": 0.2,
        "quarantine_standing": False, **worker}, runtime={"ping_interval_s": 0.05})


@pytest.fixture
async def launcher() -> AsyncIterator[InProcessLauncher]:
    launcher = InProcessLauncher()
    yield launcher
    await launcher.close()


async def test_a_killed_runtime_is_restarted_and_counted(tmp_path: Path,
                                                         launcher: InProcessLauncher) -> None:
    settings = settings_for(tmp_path)
    store, catalog = open_repository(settings)
    supervisor = RuntimeSupervisor(settings, catalog, store, launcher=launcher)
    crashed_before = REGISTRY.get_sample_value("modelfleet_runtime_restarts_total",
                                               {"reason": "exited"}) or 0.0
    await supervisor.start()
    [runtime] = supervisor.shared
    assert runtime.ready and runtime.runtime is not None
    first = runtime.runtime
    supervisor.changed.clear()
    await launcher.started[0].kill()
    await eventually(lambda: runtime.restarts == 1 and runtime.ready)
    assert supervisor.changed.is_set()  # the coordinator is told: down, then ready
    assert runtime.runtime is not first and runtime.runtime is launcher.started[1].runtime
    assert (REGISTRY.get_sample_value("modelfleet_runtime_restarts_total",
                                      {"reason": "exited"}) or 0.0) == crashed_before + 1
    await supervisor.stop()
    assert runtime.stopped and all(s.exit_code is not None for s in launcher.started)


async def test_after_a_crash_a_standby_is_kept_and_takes_over(
        tmp_path: Path, launcher: InProcessLauncher) -> None:
    settings = settings_for(tmp_path, standby_keep_s=30)
    store, catalog = open_repository(settings)
    supervisor = RuntimeSupervisor(settings, catalog, store, launcher=launcher)
    await supervisor.start()
    [runtime] = supervisor.shared
    assert len(launcher.started) == 1  # no spare before a crash
    await launcher.started[0].kill()
    # Restarted, then a spare started beside it.
    await eventually(lambda: runtime.ready and len(launcher.started) == 3)
    serving, spare = launcher.started[1], launcher.started[2]
    assert runtime.runtime is serving.runtime
    await serving.kill()
    await eventually(lambda: runtime.restarts == 2 and runtime.ready)
    assert runtime.runtime is spare.runtime  # a swap, not a start
    await supervisor.stop()


async def test_an_orderly_stop_asks_the_runtime_to_shut_down(
        tmp_path: Path, launcher: InProcessLauncher) -> None:
    settings = settings_for(tmp_path)
    store, catalog = open_repository(settings)
    supervisor = RuntimeSupervisor(settings, catalog, store, launcher=launcher)
    await supervisor.start()
    await supervisor.stop()
    assert [s.exit_code for s in launcher.started] == [0]  # shut down, not killed
    assert supervisor.shared[0].stopped


async def test_residency_mirrors_what_the_runtimes_hold(
        tmp_path: Path, launcher: InProcessLauncher) -> None:
    settings = settings_for(tmp_path)
    store, catalog = open_repository(settings)
    supervisor = RuntimeSupervisor(settings, catalog, store, launcher=launcher)
    await supervisor.start()
    [runtime] = supervisor.shared
    assert runtime.runtime is not None
    await runtime.runtime.load("iris", "1")
    await runtime.runtime.load("banner", "1")
    residency = Residency(time.time)
    await residency.refresh(supervisor.all())
    assert residency.models("device") == frozenset({"iris", "banner"})
    assert REGISTRY.get_sample_value("modelfleet_resident_models", {"tier": "device"}) == 2
    await runtime.runtime.unload("banner")
    await residency.refresh(supervisor.all())
    assert residency.models("device") == frozenset({"iris"})
    await launcher.started[0].kill()  # a runtime that died holds nothing, nor its successor
    await eventually(lambda: runtime.restarts == 1)
    await residency.refresh(supervisor.all())
    assert residency.models("device") == frozenset()
    await supervisor.stop()


async def test_the_quarantine_runtime_stands_from_the_start_and_keeps_a_spare_once_used(
        tmp_path: Path, launcher: InProcessLauncher) -> None:
    settings = settings_for(tmp_path, standby_keep_s=30, quarantine_standing=True)
    store, catalog = open_repository(settings)
    supervisor = RuntimeSupervisor(settings, catalog, store, launcher=launcher)
    await supervisor.start()
    names = {r.name for r in supervisor.all()}
    assert names == {"runtime-0", "quarantine"}  # before any suspect
    quarantine = supervisor.take("iris", suspect=True)
    assert supervisor.is_quarantine(quarantine)
    await quarantine.wait_settled(20)
    # Used once: a spare is started beside it at once (its pills come in bursts).
    await eventually(lambda: len(launcher.started) == 3)
    supervisor.done("iris", quarantine)
    assert not await supervisor.retire_quarantine()  # it stands: never retired when idle
    await supervisor.stop()


async def test_a_shared_runtimes_eager_spare_waits_for_its_reloads_and_takes_over(
        tmp_path: Path, launcher: InProcessLauncher) -> None:
    settings = settings_for(tmp_path, standby_keep_s=30, standby_eager=True)
    store, catalog = open_repository(settings)
    supervisor = RuntimeSupervisor(settings, catalog, store, launcher=launcher)
    await supervisor.start()
    [runtime] = supervisor.shared
    # No crash yet, and still a spare, once the runtime has been up a while unloading.
    await eventually(lambda: len(launcher.started) == 2)
    spare = launcher.started[1]
    await launcher.started[0].kill()
    await eventually(lambda: runtime.restarts == 1 and runtime.ready)
    assert runtime.runtime is spare.runtime  # the first crash is a swap too
    await supervisor.stop()


async def test_a_record_of_a_runtime_killed_from_outside_sends_no_model_to_quarantine(
        tmp_path: Path, launcher: InProcessLauncher) -> None:
    settings = settings_for(tmp_path)
    store, catalog = open_repository(settings)
    supervisor = RuntimeSupervisor(settings, catalog, store, launcher=launcher)
    await supervisor.start()
    [runtime] = supervisor.shared
    supervisor.mark_crashing("crasher", recorded_on=runtime)  # it died of itself
    assert supervisor.crashing("crasher") and supervisor.quarantines("crasher", False)
    supervisor.mark_crashing("iris", recorded_on=runtime)  # named, then found SIGKILLed
    runtime.killed_at = time.monotonic()
    assert not supervisor.crashing("iris")
    supervisor.mark_crashing("banner", recorded_on=runtime)  # named after the kill was seen
    assert not supervisor.crashing("banner")
    supervisor.mark_crashing("banner")  # alone on a crash: evidence, however it died
    assert supervisor.crashing("banner")
    await supervisor.stop()
