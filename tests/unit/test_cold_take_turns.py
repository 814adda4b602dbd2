"""Workers that decide alone agree who takes a capped queue and who steps back from it.

Every worker ranks every worker alike for each model (``scheduling.keep_rank``,
rendezvous hashing). Over a queue with more consumers than its fan-out cap, the ones
ranked below the cap step back, so two workers never both leave a queue one of them
should keep (the randomized step-back did, a quarter of the time for two on a cap-1
queue, and a third worker then took it cold). Before a cold take of a capped queue, a
worker waits one turn per ``cap`` free workers ranked ahead of it, then counts afresh:
workers woken by one announcement do not all take it in the same instant.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from modelfleet.broker.embedded import MemoryBroker
from modelfleet.messages import PayloadRef, Task, now_ms
from modelfleet.scheduling import (
    MAX_TAKE_TURNS,
    QueueView,
    ScoringSettings,
    Snapshot,
    WorkerView,
    decide,
    keep_rank,
    take_turn,
)
from modelfleet.settings import Settings
from modelfleet.worker.announced import AnnouncedCounts
from modelfleet.worker.coordinator import Coordinator
from tests.fleet import in_process_fleet
from tests.procs import write_package

MODELS = [f"m{i}" for i in range(200)]


def steps_back(worker_id: str, model_id: str, consumers: int, cap: int,
               outranked_by: int | None, now: float = 1000.0) -> bool:
    queue = QueueView(model_id, backlog=3, consumers=consumers, fanout_max_workers=cap,
                      outranked_by=outranked_by)
    worker = WorkerView(worker_id, subscriptions=frozenset({model_id}),
                        resident_device=frozenset({model_id}), free_permits=2,
                        permits_cap=4)
    decision = decide(Snapshot(now, (queue,), worker), ScoringSettings(), 7)
    return model_id in decision.unsubscribe


def ahead(worker_id: str, others: list[str], model_id: str) -> int:
    mine = keep_rank(worker_id, model_id)
    return sum(1 for other in others if keep_rank(other, model_id) < mine)


def test_of_two_workers_over_a_cap_1_queue_exactly_one_steps_back() -> None:
    leavers = []
    for model_id in MODELS:
        left = [w for w, other in (("w-a", "w-b"), ("w-b", "w-a"))
                if steps_back(w, model_id, 2, 1, ahead(w, [other], model_id))]
        assert len(left) == 1, (model_id, left)
        leavers.append(left[0])
    # Ranks are drawn per model: neither worker keeps every queue.
    assert 60 < leavers.count("w-a") < 140


def test_of_three_over_a_cap_2_queue_the_last_ranked_steps_back() -> None:
    workers = ["w-a", "w-b", "w-c"]
    for model_id in MODELS[:50]:
        left = [w for w in workers if steps_back(
            w, model_id, 3, 2, ahead(w, [o for o in workers if o != w], model_id))]
        assert left == [max(workers, key=lambda w: keep_rank(w, model_id))]


def test_knowing_nobody_the_step_back_is_drawn_and_may_leave_the_queue_to_no_one() -> None:
    """Without the others' names (``outranked_by`` None) each steps back at random with
    the share over the cap: some queues are left by both, which is what the ranks end."""
    both = sum(1 for m in MODELS
               if steps_back("w-a", m, 2, 1, None) and steps_back("w-b", m, 2, 1, None))
    assert both > 0


def test_a_worker_that_does_not_yet_know_the_other_consumer_keeps_the_queue() -> None:
    # Its peers' states have not named the second consumer yet: it keeps the queue; the
    # other, which knows it, decides (and a worker's state comes every state interval).
    assert not steps_back("w-a", "m1", 2, 1, 0)


def test_turns_go_by_cap_and_stop_at_the_last() -> None:
    assert [take_turn(n, 1) for n in range(5)] == [0, 1, 2, 3, 3]
    assert [take_turn(n, 2) for n in range(6)] == [0, 0, 1, 1, 2, 2]
    assert take_turn(1000, 1) == MAX_TAKE_TURNS


def state(worker_id: str, subscriptions: list[str], in_use: int = 0,
          cap: int = 4) -> dict[str, object]:
    return {"kind": "worker_state", "worker_id": worker_id, "subscriptions": subscriptions,
            "permits_in_use": in_use, "permits_cap": cap}


def test_peers_announced_states_say_who_outranks_this_worker() -> None:
    counts = AnnouncedCounts(fresh_s=1.0, forget_s=10.0, peer_stale_s=3.0, worker_id="w-a")
    model_id = next(m for m in MODELS if ahead("w-a", ["w-b", "w-c"], m) == 2)
    counts.observe(state("w-b", [model_id]), 0.0)
    counts.observe(state("w-c", [], in_use=4), 0.0)  # busy: no permit free
    assert counts.outranked_by(model_id) == 1  # only w-b consumes it
    assert counts.free_ahead(model_id) == 1  # w-c has no permit free to take it
    counts.observe(state("w-c", [model_id], in_use=1), 0.5)
    assert (counts.outranked_by(model_id), counts.free_ahead(model_id)) == (2, 2)
    counts.observe({"kind": "worker_gone", "worker_id": "w-b"}, 1.0)
    assert (counts.outranked_by(model_id), counts.free_ahead(model_id)) == (1, 1)
    counts.expire_peers(10.0)  # w-c silent since 0.5 s: stale
    assert (counts.outranked_by(model_id), counts.free_ahead(model_id)) == (0, 0)


def test_only_peers_that_could_take_a_cold_queue_come_before_this_worker() -> None:
    counts = AnnouncedCounts(fresh_s=1.0, forget_s=10.0, peer_stale_s=3.0, worker_id="w-a")
    model_id = next(m for m in MODELS if ahead("w-a", ["w-b", "w-c"], m) == 2)
    counts.observe({**state("w-b", []), "accepting_cold_work": False}, 0.0)  # loader full
    counts.observe({**state("w-c", []), "gpus": 1}, 0.0)
    assert counts.free_ahead(model_id) == 1
    counts.observe({**state("w-b", []), "accepting_cold_work": True}, 0.5)
    assert counts.free_ahead(model_id) == 2
    # A CUDA-only model: a CPU worker will never take it, so it takes no turn.
    assert counts.free_ahead(model_id, cuda_only=True) == 1


MODEL = '''
    from modelfleet import Model

    class Echo(Model):
        def predict(self, batch):
            return [{"ok": True} for _ in batch]
'''


@contextlib.asynccontextmanager
async def two_workers(tmp_path: Path, turn_s: float
                      ) -> AsyncIterator[tuple[MemoryBroker, Coordinator, Coordinator]]:
    """Two workers on one embedded broker, driven by hand, each knowing the other is free."""
    repo = tmp_path / "repo"
    write_package(repo, "solo", 'name = "solo"\nversion = "1"\nentrypoint = "handler:Echo"\n'
                  'accepts = ["text/plain"]\n[fanout]\nmax_workers = 1\n', MODEL)

    def settings(worker_id: str) -> Settings:
        return Settings(repo=str(repo), state_dir=tmp_path / worker_id,
                        broker={"url": "memory"},
                        worker={"worker_id": worker_id, "permits": 4,
                                "cold_take_turn_s": turn_s})

    broker = MemoryBroker(settings("w-a").broker)
    await broker.connect()
    try:
        async with in_process_fleet(settings("w-a"), start="runtimes", broker=broker) as a, \
                in_process_fleet(settings("w-b"), start="runtimes", broker=broker) as b:
            for me, other in ((a.coordinator, "w-b"), (b.coordinator, "w-a")):
                me._announced.observe(state(other, []), me._clock())
            yield broker, a.coordinator, b.coordinator
    finally:
        await broker.close()


async def put_task(broker: MemoryBroker, coordinators: tuple[Coordinator, ...]) -> None:
    await broker.publish_task(Task(uuid.uuid4().hex, "solo", "1", now_ms() + 60_000,
                                   "nowhere", PayloadRef("inline", data=b"x", size_bytes=1),
                                   "text/plain", now_ms()))
    for coordinator in coordinators:  # what their event listeners do with the demand
        coordinator._queues.demand_heard("solo")
        coordinator._note_demand("solo")


async def test_two_free_workers_woken_together_take_a_cap_1_queue_one_after_another(
        tmp_path: Path) -> None:
    async with two_workers(tmp_path, turn_s=0.2) as (broker, a, b):
        first, second = sorted((a, b), key=lambda c: keep_rank(c.worker_id, "solo"))
        # The queue waits with nobody on it; the first task is held by nobody (no
        # consumer runs it here: the test drives the re-scores and never starts one).
        await put_task(broker, (a, b))
        await asyncio.gather(a._rescore(full=True), b._rescore(full=True))
        assert "solo" in first._consumers
        assert "solo" not in second._consumers
        assert "solo" in second._turns  # it waits its turn rather than take it now
        await asyncio.sleep(0.3)
        await second._rescore(full=True)  # its turn: a fresh count finds the cap reached
        assert "solo" not in second._consumers
        assert (await broker.queue_stats(["solo"]))["solo"].consumers == 1


async def test_the_second_ranked_takes_the_queue_in_its_turn_if_the_first_did_not(
        tmp_path: Path) -> None:
    async with two_workers(tmp_path, turn_s=0.2) as (broker, a, b):
        first, second = sorted((a, b), key=lambda c: keep_rank(c.worker_id, "solo"))
        await put_task(broker, (second,))  # only the second heard the demand
        await second._rescore(full=True)
        assert "solo" not in second._consumers  # not yet: the first might take it
        await asyncio.sleep(0.3)
        await second._rescore(full=True)
        assert "solo" in second._consumers
        assert "solo" not in first._consumers
