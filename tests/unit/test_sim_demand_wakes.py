"""The simulator takes demand announcements as the coordinator's event listener does
(``worker/coordinator.py``, ``_listen_events``): a model not held here, not already to
be counted and not last counted at its fan-out cap is to be counted afresh, and wakes
the worker if a permit is free. The simulator folds announcements lazily; these tests
hold the lazy fold to the slow path that takes each announcement as it is heard."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace

import pytest

from modelfleet.sim import pull
from modelfleet.sim.engine import Simulation
from modelfleet.sim.scenario import ScenarioConfig, build_catalog, build_trace
from modelfleet.sim.wakeable import WakeableWorkers

SMALL = ScenarioConfig(models=60, workers=4, duration_s=40.0, warmup_s=5.0, rate=12.0,
                       bursts_per_min=2.0, burst_rate=10.0, burst_s=3.0, device_gib=2.0,
                       host_gib=2.0, size_median_mb=150.0, size_max_mb=1_500.0,
                       sample_s=5.0, seed=3)


class EagerCheck(pull.PullAffinity):
    """Pull-affinity that also takes every announcement the slow way, for every worker,
    at the instant it is heard, and checks the simulator's lazy fold and its wakes
    against that."""

    def __init__(self, seed: int) -> None:
        super().__init__(rng_seed=seed)
        self.passes: list[dict[int, bool]] = []  # per worker: log index -> taken?
        self.woken: list[int] = []
        self.wakes = self.skipped_dirty = self.skipped_cap = self.folds = 0

    def attach(self, sim: Simulation) -> None:
        super().attach(sim)
        self.passes = [{} for _ in self._coords]

    def _at_cap(self, coord: pull.Coordinator, model: int) -> bool:
        """``Coordinator._at_cap``: the last count saw the queue at its fan-out cap."""
        count = coord.counts.get(model)
        facts = self._facts[model]
        if count is None or facts.pinned:
            return False
        return count[1] >= self.settings.fanout_cap(facts.fanout_max_workers, facts.plan)

    def _dirty_now(self, index: int) -> set[int]:
        """What the worker's dirty set is now, taking each pending announcement as heard."""
        coord = self._coords[index]
        log, offset = self._heard_log, self._heard_offset
        pending = range(coord.heard_upto, self.heard_end())
        return self.dirty(coord) | {log[k - offset] for k in pending if self.passes[index][k]}

    def _heard(self, model: int) -> None:
        position = self.heard_end()
        expected = []
        for index, coord in enumerate(self._coords):
            taken = model not in coord.consumers and not self._at_cap(coord, model)
            dirty = self._dirty_now(index)
            if taken and model in dirty:
                self.skipped_dirty += 1
            elif model not in coord.consumers and not taken:
                self.skipped_cap += 1
            free = coord.worker.in_flight < coord.worker.permits
            if taken and model not in dirty and free and coord.state != pull.PAUSING \
                    and not (coord.state == pull.RESCORING and coord.changed):
                expected.append(index)
            self.passes[index][position] = taken
        self.woken = []
        super()._heard(model)
        assert self.woken == expected
        self.wakes += len(expected)

    def _wake(self, coord: pull.Coordinator) -> None:
        self.woken.append(coord.worker.index)
        super()._wake(coord)

    def _fold_heard(self, coord: pull.Coordinator) -> None:
        index = coord.worker.index
        expected = self._dirty_now(index)
        super()._fold_heard(coord)
        assert coord.heard_upto == self.heard_end()
        assert self.dirty(coord) == expected
        self.folds += 1


@pytest.mark.parametrize("seed", [3, 4])
def test_the_lazy_fold_takes_each_announcement_as_if_heard_at_once(seed: int) -> None:
    config = replace(SMALL, seed=seed)
    router = EagerCheck(seed)
    Simulation(config, build_catalog(config), build_trace(config), router).run()
    assert router.folds > 1000 and router.wakes > 100
    assert router._heard_offset > 0  # what no worker reads again was dropped on the way
    # Both rules of the event listener were exercised, not just the plain wake. (Fewer
    # at-cap skips than when a wake put the next tick off: counts at the cap are taken
    # again at every tick now, so they go stale less; 78 and 30 for these seeds.)
    assert router.skipped_dirty > 100 and router.skipped_cap > 20


