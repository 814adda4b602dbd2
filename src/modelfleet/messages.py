"""Task and Reply, the two messages that cross the broker, and their msgpack codec.

A Task is small: payload bytes ride inline only below a threshold; larger ones stay
on the gateway that received them and travel as a signed URL (``PayloadRef``).
Events (worker state, model demand) are plain msgpack maps with a ``kind`` key.

Each message is encoded once, by whoever makes it, and decoded once by each process
that reads it (README, "one encode per hop"): a Task is encoded by the gateway and
its bytes travel unchanged to the runtime (``Delivery.body``); a Reply is encoded by
the runtime, stamped with what the worker adds (worker id, queue wait, given to it
with the task), and its bytes (``EncodedReply``) cross the coordinator and the
broker to the gateway, the one place that decodes it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import msgpack

from modelfleet.errors import ModelfleetError

PayloadKind = Literal["inline", "gateway", "url"]
ReplyStatus = Literal["ok", "error"]
PHASES = ("queue_wait", "payload_fetch", "model_load", "preprocess", "predict", "postprocess")


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class PayloadRef:
    """Where the request's bytes are: inline, on the receiving gateway, or at the caller's URL."""

    kind: PayloadKind
    data: bytes = b""
    url: str = ""
    size_bytes: int = 0


@dataclass(frozen=True)
class Task:
    request_id: str
    model_id: str
    version: str
    deadline_ms: int
    reply_to: str
    payload: PayloadRef
    content_type: str
    enqueued_ms: int
    tenant: str = "default"
    plan: str = "free"
    params: dict[str, str] = field(default_factory=dict)
    delivery_count: int = 0  # set by the broker on receipt; 0 on first delivery
    # Crash evidence, carried by the task from one delivery to the next: runtime crashes
    # it was in flight for, those of them it was alone on the runtime for, and those the
    # runtime's flight record cleared it of (its model's code was not running: ipc/flight.py).
    crashes: int = 0
    crashes_alone: int = 0
    crashes_cleared: int = 0

    @property
    def suspect(self) -> bool:
        """Was it on a runtime that crashed (and not cleared by its flight record), or with
        a consumer that died? (runs alone, in quarantine)"""
        return self.delivery_count > 0 or self.crashes > self.crashes_cleared

    def expired(self, at_ms: int | None = None) -> bool:
        return (now_ms() if at_ms is None else at_ms) >= self.deadline_ms

    def with_delivery_count(self, count: int) -> Task:
        return replace(self, delivery_count=count)


@dataclass(frozen=True)
class Reply:
    request_id: str
    status: ReplyStatus
    body: bytes = b""
    content_type: str = "application/json"
    error_code: str = ""
    error_message: str = ""
    timings_ms: dict[str, float] = field(default_factory=dict)
    worker_id: str = ""
    cold: bool = False
    # A v2 answer with binary outputs: the length of its JSON header (the gateway's
    # Inference-Header-Content-Length); None for any other body.
    header_length: int | None = None

    @classmethod
    def failure(cls, request_id: str, error: ModelfleetError, worker_id: str = "",
                timings_ms: dict[str, float] | None = None) -> Reply:
        return cls(request_id, "error", error_code=error.code, error_message=error.message,
                   worker_id=worker_id, timings_ms=timings_ms or {})


# The codec packs a message's own fields (``vars``: a shallow view, never mutated here)
# rather than ``dataclasses.asdict``, which deep-copies every field on the warm path.
def encode_task(task: Task) -> bytes:
    data = dict(vars(task))
    del data["delivery_count"]
    data["payload"] = vars(task.payload)
    packed: bytes = msgpack.packb(data, use_bin_type=True)
    return packed


def decode_task(raw: bytes, delivery_count: int = 0) -> Task:
    data = msgpack.unpackb(raw, raw=False)
    data["payload"] = PayloadRef(**data["payload"])
    return Task(**data, delivery_count=delivery_count)


def encode_reply(reply: Reply) -> bytes:
    packed: bytes = msgpack.packb(vars(reply), use_bin_type=True)
    return packed


_REPLY_FIELDS = frozenset(Reply.__dataclass_fields__)


def decode_reply(raw: bytes) -> Reply:
    """A Reply; fields a newer sender added and this version lacks are left out (a
    mixed fleet during a rolling upgrade), and one an older sender lacks takes its
    default."""
    data = msgpack.unpackb(raw, raw=False)
    if not _REPLY_FIELDS.issuperset(data):
        data = {k: v for k, v in data.items() if k in _REPLY_FIELDS}
    return Reply(**data)


@dataclass(frozen=True)
class EncodedReply:
    """A Reply as the bytes its maker encoded, with what a carrier needs to know of it.

    The coordinator and the brokers pass replies on in this form, reading only
    ``request_id`` and ``status`` (for logs and metrics), never the body.
    """

    request_id: str
    status: ReplyStatus
    data: bytes

    @classmethod
    def of(cls, reply: Reply) -> EncodedReply:
        return cls(reply.request_id, reply.status, encode_reply(reply))

    def decode(self) -> Reply:
        return decode_reply(self.data)


def encode_event(event: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(event, use_bin_type=True)
    return packed


def decode_event(raw: bytes) -> dict[str, Any]:
    value = msgpack.unpackb(raw, raw=False)
    if not isinstance(value, dict):
        raise ValueError("event is not a map")
    return value
