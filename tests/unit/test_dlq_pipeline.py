"""The archiver and replay against the embedded broker, with a SQLite archive."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from modelfleet.broker.embedded import MemoryBroker
from modelfleet.dlq.archive import Archive, ArchiveUnavailable, open_archive
from modelfleet.dlq.consumer import archive_dead_letters
from modelfleet.dlq.records import DeadLetterRecord, Selection, SignatureCount
from modelfleet.dlq.replay import (
    ReplayOutcome,
    ReplayRefused,
    ReplayRequest,
    plan_replay,
    replay,
)
from modelfleet.messages import EncodedReply, PayloadKind, PayloadRef, Reply, Task, now_ms
from modelfleet.settings import BrokerSettings

IDLE_S = 0.05
LIMIT = 1  # the embedded broker's delivery limit in these tests


def make_task(request_id: str, model_id: str = "digits", kind: PayloadKind = "inline",
              timeout_ms: int = 20_000) -> Task:
    payload = PayloadRef("inline", b"pixels", size_bytes=6) if kind == "inline" else \
        PayloadRef(kind, url=f"http://gw1:8000/payloads/{request_id}?sig=x", size_bytes=900_000)
    start = now_ms() - 60_000  # its deadline passed long ago, as a dead letter's has
    return Task(request_id=request_id, model_id=model_id, version="1",
                deadline_ms=start + timeout_ms, reply_to="inbox.gone", payload=payload,
                content_type="image/png", enqueued_ms=start)


@pytest.fixture
async def broker() -> AsyncIterator[MemoryBroker]:
    b = MemoryBroker(BrokerSettings(delivery_limit=LIMIT))
    await b.connect()
    yield b
    await b.close()


@pytest.fixture
def archive(tmp_path: Path) -> Iterator[Archive]:
    opened = open_archive(str(tmp_path / "dlq.sqlite3"))
    yield opened
    opened.close()


async def dead_letter(broker: MemoryBroker, task: Task, reason: str) -> None:
    """Publish ``task`` and have a worker dead-letter it (``delivery_limit``: by rejecting
    it past the limit, as RabbitMQ does when consumers keep dying)."""
    await broker.publish_task(task)
    sub = await broker.subscribe(task.model_id, prefetch=1)
    async for delivery in sub:
        if reason != "delivery_limit":
            await delivery.dead_letter(reason)
            break
        last = delivery.task.delivery_count >= LIMIT
        await delivery.reject(requeue=True)
        if last:
            break
    await sub.cancel()


async def drain(broker: MemoryBroker, archive: Archive) -> tuple[int, int]:
    stats = await archive_dead_letters(broker, archive, asyncio.Event(), idle_s=IDLE_S)
    return stats.archived, stats.duplicates


async def test_archive_then_list(broker: MemoryBroker, archive: Archive) -> None:
    await dead_letter(broker, make_task("t1"), "delivery_limit")
    await dead_letter(broker, make_task("d1"), "runtime_crashed: runtime shared-0 is gone: x")
    await dead_letter(broker, make_task("d2", "iris"), "invalid_input: empty image")
    assert await drain(broker, archive) == (3, 0)
    records = {r.request_id: r for r in archive.select(Selection())}
    assert {k: (r.failure_class, r.rule, r.delivery_count) for k, r in records.items()} == {
        "t1": ("transient", "consumer-died", 2),
        "d1": ("deterministic", "poison-input", 0),
        "d2": ("deterministic", "bad-input", 0)}
    assert records["t1"].death_reason == "delivery_limit"
    assert records["d1"].signature == "runtime_crashed: runtime shared-<n> is gone: x"
    assert records["t1"].timeout_ms == 20_000
    # Everything was acked: a second drain finds nothing.
    assert await drain(broker, archive) == (0, 0)


async def test_re_archiving_the_same_death_changes_nothing(broker: MemoryBroker,
                                                           archive: Archive) -> None:
    task = make_task("t1")
    await dead_letter(broker, task, "delivery_limit")
    assert await drain(broker, archive) == (1, 0)
    first = archive.get("t1")
    # The archiver crashed after storing, before acking: the broker delivers it again.
    await dead_letter(broker, task, "delivery_limit")
    assert await drain(broker, archive) == (0, 1)
    assert archive.get("t1") == first


async def test_a_replayed_task_that_dies_again_becomes_deterministic(
        broker: MemoryBroker, archive: Archive) -> None:
    await dead_letter(broker, make_task("t1"), "delivery_limit")
    await drain(broker, archive)
    plan = plan_replay(archive, ReplayRequest("transient"))
    await replay(broker, archive, plan, wait=False)
    # The replayed task kills its consumers again.
    sub = await broker.subscribe("digits", prefetch=1)
    async for delivery in sub:
        await delivery.dead_letter("delivery_limit")
        break
    await sub.cancel()
    assert await drain(broker, archive) == (1, 0)
    again = archive.get("t1")
    assert again is not None
    assert (again.failure_class, again.rule, again.deaths, again.replay_count) == \
        ("deterministic", "died-after-replay", 2, 1)
    assert plan_replay(archive, ReplayRequest("transient")).records == []


async def test_stop_ends_a_running_archiver_and_leaves_the_rest_queued(
        broker: MemoryBroker, archive: Archive) -> None:
    stop = asyncio.Event()
    seen: list[str] = []

    def on_record(record: object, new: bool) -> None:
        seen.append(getattr(record, "request_id", ""))
        stop.set()  # ask to stop while more dead letters are queued

    for i in range(5):
        await dead_letter(broker, make_task(f"t{i}"), "delivery_limit")
    stats = await asyncio.wait_for(
        archive_dead_letters(broker, archive, stop, on_record=on_record), 5)
    assert stats.archived == len(seen) < 5
    assert await drain(broker, archive) == (5 - len(seen), 0)  # nothing lost, nothing twice


async def fake_worker(broker: MemoryBroker, model_id: str, status: str) -> None:
    """Answer every task on ``model_id`` with ``status``, as a worker would."""
    sub = await broker.subscribe(model_id, prefetch=4)
    try:
        async for delivery in sub:
            task = delivery.task
            assert task.delivery_count == 0 and not task.expired()
            reply = Reply(task.request_id, "ok", b"{}", worker_id="w1") if status == "ok" \
                else Reply(task.request_id, "error", error_code="model_error",
                           error_message="boom", worker_id="w1")
            await broker.publish_reply(task.reply_to, EncodedReply.of(reply))
            await delivery.ack()
    finally:
        await sub.cancel()


@contextlib.asynccontextmanager
async def workers(broker: MemoryBroker, **status_by_model: str) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(fake_worker(broker, m, s)) for m, s in status_by_model.items()]
    await asyncio.sleep(0)
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_replay_republishes_transient_only_and_reports_each_outcome(
        broker: MemoryBroker, archive: Archive) -> None:
    await dead_letter(broker, make_task("t1"), "delivery_limit")
    await dead_letter(broker, make_task("t2", "iris"), "runtime_crashed: runtime a is not ready")
    await dead_letter(broker, make_task("d1"), "runtime_crashed: runtime a is gone: boom")
    await drain(broker, archive)
    seen: list[ReplayOutcome] = []
    plan = plan_replay(archive, ReplayRequest("transient"))
    assert [r.request_id for r in plan.records] == ["t1", "t2"]
    async with workers(broker, digits="ok", iris="error"):
        outcomes = await asyncio.wait_for(
            replay(broker, archive, plan, on_outcome=seen.append), 5)
    assert sorted((o.request_id, o.status, o.error_code) for o in outcomes) == [
        ("t1", "ok", ""), ("t2", "error", "model_error")]
    assert seen == outcomes
    replayed = {r.request_id: r.replay_count for r in archive.select(Selection())}
    assert replayed == {"t1": 1, "t2": 1, "d1": 0}
    # Already replayed: a second run has nothing left, unless asked.
    assert plan_replay(archive, ReplayRequest("transient")).records == []
    assert len(plan_replay(archive, ReplayRequest("transient", include_replayed=True,
                                                  model_id="iris")).records) == 1


async def test_a_replay_without_an_answer_is_reported_once_its_deadline_passes(
        broker: MemoryBroker, archive: Archive) -> None:
    await dead_letter(broker, make_task("t1"), "delivery_limit")
    await drain(broker, archive)
    plan = plan_replay(archive, ReplayRequest("transient"))
    # Nobody consumes 'digits'; its new 50 ms deadline bounds the wait.
    outcomes = await asyncio.wait_for(
        replay(broker, archive, plan, timeout_ms=50, grace_ms=0), 10)
    assert [(o.request_id, o.status) for o in outcomes] == [("t1", "no_reply")]
    stats = await broker.queue_stats(["digits"])
    assert stats["digits"].backlog == 1  # it was republished all the same


async def test_deterministic_replay_is_refused_unless_forced_by_name(
        broker: MemoryBroker, archive: Archive) -> None:
    await dead_letter(broker, make_task("d1"), "runtime_crashed: runtime a is gone: boom")
    await dead_letter(broker, make_task("d2"), "runtime_crashed: runtime a is gone: boom")
    await dead_letter(broker, make_task("t1"), "delivery_limit")
    await drain(broker, archive)
    with pytest.raises(ReplayRefused, match="never replayed automatically"):
        plan_replay(archive, ReplayRequest("deterministic"))
    with pytest.raises(ReplayRefused, match="--request-id"):
        plan_replay(archive, ReplayRequest("deterministic", force=True))
    plan = plan_replay(archive, ReplayRequest("deterministic", force=True,
                                              request_ids=("d2", "t1", "nope")))
    assert [r.request_id for r in plan.records] == ["d2"]
    assert sorted(plan.skipped) == [("nope", "not in the archive"),
                                    ("t1", "is transient, not deterministic")]
    async with workers(broker, digits="ok"):
        outcomes = await asyncio.wait_for(replay(broker, archive, plan), 5)
    assert [(o.request_id, o.status) for o in outcomes] == [("d2", "ok")]


async def test_tasks_whose_payload_stayed_on_the_gateway_are_not_replayed(
        broker: MemoryBroker, archive: Archive) -> None:
    await dead_letter(broker, make_task("g1", kind="gateway"), "delivery_limit")
    await dead_letter(broker, make_task("u1", kind="url"), "delivery_limit")
    await drain(broker, archive)
    plan = plan_replay(archive, ReplayRequest("transient"))
    assert [r.request_id for r in plan.records] == ["u1"]
    assert [request_id for request_id, _ in plan.skipped] == ["g1"]
    kept = archive.get("u1")
    assert kept is not None and kept.payload_url.startswith("http://gw1:8000/")


async def test_a_replayed_task_gets_a_fresh_deadline_of_its_original_length(
        broker: MemoryBroker, archive: Archive) -> None:
    await dead_letter(broker, make_task("t1", timeout_ms=7_000), "delivery_limit")
    await drain(broker, archive)
    before = now_ms()
    await replay(broker, archive, plan_replay(archive, ReplayRequest("transient")), wait=False)
    sub = await broker.subscribe("digits", prefetch=1)
    async for delivery in sub:
        task = delivery.task
        await delivery.ack()
        break
    await sub.cancel()
    assert task.reply_to == "inbox.gone"  # --no-wait keeps the original address
    assert task.delivery_count == 0
    assert before <= task.enqueued_ms and task.deadline_ms - task.enqueued_ms == 7_000
    assert task.payload == make_task("t1").payload


class BrokenArchive:
    """Reads work, writes fail: the database went away mid-run."""

    def __init__(self, inner: Archive) -> None:
        self.inner = inner
        self.location = inner.location

    def get(self, request_id: str) -> DeadLetterRecord | None:
        return self.inner.get(request_id)

    def put(self, record: DeadLetterRecord) -> None:
        raise ArchiveUnavailable("disk I/O error")

    def select(self, selection: Selection) -> list[DeadLetterRecord]:
        return self.inner.select(selection)

    def signature_counts(self, selection: Selection) -> list[SignatureCount]:
        return self.inner.signature_counts(selection)

    def mark_replayed(self, request_id: str, at_ms: int) -> None:
        self.inner.mark_replayed(request_id, at_ms)

    def close(self) -> None:
        self.inner.close()


async def test_an_archive_failure_stops_the_archiver_without_acking(
        broker: MemoryBroker, archive: Archive) -> None:
    await dead_letter(broker, make_task("t1"), "delivery_limit")
    seen: list[object] = []
    with pytest.raises(ArchiveUnavailable, match="disk I/O"):
        await archive_dead_letters(broker, BrokenArchive(archive), asyncio.Event(),
                                   idle_s=IDLE_S, on_record=lambda r, new: seen.append(r))
    assert seen == []
    assert archive.get("t1") is None
