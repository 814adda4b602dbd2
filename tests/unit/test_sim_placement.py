"""The simulator places models on a worker's runtimes as the worker does
(``modelfleet.sim.placement``: the worker's own ``worker/spread.py``), and counts only the
queues that exist (a model a cold-lane task brought has none until a task is published)."""

from __future__ import annotations

from typing import Any

import pytest

import modelfleet.scheduling
from modelfleet.cache import GdsfPolicy, ModelCache
from modelfleet.scheduling import ScoringSettings
from modelfleet.sim import pull
from modelfleet.sim.compare import make_router
from modelfleet.sim.engine import Simulation
from modelfleet.sim.placement import HashPlacement, SpreadPlacement
from modelfleet.sim.scenario import Catalog, Trace, build_catalog, scenario
from modelfleet.sim.worker import SimRuntime, SimWorker

MB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def two_runtimes(budget_bytes: int, clock: Clock) -> SimWorker:
    runtimes = [SimRuntime(r, f"runtime-{r}", ModelCache(budget_bytes, 0, GdsfPolicy(),
                                                         clock=clock), 2) for r in range(2)]
    return SimWorker(0, "w0000", runtimes, permits=16)


def placement_of(worker: SimWorker, clock: Clock, catalog: Catalog,
                 keep_s: float = 10.0) -> SpreadPlacement:
    pool = sum(r.cache.device_budget_bytes for r in worker.runtimes)
    return SpreadPlacement(catalog, [worker], replica_at=8, keep_s=keep_s, pool_bytes=pool,
                           clock=clock)


def resident(worker: SimWorker, runtime: int, catalog: Catalog, model: int) -> None:
    cache = worker.runtimes[runtime].cache
    cache.reserve(catalog.names[model], catalog.size_bytes[model])
    cache.commit(catalog.names[model], catalog.size_bytes[model], 0.01, "repository")


@pytest.fixture
def catalog() -> Catalog:
    return build_catalog(scenario("peers"))


def test_hash_placement_is_the_catalogs_crc32_for_every_task(catalog: Catalog) -> None:
    clock = Clock()
    worker = two_runtimes(100 * MB, clock)
    placement = HashPlacement(catalog)
    for model in range(len(catalog.names)):
        task = (model, model, 0.0)
        assert placement.take(worker, task).index == catalog.runtime[model]
        assert placement.home(worker, model) == catalog.runtime[model]
        placement.done(worker, task)
    assert placement.moves(worker) == 0


def test_a_model_is_placed_on_the_runtime_running_least_then_with_most_free_share(
        catalog: Catalog) -> None:
    clock = Clock()
    worker = two_runtimes(100 * MB, clock)
    placement = placement_of(worker, clock, catalog)
    first = (0, 0, 0.0)
    assert placement.take(worker, first).name == "runtime-0"  # a tie: by name
    assert placement.home(worker, 0) == 0
    # runtime-0 runs a task now: the next model goes to runtime-1, and stays there.
    assert placement.home(worker, 1) == 1
    placement.done(worker, first)
    assert placement.home(worker, 1) == 1
    # Neither runs anything: the next goes where less is placed and not yet resident.
    smaller = 0 if catalog.size_bytes[0] < catalog.size_bytes[1] else 1
    assert placement.home(worker, 2) == smaller
    assert placement.moves(worker) == 3


def test_a_hot_model_gets_a_replica_and_loses_it_once_it_cooled(catalog: Catalog) -> None:
    clock = Clock()
    worker = two_runtimes(200 * MB, clock)
    placement = placement_of(worker, clock, catalog, keep_s=10.0)
    model = 5
    assert placement.home(worker, model) == 0
    resident(worker, 0, catalog, model)
    unloaded: list[tuple[str, str]] = []
    placement.resync(worker, clock.now, lambda r, m: unloaded.append((r.name, m)))
    tasks = [(i, model, 0.0) for i in range(9)]
    taken = [placement.take(worker, task).name for task in tasks]
    # Eight in flight on its one holder make it hot: the ninth runs on the new replica.
    assert taken == ["runtime-0"] * 8 + ["runtime-1"]
    assert placement.runtime_of(worker, tasks[8]).name == "runtime-1"
    for task in tasks:
        placement.done(worker, task)
    clock.now = 1.0
    placement.resync(worker, clock.now, lambda r, m: unloaded.append((r.name, m)))
    assert unloaded == []  # quiet, but not for keep_s yet
    clock.now = 12.0
    placement.resync(worker, clock.now, lambda r, m: unloaded.append((r.name, m)))
    assert unloaded == [("runtime-1", catalog.names[model])]
    assert placement.take(worker, (20, model, 12.0)).name == "runtime-0"


