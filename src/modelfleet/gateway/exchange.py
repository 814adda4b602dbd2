"""One inference request's exchange at the gateway, whichever API it came by (/v1, /v2).

What both APIs share: the request is tracked for the drain, its outcome is counted
(``modelfleet_gateway_requests_total``, latency by bounded model label) and logged once
(``RequestObserver``), a caller that hung up is counted as such, a body that came too
slowly is counted as a read timeout, and a bug of ours is still answered (and logged).
Each API supplies what differs: how it reads and sends the request (``run``), how it
writes an answer (``respond``) and an error (``error``, ``internal``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi.responses import Response

from modelfleet import metrics
from modelfleet.errors import ClientGone, ModelfleetError
from modelfleet.gateway.inflight import RequestGuard, RequestTimeout
from modelfleet.gateway.observe import RequestObserver, RequestRecord
from modelfleet.gateway.parking import PARKED_REPLY, PARKED_REQUEST_ID
from modelfleet.gateway.service import Answer, GatewayService
from modelfleet.messages import Reply

log = logging.getLogger("modelfleet.gateway")


@dataclass
class Routed:
    """The version the request is served by, once the route has given it ('' before), and
    its batch size (a v2 request's first dimension; 1 otherwise) for the statistics."""

    version: str
    batch_size: int = 1


async def exchange(service: GatewayService, observer: RequestObserver, model: str,
                   version: str | None, what: str,
                   run: Callable[[RequestGuard, Routed], Awaitable[Answer]],
                   respond: Callable[[Answer], Response],
                   error: Callable[[ModelfleetError], Response],
                   internal: Callable[[str], Response]) -> Response:
    started = time.perf_counter()
    status, outcome, reply = 500, "internal_error", None
    routed = Routed(version or "")
    PARKED_REQUEST_ID.set("")
    PARKED_REPLY.set(None)
    try:
        async with service.requests.track() as guard:
            answer = await run(guard, routed)
        status, outcome, reply = 200, "ok", answer.reply
        return respond(answer)
    except ClientGone as exc:  # nobody reads the answer; counted, not an error of ours
        metrics.CLIENT_DISCONNECTS.inc()
        response = error(exc)
        status, outcome = response.status_code, exc.code
        log.info("%s for %s: %s", what, model, exc.message)
        return response
    except ModelfleetError as exc:
        response = error(exc)
        status, outcome = response.status_code, exc.code
        reply = PARKED_REPLY.get()  # a worker's failure reply, when one came
        if isinstance(exc, RequestTimeout):
            metrics.READ_TIMEOUTS.labels("body").inc()
        return response
    except Exception as exc:  # a bug of ours: still an error the caller can read, and logged
        log.exception("%s for %s failed", what, model)
        return internal(f"internal error: {type(exc).__name__}")
    finally:
        record_exchange(service, observer, model, routed.version, status, outcome, reply, started,
                routed.batch_size)


def answer_headers(answer: Answer) -> dict[str, str]:
    """What every answer tells its caller: who answered, whether it was cold, the phases."""
    reply = answer.reply
    return {"X-Worker-Id": reply.worker_id, "X-Model-Cold": "1" if reply.cold else "0",
            "Server-Timing": ", ".join(f"{k};dur={v:.2f}" for k, v in reply.timings_ms.items())}


def record_exchange(service: GatewayService, observer: RequestObserver, model: str, version: str,
            status: int, outcome: str, reply: Reply | None, started: float,
            batch_size: int = 1) -> None:
    known = model if model in service.catalog else "(unknown)"
    label = observer.label(known)  # the first N models, then "other"
    seconds = time.perf_counter() - started
    metrics.REQUESTS.labels(label, str(status)).inc()
    metrics.REQUEST_SECONDS.labels(label).observe(seconds)
    if known == model and version:  # the statistics extension: models the catalog has
        service.statistics.record(model, version, status == 200, seconds,
                                  dict(reply.timings_ms) if reply is not None else {},
                                  batch_size)
    observer.record(RequestRecord(PARKED_REQUEST_ID.get(), known, version, status, outcome,
                                  seconds, reply))
