"""What one inference request is, resolved once, and what came of it, as values.

The HTTP handler (/v1, /v2) and the gRPC servicer resolve a request once
(``GatewayService.resolve``): the model is looked up in the catalog once, its route
computed once (``ControlPlane.route_of``: the route records stickiness, so a second
call could name another version), the caller's tenant read once, the deadline fixed
once. The ``Resolved`` value is what the service puts in the task, what the log line
and the statistics name and what the meter bills: all see the same version.

``GatewayService.infer`` returns an ``Outcome``: the worker's reply (status, body,
timings, cold, a v2 answer's header length, each a field of the reply frame) with the
plan it ran under. A failure the gateway itself decides before any reply (no capacity,
the deadline, a caller that hung up) is raised, as a ``ModelfleetError``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from modelfleet.errors import ModelfleetError, RequestRejected, error_from_code
from modelfleet.messages import Reply
from modelfleet.repository.manifest import Manifest

_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")


@dataclass(frozen=True)
class Resolved:
    """One request's plan: which model and version serve it, for whom, until when."""

    request_id: str
    model_id: str
    asked_version: str | None  # the version the caller named (None: the route's)
    manifest: Manifest  # the version it gets
    tenant: str  # the caller's tenant and plan (auth off: the model owner's)
    plan: str
    priority: int  # the caller's plan priority (0 with auth off)
    deadline_ms: int
    batch_size: int = 1  # a v2 request's first dimension, for the statistics

    @property
    def version(self) -> str:
        return self.manifest.version


@dataclass(frozen=True)
class Outcome:
    """What the fleet answered one request: the worker's reply, under ``resolved``."""

    resolved: Resolved
    reply: Reply

    @property
    def ok(self) -> bool:
        return self.reply.status == "ok"

    @property
    def error(self) -> ModelfleetError | None:
        """The worker's failure, as the error it names; None for an answer."""
        if self.ok:
            return None
        return error_from_code(self.reply.error_code, self.reply.error_message)

    @property
    def body(self) -> bytes:
        return self.reply.body

    @property
    def content_type(self) -> str:
        return self.reply.content_type

    @property
    def header_length(self) -> int | None:
        return self.reply.header_length

    @property
    def timings_ms(self) -> dict[str, float]:
        return self.reply.timings_ms

    @property
    def cold(self) -> bool:
        return self.reply.cold

    @property
    def worker_id(self) -> str:
        return self.reply.worker_id


def timeout_header(value: str | None) -> float | None:
    """The seconds of an ``X-Request-Timeout`` header (None without one).

    Plain decimals only: float() also takes "1_0", "1e3", "inf", "+5", " 5 "."""
    if value is None:
        return None
    asked = float(value) if _DECIMAL.fullmatch(value) else 0.0
    if not asked > 0:
        raise RequestRejected(
            "X-Request-Timeout must be a positive decimal number of seconds "
            f"(like 2.5), got {value!r}")
    return asked
