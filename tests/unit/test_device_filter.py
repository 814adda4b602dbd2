"""CUDA-only models (``device = "cuda"``) and the workers that may pull them.

A worker declares its CUDA devices (``worker.gpus``); one with none never subscribes to
a CUDA-only model's queue, whatever waits there, and a gateway whose fleet has no
worker with a device answers such a model 503 at once rather than leave the request
queued until its deadline (or run it on a CPU in silence).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from modelfleet.broker.embedded import MemoryBroker
from modelfleet.errors import NoCapacity
from modelfleet.gateway.service import GatewayService
from modelfleet.messages import PayloadRef, Task, now_ms
from modelfleet.settings import Settings
from modelfleet.worker.coordinator import Coordinator
from tests.fleet import in_process_fleet
from tests.procs import ECHO_HANDLER, ask, write_package
from tests.waiting import eventually

MANIFEST = '''
    name = "{name}"
    version = "1"
    entrypoint = "handler:Echo"
    accepts = ["text/plain"]
    device = "{device}"
'''


@dataclass
class Fleet:
    broker: MemoryBroker
    gateway: GatewayService
    coordinator: Coordinator


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    write_package(root, "on-gpu", MANIFEST.format(name="on-gpu", device="cuda"), ECHO_HANDLER)
    write_package(root, "on-cpu", MANIFEST.format(name="on-cpu", device="cpu"), ECHO_HANDLER)
    return root


async def _fleet(repo: Path, gpus: int) -> AsyncIterator[Fleet]:
    settings = Settings(repo=str(repo), state_dir=repo.parent / f"state-{gpus}", worker={
        "worker_id": f"w-gpus-{gpus}", "gpus": gpus, "rescore_interval_s": 0.05,
        "state_interval_s": 0.05, "standby_keep_s": 0})
    async with in_process_fleet(settings, gateway=True) as fleet:
        await fleet.gateway_heard_of_the_worker()
        yield Fleet(fleet.broker, fleet.service, fleet.coordinator)


@pytest.fixture
async def cpu_fleet(repo: Path) -> AsyncIterator[Fleet]:
    async for fleet in _fleet(repo, gpus=0):
        yield fleet


@pytest.fixture
async def gpu_fleet(repo: Path) -> AsyncIterator[Fleet]:
    async for fleet in _fleet(repo, gpus=1):
        yield fleet


async def _infer(fleet: Fleet, model: str) -> dict[str, str]:
    answer = await ask(fleet.gateway, model, None, b"hi", "text/plain", now_ms() + 20_000, {})
    result: dict[str, str] = json.loads(answer.body)
    return result


async def test_a_cpu_worker_never_subscribes_to_a_cuda_model(cpu_fleet: Fleet) -> None:
    """Tasks wait on the CUDA model's queue and its demand is announced: still not pulled."""
    assert await _infer(cpu_fleet, "on-cpu") == {"echo": "hi"}
    for i in range(3):
        await cpu_fleet.broker.publish_task(Task(
            f"t{i}", "on-gpu", "1", now_ms() + 60_000, "nowhere",
            PayloadRef("inline", data=b"x", size_bytes=1), "text/plain", now_ms()))
        await cpu_fleet.broker.publish_event({"kind": "demand", "model_id": "on-gpu",
                                              "at": time.time()})
    # Heard first (it wakes a re-score), so that what follows is re-scores that knew of it.
    await eventually(lambda: "on-gpu" in cpu_fleet.coordinator._demand, 10,
                     what="the CUDA model's demand reaching the worker")
    for _ in range(20):  # many re-scores (every 0.05 s)
        await asyncio.sleep(0.05)
        assert "on-gpu" not in cpu_fleet.coordinator.state()["subscriptions"]
    assert (await cpu_fleet.broker.queue_stats(["on-gpu"]))["on-gpu"].backlog == 3
    assert cpu_fleet.coordinator.state()["gpus"] == 0


async def test_a_cuda_model_on_a_cpu_only_fleet_is_refused_at_once(cpu_fleet: Fleet) -> None:
    started = time.monotonic()
    with pytest.raises(NoCapacity, match=r"'on-gpu' needs a CUDA device.*no live worker"):
        await _infer(cpu_fleet, "on-gpu")
    assert time.monotonic() - started < 5  # answered, not left queued to its 20 s deadline
    stats = await cpu_fleet.broker.queue_stats(["on-gpu"])
    assert "on-gpu" not in stats or stats["on-gpu"].backlog == 0  # nothing was queued


async def test_a_worker_with_a_device_pulls_the_cuda_model(gpu_fleet: Fleet) -> None:
    assert gpu_fleet.gateway.fleet.has_gpu_worker()
    assert await _infer(gpu_fleet, "on-gpu") == {"echo": "hi"}
    assert "on-gpu" in gpu_fleet.coordinator.state()["subscriptions"]
    assert await _infer(gpu_fleet, "on-cpu") == {"echo": "hi"}  # CPU models too
