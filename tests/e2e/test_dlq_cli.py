"""``modelfleet dlq`` as real subprocesses against a real RabbitMQ.

Dead letters are made the way production makes them: RabbitMQ itself dead-letters a
task whose consumers keep handing it back (``delivery_limit``), and a worker
dead-letters the ones a runtime crashed on. The dead-letter queue is shared by
everything on this vhost, so the archiver may also take in other dead letters: every
check here looks only at this run's request ids and this run's model id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from modelfleet.broker.base import Broker
from modelfleet.messages import EncodedReply, PayloadRef, Reply, Task, now_ms
from modelfleet.settings import BrokerSettings
from tests.conftest import own_deployment, rabbitmq_url, require_rabbitmq
from tests.procs import ROOT

pytestmark = pytest.mark.rabbitmq
DELIVERY_LIMIT = 1
IDLE_EXPIRY_S = 120


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    require_rabbitmq()
    return {
        "MODELFLEET_BROKER": rabbitmq_url(),
        # A queue prefix of our own, and queue arguments every process here agrees on.
        **own_deployment(f"dlq{uuid.uuid4().hex[:8]}"),
        "MODELFLEET_BROKER__DELIVERY_LIMIT": str(DELIVERY_LIMIT),
        "MODELFLEET_BROKER__QUEUE_IDLE_EXPIRY_S": str(IDLE_EXPIRY_S),
        "MODELFLEET_DLQ_DB": str(tmp_path / "dlq.sqlite3"),
        "MODELFLEET_LOG_LEVEL": "warning",
    }


@pytest.fixture
async def broker(env: dict[str, str]) -> AsyncIterator[Broker]:
    from modelfleet.broker.rabbitmq.broker import AmqpBroker

    b = AmqpBroker(BrokerSettings(url=rabbitmq_url(), delivery_limit=DELIVERY_LIMIT,
                                  queue_idle_expiry_s=IDLE_EXPIRY_S,
                                  queue_prefix=env["MODELFLEET_BROKER__QUEUE_PREFIX"]))
    await b.connect()
    yield b
    await b.close()


async def dlq(env: dict[str, str], *args: str, timeout_s: float = 60) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "modelfleet", "dlq", *args, cwd=ROOT, env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def make_task(request_id: str, model_id: str) -> Task:
    start = now_ms()
    return Task(request_id=request_id, model_id=model_id, version="1",
                deadline_ms=start + 15_000, reply_to="inbox.long-gone",
                payload=PayloadRef("inline", b"pixels", size_bytes=6),
                content_type="image/png", enqueued_ms=start, tenant="e2e")


async def make_dead_letters(broker: Broker, model_id: str, ids: dict[str, str]) -> None:
    """``ids``: request id -> how it dies ('delivery_limit', or a worker's reason)."""
    for request_id in ids:
        await broker.publish_task(make_task(request_id, model_id))
    sub = await broker.subscribe(model_id, prefetch=1)
    left = dict(ids)
    iterator = aiter(sub)
    while left:
        delivery = await asyncio.wait_for(anext(iterator), 20)
        reason = left[delivery.task.request_id]
        if reason != "delivery_limit":
            await delivery.dead_letter(reason)
            del left[delivery.task.request_id]
        elif delivery.task.delivery_count >= DELIVERY_LIMIT:
            await delivery.reject(requeue=True)  # one return too many: RabbitMQ gives up
            del left[delivery.task.request_id]
        else:
            await delivery.reject(requeue=True)  # as if its worker died mid-task
    await sub.cancel()


async def answer(broker: Broker, model_id: str, seen: list[str]) -> None:
    """A stand-in worker: reply ok to every task on ``model_id``."""
    sub = await broker.subscribe(model_id, prefetch=4)
    try:
        async for delivery in sub:
            task = delivery.task
            seen.append(task.request_id)
            await broker.publish_reply(task.reply_to, EncodedReply.of(
                Reply(task.request_id, "ok", b"{}", worker_id="e2e-worker")))
            await delivery.ack()
    finally:
        with contextlib.suppress(Exception):
            await sub.cancel()


def ours(out: str, ids: set[str]) -> dict[str, dict[str, object]]:
    records = (json.loads(line) for line in out.splitlines() if line.startswith("{"))
    return {r["request_id"]: r for r in records if r["request_id"] in ids}


async def test_archive_list_and_replay_through_rabbitmq(env: dict[str, str],
                                                        broker: Broker) -> None:
    run = uuid.uuid4().hex[:8]
    model_id = f"dlq-e2e-{run}"
    deaths = {f"{run}-evicted": "delivery_limit",
              f"{run}-restarting": "runtime_crashed: runtime shared-0 is not ready",
              f"{run}-poison": "runtime_crashed: runtime shared-0 is gone: connection closed"}
    await make_dead_letters(broker, model_id, deaths)

    # archive --once drains the dead-letter queue (ours and anyone else's) into the archive.
    code, out = await dlq(env, "archive", "--once", "--idle-s", "3")
    assert code == 0, out
    for request_id in deaths:
        assert f"archived  {request_id}  {model_id}@1" in out, out

    code, out = await dlq(env, "list", "--json", "--model", model_id)
    assert code == 0, out
    records = ours(out, set(deaths))
    assert {k: (r["failure_class"], r["rule"]) for k, r in records.items()} == {
        f"{run}-evicted": ("transient", "consumer-died"),
        f"{run}-restarting": ("transient", "runtime-not-ready"),
        f"{run}-poison": ("deterministic", "poison-input")}
    assert records[f"{run}-evicted"]["death_reason"] == "delivery_limit"
    assert records[f"{run}-evicted"]["delivery_count"] == DELIVERY_LIMIT + 1

    # Deterministic ones are refused without touching the broker.
    code, out = await dlq(env, "replay", "--class", "deterministic", "--model", model_id)
    assert code == 2 and "never replayed automatically" in out, out

    # Transient ones are republished, answered by a stand-in worker, each outcome printed.
    seen: list[str] = []
    worker = asyncio.create_task(answer(broker, model_id, seen))
    try:
        code, out = await dlq(env, "replay", "--class", "transient", "--model", model_id,
                              "--timeout-s", "20")
    finally:
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker
    assert code == 0, out
    for request_id in (f"{run}-evicted", f"{run}-restarting"):
        assert any(line.startswith("ok") and request_id in line and "e2e-worker" in line
                   for line in out.splitlines()), out
    assert sorted(seen) == sorted([f"{run}-evicted", f"{run}-restarting"])
    assert "2 replayed: 2 ok, 0 failed or unanswered" in out

    code, out = await dlq(env, "list", "--json", "--model", model_id)
    assert {k: r["replay_count"] for k, r in ours(out, set(deaths)).items()} == {
        f"{run}-evicted": 1, f"{run}-restarting": 1, f"{run}-poison": 0}

    # A second replay finds nothing new to do.
    code, out = await dlq(env, "replay", "--class", "transient", "--model", model_id)
    assert (code, out.strip()) == (0, "nothing to replay")


async def test_a_running_archiver_stops_cleanly_on_sigterm(env: dict[str, str],
                                                           broker: Broker) -> None:
    run = uuid.uuid4().hex[:8]
    request_id = f"{run}-evicted"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "modelfleet", "dlq", "archive", cwd=ROOT,
        env={**os.environ, **env}, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    try:
        assert proc.stdout is not None
        await make_dead_letters(broker, f"dlq-e2e-{run}", {request_id: "delivery_limit"})
        # It archives what arrives while it runs (other dead letters may come first).
        while request_id not in (line := (await asyncio.wait_for(
                proc.stdout.readline(), 30)).decode()):
            assert line, "the archiver exited early"
        proc.terminate()
        rest = (await asyncio.wait_for(proc.stdout.read(), 30)).decode()
        assert await proc.wait() == 0, rest
        assert "archived, " in rest and "already there, in " in rest
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
