"""A worker with two shared runtimes, in one process: placement and the pooled budget.

The embedded broker, in-process runtimes (the runtime's own server code) and real
handlers. Each handler instance answers with its own id, so the replies say which
copy of a model served them: a hot model is served by a copy on each runtime while
its load lasts, and by one again once the load stops (the other copy unloaded). The
budget is observed as the runtimes report it (the ``budget`` op).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from modelfleet.broker.embedded import MemoryBroker
from modelfleet.ipc.protocol import DeviceBudget
from modelfleet.messages import PayloadRef, Reply, Task, now_ms
from modelfleet.settings import Settings
from modelfleet.worker.supervisor import RuntimeSupervisor
from tests.fleet import in_process_fleet
from tests.procs import write_package
from tests.waiting import eventually

MB = 1024 * 1024

# Sleeps for the number in its input; holds HOLD_MB of bytes (what the runtime measures).
HANDLER = '''
    from __future__ import annotations

    import time

    from modelfleet import Model, Request

    class Held(Model):
        def load(self, ctx):
            self.blob = bytes({hold} * 1024 * 1024)

        async def preprocess(self, request: Request) -> str:
            return request.text()

        def predict(self, batch):
            out = []
            for text in batch:
                parts = text.split()
                time.sleep(float(parts[1]) if len(parts) > 1 else 0.0)
                out.append({{"echo": text, "copy": id(self)}})
            return out
'''
MANIFEST = '''
    name = "{name}"
    version = "1"
    entrypoint = "handler:Held"
    accepts = ["text/plain"]
    memory_estimate_mb = {hold}
    [batching]
    max_batch_size = 1
'''


@dataclass
class Worker:
    broker: MemoryBroker
    supervisor: RuntimeSupervisor
    inbox_address: str
    replies: asyncio.Queue[Reply]

    async def send(self, model: str, text: str) -> Task:
        body = text.encode()
        task = Task(uuid.uuid4().hex, model, "1", now_ms() + 30_000, self.inbox_address,
                    PayloadRef("inline", data=body, size_bytes=len(body)), "text/plain",
                    now_ms())
        await self.broker.publish_task(task)
        await self.broker.publish_event({"kind": "demand", "model_id": model,
                                         "at": time.time()})
        return task

    async def replies_for(self, count: int) -> list[dict[str, object]]:
        out = []
        for _ in range(count):
            reply = await asyncio.wait_for(self.replies.get(), 30)
            assert reply.status == "ok", reply.error_message
            out.append(json.loads(reply.body))
        return out

    async def budgets(self) -> list[DeviceBudget]:
        found = []
        for shared in self.supervisor.shared:
            assert shared.runtime is not None
            found.append(await shared.runtime.budget())
        return found


async def start_worker(tmp_path: Path, models: dict[str, int],
                       **worker: object) -> AsyncIterator[Worker]:
    repo = tmp_path / "repo"
    for name, hold in models.items():
        write_package(repo, name, MANIFEST.format(name=name, hold=hold),
                      HANDLER.format(hold=hold))
    settings = Settings(repo=str(repo), state_dir=tmp_path / "state", broker={"url": "memory"},
                        worker={"worker_id": "w-spread", "shared_runtimes": 2, "permits": 8,
                                "rescore_interval_s": 0.1, "state_interval_s": 0.2,
                                "standby_keep_s": 0, **worker},
                        runtime={"ping_interval_s": 0.1, "host_budget_bytes": 0})
    async with in_process_fleet(settings) as fleet:
        yield Worker(fleet.broker, fleet.supervisor, fleet.inbox_address, fleet.replies)


@pytest.fixture
async def hot_worker(tmp_path: Path) -> AsyncIterator[Worker]:
    async for worker in start_worker(tmp_path, {"hot": 1}, replica_at_tasks=2,
                                     replica_keep_s=0.3):
        yield worker


def replicas() -> float:
    return REGISTRY.get_sample_value("modelfleet_worker_model_replicas") or 0.0


async def test_a_hot_model_is_served_from_both_runtimes_and_from_one_once_load_stops(
        hot_worker: Worker) -> None:
    worker = hot_worker
    await worker.send("hot", "warm")
    [first] = await worker.replies_for(1)
    # A sustained load: more tasks in flight than one runtime is given (2 here).
    copies: set[object] = set()
    for _ in range(4):
        for i in range(8):
            await worker.send("hot", f"load-{i} 0.2")
        copies |= {r["copy"] for r in await worker.replies_for(8)}
    assert len(copies) == 2, "the hot model was served by one copy only"
    assert [("hot" in b.device) for b in await worker.budgets()] == [True, True]
    assert len(worker.supervisor.spread.holders("hot")) == 2

    # The load stops: after replica_keep_s the second copy is dropped and unloaded.
    async def one_copy_left() -> bool:
        return sum("hot" in b.device for b in await worker.budgets()) == 1

    await eventually(one_copy_left, 15, what="the replica taken off")
    assert replicas() == 0
    assert len(worker.supervisor.spread.holders("hot")) == 1
    # A light load (one task at a time) is served by the copy that stayed, alone.
    left = set()
    for i in range(4):
        await worker.send("hot", f"after-{i}")
        left |= {r["copy"] for r in await worker.replies_for(1)}
    assert len(left) == 1 and left <= copies
    assert first["copy"] in copies


@pytest.fixture
async def pooled_worker(tmp_path: Path) -> AsyncIterator[Worker]:
    # 6 MB for the worker: 3 MB per runtime to start with, less than either model.
    async for worker in start_worker(tmp_path, {"big": 4, "other": 4, "huge": 8},
                                     device_budget_bytes=6 * MB):
        yield worker


async def test_one_budget_for_the_worker_serves_a_model_larger_than_a_runtimes_share(
        pooled_worker: Worker) -> None:
    """Two runtimes with 3 MB each could not load a 4 MB model; one 6 MB pool can, and
    the runtimes' budgets together never hold more than the pool."""
    worker = pooled_worker
    assert sum(b.budget_bytes for b in await worker.budgets()) == 6 * MB
    await worker.send("big", "one")
    await worker.replies_for(1)
    budgets = await worker.budgets()
    assert sum(b.budget_bytes for b in budgets) == 6 * MB
    assert sum(b.used_bytes for b in budgets) <= 6 * MB
    assert any("big" in b.device for b in budgets)
    # A second 4 MB model does not fit beside the first: the pool takes room back from
    # the runtime holding it (it evicts) rather than overflowing.
    await worker.send("other", "two")
    await worker.replies_for(1)
    budgets = await worker.budgets()
    assert sum(b.budget_bytes for b in budgets) == 6 * MB
    assert sum(b.used_bytes for b in budgets) <= 6 * MB
    assert [m for b in budgets for m in b.device] == ["other"]


