"""What the archive keeps about one dead letter, and how a new death updates it.

One record per request id. The archiver is at-least-once (it acks only after
storing), so the same death may arrive twice: ``archived`` then returns the record
unchanged. A *new* death of the same request is one whose task differs from the
stored one; that only happens after a replay (a replay gives the task a fresh
deadline and reply address), and it makes the record deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from modelfleet.dlq.classify import FailureClass, classify
from modelfleet.messages import PayloadKind, Task, decode_task, encode_task


@dataclass(frozen=True)
class DeadLetterRecord:
    request_id: str
    model_id: str
    version: str
    tenant: str
    plan: str
    delivery_count: int  # deliveries of the task when it died
    death_reason: str  # verbatim
    signature: str  # normalised reason; identical failures share it
    failure_class: FailureClass
    rule: str  # the classification rule that decided
    content_type: str
    payload_kind: PayloadKind
    payload_inline: bytes  # the payload itself when it travelled inline
    payload_url: str  # where it was when it did not
    payload_size_bytes: int
    task_bytes: bytes  # the encoded task, as it died: what a replay republishes
    timeout_ms: int  # the original deadline minus enqueue time: a replay gets as long
    first_seen_ms: int  # when the archive first stored it (epoch ms)
    last_seen_ms: int  # when it last died
    deaths: int = 1  # distinct deaths: 1, plus one per death after a replay
    replay_count: int = 0
    replayed_at_ms: int | None = None

    def task(self) -> Task:
        """The task as it died (delivery count 0: it is no longer on any queue)."""
        return decode_task(self.task_bytes)


@dataclass(frozen=True)
class Selection:
    """Which records a query returns, oldest first."""

    failure_class: FailureClass | None = None
    model_id: str | None = None
    request_ids: tuple[str, ...] = ()  # empty: any
    never_replayed: bool = False
    limit: int | None = None


@dataclass(frozen=True)
class SignatureCount:
    """One group of ``modelfleet dlq list --by-signature``."""

    signature: str
    failure_class: FailureClass
    rule: str
    model_id: str
    count: int
    first_seen_ms: int
    last_seen_ms: int


def archived(task: Task, reason: str, at_ms: int,
             previous: DeadLetterRecord | None) -> DeadLetterRecord:
    """The record to store for ``task`` dead-lettered for ``reason``, seen at ``at_ms``.

    ``previous``: what the archive holds for this request id already, if anything.
    """
    task_bytes = encode_task(task)
    if previous is not None and previous.task_bytes == task_bytes:
        return previous  # the same death, delivered again: nothing new to record
    verdict = classify(reason, task, replayed_before=previous is not None
                       and previous.replay_count > 0)
    fresh = DeadLetterRecord(
        request_id=task.request_id, model_id=task.model_id, version=task.version,
        tenant=task.tenant, plan=task.plan, delivery_count=task.delivery_count,
        death_reason=reason, signature=verdict.signature, failure_class=verdict.failure_class,
        rule=verdict.rule, content_type=task.content_type, payload_kind=task.payload.kind,
        payload_inline=task.payload.data if task.payload.kind == "inline" else b"",
        payload_url=task.payload.url, payload_size_bytes=task.payload.size_bytes,
        task_bytes=task_bytes, timeout_ms=max(0, task.deadline_ms - task.enqueued_ms),
        first_seen_ms=at_ms, last_seen_ms=at_ms)
    if previous is None:
        return fresh
    # Died again after a replay: keep its history, take the new death's facts.
    return replace(fresh, first_seen_ms=previous.first_seen_ms, deaths=previous.deaths + 1,
                   replay_count=previous.replay_count, replayed_at_ms=previous.replayed_at_ms)