def counted_worker(config: ScenarioConfig
                   ) -> tuple[pull.PullAffinity, pull.Coordinator, list[int]]:
    """Pull-affinity on ``config`` with worker 0 fully counted, free to be woken, and
    its wakes recorded (the list) instead of run."""
    router = pull.PullAffinity(rng_seed=config.seed)
    sim = Simulation(config, build_catalog(config), build_trace(config), router)
    router.attach(sim)
    coord = router._coords[0]
    router._refresh(coord)
    router._count(coord, full=True)
    woken: list[int] = []
    router._wake = lambda c: woken.append(c.worker.index)  # type: ignore[method-assign]
    router._wakeable = WakeableWorkers()
    router._wakeable.add(0, coord.heard_upto)
    return router, coord, woken


def test_an_announcement_wakes_a_worker_once_until_counted_and_not_at_the_cap() -> None:
    config = SMALL
    router, coord, woken = counted_worker(config)
    model = next(m for m in range(config.models) if not router._facts[m].pinned)
    router._heard(model)
    assert woken == [0]  # heard, not held, never counted: wake
    router._heard(model)
    assert woken == [0]  # to be counted already: no second wake
    router._count(coord, full=False)  # counted: the next announcement wakes again
    assert model not in router.dirty(coord)
    router._heard(model)
    assert woken == [0, 0]
    # A queue last counted with as many consumers as its fan-out cap does not wake.
    other = next(m for m in range(model + 1, config.models) if not router._facts[m].pinned)
    cap = router.settings.fanout_cap(router._facts[other].fanout_max_workers,
                                     router._facts[other].plan)
    router._consumers[other].extend(pull.Consumer(other, 1, owner=1) for _ in range(cap))
    router._fold_heard(coord)  # as every caller of _set_count does first
    router._set_count(coord, other)
    assert other in coord.at_cap and not router._facts[other].pinned
    router._heard(other)
    assert woken == [0, 0]
    router._fold_heard(coord)
    assert other not in router.dirty(coord)  # and it is not counted afresh at a woken re-score


def test_the_wake_at_cap_ablation_wakes_for_a_queue_at_its_cap() -> None:
    config = replace(SMALL, wake_at_cap=True)
    router, coord, woken = counted_worker(config)
    model = next(m for m in range(config.models) if not router._facts[m].pinned)
    cap = router.settings.fanout_cap(router._facts[model].fanout_max_workers,
                                     router._facts[model].plan)
    router._consumers[model].extend(pull.Consumer(model, 1, owner=1) for _ in range(cap))
    router._fold_heard(coord)
    router._set_count(coord, model)
    router._heard(model)
    assert woken == [0]
    router._fold_heard(coord)
    assert model in router.dirty(coord)


class ExpiredBacklog(pull.PullAffinity):
    """At 35 s, 1,500 tasks that arrived at 0 (past their 30 s deadline) wait in one
    queue, and a worker subscribes to it."""

    extra = 1_500

    def attach(self, sim: Simulation) -> None:
        super().attach(sim)
        sim.after(35.0, self._expired_backlog)

    def _expired_backlog(self) -> None:
        sim, model, first = self.sim, 0, len(self.sim.arrival)
        sim.arrival.extend([0.0] * self.extra)
        sim.request_model.extend([model] * self.extra)
        sim.latency.extend([math.nan] * self.extra)
        sim.answered_at.extend([math.nan] * self.extra)
        sim.hit.extend(bytearray(self.extra))
        sim.timed_out.extend(bytearray(self.extra))
        self._queues[model].extend((i, model, 0.0) for i in range(first, first + self.extra))
        self._nonempty.add(model)
        self._subscribed(self._coords[0], model, 1, deque())


def test_a_queue_of_expired_tasks_drains_without_running_out_of_stack() -> None:
    """Each expired task gives its permit back at once and the next delivery starts in
    the same call chain: a few frames per task, past Python's default limit here."""
    config = SMALL
    router = ExpiredBacklog(rng_seed=config.seed)
    sim = Simulation(config, build_catalog(config), build_trace(config), router)
    sim.run()
    assert not router._queues[0]
    assert all(sim.timed_out[-ExpiredBacklog.extra:])
