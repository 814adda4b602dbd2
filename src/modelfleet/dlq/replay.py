"""Controlled replay of archived dead letters, observable outcome by outcome.

Transient dead letters may be replayed. Deterministic ones never are unless a
person names them one by one (``force`` with explicit request ids): they fail the
same way again, and a poison input takes a runtime (or a worker) down with it.

The original caller is long gone (its deadline passed), so a replayed task gets a
fresh deadline of its original length and a reply address of our own: a replay
inbox that this command opens, so that each outcome is printed as it arrives.
Nobody else waits for those replies. Workers drop a task whose deadline passed
without replying, so we wait no longer than the latest new deadline (plus grace).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from modelfleet.broker.base import Broker, Inbox
from modelfleet.dlq.archive import Archive
from modelfleet.dlq.classify import FailureClass
from modelfleet.dlq.records import DeadLetterRecord, Selection
from modelfleet.errors import BrokerUnavailable, ConfigError
from modelfleet.messages import Task, now_ms
from modelfleet.redaction import redact  # the gateway URL may carry an API key

if TYPE_CHECKING:
    import httpx

DEFAULT_TIMEOUT_MS = 30_000  # when the archived task has no usable original timeout
REPLY_GRACE_MS = 2_000  # a reply may be in flight when its deadline passes

OutcomeStatus = Literal["ok", "error", "no_reply", "sent"]


class ReplayRefused(ConfigError):
    """The replay asked for breaks the rules above; the message says how to ask instead."""

    code = "replay_refused"


@dataclass(frozen=True)
class ReplayRequest:
    failure_class: FailureClass
    model_id: str | None = None
    request_ids: tuple[str, ...] = ()
    limit: int | None = None
    force: bool = False
    include_replayed: bool = False  # also those replayed before (named ids always are)


@dataclass(frozen=True)
class ReplayPlan:
    records: list[DeadLetterRecord]
    skipped: list[tuple[str, str]]  # (request id, why not)


@dataclass(frozen=True)
class ReplayOutcome:
    request_id: str
    model_id: str
    status: OutcomeStatus  # "sent": not waited for (--no-wait)
    error_code: str = ""
    error_message: str = ""
    worker_id: str = ""
    elapsed_ms: int = 0


def check_request(request: ReplayRequest) -> None:
    """Raise ReplayRefused unless the request is one the rules allow."""
    if request.failure_class != "deterministic":
        return
    if not request.force:
        raise ReplayRefused(
            "deterministic dead letters are never replayed automatically: they fail the same "
            "way again, and a poison input crashes the runtime that takes it. Fix the cause, "
            "then replay named ones with --force --request-id ID [--request-id ID ...]")
    if not request.request_ids:
        raise ReplayRefused("--force replays only dead letters named with --request-id: "
                            "list them with 'modelfleet dlq list --class deterministic'")


def plan_replay(archive: Archive, request: ReplayRequest) -> ReplayPlan:
    """What ``request`` would replay, and what it leaves out and why. Reads only."""
    check_request(request)
    records = archive.select(Selection(
        failure_class=request.failure_class, model_id=request.model_id,
        request_ids=request.request_ids, limit=request.limit,
        never_replayed=not request.include_replayed and not request.request_ids))
    skipped: list[tuple[str, str]] = []
    if request.request_ids:
        found = {r.request_id for r in records}
        others = {r.request_id: r for r in archive.select(
            Selection(request_ids=tuple(i for i in request.request_ids if i not in found)))}
        for request_id in request.request_ids:
            if request_id in found:
                continue
            other = others.get(request_id)
            skipped.append((request_id, "not in the archive" if other is None else
                            f"is {other.failure_class}, not {request.failure_class}"))
    kept = []
    for record in records:
        if record.payload_kind == "gateway":
            # The bytes lived on the gateway that took the request; it freed them when the
            # request ended, so a runtime could not fetch them now.
            skipped.append((record.request_id, "its payload was held by the original gateway "
                            "and is gone"))
        else:
            kept.append(record)
    return ReplayPlan(kept, skipped)


def replay_task(record: DeadLetterRecord, at_ms: int, reply_to: str,
                timeout_ms: int | None = None) -> Task:
    """The archived task with a fresh deadline (``timeout_ms``, else its original length)."""
    timeout = timeout_ms or record.timeout_ms or DEFAULT_TIMEOUT_MS
    return replace(record.task(), deadline_ms=at_ms + timeout, enqueued_ms=at_ms,
                   reply_to=reply_to, delivery_count=0)


async def replay(broker: Broker, archive: Archive, plan: ReplayPlan, *,
                 timeout_ms: int | None = None, wait: bool = True,
                 clock_ms: Callable[[], int] = now_ms, grace_ms: int = REPLY_GRACE_MS,
                 on_outcome: Callable[[ReplayOutcome], None] = lambda outcome: None,
                 ) -> list[ReplayOutcome]:
    """Republish the plan's tasks; with ``wait``, collect each reply until the deadlines.

    Without ``wait`` the tasks keep their original reply address, whose gateway no
    longer waits for them: replies are dropped there as late, which is harmless.
    """
    inbox = await broker.open_inbox() if wait else None
    try:
        sent: dict[str, tuple[DeadLetterRecord, int]] = {}
        last_deadline_ms = 0
        for record in plan.records:
            at_ms = clock_ms()
            task = replay_task(record, at_ms, inbox.address if inbox else record.task().reply_to,
                               timeout_ms)
            await broker.republish(task)
            await _announce(broker, task)
            await asyncio.to_thread(archive.mark_replayed, record.request_id, at_ms)
            sent[record.request_id] = (record, at_ms)
            last_deadline_ms = max(last_deadline_ms, task.deadline_ms)
            if inbox is None:
                on_outcome(ReplayOutcome(record.request_id, record.model_id, "sent"))
        if inbox is None:
            return [ReplayOutcome(r.request_id, r.model_id, "sent") for r, _ in sent.values()]
        return await _collect(inbox, sent, last_deadline_ms + grace_ms, clock_ms,
                              on_outcome)
    finally:
        if inbox is not None:
            await inbox.close()


async def _announce(broker: Broker, task: Task) -> None:
    """Tell the workers a task waits in its model's queue, as a gateway does for its
    own: a worker that counted that queue missing asks for it again now
    (broker/missing_queues.py), and one idle takes it without waiting for its next
    full count. Without a count and marked ``requeued`` (no gateway counts it), so that
    workers count the queue exactly."""
    with contextlib.suppress(BrokerUnavailable):
        await broker.publish_event({"kind": "demand", "model_id": task.model_id,
                                    "at": time.time(), "requeued": True})


async def _collect(inbox: Inbox, sent: dict[str, tuple[DeadLetterRecord, int]],
                   until_ms: int, clock_ms: Callable[[], int],
                   on_outcome: Callable[[ReplayOutcome], None]) -> list[ReplayOutcome]:
    outcomes: list[ReplayOutcome] = []
    waiting = dict(sent)
    if waiting:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, (until_ms - clock_ms()) / 1000)):
                async for reply in inbox:
                    entry = waiting.pop(reply.request_id, None)
                    if entry is None:
                        continue  # a duplicate reply, or not one of ours
                    record, at_ms = entry
                    outcome = ReplayOutcome(reply.request_id, record.model_id, reply.status,
                                            reply.error_code, reply.error_message,
                                            reply.worker_id, clock_ms() - at_ms)
                    outcomes.append(outcome)
                    on_outcome(outcome)
                    if not waiting:
                        break
    for record, _ in waiting.values():
        outcome = ReplayOutcome(record.request_id, record.model_id, "no_reply")
        outcomes.append(outcome)
        on_outcome(outcome)
    return outcomes


async def replay_through_gateway(base_url: str, archive: Archive, plan: ReplayPlan, *,
                                 timeout_ms: int | None = None,
                                 clock_ms: Callable[[], int] = now_ms,
                                 on_outcome: Callable[[ReplayOutcome], None]
                                 = lambda outcome: None) -> list[ReplayOutcome]:
    """Send the plan's requests again through a gateway's HTTP API, one at a time.

    What ``modelfleet serve`` on its embedded broker needs (no broker is reachable from
    outside that process), and what works against any deployment: the request goes in
    as a caller's would, to the version that died (``/v1/models/M/versions/V/infer``),
    with the payload it had (inline bytes, or its URL as ``{"url": ...}``).
    """
    import httpx  # here, not at import: serve imports this module, and httpx's CLI with it

    outcomes = []
    async with httpx.AsyncClient(base_url=base_url.rstrip("/")) as client:
        for record in plan.records:
            timeout_s = (timeout_ms or record.timeout_ms or DEFAULT_TIMEOUT_MS) / 1000
            if record.payload_kind == "url":
                body = json.dumps({"url": record.payload_url}).encode()
                content_type = "application/json"
            else:
                body, content_type = record.payload_inline, record.content_type
            at_ms = clock_ms()
            await asyncio.to_thread(archive.mark_replayed, record.request_id, at_ms)
            try:
                response = await client.post(
                    f"/v1/models/{record.model_id}/versions/{record.version}/infer",
                    content=body, timeout=timeout_s + 5,
                    headers={"content-type": content_type,
                             "x-request-timeout": f"{timeout_s:.3f}"})
            except httpx.HTTPError as exc:
                outcome = ReplayOutcome(record.request_id, record.model_id, "error",
                                        "gateway_unreachable", redact(f"{base_url}: {exc!r}"))
            else:
                outcome = _http_outcome(record, response, clock_ms() - at_ms)
            outcomes.append(outcome)
            on_outcome(outcome)
    return outcomes


def _http_outcome(record: DeadLetterRecord, response: httpx.Response,
                  elapsed_ms: int) -> ReplayOutcome:
    if response.status_code == 200:
        return ReplayOutcome(record.request_id, record.model_id, "ok", elapsed_ms=elapsed_ms)
    try:
        error = response.json()["error"]
        code, message = str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        code, message = f"http_{response.status_code}", response.text[:200]
    return ReplayOutcome(record.request_id, record.model_id, "error", code, message,
                         elapsed_ms=elapsed_ms)