def test_a_resync_forgets_where_models_neither_resident_nor_running_were_placed(
        catalog: Catalog) -> None:
    clock = Clock()
    worker = two_runtimes(100 * MB, clock)
    placement = placement_of(worker, clock, catalog)
    busy = placement.take(worker, (0, 0, 0.0))  # placed, running
    assert placement.home(worker, 1) == 1  # placed, idle
    assert placement.home(worker, 2) == 1  # placed, and loaded there below
    resident(worker, 1, catalog, 2)
    moves = placement.moves(worker)
    placement.resync(worker, clock.now, lambda r, m: None)
    assert placement.moves(worker) > moves
    assert placement.holders(worker, 0) == (busy.name,)  # running: kept
    assert placement.holders(worker, 2) == ("runtime-1",)  # resident: kept
    assert placement.holders(worker, 1) == ()  # neither: forgotten, placed afresh


def test_a_model_a_lane_task_brought_is_no_candidate_until_a_task_waits_in_its_queue(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker counts only queues that exist (QueueCounts.presume_missing): a model whose
    # requests all went by the cold lane is resident here but has no queue, so it is no
    # candidate (the sim subscribed to each such empty queue, warm, 5,000 times a run at
    # 5,000 models, where the build subscribed 19 times).
    config = scenario("peers", clients=0, warmup_s=0.0, duration_s=4.0)
    catalog = build_catalog(config)
    model = catalog.names[3]
    seen: list[tuple[float, bool, bool]] = []  # (when, a queue of it, subscribed to it)
    real = modelfleet.scheduling.decide

    def spy(snapshot: modelfleet.scheduling.Snapshot, settings: ScoringSettings,
            rng_seed: int) -> modelfleet.scheduling.Decision:
        decision = real(snapshot, settings, rng_seed)
        seen.append((snapshot.now, any(q.model_id == model for q in snapshot.queues),
                     model in decision.subscribe))
        return decision

    monkeypatch.setattr(pull, "decide", spy)
    # One request at 0.5 s (the lane: it is loaded, so resident), ten at 2.0 s (four to
    # the lane, six to its own queue, which then exists).
    trace = Trace([0.5] + [2.0] * 10, [3] * 11)
    sim = Simulation(config, catalog, trace, make_router("pull-affinity", config,
                                                         ScoringSettings()))
    sim.run()
    runtimes: list[Any] = sim.workers[0].runtimes
    assert any(r.cache.tier_of(model) == "device" for r in runtimes)
    before = [entry for entry in seen if 0.6 < entry[0] < 2.0]
    after = [entry for entry in seen if entry[0] >= 2.0]
    assert before and not any(queued or subscribed for _, queued, subscribed in before)
    assert any(queued for _, queued, _ in after)
    assert all(latency < 1.0 for latency in sim.latency)


def test_a_run_replicates_its_hot_model_and_unloads_the_copy_once_it_cooled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Every client asks for one model: its tasks in flight reach permits / runtimes, so it
    # gets the other runtime too (both serve it); once the clients stop, it is quiet for
    # replica_keep_s and the copy is unloaded, its bytes back in the pool.
    config = scenario("peers", only_model=0, warmup_s=1.0, duration_s=6.0)
    sim = Simulation(config, build_catalog(config), Trace([], []),
                     make_router("pull-affinity", config, ScoringSettings()))
    served_on: set[str] = set()
    real_take = SpreadPlacement.take

    def take(placement: SpreadPlacement, worker: SimWorker, task: Any) -> SimRuntime:
        runtime = real_take(placement, worker, task)
        served_on.add(runtime.name)
        return runtime
    monkeypatch.setattr(SpreadPlacement, "take", take)
    sim.run()
    name = sim.catalog.names[0]
    assert served_on == {"runtime-0", "runtime-1"}
    worker = sim.workers[0]
    holding = [r.name for r in worker.runtimes if r.cache.tier_of(name) == "device"]
    assert len(holding) == 1
    assert sim.placement.home(worker, 0) == int(holding[0][-1])
    assert isinstance(sim.placement, SpreadPlacement)
    assert sim.placement.holders(worker, 0) == (holding[0],)


def test_a_runtimes_cache_ranks_by_how_long_its_loads_took_beside_everything_else() -> None:
    # ModelHost times a load by the clock and its cache's cost model learns from that:
    # with the CPU modelled a load shares the cores (and its runtime's GIL) with the rest,
    # so what the cache learns is at least the load's CPU and, under load, more.
    config = scenario("peers", warmup_s=1.0, duration_s=6.0)
    sim = Simulation(config, build_catalog(config), Trace([], []),
                     make_router("pull-affinity", config, ScoringSettings()))
    sim.run()
    cat = sim.catalog
    learnt = [(runtime.cache.reload_cost_s(name, cat.size_bytes[m]), cat.load_s[m])
              for runtime in sim.workers[0].runtimes
              for m, name in enumerate(cat.names)
              if runtime.cache.last_measured_bytes(name) is not None]
    assert learnt
    assert all(seconds >= nominal * 0.999 for seconds, nominal in learnt)
    assert sum(seconds > nominal * 1.5 for seconds, nominal in learnt) > len(learnt) // 4