async def test_a_model_larger_than_the_whole_pool_is_refused_saying_so(
        pooled_worker: Worker) -> None:
    worker = pooled_worker
    await worker.send("big", "first")
    await worker.replies_for(1)
    task = await worker.send("huge", "too-big")
    reply = await asyncio.wait_for(worker.replies.get(), 30)
    assert (reply.request_id, reply.status) == (task.request_id, "error")
    assert reply.error_code == "model_too_large", (reply.error_code, reply.error_message)
    assert "device budget is 6291456 bytes" in (reply.error_message or "")
    budgets = await worker.budgets()  # the pool is whole, and still serves
    assert sum(b.budget_bytes for b in budgets) == 6 * MB
    await worker.send("big", "still-served")
    await worker.replies_for(1)


async def test_two_misses_that_do_not_fit_the_pool_together_both_get_answers(
        pooled_worker: Worker) -> None:
    """Two 4 MB models missed at once on a 6 MB pool: one runtime's room is taken for the
    other's load, so a load meets a budget that just moved away (``model_too_large``). The
    worker asks that runtime again within the task's deadline: every caller gets its
    answer, and the pool still never holds more than itself."""
    worker = pooled_worker
    before = REGISTRY.get_sample_value("modelfleet_worker_memory_retries_total",
                                       {"code": "model_too_large"}) or 0.0
    tasks = []
    for round_ in range(3):
        for model in ("big", "other"):
            tasks.append(await worker.send(model, f"{model}-{round_} 0.05"))
    replies = []
    for _ in tasks:
        replies.append(await asyncio.wait_for(worker.replies.get(), 60))
    assert sorted(r.request_id for r in replies) == sorted(t.request_id for t in tasks)
    failed = [(r.error_code, r.error_message) for r in replies if r.status != "ok"]
    assert failed == []
    budgets = await worker.budgets()
    assert sum(b.budget_bytes for b in budgets) == 6 * MB
    after = REGISTRY.get_sample_value("modelfleet_worker_memory_retries_total",
                                      {"code": "model_too_large"}) or 0.0
    assert after >= before  # counted when it happened (it need not, on a quiet machine)
