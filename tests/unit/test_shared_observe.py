"""The coordinator and the simulator observe alike: one state, the same snapshot.

The same fleet state (backlogs, a consumer elsewhere, demand heard, plans) is set up
twice: on a real coordinator (the embedded broker, in-process runtimes, a repository
on disk) and in the simulator's pull model. Both go through their own gathering and
the shared ``scheduling.snapshot_of``; the snapshots must be equal, and so must what
``decide`` makes of them. The state is one where the two used to disagree: two
starved queues for one free load slot, where the worker takes the higher plan
priority first and the simulator took the higher score.
"""

from __future__ import annotations

import uuid
import zlib
from dataclasses import replace
from pathlib import Path

from modelfleet.messages import PayloadRef, Task, now_ms
from modelfleet.scheduling import ScoringSettings, Snapshot, actions_for, decide, snapshot_of
from modelfleet.settings import Settings
from modelfleet.sim.engine import Simulation
from modelfleet.sim.pull import Consumer, PullAffinity
from modelfleet.sim.scenario import ScenarioConfig, build_catalog, build_trace
from tests.fleet import in_process_fleet
from tests.procs import write_package

NOW = 1_000.0
WORKER = "w0000"  # the simulator's name for its first worker
# model -> (plan, tasks waiting, consumers elsewhere, demand heard)
STATE = {
    "big-free": ("free", 6, 0, True),  # starved, the highest pressure: the best score
    "ent": ("enterprise", 1, 0, True),  # starved, a higher plan: taken first
    "pro-shared": ("pro", 3, 1, True),  # one consumer elsewhere
    "idle": ("free", 0, 0, True),  # in demand, nothing waits
    "quiet": ("free", 0, 0, False),  # in the catalog only
}
MODEL = '''
    from modelfleet import Model

    class Echo(Model):
        def predict(self, batch):
            return batch
'''


def manifest(name: str, plan: str) -> str:
    return f'''
        name = "{name}"
        version = "1"
        entrypoint = "handler:Echo"
        plan = "{plan}"
        accepts = ["text/plain"]
    '''


def task(model: str) -> Task:
    return Task(uuid.uuid4().hex, model, "1", now_ms() + 60_000, "nobody",
                PayloadRef("inline", data=b"x", size_bytes=1), "text/plain", now_ms())


async def coordinator_snapshot(tmp_path: Path, scoring: ScoringSettings
                               ) -> tuple[Snapshot, int]:
    repo = tmp_path / "repo"
    for name, (plan, _, _, _) in STATE.items():
        write_package(repo, name, manifest(name, plan), MODEL)
    settings = Settings(repo=str(repo), state_dir=tmp_path / "state", broker={"url": "memory"},
                        worker={"worker_id": WORKER, "permits": 4},
                        runtime={"max_concurrent_loads": 1}, scheduling=scoring)
    async with in_process_fleet(settings, start="runtimes", clock=lambda: NOW) as fleet:
        broker, coordinator = fleet.broker, fleet.coordinator
        elsewhere = []
        try:
            for name, (_, waiting, consumers, heard) in STATE.items():
                for _ in range(waiting + consumers):  # a consumer elsewhere holds one each
                    await broker.publish_task(task(name))
                for _ in range(consumers):
                    elsewhere.append(await broker.subscribe(name, 1))
                if heard:
                    coordinator._note_demand(name)
            snapshot = await coordinator._observe(full=True)
            assert snapshot is not None
            return snapshot, zlib.crc32(WORKER.encode())
        finally:
            for sub in elsewhere:
                await sub.cancel()


def simulator_snapshot(scoring: ScoringSettings, seed: int) -> Snapshot:
    names = tuple(STATE)
    config = ScenarioConfig(models=len(names), workers=2, duration_s=10.0, warmup_s=1.0,
                            rate=1.0, permits=4, loaders=1, runtimes_per_worker=1,
                            batch_size=1, seed=1)
    catalog = replace(build_catalog(config), names=names,
                      plans=tuple(STATE[n][0] for n in names), pinned=frozenset(),
                      fanout_max_workers=(2,) * len(names), runtime=(0,) * len(names))
    router = PullAffinity(scoring, rng_seed=seed)
    sim = Simulation(config, catalog, build_trace(config), router)
    router.attach(sim)
    sim.now = NOW
    for model, name in enumerate(names):
        _, waiting, consumers, heard = STATE[name]
        router._queues[model].extend((i, model, NOW) for i in range(waiting))
        if waiting:
            router._nonempty.add(model)
        for _ in range(consumers):  # another worker's consumer, its window full
            router._consumers[model].append(Consumer(model, 1, owner=1, held=1))
        if heard:  # (before the bookkeeping: it keeps the backlogged in demand too)
            router._demand[model] = NOW
        router._dispatch(model)  # the broker's bookkeeping of the queue (nothing delivered)
    coord = router._coords[0]
    router._refresh(coord)
    router._count(coord, full=True)
    return snapshot_of(router.observation(coord), scoring, seed)


async def test_one_state_gives_the_worker_and_the_simulator_one_snapshot(
        tmp_path: Path) -> None:
    scoring = ScoringSettings()
    worker, seed = await coordinator_snapshot(tmp_path, scoring)
    simulated = simulator_snapshot(scoring, seed)
    assert simulated == worker
    # One load slot: of the two starved queues, the enterprise one is kept (priority
    # before score, as scoring admits them); nothing waits in "idle" or "quiet".
    assert [q.model_id for q in worker.queues] == ["ent", "pro-shared"]
    assert worker.worker.loader_room == {"runtime-0": 1}
    decided = decide(worker, scoring, seed)
    assert decided == decide(simulated, scoring, seed)
    assert "ent" in decided.subscribe and "ent" in decided.cold
    steps = actions_for(decided, worker, scoring)
    assert steps == actions_for(decide(simulated, scoring, seed), simulated, scoring)
    assert [s.kind for s in steps] == ["subscribe"] * len(decided.subscribe)
